"""Replicas sharded over devices and hosts, with a real low-bit wire format.

The library simulates the M replicas on one device: every replica leaf of the state and
every batch leaf has a leading axis M, and the inner step is vmapped over it. This
module runs **the same `init` and `step`** with that axis sharded over a mesh axis
`"replica"` spanning the devices of one process or of many (JAX's multi-controller
runtime, `jax.distributed`): nothing is re-implemented, only placed.

- `replica_mesh(M)` builds the mesh; `shard_state` / `shard_batch` place the state and
  the batch (replica leaves `P("replica")`, everything else replicated); `sharded_step`
  jits a step so that the state keeps that layout from step to step.
- `sharded_exchange(mesh)` is the `exchange` hook of `streaming_diloco`: instead of
  averaging a `[M, ...]` array on one device, every replica quantizes **its own** Δ,
  packs the codes (two 4-bit codes per byte) and the float32 group scales into one
  `uint8` message per fragment, the replicas `all_gather` those bytes, and each one
  dequantizes all M messages and averages them in float32 locally (Streaming DiLoCo
  §2.4: "the accumulation is done in FP32"). The bytes on the wire are the bits of
  `Algorithm.bits_per_fragment` (within half a byte of padding).
- Data-Parallel needs nothing special: with the batch sharded and the parameters
  replicated, XLA turns its mean of the per-replica gradients into an all-reduce.

Numerics, compared with the vmapped simulation (`tests/test_distributed.py`):

- the exchange is exact by construction: the same quantizer on the same values with the
  same PRNG keys, integer codes and scales moved verbatim, so what every replica
  reconstructs of every message is bitwise the simulation's; the mean is the same
  `communication.average` (`jnp.mean` over `[M, ...]`), which XLA may fuse with another
  summation order, so it agrees to within `M · eps · mean|x|` (bitwise when XLA picks
  the same order, as it does for whole-tensor scales in the tests);
- a whole step is not bitwise: XLA:CPU compiles the per-device program (an
  `[M/D, ...]` slice of the replica axis; a size-1 axis is squeezed away) with other dot
  kernels and operand layouts than the `[M, ...]` program, so the inner step differs
  by float32 rounding (a few ulp per step; measured ≤ 1e-7 after 10 steps of the
  toy model, 4e-5 after 6 steps of a 6-layer transformer, where Adam's normalisation
  amplifies ulp-level gradient differences). A quantization code can then differ where a
  value sits within that distance of a rounding boundary;
- the global parameters and the outer optimizer are replicated computations; two
  processes give bitwise the results of one process with the same devices per replica.

This differs from a production setup in:
1. The exchange is an all-gather followed by a local mean, not an all-reduce: it is
   the only way to average low-bit codes without re-quantizing partial sums, and every
   replica averages exactly the values the simulation averages. Each replica receives
   `M - 1` messages, so for large M a reduce-scatter of dequantized values would move
   fewer bytes.
2. Value-dropping compressors (`dare`, `top_k`, `fed_dropout`) and `compressor=None`
   send their dense reconstruction (the wide dtype, 32 bits per element), not a sparse
   encoding: their `bits_per_fragment` describes an ideal wire, not this one.
3. Only fragments selected by the `sent` mask travel when the caller passes it; a
   caller that does not (the plain 4-argument hook) exchanges every fragment at each
   sync, P times the bytes of one fragment.
"""

import dataclasses
import functools as ft
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, PRNGKeyArray, UInt8

from .. import communication
from ..compression import Compressor, Quantized, Quantizer
from ..custom_types import Batch
from ..data_parallel import DataParallelState
from ..fragments import Fragments
from ..streaming import StreamingState


AXIS = "replica"
"""Name of the mesh axis the replicas are sharded over."""

_REPLICA_FIELDS = {
    StreamingState: ("replica_params", "inner_state", "residual"),
    DataParallelState: (),
}


def replica_mesh(num_replicas: int, devices: Any = None) -> Mesh:
    """A one-axis mesh `("replica",)` over `devices`, for M replicas.

    Every device holds `M / len(devices)` replicas. The axis type is `Auto` (classic
    sharding propagation), so the unchanged library code, written for a leading M axis,
    is partitioned by XLA; only the exchange is written per replica (`shard_map`).
    Devices are ordered by process, so each process owns a contiguous block of
    replicas (see `process_replicas`).

    On a cluster, use one replica per island (host or slice) and pass the devices that
    carry the replica axis; devices inside a replica could carry a second mesh axis for
    data or FSDP sharding of the inner step (not built here).

    Args:
        num_replicas: M >= 1; must be a multiple of the number of devices.
        devices: the devices of the axis; default every global device
            (`jax.devices()`, all processes).

    Returns:
        The mesh.

    Raises:
        ValueError: if M is not a positive multiple of the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    if (
        not isinstance(num_replicas, int)
        or num_replicas < 1
        or num_replicas % len(devices)
    ):
        raise ValueError(
            f"num_replicas (M)={num_replicas!r} must be a positive multiple of the "
            f"number of devices {len(devices)}; pass devices=... to use fewer."
        )
    return Mesh(np.array(devices), (AXIS,), axis_types=(AxisType.Auto,))


def process_replicas(mesh: Mesh, num_replicas: int) -> list[int]:
    """The replicas whose data this process feeds (held by its addressable devices).

    Examples:
        >>> mesh = replica_mesh(4, jax.devices()[:1])
        >>> process_replicas(mesh, 4)
        [0, 1, 2, 3]
    """
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    index = sharding.addressable_devices_indices_map((num_replicas,))
    out = set()
    for (s,) in index.values():
        out.update(range(*s.indices(num_replicas)))
    return sorted(out)


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """The sharding of every array leaf of a state: `P("replica")` or replicated.

    Replica leaves (`replica_params`, `inner_state`, `residual` of a
    `StreamingState`) are split along their leading axis M; everything else
    (θ_g, the outer state, the in-flight buffer, step counters, a `DataParallelState`)
    is replicated on every device.

    Raises:
        ValueError: for a state type other than `StreamingState` / `DataParallelState`.
    """
    fields = _REPLICA_FIELDS.get(type(state))
    if fields is None:
        raise ValueError(
            f"state of type {type(state).__name__} is not supported; allowed: "
            f"{[t.__name__ for t in _REPLICA_FIELDS]}."
        )
    split = NamedSharding(mesh, PartitionSpec(AXIS))
    whole = NamedSharding(mesh, PartitionSpec())
    return type(state)(
        *(
            jax.tree.map(
                lambda x, s=(split if name in fields else whole): (
                    s if eqx.is_array(x) else None
                ),
                getattr(state, name),
            )
            for name in state._fields
        )
    )


def shard_state(state: Any, mesh: Mesh) -> Any:
    """Place a state (the same full value on every process) on the mesh.

    Works in one process and across processes: every process calls `alg.init` with
    the same arguments and keeps only the slices its devices hold.
    """
    shardings = state_shardings(state, mesh)
    return jax.tree.map(
        lambda x, s: _global_array(x, s) if eqx.is_array(x) else x,
        state,
        shardings,
        is_leaf=lambda x: x is None,
    )


def shard_batch(batch: Batch, mesh: Mesh, num_replicas: int) -> Batch:
    """Assemble the global `[M, ...]` batch from this process's replicas' batches.

    Args:
        batch: every leaf has a leading axis over `process_replicas(mesh, M)`, in that
            order (in a single process: the whole `[M, ...]` batch).
        mesh: the replica mesh.
        num_replicas: M.

    Returns:
        The batch as global arrays sharded `P("replica")`.
    """
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    local = len(process_replicas(mesh, num_replicas))

    def place(x):
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] != local:
            raise ValueError(
                f"batch leaf of shape {x.shape}: its leading axis must be this "
                f"process's {local} replicas."
            )
        return jax.make_array_from_process_local_data(
            sharding, x, (num_replicas,) + x.shape[1:]
        )

    return jax.tree.map(place, batch)


def sharded_step(step: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """`eqx.filter_jit(step)` that keeps the state's replica sharding on its output.

    Args:
        step: an `Algorithm.step`.
        mesh: the replica mesh.

    Returns:
        The jitted `step(state, batch) -> (state, metrics)` for sharded inputs.
    """

    @eqx.filter_jit
    def run(state, batch):
        new_state, metrics = step(state, batch)
        shardings = state_shardings(new_state, mesh)
        new_state = jax.tree.map(
            lambda x, s: jax.lax.with_sharding_constraint(x, s) if s else x,
            new_state,
            shardings,
            is_leaf=lambda x: x is None,
        )
        return new_state, metrics

    return run


def pack4(codes: UInt8[Array, "*batch n"]) -> UInt8[Array, "*batch half"]:
    """Two 4-bit codes per byte: element `2i` in the low nibble, `2i + 1` in the high.

    An odd count is padded with a zero code. Bits above the low four are dropped.

    Examples:
        >>> pack4(jnp.array([1, 2, 15], jnp.uint8)).tolist()
        [33, 15]
    """
    n = codes.shape[-1]
    codes = codes & jnp.uint8(0x0F)
    if n % 2:
        pad = jnp.zeros(codes.shape[:-1] + (1,), jnp.uint8)
        codes = jnp.concatenate([codes, pad], axis=-1)
    pairs = codes.reshape(codes.shape[:-1] + (-1, 2))
    return pairs[..., 0] | jnp.left_shift(pairs[..., 1], jnp.uint8(4))


def unpack4(packed: UInt8[Array, "*batch half"], n: int) -> UInt8[Array, "*batch n"]:
    """Inverse of `pack4`: the first `n` 4-bit codes.

    Examples:
        >>> unpack4(jnp.array([33, 15], jnp.uint8), 3).tolist()
        [1, 2, 15]
    """
    if not 0 <= n <= 2 * packed.shape[-1]:
        raise ValueError(f"n={n} codes do not fit in {packed.shape[-1]} bytes.")
    lo = packed & jnp.uint8(0x0F)
    hi = jnp.right_shift(packed, jnp.uint8(4))
    both = jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (-1,))
    return both[..., :n]


def sharded_exchange(mesh: Mesh) -> Callable[..., tuple[list[Array], list[Array]]]:
    """The exchange of outer gradients between replicas sharded over `mesh`.

    Pass it as `streaming_diloco(..., exchange=sharded_exchange(mesh))`. It has the
    signature and the results of `communication.simulated_exchange`, plus an optional
    `sent` mask (`[P]` bool): when given, only the fragments it selects are exchanged
    (one `lax.cond` per fragment) and the others come back as zeros.

    Inside `jax.shard_map` over `"replica"`, for each fragment p (Alg. 2, l.7-8):

    1. each replica encodes its own Δ, group by group (a whole leaf, or one row of a
       leaf labelled per row), with the same PRNG keys as `communication.compress`:
       a `Quantizer` gives uint8 codes and float32 amax scales; any other compressor
       (or none) gives its dense reconstruction in the wide dtype;
    2. the message is one `uint8` vector: the codes (two per byte for 4-bit formats,
       one byte for 8-bit formats, the raw bytes of bf16 / fp32 casts and of dense
       values) followed by the scales' float32 bytes;
    3. `all_gather` of the messages over `"replica"`: this is the only collective;
    4. every replica unpacks and dequantizes all M messages and averages them in the
       wide dtype with `jnp.mean` over the replica axis, the simulation's operation.

    Args:
        mesh: the replica mesh (`replica_mesh`).

    Returns:
        `exchange(compressor, fragments, deltas, key, sent=None) -> (mean, own)`:
        `mean` is one replicated `[...]` array per leaf, `own` the `[M, ...]`
        reconstructions, sharded like the deltas (what error feedback subtracts).
    """

    def exchange(
        compressor: Compressor | None,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
        sent: Bool[Array, " P"] | None = None,
    ) -> tuple[list[Array], list[Array]]:
        num_replicas = deltas[0].shape[0]
        if num_replicas % mesh.shape[AXIS]:
            raise ValueError(
                f"M={num_replicas} replicas are not a multiple of the mesh's "
                f"{mesh.shape[AXIS]} devices on axis {AXIS!r}."
            )
        keys = [jr.split(jr.fold_in(key, i), num_replicas) for i in range(len(deltas))]
        wires = [
            _Wire(compressor, fragments, deltas, keys, p)
            for p in range(fragments.num_fragments)
        ]
        local = ft.partial(
            _exchange_local, wires, fragments, num_replicas, sent is None
        )
        split, whole = PartitionSpec(AXIS), PartitionSpec()
        flags = jnp.ones((), bool) if sent is None else sent
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(split, split, whole),
            out_specs=(whole, split),
            check_vma=False,
        )(deltas, keys, flags)

    return exchange


class Collective(NamedTuple):
    """One collective of a compiled program (see `collectives`)."""

    kind: str  # "all-gather", "all-reduce", ...
    dtype: str  # HLO element type, e.g. "u8", "f32"
    shape: tuple[int, ...]  # the result's shape
    group_size: int  # devices taking part
    bytes_per_device: int  # what one device contributes: its operand's bytes
    op_name: str  # the JAX name stack of the op (e.g. ".../sdiloco_fragment_1/...")


_COLLECTIVE = re.compile(
    r"=\s*(?P<result>\([^)]*\)|[a-z]+\d*\[[\d,]*\]\S*)\s+"
    r"(?P<kind>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<shape>[\d,]*)\]")
_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}


def collectives(hlo_text: str) -> list[Collective]:
    """The collectives of a compiled XLA program and the bytes each device sends.

    Args:
        hlo_text: `jax.jit(f).lower(...).compile().as_text()`.

    Returns:
        One `Collective` per array a collective instruction produces (a combined
        all-reduce of a tuple gives one per element; those inside `lax.cond`
        branches are included, whether or not they run). For an all-gather,
        `bytes_per_device` is the result's bytes divided by the group size; for the
        other kinds, the result's bytes.
    """
    out = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        size = _group_size(line)
        name = re.search(r'op_name="([^"]*)"', line)
        for array in _ARRAY.finditer(match["result"]):
            shape = tuple(int(s) for s in array["shape"].split(",") if s)
            nbytes = math.prod(shape) * _ITEMSIZE.get(array["dtype"], 4)
            if match["kind"] == "all-gather":
                nbytes //= size
            out.append(
                Collective(
                    match["kind"],
                    array["dtype"],
                    shape,
                    size,
                    nbytes,
                    name[1] if name else "",
                )
            )
    return out


def wire_bytes(hlo_text: str, num_replicas: int) -> dict[int, int]:
    """Bytes one replica sends to sync each fragment, read off a compiled step.

    Args:
        hlo_text: the compiled program of a step using `sharded_exchange`.
        num_replicas: M.

    Returns:
        `{fragment: bytes of one replica's message}`, from the all-gathers that
        `sharded_exchange` emits (named `sdiloco_fragment_<p>`).
    """
    out = {}
    for c in collectives(hlo_text):
        match = re.search(r"sdiloco_fragment_(\d+)", c.op_name)
        if c.kind == "all-gather" and match:
            out[int(match[1])] = math.prod(c.shape) // num_replicas
    return out


# ----------------------------------------------------------------------------- helpers


def _group_size(line: str) -> int:
    """Devices per replica group of an HLO collective (1 if it cannot be read)."""
    groups = re.search(
        r"replica_groups=(\{\{[\d,]*\}|\[[\d,]*\]|mesh\[[^\]]*\] \{[^}]*\})", line
    )
    if not groups:
        return 1
    text = groups[1]
    if text.startswith("{{"):  # explicit groups: {{0,1,2,3},...}
        return len(text[2:-1].split(","))
    if text.startswith("["):  # iota groups: [num_groups,group_size]<=[...]
        return int(text[1:-1].split(",")[-1])
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", text))  # mesh['a'=4] {'a'}
    used = re.findall(r"'([^']+)'", text.split("{", 1)[1])
    return math.prod(int(sizes[a]) for a in used)


def _global_array(x: Array, sharding: NamedSharding) -> Array:
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


@dataclasses.dataclass(frozen=True)
class _Group:
    """One scaling group of a fragment: a whole leaf, or some rows of a leaf."""

    leaf: int
    rows: np.ndarray | None  # row indices of a leaf labelled per row


class _Wire:
    """The static layout of one fragment's message (built at trace time).

    A message is `codes ++ scales`: every group's codes flattened and concatenated
    (packed two per byte for 4-bit formats, otherwise their raw bytes), then every
    group's float32 scales as raw bytes.
    """

    def __init__(self, compressor, fragments, deltas, keys, p):
        self.compressor = compressor
        self.packed = isinstance(compressor, Quantizer) and (
            compressor.bits_per_element == 4
        )
        self.groups, self.shapes, self.dtypes, self.layout = [], [], [], []
        for i, labels in enumerate(fragments.labels):
            rows = None if labels.ndim == 0 else np.flatnonzero(labels == p)
            if (rows is None and int(labels) != p) or (
                rows is not None and not rows.size
            ):
                continue
            shape, key = deltas[i].shape[1:], keys[i].shape[1:]
            if rows is not None:
                shape, key = (len(rows),) + shape[1:], (len(rows),) + key
            self.groups.append(_Group(i, rows))
            self.shapes.append(shape)
            self.dtypes.append(deltas[i].dtype)
            # Shapes and dtypes of this group's codes and scales, for one replica.
            self.layout.append(
                jax.eval_shape(
                    ft.partial(self._encode_group, rows=rows is not None),
                    jax.ShapeDtypeStruct(shape, deltas[i].dtype),
                    jax.ShapeDtypeStruct(key, keys[i].dtype),
                )
            )
        self.code_sizes = [math.prod(c.shape) for c, _ in self.layout]
        self.code_bytes = [
            n * c.dtype.itemsize for n, (c, _) in zip(self.code_sizes, self.layout)
        ]
        self.scale_sizes = [math.prod(s.shape) for _, s in self.layout]
        total = sum(self.code_sizes)
        self.body_bytes = -(-total // 2) if self.packed else sum(self.code_bytes)

    def _encode_group(self, x, key, *, rows):
        """Codes and float32 scales of one group's tensor (rows vmapped)."""
        c = self.compressor

        def one(x, key):
            if isinstance(c, Quantizer):
                q = c.quantize(x, key)
                return q.codes, q.scale
            y = x if c is None else c(x, key)
            return y, jnp.zeros((0,), jnp.float32)

        return jax.vmap(one)(x, key) if rows else one(x, key)

    def _decode_group(self, codes, scale, shape, dtype, rows):
        """The reconstruction of one group from its codes and scales."""
        c = self.compressor

        def one(codes, scale, shape):
            if isinstance(c, Quantizer):
                return c.dequantize(Quantized(codes, scale), shape, dtype)
            return codes

        if rows:
            return jax.vmap(lambda k, s: one(k, s, shape[1:]))(codes, scale)
        return one(codes, scale, shape)

    def encode(self, deltas: list[Array], keys: list[Array]) -> Array:
        """One replica's message, from its Δ and keys (as `communication.compress`)."""
        codes, scales = [], []
        for g in self.groups:
            x, k = deltas[g.leaf], keys[g.leaf]
            if g.rows is None:
                c, s = self._encode_group(x, k, rows=False)
            else:
                row_keys = jr.split(k, x.shape[0])[g.rows]
                c, s = self._encode_group(x[g.rows], row_keys, rows=True)
            codes.append(c.reshape(-1))
            scales.append(s.reshape(-1))
        if self.packed:
            body = pack4(jnp.concatenate(codes))
        else:
            body = jnp.concatenate([_to_bytes(c) for c in codes])
        return jnp.concatenate([body, _to_bytes(jnp.concatenate(scales))])

    def decode(self, message: Array) -> list[Array]:
        """One replica's reconstruction of every group, from its message."""
        body = message[: self.body_bytes]
        if self.packed:
            parts = _split(unpack4(body, sum(self.code_sizes)), self.code_sizes)
        else:
            parts = _split(body, self.code_bytes)
        scales = _from_bytes(
            message[self.body_bytes :], jnp.float32, (sum(self.scale_sizes),)
        )
        out = []
        for g, part, scale, (c, s), shape, dtype in zip(
            self.groups,
            parts,
            _split(scales, self.scale_sizes),
            self.layout,
            self.shapes,
            self.dtypes,
        ):
            codes = _from_bytes(part, c.dtype, c.shape)
            out.append(
                self._decode_group(
                    codes, scale.reshape(s.shape), shape, dtype, g.rows is not None
                )
            )
        return out


def _exchange_local(wires, fragments, num_replicas, send_all, deltas, keys, sent):
    """Per device: encode local replicas, all-gather, decode all, average (Alg. 2 l.8)."""
    local = deltas[0].shape[0]

    def send(p, deltas, keys):
        wire = wires[p]
        with jax.named_scope(f"sdiloco_fragment_{p}"):
            message = jax.vmap(wire.encode)(deltas, keys)  # [local, bytes]
            messages = jax.lax.all_gather(message, AXIS, axis=0, tiled=True)  # [M, B]
            return jax.vmap(wire.decode)(messages)  # per group [M, ...]

    def skip(p, deltas, keys):
        del deltas, keys
        return [
            jnp.zeros((num_replicas,) + s, d)
            for s, d in zip(wires[p].shapes, wires[p].dtypes)
        ]

    pieces = []
    for p in range(len(wires)):
        if send_all:
            pieces.append(send(p, deltas, keys))
        else:
            pieces.append(
                jax.lax.cond(
                    sent[p], ft.partial(send, p), ft.partial(skip, p), deltas, keys
                )
            )
    recon = _assemble(wires, fragments, pieces)
    mean = communication.average(recon)
    start = jax.lax.axis_index(AXIS) * local
    own = [jax.lax.dynamic_slice_in_dim(r, start, local, axis=0) for r in recon]
    return mean, own


def _assemble(wires, fragments, pieces) -> list[Array]:
    """Per-leaf `[M, ...]` reconstructions from the per-fragment group pieces."""
    whole: dict[int, Array] = {}
    rows: dict[int, list[tuple[np.ndarray, Array]]] = {}
    for wire, parts in zip(wires, pieces):
        for g, x in zip(wire.groups, parts):
            if g.rows is None:
                whole[g.leaf] = x
            else:
                rows.setdefault(g.leaf, []).append((g.rows, x))
    out = []
    for i in range(len(fragments.labels)):
        if i in whole:
            out.append(whole[i])
            continue
        order = np.concatenate([r for r, _ in rows[i]])
        stacked = jnp.concatenate([x for _, x in rows[i]], axis=1)
        if np.array_equal(order, np.arange(order.size)):
            out.append(stacked)
        else:
            out.append(jnp.take(stacked, np.argsort(order), axis=1))
    return out


def _split(x: Array, sizes: list[int]) -> list[Array]:
    offsets = np.cumsum([0] + sizes)
    return [x[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def _to_bytes(x: Array) -> Array:
    x = x.reshape(-1)
    if x.dtype == jnp.uint8:
        return x
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: Array, dtype: Any, shape: tuple[int, ...]) -> Array:
    dtype = jnp.dtype(dtype)
    if dtype == jnp.uint8:
        return b.reshape(shape)
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dtype).reshape(shape)
    return jax.lax.bitcast_convert_type(b.reshape(-1, dtype.itemsize), dtype).reshape(
        shape
    )
