"""The virtual clock: seeded wall-clock traces, their checks, and the engine's time."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sdiloco.sim import chaos, goodput, virtual_clock as vc


TIMING = chaos.Timing(step_s=1.0, detect_s=4.0, heal_bytes=0.0, bandwidth_gbit=1.0)
NONE = np.zeros((0, 3))


@settings(max_examples=20, deadline=None)
@given(
    failures=st.floats(0, 20),
    repair=st.floats(0, 0.2),
    stragglers=st.floats(0, 5),
    seed=st.integers(0, 2**31 - 1),
    learners=st.integers(1, 6),
)
def test_a_trace_is_seeded_valid_and_each_learners_draws_are_its_own(
    failures, repair, stragglers, seed, learners
):
    f = chaos.Failures(failures, repair, stragglers, 0.05, 3, seed=seed)
    a = vc.draw_trace(f, learners, 100.0, jitter=0.1)
    b = vc.draw_trace(f, learners, 100.0, jitter=0.1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    vc.check_clock_trace(a)
    # a learner's draws depend on the seed and its index only
    more = vc.draw_trace(f, learners + 2, 100.0, jitter=0.1)
    np.testing.assert_array_equal(
        more.failures[more.failures[:, 0] < learners], a.failures
    )
    np.testing.assert_array_equal(more.slow[more.slow[:, 0] < learners], a.slow)
    # stragglers are drawn on a stream of their own: they do not move the failures
    calm = vc.draw_trace(
        chaos.Failures(failures, repair, seed=seed), learners, 100.0, jitter=0.1
    )
    np.testing.assert_array_equal(calm.failures, a.failures)
    assert len(calm.slow) == 0
    # times in seconds, inside the horizon
    assert (a.failures[:, 1] < a.horizon_s).all() and a.horizon_s == 1000.0


def test_the_rates_are_per_learner_per_run():
    """Failures per learner per run_s, over a horizon of 10 runs: the mean count over
    200 seeds is 10 × rate (Poisson; its standard error here is 0.22)."""
    rate = 2.0
    counts = [
        len(vc.draw_trace(chaos.Failures(rate, seed=s), 1, 50.0).failures)
        for s in range(200)
    ]
    assert np.mean(counts) == pytest.approx(10 * rate, abs=1.0)
    down = vc.draw_trace(chaos.Failures(50.0, 0.1, seed=3), 1, 50.0).failures[:, 2]
    assert down.mean() == pytest.approx(0.1 * 50.0, rel=0.2)  # 500 draws, 5 s


def test_no_failures_is_an_empty_trace():
    trace = vc.draw_trace(chaos.Failures(), 4, 100.0)
    assert trace.failures.shape == (0, 3) and trace.slow.shape == (0, 3)


def test_a_slow_period_slows_the_steps_that_start_in_it():
    """One learner, a slow period [10, 20) s at 3×: the steps starting at 10, 13, 16
    and 19 s take 3 s each, so 30 steps end at 30 + 4 × 2 s."""
    trace = vc.ClockTrace(NONE, np.array([[0.0, 10.0, 20.0]]), 1, slowdown=3.0)
    out = goodput.simulate(trace, goodput.plain_dp_policy(), TIMING, steps=30)
    assert out.wall_s == 38.0 and out.goodput == 1.0  # a slow step is still work


def test_jitter_is_mean_one_and_the_same_for_every_method():
    """σ = 0.3 on one learner: 4,000 steps take 4,000 s within 2 % (the standard
    error of the mean is 0.5 %); every method draws the same step times."""
    trace = vc.ClockTrace(NONE, NONE, 1, jitter=0.3, seed=7)
    dp = goodput.simulate(trace, goodput.plain_dp_policy(), TIMING, 4000)
    assert dp.wall_s == pytest.approx(4000, rel=0.02)
    assert dp.wall_s != 4000.0
    dec = goodput.simulate(trace, goodput.decoupled_policy(1), TIMING, 4000)
    assert dec.wall_s == dp.wall_s


def test_ticks_are_exact_binary_fractions_of_a_second():
    assert vc.TICK == 2.0**-20
    assert vc.ticks(1.0) == 2**20 and vc.ticks(14.6) * vc.TICK == pytest.approx(14.6)
    assert vc.ticks(0.1) * vc.TICK == pytest.approx(0.1, abs=vc.TICK)


def test_a_run_longer_than_its_trace_is_refused():
    """M = 1, a failure every 2 s that costs 10 s: the run outlasts 10 runs."""
    f = chaos.Failures(failures=50.0, seed=1)
    trace = vc.draw_trace(f, 1, 100.0, horizon=2.0)
    slow = chaos.Timing(1.0, 4.0, 0.0, 1.0, restart_s=10.0)
    with pytest.raises(ValueError, match=r"trace.horizon_s=200.0; expected at least"):
        goodput.simulate(trace, goodput.diloco_policy(50), slow, 100)


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            lambda: vc.draw_trace(chaos.Failures(miss=0.5), 2, 10.0),
            r"Failures.miss=0.5; expected 0 on the virtual clock",
        ),
        (
            lambda: vc.draw_trace(chaos.Failures(late=0.1), 2, 10.0),
            r"Failures.late=0.1",
        ),
        (lambda: vc.draw_trace(chaos.Failures(), 0, 10.0), r"num_learners=0"),
        (lambda: vc.draw_trace(chaos.Failures(), 2, 0.0), r"run_s=0.0; expected"),
        (
            lambda: vc.draw_trace(chaos.Failures(), 2, 1.0, jitter=-0.1),
            r"jitter=-0.1; expected a number >= 0",
        ),
        (
            lambda: vc.draw_trace(chaos.Failures(), 2, 1.0, horizon=0.5),
            r"horizon=0.5; expected a number >= 1",
        ),
        (
            lambda: vc.check_clock_trace(vc.ClockTrace(np.zeros((2, 2)), NONE, 2)),
            r"trace.failures.shape=\(2, 2\); expected \(N, 3\)",
        ),
        (
            lambda: vc.check_clock_trace(
                vc.ClockTrace(np.array([[2.0, 1.0, 0.0]]), NONE, 2)
            ),
            r"trace.failures\[:, 0\]=\[2.0\]; expected learner indices in \[0, M\)",
        ),
        (
            lambda: vc.check_clock_trace(
                vc.ClockTrace(np.array([[0.0, -1.0, 0.0]]), NONE, 2)
            ),
            r"trace.failures\[:, 1:\]=\[\[-1.0, 0.0\]\]; expected times >= 0",
        ),
        (
            lambda: vc.check_clock_trace(
                vc.ClockTrace(NONE, np.array([[0.0, 5.0, 4.0]]), 2)
            ),
            r"trace.slow=.*expected each period's end >= its start",
        ),
        (
            lambda: vc.check_clock_trace(vc.ClockTrace(NONE, NONE, 2, slowdown=0.5)),
            r"trace.slowdown=0.5; expected a number >= 1",
        ),
        (
            lambda: vc.check_clock_trace(vc.ClockTrace(NONE, NONE, 2, seed=-1)),
            r"trace.seed=-1; expected an integer >= 0",
        ),
        (
            lambda: goodput.simulate(
                vc.ClockTrace(NONE, NONE, 2), goodput.plain_dp_policy(), TIMING, 0
            ),
            r"steps=0; expected an integer >= 1",
        ),
    ],
)
def test_bad_input_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
