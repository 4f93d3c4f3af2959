"""`python -m sdiloco.paper` works on a checkout and never on the installed package."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest


pytest.importorskip("matplotlib")

from sdiloco.paper import figures, plotting, provenance  # noqa: E402


ROOT = pathlib.Path(__file__).resolve().parents[1]


def _files(directory: pathlib.Path) -> set[pathlib.Path]:
    return {p for p in directory.rglob("*")}


def _python(*argv: str, cwd: pathlib.Path, **env: str):
    """`python *argv` in `cwd`, with no `SDILOCO_*` setting of ours and `env` added;
    output captured."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SDILOCO_")}
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env={**clean, "MPLBACKEND": "Agg", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_no_notebooks_outside_a_checkout(tmp_path, monkeypatch, capsys):
    # An installed package (no notebooks beside it), run from outside a checkout.
    monkeypatch.delenv("SDILOCO_REPO", raising=False)
    monkeypatch.setattr(plotting, "_SOURCE_ROOT", tmp_path / "site-packages")
    monkeypatch.chdir(tmp_path)
    assert figures.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no notebooks")
    assert str(tmp_path / "notebooks") in err and "--notebooks" in err
    assert "SDILOCO_REPO" in err
    assert not list(tmp_path.iterdir())  # nothing written
    # Pointed at a checkout, from anywhere, it finds the notebooks again.
    assert figures.main(["--list", "--notebooks", str(ROOT / "notebooks")]) == 0
    assert "fig02_fragment_patterns" in capsys.readouterr().out
    monkeypatch.setenv("SDILOCO_REPO", str(ROOT))
    assert figures.notebooks_dir() == ROOT / "notebooks"


def test_runtimes_change_only_when_what_they_describe_changes(tmp_path, monkeypatch):
    """A re-render from the same records leaves the committed `runtimes.json` as it
    is (its times go to the checkout's `runs/`); one that reads other records
    (trained elsewhere) or trained rewrites the entry, so that the entry and
    the record index agree."""
    monkeypatch.setattr(figures, "repo_root", lambda: tmp_path / "checkout")
    out = tmp_path / "figures"
    out.mkdir()

    def render(keys, trained=0, train_s=10.0):
        runs = {"runs": len(keys), "trained": trained, "train_s": train_s}
        runs |= {"stale": 0, "keys": keys, "trained_now_s": 0.0}
        figures._record(out, "nb", 3.0, runs)
        return json.loads((out / "runtimes.json").read_text())["nb"]

    assert render(["a", "b"])["runs"] == 2  # not listed yet: written
    first = (out / "runtimes.json").read_text()
    render(["a", "b"])  # the same records: the committed file is left as it is
    assert (out / "runtimes.json").read_text() == first
    assert (tmp_path / "checkout" / "runs" / "runtimes.json").exists()
    assert render(["a", "b", "c"])["runs"] == 3  # more records: rewritten
    index = json.loads((out / "records.json").read_text())
    assert index["nb"] == ["a", "b", "c"]
    # other records, as many: rewritten (the entry and the record index agree)
    assert render(["a", "b", "d"], train_s=20.0)["train_s"] == 20.0
    entry = render(["a", "b", "d"], trained=1)  # trained: rewritten
    assert entry["trained"] == 1
    now = (out / "runtimes.json").read_text()
    render(["a", "b", "d"])  # a re-render after training: left as it is
    assert (out / "runtimes.json").read_text() == now
    # the same records, re-stamped elsewhere (other times): rewritten
    assert render(["a", "b", "d"], train_s=30.0)["train_s"] == 30.0
    now = (out / "runtimes.json").read_text()
    render(["a", "b", "d"], train_s=30.0)  # and then left as it is
    assert (out / "runtimes.json").read_text() == now


@pytest.mark.integration
def test_wheel_install_finds_no_notebooks_and_writes_nothing(tmp_path):
    # The package copied alone onto the path, as a wheel installs it.
    site = tmp_path / "site-packages"
    shutil.copytree(
        ROOT / "sdiloco", site / "sdiloco", ignore=shutil.ignore_patterns("__pycache__")
    )
    work = tmp_path / "work"
    work.mkdir()
    before = _files(site)
    env = dict(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1")
    proc = _python("-m", "sdiloco.paper", "--fast", cwd=work, **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "no notebooks" in proc.stderr and str(work / "notebooks") in proc.stderr
    assert "0/0" not in proc.stdout
    assert _files(site) == before and not list(work.iterdir())
    # The package imported is the copy, and its artifact/cache directories are not
    # in it.
    code = (
        "import sdiloco, pathlib; from sdiloco.paper import plotting; "
        "print(pathlib.Path(sdiloco.__file__).parent); print(plotting.REPO_ROOT)"
    )
    proc = _python("-c", code, cwd=work, **env)
    assert proc.returncode == 0, proc.stderr
    package, root = proc.stdout.split()
    assert pathlib.Path(package) == site / "sdiloco"
    assert pathlib.Path(root) == work
    assert _files(site) == before


@pytest.mark.integration
@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failing_notebook_is_one_line_and_exit_1(tmp_path, jobs):
    """A cell that raises ends its notebook's line with the error, not nbclient's
    traceback; the whole traceback is kept in the checkout's `runs/failed/`; with
    `--jobs 2` the other notebook still runs and prints its own line (and sees the
    folder of the command's shared FAST runs, removed when the command ends)."""
    checkout = tmp_path / "checkout"
    (checkout / "notebooks").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    cell = "# %%\n"
    (checkout / "notebooks" / "bad_one.py").write_text(
        cell + "x = 1\n" + cell + "raise ValueError('lr=-1.0; must be > 0.')\n"
    )
    seen = checkout / "fast-runs.txt"
    (checkout / "notebooks" / "good_one.py").write_text(
        cell
        + "import os, pathlib\nshared = pathlib.Path(os.environ['SDILOCO_FAST_RUNS'])\n"
        f"assert shared.is_dir()\npathlib.Path({str(seen)!r}).write_text(str(shared))\n"
    )
    names = ["bad_one"] if jobs == 1 else ["bad_one", "good_one"]
    argv = ["-m", "sdiloco.paper", *names, "--fast", f"--jobs={jobs}"]
    proc = _python(*argv, cwd=checkout, SDILOCO_REPO=str(checkout))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    bad = [line for line in lines if line.startswith("bad_one:")]
    assert len(bad) == 1, lines
    log = checkout / "runs" / "failed" / "bad_one.txt"
    assert "FAILED: ValueError: lr=-1.0; must be > 0." in bad[0] and str(log) in bad[0]
    assert "raise ValueError" in log.read_text()  # the cell and its traceback
    if jobs == 2:
        good = [line for line in lines if line.startswith("good_one:")]
        assert len(good) == 1 and good[0].startswith("good_one: ok"), lines
        assert not pathlib.Path(seen.read_text()).exists()
    assert lines[-1].startswith(f"{len(names) - 1}/{len(names)} notebooks in "), lines
    assert len(lines) == len(names) + 1, lines


def _git(*args: str, cwd: pathlib.Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.notebook
def test_rerendering_a_clean_clone_leaves_git_status_clean(tmp_path):
    # A fresh clone of this checkout (its uncommitted tracked changes committed on
    # top), then the figure command on notebooks that read records (fig08, with a
    # table and a figure sharing one JSON) and none (fig02), two at a time.
    clone = tmp_path / "clone"
    _git("clone", "--quiet", "--shared", str(ROOT), str(clone), cwd=tmp_path)
    for name in _git("diff", "--name-only", "HEAD", cwd=ROOT).splitlines():
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, clone / name)
    _git("add", "-u", cwd=clone)
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.com"]
    _git(*identity, "commit", "--quiet", "--allow-empty", "-m", "wip", cwd=clone)
    # The numerics fingerprint is given, not measured (20 CPU-s at the suite's
    # compiler flags; test_provenance.py measures it): under those flags it is not
    # the records' either way, so the same records read as stale.
    other = json.dumps({"fingerprint": "0" * 16, "probes": {}})
    proc = subprocess.run(
        [sys.executable, "-m", "sdiloco.paper", "fig08", "fig02", "--jobs", "2"],
        cwd=clone,
        env={**os.environ, "PYTHONPATH": str(clone), provenance.FINGERPRINT_ENV: other},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and len(set(lines)) == 3, proc.stdout  # one per notebook
    assert lines[-1].startswith("2/2 notebooks")
    assert "without encryption" not in proc.stdout + proc.stderr
    assert _git("status", "--porcelain", cwd=clone) == ""


def test_a_notebook_with_stale_records_names_the_commands(
    monkeypatch, capsys, tmp_path
):
    # Its line said "(...; README)"; it names the commands that check the records
    # or make them this machine's, for that notebook.
    def one(path, out_dir, fast, alone):
        return path.stem, 1.0, 0, {"runs": 12, "stale": 12}

    monkeypatch.setattr(figures, "_run_one", one)
    paths = [tmp_path / "chaos.py", tmp_path / "fig08.py"]
    assert figures._run_all(paths, tmp_path, fast=True, jobs=1) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("chaos: ok; 0 of 12 records current (the others:")
    for name, line in zip(("chaos", "fig08"), lines):
        assert "python -m sdiloco.paper --verify 3" in line
        assert f"python -m sdiloco.paper {name} --restamp" in line
