"""Replica islands that fail and rejoin: the exchange over a key-value board.

The SPMD job (`sharded_exchange`, `Courier`) runs one program over every process's
devices, so one dead process stops it. Here each replica island is a program of its
own (`num_replicas=1` in its `streaming_diloco`), and the fragments' packed messages
travel through a key-value store: JAX's coordination service (`Board`), run by a
**coordinator** process that holds no replica and is started with recoverable tasks,
so a replica process may die, and start again, without taking the service or the
other replicas with it.

One round (one fragment sent at one step), with `board_exchange` as the step's
`exchange`:

1. every replica encodes its own Δ into the packed message of `sharded_exchange`
   (`Wire`, the simulation's PRNG key of that replica) and posts it under
   `msg/<round>/<m>`; `<round>` is a digest of the step's exchange key, which every
   replica derives from the same seed, t and fragment;
2. the coordinator (`coordinate`) decides the round's **members**: the replicas whose
   message arrived before every replica it expects has arrived, or before `grace_s`
   after the first one; it posts them under `members/<round>`;
3. every replica reads the members' messages, decodes them and averages them as the
   simulation does (absent replicas as zeros, the mean rescaled to the members:
   `participation.over_senders`), so every survivor's θ_g stays bitwise equal.

A replica that misses a deadline is left out of that round and no longer waited for;
one whose message arrives after a decision is waited for again from the next round.
A dead replica therefore stalls the others once, for at most `grace_s`.

Healing (`request_heal`, `serve_heals`). A replica process started while the job runs
asks for the state of a live peer: the coordinator names one, which serialises its
whole state between two of its steps (θ_g, the outer state, the in-flight averages,
the step count, its inner optimizer state) and posts it. The returning replica takes
it, replaces its parameters by θ_g (`heal="copy"` of the simulation) and joins at its
next send. Its data position follows from the step count.

The single point of failure is the coordinator: the service lives in it, and a
replica process whose heartbeats find no service is ended by JAX's runtime after
`heartbeat_s`. Every other wait on the board is bounded; a round whose members never come raises `BoardError`
naming the round, the replica and the key, within `timeout_s`.
"""

import dataclasses
import hashlib
import io
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jaxtyping import Array, PRNGKeyArray

from .. import communication, participation
from ..compression import Compressor
from ..fragments import Fragments
from .exchange import assemble, replica_keys
from .wire import Wire


class BoardError(RuntimeError):
    """A key did not appear on the board in time, or the board is unreachable."""


class BoardProtocolError(BoardError):
    """The board answered, but not as the protocol says: it refused a request (a
    value too large, an argument it does not take), or a value read back does not
    parse. Retrying does not help; the message names the key and what was wrong."""


def runtime() -> Any:
    """JAX's coordination-service bindings: the one place the board touches JAX's
    private API.

    `jax.distributed` runs the same service and client, but keeps them in a module
    global and exposes no handle to their key-value store, nor the `recoverable`
    option a board needs (a replica process may die and connect again); so the
    board builds its own from the bindings below. `tests/test_board.py` checks that
    they still take the arguments the board passes.
    """
    from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]

    return _jax


class Board:
    """A connection to the job's key-value store (JAX's coordination service).

    Node 0 is the coordinator (`serve=True` starts the service in that process, with
    recoverable tasks); replica m is node m + 1. Opening blocks until every node has
    connected the first time (the service's start barrier); a node that connects
    again later (a restarted replica) does not wait.

    Args:
        address: `host:port` of the service.
        node: this process's node id, 0 ... num_nodes - 1.
        num_nodes: M + 1.
        serve: start the service here (the coordinator).
        heartbeat_s: seconds without a heartbeat after which the service counts a
            node as gone.
        connect_timeout_s: how long opening waits for the other nodes.
    """

    def __init__(
        self,
        address: str,
        node: int,
        num_nodes: int,
        *,
        serve: bool = False,
        heartbeat_s: int = 10,
        connect_timeout_s: int = 300,
    ):
        _jax = runtime()
        if not 0 <= node < num_nodes:
            raise ValueError(f"node={node}; allowed: 0 ... {num_nodes - 1}.")
        self.node, self.num_nodes = node, num_nodes
        self.linger_s = 2.0
        self._service = None
        if serve:
            self._service = _jax.get_distributed_runtime_service(
                address, num_nodes, heartbeat_timeout=heartbeat_s, recoverable=True
            )
        self._client = _jax.get_distributed_runtime_client(
            address,
            node,
            init_timeout=connect_timeout_s,
            heartbeat_timeout=heartbeat_s,
            shutdown_on_destruction=False,
        )
        try:
            self._client.connect()
        except Exception as e:  # noqa: BLE001 - the runtime raises its own types
            raise BoardError(
                f"node {node} could not connect to the board at {address} within "
                f"{connect_timeout_s} s: {e}"
            ) from None

    def put(self, key: str, value: bytes) -> None:
        self._call("put", key, self._client.key_value_set_bytes, key, value, True)

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of `key`, waiting at most `timeout_s` for it to be posted."""
        try:
            return self._client.blocking_key_value_get_bytes(
                key, max(1, int(timeout_s * 1000))
            )
        except Exception as e:  # noqa: BLE001 - the runtime raises its own types
            if _status(e) != "DEADLINE_EXCEEDED":
                raise self._failure("get", key, e) from None
            raise BoardError(
                f"node {self.node}: {key!r} not on the board within {timeout_s:g} s "
                f"({_cause(e)})"
            ) from None

    def try_get(self, key: str) -> bytes | None:
        """The value of `key`, or None if it is not on the board (now)."""
        try:
            return self._client.key_value_try_get_bytes(key)
        except Exception as e:  # noqa: BLE001 - the runtime raises its own types
            if _status(e) == "NOT_FOUND":
                return None
            raise self._failure("get", key, e) from None

    def keys(self, prefix: str) -> list[str]:
        """Every key under the directory `prefix` (ending in `/`)."""
        pairs = self._call("list", prefix, self._client.key_value_dir_get_bytes, prefix)
        return [k for k, _ in pairs]

    def delete(self, key: str) -> None:
        """Delete `key`, or every key under it when it is a directory."""
        self._call("delete", key, self._client.key_value_delete, key)

    def _call(self, what: str, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the runtime raises its own types
            raise self._failure(what, key, e) from None

    def _failure(self, what: str, key: str, e: Exception) -> BoardError:
        """The runtime's error as what it is: the board out of reach (the service
        gone, the link down, a call past its deadline), or a request the board
        refused (a `BoardProtocolError`)."""
        if _status(e) in _UNREACHABLE:
            return BoardError(
                f"node {self.node}: {what} {key!r} failed, the board is unreachable "
                f"({_cause(e)})"
            )
        return BoardProtocolError(
            f"node {self.node}: the board refused {what} {key!r} ({_cause(e)})"
        )

    def close(self) -> None:
        """Leave the board (the coordinator also stops the service, after the
        islands had `linger_s` to leave)."""
        try:
            self._client.shutdown()
        finally:
            if self._service is not None:
                time.sleep(self.linger_s)
                self._service.shutdown()


# --------------------------------------------------------------- the replica's side


@dataclasses.dataclass
class RoundLog:
    """What one replica saw of one round: when it posted (`time.time()`), how long
    it waited for the decision and the messages, the members, and the bytes it
    received."""

    round: str
    posted: float
    waited_s: float
    members: tuple[int, ...]
    received_bytes: int


class BoardExchange:
    """The `exchange` of a replica island's `streaming_diloco` (see the module).

    Build the island's algorithm with `num_replicas=1` and `exchange=` this; the mean
    it returns is over the members of each round among `num_replicas` islands.
    """

    def __init__(
        self, board: Board, replica: int, num_replicas: int, *, timeout_s: float = 120
    ):
        _check_replica(replica, num_replicas)
        self.board, self.replica, self.num_replicas = board, replica, num_replicas
        self.timeout_s = timeout_s
        self.rounds: list[RoundLog] = []

    def __repr__(self) -> str:
        return f"board_exchange(replica={self.replica}, M={self.num_replicas})"

    def __call__(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
    ) -> tuple[list[Array], list[Array]]:
        _check_island(deltas)
        count = self.num_replicas
        wire, keys = _island_wire(
            self.replica, count, compressor, fragments, deltas, key
        )
        message = jax.vmap(wire.encode)(deltas, keys)[0]  # [B]
        shapes = (
            jax.ShapeDtypeStruct((count,) + message.shape, jnp.uint8),
            jax.ShapeDtypeStruct((count,), jnp.bool_),
        )
        messages, present = io_callback(
            self._round, shapes, message, _key_data(key), ordered=False
        )
        recon = assemble([wire], fragments, [jax.vmap(wire.decode)(messages)])
        mean = _mean_over_members(recon, present, count)
        own = assemble([wire], fragments, [jax.vmap(wire.decode)(message[None])])
        return mean, own

    def _round(self, message: np.ndarray, key_data: np.ndarray):
        """Post this replica's message, wait for the members, read theirs."""
        name = hashlib.blake2b(
            np.asarray(key_data).tobytes(), digest_size=8
        ).hexdigest()
        out, members = board_round(
            self.board,
            self.replica,
            self.num_replicas,
            name,
            message,
            timeout_s=self.timeout_s,
            log=self.rounds,
        )
        present = np.zeros(self.num_replicas, bool)
        present[list(members)] = True
        return out, present


def board_round(
    board: Board,
    replica: int,
    num_replicas: int,
    name: str,
    message: np.ndarray,
    *,
    timeout_s: float,
    log: list[RoundLog],
    post: bool = True,
) -> tuple[np.ndarray, tuple[int, ...]]:
    """One round on the board: post `message` (unless `post` is False), wait for the
    coordinator's members, read theirs. Returns every replica's message `[M, B]`
    (zeros for those not members) and the members."""
    m, start, posted = replica, time.perf_counter(), time.time()
    own = np.asarray(message, np.uint8)
    if post:
        board.put(f"msg/{name}/{m}", own.tobytes())
        board.put(f"arrived/{name}/{m}", b"1")
    members = tuple(_ints(board.get(f"members/{name}", timeout_s), f"members/{name}"))
    out = np.zeros((num_replicas,) + own.shape, np.uint8)
    received = 0
    for j in members:
        if j == m and post:
            out[j] = own
        else:
            blob = board.get(f"msg/{name}/{j}", timeout_s)
            if len(blob) != own.size:
                raise BoardProtocolError(
                    f"msg/{name}/{j} holds {len(blob)} bytes; allowed: {own.size} "
                    "(the same run's message on every island)."
                )
            out[j] = np.frombuffer(blob, np.uint8)
            received += own.size
    log.append(RoundLog(name, posted, time.perf_counter() - start, members, received))
    return out, members


class BoardPosted:
    """The posted form of `board_exchange` (a `PostedExchange`), for τ >= 1.

    The island's step only encodes its message (with one more byte, 1, that marks
    it present); a `Courier` with a `BoardTransport` moves the round while the next
    τ steps compute and delivers every member's message into the inbox (`[K, M, B]`,
    M the islands: `inbox_rows`); the step of the outer update decodes them and
    averages over the members, as `board_exchange` does within the sending step.
    The same bytes and the same mean, so the same numbers. Without host callbacks
    in its programs, the island's step can be kept by JAX's persistent compilation
    cache, so a restarted island loads it instead of compiling it.
    """

    def __init__(self, replica: int, num_replicas: int):
        _check_replica(replica, num_replicas)
        self.replica, self.num_replicas = replica, num_replicas

    def __repr__(self) -> str:
        return f"board_posted(replica={self.replica}, M={self.num_replicas})"

    def _wire(self, compressor, fragments, deltas, key):
        m, count = self.replica, self.num_replicas
        return _island_wire(m, count, compressor, fragments, deltas, key)

    def message_bytes(self, compressor, fragments, deltas, key) -> int:
        def size(deltas, key):
            wire, keys = self._wire(compressor, fragments, deltas, key)
            return wire.encode([x[0] for x in deltas], [k[0] for k in keys])

        return int(jax.eval_shape(size, deltas, key).shape[0]) + 1

    def encode(self, compressor, fragments, deltas, key):
        _check_island(deltas)
        wire, keys = self._wire(compressor, fragments, deltas, key)
        messages = jax.vmap(wire.encode)(deltas, keys)  # [1, b]
        own = assemble([wire], fragments, [jax.vmap(wire.decode)(messages)])
        present = jnp.ones((1, 1), jnp.uint8)
        return jnp.concatenate([messages, present], axis=1), own

    def decode_mean(self, compressor, fragments, messages, deltas, key):
        wire, _ = self._wire(compressor, fragments, deltas, key)
        present = messages[:, -1] == 1
        recon = assemble([wire], fragments, [jax.vmap(wire.decode)(messages[:, :-1])])
        return _mean_over_members(recon, present, self.num_replicas)

    def inbox_rows(self, num_replicas: int) -> int:
        return self.num_replicas


class BoardTransport:
    """A `Courier`'s transport for an island: each posted fragment is one round on
    the board (`board_round`), named by the step that sent it and the fragment.

    `quiet_until`: rounds sent at or before this step are only read, not posted (a
    healed island's in-flight fragments are its peer's messages, not its own).
    """

    def __init__(
        self, board: Board, replica: int, num_replicas: int, *, timeout_s: float
    ):
        self.board, self.replica, self.num_replicas = board, replica, num_replicas
        self.timeout_s = timeout_s
        self.quiet_until = 0
        self.rounds: list[RoundLog] = []

    def __repr__(self) -> str:
        return f"the board's islands (replica {self.replica} of {self.num_replicas})"

    def __call__(self, messages: np.ndarray, fragment: int, sent: int) -> np.ndarray:
        out, _ = board_round(
            self.board,
            self.replica,
            self.num_replicas,
            f"{sent}-{fragment}",
            messages[0],
            timeout_s=self.timeout_s,
            log=self.rounds,
            post=sent > self.quiet_until,
        )
        return out


def _check_replica(replica: int, num_replicas: int) -> None:
    if not 0 <= replica < num_replicas:
        raise ValueError(
            f"replica={replica}; allowed: 0 ... num_replicas - 1 = {num_replicas - 1}."
        )


def _island_wire(replica, num_replicas, compressor, fragments, deltas, key):
    """The packed format of island `replica`'s message and its PRNG keys (those the
    simulation gives that replica, so the bytes are the simulation's)."""
    keys = [
        k[replica : replica + 1] for k in replica_keys(key, len(deltas), num_replicas)
    ]
    return Wire(compressor, fragments, deltas, keys, 0), keys


def _check_island(deltas: list[Array]) -> None:
    if deltas[0].shape[0] != 1:
        raise ValueError(
            f"a board exchange carries one replica per island; got "
            f"{deltas[0].shape[0]} (build the island with num_replicas=1)."
        )


def _mean_over_members(
    recon: list[Array], present: Array, num_replicas: int
) -> list[Array]:
    """The mean of the members' reconstructions: absent ones as zeros, the mean
    rescaled to the members (`participation.over_senders`), as the simulation."""
    recon = [participation.where_replicas(present, r, jnp.zeros_like(r)) for r in recon]
    mean = communication.average(recon)
    return participation.over_senders(mean, jnp.sum(present), num_replicas)


def board_exchange(
    board: Board, replica: int, num_replicas: int, *, timeout_s: float = 120
) -> BoardExchange:
    """The exchange of replica island `replica` of `num_replicas` over `board`."""
    return BoardExchange(board, replica, num_replicas, timeout_s=timeout_s)


# ---------------------------------------------------------------------- healing


def request_heal(
    board: Board, replica: int, template: Any, timeout_s: float
) -> tuple[Any, int]:
    """A live peer's state, for a replica that comes back (see the module).

    Posts the request, waits (at most `timeout_s`) for the state a peer serialised,
    and reads it into the structure of `template` (a state of the same algorithm).
    Returns `(state, bytes received)`.
    """
    nonce = f"{time.time_ns()}"
    board.put(f"heal/want/{replica}", nonce.encode())
    key = f"heal/state/{replica}/{nonce}"
    blob = board.get(key, timeout_s)
    board.delete(key)
    try:
        state = eqx.tree_deserialise_leaves(io.BytesIO(blob), _host(template))
    except (RuntimeError, ValueError, TypeError, EOFError) as e:
        raise BoardProtocolError(
            f"{key!r}: {len(blob)} bytes that are not a state of this run ({e}); "
            "allowed: a peer of the same run (the same flags on every island)."
        ) from None
    return state, len(blob)


def serve_heals(board: Board, replica: int, state: Any) -> int:
    """If the coordinator asked this replica to heal a peer, post `state` for it.

    Call between steps (the state is read, not donated). Returns the bytes posted
    (0 when nobody asked).
    """
    ask = board.try_get(f"heal/serve/{replica}")
    if ask is None:
        return 0
    board.delete(f"heal/serve/{replica}")
    peer, _, nonce = ask.decode(errors="replace").partition(":")
    if not peer.isdigit() or not nonce:
        raise BoardProtocolError(
            f"heal/serve/{replica} holds {ask[:40]!r}; allowed: '<replica>:<nonce>'."
        )
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, _host(state))
    board.put(f"heal/state/{peer}/{nonce}", buffer.getvalue())
    return len(buffer.getvalue())


# ------------------------------------------------------------------ the coordinator


@dataclasses.dataclass
class Decision:
    """One round as the coordinator decided it."""

    round: str
    members: tuple[int, ...]
    waited_s: float  # from the first message to the decision
    timed_out: bool  # decided at the grace deadline (an expected replica missing)


def coordinate(
    board: Board,
    num_replicas: int,
    *,
    grace_s: float,
    stop: Callable[[], bool],
    start_s: float = 300.0,
    poll_s: float = 0.005,
    keep_s: float = 60.0,
) -> list[Decision]:
    """The coordinator's loop: decide every round's members, route heal requests.

    Runs until every island it expects has posted `done/<m>`, or `stop()` is true.
    A round's members are the replicas whose message has arrived when every
    expected replica has, or `grace_s` after the first message.
    Expected: every replica at the start; one that misses a deadline is not waited
    for until its message arrives again (late, or after it healed and said hello).
    No round is decided before every island has said hello (it has compiled its
    step and is about to train) or `start_s` has passed, so that the islands' unequal
    start-up is not taken for a failure. Messages of decided rounds are deleted
    `keep_s` later.

    Returns:
        The decisions, in the order they were made.
    """
    expected = set(range(num_replicas))
    first: dict[str, float] = {}
    decided: dict[str, float] = {}
    decisions: list[Decision] = []
    began, greeted = time.perf_counter(), set()
    route, recent = HealRouter(), ()
    while not stop():
        time.sleep(poll_s)
        now = time.perf_counter()
        done = {int(k.rsplit("/", 1)[1]) for k in board.keys("done/")}
        if done and expected <= done:  # every live island has finished
            break
        for key in board.keys("hello/"):
            greeted.add(int(key.rsplit("/", 1)[1]))
            expected.add(int(key.rsplit("/", 1)[1]))
            board.delete(key)
        route(board, expected, recent)
        if len(greeted) < num_replicas and now - began < start_s:
            continue  # still starting
        for name, arrived in _arrivals(board).items():
            if name in decided:  # late: alive, wait for it from the next round
                expected |= arrived
                board.delete(f"arrived/{name}")
                continue
            first.setdefault(name, now)
            timed_out = now - first[name] >= grace_s
            if expected <= arrived or timed_out:
                members = tuple(sorted(arrived))
                board.put(f"members/{name}", _bytes(members))
                board.delete(f"arrived/{name}")
                if timed_out:
                    expected = set(arrived)
                decided[name], recent = now, members
                decisions.append(Decision(name, members, now - first[name], timed_out))
        for name, at in list(decided.items()):
            if now - at > keep_s and at > 0:
                board.delete(f"msg/{name}")
                board.delete(f"members/{name}")
                decided[name] = -1.0  # remembered, so that late arrivals are known
    return decisions


class HealRouter:
    """The coordinator's routing of heal requests (`request_heal`) to live peers.

    A request goes to a peer that is live (in the coordinator's expected set), is
    not itself waiting for a heal and is not serving another request; members of
    the latest decided round come first (they are training now). Two islands
    restarted at once are therefore never routed to each other, and a peer serves
    one request at a time. A request routed to a peer that then leaves the live set
    (it missed a deadline: it died before it served) or asks for a heal itself (it
    died and came back) is routed again.
    """

    def __init__(self):
        self.routed: dict[int, tuple[int, str]] = {}  # peer -> (asker, nonce)

    def __call__(
        self, board: "Board", live: set[int], recent: tuple[int, ...] = ()
    ) -> None:
        askers = {int(k.rsplit("/", 1)[1]) for k in board.keys("heal/want/")}
        for peer, (asker, nonce) in list(self.routed.items()):
            if board.try_get(f"heal/serve/{peer}") is None:  # the peer took it
                del self.routed[peer]
            elif peer not in live or peer in askers:  # it died, or came back
                board.delete(f"heal/serve/{peer}")
                del self.routed[peer]
                if asker not in askers:  # ask again (a newer request stands)
                    board.put(f"heal/want/{asker}", nonce.encode())
                    askers.add(asker)
        busy = askers | set(self.routed) | {a for a, _ in self.routed.values()}
        for asker in sorted(askers):
            nonce = board.try_get(f"heal/want/{asker}")
            peers = sorted(live - busy, key=lambda p: (p not in recent, p))
            if nonce is None or not peers:
                continue  # asked again later, or when a peer is free
            board.delete(f"heal/want/{asker}")
            board.put(f"heal/serve/{peers[0]}", f"{asker}:{nonce.decode()}".encode())
            self.routed[peers[0]] = (asker, nonce.decode())
            busy.add(peers[0])


def _arrivals(board: Board) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for key in board.keys("arrived/"):
        _, name, m = key.split("/")
        out.setdefault(name, set()).add(int(m))
    return out


_UNREACHABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "ABORTED"}
"""The runtime's status codes that mean the service is out of reach, not that it
refused the request."""


def _status(e: Exception) -> str:
    """The runtime's status code at the head of its message (`"NOT_FOUND: ..."`),
    or "" when there is none."""
    head = str(e).split(":", 1)[0].strip()
    return head if head.isupper() and head.replace("_", "").isalpha() else ""


def _cause(e: Exception) -> str:
    """The runtime's error in one short line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _bytes(members: tuple[int, ...]) -> bytes:
    return ",".join(map(str, members)).encode()


def _ints(blob: bytes, key: str) -> list[int]:
    """The replicas listed in `blob` (`_bytes`), or a `BoardProtocolError`."""
    try:
        return [int(x) for x in blob.decode().split(",") if x]
    except (UnicodeDecodeError, ValueError):
        raise BoardProtocolError(
            f"{key!r} holds {blob[:40]!r}; allowed: replica ids joined by ','."
        ) from None


def _host(tree: Any) -> Any:
    """The state's arrays as NumPy, for serialisation."""
    return jax.device_get(tree)


def _key_data(key: Array) -> Array:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return jnp.asarray(key)
