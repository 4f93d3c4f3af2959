"""One training loop from one device to many processes: `train.run` and the CLI on a mesh.

The runs here are the documented entry points (`train.run(..., devices_per_replica=)`
and `python -m sdiloco train ... --coordinator ...`) on a small transformer, M = 2:

- 1 process x 4 devices (2 replicas x 2 data) and 2 processes x 2 devices agree with
  the vmapped one-device simulation within float32 rounding (see
  `sdiloco.distributed.mesh` for why a sharded step is not bitwise the simulation),
  and with each other bitwise (the same per-device program);
- the compiled step's collectives: the packed low-bit messages are the only bytes of
  fragment size across `"replica"`; the gradient all-reduce stays inside an island;
- every process SIGKILLed with a fragment in flight, then the same commands again: the
  run ends bitwise equal to the uninterrupted one;
- a checkpoint written by 2 processes x 2 devices restores on 1 process x 4 devices and
  on the one-device simulation, and a layout that cannot hold the run is refused
  before any compute;
- bad coordinates end with one clear line and a non-zero status within a bounded time.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import (
    communicate_all,
    cpu_env,
    finish_processes,
    free_port,
    session_folder,
    start_processes,
)

import sdiloco
from sdiloco.lab import cluster, config as config_lib, train
from sdiloco.lab.checkpoint import Checkpointer, CheckpointError


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = dict(rtol=2e-4, atol=2e-5)
STEPS = 24
FLAGS = [
    "--model=tiny-xxs",
    f"--steps={STEPS}",
    "--sync-every=4",
    "--batch-size=8",
    "--checkpoint-every=4",
    "--eval-windows=64",
    "--no-progress",
]
"""The CLI flags of the run: Streaming DiLoCo with overlapped FP4, M = 2, H = 4,
3 fragments sent at steps 4, 5, 7 (mod 4), τ = 1: each checkpoint (every 4 steps) is
taken with fragment 0 in flight. Scored on 64 held-out windows (every window, the
default, is most of a 24-step job's time after its compiles)."""


@pytest.fixture(autouse=True)
def standard_promotion():
    """Runs use optax's AdamW, whose `b1 ** count` strict promotion rejects."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _config(**changes):
    """The config the CLI builds from `FLAGS` (checked against its config.json)."""
    base = dict(
        model="tiny-xxs",
        steps=STEPS,
        method={"sync_every": 4},
        data={"global_batch_size": 8},
        checkpoint_every=4,
        eval_windows=64,
    )
    return config_lib.preset("streaming_overlap_fp4", **{**base, **changes})


def _final_state(out_dir, config=None):
    """The state of the newest checkpoint in `out_dir`, as NumPy arrays."""
    config = config or _config()
    template = train.build(config).init_state()
    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), config.to_json())
    try:
        state, _ = ckpt.restore(template)
    finally:
        ckpt.close()
    return jax.tree.map(np.asarray, sdiloco.global_params(state)), state


def _arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree) if hasattr(x, "shape")]


def _assert_equal(a, b):
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _assert_close(a, b):
    """Equal to `TOL`, except that a few isolated elements (<= 0.1 %) may differ by up
    to 5e-3: the processes sum the outer gradients in another order than the
    simulation, and a value on an E3M0 rounding boundary then rounds to the
    neighbouring level (seen on one CPU: 1 of 6,144 elements, 1.5e-4 apart; 1.1e-3
    apart once tiny-xxs's tuned warmup changed the run). A wrong exchange or schedule
    moves far more elements than that."""
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=5e-3)
        far = ~np.isclose(x, y, **TOL)
        assert far.sum() <= max(1, x.size // 1000), (
            f"{far.sum()} of {x.size} elements beyond {TOL}"
        )


def _env(devices):
    return cpu_env(devices, ROOT)


def _start_job(out_dir, port, *, num_processes=2, devices=2, extra=()):
    """The same CLI command once per process, as a user would start them."""
    return start_processes(
        lambda i: [
            "-m",
            "sdiloco",
            "train",
            *FLAGS,
            f"--out={out_dir}",
            f"--coordinator=127.0.0.1:{port}",
            f"--num-processes={num_processes}",
            f"--process-id={i}",
            "--init-timeout=60",
            *extra,
        ],
        num_processes,
        _env(devices),
        ROOT,
    )


def _steps(out_dir):
    ckpt = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(ckpt):
        return []
    return sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())


# -------------------------------------------------------------- one process, 4 devices


@pytest.fixture(scope="session")
def simulated():
    """The one-device simulation of the run (the reference)."""
    with jax.numpy_dtype_promotion("standard"):
        history = train.run(_config(), progress=False)
    return jax.tree.map(np.asarray, history.state.global_params), history


@pytest.mark.integration
def test_one_process_four_devices_equals_simulation(simulated):
    reference, ref_history = simulated
    for fsdp in (False, True):
        history = train.run(_config(), devices_per_replica=2, fsdp=fsdp, progress=False)
        state = history.state
        assert dict(state.global_params.blocks.attn.w_q.sharding.mesh.shape) == {
            "replica": 2,
            "data": 2,
        }
        _assert_close(history.state.global_params, reference)
        assert history.summary["bits_total"] == ref_history.summary["bits_total"]
        got, want = (
            history.evals[-1]["eval/global"],
            ref_history.evals[-1]["eval/global"],
        )
        assert abs(got - want) < 1e-4
    # With FSDP, each replica's parameters are split over its island's two devices.
    spec = state.replica_params.blocks.mlp.w_up.sharding.spec
    assert spec[0] == "replica" and "data" in spec


@pytest.mark.hlo
@pytest.mark.integration
def test_compiled_collectives_per_axis():
    # The 2 x 2 mesh's compiled step: which collectives run over which axis.
    place = cluster.Placement.of(2, devices_per_replica=2)
    r = train.build(_config(), place)
    state = place.state(r.init_state())
    batch = place.batch(r.iterators())
    compiled = place.step(r.algorithm).lower(state, batch).compile()
    text = compiled.as_text()
    found = sdiloco.distributed.collectives(text, place.mesh)
    per_axis = sdiloco.distributed.by_axis(text, place.mesh)
    num_params = r.model_config.num_params()
    bits = r.algorithm.bits_per_fragment(r.model)
    # Across islands ("replica"): the packed messages, half of each fragment's
    # message from each of its island's two devices, and the metrics (the replicas'
    # mean loss and per-replica values: a few scalars).
    wide = [c for c in found if c.axes == ("replica",)]
    packed = [c for c in wide if c.dtype == "u8"]
    assert {c.kind for c in packed} == {"all-gather"}
    served = set()
    for c in packed:  # one compiled branch may serve fragments of one size
        fragments = [
            int(p)
            for p in c.op_name.split("sdiloco_fragment_")[1].split("/")[0].split("_")
        ]
        for p in fragments:
            assert c.bytes_per_device == math.ceil(math.ceil(bits[p] / 8) / 2)
        served.update(fragments)
    assert served == set(range(len(bits)))
    assert sum(c.bytes_per_device for c in wide if c.dtype != "u8") <= 16
    assert sdiloco.distributed.wire_bytes(text, 2, place.mesh) == {
        p: math.ceil(math.ceil(b / 8) / 2) * 2 for p, b in enumerate(bits)
    }
    # Inside an island ("data"): the gradient all-reduce of a whole replica's
    # float32 gradient, and the re-assembly of the messages.
    assert per_axis[("data",)]["all-reduce"] >= 4 * num_params
    assert set(per_axis) <= {("replica",), ("data",)}


@pytest.mark.integration
def test_layout_that_cannot_hold_the_run_is_refused(tmp_path):
    # Before any compute: one line naming the value and what is allowed.
    with pytest.raises(ValueError, match="data .devices per replica.=3"):
        train.run(_config(), devices_per_replica=3, progress=False)
    three = sdiloco.distributed.replica_mesh(3, jax.devices()[:3])
    with pytest.raises(ValueError, match="num_replicas .M.=2 is not a multiple"):
        train.run(_config(), mesh=three, progress=False)
    odd = _config(data={"global_batch_size": 2})
    with pytest.raises(ValueError, match="global_batch_size=2.*multiple of 4"):
        train.run(odd, devices_per_replica=2, progress=False)


# --------------------------------------------------------- two processes, 2 devices each


@pytest.fixture(scope="session")
def two_processes(tmp_path_factory):
    """The uninterrupted 2 processes x 2 devices run, through the CLI.

    Run once per test session: under pytest-xdist the first worker that needs it runs
    the job into a directory the workers share, and the others wait for it.
    """
    base = session_folder(tmp_path_factory)  # shared by the session's workers
    out = base / "two_processes"
    done = base / "two_processes.done"
    try:
        os.close(os.open(base / "two_processes.lock", os.O_CREAT | os.O_EXCL))
    except FileExistsError:  # another worker runs it
        deadline = time.monotonic() + 600
        while not done.exists():
            assert time.monotonic() < deadline, "the two-process job did not finish"
            time.sleep(0.5)
    else:
        try:
            outputs = finish_processes(_start_job(out, free_port()), timeout=400)
            printed = ["summary" in o for o in outputs]
            (base / "two_processes.printed").write_text(json.dumps(printed))
        finally:
            done.touch()
    printed = json.loads((base / "two_processes.printed").read_text())
    with open(out / "config.json") as f:
        assert f.read() == _config().to_json()  # the CLI built the same config
    with jax.numpy_dtype_promotion("standard"):
        params, state = _final_state(out)
    return dict(out=out, params=params, state=state, printed=printed)


@pytest.mark.multiprocess
def test_two_processes_equal_one_process_and_simulation(two_processes, simulated):
    params, state = two_processes["params"], two_processes["state"]
    assert int(state.step) == STEPS
    _assert_close(params, simulated[0])
    one = train.run(_config(), devices_per_replica=2, progress=False)
    # The same per-device program on the same 2 x 2 mesh: bitwise.
    _assert_equal(params, one.state.global_params)
    # Process 0 alone printed the summary (one JSON document).
    assert two_processes["printed"] == [True, False]


@pytest.mark.multiprocess
def test_sigkill_every_process_then_resume_is_bitwise(two_processes, tmp_path):
    out, port = tmp_path / "run", free_port()
    procs = _start_job(out, port)
    deadline = time.monotonic() + 300
    try:
        while not [s for s in _steps(out) if s >= 8] and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a process ended early"
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGKILL)
    finally:
        for p in procs:
            p.kill()
            p.communicate()  # reaps it and closes its pipe
    killed_at = _steps(out)
    assert killed_at and max(killed_at) < STEPS, killed_at  # killed mid-run
    assert not (out / "history.json").exists()
    # The checkpoint it will resume from has a fragment in flight (τ = 1).
    _, state = _final_state(out)
    assert int(state.step) in np.asarray(state.sent_at).tolist()
    shutil.copytree(out, tmp_path / "copy")  # for the layout test below
    finish_processes(_start_job(out, port), timeout=400)  # the same commands again
    params, final = _final_state(out)
    assert int(final.step) == STEPS
    _assert_equal(params, two_processes["params"])
    _assert_equal(final, two_processes["state"])
    # Written by 2 processes x 2 devices, restored on 1 process x 4 devices: the
    # same numbers (bitwise, the same per-device program).
    history = train.run(
        _config(), tmp_path / "copy", devices_per_replica=2, progress=False
    )
    _assert_equal(history.state.global_params, two_processes["params"])


@pytest.mark.multiprocess
def test_checkpoint_of_a_job_restores_on_the_simulation(two_processes, tmp_path):
    # The job's step-20 checkpoint (fragment 0 in flight), continued on one device.
    copy = tmp_path / "run"
    shutil.copytree(two_processes["out"], copy)
    shutil.rmtree(copy / "checkpoints" / str(STEPS))
    assert _steps(copy) == [STEPS - 4]
    history = train.run(_config(), copy, progress=False)
    assert int(history.state.step) == STEPS
    _assert_close(history.state.global_params, two_processes["params"])
    # Another M cannot hold the run: refused before any compute, naming the field.
    other = _config(method={"sync_every": 4, "num_replicas": 4})
    with pytest.raises(CheckpointError, match="num_replicas: 2 vs 4"):
        train.run(other, copy, progress=False)


# ------------------------------------------------------------- the courier across processes


def _courier_template(config):
    """A state shaped like a courier run's (the packed outbox and inbox)."""
    r = train.build(config)
    r.algorithm = config.method.build(
        sdiloco.lab.model.loss_with_aux,
        config.inner.build(config.steps),
        r.model,
        exchange=sdiloco.distributed.posted_exchange(),
    )
    return r.init_state()


def _courier_state(out_dir):
    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), _config().to_json())
    try:
        state, _ = ckpt.restore(_courier_template(_config()))
    finally:
        ckpt.close()
    return state


@pytest.mark.multiprocess
def test_courier_job_agrees_and_resumes_with_a_fragment_in_flight(simulated, tmp_path):
    """2 processes x 2 devices with `--courier`: each process computes on one device
    and moves the messages on the other. The run agrees with the simulation; resumed
    from its step-20 checkpoint (fragment 0 in flight: the courier posts it again),
    it ends bitwise equal."""
    out = tmp_path / "run"
    finish_processes(_start_job(out, free_port(), extra=["--courier"]), timeout=400)
    state = _courier_state(out)  # restores only a state with the packed buffers
    assert int(state.step) == STEPS
    _assert_close(state.global_params, simulated[0])
    history = json.loads((out / "history.json").read_text())
    assert all(np.isfinite(r["loss/train"]) for r in history["rows"])
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "checkpoints" / str(STEPS))
    (copy / "history.json").unlink()
    assert _steps(copy) == [STEPS - 4]
    resumed_from = _courier_state(copy)
    assert int(resumed_from.step) in np.asarray(resumed_from.sent_at).tolist()
    finish_processes(_start_job(copy, free_port(), extra=["--courier"]), timeout=400)
    _assert_equal(_courier_state(copy), state)


# --------------------------------------------------------------------- bad coordinates


def _cli(*flags, devices=1, timeout=90):
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sdiloco", "train", *FLAGS, *flags],
        env=_env(devices),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = done.stderr.strip().splitlines()
    return done.returncode, lines, time.monotonic() - start


@pytest.mark.multiprocess
def test_bad_coordinates_end_with_a_clear_error():
    port = free_port()
    job = [f"--coordinator=127.0.0.1:{port}", "--num-processes=2", "--init-timeout=3"]
    # Nobody listens, or process 0 of a job of two is alone: JAX's own rendezvous
    # gives up after the timeout, with the runtime's fatal message (we run no
    # server of our own in front of it: docs/decisions.md).
    for pid in (1, 0):
        rc, lines, seconds = _cli(*job, f"--process-id={pid}")
        assert rc != 0 and seconds < 60
        assert any("DEADLINE_EXCEEDED" in line for line in lines), lines[-5:]
    # Coordinates that cannot describe a job: refused at once, exit status 2.
    for flags, message in [
        (job + ["--process-id=2"], "process_id=2; allowed: an int in [0, 2)"),
        (["--coordinator=nowhere", "--num-processes=2", "--process-id=0"], "HOST:PORT"),
        ([f"--coordinator=127.0.0.1:{port}", "--process-id=0"], "num_processes"),
    ]:
        rc, lines, _ = _cli(*flags)
        assert rc == 2 and len(lines) == 1 and message in lines[0], lines
    # A mesh that does not divide the devices: one line, before any compute.
    rc, lines, _ = _cli("--devices-per-replica=3", devices=4)
    assert rc == 2 and len(lines) == 1 and "devices per replica" in lines[0], lines


@pytest.mark.multiprocess
def test_processes_that_disagree_on_the_job_size_are_told(tmp_path):
    port = free_port()
    coordinator = f"--coordinator=127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sdiloco",
                "train",
                *FLAGS,
                coordinator,
                f"--num-processes={n}",
                f"--process-id={i}",
                "--init-timeout=20",
            ],
            env=_env(1),
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, n in ((0, 2), (1, 3))
    ]
    try:
        errors = [err for _, err in communicate_all(procs, 90)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [1, 1]
    for err in errors:
        assert "num_processes=3, process 0 with 2" in err.strip().splitlines()[-1]


def test_connect_checks_its_arguments_before_waiting():
    cluster.connect()  # a single-process run: nothing to join
    assert jax.process_count() == 1
    for kwargs, message in [
        (dict(coordinator="h:1", auto=True), "auto=True detects the coordinates"),
        (dict(coordinator="h:1", num_processes=2), r"missing: \['process_id'\]"),
        (dict(coordinator="h:0", num_processes=2, process_id=0), "HOST:PORT"),
        (dict(coordinator="h:1", num_processes=0, process_id=0), "num_processes=0"),
        (dict(coordinator="h:1", num_processes=2, process_id=-1), "process_id=-1"),
        (dict(timeout_s=0), "timeout_s=0"),
    ]:
        with pytest.raises(ValueError, match=message):
            cluster.connect(**kwargs)
