"""Elastic islands as real processes: `python -m sdiloco coordinate` and one
`python -m sdiloco train ... --board --replica m` per island, over loopback.

- Three islands that all stay up train the run of the one-device simulation (M = 3,
  float32 messages) within float32 rounding, and end with bitwise equal θ_g;
- one island SIGKILLed mid-run: the other two go on after one round's grace window
  (their longest wait is bounded by it), train without it, and the same command
  started again heals it from a live peer; it takes part in the rounds after, and
  every island ends with the same θ_g;
- island 1's link cut for a while (each process in a network namespace of
  `benchmarks.wan`, root): the others go on without it after one grace window, it
  reads the rounds it missed and takes part again without a heal, and every island
  ends with the same θ_g;
- bad flags end with one line and a non-zero status before anything starts.
"""

import contextlib
import functools
import io
import json
import os
import signal
import subprocess
import sys
import time

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from helpers import (
    assert_trees_allclose,
    communicate_all,
    cpu_env,
    finish_processes,
    free_port,
)

from benchmarks import wan
from sdiloco.distributed.board import Membership, RoundLog
from sdiloco.lab import cli, config as config_lib, elastic as elastic_lib, train


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = 3
WAN = wan.available()
FLAGS = [
    "--preset=streaming_overlap_fp4",
    "--model=tiny-xxs",
    f"--replicas={M}",
    "--sync-every=6",
    "--batch-size=6",
    "--eval-windows=64",
]
"""Streaming DiLoCo with overlapped FP4 (3 fragments, τ = 1), M = 3 islands, H = 6."""
PACED = ["--min-step-s=0.05"]
"""The long jobs' islands take at least 50 ms a step (they sleep what their step left,
`--min-step-s`): as long in wall time as 2.5x the steps unpaced on 2 busy cores
(~50 steps/s), so 40 % of the steps' compute."""
SLOW = ["--min-step-s=0.1"]
"""Twice `PACED`'s time a step: a job as long in wall time with half the steps. Every
paced job takes 480 steps, so all compile the same programs (the step's learning-rate
schedule holds the step count), and the jobs after the first load them from the
compilation cache: 30 CPU-s less for the SIGKILL and pause jobs, cold, side by side,
than at 960 steps paced by `PACED`."""


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def _popen(argv, out, start=subprocess.Popen):
    # The suite's compilation cache (`conftest.py`) is in the environment: a restarted
    # island loads its step from it, and so do the islands of the next job with the
    # same flags.
    return start(
        [sys.executable, "-m", "sdiloco", *argv],
        env=cpu_env(1, ROOT),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _board(port, grace, timeout, host="127.0.0.1"):
    return [
        f"--board={host}:{port}",
        f"--grace={grace}",
        f"--board-timeout={timeout}",
        "--init-timeout=120",
    ]


def _island(m, out, steps, board, extra=(), start=subprocess.Popen):
    return _popen(
        [
            "train",
            *FLAGS,
            *extra,
            f"--steps={steps}",
            f"--replica={m}",
            *board,
            f"--out={out}",
        ],
        out,
        start,
    )


def _job(out, steps, *, grace, timeout=120, extra=(), net=None, board_flags=()):
    """The coordinator and M islands over loopback, or each process in its own
    namespace of `net` (a `benchmarks.wan.Wan`: the coordinator is node 0, island m
    node m + 1)."""

    def start(node):
        return subprocess.Popen if net is None else functools.partial(net.popen, node)

    host = "127.0.0.1" if net is None else net.ip(0)
    board = [*_board(free_port(), grace, timeout, host), *board_flags]
    coordinator = _popen(
        ["coordinate", f"--replicas={M}", *board, f"--out={out}"], out, start(0)
    )
    islands = [_island(m, out, steps, board, extra, start(m + 1)) for m in range(M)]
    return coordinator, islands, board


def _config(steps, **method):
    return config_lib.preset(
        "streaming_overlap_fp4",
        model="tiny-xxs",
        steps=steps,
        eval_windows=64,
        sync_every=6,
        method={"num_replicas": M, **method},
        data={"global_batch_size": 6},
    )


def _theta(out, m, like):
    return eqx.tree_deserialise_leaves(out / f"island-{m}.eqx", like)


def _summary(out, name):
    return json.loads((out / name).read_text())


def _step(out, m):
    try:
        return int((out / f"island-{m}.step").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _assert_equal_thetas(out, like):
    """Every island's θ_g, checked bitwise equal to island 0's."""
    thetas = [_theta(out, m, like) for m in range(M)]
    for theta in thetas[1:]:
        assert all(
            np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(thetas[0]), jax.tree.leaves(theta))
        )
    return thetas


def _assert_survivors_waited_one_grace(out, grace):
    """Islands 0 and 2 waited at most about one grace window for any round."""
    for m in (0, 2):
        waits = [r["waited_s"] for r in _summary(out, f"island-{m}.json")["rounds"]]
        assert max(waits) < grace + 3.0, max(waits)


@pytest.mark.multiprocess
@pytest.mark.parametrize("tau", [1, 0])
def test_islands_train_the_simulated_run(tmp_path, tau):
    # float32 messages: with FP4 one rounding flip of a code moves an element by a
    # quantization step, so the comparison would test the quantizer, not the job.
    # τ = 0 (no overlap): each round between the halves of the step that sends.
    steps = 36
    quiet = ["--quantizer=none", f"--overlap={tau}", "--no-progress"]
    coordinator, islands, _ = _job(tmp_path, steps, grace=100, extra=quiet)
    outputs = finish_processes([*islands, coordinator], timeout=400)
    # `--no-progress` is honoured: no bar on an island either.
    assert not any("it/s" in out or f"/{steps} [" in out for out in outputs)
    decisions = _summary(tmp_path, "coordinator.json")
    assert decisions and all(d["members"] == [0, 1, 2] for d in decisions)
    assert not any(d["timed_out"] for d in decisions)
    simulated = train.run(_config(steps, quantizer=None, overlap=tau), progress=False)
    like = simulated.state.global_params
    thetas = _assert_equal_thetas(tmp_path, like)  # the same messages averaged
    # One program per island vs the vmapped simulation: float32 rounding apart.
    assert_trees_allclose(thetas[0], like, rtol=2e-4, atol=2e-5)
    final = _summary(tmp_path, "island-0.json")["evaluation"]["eval/global"]
    assert final == pytest.approx(simulated.evals[-1]["eval/global"], rel=1e-4)


@pytest.mark.multiprocess
def test_sigkill_an_island_the_others_go_on_and_it_heals(tmp_path):
    # Long enough that the restarted island (start-up and compile: ~20 s on two
    # busy cores) rejoins before the others finish (48 s, `SLOW`). The grace window
    # is longer than a survivor's stall on two cores shared with the other xdist
    # worker (8-24 s measured), so no survivor is told it is behind and heals (from a
    # finished peer near the end, docs/elastic.md): not what this test is about.
    steps, grace, kill_at = 480, 30.0, 60
    coordinator, islands, board = _job(tmp_path, steps, grace=grace, extra=SLOW)
    restarted = None
    try:
        deadline = time.monotonic() + 300
        while _step(tmp_path, 1) < kill_at and time.monotonic() < deadline:
            assert all(p.poll() is None for p in [coordinator, *islands])
            time.sleep(0.05)
        islands[1].send_signal(signal.SIGKILL)
        killed = _step(tmp_path, 1)
        assert kill_at <= killed < steps
        islands[1].communicate()
        restarted = _island(1, tmp_path, steps, board, SLOW)  # the same command
        outputs = finish_processes(
            [islands[0], islands[2], restarted, coordinator], 600
        )
    finally:
        for p in [coordinator, *islands, restarted]:
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    decisions = _summary(tmp_path, "coordinator.json")
    without = [i for i, d in enumerate(decisions) if 1 not in d["members"]]
    assert without, "the dead island took part in every round"
    # Its absence was detected at a round's grace deadline, and the others went on.
    assert decisions[without[0]]["timed_out"]
    assert decisions[without[0]]["members"] == [0, 2]
    back = [i for i, d in enumerate(decisions) if i > without[0] and 1 in d["members"]]
    assert back, "the restarted island never took part again"
    after = decisions[back[0] :]  # (a busy machine may drop a round here and there)
    assert sum(d["members"] == [0, 1, 2] for d in after) >= 0.9 * len(after)
    healed = _summary(tmp_path, "island-1.json")
    assert healed["healed"]["bytes"] > 0 and healed["first_step"] > killed
    served = sum(_summary(tmp_path, f"island-{m}.json")["served_bytes"] for m in (0, 2))
    assert served == healed["healed"]["bytes"]
    _assert_survivors_waited_one_grace(tmp_path, grace)
    _assert_equal_thetas(tmp_path, train.build(_config(steps)).model)
    survived = _summary(tmp_path, "island-0.json")  # paced: >= 100 ms a step
    assert survived["trained_s"] >= (steps - 1) * 0.1, survived["trained_s"]
    # A survivor said so, one line each: the peer left out, then back; and showed
    # its progress (the bar of `train`).
    survivor = outputs[0]
    assert survivor.count("went on without island 1") == 1, survivor[-3000:]
    assert survivor.count("island 1 is back") == 1, survivor[-3000:]
    assert f"{steps}/{steps}" in survivor


def test_membership_says_who_left_and_who_came_back():
    rounds = [
        RoundLog("a", 0.0, 0.1, (0, 1, 2), 10),
        RoundLog("b", 0.0, 4.0, (0, 2), 10),
        RoundLog("c", 0.0, 0.1, (0, 2), 10),
    ]
    members = Membership(3)
    assert members.news(rounds[:1]) == []
    assert members.news(rounds) == ["round b went on without island 1"]
    assert members.news(rounds) == []  # each round is read once
    rounds.append(RoundLog("d", 0.0, 0.1, (0, 1, 2), 10))
    assert members.news(rounds) == ["island 1 is back (round d)"]


@pytest.mark.multiprocess
@pytest.mark.skipif(not WAN[0], reason=f"no WAN emulation here: {WAN[1]}")
def test_a_cut_link_leaves_the_island_out_then_it_takes_part_again(tmp_path):
    # Each process in its own network namespace (`benchmarks.wan`); island 1's link
    # is down for longer than the grace window and shorter than the heartbeat.
    # A grace window long enough that the islands' unequal start on a busy machine is
    # not taken for a failure.
    steps, grace, cut_at, cut_s = 480, 8.0, 60, 12.0
    with wan.Wan(M + 1) as net:
        flags = ["--heartbeat=60"]
        coordinator, islands, _ = _job(
            tmp_path, steps, grace=grace, extra=PACED, net=net, board_flags=flags
        )
        procs = [coordinator, *islands]
        deadline = time.monotonic() + 300
        while _step(tmp_path, 1) < cut_at:
            assert all(p.poll() is None for p in procs)
            assert time.monotonic() < deadline, f"island 1 never reached step {cut_at}"
            time.sleep(0.05)
        cut_from = _step(tmp_path, 1), [_step(tmp_path, m) for m in range(M)]
        net.set_link(2, up=False)  # island 1 is node 2
        time.sleep(cut_s)
        net.set_link(2, up=True)
        finish_processes(procs, timeout=600)
    decisions = _summary(tmp_path, "coordinator.json")
    cut = [d for d in decisions if d["timed_out"] and d["members"] == [0, 2]]
    # the others went on without it
    assert cut, (
        f"the cut was never detected: cut at steps {cut_from}; rounds that were not "
        f"all three: {[d for d in decisions if d['members'] != [0, 1, 2]][:8]}; "
        f"timed out: {[d for d in decisions if d['timed_out']][:8]}"
    )
    assert sum(d["timed_out"] for d in decisions) <= 4
    without = [i for i, d in enumerate(decisions) if 1 not in d["members"]]
    back = decisions[without[-1] + 1 :]
    assert len(back) > len(decisions) // 4  # it takes part to the end
    assert all(d["members"] == [0, 1, 2] for d in back)
    assert not _summary(tmp_path, "island-1.json")["healed"]  # it never left
    _assert_survivors_waited_one_grace(tmp_path, grace)
    # it read the rounds it missed: the same θ_g
    _assert_equal_thetas(tmp_path, train.build(_config(steps)).model)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["coordinate", "--replicas=3"], "coordinate needs --board HOST:PORT"),
        (
            ["coordinate", "--board=h:1", "--replicas=1"],
            "--replicas=1; allowed: M >= 2",
        ),
        (["coordinate", "--board=nohost", "--replicas=3"], "board='nohost'; allowed"),
        (["train", "--board=h:1", "--replicas=3"], "--board needs --replica"),
        (
            ["train", "--board=h:1", "--replicas=3", "--batch-size=6", "--replica=3"],
            "replica=3 of method.num_replicas=3",
        ),
        (
            ["train", "--board=h:1", "--preset=data_parallel", "--replica=0"],
            "method.kind='data_parallel' on an island",
        ),
        (
            ["train", "--board=h:1", "--replica=0", "--grace=10", "--board-timeout=5"],
            "timeout_s=5.0 <= grace_s=10.0",
        ),
        (
            ["coordinate", "--board=h:1", "--replicas=3", "--heartbeat=0"],
            "heartbeat_s=0; allowed: >= 1 s",
        ),
        (
            ["train", "--board=h:1", "--replica=0", "--min-step-s=-0.5"],
            "min_step_s=-0.5; allowed: 0 <= S < inf seconds",
        ),
        (
            ["train", "--board=h:1", "--replica=0", "--min-step-s=inf"],
            "min_step_s=inf; allowed: 0 <= S < inf seconds",
        ),
        (["train", "--min-step-s=0.1"], "--min-step-s without --board"),
    ],
)
def test_bad_flags_are_one_line(argv, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(argv)
    assert status == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@hypothesis.given(
    grace=st.floats(0.1, 300.0), heartbeat=st.integers(1, 3600), slack=st.floats(1, 9)
)
def test_a_rounds_copies_stay_while_a_silent_island_still_counts_as_live(
    grace, heartbeat, slack
):
    # An island stopped for less than the heartbeat still counts as live; when it
    # goes on, the board's copies of the round it was reading must still be there.
    options = elastic_lib.BoardOptions(
        "127.0.0.1:1", grace_s=grace, timeout_s=grace + slack, heartbeat_s=heartbeat
    )
    assert options.keep_s >= heartbeat + grace
    assert options.keep_s >= max(60.0, 4 * grace)


def test_the_step_file_is_replaced_whole(tmp_path):
    elastic_lib._write(tmp_path, "island-0.step", "5")
    with pytest.raises(TypeError):
        elastic_lib._write(tmp_path, "island-0.step", 6)  # pyright: ignore
    assert (tmp_path / "island-0.step").read_text() == "5"  # never empty
    elastic_lib._write(tmp_path, "island-0.step", "7")
    assert (tmp_path / "island-0.step").read_text() == "7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["island-0.step"]


def test_a_paced_island_takes_its_minimum_per_step_and_no_more(tmp_path):
    # `--min-step-s`: each step lasts at least the minimum; a step slower than it
    # (here 0.5 s of work) is not paced further, nor made up for by the next.
    start = time.monotonic()  # the first step is due 0.2 s after the callback is made
    paced = elastic_lib._StepFile(tmp_path, 0, _config(10), min_step_s=0.2)
    paced(1, None, None)
    paced(2, None, None)
    assert time.monotonic() - start >= 2 * 0.2
    time.sleep(0.5)
    late = time.monotonic()
    paced(3, None, None)
    assert time.monotonic() - late < 0.15  # behind: no sleep
    paced(4, None, None)
    assert time.monotonic() - late >= 0.2  # then the minimum again
    assert not (tmp_path / "island-0.step").exists()  # every log_every = 10 steps


@pytest.mark.multiprocess
def test_a_pause_shorter_than_the_heartbeat_is_ridden_out(tmp_path):
    # Island 1 stopped (SIGSTOP) for 8 s under a 10 s heartbeat: its process goes on
    # after SIGCONT. The others go on without it after one grace window, and wait
    # for it again once it has caught up (it is about 3 s behind, less than the
    # grace window), so no round after it waits out a second window.
    steps, grace, stop_at, pause = 480, 5.0, 60, 8.0
    coordinator, islands, _ = _job(
        tmp_path, steps, grace=grace, extra=PACED, board_flags=["--heartbeat=10"]
    )
    procs = [coordinator, *islands]
    try:
        deadline = time.monotonic() + 300
        while _step(tmp_path, 1) < stop_at and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs)
            time.sleep(0.05)
        islands[1].send_signal(signal.SIGSTOP)
        time.sleep(pause)
        islands[1].send_signal(signal.SIGCONT)
        outputs = finish_processes(procs, timeout=600)  # every process ends well
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert "Check failure" not in outputs[2] and "Traceback" not in outputs[2]
    # The rounds sent from the pause on (a busy machine's unequal start-up may time
    # out a first round): one grace window, then island 1 takes part again.
    decisions = [
        d
        for d in _summary(tmp_path, "coordinator.json")
        if int(d["round"].split("-")[0]) >= stop_at
    ]
    late = [d for d in decisions if d["timed_out"]]
    assert len(late) == 1 and late[0]["members"] == [0, 2], late
    without = [i for i, d in enumerate(decisions) if 1 not in d["members"]]
    assert without and decisions[without[0]]["timed_out"]
    back = decisions[without[-1] + 1 :]
    assert back and all(d["members"] == [0, 1, 2] for d in back)
    _assert_survivors_waited_one_grace(tmp_path, grace)
    _assert_equal_thetas(tmp_path, train.build(_config(steps)).model)


@pytest.mark.multiprocess
def test_an_island_that_loses_the_board_ends_with_one_line(tmp_path):
    # Paced: far from done (48 s) when the board goes, on any machine.
    steps, heartbeat = 480, 3
    coordinator, islands, _ = _job(
        tmp_path,
        steps,
        grace=4.0,
        extra=SLOW,
        board_flags=[f"--heartbeat={heartbeat}"],
    )
    try:
        deadline = time.monotonic() + 300
        while _step(tmp_path, 0) < 30 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in [coordinator, *islands])
            time.sleep(0.05)
        coordinator.kill()  # the board is gone
        coordinator.communicate()
        lost = time.monotonic()
        outputs = [out for out, _ in communicate_all(islands, 60)]
        took = time.monotonic() - lost
    finally:
        for p in [coordinator, *islands]:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert heartbeat - 1 < took < heartbeat + 30
    for m, (p, out) in enumerate(zip(islands, outputs)):
        assert p.returncode == 1, out[-3000:]
        last = out.strip().splitlines()[-1]
        assert last.startswith(f"error: island {m}: lost the board at "), last
        assert last.endswith("start the same command again to heal"), last
        for trace in ("Check failure", "Traceback", "*** ", "@ 0x"):
            assert trace not in out, out[-3000:]
