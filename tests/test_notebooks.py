"""The paper-figure notebooks: each runs in FAST mode and writes its artifacts; each
`.ipynb` is in sync with its jupytext `.py`, holds the outputs of a full run, and is
listed in `paper_figures/README.md`."""

import json
import os
import pathlib

import pytest
from helpers import session_folder
from notebook_runner import NotebookRunner

from sdiloco.paper import experiments, figures


ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = figures.notebooks()
IDS = [p.stem for p in NOTEBOOKS]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


@pytest.fixture(scope="session")
def fast_runs(tmp_path_factory):
    """One folder for this pytest run's FAST runs (`experiments.FAST_RUNS`), shared by
    both xdist workers."""
    return session_folder(tmp_path_factory) / "fast-runs"


@pytest.fixture(scope="session")
def runner(fast_runs, tmp_path_factory):
    """This worker's notebook process (`notebook_runner`): the notebooks run in FAST
    mode, drawing with Agg."""
    env = dict(
        os.environ,
        SDILOCO_FAST="1",
        MPLBACKEND="Agg",
        **{experiments.FAST_RUNS: str(fast_runs)},
    )
    log = tmp_path_factory.mktemp("notebook-runner") / "stderr.txt"
    runner = NotebookRunner(env, log)
    yield runner
    runner.close()


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_fast_and_writes_artifacts(path, tmp_path, runner):
    # FAST runs are a few steps long and never recorded, so their time is XLA's
    # compiles: they compile as the suite does (`conftest.LEVEL_FLAG` and
    # `EMITTER_FLAG`; the tier's numerics are not the records', and no test here
    # reads them). A run another notebook of this pytest run trained already is
    # read from `fast_runs` (the FAST Streaming FP4 run at the standard budget is
    # in ten notebooks): the tier trains each distinct run once.
    env = {
        "SDILOCO_FIGURES_DIR": str(tmp_path / "figures"),
        "SDILOCO_RUN_CACHE": str(tmp_path / "cache"),
    }
    log = tmp_path / "output.txt"
    result = runner.run(path, env, log, timeout=900)  # the longest, 2 on 2 cores
    output = log.read_text() if log.exists() else ""
    assert result["ok"], output[-3000:] + result["error"][-4000:]
    written = sorted((tmp_path / "figures").iterdir())
    metas = [json.loads(p.read_text()) for p in written if p.suffix == ".json"]
    artifacts = [p for p in written if p.suffix in (".png", ".md")]
    assert artifacts, f"{path.stem} wrote no figure or table"
    assert metas and all(m["notebook"] == path.stem for m in metas)
    assert all(m["fast_mode"] is True for m in metas)
    for p in artifacts:  # every artifact has its metadata
        assert p.with_suffix(".json").exists(), p.name
    assert not (tmp_path / "cache").exists()  # FAST mode never caches runs


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_pair_in_sync_and_executed(path):
    jupytext = pytest.importorskip("jupytext")
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.exists(), (
        f"{ipynb.name} is missing: run python -m sdiloco.paper {path.stem}"
    )
    py_cells = jupytext.read(path).cells
    nb = jupytext.read(ipynb)
    assert [(c.cell_type, c.source) for c in nb.cells] == [
        (c.cell_type, c.source) for c in py_cells
    ], (
        f"{ipynb.name} and {path.name} differ: re-run python -m sdiloco.paper {path.stem}"
    )
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), "not executed"
    assert any(c.get("outputs") for c in code)
    assert not any(
        o.get("output_type") == "error" for c in code for o in c.get("outputs", [])
    )


def test_index_lists_every_notebook():
    index = (ROOT / "paper_figures" / "README.md").read_text()
    missing = [p.stem for p in NOTEBOOKS if p.stem not in index]
    assert not missing, f"paper_figures/README.md does not mention {missing}"


def test_committed_artifacts_are_full_mode():
    for meta in (ROOT / "paper_figures").glob("*.json"):
        if meta.name in ("runtimes.json", "records.json"):
            continue
        d = json.loads(meta.read_text())
        assert d["fast_mode"] is False, f"{meta.name} was written in FAST mode"
        assert d["notebook"] in IDS, f"{meta.name} comes from an unknown notebook"


def test_runtimes_keep_render_and_training_time_apart():
    times = json.loads((ROOT / "paper_figures" / "runtimes.json").read_text())
    assert sorted(times) == sorted(p.stem for p in NOTEBOOKS)
    for name, t in times.items():
        assert set(t) == {"render_s", "runs", "trained", "train_s", "stale"}, name
        assert t["render_s"] > 0 and 0 <= t["trained"] <= t["runs"], name
        assert 0 <= t["stale"] <= t["runs"] - t["trained"], name
        assert (t["train_s"] > 0) == (t["runs"] > 0), name


def test_figures_cli_rejects_unknown_name(capsys):
    assert figures.main(["no-such-notebook"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "no-such-notebook" in err


def test_the_record_index_names_records_that_exist():
    """`records.json` (what `--verify` samples): per notebook, the records it read;
    every notebook that reads records is listed, with as many as it read."""
    index = json.loads((ROOT / "paper_figures" / "records.json").read_text())
    times = json.loads((ROOT / "paper_figures" / "runtimes.json").read_text())
    assert set(index) <= set(IDS)
    for name, t in times.items():
        if t["runs"]:
            assert len(index.get(name, [])) == t["runs"], name
    runs = ROOT / "paper_figures" / "runs"
    missing = [
        k for keys in index.values() for k in keys if not (runs / f"{k}.json").exists()
    ]
    assert not missing, missing[:5]


def test_the_runner_reports_a_failure_a_death_and_a_timeout_and_goes_on(tmp_path):
    # `notebook_runner`: a notebook runs as `python notebook.py` would (its folder
    # the working directory, the test's env, its output in its log); one that
    # raises gives its traceback; a runner that dies or runs past its time is
    # stopped, and the next notebook gets a new one.
    scripts = {
        "ok": "import os, pathlib\npathlib.Path('who.txt').write_text(os.environ['WHO'])"
        "\nprint('hello')\n",
        "who": "import os, pathlib\n"
        "pathlib.Path('who.txt').write_text(os.environ.get('WHO', 'nobody'))\n",
        "bad": "raise ValueError('lr=-1.0; must be > 0.')\n",
        "dies": "import os\nos._exit(3)\n",
        "slow": "import time\ntime.sleep(30)\n",
    }
    for name, text in scripts.items():
        (tmp_path / f"{name}.py").write_text(text)
    runner = NotebookRunner(dict(os.environ, MPLBACKEND="Agg"), tmp_path / "err.txt")
    try:
        log = tmp_path / "log.txt"
        assert runner.run(tmp_path / "ok.py", {"WHO": "a"}, log, 60) == {
            "ok": True,
            "error": "",
        }
        assert (tmp_path / "who.txt").read_text() == "a"
        assert log.read_text() == "hello\n"
        first = runner.proc
        assert runner.run(tmp_path / "who.py", {}, log, 60)["ok"]  # env not kept
        assert (tmp_path / "who.txt").read_text() == "nobody"
        assert runner.proc is first
        bad = runner.run(tmp_path / "bad.py", {}, log, 60)
        assert not bad["ok"] and "ValueError: lr=-1.0; must be > 0." in bad["error"]
        assert runner.proc is first  # a failing notebook leaves the runner as it was
        died = runner.run(tmp_path / "dies.py", {}, log, 60)
        assert not died["ok"] and "the notebook runner died" in died["error"]
        late = runner.run(tmp_path / "slow.py", {}, log, 1)
        assert not late["ok"] and "ran past its time limit" in late["error"]
        assert runner.proc is None
        assert runner.run(tmp_path / "ok.py", {"WHO": "b"}, log, 60)["ok"]
        assert (tmp_path / "who.txt").read_text() == "b"
        assert runner.proc is not first
    finally:
        runner.close()
