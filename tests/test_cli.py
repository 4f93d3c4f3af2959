"""`python -m sdiloco train`: a bad flag is one line on stderr and exit 2, no traceback."""

import os
import pathlib
import subprocess
import sys

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
