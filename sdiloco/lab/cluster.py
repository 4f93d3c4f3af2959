"""Where a run's replicas live: one device, or a mesh across devices and processes.

The training loop (`sdiloco.lab.train.run`) is the same program on a laptop and on a
cluster; only the `Placement` differs:

- **simulation** (no mesh, one process): the M replicas are vmapped on the default
  device, the reference every other layout is checked against;
- **mesh** (`sdiloco.distributed.replica_mesh`, axes `("replica", "data")`): replicas
  over islands of devices, each replica's batch (and, with FSDP, its parameters and
  inner optimizer state) split over its island, the exchange an all-gather of the
  packed low-bit messages across `"replica"` only. The mesh may span processes: each
  process feeds its own replicas' data, every process runs the same step, process 0
  writes the history, and all of them write their shards of a checkpoint;
- **a transport** (`distributed.Transport`): the exchange posted and moved between
  steps by it (`distributed.Courier`). One whose `island` is `(m, M)` (an elastic
  job's `distributed.RayTransport`) makes this program replica m alone: its own
  share of the batch, and the transport's `join` and `between_steps` around the
  steps (a restarted island heals there).

`connect` joins the processes of a job (`jax.distributed.initialize`, which
rendezvouses on the coordinator's port with its own bounded wait) after checking the
coordinates it is given, and turns the runtime's errors into one line
(`ConnectError`). Once joined, the processes compare the job size each was given
(an all-gather over the job): processes that disagree are told, each in one line. A
coordinator that cannot be reached, or a job that never gathers its processes, ends
when JAX's `initialization_timeout` runs out, with the runtime's own fatal message
(docs/decisions.md, "the SPMD job's rendezvous").
"""

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import distributed
from ..jit import jit_step
from ..streaming import StreamingSpec
from . import data as data_lib


class ConnectError(RuntimeError):
    """The processes of a job could not be joined (see `connect`)."""


def connect(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    timeout_s: int = 300,
) -> None:
    """Join this process to its job, or do nothing for a single-process run.

    Args:
        coordinator: `HOST:PORT` of process 0 (which listens there).
        num_processes: processes in the job (>= 1), with `coordinator`.
        process_id: this process, in `[0, num_processes)`, with `coordinator`.
        auto: let `jax.distributed.initialize()` read the coordinates from the cluster
            (SLURM, Cloud TPU, Kubernetes...); the three arguments above must be None.
        timeout_s: how long to wait for every process to join.

    Raises:
        ValueError: coordinates that cannot describe a job (checked before any waiting),
            naming the field, its value and what is allowed.
        ConnectError: the job did not gather within `timeout_s` (an unreachable
            coordinator, fewer processes started than `num_processes`, ...).
    """
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if not isinstance(timeout_s, int) or isinstance(timeout_s, bool) or timeout_s < 1:
        raise ValueError(f"timeout_s={timeout_s!r}; allowed: an int >= 1 (seconds).")
    if auto:
        if any(given):
            raise ValueError(
                "auto=True detects the coordinates from the cluster; allowed: no "
                "coordinator, num_processes or process_id with it."
            )
        _initialize(dict(initialization_timeout=timeout_s), "the detected cluster")
        return
    if not any(given):
        return
    if not all(given):
        missing = [
            n
            for n, g in zip(("coordinator", "num_processes", "process_id"), given)
            if not g
        ]
        raise ValueError(
            f"a multi-process run needs coordinator, num_processes and process_id "
            f"together; missing: {missing}."
        )
    assert coordinator is not None and num_processes is not None
    assert process_id is not None
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator={coordinator!r}; allowed: HOST:PORT with a port in "
            "[1, 65535], e.g. 10.0.0.1:1234."
        )
    if not _pos_int(num_processes):
        raise ValueError(f"num_processes={num_processes!r}; allowed: an int >= 1.")
    if not (_int(process_id) and 0 <= process_id < num_processes):
        raise ValueError(
            f"process_id={process_id!r}; allowed: an int in [0, {num_processes})."
        )
    _initialize(
        dict(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
        ),
        f"coordinator {coordinator} ({num_processes} processes, this one "
        f"{process_id}, waited {timeout_s} s)",
    )
    _check_job(num_processes, process_id)


def is_primary() -> bool:
    """Whether this is process 0 (the one that writes and prints)."""
    return jax.process_index() == 0


def disconnect() -> None:
    """Leave the job joined by `connect` (nothing for a single-process run)."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()


@dataclasses.dataclass(frozen=True)
class Placement:
    """The layout of one run: the simulation (`mesh=None`) or a replica mesh.

    Build it with `Placement.of`. Every method is the same call in one process and in
    many: a process places only what its devices hold and reads only replicated
    values.
    """

    mesh: Mesh | None
    num_replicas: int
    fsdp: bool = False
    comm_mesh: Mesh | None = None
    """With a courier: one communication device per process (`courier_meshes`)."""
    transport: Any = None
    """A `distributed.Transport` that moves the posted exchange (no mesh)."""
    _couriers: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @staticmethod
    def of(
        num_replicas: int,
        mesh: Mesh | None = None,
        *,
        devices_per_replica: int | None = None,
        fsdp: bool = False,
        courier: bool = False,
        transport: Any = None,
    ) -> "Placement":
        """The placement of a run of M replicas.

        Args:
            num_replicas: M.
            mesh: a `distributed.replica_mesh(M, ...)`; default: the simulation on one
                device in a single process without `devices_per_replica` or `fsdp`,
                else a mesh over every device of the job.
            devices_per_replica: D, the size of the mesh's `"data"` axis when the mesh
                is built here (see `replica_mesh`).
            fsdp: split each replica's parameters and inner state over `"data"`.
            courier: overlap the exchange of the DiLoCo family with τ >= 1 with the
                next inner steps (`distributed.Courier`): the last device of each
                process becomes its communication device and the others compute.
                Methods without overlap keep the exchange in the step.
            transport: a `distributed.Transport` (or a function `move(messages,
                fragment, sent) -> messages`) that moves the exchange of the DiLoCo
                family between steps, for every τ, in one process without a mesh;
                one with `island=(m, M)` makes this program replica m alone.

        Raises:
            ValueError: a mesh that cannot hold M replicas (checked before any compute).
        """
        if transport is not None:
            if mesh is not None or courier or devices_per_replica is not None or fsdp:
                raise ValueError(
                    "transport= with a mesh, courier, devices_per_replica or fsdp; "
                    "allowed: a transport alone (it moves the messages of one "
                    "process's replicas)."
                )
            transport = distributed.as_transport(transport)
            island = transport.island
            if island is not None and island[1] != num_replicas:
                raise ValueError(
                    f"transport island={island} for num_replicas (M)={num_replicas}; "
                    f"allowed: an island (m, {num_replicas})."
                )
            return Placement(None, num_replicas, transport=transport)
        if courier:
            if mesh is not None:
                raise ValueError(
                    "courier=True with a mesh given; allowed: no mesh (the courier "
                    "builds its compute and communication meshes, courier_meshes)."
                )
            mesh, comm = distributed.courier_meshes(
                num_replicas, data=devices_per_replica
            )
            return Placement(mesh, num_replicas, fsdp, comm)
        wants_mesh = devices_per_replica is not None or fsdp
        if mesh is None and (jax.process_count() > 1 or wants_mesh):
            mesh = distributed.replica_mesh(num_replicas, data=devices_per_replica)
        elif mesh is not None and devices_per_replica is not None:
            raise ValueError(
                f"devices_per_replica={devices_per_replica!r} with a mesh given; "
                "allowed: one of the two (the mesh's 'data' axis is D)."
            )
        if mesh is not None:
            rows = dict(mesh.shape)[distributed.AXIS]
            if num_replicas % rows:
                raise ValueError(
                    f"num_replicas (M)={num_replicas} is not a multiple of the mesh's "
                    f"{rows} rows on axis {distributed.AXIS!r}; allowed: a mesh "
                    f"from replica_mesh({num_replicas}, ...)."
                )
        return Placement(mesh, num_replicas, fsdp)

    @property
    def primary(self) -> bool:
        """Whether this process writes the run's files and shows its progress."""
        return jax.process_index() == 0

    @property
    def island(self) -> tuple[int, int] | None:
        """`(m, M)` when this program is replica m alone (its transport's)."""
        return None if self.transport is None else self.transport.island

    @functools.cached_property
    def local_replicas(self) -> list[int]:
        """The replicas whose batches this process reads."""
        if self.island is not None:
            return [self.island[0]]
        if self.mesh is None:
            return list(range(self.num_replicas))
        return distributed.process_replicas(self.mesh, self.num_replicas)

    def exchange(self, overlap: int | Sequence[int] = 0) -> dict[str, Any]:
        """Extra arguments of a DiLoCo-family factory: the exchange on this layout.

        Args:
            overlap: the method's τ; with a courier and every τ >= 1, the exchange
                is posted (moved between steps), else it stays in the step.
        """
        if self.transport is not None:
            return {"exchange": distributed.posted_exchange(island=self.island)}
        if self.mesh is None:
            return {}
        taus = (overlap,) if isinstance(overlap, int) else tuple(overlap)
        if self.comm_mesh is not None and min(taus) >= 1:
            return {"exchange": distributed.posted_exchange(self.mesh)}
        return {"exchange": distributed.sharded_exchange(self.mesh)}

    def state(self, state: Any) -> Any:
        """Place a state (the same full value on every process)."""
        if self.island is not None:  # through the host, as a healed state comes:
            # the same types (no weak types) and device, so the step compiles once
            return jax.device_put(jax.device_get(state), jax.local_devices()[0])
        if self.mesh is None:
            return state
        return distributed.shard_state(state, self.mesh, fsdp=self.fsdp)

    def abstract(self, state: Any) -> Any:
        """`ShapeDtypeStruct`s of a state's arrays with their shardings here."""
        arrays = eqx.filter(state, eqx.is_array)
        if self.mesh is None:
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                arrays,
            )
        shardings = distributed.state_shardings(state, self.mesh, fsdp=self.fsdp)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            arrays,
            shardings,
        )

    def batch(self, iterators: Sequence[Any]) -> Any:
        """The next global batch: one `next()` of each local replica's iterator."""
        host = data_lib.stack_batches([next(iterators[m]) for m in self.local_replicas])
        if self.mesh is None:
            return host
        return distributed.shard_batch(host, self.mesh, self.num_replicas)

    def step(self, algorithm: Any) -> Callable[..., tuple[Any, Any]]:
        """The jitted, state-donating step on this layout (a `distributed.Courier`
        for a posted exchange)."""
        if self.transport is not None and isinstance(algorithm.spec, StreamingSpec):
            courier = distributed.Courier(algorithm, transport=self.transport)
            self._couriers.append(courier)
            return courier
        if self.mesh is None:
            return jit_step(algorithm)
        if isinstance(algorithm.spec, StreamingSpec) and algorithm.spec.posted:
            courier = distributed.Courier(
                algorithm, self.mesh, self.comm_mesh, fsdp=self.fsdp
            )
            self._couriers.append(courier)
            return courier
        return distributed.sharded_step(algorithm.step, self.mesh, fsdp=self.fsdp)

    def join(self, step: Any, state: Any, batch: Any, spec: Any) -> Any:
        """Before the first step: with a transport, compile every program `step`
        may run (`Courier.warm_up`, on a copy), then the transport's `join` (a
        restarted island heals there, with its programs ready). Returns the state
        to start from."""
        if self.transport is None:
            return state
        if isinstance(step, distributed.Courier):
            step.warm_up(self.state(state), batch)
        return self._placed(state, self.transport.join(state, spec))

    def between_steps(self, state: Any, spec: Any) -> Any:
        """After a step: the transport's `between_steps` (the state itself
        without one). A state it hands back in place of `state` (a heal) is
        placed here (`state`), as the first one was."""
        if self.transport is None:
            return state
        return self._placed(state, self.transport.between_steps(state, spec))

    def _placed(self, state: Any, new: Any) -> Any:
        return new if new is state else self.state(new)

    def close(self, wait: bool = True) -> None:
        """Stop the couriers' threads, after waiting (bounded) for the messages in
        flight unless `wait` is False (after an error). Idempotent."""
        while self._couriers:
            courier = self._couriers.pop()
            if wait:
                courier.close()
            else:
                courier.stop()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No courier collective runs inside the block (`Courier.exclusive`: the
        messages posted so far arrive, then each courier's lock is held).

        Every collective the training loop issues itself (the metric flush,
        evaluation, checkpoint metadata and barriers) runs inside one, and finishes
        there: XLA:CPU's gloo collectives between the same processes must not run
        from two threads at once (measured: a `gloo::EnforceNotMet` "received data
        size doesn't match expected size"). Overlap is lost only at those steps.
        """
        with contextlib.ExitStack() as stack:
            for courier in self._couriers:
                stack.enter_context(courier.exclusive())
            yield

    def metrics(self, rows: Any) -> Any:
        """Steps' metrics on the host (NumPy), with a courier's means added back."""
        if not self._couriers:
            return self.host(rows)
        return self._couriers[-1].host(rows)

    def replicated(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`fn(state)` computed on the layout, its result readable by every process."""
        if self.mesh is None:
            return fn
        whole = NamedSharding(self.mesh, PartitionSpec())
        jitted = eqx.filter_jit(
            lambda s: jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, whole), fn(s)
            )
        )

        def call(state):
            with self.exclusive():
                return jax.block_until_ready(jitted(state))

        return call

    def host(self, tree: Any) -> Any:
        """Local copies of the replicated arrays of `tree` (NumPy; others unchanged)."""

        def readable(x):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                if not x.is_fully_replicated:
                    raise ValueError(
                        f"array of shape {x.shape} is split across processes; read "
                        "it through `replicated` first."
                    )
                return x.addressable_data(0)
            return x

        # One batched transfer of every array (the training loop's metric flush).
        return jax.device_get(jax.tree.map(readable, tree))

    def local(self, tree: Any) -> Any:
        """`tree` as arrays this process can compute with alone (for evaluation).

        Arrays that span processes become local copies on this process's default
        device; the others are returned as they are.
        """
        if all(
            x.is_fully_addressable
            for x in jax.tree.leaves(tree)
            if isinstance(x, jax.Array)
        ):
            return tree
        return jax.tree.map(
            lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x,
            self.host(tree),
        )

    def gather_json(self, local: dict[int, Any]) -> dict[int, Any]:
        """Merge every process's `{replica: JSON value}` (e.g. iterator positions)."""
        if jax.process_count() == 1:
            return dict(local)
        text = json.dumps({str(k): v for k, v in local.items()}).encode()
        with self.exclusive():
            sizes = multihost_utils.process_allgather(np.array([len(text)], np.int32))
            buf = np.zeros(int(np.max(sizes)), np.uint8)
            buf[: len(text)] = np.frombuffer(text, np.uint8)
            every = multihost_utils.process_allgather(buf)
        out: dict[int, Any] = {}
        for row, size in zip(np.asarray(every), np.asarray(sizes).reshape(-1)):
            out.update({int(k): v for k, v in json.loads(bytes(row[:size])).items()})
        return out

    def describe(self, short: bool = False) -> str:
        """One line: where the replicas live (`short`: an island's name alone)."""
        if self.island is not None:
            m, count = self.island
            return (
                f"island {m}" if short else f"island {m} of {count}: {self.transport!r}"
            )
        if self.transport is not None:
            return (
                f"simulation: {self.num_replicas} replicas vmapped on one device, "
                f"the exchange moved by {self.transport!r}"
            )
        if self.mesh is None:
            return f"simulation: {self.num_replicas} replicas vmapped on one device"
        courier = ""
        if self.comm_mesh is not None:
            courier = f", a courier on {self.comm_mesh.size} communication devices"
        shape = dict(self.mesh.shape)
        return (
            f"mesh replica={shape[distributed.AXIS]} x data={shape[distributed.DATA]} "
            f"over {self.mesh.size} devices in {jax.process_count()} processes"
            f"{', FSDP' if self.fsdp else ''}{courier}; this process feeds replicas "
            f"{self.local_replicas}"
        )


# ----------------------------------------------------------------------------- helpers


def _check_job(num_processes: int, process_id: int) -> None:
    """Raise `ConnectError` on every process when the processes were given different
    job sizes (each one's `(num_processes, process_id)`, all-gathered)."""
    if jax.process_count() == 1 and num_processes == 1:
        return
    mine = np.array([num_processes, process_id], np.int32)
    given = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    sizes = {int(n) for n, _ in given}
    if len(sizes) == 1 and sizes == {jax.process_count()}:
        return
    first = {int(i): int(n) for n, i in given}
    other = next((i for i, n in first.items() if n != first.get(0)), process_id)
    raise ConnectError(
        f"process {other} was started with num_processes={first.get(other)}, "
        f"process 0 with {first.get(0)}; allowed: the same value everywhere "
        f"(the coordinator counts {jax.process_count()} processes)."
    )


def _initialize(kwargs: dict, where: str) -> None:
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # the runtime raises XlaRuntimeError or RuntimeError
        message = " ".join(str(e).split())[:300]
        raise ConnectError(f"could not join {where}: {message}") from e


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _pos_int(x: Any) -> bool:
    return _int(x) and x >= 1
