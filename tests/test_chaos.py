"""The chaos simulator: seeded traces, their checks, and the time they cost."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sdiloco.sim import chaos


TIMING = chaos.Timing(step_s=1.0, detect_s=10.0, heal_bytes=0.0, bandwidth_gbit=1.0)


@settings(max_examples=25, deadline=None)
@given(
    failures=st.floats(0, 20),
    stragglers=st.floats(0, 5),
    miss=st.floats(0, 1),
    seed=st.integers(0, 2**31 - 1),
    replicas=st.integers(1, 6),
)
def test_a_trace_is_seeded_valid_and_keeps_someone_at_the_start(
    failures, stragglers, miss, seed, replicas
):
    f = chaos.Failures(failures, 0.05, stragglers, 0.05, 3, miss, seed=seed)
    a = chaos.failure_trace(f, replicas, 200)
    b = chaos.failure_trace(f, replicas, 200)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    chaos.check_trace(a, replicas, 200)  # shapes, dtypes, subsets, someone at t = 1
    assert a.alive[0, 0]


def test_a_replicas_draws_do_not_depend_on_the_others():
    f = chaos.Failures(8.0, 0.05, 2.0, 0.05, seed=4)
    three, five = chaos.failure_trace(f, 3, 300), chaos.failure_trace(f, 5, 300)
    for x, y in zip(three, five):
        np.testing.assert_array_equal(x[:, 1:], y[:, 1:3])


def test_no_failures_is_everyone_at_every_step():
    trace = chaos.failure_trace(chaos.Failures(), 4, 50)
    assert all(x.all() for x in trace)
    assert chaos.summary(trace) == {
        "alive": 1.0,
        "computes": 1.0,
        "failures": 0,
        "returns": 0,
    }


def test_a_straggler_computes_one_step_in_slowdown_and_misses_no_more_than_it_may():
    f = chaos.Failures(stragglers=3.0, straggle=0.2, slowdown=4, miss=0.0, seed=2)
    trace = chaos.failure_trace(f, 2, 1000)
    assert trace.alive.all() and trace.sends.all()  # miss = 0: every message counts
    skipped = (~trace.computes).sum(axis=0)
    assert skipped.sum() > 0
    # in a slow period of n steps a replica computes ceil(n / 4) of them
    assert (~trace.computes).mean() <= 0.75


def test_wall_clock_without_failures_is_steps_times_step_time():
    trace = chaos.failure_trace(chaos.Failures(), 3, 100)
    out = chaos.wall_clock(trace, np.ones(100, bool), TIMING)
    assert out == {
        "wall_s": 100.0,
        "useful_s": 300.0,
        "goodput": 1.0,
        "stall_s": 0.0,
        "heal_s": 0.0,
        "lost_steps": 0,
        "discarded_steps": 0.0,
    }


def test_one_failure_stalls_data_parallel_and_a_sync_only_inside_the_window():
    """Replica 1 dies at step 21 (row 20) and returns at step 41: Data-Parallel waits
    the whole detection time (10 s); a method syncing at steps 25 and 50 waits the
    6 s left at step 25; one syncing at 50 alone never waits."""
    alive = np.ones((60, 2), bool)
    alive[20:40, 1] = False
    trace = chaos.Trace(alive, alive.copy(), alive.copy())
    every = chaos.wall_clock(trace, np.ones(60, bool), TIMING)
    assert every["stall_s"] == 10.0 and every["wall_s"] == 70.0
    syncs = np.zeros(60, bool)
    syncs[[24, 49]] = True
    assert chaos.wall_clock(trace, syncs, TIMING)["stall_s"] == 6.0
    syncs[24] = False
    late = chaos.wall_clock(trace, syncs, TIMING)
    assert late["stall_s"] == 0.0 and late["wall_s"] == 60.0
    # 20 of 120 replica-steps down, and the 20 steps replica 1 took before it died
    # were never sent: it heals to θ_g, so they are thrown away
    assert late["discarded_steps"] == 20.0
    assert late["goodput"] == pytest.approx(80 / 120)
    # Data-Parallel sends every step: a failure throws nothing away
    assert every["discarded_steps"] == 0.0
    assert every["goodput"] == pytest.approx(100 / (2 * 70))


def test_a_failure_discards_each_fragments_work_since_its_last_send():
    """Two fragments (a quarter and three quarters of the parameters), fragment 0
    sent at rows 3, 7, 11 and fragment 1 at rows 5, 9. Replica 1 dies at row 8: its
    rows 6 and 7 never reached fragment 1 (row 7's send of fragment 0 carried row 7),
    so 0.75 × 2 steps are thrown away; replica 0, which straggles at row 7 (computes,
    its message misses the round), loses nothing as it never fails."""
    alive = np.ones((12, 2), bool)
    alive[8:10, 1] = False
    sends = alive.copy()
    sends[7, 0] = False
    trace = chaos.Trace(alive, alive.copy(), sends)
    sent = np.zeros((12, 2), bool)
    sent[[3, 7, 11], 0] = True
    sent[[5, 9], 1] = True
    syncs = sent.any(1)
    shares = np.array([0.25, 0.75])
    out = chaos.wall_clock(trace, syncs, TIMING, sent=sent, shares=shares)
    assert out["discarded_steps"] == pytest.approx(1.5)
    assert out["useful_s"] == pytest.approx(22 - 1.5)
    # the same failure one row later throws away rows 6, 7, 8 of fragment 1 and row 8
    # of fragment 0 (nothing is sent at row 8)
    alive[8, 1], alive[9:11, 1] = True, False
    trace = chaos.Trace(alive, alive.copy(), alive.copy())
    out = chaos.wall_clock(trace, syncs, TIMING, sent=sent, shares=shares)
    assert out["discarded_steps"] == pytest.approx(0.25 * 1 + 0.75 * 3)


def test_healing_costs_the_returning_replica_its_download():
    alive = np.ones((30, 2), bool)
    alive[10:15, 1] = False
    trace = chaos.Trace(alive, alive.copy(), alive.copy())
    timing = chaos.Timing(1.0, 0.0, heal_bytes=3e9 / 8, bandwidth_gbit=1.0)  # 3 s
    out = chaos.wall_clock(trace, np.zeros(30, bool), timing)
    assert timing.heal_s == pytest.approx(3.0)
    assert out["lost_steps"] == 3 and out["heal_s"] == pytest.approx(3.0)
    # 5 steps down, 3 healing, and the 10 steps taken before the failure, never sent
    assert out["discarded_steps"] == 10.0
    assert out["useful_s"] == 60 - 5 - 3 - 10
    restart = chaos.Timing(1.0, 0.0, 3e9 / 8, 1.0, restart_s=4.0)
    out = chaos.wall_clock(trace, np.zeros(30, bool), restart)
    assert out["lost_steps"] == 7 and out["heal_s"] == pytest.approx(7.0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: chaos.Failures(failures=-1.0), r"Failures.failures=-1.0"),
        (lambda: chaos.Failures(repair=2.0), r"Failures.repair=2.0"),
        (lambda: chaos.Failures(slowdown=1), r"Failures.slowdown=1"),
        (lambda: chaos.failure_trace(chaos.Failures(), 0, 10), r"num_replicas=0"),
        (
            lambda: chaos.check_trace(chaos.Trace(*[np.ones((9, 2), bool)] * 3), 2, 10),
            r"trace.alive.shape=\(9, 2\); expected \(10, 2\)",
        ),
        (
            lambda: chaos.check_trace(
                chaos.Trace(np.zeros((10, 2), bool), *[np.zeros((10, 2), bool)] * 2),
                2,
                10,
            ),
            r"trace.alive\[0\]=\[False, False\]; expected at least one replica",
        ),
        (
            lambda: chaos.check_trace(
                chaos.Trace(
                    np.eye(2, dtype=bool)[[0] * 10],
                    np.ones((10, 2), bool),
                    np.eye(2, dtype=bool)[[0] * 10],
                ),
                2,
                10,
            ),
            r"trace.computes\[0, 1\]=True; expected False where alive is False",
        ),
        (
            lambda: chaos.check_trace(chaos.Trace(*[np.ones((10, 2), int)] * 3), 2, 10),
            r"trace.alive.dtype=dtype\('int64'\); expected bool",
        ),
    ],
)
def test_bad_input_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
