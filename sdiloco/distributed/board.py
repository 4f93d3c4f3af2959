"""Replica islands that fail and rejoin: the exchange over the job's board.

The SPMD job (`sharded_exchange`, `Courier`) runs one program over every process's
devices, so one dead process stops it. Here each replica island is a program of its
own (`num_replicas=1` in its `streaming_diloco`), and the programs meet on a
**board**: a key-value store served over TCP by a **coordinator** process that holds
no replica (`coordinator.BoardServer`, `net`), which a replica process may leave (it
dies) and join again (it is started again) without taking the board or the other
replicas with it.

One round (one fragment sent at one step), named `<sent step>-<fragment>`
(`round_name`):

1. every replica encodes its own Δ into the packed message of `sharded_exchange`
   (`Wire`, the simulation's PRNG key of that replica) and posts it
   (`msg/<round>/<m>`, then `arrived/<round>/<m>`);
2. the coordinator decides the round's **members**: the replicas whose message
   arrived before every replica it expects has arrived, or before `grace_s` after
   the first one; it posts them under `members/<round>`;
3. every replica reads the members' messages, decodes them and averages them as the
   simulation does (absent replicas as zeros, the mean rescaled to the members:
   `participation.over_senders`), so every survivor's θ_g stays bitwise equal.

A replica that misses a deadline is left out of that round and no longer waited for
(`coordinator.Coordinator` says when it is waited for again). A dead replica
therefore stalls the others once, for at most `grace_s`.

Healing (`request_heal`, `serve_heal`). A replica process started while the job runs
asks for the state of a live peer: the coordinator names one, which serialises its
whole state between two of its steps (θ_g, the outer state, the in-flight averages,
the step count, its inner optimizer state) and offers it from its own store (a
`net.Depot`); the returning replica fetches it from there, replaces its parameters
by θ_g (`heal="copy"` of the simulation) and joins at its next send. Its data
position follows from the step count.

The single point of failure is the coordinator: the board lives in it, and a replica
that cannot reach it for `heartbeat_s` stops with `BoardLost` (one line). Every
other wait on the board is bounded; a round whose members never come raises
`BoardError` naming the round, the replica and the key, within `timeout_s`.
"""

import dataclasses
import hashlib
import io
import threading
import time
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
from . import net
from .exchange import assemble, replica_keys
from .wire import Wire


class BoardError(RuntimeError):
    """A key did not appear on the board in time, or the board could not be used."""


class BoardProtocolError(BoardError):
    """The board answered, but not as the protocol says: it refused a request, or a
    value read back does not parse. Retrying does not help; the message names the
    key and what was wrong."""


class BoardLost(BoardError):
    """The board could not be reached for longer than the heartbeat: the
    coordinator is gone, or this process's link has been down that long."""


class Board:
    """A connection to the job's board: the coordinator's `net.Store`, over TCP.

    Replica m is node m + 1 (the coordinator, which serves the board in its own
    process, is node 0). Every call is one request on a connection of the calling
    thread, answered in turn; requests are idempotent, so one whose connection
    failed is sent again on a new one.

    The heartbeat. A background thread asks the board for this node's mail every
    `beat_s` (the coordinator's requests to it: `mail`), which also tells the
    board it is alive. Any call that cannot reach the board is tried again until
    the board has been silent for `heartbeat_s`; then it raises `BoardLost`, and so
    does `check` once the background thread has seen that. A process stopped
    (SIGSTOP) or a link down for less than the heartbeat therefore goes on where it
    was; the board's side of the connection never ends a process. A process that
    was stopped longer goes on as well if the board answers when it wakes.

    Args:
        address: `host:port` of the coordinator's board.
        node: this process's node id.
        heartbeat_s: how long the board may be out of reach before calls give up.
        connect_timeout_s: how long opening waits for the board to be up (the
            coordinator may start after the islands).
        mailbox: the key prefix of this node's mail (`to/<m>/`), or None.
        chunk_bytes: bytes per chunk of a value on the wire (`net.CHUNK`).
        name: who this is, in errors (default `node <node>`).
    """

    def __init__(
        self,
        address: str,
        node: int,
        *,
        heartbeat_s: float = 10.0,
        connect_timeout_s: float = 300.0,
        mailbox: str | None = None,
        chunk_bytes: int = net.CHUNK,
        name: str | None = None,
    ):
        net.split_address(address)  # a ValueError naming it
        self.address, self.node, self.heartbeat_s = address, node, heartbeat_s
        self.name = f"node {node}" if name is None else name
        self.chunk, self.mailbox = chunk_bytes, mailbox
        self.progress_s = min(5.0, max(0.5, heartbeat_s / 2))
        self.beat_s = 0.1 if mailbox else max(0.1, heartbeat_s / 4)
        self.last_ok = time.monotonic()
        self.lost: BoardLost | None = None
        self.mail: dict[str, bytes] = {}
        self._local = threading.local()
        self._conns: list[net.Connection] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._open(connect_timeout_s)
        self._beat = threading.Thread(
            target=self._beats, name="sdiloco-board-beat", daemon=True
        )
        self._beat.start()

    def put(self, key: str, value: Any) -> None:
        self._request("put", net.PUT, key, value)

    def get(self, key: str, timeout_s: float) -> bytearray:
        """The value of `key`, waiting at most `timeout_s` for it to be posted."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            wait = max(0.0, min(left, self.progress_s))
            status, value = self._request("get", net.GET, key, b"", wait)
            if status == net.OK:
                return value
            if left <= wait:
                raise BoardError(
                    f"{self.name}: {key!r} not on the board within {timeout_s:g} s"
                )

    def try_get(self, key: str) -> bytes | None:
        """The value of `key`, or None if it is not on the board (now)."""
        status, value = self._request("get", net.GET, key)
        return bytes(value) if status == net.OK else None

    def items(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every key under `prefix`, with its value."""
        return net.decode_items(self._request("list", net.ITEMS, prefix)[1])

    def keys(self, prefix: str) -> list[str]:
        """Every key under the directory `prefix` (ending in `/`)."""
        return [k for k, _ in self.items(prefix)]

    def delete(self, key: str) -> None:
        """Delete `key`, and every key under it."""
        self._request("delete", net.DELETE, key)

    def check(self) -> None:
        """Raise `BoardLost` if the heartbeat found the board gone."""
        if self.lost is not None:
            raise self.lost

    def take_mail(self) -> dict[str, bytes]:
        """The mail received since the last call (key without the prefix: value)."""
        with self._lock:
            mail, self.mail = self.mail, {}
        return mail

    def local_host(self) -> str:
        """This process's address as the board sees it (where peers reach it)."""
        return self._conn().sock.getsockname()[0]

    def close(self) -> None:
        """Stop the heartbeat and close every connection."""
        self._stop.set()
        self._beat.join(timeout=self.progress_s + 1)
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()

    # ------------------------------------------------------------------ helpers

    def _open(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._conn()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise BoardError(
                        f"{self.name} could not connect to the board at "
                        f"{self.address} within {timeout_s:g} s ({_cause(e)})"
                    ) from None
                time.sleep(0.2)

    def _conn(self) -> net.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = net.Connection(
                self.address,
                node=self.node,
                progress_s=self.progress_s,
                chunk_bytes=self.chunk,
            )
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def _request(
        self, what: str, op: int, key: str, value: Any = b"", wait_s: float = 0.0
    ) -> tuple[int, bytearray]:
        """One request, sent again on a new connection until it is answered or the
        board has been out of reach for the heartbeat (`BoardLost`)."""
        while True:
            try:
                reply = self._conn().request(op, key, value, wait_s)
            except net.RequestRefused as e:
                raise BoardProtocolError(
                    f"{self.name}: the board refused {what} {key!r} ({e})"
                ) from None
            except OSError as e:
                self._reconnect(e)
                continue
            self.last_ok = time.monotonic()
            return reply

    def _reconnect(self, error: Exception) -> None:
        """After a failed request: a new connection, tried until the board has been
        silent for `heartbeat_s` (then `BoardLost`)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()
        while True:
            try:
                self._conn()
                return
            except OSError as e:
                error = e
            silent = time.monotonic() - self.last_ok
            if silent > self.heartbeat_s or self._stop.is_set():
                self.lost = BoardLost(
                    f"{self.name}: lost the board at {self.address} for "
                    f"{silent:.0f} s (heartbeat {self.heartbeat_s:g} s, "
                    f"{_cause(error)}); start the same command again to heal"
                )
                raise self.lost
            time.sleep(0.2)

    def _beats(self) -> None:
        """The heartbeat: fetch this node's mail (and so say it is alive)."""
        while not self._stop.wait(self.beat_s):
            try:
                if self.mailbox is None:
                    self._request("beat", net.GET, "beat/")
                    continue
                for key, value in self.items(self.mailbox):
                    with self._lock:
                        self.mail[key.removeprefix(self.mailbox)] = value
                    self.delete(key)
            except BoardLost:
                return  # `check` raises it in the training loop
            except BoardProtocolError:
                continue  # a reply that did not parse: the next beat asks again


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
        self, board: Board, replica: int, num_replicas: int, *, timeout_s: float = 120.0
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
    board: Board, replica: int, num_replicas: int, *, timeout_s: float = 120.0
) -> BoardExchange:
    """The exchange of replica island `replica` of `num_replicas` over `board`."""
    return BoardExchange(board, replica, num_replicas, timeout_s=timeout_s)


# ---------------------------------------------------------------------- healing


def request_heal(
    board: Board, replica: int, template: Any, timeout_s: float
) -> tuple[Any, int]:
    """A live peer's state, for a replica that comes back (see the module).

    Posts the request (`heal/want/<m>`), waits (at most `timeout_s` in all) for the
    peer the coordinator chose to offer its state, fetches it from that peer's
    depot, and reads it into the structure of `template` (a state of the same
    algorithm). A fetch that fails (the peer died meanwhile) asks again at once.
    Returns `(state, bytes received)`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        nonce = f"{time.time_ns()}"
        board.put(f"heal/want/{replica}", nonce.encode())
        ready = f"heal/ready/{replica}/{nonce}"
        where = board.get(ready, max(0.0, deadline - time.monotonic()))
        board.delete(ready)
        try:
            blob = net.fetch(
                bytes(where).decode(),
                f"heal/{replica}/{nonce}",
                progress_s=board.progress_s,
                chunk_bytes=board.chunk,
            )
        except OSError:
            blob = None  # the peer is gone: ask again
        if blob is not None:
            break
    board.put(f"heal/got/{replica}/{nonce}", b"1")
    try:
        state = eqx.tree_deserialise_leaves(io.BytesIO(blob), _host(template))
    except (RuntimeError, ValueError, TypeError, EOFError) as e:
        raise BoardProtocolError(
            f"heal/{replica}/{nonce}: {len(blob)} bytes that are not a state of this "
            f"run ({e}); allowed: a peer of the same run (the same flags everywhere)."
        ) from None
    return state, len(blob)


def serve_heal(board: Any, depot: net.Depot, ask: bytes, state: Any) -> int:
    """Offer `state` to the peer that `ask` (`"<replica>:<nonce>"`, the mail
    `serve` from the coordinator) names: serialised now (call it between steps;
    the state is read, not donated), sent from the depot's thread when the peer
    fetches it. Returns the bytes offered."""
    peer, _, nonce = bytes(ask).decode(errors="replace").partition(":")
    if not peer.isdigit() or not nonce:
        raise BoardProtocolError(
            f"a heal request {bytes(ask)[:40]!r}; allowed: '<replica>:<nonce>'."
        )
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, _host(state))
    depot.offer(f"heal/{peer}/{nonce}", buffer.getbuffer())
    board.put(f"heal/ready/{peer}/{nonce}", depot.address.encode())
    return buffer.getbuffer().nbytes


def _cause(e: Exception) -> str:
    """The runtime's error in one short line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _ints(blob: bytes | bytearray, key: str) -> list[int]:
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
