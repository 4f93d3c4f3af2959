"""`python -m sdiloco train`: a bad flag is one line on stderr and exit 2, no traceback."""

import json
import os
import pathlib
import re
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
    ],
    ids=["inner", "outer", "warmup", "compressor", "merge", "both", "diloco-merge"],
)
def test_bad_optimizer_compressor_or_merge_is_one_line_and_exit_2(flags, field, capsys):
    from sdiloco.lab.cli import main

    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and err.count("\n") == 1, err


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
    ],
    ids=["muloco", "flags", "quantizer-replaces", "warmup"],
)
def test_optimizer_compressor_and_merge_flags_reach_the_config(
    flags, expect, monkeypatch, tmp_path
):
    from sdiloco.lab import train
    from sdiloco.lab.cli import main

    seen = {}

    def fake_run(cfg, out, **kwargs):
        seen["cfg"] = cfg
        raise train.Interrupted(1, signal.SIGINT, out)

    monkeypatch.setattr(train, "run", fake_run)
    out = str(tmp_path / "out")
    assert main(["train", "--model", "tiny-xxxs", "--out", out, *flags]) == 130
    cfg = seen["cfg"]
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
