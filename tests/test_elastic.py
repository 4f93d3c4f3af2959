"""The elastic job on Ray, end to end: `python -m sdiloco train --elastic`, each job
inside a network namespace of its own whose only interface is `lo` (`unshare
--net`, root; made by the test, gone with its processes), so Ray binds loopback.

- three islands that stay up train the run of the one-device simulation (M = 3,
  float32 messages) within float32 rounding and end with bitwise equal θ_g; the
  job joins a Ray cluster started beforehand (`--address`), and while it runs, an
  island with another seed and a second process claiming island 1 are refused,
  each with one line, and the job goes on;
- island 1 SIGKILLed: the others go on without it once Ray reports the death (at
  most one grace window), Ray restarts it, it heals from a live peer, and the peer
  that served it is SIGKILLed in turn (kill the healer): both come back, and every
  island ends with the same θ_g;
- island 1 stopped (SIGSTOP) for less than the grace window after which it would
  be told it is behind: left out once, then it takes part again, no heal;
- the syncer SIGKILLed: every island ends with one line, their checkpoints stay,
  and the same command resumes the job to the end with equal θ_g;
- light scenarios in one Ray instance (`tests/elastic_scenarios.py`): a sender
  SIGKILLed right after a round's decision, whose message is still read (the
  syncer owns every message; with the sender owning it, it is lost); and a heal
  whose peer is SIGKILLed before it serves, routed to another peer.
"""

import contextlib
import io
import json
import os
import shutil
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
from helpers import assert_trees_allclose, communicate_all, cpu_env

from sdiloco.distributed.ray_transport import Membership, RoundLog
from sdiloco.lab import cli, config as config_lib, elastic as elastic_lib, train


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = 3
STEPS = 240
FLAGS = [
    "--preset=streaming_overlap_fp4",
    "--model=tiny-xxs",
    f"--replicas={M}",
    "--sync-every=6",
    "--batch-size=6",
    "--eval-windows=64",
]
"""Streaming DiLoCo with overlapped FP4 (3 fragments, τ = 1), M = 3 islands, H = 6."""
PACED = ["--min-step-s=0.1"]
"""Each island's step takes at least 100 ms (it sleeps what its step left): 24 s of
training for the 240 steps every paced job takes (the same programs, loaded from
the compilation cache after the first job)."""


def _netns() -> tuple[bool, str]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False, "needs root and unshare (a network namespace per job)"
    probe = subprocess.run(
        ["unshare", "--net", "ip", "link", "set", "lo", "up"], capture_output=True
    )
    return probe.returncode == 0, probe.stderr.decode()[:200]


NETNS = _netns()
needs_netns = pytest.mark.skipif(not NETNS[0], reason=f"no namespace: {NETNS[1]}")
RAY = shutil.which("ray", path=os.path.dirname(sys.executable))


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


class _Namespace:
    """Commands in one network namespace whose only interface is `lo`: the first
    (`start`) makes it; the others enter it (`nsenter`); `close` kills every
    process left in it (Ray's, after a SIGKILLed driver), which removes it."""

    def __init__(self):
        self.first: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []

    def start(self, argv, **kw) -> subprocess.Popen:
        if self.first is None:
            script = 'ip link set lo up && exec "$@"'
            argv = ["unshare", "--net", "sh", "-c", script, "sh", *argv]
        else:
            argv = ["nsenter", f"--net=/proc/{self.first.pid}/ns/net", *argv]
        p = subprocess.Popen(
            argv,
            env=dict(cpu_env(1, ROOT), RAY_AUTH_MODE="token"),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **kw,
        )
        if self.first is None:
            self.first = p
            deadline = time.monotonic() + 10
            while self._inode(p.pid) == self._inode(os.getpid()):
                assert time.monotonic() < deadline, "unshare did not start"
                time.sleep(0.01)
            self.inode = self._inode(p.pid)
        self.procs.append(p)
        return p

    @staticmethod
    def _inode(pid) -> str:
        try:
            return os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            return ""

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        if self.first is None:
            return
        for pid in [int(x) for x in os.listdir("/proc") if x.isdigit()]:
            if pid != os.getpid() and self._inode(pid) == self.inode:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def netns():
    ns = _Namespace()
    try:
        yield ns
    finally:
        ns.close()


def _argv(out, *, grace, extra=()):
    return [
        sys.executable,
        "-m",
        "sdiloco",
        "train",
        "--elastic",
        *FLAGS,
        f"--steps={STEPS}",
        f"--grace={grace}",
        f"--out={out}",
        "--no-progress",
        *extra,
    ]


def _config(steps=STEPS, **method):
    return config_lib.preset(
        "streaming_overlap_fp4",
        model="tiny-xxs",
        steps=steps,
        eval_windows=64,
        sync_every=6,
        method={"num_replicas": M, **method},
        data={"global_batch_size": 6},
    )


def _summary(out, name):
    return json.loads((out / name).read_text())


def _step(out, m):
    try:
        return int((out / f"island-{m}.step").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _pid(out, name):
    return int((out / f"{name}.pid").read_text())


def _wait(condition, procs, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, f"ended before {what}: {ended[0].communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _assert_equal_thetas(out, like):
    """Every island's θ_g, checked bitwise equal to island 0's."""
    thetas = [
        eqx.tree_deserialise_leaves(out / f"island-{m}.eqx", like) for m in range(M)
    ]
    for theta in thetas[1:]:
        assert all(
            np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(thetas[0]), jax.tree.leaves(theta))
        )
    return thetas


def _decisions(out):
    return _summary(out, "syncer.json")["decisions"]


def _assert_survivors_waited_one_grace(out, grace, survivors=(0, 2)):
    for m in survivors:
        waits = [r["waited_s"] for r in _summary(out, f"island-{m}.json")["rounds"]]
        assert max(waits) < grace + 5.0, max(waits)


INTRUDER = """
import json, os, sys, ray
from sdiloco.lab import config as c, elastic as e
where = json.load(open(sys.argv[1]))
ray.init(address=where["address"], namespace=where["namespace"])
syncer = ray.get_actor("syncer")
base = c.preset("streaming_overlap_fp4", model="tiny-xxs", steps=36, eval_windows=64,
    sync_every=6, method={"num_replicas": 3, "quantizer": None, "compressor": None},
    data={"global_batch_size": 6})
for config in (base.replace(seed=1), base):  # another seed; then island 1's id
    fields = e.fingerprint(config)
    print(json.dumps(ray.get(syncer.hello.remote(1, None, fields, 0, os.getpid()))))
"""


@pytest.mark.multiprocess
@needs_netns
def test_islands_train_the_simulated_run_on_a_cluster_and_refuse_intruders(
    tmp_path, netns
):
    # float32 messages: with FP4 one rounding flip of a code moves an element by a
    # quantization step, so the comparison would test the quantizer, not the job.
    steps = 36
    head = [RAY, "start", "--head", "--port=6380", "--num-cpus=2"]
    head += ["--include-dashboard=false", "--object-store-memory=200000000"]
    flags = ["--quantizer=none", "--address=127.0.0.1:6380", "--init-timeout=120"]
    argv = _argv(tmp_path, grace=100, extra=flags)
    argv[argv.index(f"--steps={STEPS}")] = f"--steps={steps}"
    script = f"{' '.join(head)} > /dev/null && exec {' '.join(argv)}"
    job = netns.start(["sh", "-c", script])
    _wait(lambda: (tmp_path / "ray.json").exists(), [job], "the job's start")
    listening = netns.start(["ss", "-ltnH"]).communicate(timeout=30)[0]
    intruder = netns.start([sys.executable, "-c", INTRUDER, str(tmp_path / "ray.json")])
    (out, _), (refused, _) = communicate_all([job, intruder], 400)
    assert job.returncode == 0, out[-4000:]
    # Every port of the job is on loopback (the namespace has nothing else).
    ports = [line.split()[3] for line in listening.splitlines()]
    assert ports and all("127.0.0.1" in p or p.startswith("[::1]") for p in ports)
    # An island with another seed, then a second process claiming island 1: each
    # refused in one line naming why; the job went on and ended well.
    lines = [json.loads(x)["refused"] for x in refused.splitlines() if "refused" in x]
    assert len(lines) == 2, refused[-3000:]
    assert "island 1 refused: its config differs" in lines[0] and "seed" in lines[0]
    assert "island 1 is already held by actor" in lines[1]
    report = _summary(tmp_path, "syncer.json")
    assert len(report["refused"]) == 2
    decisions = report["decisions"]
    assert decisions and all(d["members"] == [0, 1, 2] for d in decisions)
    simulated = train.run(_config(steps, quantizer=None), progress=False)
    like = simulated.state.global_params
    thetas = _assert_equal_thetas(tmp_path, like)  # the same messages averaged
    assert_trees_allclose(thetas[0], like, rtol=2e-4, atol=2e-5)


def _healer_of(out, asker: int) -> int | None:
    """The island whose journal says it served a heal to `asker` (a journal also
    holds an island's own heals, so its existence says nothing)."""
    for m in range(M):
        journal = out / f"island-{m}.jsonl"
        if m == asker or not journal.exists():
            continue
        for line in journal.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            if event["what"] == "serve" and str(event.get("asker")) == str(asker):
                return m
    return None


@pytest.mark.multiprocess
@needs_netns
def test_a_killed_island_and_then_its_healer_are_restarted_and_heal(tmp_path, netns):
    grace, kill_at = 10.0, 60
    job = netns.start(_argv(tmp_path, grace=grace, extra=PACED))
    _wait(lambda: _step(tmp_path, 1) >= kill_at, [job], f"step {kill_at}")
    killed = _step(tmp_path, 1)
    os.kill(_pid(tmp_path, "island-1"), signal.SIGKILL)
    _wait(lambda: _healer_of(tmp_path, 1) is not None, [job], "a heal served")
    healer = _healer_of(tmp_path, 1)
    finished = (tmp_path / f"island-{healer}.json").exists()  # serving at its end
    os.kill(_pid(tmp_path, f"island-{healer}"), signal.SIGKILL)  # kill the healer
    ((out, _),) = communicate_all([job], 500)
    assert job.returncode == 0, out[-4000:]
    decisions = _decisions(tmp_path)
    without = [i for i, d in enumerate(decisions) if 1 not in d["members"]]
    # Decided without it when Ray reported its death, at the latest at the grace
    # deadline: the survivors stalled at most one grace window.
    assert without and decisions[without[0]]["members"] == [0, 2]
    assert decisions[without[0]]["waited_s"] < grace + 3.0
    back = [i for i, d in enumerate(decisions) if 1 in d["members"]]
    assert back[-1] > without[0] or finished, "the restarted island never took part"
    # A healer killed after its last step counts as finished (its summary was
    # written); one killed before is restarted and heals too.
    for m in (1,) if finished else (1, healer):
        summary = _summary(tmp_path, f"island-{m}.json")
        assert summary["healed"]["bytes"] > 0 and summary["first_step"] > killed
    _assert_equal_thetas(tmp_path, train.build(_config()).model)
    assert "went on without island 1" in out


@pytest.mark.multiprocess
@needs_netns
def test_a_pause_shorter_than_the_grace_window_is_ridden_out(tmp_path, netns):
    # Island 1 stopped for 8 s: the others go on without it after one grace window
    # (5 s); it wakes about 3 s after that decision, less than a grace window, so
    # it reads the round it missed and is waited for again: no heal.
    grace, stop_at, pause = 5.0, 60, 8.0
    job = netns.start(_argv(tmp_path, grace=grace, extra=PACED))
    _wait(lambda: _step(tmp_path, 1) >= stop_at, [job], f"step {stop_at}")
    pid = _pid(tmp_path, "island-1")
    os.kill(pid, signal.SIGSTOP)
    time.sleep(pause)
    os.kill(pid, signal.SIGCONT)
    ((out, _),) = communicate_all([job], 500)
    assert job.returncode == 0, out[-4000:]
    decisions = [
        d for d in _decisions(tmp_path) if int(d["round"].split("-")[0]) >= stop_at
    ]
    late = [d for d in decisions if d["timed_out"]]
    assert len(late) == 1 and late[0]["members"] == [0, 2], late
    without = [i for i, d in enumerate(decisions) if 1 not in d["members"]]
    back = decisions[without[-1] + 1 :]
    assert back and all(d["members"] == [0, 1, 2] for d in back)
    assert not _summary(tmp_path, "island-1.json")["healed"]
    _assert_survivors_waited_one_grace(tmp_path, grace)
    _assert_equal_thetas(tmp_path, train.build(_config()).model)


@pytest.mark.multiprocess
@needs_netns
def test_a_lost_syncer_ends_each_island_in_one_line_and_the_job_resumes(
    tmp_path, netns
):
    argv = _argv(tmp_path, grace=5.0, extra=[*PACED, "--checkpoint-every=20"])
    job = netns.start(argv)
    _wait(lambda: _step(tmp_path, 0) >= 60, [job], "step 60")
    os.kill(_pid(tmp_path, "syncer"), signal.SIGKILL)
    ((out, _),) = communicate_all([job], 120)
    assert job.returncode == 1, out[-4000:]
    errors = [x for x in out.splitlines() if x.startswith("error: ")]
    for m in range(M):
        (line,) = [
            x for x in errors if x.startswith(f"error: island {m}: lost the syncer")
        ]
        assert "its checkpoint of step" in line and line.endswith(
            "start the same command again to resume the job"
        ), line
    assert errors[-1] == "error: the elastic job ended: no island could finish."
    for trace in ("Traceback", "Check failure"):
        assert trace not in "\n".join(
            x for x in out.splitlines() if "(raylet)" not in x
        )
    netns.close()
    again = _Namespace()  # the same command, in a namespace of its own
    try:
        job = again.start(argv)
        ((out, _),) = communicate_all([job], 500)
    finally:
        again.close()
    assert job.returncode == 0, out[-4000:]
    start = _summary(tmp_path, "syncer.json")["start_step"]
    assert start >= 60  # resumed from the checkpoints, not from step 0
    summaries = [_summary(tmp_path, f"island-{m}.json") for m in range(M)]
    for s in summaries:  # at the job's start; one behind it healed from a peer
        assert s["first_step"] == start or (s["healed"] and s["first_step"] > start)
    _assert_equal_thetas(tmp_path, train.build(_config()).model)


@pytest.fixture(scope="module")
def scenarios():
    """What `tests/elastic_scenarios.py` saw: one Ray instance for all of them."""
    ns = _Namespace()
    try:
        p = ns.start(
            [sys.executable, os.path.join(ROOT, "tests", "elastic_scenarios.py")]
        )
        ((out, _),) = communicate_all([p], 180)
    finally:
        ns.close()
    assert p.returncode == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.multiprocess
@needs_netns
def test_a_heal_whose_peer_dies_before_it_serves_is_routed_to_another(scenarios):
    seen = scenarios["kill_healer"]
    assert seen["first"] == [["serve", "1:n"]]  # routed to peer 0, killed
    assert seen["served"] > 0 and seen["got"] == [5, 999]  # peer 2 served it


@pytest.mark.multiprocess
@needs_netns
@pytest.mark.parametrize("variant", ["owned", "sender"])
def test_a_sender_killed_right_after_the_decision_is_still_read(scenarios, variant):
    seen = scenarios[variant]
    assert seen["members"] == [[0, 1, 2]] * 3  # decided with island 0
    if variant == "owned":  # the job's mechanism: every member reads its bytes
        assert seen["rows"] == [1, 2, 3] and seen["sizes"] == 1 << 20
    else:  # without it, the round cannot be applied as decided
        assert "OwnerDiedError" in seen["error"]


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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--elastic", "--replicas=1"], "--replicas=1; allowed: M >= 2"),
        (
            ["train", "--elastic", "--preset=data_parallel"],
            "method.kind='data_parallel' on an island",
        ),
        (
            ["train", "--elastic", "--grace=10", "--elastic-timeout=5"],
            "timeout_s=5.0 <= grace_s=10.0",
        ),
        (["train", "--elastic", "--max-restarts=-1"], "max_restarts=-1; allowed"),
        (
            ["train", "--elastic", "--min-step-s=-0.5"],
            "min_step_s=-0.5; allowed: 0 <= S < inf seconds",
        ),
        (["train", "--elastic", "--process-id=0"], "--process-id with --elastic"),
        (["train", "--min-step-s=0.1"], "--min-step-s without --elastic"),
        (["train", "--address=h:1"], "--address without --elastic"),
    ],
)
def test_bad_flags_are_one_line(argv, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(argv)
    assert status == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_an_error_raised_in_one_islands_run_does_not_end_the_job(monkeypatch):
    # An island's run that raises an error of its own kind (not a death, not an
    # elastic error: say its checkpoint could not be read) is run again while it
    # has restarts left, then ends alone with one line; the others' summaries
    # stand. Before, Ray's wrapped error left the driver's loop and every island
    # ended with the job (a chaos soak's job ended so after a SIGKILL).
    import ray
    from ray import exceptions as rx

    from sdiloco.lab import ray_job

    calls: list[str] = []

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            calls.append(self.name)
            return ("syncer", self.name)

    class FakeSyncer:
        def __getattr__(self, name):
            return Method(name)

    def start(m):
        ref = (m, calls.count(f"start {m}"))
        calls.append(f"start {m}")
        return ref

    def get(ref, timeout=None):
        if ref[0] == "syncer":
            return {"decisions": []}
        m, _ = ref
        if m == 1:
            cause = ValueError("checkpoint 800 could not be read")
            raise rx.RayTaskError("Island.run", "Traceback ...", cause)
        return {"summary": {"island": m}}

    monkeypatch.setattr(ray, "wait", lambda refs, **kw: (refs[:1], refs[1:]))
    monkeypatch.setattr(ray, "get", get)
    result = ray_job._watch(start, 3, FakeSyncer(), 2, None)
    assert result.summaries == {0: {"island": 0}, 2: {"island": 2}}
    assert calls.count("start 1") == 3  # the first run and 2 restarts
    assert result.errors[1] == (
        "island 1 failed: ValueError: checkpoint 800 could not be read; ended 3 "
        "times, no restart left (max_restarts=2)"
    )


def test_the_job_keeps_rays_token_authentication_on(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    from sdiloco.lab import ray_job

    with pytest.raises(ValueError, match="RAY_AUTH_MODE='disabled'; allowed: 'token'"):
        ray_job.start_ray(elastic_lib.ElasticOptions(), _config(), "x")


@hypothesis.given(grace=st.floats(0.1, 300.0), heartbeat=st.floats(1, 3600))
def test_a_rounds_messages_stay_while_a_silent_island_still_counts_as_live(
    grace, heartbeat
):
    options = elastic_lib.ElasticOptions(
        grace_s=grace, timeout_s=grace + 1, heartbeat_s=heartbeat
    )
    assert options.keep_s >= heartbeat + grace
    assert options.keep_s >= max(60.0, 4 * grace)


def test_the_fingerprint_names_what_islands_must_agree_on():
    base = elastic_lib.fingerprint(_config())
    assert {"model", "seed", "steps", "method.sync_every"} <= set(base)
    assert not {"eval_every", "checkpoint_every", "log_every"} & set(base)
    other = elastic_lib.fingerprint(_config().replace(seed=3, checkpoint_every=7))
    assert {k for k in base if base[k] != other.get(k)} == {"seed"}


def test_the_step_file_is_replaced_whole(tmp_path):
    elastic_lib._write(tmp_path, "island-0.step", "5")
    with pytest.raises(TypeError):
        elastic_lib._write(tmp_path, "island-0.step", 6)  # pyright: ignore
    assert (tmp_path / "island-0.step").read_text() == "5"  # never empty
    elastic_lib._write(tmp_path, "island-0.step", "7")
    assert (tmp_path / "island-0.step").read_text() == "7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["island-0.step"]


def test_a_paced_island_takes_its_minimum_per_step_and_no_more(tmp_path):
    start = time.monotonic()
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
