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

import concurrent.futures
import dataclasses
import io
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .. import streaming
from . import net
from .transport import Transport


class Keys:
    """Every key of the board, in one place: what the islands and the coordinator
    write and read. A round is named `round_name(sent, fragment)`; m is an island."""

    MESSAGES, ARRIVED, GOT = "msg/", "arrived/", "got/"
    HELLO, DONE, WANT = "hello/", "done/", "heal/want/"
    START, END = "start", "end"
    """`start`: every island may take its first step; `end`: every island is done
    (those that finished first and stayed to serve heals may leave)."""

    @staticmethod
    def message(name: str, m: int | None = None) -> str:
        """Island m's message of round `name` (the board's copy, and the key in
        every depot), or the round's directory."""
        return f"msg/{name}" if m is None else f"msg/{name}/{m}"

    @staticmethod
    def arrived(name: str, m: int | None = None) -> str:
        return f"arrived/{name}" if m is None else f"arrived/{name}/{m}"

    @staticmethod
    def got(name: str, m: int | None = None) -> str:
        """Island m read every message of round `name` (its copies can go)."""
        return f"got/{name}" if m is None else f"got/{name}/{m}"

    @staticmethod
    def members(name: str) -> str:
        return f"members/{name}"

    @staticmethod
    def island(what: str, m: int) -> str:
        """`hello`, `joined`, `done` or `depot` (where its depot is) of island m."""
        return f"{what}/{m}"

    @staticmethod
    def mail(m: int, what: str = "") -> str:
        """Island m's mailbox (`serve`: a heal to serve; `behind`), or its prefix."""
        return f"to/{m}/{what}"

    @staticmethod
    def heal(what: str, m: int, nonce: str | None = None) -> str:
        """`want` (island m asks), `ready` (its state is offered: where), `got`
        (it has it), or the depot key of the state itself (`state`)."""
        if what == "want":
            return f"heal/want/{m}"
        if what == "state":
            return f"heal/{m}/{nonce}"
        return f"heal/{what}/{m}/{nonce}"


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
        mailbox: the key prefix of this node's mail (`to/<m>/`), or None. The
            heartbeat moves each letter into `mail` (by key: an unread letter is
            replaced by a newer one) and clears only the value it read, so a letter
            put meanwhile waits for the next beat.
        chunk_bytes: bytes per chunk of a value on the wire (`net.CHUNK`).
        name: who this is, in errors (default `node <node>`).
        say: where to write one line when opening has to wait for the board (e.g.
            `print` to stderr); None says nothing.
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
        say: Callable[[str], None] | None = None,
    ):
        net.split_address(address)  # a ValueError naming it
        self.say = say
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

    def delete_if(self, key: str, value: Any) -> bool:
        """Delete `key` only while it holds `value` (what the caller read); whether
        it did. A value put since stays."""
        return self._request("clear", net.DELETE_IF, key, value)[0] == net.OK

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
        said = False
        while True:
            try:
                self._conn()
                return
            except OSError as e:
                if self.say is not None and not said:  # once, when the wait starts
                    self.say(
                        f"{self.name}: waiting up to {timeout_s:g} s for the board "
                        f"at {self.address} ({_cause(e)}): the job's coordinator "
                        "(python -m sdiloco coordinate) must be running there"
                    )
                    said = True
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
                    self.delete_if(key, value)  # a letter put since: next beat
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


class Rounds:
    """One island's rounds (see the module): its message offered from its own depot
    and one copy put on the board, the arrival; every member's message fetched from
    its owner's depot, in parallel, or, when the owner is gone, from the board's
    copy or from another member that read it (each island offers what it read for
    `keep_s`, for a peer that reads the round late).

    The coordinator so carries one copy of each message in, and out only for an
    island whose owner is gone; the islands carry the rest.
    """

    def __init__(
        self,
        board: Board,
        depot: net.Depot,
        replica: int,
        num_replicas: int,
        *,
        timeout_s: float,
        keep_s: float = 30.0,
    ):
        _check_replica(replica, num_replicas)
        self.board, self.depot, self.timeout_s = board, depot, timeout_s
        self.replica, self.num_replicas, self.keep_s = replica, num_replicas, keep_s
        self.log: list[RoundLog] = []
        self.reply_s = min(2.0, board.progress_s)
        self._where: dict[int, str] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, num_replicas - 1), thread_name_prefix="sdiloco-fetch"
        )

    def __call__(
        self, name: str, message: Any, *, post: bool = True, inbox: Any = None
    ) -> tuple[np.ndarray, tuple[int, ...]]:
        """One round: post `message` (unless `post` is False: read only), wait for
        the members, read theirs. Returns every island's message `[M, B]` (zeros
        for those not members; written into `inbox` when given) and the members."""
        m, start, posted = self.replica, time.perf_counter(), time.time()
        own = np.ascontiguousarray(message, np.uint8)
        if post:
            self.depot.offer(Keys.message(name, m), own)
            self.board.put(Keys.message(name, m), own)  # the board's copy: the arrival
            self.board.put(Keys.arrived(name, m), b"1")
        key = Keys.members(name)
        members = tuple(_ints(self.board.get(key, self.timeout_s), key))
        out = np.zeros((self.num_replicas,) + own.shape, np.uint8)
        out = out if inbox is None else inbox
        others = [j for j in members if not (j == m and post)]
        reads = [
            self._pool.submit(self._read, name, j, members, out[j]) for j in others
        ]
        for read in reads:
            read.result()
        if post and m in members:
            out[m] = own
        for j in set(range(self.num_replicas)) - set(members):
            out[j] = 0
        self.board.put(Keys.got(name, m), b"1")
        self.depot.prune(Keys.MESSAGES, self.keep_s)
        waited = time.perf_counter() - start
        self.log.append(RoundLog(name, posted, waited, members, own.size * len(others)))
        return out, members

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _read(self, name: str, j: int, members: tuple[int, ...], row: Any) -> None:
        """Member j's message into `row`: from j's depot, else the board's copy,
        else the depot of another member that read it."""
        key = Keys.message(name, j)
        if not self._fetch(j, key, row):
            copy = self.board.try_get(key)
            if copy is not None:
                _check_size(key, len(copy), row.size)
                row[:] = np.frombuffer(copy, np.uint8)
            elif not any(self._fetch(k, key, row) for k in members if k != j):
                raise BoardError(
                    f"{key!r}: island {j}'s message is on no live island nor on "
                    "the board"
                )
        self.depot.offer(key, row)  # for a peer that reads the round late

    def _fetch(self, k: int, key: str, row: Any) -> bool:
        """Whether island k's depot gave `key` into `row`. A depot that does not
        answer within `reply_s` (its process stopped, its link down) is passed
        over at once: the board's copy is there."""
        if k == self.replica:
            return False
        for fresh in (False, True):
            where = self._address(k, fresh)
            if where is None:
                return False
            try:
                got = net.fetch(
                    where,
                    key,
                    progress_s=self.board.progress_s,
                    reply_s=self.reply_s,
                    into=row,
                )
            except TimeoutError:
                return False
            except OSError:
                continue  # gone, or restarted elsewhere: ask the board again
            if got is None:
                return False
            _check_size(key, len(got), row.size)
            return True
        return False

    def _address(self, k: int, fresh: bool) -> str | None:
        if fresh or k not in self._where:
            where = self.board.try_get(Keys.island("depot", k))
            if where is None:
                return None
            self._where[k] = bytes(where).decode()
        return self._where[k]


class BoardTransport(Transport):
    """The transport of island `replica` of an elastic job of `num_replicas` (a
    `transport.Transport`): it moves each fragment posted as one round (`Rounds`,
    named by the step that sent it and the fragment), and it is how the island
    joins the job and keeps up with it (`lab.train.run(..., transport=...)` calls
    `join` once and `between_steps` after every step):

    - `join`: an island the board has seen before (`joined/<m>`) was restarted: it
      heals from a live peer; then it says hello and waits until the whole job has;
    - `between_steps`: the coordinator's mail. A heal to serve is offered from the
      island's depot (a failure is one line and never ends the island); word that it
      fell behind makes it heal as a restarted island does;
    - `news`: one line when a round leaves a peer out, one when a peer is back.

    A healed state's in-flight fragments are its peer's messages: rounds sent at or
    before the step it healed at are read, not posted (`quiet_until`).

    Args:
        board: the island's connection to the board.
        depot: where its messages and the heals it serves leave from.
        timeout_s: the longest any wait on the board lasts (`BoardError`).
        start_s: how long `join` waits for the whole job's hello.
        say: where the island's lines go (default: stderr, prefixed "island m:").
    """

    def __init__(
        self,
        board: Board,
        replica: int,
        num_replicas: int,
        *,
        depot: net.Depot,
        timeout_s: float,
        start_s: float = 300.0,
        say: Any = None,
    ):
        super().__init__()
        self.board, self.depot = board, depot
        self.replica, self.num_replicas = replica, num_replicas
        self.island = (replica, num_replicas)
        self.timeout_s, self.start_s = timeout_s, start_s
        self.round = Rounds(board, depot, replica, num_replicas, timeout_s=timeout_s)
        self.rounds = self.round.log
        self.quiet_until = 0
        self.healed: dict[str, Any] = {}
        """`seconds`, `bytes` and `why` of the last heal (empty: none)."""
        self.served = 0
        """Bytes of the heals this island served."""
        self.joined_at: float | None = None
        """`time.time()` when it joined the rounds (after a heal, if any)."""
        self.first_step = 0
        """The step it joined at (a restarted island: its peer's)."""
        self.ready_at = 0.0
        """`time.perf_counter()` when `join` began: its programs were ready."""
        self._members = Membership(num_replicas)
        self._say = say or (
            lambda text: print(f"island {replica}: {text}", file=sys.stderr, flush=True)
        )

    def __repr__(self) -> str:
        return f"the board's islands (replica {self.replica} of {self.num_replicas})"

    def move(self, messages: Any, fragment: int, sent: int) -> np.ndarray:
        name = round_name(sent, fragment)
        post = sent > self.quiet_until
        out, _ = self.round(name, np.asarray(messages)[0], post=post)
        return out

    def join(self, state: Any, spec: Any) -> Any:
        self.ready_at = time.perf_counter()  # its programs are compiled (or loaded)
        board, m = self.board, self.replica
        if board.try_get(Keys.island("joined", m)) is not None:
            state = self.heal(state, spec, "restarted")
        board.put(Keys.island("joined", m), b"1")
        board.put(Keys.island("hello", m), b"1")
        board.get(Keys.START, self.start_s)  # every island starts together
        self.joined_at, self.first_step = time.time(), int(state.step)
        return state

    def between_steps(self, state: Any, spec: Any) -> Any:
        self.board.check()  # `BoardLost` once the board has been gone too long
        mail = self.board.take_mail()
        if "serve" in mail:
            self._serve(mail["serve"], state)
        if "behind" not in mail:
            return state
        self._say(f"behind by {mail['behind'].decode()} s at step {int(state.step)}")
        state = self.heal(state, spec, "behind")
        self.board.put(Keys.island("hello", self.replica), b"1")
        return state

    def heal(self, state: Any, spec: Any, why: str) -> Any:
        """A live peer's state with θ_g as this island's parameters (`heal="copy"`
        of the simulation: the peer's inner state); the training loop places it
        (`lab.cluster.Placement`)."""
        asked = time.perf_counter()
        state, size = request_heal(self.board, self.replica, state, self.timeout_s)
        state = streaming.adopt_global(spec, state)
        self.quiet_until = int(state.step)
        seconds = time.perf_counter() - asked
        self.healed = {"seconds": seconds, "bytes": size, "why": why}
        self._say(f"healed at step {int(state.step)} ({size} bytes)")
        return state

    def serve_until_end(self, state: Any, poll_s: float = 0.05) -> None:
        """After its last step: serve the heals peers still ask for, with this final
        `state`, until the coordinator says every island is done (`Keys.END`), the
        board is gone, or `timeout_s` has passed. An island told it is behind in a
        run's last seconds can so heal from a peer that has finished (it then has
        the final state and finishes too) instead of waiting for a peer that left."""
        deadline = time.monotonic() + self.timeout_s
        try:
            while self.board.try_get(Keys.END) is None:
                if time.monotonic() > deadline:
                    self._say("left with the job not over (no end on the board)")
                    return
                mail = self.board.take_mail()
                if "serve" in mail and (served := self._serve(mail["serve"], state)):
                    self._say(f"served a heal after its last step ({served} bytes)")
                time.sleep(poll_s)
        except BoardError:
            return  # the board is gone: the job is over

    def _serve(self, request: bytes, state: Any) -> int:
        """Serve the heal a peer asked for (`request`) with `state`; returns the
        bytes served. A failure is one line, 0 bytes, and never ends the island;
        only a lost board does (`BoardLost`)."""
        try:
            served = serve_heal(self.board, self.depot, request, state)
        except BoardLost:
            raise
        except Exception as e:  # noqa: BLE001 - serving never ends the island
            self._say(f"a heal it served failed: {e}")
            return 0
        self.served += served
        return served

    def news(self) -> list[str]:
        return self._members.news(self.rounds)

    def close(self) -> None:
        """Stop fetching (the depot and the board are the caller's)."""
        self.round.close()


class Membership:
    """Who took part in the rounds an island has seen, and what changed: one line
    when a round leaves a peer out, one when a peer is back."""

    def __init__(self, num_replicas: int):
        self.last, self.seen = set(range(num_replicas)), 0

    def news(self, rounds: list[Any]) -> list[str]:
        """Lines for the rounds (`RoundLog`s, in order) not read yet."""
        lines = []
        for r in rounds[self.seen :]:
            now = set(r.members)
            left, back = sorted(self.last - now), sorted(now - self.last)
            lines += [f"round {r.round} went on without island {k}" for k in left]
            lines += [f"island {k} is back (round {r.round})" for k in back]
            self.last = now
        self.seen = len(rounds)
        return lines


def round_name(sent: int, fragment: int) -> str:
    """The name of the round of fragment `fragment` sent at step `sent`: the same
    on every island, whatever τ."""
    return f"{sent}-{fragment}"


def _check_replica(replica: int, num_replicas: int) -> None:
    if not 0 <= replica < num_replicas:
        raise ValueError(
            f"replica={replica}; allowed: 0 ... num_replicas - 1 = {num_replicas - 1}."
        )


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
        board.put(Keys.heal("want", replica), nonce.encode())
        ready = Keys.heal("ready", replica, nonce)
        where = board.get(ready, max(0.0, deadline - time.monotonic()))
        board.delete(ready)
        try:
            blob = net.fetch(
                bytes(where).decode(),
                Keys.heal("state", replica, nonce),
                progress_s=board.progress_s,
                chunk_bytes=board.chunk,
            )
        except OSError:
            blob = None  # the peer is gone: ask again
        if blob is not None:
            break
    board.put(Keys.heal("got", replica, nonce), b"1")
    try:
        state = eqx.tree_deserialise_leaves(io.BytesIO(blob), _host(template))
    except (RuntimeError, ValueError, TypeError, EOFError) as e:
        raise BoardProtocolError(
            f"{Keys.heal('state', replica, nonce)}: {len(blob)} bytes that are not a state of this "
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
    depot.offer(Keys.heal("state", int(peer), nonce), buffer.getbuffer())
    board.put(Keys.heal("ready", int(peer), nonce), depot.address.encode())
    return buffer.getbuffer().nbytes


def _cause(e: Exception) -> str:
    """The runtime's error in one short line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _check_size(key: str, size: int, expected: int) -> None:
    if size != expected:
        raise BoardProtocolError(
            f"{key!r} holds {size} bytes; allowed: {expected} (the same run's "
            "message on every island: the same flags everywhere)."
        )


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
