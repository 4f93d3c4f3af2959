"""Goodput on the virtual clock: the accounting identity, closed forms for one
failure, an independent reference for plain Data-Parallel, and the policies' limits."""

import doctest

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sdiloco.sim import chaos, goodput, virtual_clock as vc


NONE = np.zeros((0, 3))
GRACE = 4.0


def timing(restart_s: float = 0.0, heal_s: float = 0.0, grace: float = GRACE):
    """1 s steps; the heal as bytes over 1 Gbit/s."""
    return chaos.Timing(1.0, grace, heal_s * 1e9 / 8, 1.0, restart_s=restart_s)


def one_failure(num_learners: int, at: float, down: float = 0.0) -> vc.ClockTrace:
    """Learner 1 fails at `at` seconds and is down `down` seconds."""
    return vc.ClockTrace(np.array([[1.0, at, down]]), NONE, num_learners)


def loss(out: vc.Summary) -> float:
    """Allocated time that was not useful."""
    return out.allocated_s - out.useful_s


def policies(num_learners: int, H: int, P: int, tau: int, K: int, sync_s: float):
    return {
        "plain": goodput.plain_dp_policy(sync_s),
        "elastic": goodput.elastic_dp_policy(sync_s),
        "diloco": goodput.diloco_policy(H, sync_s),
        "streaming": goodput.streaming_policy(H, P, tau, sync_s),
        "decoupled": goodput.decoupled_policy(
            min(K, num_learners), H, P, tau, sync_s=sync_s
        ),
    }


@settings(max_examples=40, deadline=None)
@given(
    learners=st.integers(1, 5),
    steps=st.integers(1, 40),
    rate=st.floats(0, 8),
    repair=st.floats(0, 0.1),
    stragglers=st.floats(0, 3),
    jitter=st.sampled_from([0.0, 0.2]),
    restart=st.sampled_from([0.0, 3.0, 14.6]),
    grace=st.sampled_from([0.0, 2.0, 4.0]),
    schedule=st.sampled_from([(1, 1, 0), (4, 1, 0), (6, 3, 2), (8, 4, 1)]),
    quorum=st.integers(1, 5),
    sync_s=st.sampled_from([0.0, 0.7]),
    seed=st.integers(0, 2**16),
)
def test_the_parts_add_up_to_the_allocated_time_exactly(
    learners,
    steps,
    rate,
    repair,
    stragglers,
    jitter,
    restart,
    grace,
    schedule,
    quorum,
    sync_s,
    seed,
):
    f = chaos.Failures(rate, repair, stragglers, 0.05, 3, seed=seed)
    trace = vc.draw_trace(f, learners, float(steps), jitter=jitter, horizon=200.0)
    t = timing(restart, 1.5, grace)
    for name, policy in policies(learners, *schedule, quorum, sync_s).items():
        try:
            out = goodput.simulate(trace, policy, t, steps)
        except ValueError as e:  # a run that cannot end before its trace does
            assert "horizon" in str(e)
            continue
        assert sum(out.parts.values()) == out.allocated_s, name
        assert all(v >= 0 for v in out.parts.values()), name
        assert min(out.merged_steps) >= learners * steps, name  # the whole budget
        assert 0 < out.goodput <= 1
        if name == "decoupled":
            assert out.wait_s == 0.0  # learners never wait
        else:
            assert out.stale_s == 0.0 and out.staleness_max == 0


@pytest.mark.parametrize("learners", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(goodput.standard_policies(8)))
def test_without_failures_or_stragglers_goodput_is_one(learners, name):
    policy = goodput.standard_policies(8)[name]
    if isinstance(policy, goodput.Decoupled):
        policy = goodput.decoupled_policy(min(policy.quorum, learners))
    trace = vc.ClockTrace(NONE, NONE, learners)
    out = goodput.simulate(trace, policy, timing(), steps=250)
    assert out.goodput == 1.0 and out.wall_s == 250.0
    assert out.merged_steps == (250 * learners,) * policy.fragments


@pytest.mark.parametrize("learners", [2, 3, 8])
@pytest.mark.parametrize(
    "at, down, restart, heal", [(5.0, 0.0, 10.0, 0.0), (37.0, 3.0, 14.6, 9.6)]
)
def test_plain_dp_loses_m_times_the_outage(learners, at, down, restart, heal):
    """One failure at a step boundary: everyone stops until the learner is back.
    With no down-time and no heal that is M × restart."""
    out = goodput.simulate(
        one_failure(learners, at, down),
        goodput.plain_dp_policy(),
        timing(restart, heal),
        steps=100,
    )
    outage = down + restart + heal
    assert loss(out) == pytest.approx(learners * outage, abs=1e-5)
    assert out.wait_s == pytest.approx((learners - 1) * outage, abs=1e-5)
    assert out.down_s == down and out.heal_s == pytest.approx(restart + heal)
    assert out.discarded_s == 0.0  # it failed between steps: nothing was lost


def plain_dp_reference(learners, steps, outage, failures):
    """Plain Data-Parallel with 1 s steps, written separately: step j starts when
    the previous one has ended for everyone; a learner that fails takes `down` +
    `outage` seconds to come back and then takes its step again; a failure while it
    is away is ignored. Returns the wall-clock."""
    by = [sorted((f, d) for m, f, d in failures if m == k) for k in range(learners)]
    back, seen, t = [0.0] * learners, [0] * learners, 0.0
    for _ in range(steps):
        ends = []
        for m in range(learners):
            start = max(t, back[m])
            while seen[m] < len(by[m]):
                f, down = by[m][seen[m]]
                if f < back[m]:
                    seen[m] += 1  # it was away: ignored
                    continue
                if f >= start + 1.0:
                    break
                seen[m] += 1
                back[m] = f + down + outage
                start = max(start, back[m])  # it waits, or its step is lost
            ends.append(start + 1.0)
        t = max(ends)
    return t


@settings(max_examples=25, deadline=None)
@given(
    learners=st.integers(1, 4),
    steps=st.integers(1, 30),
    failures=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(0, 400).map(lambda x: x / 8),
            st.integers(0, 40).map(lambda x: x / 8),
        ),
        max_size=6,
    ),
    outage=st.sampled_from([0.0, 2.5, 10.0]),
)
def test_plain_dp_matches_an_independent_reference(learners, steps, failures, outage):
    failures = [(m, f, d) for m, f, d in failures if m < learners]
    trace = vc.ClockTrace(
        np.asarray(failures, np.float64).reshape(-1, 3), NONE, learners
    )
    out = goodput.simulate(trace, goodput.plain_dp_policy(), timing(outage), steps)
    assert out.wall_s == pytest.approx(
        plain_dp_reference(learners, steps, outage, failures), abs=1e-5
    )
    assert out.useful_s == learners * steps  # every step is taken, once


@settings(max_examples=25, deadline=None)
@given(
    learners=st.integers(2, 4),
    steps=st.integers(5, 40),
    failures=st.lists(st.integers(0, 320).map(lambda x: x / 8), max_size=4),
    extra=st.integers(0, 320).map(lambda x: x / 8),
)
def test_one_more_failure_never_raises_plain_dp_goodput(
    learners, steps, failures, extra
):
    """Each failure on a learner of its own (a failure that comes while its learner
    is already away is absorbed, and can move the outage earlier: that is no longer
    'more failures')."""
    failures = failures[: learners - 1]
    rows = [(m, f, 0.0) for m, f in enumerate(failures)]
    more = rows + [(len(failures), extra, 0.0)]
    out = {}
    for name, r in (("base", rows), ("more", more)):
        trace = vc.ClockTrace(np.asarray(r, np.float64).reshape(-1, 3), NONE, learners)
        out[name] = goodput.simulate(
            trace, goodput.plain_dp_policy(), timing(7.0), steps
        )
    assert out["more"].wall_s >= out["base"].wall_s
    assert out["more"].goodput <= out["base"].goodput


@pytest.mark.parametrize("learners", [2, 3, 4])
@pytest.mark.parametrize("down, restart", [(0.0, 10.0), (3.0, 11.0), (0.0, 14.0)])
def test_elastic_dp_loses_one_grace_for_the_survivors_and_the_outage(
    learners, down, restart
):
    """Learner 1 fails at the 7 s step boundary. The others send step 8 at 8 s and
    wait one grace window for it, then go on without it; it is back at
    7 + down + restart, at a step boundary of theirs, and rejoins at once. It missed
    `down + restart − grace` steps, which the learners take again at the end (the
    last ones by fewer than M: the others wait at the tail)."""
    out = goodput.simulate(
        one_failure(learners, 7.0, down),
        goodput.elastic_dp_policy(),
        timing(restart),
        steps=100,
    )
    missed = int(down + restart - GRACE)
    tail = -missed % learners
    assert out.wait_s == (learners - 1) * GRACE
    assert out.down_s == down and out.heal_s == restart
    assert out.tail_s == tail
    assert loss(out) == (learners - 1) * GRACE + down + restart + tail
    # the rounds without it, and the last step if only some learners took it
    assert out.rounds - out.full_rounds == missed + (tail > 0)


def test_diloco_throws_away_the_steps_since_the_last_sync():
    """H = 10, M = 2; learner 1 fails at 13 s, 3 steps after its last sync.
    - back at 17 s (restart 4 s), before the sync at step 20: it rejoins at its peer's
      next step and sends at step 20, nobody waits. Lost: the 3 steps and the 4 s;
      the 7 steps it missed leave one learner a step of tail.
    - back at 28 s (restart 15 s): its peer waits a grace window at step 20 (20 to
      24 s), goes on, and is at a step boundary at 28 s. Lost: 3 steps, 15 s and
      the grace window; it missed 11 steps, which with the 3 make 14, no tail."""
    early = goodput.simulate(
        one_failure(2, 13.0), goodput.diloco_policy(10), timing(4.0), steps=100
    )
    assert early.discarded_s == 3.0 and early.wait_s == 0.0 and early.tail_s == 1.0
    assert loss(early) == 3.0 + 4.0 + 1.0
    late = goodput.simulate(
        one_failure(2, 13.0), goodput.diloco_policy(10), timing(15.0), steps=100
    )
    assert late.discarded_s == 3.0 and late.wait_s == GRACE and late.tail_s == 0.0
    assert loss(late) == 3.0 + 15.0 + GRACE
    assert late.full_rounds == late.rounds - 1  # round 20 went without it


def test_streaming_throws_away_each_fragments_steps_since_its_send():
    """H = 8, P = 4 (fragment p sent at steps 8k + 2p): a failure at 13 s discards
    13 − 8 = 5 steps of fragment 0, 13 − 10 = 3 of fragment 1, 13 − 12 = 1 of
    fragment 2 and 13 − 6 = 7 of fragment 3, a quarter of the step each: 4 s."""
    out = goodput.simulate(
        one_failure(2, 13.0),
        goodput.streaming_policy(8, 4, 1),
        timing(2.0),
        steps=100,
    )
    assert out.discarded_s == (5 + 3 + 1 + 7) / 4


def test_overlap_hides_the_sync_time_that_data_parallel_and_diloco_wait_for():
    """No failures, 0.7 s from a round's decision to its result: Data-Parallel
    waits it every step, DiLoCo every H steps, Streaming DiLoCo (τ = 5 steps) only
    at the last merge, and Decoupled DiLoCo's learners not at all but at the end."""
    trace, c = vc.ClockTrace(NONE, NONE, 3), 0.7
    run = {
        name: goodput.simulate(trace, policy, timing(), steps=200)
        for name, policy in policies(3, 100, 4, 5, 3, c).items()
    }
    assert run["plain"].wall_s == pytest.approx(200 * (1 + c), abs=1e-4)
    assert run["elastic"].wall_s == pytest.approx(200 * (1 + c), abs=1e-4)
    assert run["diloco"].wall_s == pytest.approx(200 + 2 * c, abs=1e-4)
    assert run["streaming"].wall_s == pytest.approx(200 + c, abs=1e-5)
    assert run["decoupled"].wall_s == pytest.approx(200 + c, abs=1e-5)
    assert run["decoupled"].wait_s == 0.0 and run["decoupled"].staleness_max == 0


@pytest.mark.parametrize("learners", [2, 4, 8])
@pytest.mark.parametrize("quorum", ["1", "M"])
def test_decoupled_loses_only_the_unsent_steps_and_the_outage(learners, quorum):
    """H = 10, P = 1, τ = 2: learner 1 fails at 13 s, 3 steps after its send, and is
    back 9 s later. Nobody waits: the loss is the 3 steps, the 9 s and the tail of
    the last steps (the 12 steps to take again, over M learners)."""
    k = 1 if quorum == "1" else learners
    out = goodput.simulate(
        one_failure(learners, 13.0),
        goodput.decoupled_policy(k, 10, 1, 2),
        timing(9.0),
        steps=100,
    )
    tail = -(3 + 9) % learners
    assert out.wait_s == 0.0 and out.discarded_s == 3.0 and out.tail_s == tail
    assert loss(out) == 3.0 + 9.0 + tail
    assert out.staleness_max == 0  # the syncer never holds a result past τ


def test_decoupled_records_who_went_on_past_a_late_result_and_for_how_long():
    """M = K = 2, H = 10, τ = 2, γ = 0. Learner 1 is 2× slow for its first 20 s, so
    it stays 10 steps behind learner 0. Each round waits for both: learner 0 sends
    at counts 10, 20, 30 and gets each result 10 s later, 8 steps past the step it
    was due (counts 12, 22, 32); the last round closes at the end (45 s), 3 steps past
    count 42. Learner 1 is never late. Stale work: learner 0's 8 + 8 + 8 + 3 steps."""
    trace = vc.ClockTrace(NONE, np.array([[1.0, 0.0, 20.0]]), 2)
    full = goodput.simulate(
        trace, goodput.decoupled_policy(2, 10, 1, 2, gamma=0.0), timing(), 40
    )
    assert full.wall_s == 45.0 and full.wait_s == 0.0
    assert full.stale_s == 27.0 and full.fresh_s == 90.0 - 27.0
    assert full.staleness_max == 8 and full.merges == 7
    assert full.staleness_mean == pytest.approx(27 / 7)
    # with K = 1 each message is merged as it comes: nothing is late
    one = goodput.simulate(
        trace, goodput.decoupled_policy(1, 10, 1, 2, gamma=0.0), timing(), 40
    )
    assert one.stale_s == 0.0 and one.staleness_max == 0 and one.wall_s == 45.0


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), learners=st.sampled_from([2, 4, 8]))
def test_decoupled_learners_never_wait_and_k_1_with_no_grace_is_never_stale(
    seed, learners
):
    """Failures, slow periods and jitter: the learners of Decoupled never wait for
    anyone (for any K). With K = 1 and γ = 0 each message is merged as it comes,
    within τ, so no result is ever late; with K = M the slowest learner holds each
    round, and the others go on past it."""
    f = chaos.Failures(3.0, 0.02, 3.0, 0.05, 3, seed=seed)
    trace = vc.draw_trace(f, learners, 300.0, jitter=0.2)
    t = timing(14.6, 9.6)
    fast = goodput.simulate(
        trace, goodput.decoupled_policy(1, 20, 2, 3, gamma=0.0), t, steps=300
    )
    assert fast.wait_s == 0.0 and fast.stale_s == 0.0 and fast.staleness_max == 0
    full = goodput.simulate(trace, goodput.decoupled_policy(learners, 20, 2, 3), t, 300)
    assert full.wait_s == 0.0
    # the same learners, the same work: only who was late to merge differs
    assert full.wall_s == fast.wall_s and full.useful_s == fast.useful_s
    assert full.staleness_max >= fast.staleness_max


def test_a_straggler_makes_synchronous_learners_wait_and_decoupled_ones_not():
    """Learner 0 is 2× slow for 40 s: Data-Parallel waits for it every step (1 s of
    the others' per slow step); a DiLoCo round falls out of the grace window, so it
    is left out and heals from a peer; Decoupled's learners go on."""
    trace = vc.ClockTrace(NONE, np.array([[0.0, 10.0, 50.0]]), 4)
    t = timing(14.6, 9.6)
    dp = goodput.simulate(trace, goodput.plain_dp_policy(), t, steps=100)
    assert dp.wait_s == 3 * 20.0 and dp.goodput == 420 / 480
    diloco = goodput.simulate(trace, goodput.diloco_policy(30), t, steps=100)
    assert diloco.behind == 1 and diloco.discarded_s > 0
    dec = goodput.simulate(trace, goodput.decoupled_policy(2, 30, 1, 3), t, 100)
    assert dec.wait_s == 0.0 and dec.behind == 0


def test_replay_is_deterministic_and_the_seed_matters():
    traces = goodput.failure_traces(
        3.0, [0, 0, 1], 4, 200.0, repair=0.02, stragglers=2.0, jitter=0.1
    )
    methods = goodput.standard_policies(4)
    a, b, c = (goodput.replay(tr, methods, timing(14.6, 9.6), 200) for tr in traces)
    assert a == b
    assert a != c
    assert set(a) == set(methods)


def test_standard_policies_are_the_issues_methods():
    assert list(goodput.standard_policies(8)) == [
        "Data-Parallel",
        "elastic Data-Parallel",
        "DiLoCo",
        "Streaming DiLoCo",
        "Decoupled K=1",
        "Decoupled K=4",
        "Decoupled K=8",
    ]
    assert list(goodput.standard_policies(1))[-1] == "Decoupled K=1"


def test_the_docstring_examples_hold():
    for module in (goodput, vc):
        assert doctest.testmod(module, raise_on_error=False).failed == 0


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: goodput.Synchronous(sync_every=0), r"Synchronous.sync_every=0"),
        (
            lambda: goodput.streaming_policy(4, 5, 1),
            r"Synchronous.fragments=5; expected <= sync_every = 4",
        ),
        (
            lambda: goodput.streaming_policy(10, 2, 10),
            r"Synchronous.overlap=10; expected an integer in \[0, 10\)",
        ),
        (
            lambda: goodput.plain_dp_policy(-1.0),
            r"Synchronous.sync_s=-1.0; expected a number >= 0",
        ),
        (
            lambda: goodput.Synchronous(4, 2, shares=(0.5, 0.6)),
            r"Synchronous.shares=\(0.5, 0.6\); expected P positive numbers summing",
        ),
        (lambda: goodput.decoupled_policy(0), r"Decoupled.quorum=0; expected"),
        (
            lambda: goodput.decoupled_policy(2, gamma=1.5),
            r"Decoupled.gamma=1.5; expected a number in \[0, 1\]",
        ),
        (
            lambda: goodput.decoupled_policy(2, ema=1.0),
            r"Decoupled.ema=1.0; expected a number in \[0, 1\)",
        ),
        (
            lambda: goodput.simulate(
                vc.ClockTrace(NONE, NONE, 2), goodput.decoupled_policy(3), timing(), 10
            ),
            r"Decoupled.quorum=3; expected <= M = 2",
        ),
    ],
)
def test_bad_input_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
