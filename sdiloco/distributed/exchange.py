"""The exchange of outer gradients between replicas sharded over a mesh.

`sharded_exchange(mesh)` is the `exchange` hook of `streaming_diloco`: instead of
averaging a `[M, ...]` array on one device, every replica compresses **its own** Δ,
packs the message its compressor encodes into one `uint8` vector per fragment
(`sdiloco.distributed.wire`: integer fields such as codes and indices at their width,
float fields such as kept values and scales as raw bytes), the replicas `all_gather`
those bytes, and each one decodes all M messages and averages them in float32 locally
(Streaming DiLoCo §2.4: "the accumulation is done in FP32"). The bytes on the wire are
the bits of `Algorithm.bits_per_fragment` (within a byte of padding per field width;
the `hlo` tests of `tests/test_distributed.py` read them off the compiled step): a
4-bit quantizer sends two codes per byte, a chunked top-k its float32 values and 6-bit
positions, a chain the message of its last stage nested in the first's.

On a mesh with a `"data"` axis of D > 1 devices per replica, the D devices of an island
hold the same message; each sends its `1/D` share across `"replica"` and the island
then all-gathers the shares over `"data"` (its fast links), so the slow axis carries
each replica's message once.

Numerics, compared with the vmapped simulation (`tests/test_distributed.py`): the
exchange is exact by construction. The same compressor runs on the same values with
the same PRNG keys, integer fields and float fields move verbatim, and decoding a
message is the compressor's own round trip, so what every replica reconstructs of
every message is bitwise the simulation's. The mean is the same
`aggregation.average`, which sums the `[M, ...]` reconstructions in replica order and
then divides by M: a fixed order, so the mean is bitwise the simulation's as well.

This differs from a production setup in:
1. The exchange is an all-gather followed by a local mean, not an all-reduce: it is
   the only way to average low-bit codes without re-quantizing partial sums, and every
   replica averages exactly the values the simulation averages. Each replica receives
   `M - 1` messages, so for large M a reduce-scatter of dequantized values would move
   fewer bytes.
2. The wire carries what `Compressor.encode` returns, so it is only as compact as the
   message a compressor defines: every compressor of `sdiloco.compression` defines one
   (a random mask travels as its 64-bit seed, for instance), while one that keeps the
   default `encode` sends its dense reconstruction at 32 bits per element. Float
   fields travel at their own dtype's width (the kept values of a float64 parameter
   take 64 bits, where the accounting counts 32).
"""

import functools as ft
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, PRNGKeyArray

from ..aggregation import average
from ..compression import Compressor
from ..fragments import Fragments
from .mesh import AXIS, DATA
from .wire import Wire


def sharded_exchange(mesh: Mesh) -> Callable[..., tuple[list[Array], list[Array]]]:
    """The exchange of outer gradients between replicas sharded over `mesh`.

    Pass it as `streaming_diloco(..., exchange=sharded_exchange(mesh))`: a
    `base.Exchange`, with the results of `communication.simulated_exchange`. The step
    calls it once per fragment it sends, with that fragment's pieces.

    Inside `jax.shard_map` over `"replica"`, for each of `fragments` (Alg. 2, l.7-8):

    1. each replica encodes its own Δ, group by group (a whole leaf, or one row of a
       leaf labelled per row), with the same PRNG keys as `communication.compress`:
       `compressor.encode` gives named fields (codes, indices, seeds, values,
       scales); without a compressor, the values themselves;
    2. the message is one `uint8` vector: the integer fields packed at their widths
       (`Compressor.widths`; one bitstream per width), then the float fields' raw
       bytes (`wire.Wire`);
    3. `all_gather` of the messages over `"replica"`: this is the only collective;
    4. every replica unpacks and decodes all M messages and aggregates them in the
       wide dtype with the algorithm's aggregator (the plain mean: summed in replica
       order, then divided by M), the simulation's operation in the same order.

    Args:
        mesh: the replica mesh (`replica_mesh`).

    Returns:
        `exchange(compressor, fragments, deltas, key, aggregate) -> (mean, own)`:
        `mean` is one replicated `[...]` array per leaf, `own` the `[M, ...]`
        reconstructions, sharded like the deltas (what error feedback subtracts).
    """

    def exchange(
        compressor: Compressor | None,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
        aggregate: Callable[[list[Array]], list[Array]] = average,
    ) -> tuple[list[Array], list[Array]]:
        num_replicas = deltas[0].shape[0]
        if num_replicas % mesh.shape[AXIS]:
            raise ValueError(
                f"M={num_replicas} replicas are not a multiple of the mesh's "
                f"{mesh.shape[AXIS]} devices on axis {AXIS!r}."
            )
        keys = replica_keys(key, len(deltas), num_replicas)
        wires = [
            Wire(compressor, fragments, deltas, keys, p)
            for p in range(fragments.num_fragments)
        ]
        local = ft.partial(
            _exchange_local, wires, fragments, mesh.shape[DATA], aggregate
        )
        split, whole = PartitionSpec(AXIS), PartitionSpec()
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(split, split),
            out_specs=(whole, split),
            check_vma=False,
        )(deltas, keys)

    return exchange


# ----------------------------------------------------------------------------- helpers


def replica_keys(key: PRNGKeyArray, num_leaves: int, num_replicas: int) -> list[Array]:
    """The keys of `communication.compress`: one `[M, ...]` split per leaf, so that
    every exchange quantizes each replica's Δ with the simulation's randomness."""
    return [jr.split(jr.fold_in(key, i), num_replicas) for i in range(num_leaves)]


def _exchange_local(wires, fragments, data, aggregate, deltas, keys):
    """Per device: encode local replicas, all-gather, decode all, aggregate (Alg. 2
    l.8)."""
    local = deltas[0].shape[0]
    pieces = []
    for p, wire in enumerate(wires):
        name = fragments.names[p] if fragments.names else str(p)
        with jax.named_scope(f"sdiloco_fragment_{name}"):
            message = jax.vmap(wire.encode)(deltas, keys)  # [local, B]
            pieces.append(jax.vmap(wire.decode)(_gather(message, data)))  # [M, ...]
    recon = assemble(wires, fragments, pieces)
    mean = aggregate(recon)
    start = jax.lax.axis_index(AXIS) * local
    own = [jax.lax.dynamic_slice_in_dim(r, start, local, axis=0) for r in recon]
    return mean, own


def _gather(message: Array, data: int) -> Array:
    """Every replica's message, `[M, B]`, from this device's replicas' `[local, B]`.

    With one device per replica (D = 1), one all-gather over `"replica"`. With an island
    of D devices per replica, each device sends only its `1/D` share of the (padded)
    message across `"replica"`, and the island then all-gathers the shares over
    `"data"`: the slow axis carries each message once, not D times.
    """
    if data == 1:
        return jax.lax.all_gather(message, AXIS, axis=0, tiled=True)
    size = message.shape[1]
    share = -(-size // data)
    message = jnp.pad(message, ((0, 0), (0, share * data - size)))
    mine = jax.lax.dynamic_slice_in_dim(
        message, jax.lax.axis_index(DATA) * share, share, axis=1
    )
    shares = jax.lax.all_gather(mine, AXIS, axis=0, tiled=True)  # [M, B / D]
    whole = jax.lax.all_gather(shares, DATA, axis=1, tiled=True)  # [M, B]
    return whole[:, :size]


def assemble(wires, fragments, pieces) -> list[Array]:
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
