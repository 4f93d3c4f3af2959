"""`python -m sdiloco train`: a bad flag is one line on stderr and exit 2, no traceback."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--alpha", "2"], "alpha"),
        (["--replicas", "0"], "num_replicas"),
        (["--quantizer", "nope"], "quantizer"),
        (["--preset", "nope"], "preset"),
        (["--steps", "many"], "--steps"),
    ],
    ids=["alpha", "replicas", "quantizer", "preset", "steps-type"],
)
@pytest.mark.integration
def test_bad_flag_is_one_line_and_exit_2(flags, field, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "sdiloco", "train", "--out", str(out), *flags],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and field in lines[0], lines[0]
    assert not out.exists()  # refused before any compute or output
    assert proc.stdout == ""


def test_main_returns_2_in_process(capsys):
    from sdiloco.lab.cli import main

    assert main(["train", "--alpha", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "alpha" in err and err.count("\n") == 1


def _cli(args, cwd=ROOT, timeout=240, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "sdiloco", *args],
        cwd=cwd,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


@pytest.mark.integration
def test_token_ids_beyond_the_vocabulary_are_one_line_and_exit_2(tmp_path):
    # An id past the embedding reads NaN silently; the file is refused before any
    # compute, naming the file, the largest id, the vocabulary and the way out.
    import numpy as np

    npy = tmp_path / "ids.npy"
    np.save(npy, np.arange(1000, dtype=np.uint16).repeat(20))
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be " * 2000)  # read as uint16 unless told
    for path, top in ((npy, 999), (text, None)):
        out = tmp_path / "out"
        proc = _cli(
            ["train", "--model", "tiny-xxxs", "--tokens", str(path), "--out", str(out)]
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert str(path) in lines[0] and "vocabulary is 256" in lines[0], lines[0]
        assert "--vocab" in lines[0] and (top is None or f"up to {top}" in lines[0])
        assert not out.exists()
    assert "--token-dtype" in lines[0]  # the raw file's message names the dtype flag


@pytest.mark.integration
def test_the_default_run_resumes_after_ctrl_c(tmp_path):
    # README: `python -m sdiloco train --out DIR` (run it again and it resumes).
    out = tmp_path / "run"
    args = ["train", "--model", "tiny-xxxs", "--steps", "1200", "--sync-every", "10"]
    args += ["--eval-windows", "4", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdiloco", *args],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        # The default cadence with --out: a checkpoint at every evaluation (100).
        while not (out / "checkpoints" / "100").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    (line,) = stderr.splitlines()  # one line, no traceback
    step = int(re.search(r"stopped at step (\d+), checkpoint saved", line)[1])
    assert 100 <= step < 1200 and stdout == ""
    assert line.endswith("resume with: python -m sdiloco " + " ".join(args))
    assert (out / "checkpoints" / str(step)).is_dir()
    again = _cli(args)
    assert again.returncode == 0, again.stderr
    assert f"resuming from step {step}" in again.stderr
    assert json.loads(again.stdout)["summary"]["steps"] == 1200
    assert "final held-out loss" in again.stderr and "history.csv" in again.stderr


def test_the_readme_default_run_checkpoints_and_resumes(monkeypatch, tmp_path, capsys):
    # README: `python -m sdiloco train --out runs/default` (run it again and it
    # resumes): the plain command checkpoints periodically and resumes.
    from sdiloco.lab import train
    from sdiloco.lab.cli import main

    assert (
        "`python -m sdiloco train --out runs/default` (run it again and\nit resumes)"
        in (ROOT / "README.md").read_text()
    )
    seen = {}

    def fake_run(cfg, out, **kwargs):
        seen.update(cfg=cfg, out=out, **kwargs)
        raise train.Interrupted(7, signal.SIGINT, out)

    monkeypatch.setattr(train, "run", fake_run)
    out = str(tmp_path / "default")
    assert main(["train", "--out", out]) == 130
    cfg = seen["cfg"]
    assert cfg.checkpoint_every == cfg.eval_every == 100 and seen["resume"]
    assert seen["nonfinite_loss"] == "stop"
    err = capsys.readouterr().err
    assert err == (
        f"stopped at step 7, checkpoint saved; resume with: python -m sdiloco train "
        f"--out {out}\n"
    )


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--inner", "sgd"], "InnerConfig.kind='sgd'"),
        (["--outer", "lion"], "OuterConfig.kind='lion'"),
        (["--outer-momentum-warmup", "-2"], "OuterConfig.momentum_warmup=-2"),
        (["--compressor", "int3"], "StreamingConfig.compressor spec='int3'"),
        (["--merge", "lazy"], "StreamingConfig.merge='lazy'"),
        (
            ["--quantizer", "e2m1", "--compressor", "int2,ef"],
            "compressor='int2,ef' with quantizer='e2m1'",
        ),
        (["--preset", "diloco", "--merge", "eager"], "no field 'merge'"),
        (
            ["--preset", "decoupled", "--replicas", "2", "--quorum", "3"],
            "DecoupledAggregator.k=3 (the minimum quorum K) with num_replicas=2; "
            "allowed: an int in [1, 2], or None for ⌈M/2⌉ = 1.",
        ),
        (["--quorum", "2"], "quorum=2 with preset 'streaming_overlap_fp4'"),
    ],
    ids=[
        "inner",
        "outer",
        "warmup",
        "compressor",
        "merge",
        "both",
        "diloco-merge",
        "quorum-above-M",
        "quorum-elsewhere",
    ],
)
def test_bad_optimizer_compressor_or_merge_is_one_line_and_exit_2(flags, field, capsys):
    from sdiloco.lab.cli import main

    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and err.count("\n") == 1, err


def _config_of(flags, monkeypatch, tmp_path):
    """The config `train FLAGS --out DIR` would run (the run itself stubbed out)."""
    from sdiloco.lab import train
    from sdiloco.lab.cli import main

    seen = {}

    def fake_run(cfg, out, **kwargs):
        seen["cfg"] = cfg
        raise train.Interrupted(1, signal.SIGINT, out)

    monkeypatch.setattr(train, "run", fake_run)
    assert main(["train", *flags, "--out", str(tmp_path / "out")]) == 130
    return seen["cfg"]


@pytest.mark.parametrize(
    "flags, expect",
    [
        (
            ["--preset", "muloco"],
            {"inner.kind": "muon", "compressor": "int2:row,ef", "quantizer": None},
        ),
        (
            [
                "--inner",
                "muon",
                "--outer",
                "adam",
                "--outer-lr",
                "0.01",
                "--compressor",
                "topk:0.05/32,int2,ef:0.8",
                "--merge",
                "eager",
            ],
            {
                "inner.kind": "muon",
                "outer.kind": "adam",
                "outer.lr": 0.01,
                "compressor": "topk:0.05/32,int2,ef:0.8",
                "quantizer": None,
                "merge": "eager",
            },
        ),
        (
            ["--preset", "muloco", "--quantizer", "e2m1"],
            {"compressor": None, "quantizer": "e2m1"},
        ),
        (
            ["--outer-momentum", "0.8", "--outer-momentum-warmup", "5"],
            {"outer.momentum": 0.8, "outer.momentum_warmup": 5},
        ),
        (
            ["--preset", "decoupled", "--replicas", "4", "--batch-size", "8"]
            + ["--quorum", "3", "--alpha", "0"],
            {"aggregator.k": 3, "alpha": 0.0, "num_replicas": 4, "quantizer": "e3m0"},
        ),
    ],
    ids=["muloco", "flags", "quantizer-replaces", "warmup", "decoupled"],
)
def test_optimizer_compressor_and_merge_flags_reach_the_config(
    flags, expect, monkeypatch, tmp_path
):
    cfg = _config_of(["--model", "tiny-xxxs", *flags], monkeypatch, tmp_path)
    for path, value in expect.items():
        obj = cfg if path.startswith("inner") else cfg.method
        for part in path.split("."):
            obj = getattr(obj, part)
        assert obj == value, (path, obj)


@pytest.mark.integration
@pytest.mark.parametrize("preset", ["muloco", "sparseloco", "eager"])
def test_the_new_presets_train_from_the_cli(preset, tmp_path):
    proc = _cli(
        ["train", "--preset", preset, "--model", "tiny-xxxs", "--steps", "8"]
        + ["--sync-every", "4", "--eval-windows", "64", "--no-progress"]
        + ["--out", str(tmp_path / "out")],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    loss = json.loads(proc.stdout)["evals"][-1]["eval/global"]
    assert 0 < loss < 6  # below ~ln(256) + noise: trained, finite


def test_a_bad_quorum_is_refused_before_any_compute(tmp_path, capsys):
    from sdiloco.lab.cli import main

    out = tmp_path / "out"
    flags = ["--preset", "decoupled", "--replicas", "4", "--quorum", "5"]
    assert main(["train", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DecoupledAggregator.k=5" in err, err
    assert "allowed: an int in [1, 4]" in err
    assert not out.exists()


@pytest.mark.integration
def test_the_decoupled_preset_trains_from_the_cli(tmp_path):
    # M = 4 with a quorum of 3 (every round merges: nobody fails) and adoption by
    # overwrite (α = 0); the α-blend default trains in test_config.
    proc = _cli(
        ["train", "--preset", "decoupled", "--model", "tiny-xxs", "--steps", "8"]
        + ["--replicas", "4", "--quorum", "3", "--alpha", "0", "--sync-every", "4"]
        + ["--eval-windows", "8", "--no-progress", "--out", str(tmp_path / "out")],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    loss = json.loads(proc.stdout)["evals"][-1]["eval/global"]
    assert 0 < loss < 6  # below ~ln(256) + noise: trained, finite
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["method"]["aggregator"]["args"]["k"] == 3


# A user's second hour: each defect as the user sees it (exit code, stderr lines).

_SHORT = ["train", "--model", "tiny-xxxs", "--steps", "8", "--sync-every", "2"]
_SHORT += ["--checkpoint-every", "4", "--eval-windows", "2", "--no-progress"]


def _damage_arrays(step_dir):
    """Truncate the array files of a checkpoint, as a full disk would leave them."""
    for f in (step_dir / "state").glob("ocdbt.process_*/d/*"):
        f.write_bytes(b"")


@pytest.mark.integration
def test_checkpoints_finished_damaged_or_foreign_are_one_line_each(tmp_path):
    # Defects 1, 4 and 8: a finished run again; a truncated newest checkpoint; both
    # truncated; another config. Whether orbax echoes the failed reads of a
    # truncated checkpoint depends on timing (0 to 66 echoes, up to 4,276 lines, in
    # runs of this command without the filter); test_checkpoint checks the filter.
    out = tmp_path / "run"
    args = [*_SHORT, "--out", str(out)]
    first = _cli(args)
    assert first.returncode == 0, first.stderr
    wall = json.loads((out / "history.json").read_text())["summary"]["wall_s"]
    again = _cli(args)  # already done: says so, trains nothing, keeps the wall time
    assert again.returncode == 0, again.stderr
    lines = again.stderr.splitlines()
    assert lines[0].startswith("resuming from step 8") and len(lines) == 6, lines
    assert lines[1].startswith("already done: 8 steps"), lines
    assert "nothing trained" in lines[1]
    summary = json.loads((out / "history.json").read_text())["summary"]
    assert summary["start_step"] == 8 and wall - 0.5 < summary["wall_s"] < wall + 0.5
    assert summary["wall_s"] > 1.0  # every segment's training time, not 0.0003 s

    _damage_arrays(out / "checkpoints" / "8")
    fallback = _cli(args)
    assert fallback.returncode == 0, fallback.stderr
    lines = fallback.stderr.splitlines()
    assert "Exception ignored" not in fallback.stderr, fallback.stderr[:2000]
    assert len(lines) == 6, fallback.stderr[:2000]  # the warning, then the report
    assert lines[0].startswith("warning: checkpoint step 8") and "step 4" in lines[0]
    assert "See full TensorStore" not in lines[0] and len(lines[0]) < 600
    assert lines[1].startswith("done: 8 steps") and "resumed at step 4" in lines[1]

    other = _cli([*args, "--seed", "3"])
    assert other.returncode == 2 and len(other.stderr.splitlines()) == 1, other.stderr
    for said in ("another config", "seed", "--no-resume", "another --out"):
        assert said in other.stderr, other.stderr

    for step in ("4", "8"):
        _damage_arrays(out / "checkpoints" / step)
    lost = _cli(args)
    assert lost.returncode == 2, lost.stderr
    lines = lost.stderr.splitlines()
    assert len(lines) == 1, lost.stderr[:3000]
    (line,) = lines
    assert line.startswith("error: no intact checkpoint") and "--no-resume" in line


def test_an_out_that_cannot_hold_a_run_is_one_line_and_exit_2(tmp_path, capsys):
    # Defect 2: a file, or a path through a file, before any compute or output.
    from sdiloco.lab.cli import main

    file = tmp_path / "f.txt"
    file.write_text("x")
    for out, why in ((file, "is a file"), (file / "run", "lies under the file")):
        assert main([*_SHORT, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: out_dir="), err
        assert str(out) in err and why in err and "--out" in err
    assert file.read_text() == "x"


@pytest.mark.integration
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a read-only mount in a private mount namespace needs root and unshare",
)
def test_an_out_on_a_read_only_file_system_is_one_line_and_exit_2(tmp_path):
    # Defect 2: a read-only tmpfs, mounted in a mount namespace of this command's
    # own (gone with it: the host's mounts are not touched).
    ro = tmp_path / "ro"
    ro.mkdir()
    command = (
        f"mount -t tmpfs -o ro tmpfs {ro} && exec {sys.executable} -m sdiloco "
        f"{' '.join(_SHORT)} --out {ro / 'run'}"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", command],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "mount:" in proc.stderr:  # a container that forbids mounts
        pytest.skip(f"cannot mount here: {proc.stderr.strip()}")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "Read-only file system" in line and "--out" in line, line


def test_the_runs_name_is_its_preset_and_its_title_its_knobs(monkeypatch, tmp_path):
    # Defect 3: --sync-every reaches the title (bar, loss.png); the name stays the
    # preset's ("h100" read like a GPU and went stale when H changed).
    from sdiloco.lab import config as config_lib

    flags = ["--preset", "muloco", "--sync-every", "10", "--model", "tiny-xxs"]
    cfg = _config_of(flags, monkeypatch, tmp_path)
    assert cfg.name == "muloco" and cfg.method.sync_every == 10
    assert cfg.title() == "muloco tiny-xxs M=2 H=10 tau=1"
    assert config_lib.preset("muloco", sync_every=30).title().endswith("H=30 tau=1")
    budget = config_lib.Regime(20.0, 40).apply(config_lib.preset("diloco"))
    assert budget.title().endswith(f"H={budget.method.sync_every}")
    assert config_lib.preset("data_parallel").title() == "data_parallel tiny-s M=2"


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--tokens-per-param", "20", "--rounds", "0"], "--rounds=0"),
        (["--tokens-per-param", "20", "--rounds", "-3"], "--rounds=-3"),
    ],
)
def test_rounds_zero_is_named_as_given(flags, said, capsys):
    # Defect 6: 0 was read as "not given" and reported as Regime.rounds=50.
    from sdiloco.lab.cli import main

    assert main(["train", "--model", "tiny-xxxs", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and "50" in err, err


def test_token_files_that_cannot_train_are_one_line_naming_the_file(tmp_path, capsys):
    # Defect 7: a short file (the held-out tenth was reported, not the file), a
    # float file (no name), too few windows for the batch (no way out).
    import numpy as np

    from sdiloco.lab.cli import main

    short, floats, few = (tmp_path / n for n in ("short.npy", "f.npy", "few.npy"))
    np.save(short, np.arange(50, dtype=np.uint16))
    np.save(floats, np.zeros(5000, np.float32))
    np.save(few, (np.arange(700) % 200).astype(np.uint16))  # 9 training windows
    cases = [
        (short, [], ["50 tokens", "a file of at least", "--batch-size"]),
        (floats, [], ["holds float32", "uint16"]),
        (
            few,
            ["--batch-size", "16"],
            ["9 windows", "16 training windows", "--batch-size"],
        ),
    ]
    for path, flags, said in cases:
        args = ["train", "--model", "tiny-xxxs", "--tokens", str(path), *flags]
        assert main([*args, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err  # no warning
        assert str(path) in err and all(s in err for s in said), err
    assert not (tmp_path / "out").exists()


def test_help_groups_the_island_flags_and_names_every_method(capsys):
    # Defect 12.
    from sdiloco.lab.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    elastic = text[text.index("the elastic job (Ray)") :]
    assert "--address ADDRESS" in elastic and "--min-step-s" in elastic
    preset = " ".join(text[text.rindex("--preset PRESET") :].split()[:40])
    assert "the paper's" in preset
    assert "muloco, sparseloco, eager, decoupled" in preset
    assert "--quorum K" in text
