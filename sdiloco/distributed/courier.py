"""The exchange that moves while the next τ inner steps compute.

With `sharded_exchange`, the all-gather of a fragment's packed messages is a collective
inside the step that sends it: the step ends only when every message has arrived, so
nothing is hidden even with τ >= 1. Here the exchange is split in three, around the
steps that overlap it:

1. the step that sends a fragment **encodes**, in its first half (its inner step and
   its sends, `streaming.local_phase`): each replica's packed message goes into the
   state's outbox (`posted_exchange`, a `PostedExchange`; no collective);
2. a `Courier` hands the outbox slot to its `Transport` as soon as that half is
   dispatched, which **moves** the messages while the next τ steps compute, from a
   thread of its own (an all-gather on a *communication device* of each process,
   `MeshAllGather`; a round of an elastic job through Ray; or nothing to move in the
   simulation, `InProcess`);
3. the step of the outer update (t + τ) runs as two programs: its first half is
   dispatched; the courier then waits for what has not arrived yet and copies
   every replica's message into the state's inbox; the second half **decodes**
   and averages them and takes the outer step and the merge (`streaming.receive`).
   So the bytes have τ whole inner steps to cross the link, as in Alg. 2. With
   τ = 0 (DiLoCo) the step that sends is the step of the outer update: it waits
   between its two halves, and no program holds a host callback.

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
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from ..base import Algorithm
from ..jit import JittedStep
from ..streaming import StreamingSpec, local_phase, sync_phase
from .mesh import AXIS, replica_mesh, sharded_step
from .posted import posted_exchange as posted_exchange
from .transport import MeshAllGather, Transport, as_transport


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


class CourierError(RuntimeError):
    """A fragment's messages failed to arrive, or did not arrive in time."""


class Courier:
    """Runs a posted algorithm's steps and moves its messages between them.

    `state, metrics = courier(state, batch)` is one training step, as two jitted
    programs: the step's first half (`streaming.local_phase`: the inner step and the
    encoding of what is sent) is dispatched, and the messages of the fragments it
    sent start moving (`Transport.move`); then the messages due at this step are
    put into the inbox (waiting only for those still on the way, while that inner
    step computes; with τ = 0, the ones it has just sent); then the second half
    (`streaming.sync_phase`: decode, outer step, merge) is dispatched. `events` records, per message, when it was posted, when it had
    arrived and how long the training loop waited for it (seconds of
    `time.perf_counter`).

    Failures. Every wait is bounded by `timeout` seconds; a message that does not
    arrive in time, or whose transfer fails, raises a `CourierError` naming the
    fragment, the steps and the peer processes. The state passed in is then intact:
    at a step whose messages are still on the way the first program does not donate
    it (nor at a step that sends with τ = 0), so the caller can checkpoint it or
    stop. Use the courier as a context
    manager (`with Courier(...) as courier:`): leaving it waits for the transfers
    (bounded) and stops its thread, also on an error.

    The step counter. The courier counts steps on the host; given a state it did not
    return (a restored checkpoint), it reads t and the fragments in flight off that
    state and posts them again, so the two cannot disagree.

    Collectives. XLA:CPU's gloo collectives between the same processes must not run
    from two threads at once. The courier's thread holds `lock` while its all-gather
    runs; a collective of your own (an evaluation gathered over the mesh, a
    checkpoint barrier) runs inside `with courier.exclusive():`, which waits for the
    messages posted so far and then holds the lock (`lab.cluster.Placement` does this
    for the training loop).

    Args:
        algorithm: built with `exchange=posted_exchange(...)`.
        mesh: the compute mesh (None: one program's replicas, or one island's).
        comm_mesh: one communication device per process (`courier_meshes`); needed
            with a mesh, whose transport is then an all-gather over it
            (`MeshAllGather`).
        fsdp: as `sharded_step`.
        timeout: seconds a step waits for a message before it raises.
        transport: without a mesh, what moves the messages (a `Transport`, or a
            function `move(messages, fragment, sent) -> messages` on NumPy arrays;
            `distributed.RayTransport` for the islands of an elastic job).
            Default: `InProcess`, the simulation's replicas in one program.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        mesh: Mesh | None = None,
        comm_mesh: Mesh | None = None,
        *,
        fsdp: bool = False,
        timeout: float = 600.0,
        transport: Transport
        | Callable[[np.ndarray, int, int], np.ndarray]
        | None = None,
    ):
        spec = algorithm.spec
        if not isinstance(spec, StreamingSpec) or not spec.posted:
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
        if transport is not None and mesh is not None:
            raise ValueError(
                "transport= with a mesh; allowed: one of the two (a mesh moves the "
                "messages with an all-gather)."
            )
        if mesh is not None and comm_mesh is not None:
            transport = MeshAllGather(mesh, comm_mesh)
        self.spec, self.mesh = spec, mesh
        self.transport = as_transport(transport)
        self.timeout = timeout
        self.events: list[dict[str, Any]] = []
        self.lock = self.transport.lock
        self.failed = False  # a message failed or timed out (a CourierError raised)
        self._pending: dict[int, list[_Message]] = {}
        self._t: int | None = None
        self._last: Any = None
        self.programs = _programs(spec, mesh, fsdp, donate=True)
        self._keeping = _programs(spec, mesh, fsdp, donate=False)[0]
        self._pool = None
        if self.transport.threaded:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="sdiloco-courier"
            )

    def __enter__(self) -> "Courier":
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if kind is None:
            self.close()
        else:  # an error is on its way: do not wait, nor hide it
            self.stop()

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        """One step: its inner half, the posting of what it sent, the delivery of
        what is due (with τ = 0, what it has just sent), its sync half."""
        if state is not self._last:  # a state this courier did not return
            self._start(state)
        assert self._t is not None
        t = self._t + 1
        due = self._pending.get(t, [])
        waiting = [m for m in due if not _done(m.future)]
        for m in due:
            if m not in waiting:  # arrived or failed already: fail before any compute
                self._result(m, t)
        now = self.spec.schedule.min_overlap == 0 and np.any(self.spec.schedule.sent(t))
        first = self._keeping if waiting or now else self.programs[0]
        mid, local = first(state, batch)
        self._post(mid, t)  # the outbox is written: its messages start moving
        mid = self._deliver(mid, t)  # may raise: `state` is still valid then
        new, metrics = self.programs[1](mid, local)
        self._t, self._last = t, new
        return new, metrics

    def warm_up(self, state: Any, batch: Any) -> None:
        """Compile every program a step may run, on a throwaway `state` (consumed;
        nothing is posted): both halves, the first half that keeps its input (a step
        whose messages are on the way), and the transport's copies out of the
        outbox and into the inbox. A process that joins a running job calls it before
        it joins, so that its first steps do not fall behind its peers."""
        mid, local = self._keeping(state, batch)
        jax.block_until_ready(self.programs[1](mid, local))
        mid, local = self.programs[0](state, batch)
        self._measure(mid)
        for k, size in {(int(k), int(n)) for k, n in zip(self._slots, self._sizes)}:
            inbox = self.transport.warm_up(mid.outbox, mid.inbox, k, size)
            mid = mid._replace(inbox=inbox)
        jax.block_until_ready(self.programs[1](mid, local))

    def drain(self) -> None:
        """Wait (each message at most `timeout` seconds) for every message posted."""
        for items in self._pending.values():
            for m in items:
                self._result(m, m.arrival)

    def close(self) -> None:
        """Wait for the transfers in progress (bounded), then `stop`; after a
        `CourierError` (already raised), stop without waiting."""
        try:
            if not self.failed:
                self.drain()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop the courier's thread without waiting (a transfer stuck on a dead
        link is abandoned). Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No courier collective runs inside the block: the messages posted so far
        are waited for (each at most `timeout`), then the courier's lock is held.

        Waiting first matters across processes: each process's courier thread runs
        the same all-gathers in the same order, so every process must let them finish
        before any issues a collective of its own (holding the lock alone could leave
        one process in its own collective while its peer's thread waits for it).
        Block on the results of your own collective inside the block. A transport
        that is not a collective (`Transport.collective`: Ray's, the
        simulation's) has nothing to wait for: the block runs at once.
        """
        if not self.transport.collective:
            yield
            return
        self.drain()
        with self.lock:
            yield

    def host(self, metrics: Any) -> Any:
        """Metrics as NumPy, with the means over replicas added back.

        `metrics` is one step's metrics dict, or any pytree of them (the training
        loop passes its list of `(step, metrics)`). With a mesh across processes, the
        per-replica values are gathered from every process in one collective: call
        it where the loop flushes its logs, not every step.
        """
        with self.exclusive():
            return _add_means(jax.device_get(_gather_split(metrics)))

    # ------------------------------------------------------------------ helpers

    def _start(self, state: Any) -> None:
        """Read t off the state and post again every fragment still in flight."""
        self.drain()
        self._pending = {}
        self._measure(state)
        step, sent_at = int(_read(state.step)), np.asarray(_read(state.sent_at))
        self._t = step
        tau = self.spec.schedule.min_overlap
        for p in np.flatnonzero(self.spec.schedule.in_flight(step, sent_at)):
            self._post_one(state, int(p), int(sent_at[p]), int(sent_at[p]) + tau)

    def _measure(self, state: Any) -> None:
        """Each fragment's message bytes and in-flight slot (static: the state's
        shapes)."""
        arrays = eqx.filter(state.global_params, eqx.is_inexact_array)
        self._sizes = self.spec.message_bytes(arrays)
        self._slots = self.spec.layout(arrays).slot_of

    def _post(self, state: Any, t: int) -> None:
        for p in np.flatnonzero(self.spec.schedule.sent(t)):
            self._post_one(state, int(p), t, t + self.spec.schedule.min_overlap)

    def _post_one(self, state: Any, p: int, sent: int, arrival: int) -> None:
        k, size = int(self._slots[p]), int(self._sizes[p])
        event: dict[str, Any] = {"fragment": p, "arrival_step": arrival, "bytes": size}
        event["posted"] = time.perf_counter()
        x = self.transport.take(state.outbox, k, size)
        if self._pool is None:
            future = self.transport.move(x, p, sent)
        else:
            future = self._pool.submit(self._carry, x, p, sent, event)
        message = _Message(p, k, size, sent, arrival, future, event)
        self._pending.setdefault(arrival, []).append(message)
        self.events.append(event)

    def _carry(self, x: Any, p: int, sent: int, event: dict) -> Any:
        """On the courier's thread: the transport, until every message is here."""
        event["started"] = time.perf_counter()
        out = self.transport.move(x, p, sent)
        event["arrived"] = time.perf_counter()
        return out

    def _result(self, m: "_Message", t: int) -> Any:
        """Message m's messages, waiting at most `timeout`; a `CourierError` if the
        transfer failed or timed out."""
        if not isinstance(m.future, concurrent.futures.Future):
            return m.future
        what = f"fragment {m.fragment} (sent at step {m.sent}, due at step {t})"
        try:
            return m.future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            self.failed = True
            raise CourierError(
                f"{what}: the messages of {self.transport!r} did not arrive "
                f"within timeout={self.timeout} s"
            ) from None
        except Exception as error:
            self.failed = True
            raise CourierError(
                f"{what}: the transfer with {self.transport!r} failed: {error}"
            ) from error

    def _deliver(self, state: Any, t: int) -> Any:
        for m in self._pending.get(t, []):
            start = time.perf_counter()
            messages = self._result(m, t)
            m.event["waited"] = time.perf_counter() - start
            inbox = self.transport.put(state.inbox, messages, m.slot, m.size)
            state = state._replace(inbox=inbox)
        self._pending.pop(t, None)
        return state


class _Message(NamedTuple):
    """One fragment's messages on their way: where they go, and their transfer."""

    fragment: int
    slot: int
    size: int
    sent: int
    arrival: int
    future: Any  # a Future of the gathered messages (a mesh), or the array itself
    event: dict


def _programs(spec: StreamingSpec, mesh: Mesh | None, fsdp: bool, donate: bool):
    """The step's two halves, jitted (on the mesh, with per-replica metrics)."""

    def first(state, batch):
        return local_phase(spec, state, batch)

    def second(state, local):
        return sync_phase(spec, state, local)

    if mesh is None:
        return tuple(
            JittedStep(f, donate=donate, copy_first=donate) for f in (first, second)
        )
    return tuple(
        sharded_step(f, mesh, fsdp=fsdp, metrics="local", donate=donate)
        for f in (first, second)
    )


def _done(future: Any) -> bool:
    return not isinstance(future, concurrent.futures.Future) or future.done()


def _gather_split(metrics: Any) -> Any:
    """`metrics` with every array split across processes gathered (one collective)."""
    split = [
        x
        for x in jax.tree.leaves(metrics)
        if isinstance(x, jax.Array) and not x.is_fully_addressable
    ]
    if not split:
        return metrics
    whole = [x for x in split if x.is_fully_replicated]
    parts = [x for x in split if not x.is_fully_replicated]
    every = multihost_utils.process_allgather(parts, tiled=True)
    gathered = {id(x): y for x, y in zip(parts, every)}
    gathered.update({id(x): x.addressable_data(0) for x in whole})
    return jax.tree.map(lambda x: gathered.get(id(x), x), metrics)


def _add_means(node: Any) -> Any:
    """Metrics dicts (anywhere in `node`) with their means over replicas added."""
    if isinstance(node, dict):
        if "loss/train" not in node and "loss/replicas" in node:
            node = dict(node)
            node["loss/train"] = np.mean(node["loss/replicas"], axis=0)
            for k in [k for k in node if k.startswith("replicas/aux/")]:
                node["aux/" + k.removeprefix("replicas/aux/")] = np.mean(
                    node[k], axis=0
                )
        return node
    if isinstance(node, list | tuple):
        return type(node)(_add_means(x) for x in node)
    return node


# ----------------------------------------------------------------------------- helpers


def _read(x: Any) -> Any:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return jax.device_get(x)
