"""The exchange that moves while the next τ inner steps compute.

With `sharded_exchange`, the all-gather of a fragment's packed messages is a collective
inside the step that sends it: the step ends only when every message has arrived, so
nothing is hidden even with τ >= 1. Here the exchange is split in three, around the
steps that overlap it:

1. the step that sends a fragment **encodes**: each replica's packed message goes into
   the state's outbox (`posted_exchange`, a `PostedExchange`; no collective);
2. a `Courier` **moves** the messages while the next τ steps compute: it copies the
   fragment's outbox slot to a *communication device* of each process and starts the
   all-gather there, from a thread of its own;
3. the step of the outer update (t + τ) runs as two programs: its inner step is
   dispatched first; the courier then waits for what has not arrived yet and copies
   every replica's message into the state's inbox; the second program **decodes**
   and averages them and takes the outer step and the merge (`streaming.receive`).
   So the bytes have τ whole inner steps to cross the link, as in Alg. 2.

Why a second device and a thread. A collective ties up the device that runs it until
the bytes have crossed the link; on the compute devices it would stall the inner steps.
On a device of its own it runs beside them. On XLA:CPU, a program with a collective
also runs synchronously in the call that launches it (measured: the launch of a 2 MB
all-gather over a 20 Mbit/s link returned after 1.27 s), so the courier launches it
from a worker thread, which leaves the training loop free to dispatch the next steps:
the same 20 steps took 0.085 s alone and 0.085 s while that all-gather ran. On
CPU-only hosts the communication device is one more CPU device per process
(`XLA_FLAGS=--xla_force_host_platform_device_count=K+1`, `courier_meshes`). On a GPU
or TPU host it can be the process's CPU device: the packed messages are small, they
cross the wide-area link through the host's network card anyway, and the accelerator
never waits on the transfer (pass `comm_devices=`).

Numbers: the courier only moves bytes. Encoding and decoding are those of
`sharded_exchange` (the same `Wire`, the same keys, the mean in replica order), so a
posted run reproduces the in-step exchange bitwise on the same mesh, and the
simulation within the tolerance of `tests/test_distributed.py`.

Training loop: `courier = Courier(alg, mesh, comm_mesh)`, then `state, metrics =
courier(state, batch)` in place of the jitted step. The step returned by the courier
keeps its metrics per replica (a mean over replicas would be a collective on the
compute devices, queued behind the messages on the link); `courier.host(metrics)`
reads them and adds the means. A checkpoint needs nothing special: a fragment in
flight is still in the outbox, and a courier that starts from a restored state posts
it again.
"""

import concurrent.futures
import functools
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PRNGKeyArray

from .. import communication
from ..base import Algorithm, PostedExchange, jit_step
from ..compression import Compressor
from ..fragments import Fragments
from ..streaming import local_phase, message_bytes, sync_phase
from .exchange import _assemble, replica_keys
from .mesh import AXIS, replica_mesh, sharded_step
from .wire import Wire


class _Posted:
    """`PostedExchange` with the packed wire format of `sharded_exchange`."""

    def __init__(self, mesh: Mesh | None):
        self.mesh = mesh

    def __repr__(self) -> str:
        return f"posted_exchange({'mesh' if self.mesh is not None else ''})"

    @staticmethod
    def _wire(compressor, fragments, deltas, key):
        keys = replica_keys(key, len(deltas), deltas[0].shape[0])
        return Wire(compressor, fragments, deltas, keys, 0), keys

    def message_bytes(
        self, compressor: Compressor | None, fragments: Fragments, deltas, key
    ) -> int:
        def size(deltas, key):
            wire, keys = self._wire(compressor, fragments, deltas, key)
            one = [x[0] for x in deltas], [k[0] for k in keys]
            return wire.encode(*one)

        return int(jax.eval_shape(size, deltas, key).shape[0])

    def encode(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
    ) -> tuple[Array, list[Array]]:
        wire, keys = self._wire(compressor, fragments, deltas, key)

        def local(deltas, keys):
            messages = jax.vmap(wire.encode)(deltas, keys)
            own = _assemble([wire], fragments, [jax.vmap(wire.decode)(messages)])
            return messages, own

        if self.mesh is None:
            return local(deltas, keys)
        split = PartitionSpec(AXIS)
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(split, split),
            out_specs=(split, split),
            check_vma=False,
        )(deltas, keys)

    def decode_mean(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        messages: Array,
        deltas,
        key: PRNGKeyArray,
    ) -> list[Array]:
        wire, _ = self._wire(compressor, fragments, deltas, key)
        recon = _assemble([wire], fragments, [jax.vmap(wire.decode)(messages)])
        return communication.average(recon)


def posted_exchange(mesh: Mesh | None = None) -> PostedExchange:
    """The posted exchange: pass it as `streaming_diloco(..., exchange=...)`.

    Args:
        mesh: the compute mesh the replicas are sharded over (`courier_meshes`), or
            None for the simulation on one device.

    Returns:
        A `PostedExchange`. The algorithm's state gains an outbox `[M, K, B]` and an
        inbox `[K, M, B]` of packed messages (K in-flight slots, B the bytes of the
        largest fragment's message); a `Courier` moves one to the other.
    """
    return _Posted(mesh)


def courier_meshes(
    num_replicas: int,
    devices: Sequence[Any] | None = None,
    *,
    comm_devices: Sequence[Any] | None = None,
    data: int | None = None,
) -> tuple[Mesh, Mesh]:
    """The compute mesh of the replicas and the communication mesh of the courier.

    Args:
        num_replicas: M.
        devices: every device of the job; default `jax.devices()`.
        comm_devices: one device per process for the courier; default: the last
            device of each process, the others computing.
        data: D, devices per replica on the compute mesh (see `replica_mesh`);
            default: as many as every process can give its replicas (the devices
            left over are not used).

    Returns:
        `(mesh, comm_mesh)`: the compute mesh (`replica_mesh` over the devices that
        compute) and a one-axis mesh `("replica",)` of one communication device per
        process, in the order of the processes' replicas.

    Raises:
        ValueError: if a process has no device left to compute, or not exactly one
            communication device.
    """
    devices = list(jax.devices() if devices is None else devices)
    procs = sorted({d.process_index for d in devices})
    if comm_devices is None:
        comm_devices = [[d for d in devices if d.process_index == p][-1] for p in procs]
    comm_devices = list(comm_devices)
    owners = [d.process_index for d in comm_devices]
    if sorted(owners) != procs:
        raise ValueError(
            f"comm_devices={comm_devices}: processes {owners}; allowed: exactly one "
            f"device of each of the processes {procs}."
        )
    compute = [d for d in devices if d not in comm_devices]
    per_proc = {p: [d for d in compute if d.process_index == p] for p in procs}
    missing = [p for p, ds in per_proc.items() if not ds]
    if missing:
        raise ValueError(
            f"processes {missing} have no device left to compute beside their "
            "communication device; allowed: at least 2 devices per process (on CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=2 or more)."
        )
    if num_replicas % len(procs):
        raise ValueError(
            f"num_replicas (M)={num_replicas} over {len(procs)} processes; allowed: a "
            "multiple of the number of processes (each feeds the same number)."
        )
    if data is None:  # as many devices per replica as every process can give
        local = num_replicas // len(procs)
        data = max(1, min(len(ds) for ds in per_proc.values()) // local)
        compute = [d for p in procs for d in per_proc[p][: local * data]]
    mesh = replica_mesh(num_replicas, compute, data=data)
    order = []
    for row in mesh.devices:
        p = row[0].process_index
        if p not in order:
            order.append(p)
        elif order[-1] != p:
            raise ValueError(
                "the compute mesh's rows of one process are not contiguous; allowed: "
                "devices listed process by process."
            )
    by_proc = {d.process_index: d for d in comm_devices}
    comm = Mesh(np.array([by_proc[p] for p in order], dtype=object), (AXIS,))
    return mesh, comm


class Courier:
    """Runs a posted algorithm's steps and moves its messages between them.

    `state, metrics = courier(state, batch)` is one training step, as two jitted,
    state-donating programs: the step's first half (`streaming.local_phase`: the
    inner step and the encoding of what is sent) is dispatched; then the messages due
    at this step are put into the inbox (waiting only for those still on the way,
    while that inner step computes); then the second half (`streaming.sync_phase`:
    decode, outer step, merge) is dispatched, and the messages of the fragments this
    step sent start moving. `events` records, per message, when it was posted,
    when it had arrived and how long the training loop waited for it (seconds of
    `time.perf_counter`).

    A collective of your own between the same processes (an evaluation gathered over
    the mesh, `multihost_utils`, a checkpoint barrier) must not run while a message
    moves: XLA:CPU's gloo collectives fail when two threads run them at once. Call
    `drain()` first (`Placement` does, and `host` does).

    Args:
        algorithm: built with `exchange=posted_exchange(mesh)`.
        mesh: the compute mesh (None: the simulation on one device, where delivering
            is a copy in the same program order).
        comm_mesh: one communication device per process (`courier_meshes`); needed
            with a mesh.
        fsdp: as `sharded_step`.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        mesh: Mesh | None = None,
        comm_mesh: Mesh | None = None,
        *,
        fsdp: bool = False,
    ):
        spec = algorithm.spec
        if spec is None or not spec.posted:
            raise ValueError(
                "algorithm: a Courier needs a DiLoCo-family algorithm built with "
                "exchange=distributed.posted_exchange(...)."
            )
        if (mesh is None) != (comm_mesh is None):
            raise ValueError(
                f"mesh={mesh is not None and 'given'}, comm_mesh="
                f"{comm_mesh is not None and 'given'}; allowed: both (courier_meshes) "
                "or neither (the simulation)."
            )
        self.algorithm, self.spec = algorithm, spec
        self.mesh, self.comm_mesh = mesh, comm_mesh
        self.events: list[dict[str, Any]] = []
        self._pending: dict[int, list[tuple[int, int, Any, dict]]] = {}
        self._t: int | None = None
        self._sizes: np.ndarray | None = None

        def first(state, batch):
            return local_phase(spec, state, batch)

        def second(state, local):
            return sync_phase(spec, state, local)

        if mesh is None:
            self.programs = (jit_step(first), jit_step(second))
            self._pool = None
        else:
            self.programs = tuple(
                sharded_step(f, mesh, fsdp=fsdp, metrics="local")
                for f in (first, second)
            )
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="sdiloco-courier"
            )
            whole = NamedSharding(comm_mesh, PartitionSpec())
            self._gather = jax.jit(lambda x: x, out_shardings=whole)

    # ------------------------------------------------------------------ public

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        """One step: its inner half, the delivery of what is due, its sync half,
        then the posting of what it sent."""
        if self._t is None:
            state = self._start(state)
        t = self._t + 1
        state, local = self.programs[0](state, batch)
        state = self._deliver(state, t)
        state, metrics = self.programs[1](state, local)
        self._post(state, t)
        self._t = t
        return state, metrics

    def drain(self) -> None:
        """Wait until every message posted so far has arrived."""
        for items in self._pending.values():
            for *_, future, _ in items:
                if isinstance(future, concurrent.futures.Future):
                    future.result()

    def close(self) -> None:
        """Wait for the transfers in progress and stop the courier's thread."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def host(self, metrics: Any) -> Any:
        """Metrics as NumPy, with the means over replicas added back.

        `metrics` is one step's metrics dict, or any pytree of them (the training
        loop passes its list of `(step, metrics)`). With a mesh across processes, the
        per-replica values are gathered from every process in one collective: call
        it where the loop flushes its logs, not every step.
        """
        split = [
            x
            for x in jax.tree.leaves(metrics)
            if isinstance(x, jax.Array) and not x.is_fully_addressable
        ]
        gathered = {}
        if split:
            self.drain()  # gloo collectives must not overlap the courier's
            whole = [x for x in split if x.is_fully_replicated]
            parts = [x for x in split if not x.is_fully_replicated]
            every = multihost_utils.process_allgather(parts, tiled=True)
            gathered = {id(x): y for x, y in zip(parts, every)}
            gathered.update({id(x): x.addressable_data(0) for x in whole})
        out = jax.device_get(jax.tree.map(lambda x: gathered.get(id(x), x), metrics))

        def add_means(node):
            if isinstance(node, dict):
                if "loss/train" not in node and "loss/replicas" in node:
                    node = dict(node)
                    node["loss/train"] = np.mean(node["loss/replicas"], axis=0)
                    for k in [k for k in node if k.startswith("replicas/aux/")]:
                        name = "aux/" + k.removeprefix("replicas/aux/")
                        node[name] = np.mean(node[k], axis=0)
                return node
            if isinstance(node, list | tuple):
                return type(node)(add_means(x) for x in node)
            return node

        return add_means(out)

    # ------------------------------------------------------------------ helpers

    def _start(self, state: Any) -> Any:
        """Read t off the state and post again every fragment still in flight."""
        arrays = eqx.filter(state.global_params, eqx.is_inexact_array)
        self._sizes = message_bytes(self.spec, arrays)
        self._layout = self.spec.layout_of(arrays)
        step = int(_read(state.step))
        sent_at = np.asarray(_read(state.sent_at))
        tau = min(self.spec.schedule.overlap)
        self._t = step
        for p in np.flatnonzero(self.spec.schedule.in_flight(step, sent_at)):
            self._post_one(state, int(p), int(sent_at[p]) + tau)
        return state

    def _post(self, state: Any, t: int) -> None:
        tau = min(self.spec.schedule.overlap)
        for p in np.flatnonzero(self.spec.schedule.sent(t)):
            self._post_one(state, int(p), t + tau)

    def _post_one(self, state: Any, p: int, arrival: int) -> None:
        k, size = int(self._layout.slot_of[p]), int(self._sizes[p])
        event = {"fragment": p, "arrival_step": arrival, "bytes": size}
        event["posted"] = time.perf_counter()
        if self.mesh is None:
            future = _take(state.outbox, k, size, None)
        else:
            x = _take(
                state.outbox, k, size, NamedSharding(self.mesh, PartitionSpec(AXIS))
            )
            x = self._to_comm(x)
            future = self._pool.submit(self._move, x, event)
        self._pending.setdefault(arrival, []).append((k, size, future, event))
        self.events.append(event)

    def _move(self, x: Array, event: dict) -> Array:
        """On the courier's thread: the all-gather, until the bytes have arrived."""
        event["started"] = time.perf_counter()
        out = self._gather(x)
        out.block_until_ready()
        event["arrived"] = time.perf_counter()
        return out

    def _deliver(self, state: Any, t: int) -> Any:
        for k, size, future, event in self._pending.pop(t, []):
            start = time.perf_counter()
            if self.mesh is None:
                messages, whole = future, None
            else:
                messages = self._from_comm(future.result())
                whole = NamedSharding(self.mesh, PartitionSpec())
            event["waited"] = time.perf_counter() - start
            state = state._replace(inbox=_put(state.inbox, messages, k, size, whole))
        return state

    def _to_comm(self, x: Array) -> Array:
        """This process's replicas' messages, on its communication device."""
        me = jax.process_index()
        (dev,) = [d for d in self.comm_mesh.devices.flat if d.process_index == me]
        shards = sorted(
            (s for s in x.addressable_shards if s.replica_id == 0),
            key=lambda s: s.index[0].start or 0,
        )
        parts = [jax.device_put(s.data, dev) for s in shards]
        local = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        sharding = NamedSharding(self.comm_mesh, PartitionSpec(AXIS))
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [local])

    def _from_comm(self, out: Array) -> Array:
        """Every replica's messages, replicated over the compute mesh."""
        local = out.addressable_data(0)
        sharding = NamedSharding(self.mesh, PartitionSpec())
        devices = sharding.addressable_devices
        parts = [jax.device_put(local, d) for d in devices]
        return jax.make_array_from_single_device_arrays(out.shape, sharding, parts)


# ----------------------------------------------------------------------------- helpers


def _read(x: Any) -> Any:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return jax.device_get(x)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _take(outbox: Array, k: int, size: int, sharding: Any) -> Array:
    """Fragment slot k's messages `[M, size]` from the outbox `[M, K, B]`."""
    out = outbox[:, k, :size]
    if sharding is not None:
        out = jax.lax.with_sharding_constraint(out, sharding)
    return out


@functools.partial(jax.jit, static_argnums=(2, 3, 4), donate_argnums=(0,))
def _put(inbox: Array, messages: Array, k: int, size: int, sharding: Any) -> Array:
    """The inbox `[K, M, B]` with slot k's first `size` bytes set to `messages`."""
    out = inbox.at[k, :, :size].set(messages)
    if sharding is not None:
        out = jax.lax.with_sharding_constraint(out, sharding)
    return out
