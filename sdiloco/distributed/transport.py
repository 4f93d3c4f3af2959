"""The seam between programs: what moves a fragment's packed messages.

A `Courier` runs a posted algorithm's steps; between them it hands the messages of
each fragment sent to a `Transport` and puts what comes back into the inbox. That
is the only way bytes cross from one program to another, whatever the programs are:

- `InProcess`: one program holds every replica (the simulation): the messages are
  already everywhere, so moving them is handing them on;
- `MeshAllGather`: the replicas sharded over the devices of one or many processes
  (one SPMD job): an all-gather over one communication device per process, on the
  courier's thread, beside the compute devices;
- `distributed.RayTransport`: one program per replica island (the elastic job,
  Ray actors): a round decided by the job's syncer, the messages fetched from the
  peers through Ray's object store;
- anything else: subclass `Transport` and write `move`, or give the `Courier` a
  plain function `move(messages, fragment, sent) -> messages` on NumPy arrays.

`move` gets this program's rows of a fragment's messages (`[n, b]` uint8: its
replicas', n = 1 for an island) and returns every row the exchange reads (`[R, b]`,
R = `PostedExchange.inbox_rows`), on the courier's thread when `threaded`; `take`
and `put` cut the fragment's slot out of the outbox and write the rows into the
inbox, on this program's devices (a mesh places them on its own).
"""

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

from .mesh import AXIS


class Transport:
    """What moves a fragment's messages between programs (see the module)."""

    threaded = True
    """Whether `move` runs on the courier's thread (False: in the step's own call,
    for a transport that only hands arrays on)."""

    collective = False
    """Whether `move` is a collective of this program's processes (then no other
    collective may run beside it: `Courier.exclusive` waits for it)."""

    island: tuple[int, int] | None = None
    """`(m, M)` when this program trains replica m alone, one island of a job of M
    (`lab.train.run` then builds replica m's program and feeds it replica m's
    batches); None when it holds every replica it trains."""

    def __init__(self):
        self.lock = threading.Lock()
        """Held while a transfer runs (`Courier.exclusive` takes it too)."""

    def join(self, state: Any, spec: Any) -> Any:
        """Called once, after the step is compiled and before the first step: the
        state this program starts from (a transport whose programs may come and go
        returns a live peer's when this one was restarted). Default: `state`."""
        del spec
        return state

    def between_steps(self, state: Any, spec: Any) -> Any:
        """Called after every step: the state to go on from (a transport may serve
        or take a heal here; its step count may then move on). Default: `state`."""
        del spec
        return state

    def news(self) -> list[str]:
        """Lines worth a reader's attention since the last call (who left, who is
        back), for the training loop's output. Default: none."""
        return []

    def take(self, outbox: Array, k: int, size: int) -> Any:
        """Fragment slot k's first `size` bytes of this program's rows."""
        return _take(outbox, k, size, None)

    def move(self, messages: Any, fragment: int, sent: int) -> Any:
        """Every row of fragment `fragment`'s messages, sent at step `sent`."""
        raise NotImplementedError

    def put(self, inbox: Array, messages: Any, k: int, size: int) -> Array:
        """The inbox with slot k's rows set to `messages`."""
        return _put(inbox, jnp.asarray(messages), k, size, None)

    def warm_up(self, outbox: Array, inbox: Array, k: int, size: int) -> Array:
        """Compile `take` and `put` (a process joining a running job does this
        before it joins); returns the inbox."""
        self.take(outbox, k, size)
        rows = np.zeros((inbox.shape[1], size), np.uint8)
        return self.put(inbox, rows, k, size)


class InProcess(Transport):
    """One program holds every replica: the messages are handed on."""

    threaded = False

    def __repr__(self) -> str:
        return f"processes {[jax.process_index()]}"

    def move(self, messages: Any, fragment: int, sent: int) -> Any:
        del fragment, sent
        return messages


class HostTransport(Transport):
    """A function on NumPy arrays, `move(messages, fragment, sent) -> messages`, run
    on the courier's thread: the simplest transport a user can write."""

    def __init__(self, move: Callable[..., Any]):
        super().__init__()
        self._move = move

    def __repr__(self) -> str:
        return f"transport {getattr(self._move, '__name__', repr(self._move))}"

    def move(self, messages: Any, fragment: int, sent: int) -> Any:
        return self._move(np.asarray(messages), fragment, sent)


class MeshAllGather(Transport):
    """An all-gather over `comm_mesh` (one communication device per process,
    `courier_meshes`) of the messages of the replicas sharded over `mesh`.

    XLA:CPU's gloo collectives between the same processes must not run from two
    threads at once, so the all-gather holds `lock` while it runs; on XLA:CPU a
    program with a collective also runs synchronously in the call that launches it,
    which is why it runs on the courier's thread at all.
    """

    collective = True

    def __init__(self, mesh: Mesh, comm_mesh: Mesh):
        super().__init__()
        self.mesh, self.comm_mesh = mesh, comm_mesh
        whole = NamedSharding(comm_mesh, PartitionSpec())
        self._gather = jax.jit(lambda x: x, out_shardings=whole)

    def __repr__(self) -> str:
        procs = sorted({d.process_index for d in self.comm_mesh.devices.flat})
        return f"processes {procs}"

    def take(self, outbox: Array, k: int, size: int) -> Any:
        split = NamedSharding(self.mesh, PartitionSpec(AXIS))
        return self._to_comm(_take(outbox, k, size, split))

    def move(self, messages: Any, fragment: int, sent: int) -> Any:
        del fragment, sent
        with self.lock:
            out = self._gather(messages)
            out.block_until_ready()
        return out

    def put(self, inbox: Array, messages: Any, k: int, size: int) -> Array:
        whole = NamedSharding(self.mesh, PartitionSpec())
        return _put(inbox, self._from_comm(messages), k, size, whole)

    def warm_up(self, outbox: Array, inbox: Array, k: int, size: int) -> Array:
        del outbox, k, size  # compiled at the first transfer
        return inbox

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


def as_transport(transport: Any) -> Transport:
    """`transport` itself, a plain function wrapped (`HostTransport`), or
    `InProcess` for None; anything else is a `ValueError`."""
    if transport is None:
        return InProcess()
    if isinstance(transport, Transport):
        return transport
    if callable(transport):
        return HostTransport(transport)
    raise ValueError(
        f"transport={transport!r}; allowed: a distributed.Transport, a function "
        "move(messages, fragment, sent) -> messages, or None."
    )


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
