"""Learners on a virtual clock: a shared trace of failures and stragglers, and the
discrete-event engine that replays it under one method's policy.

`sdiloco.sim.goodput` holds the policies (Data-Parallel, DiLoCo, Streaming DiLoCo,
Decoupled DiLoCo) and `replay`; this module holds what they share:

- `ClockTrace`, drawn by `draw_trace` from a `chaos.Failures`: when each learner fails
  and how long it stays down, when it straggles, and the seed of its per-step jitter.
  The trace is in **seconds of wall-clock**, where `chaos.failure_trace` draws in
  progress of the run. A failure belongs to the hardware: it comes at a time whatever
  the method is doing, so a method that is slower to its token budget meets more of
  them, and a Data-Parallel job stopped by one failure can meet the next while it
  waits. Progress units would hide both, and here the methods differ in wall-clock,
  not in steps. The rates keep their `Failures` meaning with "the run" measured as
  `run_s`, the wall-clock of the run without failures.
- `Engine`: M learners that take inner steps, fail, stay down, restart, heal from a
  peer and rejoin, on a clock of integer ticks (`TICK` = 2⁻²⁰ s), and the ledger that
  puts every tick of every learner in exactly one part (`PARTS`). Ticks make the
  parts add up to M × wall-clock exactly: every part is a whole number of ticks, so
  its value in seconds is exact in float64.

The engine asks a policy (`Policy`) what to do at each step boundary; the policy
decides rounds and calls back `include` / `discard` / `behind` / `final_decided`.
"""

import bisect
import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol, no_type_check, runtime_checkable

import numpy as np

from .chaos import Failures, Timing
from .checks import check


TICK = 2.0**-20
"""Seconds of one tick of the virtual clock."""

PARTS = ("fresh", "stale", "discarded", "wait", "tail", "down", "heal")
"""The parts of allocated time, in the order `Summary.parts` gives them."""

COMPUTE, WAIT, TAIL, DOWN, HEAL = "compute", "wait", "tail", "down", "heal"
_PART_OF = {WAIT: "wait", TAIL: "tail", DOWN: "down", HEAL: "heal"}
# At one time: returns, then step ends, then wake-ups and timers, then failures.
_REJOIN, _STEP_END, _WAKE, _FAIL = 0, 1, 2, 3


class ClockTrace(NamedTuple):
    """One seed's failures and stragglers of M learners, in seconds of wall-clock."""

    failures: np.ndarray  # [F, 3] float64: learner, time of the failure, down-time
    slow: np.ndarray  # [S, 3] float64: learner, start and end of a slow period
    num_learners: int
    slowdown: float = 2.0  # a step started in a slow period takes this many times
    jitter: float = 0.0  # σ of each step's mean-one lognormal time multiplier
    seed: int = 0  # the seed of the jitter: learner m's n-th step draws the n-th
    horizon_s: float = math.inf  # the trace holds failures up to here


def draw_trace(
    failures: Failures,
    num_learners: int,
    run_s: float,
    *,
    jitter: float = 0.0,
    horizon: float = 10.0,
) -> ClockTrace:
    """A trace of `num_learners` learners drawn from `failures`, in seconds.

    Each learner fails as a Poisson process of `failures.failures` per `run_s` seconds
    and is down an exponential time of mean `failures.repair × run_s` (0: it restarts
    at once); it straggles `failures.stragglers` times per `run_s`, each slow period
    exponential of mean `failures.straggle × run_s`, its steps `failures.slowdown`
    times longer. Learner m's draws depend only on the seed and m (failures and slow
    periods on streams of their own), so adding learners or stragglers does not move
    another learner's failures.

    Args:
        failures: rates and lengths per learner per run, and the seed. `miss` and
            `late` must be 0: here who misses a round follows from the times.
        num_learners: M.
        run_s: seconds of the run without failures (steps × step time).
        jitter: σ of the per-step lognormal multiplier (mean one); 0: none.
        horizon: the trace holds episodes up to `horizon × run_s`; a replay that
            lasts longer raises.

    Raises:
        ValueError: naming a bad argument.
    """
    check(failures.miss == 0, "Failures.miss", failures.miss, "0 on the virtual clock")
    check(failures.late == 0, "Failures.late", failures.late, "0 on the virtual clock")
    _check_count("num_learners", num_learners)
    check(_real(run_s) and run_s > 0, "run_s", run_s, "a number > 0")
    check(_real(jitter) and jitter >= 0, "jitter", jitter, "a number >= 0")
    check(_real(horizon) and horizon >= 1, "horizon", horizon, "a number >= 1")
    check(failures.seed >= 0, "Failures.seed", failures.seed, "an integer >= 0")
    end = horizon * run_s
    fails, slow = [], []
    for m in range(num_learners):
        rng = np.random.default_rng([failures.seed, m, 0])
        for at, down in _poisson(
            rng, failures.failures * horizon, end, failures.repair
        ):
            fails.append((m, at, down * run_s))
        rng = np.random.default_rng([failures.seed, m, 1])
        for at, length in _poisson(
            rng, failures.stragglers * horizon, end, failures.straggle
        ):
            slow.append((m, at, at + length * run_s))
    return ClockTrace(
        np.asarray(fails, np.float64).reshape(-1, 3),
        np.asarray(slow, np.float64).reshape(-1, 3),
        num_learners,
        float(failures.slowdown),
        float(jitter),
        failures.seed,
        float(end),
    )


def check_clock_trace(trace: ClockTrace) -> None:
    """A trace fit for the engine.

    Raises:
        ValueError: naming the field and the value: shapes other than `[F, 3]` and
            `[S, 3]`, a learner index out of range, a negative time or down-time, a
            slow period that ends before it starts, a slowdown below 1, a negative
            jitter or seed.
    """
    _check_count("trace.num_learners", trace.num_learners)
    for name in ("failures", "slow"):
        value = np.asarray(getattr(trace, name))
        ok = value.ndim == 2 and value.shape[1] == 3
        check(ok, f"trace.{name}.shape", value.shape, "(N, 3)")
        check(bool(np.isfinite(value).all()), f"trace.{name}", "not finite", "finite")
        who = value[:, 0]
        ok = bool(((who >= 0) & (who < trace.num_learners) & (who % 1 == 0)).all())
        check(ok, f"trace.{name}[:, 0]", who.tolist(), "learner indices in [0, M)")
        ok = bool((value[:, 1:] >= 0).all())
        check(ok, f"trace.{name}[:, 1:]", value[:, 1:].tolist(), "times >= 0")
    slow = np.asarray(trace.slow)
    ok = bool((slow[:, 2] >= slow[:, 1]).all())
    check(ok, "trace.slow", slow.tolist(), "each period's end >= its start")
    ok = _real(trace.slowdown) and trace.slowdown >= 1
    check(ok, "trace.slowdown", trace.slowdown, "a number >= 1")
    ok = _real(trace.jitter) and trace.jitter >= 0
    check(ok, "trace.jitter", trace.jitter, "a number >= 0")
    ok = isinstance(trace.seed, int) and trace.seed >= 0
    check(ok, "trace.seed", trace.seed, "an integer >= 0")
    ok = isinstance(trace.horizon_s, int | float) and trace.horizon_s > 0
    check(ok, "trace.horizon_s", trace.horizon_s, "a number > 0")


@dataclasses.dataclass(frozen=True)
class Summary:
    """One method's replay of one trace: where the allocated time went.

    Every part is in learner-seconds, and `sum(parts.values()) == allocated_s`
    exactly (they are whole ticks).
    """

    wall_s: float
    """Wall-clock from the first step to the last merge."""
    allocated_s: float
    """M × `wall_s`, down-time included."""
    fresh_s: float
    """Steps merged into θ_g with no result overdue at their learner."""
    stale_s: float
    """Steps merged into θ_g that their learner took while a result it was due to
    merge had not arrived (Decoupled only: the others wait instead)."""
    discarded_s: float
    """Steps thrown away: a failed learner's since its last send, a message left out
    of its round, a step cut by a failure."""
    wait_s: float
    """Waiting at barriers and grace windows during the run."""
    tail_s: float
    """Waiting at the end: a learner's last step to the run's last merge."""
    down_s: float
    """Failure to restart (the trace's down-time)."""
    heal_s: float
    """Restart and the download of a live peer's state."""
    rounds: int
    """Rounds merged (each fragment's rounds counted apart)."""
    full_rounds: int
    """Rounds with a message from every learner."""
    staleness_mean: float
    """Mean steps a learner went on past a result it was due to merge (0: none)."""
    staleness_max: int
    """The most steps of those."""
    merges: int
    """Results merged by their learner (late or not; Decoupled only)."""
    merged_steps: tuple[int, ...]
    """Learner-steps merged into θ_g, per fragment (at least M × steps each)."""
    failures: int
    """Failures that hit a learner that was up (the others came while it was down)."""
    behind: int
    """Learners so late for a round that they healed from a peer."""

    @property
    def useful_s(self) -> float:
        """Steps merged into θ_g, fresh or stale."""
        return self.fresh_s + self.stale_s

    @property
    def goodput(self) -> float:
        """Useful learner time ÷ allocated time."""
        return self.useful_s / self.allocated_s

    @property
    def parts(self) -> dict[str, float]:
        """The parts of `allocated_s`, by name (`PARTS`)."""
        return {name: getattr(self, f"{name}_s") for name in PARTS}


@runtime_checkable
class Policy(Protocol):
    """What a method decides at the engine's step boundaries (times in ticks)."""

    def step_end(self, m: int, t: int) -> None:
        """Learner m finished a step: send what is due."""
        ...

    def may_start(self, m: int, t: int) -> bool:
        """Whether m may start its next step now (if not, the policy wakes it)."""
        ...

    def final(self, m: int, t: int) -> None:
        """The budget is taken: m sends everything it holds for the last merge."""
        ...

    def failed(self, m: int, t: int) -> None:
        """Learner m failed (its unsent work is already discarded)."""
        ...

    def rejoined(self, m: int, t: int) -> int:
        """m is healed: set its step count; return when it may go on (>= t)."""
        ...

    def arrivals(self, m: int, t: int) -> None:
        """Merge the results that reached m by its step boundary at t."""
        ...

    def stale(self, m: int) -> list[bool] | None:
        """Per fragment: whether m's next step is taken with a result overdue."""
        ...

    def held(self) -> list[tuple[list[int], int]]:
        """Work sent and never merged by the end: (work, fragment) pairs."""
        ...


# The engine's classes run once per event: the tests' runtime type checks
# (jaxtyping's import hook with beartype) would make a replay ~17× slower, so they
# are left out here; the public functions that build and run them are checked.
@no_type_check
class Learner:
    """One learner's mutable state on the clock (the engine's, not public)."""

    __slots__ = (
        "m",
        "state",
        "since",
        "count",
        "version",
        "step_end",
        "last_step",
        "fresh",
        "stale",
        "steps",
        "stale_now",
    )

    def __init__(self, m: int, fragments: int):
        self.m, self.state, self.since, self.count, self.version = m, WAIT, 0, 0, 0
        self.step_end = self.last_step = 0
        self.fresh = [0] * fragments  # ticks of unsent work per fragment
        self.stale = [0] * fragments  # of which taken with a result overdue
        self.steps = [0] * fragments  # steps of unsent work per fragment
        self.stale_now: list[bool] | None = None


@no_type_check
class Engine:
    """M learners on a virtual clock, replaying one trace under one policy.

    Every learner takes steps back to back unless its policy holds it; a step's time
    is `step_s` × its jitter × `slowdown` if it starts in a slow period. The budget is
    `steps` × M learner-steps: a learner claims a step as it starts it (a step cut by
    a failure, and work later discarded, give their claims back), and once the claims
    cover the budget each learner sends what it holds for a last merge (the policy's
    `final`). The run ends when that merge holds the whole budget for every fragment;
    otherwise the learners go on and merge again.

    A failure at time f stops the learner: its step in progress and its unsent work
    are discarded (work already sent is merged if its round takes it); it is down
    for the trace's down-time, then restarts (`Timing.restart_s`) and downloads a
    live peer's state (`Timing.heal_s`), then the policy says where it rejoins.
    A failure that comes while the learner is down or healing is ignored.
    """

    def __init__(
        self,
        trace: ClockTrace,
        timing: Timing,
        steps: int,
        shares: tuple[float, ...],
    ):
        check_clock_trace(trace)
        _check_count("steps", steps)
        self.trace, self.timing = trace, timing
        self.num_learners, self.num_fragments = trace.num_learners, len(shares)
        self.budget = steps * trace.num_learners
        self.claimed = [0] * len(shares)
        self.included = [0] * len(shares)
        self.ledger: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.learners = [Learner(m, len(shares)) for m in range(trace.num_learners)]
        self.policy: Policy | None = None
        self.step = timing.step_s / TICK
        self.restart, self.heal = ticks(timing.restart_s), ticks(timing.heal_s)
        self.rounds = self.full_rounds = self.failures = self.behinds = 0
        self.staleness: list[int] = []
        self._cuts = [float(c) for c in np.cumsum(shares)[:-1]]
        self._slow = _slow_periods(trace)
        self._jitter = [
            _Jitter(trace.jitter, trace.seed, m) for m in range(self.num_learners)
        ]
        self._events: list = []
        self._seq = itertools.count()
        self._ending: int | None = None
        self.end: int | None = None

    def run(self, policy: Policy) -> Summary:
        """Replay the trace under `policy`; the summary of the run.

        Raises:
            ValueError: if the run outlasts the trace's horizon.
        """
        self.policy = policy
        for learner in self.learners:
            self.wake(learner.m, 0)
        for m, at, down in np.asarray(self.trace.failures):
            self._push(ticks(at), _FAIL, self._fail, int(m), ticks(down))
        while self.end is None:
            if not self._events:
                raise RuntimeError("the virtual clock stopped before the run ended")
            t, _, _, fn, args = heapq.heappop(self._events)
            fn(t, *args)
        check(
            self.end * TICK <= self.trace.horizon_s,
            "trace.horizon_s",
            self.trace.horizon_s,
            f"at least the run's wall-clock, {self.end * TICK:.1f} s: draw the trace "
            "with a longer horizon",
        )
        return self._summary()

    # -- what policies call -------------------------------------------------------

    def take(self, m: int, p: int) -> list[int]:
        """Learner m's unsent work on fragment p, [fresh ticks, stale ticks, steps],
        now sent (it leaves the learner)."""
        learner = self.learners[m]
        work = [learner.fresh[p], learner.stale[p], learner.steps[p]]
        learner.fresh[p] = learner.stale[p] = learner.steps[p] = 0
        return work

    def include(self, work: list[int], p: int) -> None:
        """Merge sent work into θ_g."""
        self.ledger["fresh"] += work[0]
        self.ledger["stale"] += work[1]
        self.included[p] += work[2]

    def discard(self, work: list[int], p: int) -> None:
        """Throw sent work away; its steps are claimed again."""
        self.ledger["discarded"] += work[0] + work[1]
        self.claimed[p] -= work[2]

    def wake(self, m: int, t: int) -> None:
        """Have learner m look again at time t whether it may go on."""
        self._push(t, _WAKE, self._wake, m, self.learners[m].version)

    def timer(self, t: int, fn: Callable, *args) -> None:
        """Call `fn(t, *args)` at time t."""
        self._push(t, _WAKE, fn, *args)

    def behind(self, m: int, t: int) -> None:
        """Learner m is too late to catch up: it heals from a peer (no restart)."""
        learner = self.learners[m]
        self._account(learner, t)
        self._drop(learner)
        learner.version += 1
        learner.state, learner.since = HEAL, t
        self.behinds += 1
        self._push(t + self.heal, _REJOIN, self._rejoin, m, learner.version)

    def final_decided(self, t: int) -> None:
        """The last merge's result is in θ_g at t: end, or go on if work was lost."""
        if self._ending is not None:
            return
        if min(self.included) >= self.budget:
            self._ending = t
            self._push(t, _REJOIN, self._finish)
            return
        for learner in self.learners:
            if learner.state == TAIL:
                self.wake(learner.m, t)

    def up(self, m: int) -> bool:
        """Whether learner m is neither down nor healing."""
        return self.learners[m].state not in (DOWN, HEAL)

    # -- events -------------------------------------------------------------------

    def _push(self, t: int, priority: int, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, priority, next(self._seq), fn, args))

    def _wake(self, t: int, m: int, version: int) -> None:
        learner = self.learners[m]
        if learner.version == version and learner.state in (WAIT, TAIL):
            self._ready(learner, t)

    def _ready(self, learner: Learner, t: int) -> None:
        assert self.policy is not None
        self.policy.arrivals(learner.m, t)
        if min(self.claimed) >= self.budget:
            self._enter(learner, TAIL, t)
            self.policy.final(learner.m, t)
            return
        self._enter(learner, WAIT, t)
        if self.policy.may_start(learner.m, t):
            self._start(learner, t)

    def _start(self, learner: Learner, t: int) -> None:
        assert self.policy is not None
        learner.version += 1
        for p in range(self.num_fragments):
            self.claimed[p] += 1
        learner.stale_now = self.policy.stale(learner.m)
        slow = self.trace.slowdown if self._in_slow(learner.m, t) else 1.0
        d = max(1, round(self.step * self._jitter[learner.m].next() * slow))
        self._enter(learner, COMPUTE, t)
        learner.step_end = t + d
        self._push(t + d, _STEP_END, self._step_end, learner.m, learner.version)

    def _step_end(self, t: int, m: int, version: int) -> None:
        assert self.policy is not None
        learner = self.learners[m]
        if learner.version != version:
            return
        d = t - learner.since
        stale = learner.stale_now
        for p, part in enumerate(self._split(d)):
            if stale is not None and stale[p]:
                learner.stale[p] += part
            else:
                learner.fresh[p] += part
            learner.steps[p] += 1
        learner.count += 1
        learner.last_step = d
        learner.state, learner.since = WAIT, t
        self.policy.step_end(m, t)
        if learner.version == version:
            self._ready(learner, t)

    def _fail(self, t: int, m: int, down: int) -> None:
        assert self.policy is not None
        learner = self.learners[m]
        if learner.state in (DOWN, HEAL) or self.end is not None:
            return
        if learner.state == COMPUTE:
            self.ledger["discarded"] += t - learner.since
            for p in range(self.num_fragments):
                self.claimed[p] -= 1
        else:
            self._account(learner, t)
        self._drop(learner)
        learner.version += 1
        learner.state, learner.since = DOWN, t
        self.failures += 1
        self.policy.failed(m, t)
        self._push(t + down, _REJOIN, self._heal_start, m, learner.version)
        back = t + down + self.restart + self.heal
        self._push(back, _REJOIN, self._rejoin, m, learner.version)

    def _heal_start(self, t: int, m: int, version: int) -> None:
        learner = self.learners[m]
        if learner.version == version:
            self._enter(learner, HEAL, t)

    def _rejoin(self, t: int, m: int, version: int) -> None:
        assert self.policy is not None
        learner = self.learners[m]
        if learner.version != version:
            return
        self._enter(learner, WAIT, t)
        go = self.policy.rejoined(m, t)
        if go > t:
            self.wake(m, go)
        else:
            self._ready(learner, t)

    def _finish(self, t: int) -> None:
        assert self.policy is not None
        for learner in self.learners:
            if learner.state == COMPUTE:
                self.ledger["discarded"] += t - learner.since
                learner.state, learner.since = WAIT, t
            self._account(learner, t)
            self._drop(learner)
        for work, p in self.policy.held():
            self.discard(work, p)
        self.end = t

    # -- bookkeeping --------------------------------------------------------------

    def _account(self, learner: Learner, t: int) -> None:
        """Put learner's time since its last change into its state's part."""
        if learner.state in _PART_OF:
            self.ledger[_PART_OF[learner.state]] += t - learner.since
        learner.since = t

    def _enter(self, learner: Learner, state: str, t: int) -> None:
        self._account(learner, t)
        learner.state = state

    def _drop(self, learner: Learner) -> None:
        """Discard all of a learner's unsent work."""
        for p in range(self.num_fragments):
            self.discard(self.take(learner.m, p), p)

    def _split(self, d: int) -> list[int]:
        """d ticks over the fragments by their shares, in whole ticks summing to d."""
        bounds = [0] + [round(d * c) for c in self._cuts] + [d]
        return [b - a for a, b in zip(bounds, bounds[1:])]

    def _in_slow(self, m: int, t: int) -> bool:
        starts, ends = self._slow[m]
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t < ends[i]

    def _summary(self) -> Summary:
        assert self.end is not None
        s = {name: self.ledger[name] * TICK for name in PARTS}
        return Summary(
            wall_s=self.end * TICK,
            allocated_s=self.num_learners * self.end * TICK,
            **{f"{name}_s": value for name, value in s.items()},
            rounds=self.rounds,
            full_rounds=self.full_rounds,
            staleness_mean=float(np.mean(self.staleness)) if self.staleness else 0.0,
            staleness_max=max(self.staleness, default=0),
            merges=len(self.staleness),
            merged_steps=tuple(self.included),
            failures=self.failures,
            behind=self.behinds,
        )


def ticks(seconds: int | float) -> int:
    """Seconds on the virtual clock, in whole ticks."""
    return int(round(seconds / TICK))


@no_type_check
class _Jitter:
    """Mean-one lognormal step-time multipliers of one learner, in order."""

    def __init__(self, sigma: float, seed: int, m: int):
        self.sigma, self.rng = sigma, np.random.default_rng([seed, m, 2])
        self.block: list[float] = []
        self.i = 0

    def next(self) -> float:
        if not self.sigma:
            return 1.0
        if self.i == len(self.block):
            z = self.rng.standard_normal(1024)
            self.block = np.exp(self.sigma * z - self.sigma**2 / 2).tolist()
            self.i = 0
        self.i += 1
        return self.block[self.i - 1]


def _slow_periods(trace: ClockTrace) -> list[tuple[list[int], list[int]]]:
    """Per learner, the sorted starts and ends of its slow periods, merged where
    they overlap, in ticks."""
    out = []
    slow = np.asarray(trace.slow)
    for m in range(trace.num_learners):
        periods = sorted((ticks(a), ticks(b)) for _, a, b in slow[slow[:, 0] == m])
        merged: list[list[int]] = []
        for a, b in periods:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out.append(([a for a, _ in merged], [b for _, b in merged]))
    return out


def _poisson(rng: np.random.Generator, mean: float, end: float, length: float):
    """Episodes of a Poisson process over [0, end): (start, length in runs)."""
    count = rng.poisson(mean) if mean else 0
    starts = np.sort(rng.uniform(0.0, end, count))
    lengths = rng.exponential(length, count) if length else np.zeros(count)
    return list(zip(starts.tolist(), lengths.tolist()))


def _check_count(field: str, value: object) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    check(ok, field, value, "an integer >= 1")


def _real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
