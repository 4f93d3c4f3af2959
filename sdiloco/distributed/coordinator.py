"""The elastic job's coordinator: it serves the board and decides who takes part.

The coordinator holds no replica and no training state. It serves the board
(`BoardServer`: a `net.Store` over TCP, in its own process) and runs one loop
(`Coordinator.run`) of four jobs, one method each:

- `greet`: an island that says hello (started, or healed) is waited for again;
- `decide`: a round's members are the islands whose message arrived before every
  island it waits for had, or before `grace_s` after the first one;
- `route`: a heal request goes to a live peer (`HealRouter`);
- `collect`: the board's copies of a round's messages are deleted once every
  member and every live island has read them (or `keep_s` after its decision).

When every island is done it says so (`end`): an island that finished stays until
then to serve heals (`BoardTransport.serve_until_end`), so one told it is behind in
a run's last seconds still has a peer to heal from.

A round is named `<sent step>-<fragment>` by the islands (`board.round_name`).
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from . import net
from .board import BoardError, Keys


@dataclasses.dataclass
class Decision:
    """One round as the coordinator decided it."""

    round: str
    members: tuple[int, ...]
    waited_s: float  # from the first message to the decision
    timed_out: bool  # decided at the grace deadline (an expected replica missing)


class BoardServer:
    """The board in the coordinator's process: a `net.Store` served on the port of
    `address` (every interface), and the same calls as a `board.Board` made on the
    store directly.

    Args:
        address: `host:port` the islands connect to.
        heartbeat_s: an island silent this long (stopped, or its link down) no
            longer counts as live (`live`); one whose process ended stops counting
            at once (its connections closed).
        chunk_bytes: bytes per chunk of a value on the wire.
    """

    def __init__(
        self, address: str, *, heartbeat_s: float = 10.0, chunk_bytes: int = net.CHUNK
    ):
        _, port = net.split_address(address)
        self.store, self.heartbeat_s = net.Store(), heartbeat_s
        try:
            self._server = net.Server(
                self.store, f"0.0.0.0:{port}", chunk_bytes=chunk_bytes
            )
        except OSError as e:
            raise BoardError(f"cannot serve the board on port {port}: {e}") from None
        self.address = self._server.address
        self.linger_s = 2.0

    def put(self, key: str, value: Any) -> None:
        self.store.put(key, value)

    def get(self, key: str, timeout_s: float) -> Any:
        value = self.store.get(key, timeout_s)
        if value is None:
            raise BoardError(f"coordinator: {key!r} not on the board in {timeout_s} s")
        return value

    def try_get(self, key: str) -> Any:
        return self.store.get(key)

    def items(self, prefix: str) -> list[tuple[str, Any]]:
        return self.store.items(prefix)

    def keys(self, prefix: str) -> list[str]:
        return [k for k, _ in self.store.items(prefix)]

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def delete_if(self, key: str, value: Any) -> bool:
        return self.store.delete_if(key, value)

    def live(self) -> set[int]:
        """The islands (replica ids) connected and heard from within the heartbeat."""
        return {n - 1 for n in self.store.live(self.heartbeat_s) if n >= 1}

    def close(self) -> None:
        """Stop serving, after the islands had `linger_s` to read their last keys."""
        time.sleep(self.linger_s)
        self._server.close()


class Coordinator:
    """The coordinator's state and its loop (see the module).

    Who is waited for (`expected`): every island at the start. One that misses a
    deadline is no longer waited for. A late message brings it back when it came
    less than `grace_s` after its round's decision (the island is about one round
    behind, and the others wait for it at most that long once); later than that it
    is told it is behind (mail `behind`), heals from a peer as a restarted island
    does, and is waited for again when it says hello. So a late island never costs
    the others a second grace window.

    No island takes its first step, and no round is decided, before every island
    has said hello (it has compiled its step) or `start_s` has passed (`started`),
    so that the islands' unequal start-up is not taken for a failure. The loop ends
    when every island still connected has posted `done/<m>`.

    Args:
        board: the board (a `BoardServer`, or any object with its calls).
        num_replicas: M.
        grace_s: how long a round waits after its first message.
        start_s: how long the rounds wait for every island's hello.
        keep_s: how long a decided round's messages stay on the board at most.
        live: the islands connected now (`BoardServer.live`); default all.
    """

    def __init__(
        self,
        board: Any,
        num_replicas: int,
        *,
        grace_s: float,
        start_s: float = 300.0,
        keep_s: float = 60.0,
        live: Callable[[], set[int]] | None = None,
    ):
        self.board, self.num_replicas = board, num_replicas
        self.grace_s, self.start_s, self.keep_s = grace_s, start_s, keep_s
        everyone = set(range(num_replicas))
        self.live = live if live is not None else lambda: everyone
        self.expected = set(everyone)
        self.greeted: set[int] = set()
        self.behind: set[int] = set()
        self.first: dict[str, float] = {}
        self.decided: dict[str, tuple[float, tuple[int, ...]]] = {}
        self.kept: set[str] = set()  # decided rounds whose copies are on the board
        self.decisions: list[Decision] = []
        self.route, self.recent = HealRouter(), ()
        self.began = time.perf_counter()

    def run(self, stop: Callable[[], bool], poll_s: float = 0.005) -> list[Decision]:
        """Coordinate until every connected island is done, or `stop()`; returns
        the decisions in the order they were made."""
        while not stop():
            time.sleep(poll_s)
            now = time.perf_counter()
            if self.finished():
                break
            self.greet()
            self.route(self.board, self.expected & self.live(), self.recent)
            if not self.started(now):
                continue
            self.decide(now)
            self.collect(now)
        self.board.put(Keys.END, b"1")  # islands still serving heals may leave
        return self.decisions

    def finished(self) -> bool:
        done = {_id(k) for k in self.board.keys(Keys.DONE)}
        return bool(done) and (self.expected | self.live()) <= done

    def started(self, now: float) -> bool:
        """Whether every island has said hello, or `start_s` has passed: then the
        board says `start`, which the islands wait for before their first step, so
        that they begin together however unequal their start-up was."""
        if len(self.greeted) < self.num_replicas and now - self.began < self.start_s:
            return False
        if self.board.try_get(Keys.START) is None:
            self.board.put(Keys.START, b"1")
        return True

    def greet(self) -> None:
        for key in self.board.keys(Keys.HELLO):
            m = _id(key)
            self.greeted.add(m)
            self.expected.add(m)
            self.behind.discard(m)
            self.board.delete(key)

    def decide(self, now: float) -> None:
        for name, arrived in _arrivals(self.board).items():
            if name in self.decided:
                self.board.delete(Keys.arrived(name))
                self._late(name, arrived, now)
                continue
            start = self.first.setdefault(name, now)
            timed_out = now - start >= self.grace_s
            if not (self.expected <= arrived or timed_out):
                continue
            members = tuple(sorted(arrived))
            self.board.put(Keys.members(name), _bytes(members))
            self.board.delete(Keys.arrived(name))
            if timed_out:
                self.expected = set(arrived)
            self.decided[name], self.recent = (now, members), members
            self.kept.add(name)
            self.decisions.append(Decision(name, members, now - start, timed_out))

    def collect(self, now: float) -> None:
        """Delete the board's copies of a round's messages once every member and
        every live island has read them (`got/<round>/<m>`), or `keep_s` after its
        decision (a member died before it read them; a healed island never reads
        the rounds before its heal). A live island left out of a round reads it
        too, late, and its members may have finished and gone by then, depots and
        all: the board's copy is what it reads. Decisions stay: an island far
        behind still finds the members of a round it reads late, and its late
        arrival is known for what it is."""
        got: dict[str, set[int]] = {}
        for key in self.board.keys(Keys.GOT):
            _, name, m = key.split("/")
            got.setdefault(name, set()).add(int(m))
        live = self.live()
        for name, ids in got.items():
            at, members = self.decided.get(name, (-1e9, ()))
            if set(members) | live <= ids or now - at > self.keep_s:
                self.board.delete(Keys.message(name))
                self.board.delete(Keys.got(name))
                self.kept.discard(name)
        for name in [n for n in self.kept if now - self.decided[n][0] > self.keep_s]:
            self.board.delete(Keys.message(name))
            self.kept.discard(name)

    def _late(self, name: str, arrived: set[int], now: float) -> None:
        lag = now - self.decided[name][0]
        for m in arrived - self.expected:
            if lag < self.grace_s:
                self.expected.add(m)  # about one round behind: wait for it again
            elif m not in self.behind:
                self.behind.add(m)
                self.board.put(Keys.mail(m, "behind"), f"{lag:.1f}".encode())


def coordinate(
    board: Any,
    num_replicas: int,
    *,
    grace_s: float,
    stop: Callable[[], bool],
    start_s: float = 300.0,
    keep_s: float = 60.0,
    live: Callable[[], set[int]] | None = None,
) -> list[Decision]:
    """The coordinator's loop over `board` (see `Coordinator`); returns its
    decisions."""
    c = Coordinator(
        board, num_replicas, grace_s=grace_s, start_s=start_s, keep_s=keep_s, live=live
    )
    return c.run(stop)


class HealRouter:
    """The coordinator's routing of heal requests (`board.request_heal`).

    An island that asks posts `heal/want/<m>` (a nonce). The request goes, as mail
    (`to/<peer>/serve`), to a peer that is live, is not itself waiting for a heal
    and is not serving another request; members of the latest decided round come
    first (they are training now). The peer offers its state and posts
    `heal/ready/<m>/<nonce>`; the asker fetches it and posts `heal/got/<m>/<nonce>`,
    which frees the peer. A request whose peer leaves the live set before the asker
    got the state (its process ended: its connections closed) is routed again at
    once; an asker whose fetch failed asks again with a new nonce. Two islands
    restarted at once are never routed to each other, and a peer serves one request
    at a time.
    """

    def __init__(self):
        self.routed: dict[int, tuple[int, str]] = {}  # peer -> (asker, nonce)

    def __call__(
        self, board: Any, live: set[int], recent: tuple[int, ...] = ()
    ) -> None:
        askers = {_id(k): v for k, v in board.items(Keys.WANT)}
        for peer, (asker, nonce) in list(self.routed.items()):
            if board.try_get(Keys.heal("got", asker, nonce)) is not None:
                board.delete(Keys.heal("got", asker, nonce))
                del self.routed[peer]  # served
            elif asker in askers:  # the asker asked again: its fetch failed
                board.delete(Keys.mail(peer, "serve"))
                del self.routed[peer]
            elif peer not in live or peer in askers:  # it died, or came back
                board.delete(Keys.mail(peer, "serve"))
                del self.routed[peer]
                board.put(Keys.heal("want", asker), nonce.encode())
                askers[asker] = nonce.encode()
        busy = set(askers) | set(self.routed) | {a for a, _ in self.routed.values()}
        for asker in sorted(askers):
            peers = sorted(live - busy, key=lambda p: (p not in recent, p))
            if not peers:
                continue  # when a peer is free
            nonce = bytes(askers[asker]).decode()
            # the request read, not one put since (a new nonce): that one stays, and
            # the next call routes it as a retry
            board.delete_if(Keys.heal("want", asker), askers[asker])
            board.put(Keys.mail(peers[0], "serve"), f"{asker}:{nonce}".encode())
            self.routed[peers[0]] = (asker, nonce)
            busy.add(peers[0])


def _arrivals(board: Any) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for key in board.keys(Keys.ARRIVED):
        parts = key.split("/")
        if len(parts) == 3:
            out.setdefault(parts[1], set()).add(int(parts[2]))
    return out


def _id(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


def _bytes(members: tuple[int, ...]) -> bytes:
    return ",".join(map(str, members)).encode()
