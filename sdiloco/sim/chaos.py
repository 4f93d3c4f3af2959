"""Chaos: seeded traces of replica failures and stragglers, and what they cost in time.

Two halves, both deterministic:

- `failure_trace(failures, num_replicas, steps)` draws who is alive, who computes and
  who sends at every step (`Trace`, NumPy bools `[T, M]`) from a `Failures`
  description. The learning side feeds its rows to the real step as
  `sdiloco.participation.Participation`s (`sdiloco.lab.train` does so for a config
  with `failures`).
- `wall_clock(trace, syncs, timing)` replays the same trace in time: each step takes
  `step_s`; a failure is noticed after a heartbeat timeout; a collective that meets an
  unnoticed failure waits until it is noticed; a returning replica first downloads its
  state (`heal_bytes` over the link). Data-Parallel has a collective at every step, so
  every failure stalls every live worker; the DiLoCo family has one only at its syncs,
  so a failure stalls the others only when a sync falls inside the detection window.
  Goodput is the useful compute (inner steps taken) over M × the wall-clock.

Failure times are drawn in units of the run's progress (the fraction of its steps), so
methods with different batches (and so different step counts) meet the same failures
at the same point of their token budget.
"""

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from .checks import check


@dataclasses.dataclass(frozen=True)
class Failures:
    """How replicas fail and straggle over a run (rates per replica, per run).

    Attributes:
        failures: expected failures of each replica over the run (a Poisson process
            in the run's progress); 0: none.
        repair: mean time down after a failure, as a fraction of the run
            (exponential).
        stragglers: expected slow periods of each replica over the run.
        straggle: length of a slow period, as a fraction of the run.
        slowdown: during a slow period the replica takes one inner step in
            `slowdown` (an integer >= 2).
        miss: probability that a slow replica's message misses a sync's grace
            window (it is then left out of that round's average).
        late: fraction of the run before replicas 1..M-1 join (0: all start).
        seed: the trace's seed.
    """

    failures: float = 0.0
    repair: float = 0.02
    stragglers: float = 0.0
    straggle: float = 0.02
    slowdown: int = 2
    miss: float = 0.0
    late: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("failures", "stragglers"):
            v = getattr(self, name)
            check(_real(v) and v >= 0, f"Failures.{name}", v, "a number >= 0")
        for name in ("repair", "straggle", "late", "miss"):
            v = getattr(self, name)
            check(_real(v) and 0 <= v <= 1, f"Failures.{name}", v, "a number in [0, 1]")
        ok = isinstance(self.slowdown, int) and self.slowdown >= 2
        check(ok, "Failures.slowdown", self.slowdown, "an integer >= 2")
        check(isinstance(self.seed, int), "Failures.seed", self.seed, "an integer")


class Trace(NamedTuple):
    """Who takes part at each step (`[T, M]` bools, row t for step t + 1)."""

    alive: np.ndarray
    computes: np.ndarray
    sends: np.ndarray


def failure_trace(failures: Failures, num_replicas: int, steps: int) -> Trace:
    """The participation of every step of a run, drawn from `failures`.

    One seed gives one trace; replica m's draws depend only on the seed and m, so
    adding replicas does not change the others'. Every replica is alive at the first
    step unless `late` delays it (replica 0 never joins late).

    Raises:
        ValueError: on a bad `num_replicas` or `steps`.
    """
    check(
        isinstance(num_replicas, int) and num_replicas >= 1,
        "num_replicas",
        num_replicas,
        "an integer >= 1",
    )
    check(isinstance(steps, int) and steps >= 1, "steps", steps, "an integer >= 1")
    progress = np.arange(steps) / steps  # where step t + 1 starts
    alive = np.ones((steps, num_replicas), bool)
    computes = np.ones((steps, num_replicas), bool)
    slow = np.zeros((steps, num_replicas), bool)
    for m in range(num_replicas):
        rng = np.random.default_rng([failures.seed, m])
        for start, length in _episodes(rng, failures.failures, failures.repair):
            alive[(progress >= start) & (progress < start + length), m] = False
        if m and failures.late:
            alive[progress < failures.late, m] = False
        for start, length in _episodes(rng, failures.stragglers, failures.straggle):
            during = np.flatnonzero((progress >= start) & (progress < start + length))
            slow[during, m] = True
            computes[during, m] = (during - during[:1]) % failures.slowdown == 0
        misses = rng.random(steps) < failures.miss
        computes[:, m] &= alive[:, m]
        slow[:, m] &= alive[:, m] & misses
    alive[0, 0] = computes[0, 0] = True  # someone is there at the first step
    return Trace(alive, computes, alive & ~slow)


def _episodes(rng: np.random.Generator, rate: float, mean_length: float):
    """Start and length of each episode of a Poisson process over progress [0, 1)."""
    count = rng.poisson(rate) if rate else 0
    starts = np.sort(rng.uniform(0.0, 1.0, count))
    lengths = rng.exponential(mean_length, count) if mean_length else np.zeros(count)
    return list(zip(starts, lengths))


def check_trace(trace: Trace, num_replicas: int, steps: int) -> None:
    """A trace fit for a run of `steps` steps of M replicas.

    Raises:
        ValueError: naming the field and the value: a shape other than `[steps, M]`,
            a dtype other than bool, no replica alive at the first step, or a replica
            that computes or sends while not alive.
    """
    for name, value in zip(trace._fields, trace):
        value = np.asarray(value)
        check(
            value.shape == (steps, num_replicas),
            f"trace.{name}.shape",
            value.shape,
            f"({steps}, {num_replicas}): one row per step of the run, one column per "
            "replica",
        )
        check(value.dtype == bool, f"trace.{name}.dtype", value.dtype, "bool")
    check(
        bool(np.asarray(trace.alive)[0].any()),
        "trace.alive[0]",
        np.asarray(trace.alive)[0].tolist(),
        "at least one replica alive at step 1",
    )
    for name in ("computes", "sends"):
        extra = np.asarray(getattr(trace, name)) & ~np.asarray(trace.alive)
        if extra.any():
            t, m = np.argwhere(extra)[0]
            check(False, f"trace.{name}[{t}, {m}]", True, "False where alive is False")


def summary(trace: Trace) -> dict[str, float]:
    """Fractions of replica-steps alive and computing, and the number of failures
    (alive → not alive) and returns (not alive → alive)."""
    alive = np.asarray(trace.alive)
    was = np.vstack([np.ones((1, alive.shape[1]), bool), alive[:-1]])
    return {
        "alive": float(alive.mean()),
        "computes": float(np.asarray(trace.computes).mean()),
        "failures": int((was & ~alive).sum()),
        "returns": int((~was & alive).sum()),
    }


@dataclasses.dataclass(frozen=True)
class Timing:
    """The time model of a chaos run.

    Attributes:
        step_s: seconds of one inner step (compute, with the method's own
            communication overlapped as in the utilization simulator).
        detect_s: heartbeat timeout: seconds until a failure is noticed.
        heal_bytes: bytes a returning replica downloads (its parameters and inner
            optimizer state, e.g. 3 × 4 bytes per parameter for AdamW in float32).
        bandwidth_gbit: the link it downloads over, Gbit/s.
        restart_s: seconds a returning replica's process takes to start before it
            asks for its state (imports, model, compiled programs).
    """

    step_s: float
    detect_s: float
    heal_bytes: float
    bandwidth_gbit: float
    restart_s: float = 0.0

    def __post_init__(self):
        for name in ("step_s", "detect_s", "heal_bytes", "bandwidth_gbit", "restart_s"):
            v = getattr(self, name)
            check(_real(v) and v >= 0, f"Timing.{name}", v, "a number >= 0")
        check(
            self.step_s > 0 and self.bandwidth_gbit > 0,
            "Timing.step_s/bandwidth",
            (self.step_s, self.bandwidth_gbit),
            "both > 0",
        )

    @property
    def heal_s(self) -> float:
        """Seconds to download a replica's state."""
        return 8 * self.heal_bytes / (self.bandwidth_gbit * 1e9)


def wall_clock(
    trace: Trace,
    syncs: np.ndarray,
    timing: Timing,
    sent: np.ndarray | None = None,
    shares: np.ndarray | None = None,
) -> dict[str, float]:
    """Replay `trace` in time for a method whose collectives are at `syncs`.

    Step t takes `step_s`. A failure at step t (alive at t − 1, not at t) is noticed
    `detect_s` later; a collective step (`syncs[t]`) that starts before then waits
    until it is noticed, stalling every live replica. A returning replica restarts
    (`restart_s`) and downloads its state (`heal_s`) before its first inner step,
    without stalling the others; its inner steps meanwhile are lost. The steps a
    failed replica took since it last sent each fragment are thrown away too
    (`discarded_steps`): it heals to θ_g.

    Args:
        trace, syncs, timing: the run's participation, the `[T]` steps with a
            collective (every step for Data-Parallel), the time model.
        sent, shares: `[T, P]` the steps at which fragment p is sent (default:
            `syncs`, one fragment) and `[P]` each fragment's fraction of the
            parameters (default equal), for `discarded_steps`.

    Returns:
        `wall_s`, `useful_s` (inner steps taken and kept × `step_s`), `goodput` (useful
        over M × wall), `stall_s`, `heal_s` (restart and download time of all
        returns), `lost_steps` (to restarting and healing), `discarded_steps`.
    """
    alive, computes = np.asarray(trace.alive), np.asarray(trace.computes).copy()
    steps, num_replicas = alive.shape
    syncs = np.asarray(syncs, bool)
    check(syncs.shape == (steps,), "syncs.shape", syncs.shape, f"({steps},)")
    was = np.vstack([np.ones((1, num_replicas), bool), alive[:-1]])
    now, noticed, stall, lost = 0.0, 0.0, 0.0, 0
    heal_steps = int(np.ceil((timing.restart_s + timing.heal_s) / timing.step_s))
    for t in range(steps):
        if (was[t] & ~alive[t]).any():  # a failure, noticed detect_s from now
            noticed = max(noticed, now + timing.detect_s)
        for m in np.flatnonzero(~was[t] & alive[t]):  # a return: download first
            span = slice(t, t + heal_steps)
            lost += int(computes[span, m].sum())
            computes[span, m] = False
        if syncs[t] and now < noticed:
            stall += noticed - now
            now = noticed
        now += timing.step_s
    discarded = discarded_steps(
        trace, computes, syncs if sent is None else sent, shares
    )
    useful = (float(computes.sum()) - discarded) * timing.step_s
    return {
        "wall_s": now,
        "useful_s": useful,
        "goodput": useful / (num_replicas * now),
        "stall_s": stall,
        "heal_s": int((~was & alive).sum()) * (timing.restart_s + timing.heal_s),
        "lost_steps": lost,
        "discarded_steps": discarded,
    }


def discarded_steps(
    trace: Trace,
    computes: np.ndarray,
    sent: np.ndarray,
    shares: np.ndarray | None = None,
) -> float:
    """Inner steps taken and thrown away by failures, weighted by fragment share:
    at each failure, the steps the replica computed since it last sent each
    fragment (a step's send carries that step's work). `sent` is `[T, P]` (or `[T]`,
    one fragment), `shares` `[P]` (default equal)."""
    alive, sends = np.asarray(trace.alive), np.asarray(trace.sends)
    sent = np.asarray(sent, bool)
    sent = sent[:, None] if sent.ndim == 1 else sent
    ok = sent.ndim == 2 and len(sent) == len(alive)
    check(ok, "sent.shape", sent.shape, f"({len(alive)}, P)")
    shares = np.full(sent.shape[1], 1 / sent.shape[1]) if shares is None else shares
    pending = np.zeros((alive.shape[1], sent.shape[1]))
    discarded = 0.0
    for t in range(alive.shape[0]):
        failed = ~alive[t] & (alive[t - 1] if t else True)
        discarded += float((pending[failed] @ shares).sum())
        pending[failed] = 0.0
        pending[computes[t]] += 1.0
        pending[np.ix_(sends[t], sent[t])] = 0.0
    return discarded


def _real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
