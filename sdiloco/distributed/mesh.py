"""Replicas sharded over devices and hosts: the mesh, the state and the batch on it.

The library simulates the M replicas on one device: every replica leaf of the state and
every batch leaf has a leading axis M, and the inner step is vmapped over it. This
package runs **the same `init` and `step`** with that axis sharded over a mesh of the
devices of one process or of many (JAX's multi-controller runtime, `jax.distributed`):
nothing is re-implemented, only placed.

The mesh has two axes, `("replica", "data")`:

- `"replica"` (size R, M a multiple of R) carries the replicas: the replica leaves of the
  state (`P("replica")`) and the batch's leading axis. Its only collective is the
  exchange's all-gather of the packed low-bit messages (`sharded_exchange`); this is the
  slow, wide-area axis of the paper.
- `"data"` (size D) spreads each replica over an island of D devices: the replica's
  batch is split over them (`P("replica", "data")`), so the inner step's gradient mean
  becomes an all-reduce inside the island only. With `fsdp=True` the replica's
  parameters and inner optimizer state are also split over `"data"` (their largest
  divisible axis), which is what lets a large model fit.

- `replica_mesh(M, devices, data=D)` builds the mesh; `shard_state` / `shard_batch`
  place the state and the batch; `sharded_step` jits a step so that the state keeps
  that layout from step to step.
- Data-Parallel needs nothing special: with the batch sharded and the parameters
  replicated, XLA turns its mean of the per-replica gradients into an all-reduce.
- Streaming DiLoCo also needs its exchange written per replica:
  `sdiloco.distributed.exchange.sharded_exchange`.

Numerics, compared with the vmapped simulation (`tests/test_distributed.py`):

- a whole step is not bitwise: XLA:CPU compiles the per-device program (an
  `[M/R, ...]` slice of the replica axis, a size-1 axis squeezed away, a `1/D` slice
  of the batch) with other dot kernels, operand layouts and reduction orders than the
  `[M, ...]` program, so the inner step differs by float32 rounding (a few ulp per
  step; measured ≤ 1e-7 after 10 steps of the toy model, 4e-5 after 6 steps of a
  6-layer transformer, where Adam's normalisation amplifies ulp-level gradient
  differences). A quantization code can then differ where a value sits within that
  distance of a rounding boundary;
- the global parameters and the outer optimizer are replicated computations; two
  processes give bitwise the results of one process with the same mesh.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

from ..base import AlgorithmState
from ..custom_types import Batch
from ..jit import JittedStep
from ..streaming import LocalResult


AXIS = "replica"
"""Name of the mesh axis the replicas are sharded over (the wide-area axis)."""

DATA = "data"
"""Name of the mesh axis that spreads one replica over its island's devices."""


def replica_mesh(
    num_replicas: int, devices: Any = None, *, data: int | None = None
) -> Mesh:
    """A mesh `("replica", "data")` over `devices`, for M replicas.

    The devices are ordered by process, then id, and laid out row by row: a row of D
    consecutive devices is one island holding M / R replicas, so an island stays
    inside one process whenever a process has D devices or a multiple. The axis types
    are `Auto` (classic sharding propagation), so the unchanged library code, written
    for a leading M axis, is partitioned by XLA; only the exchange is written per
    replica (`shard_map`).

    Args:
        num_replicas: M >= 1.
        devices: the devices of the mesh; default every global device (`jax.devices()`,
            all processes).
        data: D, devices per island (the `"data"` axis). Default: `len(devices) / M`
            when M divides the number of devices (each replica spread over its own
            island), else 1 (every device holds `M / len(devices)` whole replicas).

    Returns:
        The mesh, of shape `(R, D)` with `R * D = len(devices)` and M a multiple of R.

    Raises:
        ValueError: if M, D and the number of devices do not fit together (the message
            names the value and what is allowed).
    """
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    n = len(devices)
    if not _is_pos_int(num_replicas):
        raise ValueError(f"num_replicas (M)={num_replicas!r} must be an int >= 1.")
    if data is None:
        data = n // num_replicas if n % num_replicas == 0 else 1
    if not _is_pos_int(data) or n % data:
        raise ValueError(
            f"data (devices per replica)={data!r} must be a positive divisor of the "
            f"number of devices {n}."
        )
    rows = n // data
    if num_replicas % rows:
        raise ValueError(
            f"num_replicas (M)={num_replicas} must be a multiple of the {rows} "
            f"replica-axis rows of {n} devices with data={data} devices per replica; "
            f"allowed: data such that M is a multiple of {n} / data, or pass "
            "devices=... to use fewer devices."
        )
    grid = np.array(devices, dtype=object).reshape(rows, data)
    return Mesh(grid, (AXIS, DATA), axis_types=(AxisType.Auto, AxisType.Auto))


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
    for entry in index.values():
        (s,) = tuple(entry or ())
        out.update(range(*s.indices(num_replicas)))
    return sorted(out)


def state_shardings(state: Any, mesh: Mesh, *, fsdp: bool = False) -> Any:
    """The sharding of every array leaf of a state.

    The leaves of the fields the state declares in `replica_fields` (e.g.
    `replica_params`, `inner_state`, `residual` of a `StreamingState`) are split along
    their leading axis M over `"replica"`. Everything else (θ_g, the outer state, the
    in-flight slots, step counters, all of a `DataParallelState`) is replicated over
    `"replica"` (every island keeps its copy, as every worker of the paper does), in the
    memory kind its array has (θ_g and the outer state stay in host memory when
    offloaded). With `fsdp`, each replica leaf is also split over `"data"` along its
    largest axis after M that D divides (none: kept whole in the island), and so is
    every leaf of a state without replica fields (Data-Parallel, whose one state all
    replicas share); a DiLoCo island's θ_g and outer state stay whole in the island.

    Raises:
        ValueError: for a state that does not declare its `replica_fields`.
    """
    if not isinstance(state, AlgorithmState):
        raise ValueError(
            f"state of type {type(state).__name__} does not declare which fields "
            "carry the replica axis; allowed: a NamedTuple state with a "
            "`replica_fields` class attribute (an `AlgorithmState`)."
        )
    fields = type(state).replica_fields
    data = mesh.shape[DATA]

    # Shared leaves are split too only where every replica shares them (Data-Parallel):
    # a DiLoCo island's own θ_g and outer state split over "data" would be gathered
    # across islands in float32 by XLA, around the low-bit exchange.
    split_shared = not fields

    def spec(x, replica):
        out = [AXIS if replica else None] + [None] * (x.ndim - 1)
        if fsdp and data > 1 and (replica or split_shared):
            first = 1 if replica else 0
            axes = [a for a in range(first, x.ndim) if x.shape[a] % data == 0]
            if axes:
                out[max(axes, key=lambda a: x.shape[a])] = DATA
        return PartitionSpec(*out[: x.ndim]) if x.ndim else PartitionSpec()

    def sharding(x, replica):
        # Shared leaves stay in the memory they live in (host when offloaded).
        host = getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
        kind = "pinned_host" if host and not replica else None
        return NamedSharding(mesh, spec(x, replica), memory_kind=kind)

    return type(state)(
        *(
            jax.tree.map(
                lambda x, replica=name in fields: (
                    sharding(x, replica) if eqx.is_array(x) else None
                ),
                getattr(state, name),
            )
            for name in state._fields
        )
    )


def shard_state(state: Any, mesh: Mesh, *, fsdp: bool = False) -> Any:
    """Place a state (the same full value on every process) on the mesh.

    Works in one process and across processes: every process calls `alg.init` with
    the same arguments and keeps only the slices its devices hold.
    """
    shardings = state_shardings(state, mesh, fsdp=fsdp)
    return jax.tree.map(
        lambda x, s: _global_array(x, s) if eqx.is_array(x) else x,
        state,
        shardings,
        is_leaf=lambda x: x is None,
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """`P("replica", "data")`: replicas over islands, each replica's batch split in it."""
    return NamedSharding(mesh, PartitionSpec(AXIS, DATA))


def shard_batch(batch: Batch, mesh: Mesh, num_replicas: int) -> Batch:
    """Assemble the global `[M, b, ...]` batch from this process's replicas' batches.

    Args:
        batch: every leaf is `[n, b, ...]`, the whole batches of the replicas
            `process_replicas(mesh, M)`, in that order (in a single process: the whole
            `[M, b, ...]` batch). A process keeps only the parts its devices hold.
        mesh: the replica mesh.
        num_replicas: M.

    Returns:
        The batch as global arrays sharded `P("replica", "data")`: each replica's
        `b` sequences split over the D devices of its island.

    Raises:
        ValueError: if a leaf's leading axis is not this process's replicas, or its
            per-replica batch `b` is not a multiple of D.
    """
    sharding = batch_sharding(mesh)
    mine = process_replicas(mesh, num_replicas)
    position = {m: i for i, m in enumerate(mine)}
    data = mesh.shape[DATA]

    def place(x):
        x = np.asarray(x)
        if x.ndim < 2 or x.shape[0] != len(mine):
            raise ValueError(
                f"batch leaf of shape {x.shape}: its leading axis must be this "
                f"process's {len(mine)} replicas, then the per-replica batch."
            )
        if x.shape[1] % data:
            raise ValueError(
                f"per-replica batch of {x.shape[1]} sequences is not a multiple of the "
                f"{data} devices per replica (mesh axis {DATA!r}); allowed: a global "
                f"batch that is a multiple of M * {data}."
            )

        def part(index):
            rows = range(*index[0].indices(num_replicas))
            return x[[position[m] for m in rows]][(slice(None),) + index[1:]]

        return jax.make_array_from_callback(
            (num_replicas,) + x.shape[1:], sharding, part
        )

    return jax.tree.map(place, batch)


def sharded_step(
    step: Callable[..., Any],
    mesh: Mesh,
    *,
    fsdp: bool = False,
    metrics: str = "replicated",
    donate: bool = True,
) -> JittedStep:
    """A jitted step that keeps the state's layout on the mesh, with the state donated.

    The new state is constrained to `state_shardings(..., fsdp=fsdp)`. Like
    `sdiloco.jit_step`, the state passed in is consumed; `shard_state` already made
    fresh arrays.

    Args:
        step: an `Algorithm.step`.
        mesh: the replica mesh.
        fsdp: split the replica leaves over `"data"` too (see `state_shardings`).
        metrics: "replicated" (every metric readable by every process; the means over
            replicas are collectives across `"replica"`) or "local" (the means over
            replicas, `loss/train` and `aux/*`, are left out, and the per-replica
            metrics `loss/replicas` and `replicas/aux/*` stay split over
            `"replica"`: a step without sync steps then has no collective across
            `"replica"` at all; `Courier.host` adds the means back).
        donate: donate the state (as `jit_step`); False keeps it valid.

    Returns:
        The jitted `step(state, batch) -> (state, metrics)` for sharded inputs (a
        `JittedStep`: `.lower(state, batch)` gives the program).
    """
    if metrics not in ("replicated", "local"):
        raise ValueError(f"metrics={metrics!r}; allowed: 'replicated' or 'local'.")
    whole = NamedSharding(mesh, PartitionSpec())

    def constrained(state, batch, *participation):
        new_state, out = step(state, batch, *participation)
        shardings = state_shardings(new_state, mesh, fsdp=fsdp)
        new_state = jax.tree.map(
            lambda x, s: jax.lax.with_sharding_constraint(x, s) if s else x,
            new_state,
            shardings,
            is_leaf=lambda x: x is None,
        )
        if metrics == "local":
            return new_state, _local_metrics(out, mesh)
        out = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, whole), out)
        return new_state, out

    return JittedStep(constrained, donate=donate)


# ----------------------------------------------------------------------------- helpers


def _local_metrics(metrics: Any, mesh: Mesh) -> Any:
    """Metrics without the means over replicas, the per-replica ones left split (a
    step's metrics dict, or what `streaming.local_phase` reports)."""
    split = NamedSharding(mesh, PartitionSpec(AXIS))
    whole = NamedSharding(mesh, PartitionSpec())
    if isinstance(metrics, LocalResult):
        return LocalResult(
            jax.lax.with_sharding_constraint(metrics.losses, split),
            jax.lax.with_sharding_constraint(metrics.aux, split),
            jax.lax.with_sharding_constraint(metrics.sent, whole),
        )
    out = {}
    for k, v in metrics.items():
        if k == "loss/train" or k.startswith("aux/"):
            continue
        per_replica = k == "loss/replicas" or k.startswith("replicas/")
        out[k] = jax.lax.with_sharding_constraint(v, split if per_replica else whole)
    return out


def _is_pos_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _global_array(x: Array, sharding: NamedSharding) -> Array:
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
