"""The elastic job's syncer: who takes part in each round, who heals from whom.

The syncer is one asyncio Ray actor that holds no replica, no training state and no
message bytes. The islands (`ray_transport.RayTransport`) call it; every call that
waits (a round's decision, a heal, the start, the mail) waits in the syncer's event
loop, so one thread serves them all. Its decisions are today's elastic rules:

- `hello`: an island joins. It is refused, with one line, when its config's
  fingerprint differs from the job's (naming the fields that differ), or when the
  actor that claims the id is not the one the job made for it (a second process
  claiming a live island's id). A restarted island (Ray restarted its actor) is
  told to heal; so is one whose checkpoint is older than the job's start.
- `arrive`: a round's **members** are the islands whose message arrived before
  every island it waits for had, or before `grace_s` after the first one. An
  island that misses a deadline is no longer waited for; a late message brings it
  back when it came less than `grace_s` after the decision, and later than that
  it is told it is behind (mail `behind`) and heals.
- `want_heal`: a heal goes to a live peer that is not healing or serving,
  members of the latest round first; a peer that dies or does not offer within
  `serve_s` is passed over and the request routed again.
- `done`: when every island that can still finish is done, the job is over.

The consistency of a round. Each message is put into the object store by its
island with the syncer as its **owner** (`ray.put(..., _owner=syncer)`), and only
its reference is handed here. The bytes stay in the sender's node's object store
and go peer to peer to the members that read them; but the object's lifetime is
the syncer's, not the sender's, so a sender that dies right after the decision
leaves its message readable by every member, and every island applies the same
member set. References are dropped once every member and every island still
live has read the round (`got`), or `keep_s` after the decision.
"""

import asyncio
import dataclasses
import time
from typing import Any


@dataclasses.dataclass
class Decision:
    """One round as the syncer decided it."""

    round: str
    members: tuple[int, ...]
    waited_s: float  # from the first message to the decision
    timed_out: bool  # decided at the grace deadline (an expected island missing)
    at: float = 0.0  # time.time() of the decision


@dataclasses.dataclass
class _Round:
    first: float
    refs: dict[int, Any] = dataclasses.field(default_factory=dict)
    decided: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    at: float = 0.0
    members: tuple[int, ...] = ()
    got: set[int] = dataclasses.field(default_factory=set)


class Syncer:
    """The syncer's state and calls (see the module); `ray.remote(Syncer)` makes
    the actor, and the tests call it directly in one event loop.

    Args:
        num_replicas: M, the job's islands.
        fingerprint: `{field: value}` of everything islands must agree on.
        grace_s: how long a round waits after its first message.
        start_s: how long the first round waits for every island's hello.
        keep_s: how long a decided round's references stay at most.
        heartbeat_s: an island silent this long no longer counts as live.
        serve_s: how long a routed heal waits for its peer to offer the state.
    """

    def __init__(
        self,
        num_replicas: int,
        fingerprint: dict[str, str],
        *,
        grace_s: float,
        start_s: float = 300.0,
        keep_s: float = 60.0,
        heartbeat_s: float = 10.0,
        serve_s: float = 30.0,
        steps: int | None = None,
    ):
        self.num_replicas, self.fingerprint = num_replicas, dict(fingerprint)
        self.steps = steps  # the run's last step: an island restored there is done
        self.grace_s, self.start_s, self.keep_s = grace_s, start_s, keep_s
        self.heartbeat_s, self.serve_s = heartbeat_s, serve_s
        self.expected = set(range(num_replicas))
        self.owners: dict[int, str] = {}  # island -> the actor id the job made
        self.islands: dict[int, Any] = {}  # island -> its actor handle
        self.greeted: dict[int, int] = {}  # island -> its step at hello
        self.pids: dict[int, int] = {}
        self.behind: set[int] = set()
        self.healing: set[int] = set()
        self.serving: dict[int, tuple[int, str]] = {}  # peer -> (asker, nonce)
        self.offers: dict[str, Any] = {}  # nonce -> [ref] of the state offered
        self.done: set[int] = set()
        self.gone: set[int] = set()  # islands that will not come back
        self.seen: dict[int, float] = {}
        self.rounds: dict[str, _Round] = {}
        self.decisions: list[Decision] = []
        self.recent: tuple[int, ...] = ()
        self.refused: list[str] = []
        self.unhealed_posts = 0  # messages of an island not healed yet, refused
        self.rejoining: dict[int, int] = {}  # island -> the step it healed at
        self.mailbox: dict[int, list[tuple[str, str]]] = {}
        self.began = time.monotonic()
        self.start_step: int | None = None
        self._started: asyncio.Event | None = None
        self._ended: asyncio.Event | None = None
        self._mail: dict[int, asyncio.Event] = {}

    # ------------------------------------------------------------------ joining

    def register(self, m: int, island: Any) -> None:
        """The job made the actor `island` for island m: only it (any restart)
        is m, and the syncer asks it for its messages (`arrive`)."""
        self.islands[m] = island
        self.owners[m] = island._actor_id.hex()

    async def hello(
        self, m: int, actor_id: str | None, fields: dict[str, str], step: int, pid: int
    ) -> dict[str, Any]:
        """Island m joins with its config `fields` and its (restored) step; returns
        `{"refused": line}` or `{"heal": bool, "start_step": int}` once the job has
        started (every island said hello, or `start_s` passed)."""
        refusal = self._refusal(m, actor_id, fields)
        if refusal is not None:
            self.refused.append(refusal)
            return {"refused": refusal}
        restarted = m in self.greeted
        self.greeted[m], self.pids[m], self.seen[m] = step, pid, time.monotonic()
        self.gone.discard(m)
        self.done.discard(m)
        started = self._start_event()
        if len(self.greeted) == self.num_replicas:
            started.set()
        try:
            left = self.start_s - (time.monotonic() - self.began)
            await asyncio.wait_for(started.wait(), max(0.0, left))
        except TimeoutError:
            started.set()
        if self.start_step is None:
            self.start_step = max(self.greeted.values())
        # An island restored from its checkpoint of the run's last step has trained
        # every step (its θ_g is the one it had at its end): nothing to heal.
        finished = self.steps is not None and step >= self.steps
        heal = (restarted or step < self.start_step) and not finished
        self.healing.discard(m)
        self.behind.discard(m)
        if heal:
            self.healing.add(m)
            self.expected.discard(m)
        else:
            self.expected.add(m)
        return {"heal": heal, "start_step": self.start_step}

    def _refusal(self, m: int, actor_id: str | None, fields: dict[str, str]):
        if not (isinstance(m, int) and 0 <= m < self.num_replicas):
            return f"island {m!r}; allowed: 0 ... {self.num_replicas - 1}."
        differ = sorted(
            k
            for k in set(fields) | set(self.fingerprint)
            if fields.get(k) != self.fingerprint.get(k)
        )
        if differ:
            return (
                f"island {m} refused: its config differs from the job's in "
                f"{', '.join(differ)}; allowed: the same flags on every island."
            )
        owner = self.owners.get(m)
        if owner is not None and actor_id != owner:
            return (
                f"island {m} is already held by actor {owner} of this job; a second "
                "process claiming it is refused."
            )
        return None

    def _start_event(self) -> asyncio.Event:
        if self._started is None:
            self._started = asyncio.Event()
        return self._started

    # ------------------------------------------------------------------- rounds

    async def arrive(self, name: str, m: int, post: bool) -> Any:
        """Island m's message of round `name` is ready (`post`; False: it only
        reads); returns `(members, {j: [ref]})` once the round is decided.

        The syncer makes each message an object it owns: it calls the sender's
        actor for it (`Island.message`: a call's result is owned by the caller, and
        stays in the sender's node's object store) and counts the arrival once that
        object exists, without fetching it (`fetch_local=False`). A sender that dies
        after the decision so leaves its message readable by every member."""
        self._check(m, name)
        now = time.monotonic()
        self.seen[m] = now
        if post and self.rejoining.get(m, -1) < _sent(name):
            self.rejoining.pop(m, None)  # it posts again: its peer's rounds are read
        if post and m in self.healing:  # a restarted island's fresh weights
            self.unhealed_posts += 1  # never count: it posts only once healed
            post = False
        r = self.rounds.get(name)
        if r is None:
            r = self.rounds[name] = _Round(first=now)
            asyncio.get_running_loop().call_later(self.grace_s, self._decide, name)
        if post and not r.decided.is_set():
            ref = await self._own(name, m)
            if ref is not None and not r.decided.is_set():
                r.refs[m] = [ref]
                if self.expected <= set(r.refs):
                    self._decide(name)
        if post and r.decided.is_set() and m not in r.members:
            self._late(m, time.monotonic() - r.at)
        await r.decided.wait()
        return r.members, {j: r.refs[j] for j in r.members if j in r.refs}

    async def _own(self, name: str, m: int) -> Any:
        """Island m's message of round `name` as an object the syncer owns, once
        it exists (None: m died meanwhile, or did not answer within 4 grace
        windows). The call returns two objects: a token, which the syncer reads
        (a few bytes), and the message, which it never fetches; the token read
        means the call succeeded, so the message exists (a dead sender's call
        leaves an error in its place, which must never count as an arrival)."""
        island = self.islands.get(m)
        if island is None:
            return None
        token, message = island.message.options(num_returns=2).remote(name)
        try:
            await asyncio.wait_for(token, self.grace_s * 4)
        except Exception:  # noqa: BLE001 - died, failed, or too slow: no arrival
            return None
        return message

    def got(self, name: str, m: int) -> None:
        """Island m read every member's message of round `name`."""
        r = self.rounds.get(name)
        if r is not None:
            r.got.add(m)
            if self._readers(name, r) <= r.got:
                r.refs.clear()
        self.collect()

    def _readers(self, name: str, r: _Round) -> set[int]:
        """Who must read round `name` before its references go: its members, every
        live or healing island, and every island healed at or after the step that
        sent it (the round is in flight in the state it took)."""
        sent = _sent(name)
        rejoining = {m for m, step in self.rejoining.items() if step >= sent}
        return set(r.members) | self.live() | self.healing | rejoining

    def _decide(self, name: str) -> None:
        r = self.rounds.get(name)
        if r is None or r.decided.is_set():
            return
        now = time.monotonic()
        timed_out = not self.expected <= set(r.refs)  # else all, or a death told
        r.members, r.at = tuple(sorted(r.refs)), now
        r.refs = {j: r.refs[j] for j in r.members}
        if timed_out:
            self.expected = set(r.members)
        self.recent = r.members
        decision = Decision(name, r.members, now - r.first, timed_out, time.time())
        self.decisions.append(decision)
        r.decided.set()

    def _late(self, m: int, lag: float) -> None:
        if m in self.expected or m in self.healing:
            return
        if lag < self.grace_s:
            self.expected.add(m)  # about one round behind: wait for it again
        elif m not in self.behind:
            self.behind.add(m)
            self._post(m, "behind", f"{lag:.1f}")

    def collect(self) -> None:
        """Drop the references of rounds decided more than `keep_s` ago."""
        now = time.monotonic()
        for r in self.rounds.values():
            if r.refs and r.decided.is_set() and now - r.at > self.keep_s:
                r.refs.clear()

    # -------------------------------------------------------------------- mail

    async def mail(self, m: int, wait_s: float = 1.0) -> list[tuple[str, str]]:
        """Island m's letters (`serve`, `behind`), waiting up to `wait_s` for one;
        each call also says m is alive."""
        self._check(m)
        self.seen[m] = time.monotonic()
        event = self._mail.setdefault(m, asyncio.Event())
        if not self.mailbox.get(m):
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except TimeoutError:
                pass
        event.clear()
        self.seen[m] = time.monotonic()
        return self.mailbox.pop(m, [])

    def _post(self, m: int, what: str, text: str) -> None:
        self.mailbox.setdefault(m, []).append((what, text))
        self._mail.setdefault(m, asyncio.Event()).set()

    def live(self) -> set[int]:
        """The islands heard from within the heartbeat and not known gone."""
        now = time.monotonic()
        return {
            m
            for m, t in self.seen.items()
            if now - t < self.heartbeat_s and m not in self.gone
        }

    # ------------------------------------------------------------------ healing

    async def want_heal(self, m: int, nonce: str) -> list[Any]:
        """A live peer's state for island m (`[ref]`), routed again at once when
        the peer it was routed to dies (`lost`), or when it does not offer the state
        within `serve_s`."""
        self._check(m, nonce)
        self.healing.add(m)
        self.expected.discard(m)
        passed: set[int] = set()  # peers that did not offer in time
        while True:
            self.seen[m] = time.monotonic()
            peer = self._route(m, nonce, passed)
            if peer is None and self._no_healer(m):
                return [None]  # nobody left who could serve: the island ends
            if peer is None:
                await asyncio.sleep(0.1)  # when a peer is free
                continue
            deadline = time.monotonic() + self.serve_s
            while self.serving.get(peer) == (m, nonce) and nonce not in self.offers:
                if time.monotonic() > deadline:
                    self.serving.pop(peer, None)
                    passed.add(peer)
                    break
                await asyncio.sleep(0.02)
            if nonce in self.offers:
                self.serving.pop(peer, None)
                return self.offers.pop(nonce)

    def _no_healer(self, m: int) -> bool:
        """Whether no island but m is live, and every other one has finished or will
        not come back: a heal for m could wait for ever."""
        others = set(range(self.num_replicas)) - {m}
        return not (self.live() - {m}) and others <= self.done | self.gone

    def _route(self, asker: int, nonce: str, passed: set[int]) -> int | None:
        busy = self.healing | set(self.serving) | self.behind | {asker}
        if not self.live() - busy - passed:
            passed.clear()  # every free peer was tried: try them again
        peers = sorted(
            self.live() - busy - passed, key=lambda p: (p not in self.recent, p)
        )
        if not peers:
            return None
        self.serving[peers[0]] = (asker, nonce)
        self._post(peers[0], "serve", f"{asker}:{nonce}")
        return peers[0]

    def offer(self, nonce: str, refs: list[Any]) -> None:
        """A peer's state for the heal `nonce`, put by the peer (it owns it)."""
        self.offers[nonce] = refs

    def healed(self, m: int, nonce: str, step: int = 0) -> None:
        """Island m read its heal, a state at `step`: it is waited for from the
        next round, and reads the rounds in flight in that state."""
        self.seen[m] = time.monotonic()
        self.rejoining[m] = step
        self.offers.pop(nonce, None)
        self.healing.discard(m)
        self.behind.discard(m)
        self.expected.add(m)

    # ------------------------------------------------------------------- ending

    def lost(self, m: int, permanent: bool) -> None:
        """The job's driver saw island m's process die (`permanent`: no restart
        left). A heal it was serving is routed again at once, and a round that
        waited only for it is decided at once (no grace window for a death Ray
        reported)."""
        self.seen.pop(m, None)
        self.expected.discard(m)
        if permanent:
            self.gone.add(m)
        self.serving.pop(m, None)  # its heal is routed again
        for name, r in list(self.rounds.items()):  # no round waits for it now
            if not r.decided.is_set() and r.refs and self.expected <= set(r.refs):
                self._decide(name)
        self._check_end()

    def finished(self, m: int) -> None:
        """Island m trained its last step."""
        self.done.add(m)
        self.expected.discard(m)
        self._check_end()

    def is_done(self, m: int) -> bool:
        """Whether island m trained its last step (it was serving heals after)."""
        return m in self.done

    async def wait_end(self, wait_s: float) -> bool:
        """Whether every island that can finish is done (waiting up to `wait_s`)."""
        if self._ended is None:
            self._ended = asyncio.Event()
        self._check_end()
        try:
            await asyncio.wait_for(self._ended.wait(), wait_s)
        except TimeoutError:
            pass
        return self._ended.is_set()

    def _check_end(self) -> None:
        if self._ended is None:
            self._ended = asyncio.Event()
        if self.done and set(range(self.num_replicas)) - self.gone <= self.done:
            self._ended.set()

    def report(self) -> dict[str, Any]:
        """The decisions, refusals and pids, for `out/syncer.json` and the tests."""
        return {
            "decisions": [dataclasses.asdict(d) for d in self.decisions],
            "refused": list(self.refused),
            "pids": dict(self.pids),
            "start_step": self.start_step,
            "unhealed_posts": self.unhealed_posts,
        }

    def _check(self, m: Any, name: Any = "") -> None:
        """A call's island and name are what the islands send (a malformed call
        fails alone: the syncer goes on)."""
        if not (isinstance(m, int) and 0 <= m < self.num_replicas):
            raise ValueError(f"island {m!r}; allowed: 0 ... {self.num_replicas - 1}.")
        if not (isinstance(name, str) and len(name) <= 64):
            raise ValueError(f"name {str(name)[:70]!r}; allowed: a str of <= 64 chars.")

    def ping(self) -> int:
        """This process's id (the tests kill it to lose the syncer)."""
        import os

        return os.getpid()


def _sent(name: str) -> int:
    """The step that sent round `name` (`<sent>-<fragment>`; 0 if it is not)."""
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else 0
