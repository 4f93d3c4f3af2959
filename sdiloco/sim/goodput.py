"""Goodput of Data-Parallel, DiLoCo, Streaming DiLoCo and Decoupled DiLoCo on one
failure trace, replayed on a virtual clock (`sdiloco.sim.virtual_clock`).

Each method is a policy on the same engine, meeting the same `ClockTrace`:

- `Synchronous`: learners that wait for their rounds. Fragment p of P is sent at the
  steps k with (k − t_p) mod H = 0, t_p = round(p·H/P) (the utilization simulator's
  offsets, `Method.sync_offsets`), and its round must be merged before step
  k + τ + 1. A round is decided when every member has sent, or, with `elastic`, a
  grace window (`Timing.detect_s`) after the first learner needed it; a member
  missing then is left out, and no longer waited for if it is down. A learner whose
  message comes more than a grace window after its round was decided is behind: it
  heals from a peer. Without `elastic` (plain Data-Parallel) a round waits for every
  member, and a failed one, back, takes its lost step again. Presets:
  `plain_dp_policy` (H = 1), `elastic_dp_policy`, `diloco_policy` (P = 1, τ = 0),
  `streaming_policy`.
- `Decoupled`: learners that never wait. A syncer merges each fragment's round once
  `quorum` learners have sent it (at most the learners up), then waits an adaptive
  grace window for the others, γ·(τ·t̄_step − t̄_quorum − t̄_sync) with each time an
  exponential moving average, and closes early when every learner up has sent. A
  message that comes after its round closed joins the next round. A learner whose
  result is not back τ steps after it sent goes on, and merges the result at its
  first step boundary after it arrives; the steps it takes meanwhile count as stale,
  and how many as its staleness. `decoupled_policy`.

`simulate` replays one policy, `replay` several on the same trace, and
`failure_traces` draws one trace per seed at a failure rate.

Examples:
    >>> import numpy as np
    >>> from sdiloco.sim import chaos, goodput, virtual_clock as vc
    >>> timing = chaos.Timing(step_s=1.0, detect_s=4.0, heal_bytes=0.0,
    ...                       bandwidth_gbit=1.0, restart_s=10.0)
    >>> trace = vc.ClockTrace(np.array([[1.0, 5.0, 0.0]]), np.zeros((0, 3)), 2)
    >>> out = goodput.simulate(trace, goodput.plain_dp_policy(), timing, steps=20)
    >>> out.wall_s, out.allocated_s - out.useful_s  # everyone waits the restart
    (30.0, 20.0)
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import no_type_check

import numpy as np

from .chaos import Failures, Timing
from .checks import check
from .virtual_clock import (
    COMPUTE,
    TAIL,
    ClockTrace,
    Engine,
    Summary,
    draw_trace,
    ticks,
)


@dataclasses.dataclass(frozen=True)
class Synchronous:
    """A method whose learners wait for their rounds (Data-Parallel, DiLoCo,
    Streaming DiLoCo)."""

    sync_every: int = 1
    """H: inner steps between two sends of a fragment (1: Data-Parallel)."""
    fragments: int = 1
    """P: fragments, sent on staggered steps."""
    overlap: int = 0
    """τ: steps a learner takes before it needs the round it sent."""
    elastic: bool = True
    """Leave a missing learner out after a grace window (False: wait for it)."""
    sync_s: float = 0.0
    """Seconds from a round's decision to its result at the learners (the
    all-reduce or the transfer; 0: not modelled)."""
    shares: tuple[float, ...] | None = None
    """Each fragment's share of the parameters (None: equal)."""

    def __post_init__(self):
        _check_schedule(self, "Synchronous")


@dataclasses.dataclass(frozen=True)
class Decoupled:
    """Decoupled DiLoCo: learners never wait; a syncer merges each fragment at a
    quorum, with an adaptive grace window."""

    quorum: int
    """K: learners whose messages close a round (capped at the learners up)."""
    sync_every: int = 100
    """H: inner steps between two sends of a fragment."""
    fragments: int = 4
    """P: fragments, sent on staggered steps."""
    overlap: int = 5
    """τ: steps after its send at which a learner is due to merge the result."""
    gamma: float = 0.5
    """γ: the share of the overlap's slack the syncer may wait past the quorum.
    Half leaves the other half for the error of the moving averages."""
    ema: float = 0.9
    """Decay of the moving averages of step, quorum and sync times (about ten
    observations of memory)."""
    sync_s: float = 0.0
    """Seconds of the syncer's merge and transfer (0: not modelled)."""
    shares: tuple[float, ...] | None = None
    """Each fragment's share of the parameters (None: equal)."""

    def __post_init__(self):
        _check_schedule(self, "Decoupled")
        ok = isinstance(self.quorum, int) and self.quorum >= 1
        check(ok, "Decoupled.quorum", self.quorum, "an integer >= 1")
        ok = isinstance(self.gamma, int | float) and 0 <= self.gamma <= 1
        check(ok, "Decoupled.gamma", self.gamma, "a number in [0, 1]")
        ok = isinstance(self.ema, int | float) and 0 <= self.ema < 1
        check(ok, "Decoupled.ema", self.ema, "a number in [0, 1)")


def plain_dp_policy(sync_s: float = 0.0) -> Synchronous:
    """Data-Parallel without elasticity: a collective every step, and a failure
    stops everyone until the failed learner is back and has retaken its step."""
    return Synchronous(1, 1, 0, elastic=False, sync_s=sync_s)


def elastic_dp_policy(sync_s: float = 0.0) -> Synchronous:
    """Data-Parallel that leaves a failed learner out after one grace window and
    lets it rejoin at its peers' next step once it has restarted and healed."""
    return Synchronous(1, 1, 0, elastic=True, sync_s=sync_s)


def diloco_policy(sync_every: int = 100, sync_s: float = 0.0) -> Synchronous:
    """DiLoCo: one blocking round of the whole model every H steps, with a grace
    window for a missing learner."""
    return Synchronous(sync_every, 1, 0, elastic=True, sync_s=sync_s)


def streaming_policy(
    sync_every: int = 100, fragments: int = 4, overlap: int = 5, sync_s: float = 0.0
) -> Synchronous:
    """Streaming DiLoCo with today's grace: P staggered fragments, each round
    needed τ steps after its send, then waited for at most a grace window."""
    return Synchronous(sync_every, fragments, overlap, elastic=True, sync_s=sync_s)


def decoupled_policy(
    quorum: int,
    sync_every: int = 100,
    fragments: int = 4,
    overlap: int = 5,
    **kwargs,
) -> Decoupled:
    """Decoupled DiLoCo with quorum K (the other fields: `Decoupled`'s)."""
    return Decoupled(quorum, sync_every, fragments, overlap, **kwargs)


def standard_policies(num_learners: int) -> dict[str, Synchronous | Decoupled]:
    """The methods of issue 71's comparison, by name: plain and elastic
    Data-Parallel, DiLoCo (H = 100), Streaming DiLoCo (H = 100, P = 4, τ = 5) and
    Decoupled DiLoCo on the same schedule with K = 1, ⌈M/2⌉ and M."""
    quorums = sorted({1, -(-num_learners // 2), num_learners})
    return {
        "Data-Parallel": plain_dp_policy(),
        "elastic Data-Parallel": elastic_dp_policy(),
        "DiLoCo": diloco_policy(),
        "Streaming DiLoCo": streaming_policy(),
    } | {f"Decoupled K={k}": decoupled_policy(k) for k in quorums}


def simulate(
    trace: ClockTrace,
    policy: Synchronous | Decoupled,
    timing: Timing,
    steps: int,
) -> Summary:
    """Replay `trace` under `policy` for a budget of `steps` × M learner-steps.

    Args:
        trace: failures and stragglers in seconds (`virtual_clock.draw_trace`).
        policy: the method.
        timing: `step_s` (the base step), `detect_s` (the grace window),
            `restart_s`, and `heal_bytes` over `bandwidth_gbit` (the heal).
        steps: inner steps of each learner in a run without failures.

    Returns:
        The `Summary`: wall-clock, allocated time and its parts, rounds, staleness.

    Raises:
        ValueError: on a quorum above M, or a run longer than the trace's horizon.
    """
    shares = _shares(policy)
    engine = Engine(trace, timing, steps, shares)
    if isinstance(policy, Decoupled):
        ok = policy.quorum <= trace.num_learners
        check(ok, "Decoupled.quorum", policy.quorum, f"<= M = {trace.num_learners}")
        return engine.run(_Syncer(engine, policy))
    return engine.run(_Rounds(engine, policy))


def replay(
    trace: ClockTrace,
    policies: Mapping[str, Synchronous | Decoupled],
    timing: Timing,
    steps: int,
) -> dict[str, Summary]:
    """`simulate` each of `policies` on the same trace, by name."""
    return {name: simulate(trace, p, timing, steps) for name, p in policies.items()}


def failure_traces(
    rate: float,
    seeds: Sequence[int],
    num_learners: int,
    run_s: float,
    *,
    repair: float = 0.0,
    stragglers: float = 0.0,
    straggle: float = 0.02,
    slowdown: int = 2,
    jitter: float = 0.0,
    horizon: float = 10.0,
) -> list[ClockTrace]:
    """One trace per seed with `rate` failures per learner per `run_s` seconds.

    `repair` (mean down-time before the restart, as a fraction of the run; 0: the
    process restarts at once, as in the measured elastic job), `stragglers`,
    `straggle` and `slowdown` are `chaos.Failures`'; `jitter` and `horizon` are
    `virtual_clock.draw_trace`'s.
    """
    return [
        draw_trace(
            Failures(rate, repair, stragglers, straggle, slowdown, seed=seed),
            num_learners,
            run_s,
            jitter=jitter,
            horizon=horizon,
        )
        for seed in seeds
    ]


@no_type_check  # once per event: see `virtual_clock.Learner`
class _Round:
    """One fragment's round of a synchronous method."""

    __slots__ = ("key", "p", "step", "need", "members", "posts", "first", "decided")

    def __init__(self, key, p: int, step, need: int | float, members: set[int]):
        self.key, self.p, self.step, self.need = key, p, step, need
        self.members = members
        self.posts: dict[int, list[int]] = {}
        self.first: int | None = None  # when a learner first needed it
        self.decided: int | None = None


@no_type_check
class _Rounds:
    """The rounds of a synchronous method, and who waits for them."""

    def __init__(self, engine: Engine, policy: Synchronous):
        self.e, self.policy = engine, policy
        self.grace = ticks(engine.timing.detect_s) if policy.elastic else None
        self.sync = ticks(policy.sync_s)
        self.due = _due(policy)
        self.open: dict = {}  # key -> undecided _Round
        self.decided: dict = {}  # key -> decision time
        self.ready: list[tuple[float, int]] = []  # (need, ready at), recent
        self.waiters: dict = {}  # key -> learners waiting for it
        self.dead: set[int] = set()
        self.out: set[int] = set()
        self.final_n, self.final_posted, self.final_left = 0, set(), 0
        self.final_done, self.last_ready = False, 0

    def step_end(self, m: int, t: int) -> None:
        k, late = self.e.learners[m].count, False
        for p in self.due(k):
            late |= self._post((k, p), p, k, k + self.policy.overlap, m, t)
        if late:
            self.out.add(m)
            self._remove(m, lambda r: True, t)
            self.e.behind(m, t)

    def may_start(self, m: int, t: int) -> bool:
        return self._needs(m, t, self.e.learners[m].count)

    def final(self, m: int, t: int) -> None:
        keys = [("final", self.final_n, p) for p in range(self.e.num_fragments)]
        if m in self.final_posted or any(key in self.decided for key in keys):
            return  # sent, or the last merge is being decided: wait for its end
        self.final_posted.add(m)
        self._remove(m, lambda r: r.step is not None, t)  # it sends no more rounds
        for p, key in enumerate(keys):
            if key not in self.open:
                self._round(key, p, None, float("-inf"))
                self.final_left += 1
        for p, key in enumerate(keys):
            self._post(key, p, None, float("-inf"), m, t)
        for r in list(self.open.values()):
            self._need(r, m, t)  # every round in flight ends before the run does
        self._check_end()

    def failed(self, m: int, t: int) -> None:
        self.dead.add(m)
        for waiting in self.waiters.values():
            waiting.discard(m)
        if self.grace is None:
            self._remove(m, lambda r: r.step is None, t)
            return
        for r in list(self.open.values()):
            if r.step is None and r.first is not None and m in r.members:
                self.e.timer(t + self.grace, self._expire, r)

    def rejoined(self, m: int, t: int) -> int:
        self.dead.discard(m)
        self.out.discard(m)
        learner, go = self.e.learners[m], t
        if self.policy.elastic:
            peers = [
                x
                for x in self.e.learners
                if x.m != m and self.e.up(x.m) and x.m not in self.dead
            ]
            if peers:
                leader = max(peers, key=lambda x: (x.count, x.state == COMPUTE))
                busy = leader.state == COMPUTE
                learner.count = leader.count + busy
                go = leader.step_end if busy else t
        self._remove(m, lambda r: r.step is not None and r.step <= learner.count, t)
        return go

    def arrivals(self, m: int, t: int) -> None:
        del m, t

    def stale(self, m: int) -> None:
        del m

    def held(self) -> list[tuple[list[int], int]]:
        return [(w, r.p) for r in self.open.values() for w in r.posts.values()]

    # -- rounds -------------------------------------------------------------------

    def _post(self, key, p: int, step, need: int | float, m: int, t: int) -> bool:
        """m sends its work on p to round `key`; True if it is behind."""
        work = self.e.take(m, p)
        if key in self.decided:
            self.e.discard(work, p)
            return self.grace is not None and t > self.decided[key] + self.grace
        r = self._round(key, p, step, need)
        sent = r.posts.setdefault(m, [0, 0, 0])  # twice: it healed to fewer steps
        for i in range(3):
            sent[i] += work[i]
        self._maybe_decide(r, t)
        return False

    def _round(self, key, p: int, step, need: int | float) -> _Round:
        if key not in self.open:
            members = {
                x.m
                for x in self.e.learners
                if x.m not in self.out
                and x.m not in self.final_posted
                and (x.count < step if step is not None else self._final_member(x.m))
            }
            self.open[key] = _Round(key, p, step, need, members)
        return self.open[key]

    def _final_member(self, m: int) -> bool:
        """Plain Data-Parallel's last merge does not wait for a learner that is
        down: it holds nothing (its last step's round took its work)."""
        return self.grace is not None or m not in self.dead

    def _needs(self, m: int, t: int, count: int) -> bool:
        """Whether every round m needs before a step past `count` is merged; if
        not, m waits. An undecided last merge is not needed: work was lost after
        it began (its claims came back), and a member may have to take more steps
        before it sends to it."""
        self.ready = [(n, at) for n, at in self.ready if at > t]
        late = [at for n, at in self.ready if n <= count]
        rounds = [
            r for r in self.open.values() if r.need <= count and r.step is not None
        ]
        for r in rounds:
            self._need(r, m, t)
        if late and not rounds:
            self.e.wake(m, max(late))
        return not late and not rounds

    def _need(self, r: _Round | None, m: int, t: int) -> None:
        if r is None:
            return
        self.waiters.setdefault(r.key, set()).add(m)
        if r.first is None:
            r.first = t
            if self.grace is not None:
                self.e.timer(t + self.grace, self._expire, r)

    def _expire(self, t: int, r: _Round) -> None:
        """The grace window after r was first needed is over. The last merge
        gives up only on members that are down: the others are still taking the
        steps they claimed."""
        if r.decided is not None:
            return
        if r.step is not None:
            self._decide(r, t)
            return
        for m in sorted(r.members - r.posts.keys()):
            if m in self.dead:
                self._mark_out(m, t)
        self._maybe_decide(r, t)

    def _maybe_decide(self, r: _Round, t: int) -> None:
        if r.decided is None and r.members <= r.posts.keys():
            self._decide(r, t)

    def _decide(self, r: _Round, t: int) -> None:
        r.decided = t
        del self.open[r.key]
        self.decided[r.key] = t
        ready = t + self.sync * any(w[2] for w in r.posts.values())
        self.ready.append((r.need, ready))
        for work in r.posts.values():
            self.e.include(work, r.p)
        if r.posts:
            self.e.rounds += 1
            self.e.full_rounds += len(r.posts) == self.e.num_learners
        for m in self.waiters.pop(r.key, ()):
            self.e.wake(m, ready)
        for m in sorted(r.members - r.posts.keys()):
            if m in self.dead:
                self._mark_out(m, t)
        if r.step is None:
            self.final_left -= 1
            self.final_done = not self.final_left
        self.last_ready = max(self.last_ready, ready)
        self._check_end()

    def _check_end(self) -> None:
        """The last merge is over once its rounds and every round in flight are."""
        if not self.final_done or any(r.step is not None for r in self.open.values()):
            return
        self.final_done = False
        self.final_n, self.final_posted = self.final_n + 1, set()
        self.e.final_decided(self.last_ready)

    def _mark_out(self, m: int, t: int) -> None:
        """Stop waiting for m, which is down, in every round."""
        if m not in self.out:
            self.out.add(m)
            self._remove(m, lambda r: True, t)

    def _remove(self, m: int, which, t: int) -> None:
        """Take m out of the undecided rounds `which` selects; decide those that
        waited only for it."""
        for r in list(self.open.values()):
            if m in r.members and m not in r.posts and which(r):
                r.members.discard(m)
                self._maybe_decide(r, t)


# This differs from Decoupled DiLoCo as its secondary sources describe it in:
# 1. the quorum is min(K, learners up): the syncer does not wait for a learner it
#    knows is down;
# 2. merging and sending a result take a constant `sync_s`;
# 3. a message that comes after its round closed is merged in the next round;
# 4. goodput counts stale work as useful (it reached θ_g); `Summary.stale_s` says
#    how much of it there was.
@no_type_check
class _Syncer:
    """Decoupled DiLoCo's syncer: a round per fragment at a time."""

    def __init__(self, engine: Engine, policy: Decoupled):
        self.e, self.policy = engine, policy
        self.sync = ticks(policy.sync_s)
        self.due = _due(policy)
        num = engine.num_fragments
        self.reports: list[dict[int, list[int]]] = [{} for _ in range(num)]
        self.first: list[int | None] = [None] * num
        self.quorum_at: list[int | None] = [None] * num
        self.round_id = [0] * num
        # per learner: [fragment, due count, round id, arrival or None]
        self.owed: list[list[list]] = [[] for _ in range(engine.num_learners)]
        self.t_step, self.t_quorum = engine.step, 0.0
        self.t_sync = float(self.sync)
        self.finals: set[int] = set()

    def step_end(self, m: int, t: int) -> None:
        learner = self.e.learners[m]
        b = self.policy.ema
        self.t_step = b * self.t_step + (1 - b) * learner.last_step
        for p in self.due(learner.count):
            self._report(m, p, t, learner.count + self.policy.overlap)

    def may_start(self, m: int, t: int) -> bool:
        del m, t
        return True

    def final(self, m: int, t: int) -> None:
        if m not in self.finals:
            self.finals.add(m)
            for p in range(self.e.num_fragments):
                self._report(m, p, t, None)
        self._maybe_end(t)

    def failed(self, m: int, t: int) -> None:
        self.owed[m] = []
        self.finals.discard(m)
        for p in range(self.e.num_fragments):
            if self.reports[p] and self._all_up_sent(p):
                self._close(p, t)
        self._maybe_end(t)

    def rejoined(self, m: int, t: int) -> int:
        peers = [x.count for x in self.e.learners if x.m != m and self.e.up(x.m)]
        if peers:
            self.e.learners[m].count = max(peers)
        return t

    def arrivals(self, m: int, t: int) -> None:
        count, keep = self.e.learners[m].count, []
        for entry in self.owed[m]:
            p, due, _, at = entry
            if at is not None and at <= t:
                self.e.staleness.append(max(0, count - due))
            else:
                keep.append(entry)
        self.owed[m] = keep

    def stale(self, m: int) -> list[bool]:
        count, flags = self.e.learners[m].count, [False] * self.e.num_fragments
        for p, due, _, _ in self.owed[m]:
            flags[p] |= due <= count
        return flags

    def held(self) -> list[tuple[list[int], int]]:
        return [(w, p) for p, r in enumerate(self.reports) for w in r.values()]

    def _report(self, m: int, p: int, t: int, due) -> None:
        work = self.e.take(m, p)
        sent = self.reports[p].setdefault(m, [0, 0, 0])
        for i in range(3):
            sent[i] += work[i]
        if due is not None:
            self.owed[m].append([p, due, self.round_id[p], None])
        if self.first[p] is None:
            self.first[p] = t
        up = sum(self.e.up(x) for x in range(self.e.num_learners))
        if self.quorum_at[p] is None and len(self.reports[p]) >= min(
            self.policy.quorum, up
        ):
            self.quorum_at[p] = t
            grace = self.policy.gamma * (
                self.policy.overlap * self.t_step - self.t_quorum - self.t_sync
            )
            self.e.timer(t + max(0, int(grace)), self._expire, p, self.round_id[p])
        if self.quorum_at[p] is not None and self._all_up_sent(p):
            self._close(p, t)

    def _expire(self, t: int, p: int, round_id: int) -> None:
        if self.round_id[p] == round_id:
            self._close(p, t)

    def _all_up_sent(self, p: int) -> bool:
        up = [x for x in range(self.e.num_learners) if self.e.up(x)]
        return all(x in self.reports[p] for x in up)

    def _close(self, p: int, t: int) -> int:
        """Merge fragment p's round now; the time its result reaches learners."""
        reports, b = self.reports[p], self.policy.ema
        quorum_at, first = self.quorum_at[p], self.first[p]
        if quorum_at is not None and first is not None:
            self.t_quorum = b * self.t_quorum + (1 - b) * (quorum_at - first)
        self.t_sync = b * self.t_sync + (1 - b) * self.sync
        for work in reports.values():
            self.e.include(work, p)
        if reports:
            self.e.rounds += 1
            self.e.full_rounds += len(reports) == self.e.num_learners
        arrival = t + self.sync * bool(reports)
        for owed in self.owed:
            for entry in owed:
                if entry[0] == p and entry[2] == self.round_id[p]:
                    entry[3] = arrival
        self.reports[p], self.first[p], self.quorum_at[p] = {}, None, None
        self.round_id[p] += 1
        return arrival

    def _maybe_end(self, t: int) -> None:
        """The last merge, once every learner up has sent all it holds."""
        up = [x for x in range(self.e.num_learners) if self.e.up(x)]
        if not self.finals or not all(x in self.finals for x in up):
            return
        if any(self.e.learners[x].state != TAIL for x in up):
            return
        arrival = max([self._close(p, t) for p in range(self.e.num_fragments)])
        self.finals = set()
        self.e.final_decided(arrival)


def _due(policy: Synchronous | Decoupled):
    """The fragments sent after step k (1-based): (k − t_p) mod H == 0."""
    H, P = policy.sync_every, policy.fragments
    offsets = [int(np.floor(p * H / P + 0.5)) for p in range(P)]
    table: dict[int, list[int]] = {}
    for p, offset in enumerate(offsets):
        table.setdefault(offset % H, []).append(p)
    return lambda k: table.get(k % H, ())


def _shares(policy: Synchronous | Decoupled) -> tuple[float, ...]:
    if policy.shares is None:
        return (1.0 / policy.fragments,) * policy.fragments
    return tuple(float(s) for s in policy.shares)


def _check_schedule(policy: Synchronous | Decoupled, name: str) -> None:
    for field in ("sync_every", "fragments"):
        v = getattr(policy, field)
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
        check(ok, f"{name}.{field}", v, "an integer >= 1")
    check(
        policy.fragments <= policy.sync_every,
        f"{name}.fragments",
        policy.fragments,
        f"<= sync_every = {policy.sync_every} (one send step per fragment)",
    )
    tau = policy.overlap
    ok = isinstance(tau, int) and 0 <= tau < policy.sync_every
    check(ok, f"{name}.overlap", tau, f"an integer in [0, {policy.sync_every})")
    ok = isinstance(policy.sync_s, int | float) and policy.sync_s >= 0
    check(ok, f"{name}.sync_s", policy.sync_s, "a number >= 0")
    if policy.shares is not None:
        s = np.asarray(policy.shares, np.float64)
        ok = s.shape == (policy.fragments,) and bool(
            (s > 0).all() and abs(s.sum() - 1) < 1e-9
        )
        check(ok, f"{name}.shares", policy.shares, "P positive numbers summing to 1")
