"""Regenerate the paper's tables and figures: `python -m sdiloco.paper [NAME ...]`.

Each artifact has a notebook under `notebooks/`, kept as a jupytext pair: the percent
`.py` (what is edited and reviewed) and the `.ipynb` (what users open, with the outputs
of its last full run). This command executes the notebooks with nbclient:

- full mode (the default) writes the artifacts into `paper_figures/` and the executed
  notebook, outputs included, back to `notebooks/<name>.ipynb`;
- `--fast` (or `SDILOCO_FAST=1`) runs the same code on tiny settings in under a minute
  each and writes into `runs/figures-fast/` (or `--out`), leaving the committed notebooks
  and artifacts alone.

Finished learning runs are recorded in `paper_figures/runs/` (one small JSON each: the
config, evaluations, history rows and summary; see `experiments.run_one`), committed
with the artifacts, so a fresh checkout re-renders every notebook from the records in
seconds; `--retrain` trains them again, `--restamp` only those whose record this
machine cannot vouch for (not current, or not fully stamped: `provenance`).

NAME selects notebooks whose file name contains it (e.g. `fig08`, `table4`); none runs
them all. `--jobs 2` runs two notebooks at a time; each prints one line. A notebook
whose cell raises prints it on that line (`FAILED: ValueError: ...`) with the path of
the whole traceback (`runs/failed/<name>.txt`), and the command exits 1. A full-mode
execution measures, per notebook: the time to render it (`render_s`, its wall time
less the training it did in that execution), its learning runs (`runs`), how many it
trained then (`trained`), their training time summed from their records (`train_s`,
whenever they trained: re-rendering from records does not erase what training took)
and how many of the records it read were stale (`stale`: made by code of another
numerics fingerprint, `provenance`). An execution that trained something, or a
notebook not listed yet, writes this into `paper_figures/runtimes.json`; a re-render
from records writes it into `runs/runtimes.json` of the checkout (not tracked).

A re-render writes only what changed: a notebook whose outputs are those already
saved, an artifact whose bytes are equal, a sidecar JSON that differs only in its
stamps (time, commit, machine) are left as they are, so re-rendering a clean
checkout leaves `git status` clean.

The notebooks and outputs are those of a repository checkout: the one holding the
current directory, or `$SDILOCO_REPO`, or `--notebooks DIR` (see `plotting.repo_root`).
An installed wheel holds no notebooks; the command then says where it looked and exits
with status 2, writing nothing.
"""

import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import experiments, provenance, verify
from .plotting import repo_root


def notebooks_dir() -> pathlib.Path:
    """`notebooks/` of the repository checkout (see `plotting.repo_root`)."""
    return repo_root() / "notebooks"


def notebooks(
    names: list[str] | None = None, directory: str | os.PathLike | None = None
) -> list[pathlib.Path]:
    """The notebooks' `.py` files, all or those whose stem contains one of `names`.

    Args:
        names: substrings of the notebooks' names; None or empty selects all.
        directory: where the notebooks are; default `notebooks_dir()`.

    Raises:
        ValueError: no notebook in `directory`, or a name that matches none.
    """
    where = pathlib.Path(directory) if directory is not None else notebooks_dir()
    found = sorted(where.glob("[a-z]*.py"))
    if not found:
        raise ValueError(
            f"no notebooks (notebooks/*.py) in {where.resolve()}: run from a checkout "
            "of the sdiloco repository, or pass --notebooks DIR, or set "
            "SDILOCO_REPO=<checkout>."
        )
    if not names:
        return found
    chosen = [p for p in found if any(n in p.stem for n in names)]
    unknown = [n for n in names if not any(n in p.stem for p in found)]
    if unknown:
        raise ValueError(
            f"no notebook matches {unknown}; available: {[p.stem for p in found]}."
        )
    return chosen


def execute(
    path: pathlib.Path, *, fast: bool, out_dir: pathlib.Path
) -> tuple[float, dict]:
    """Execute one notebook with nbclient; in full mode save it with its outputs.

    Returns:
        The wall time in seconds and `run_times` of the learning runs it used.
    """
    import jupytext
    import nbclient
    from traitlets.config import Config

    os.environ["SDILOCO_FAST"] = "1" if fast else "0"
    os.environ["SDILOCO_FIGURES_DIR"] = str(out_dir)
    nb = jupytext.read(path)
    nb.metadata.setdefault("kernelspec", {}).update(
        {"name": "python3", "display_name": "Python 3", "language": "python"}
    )
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "runs.jsonl"
        os.environ[experiments.RUN_LOG] = str(log)  # read by the kernel's run_one
        # The kernel on local sockets (not TCP, which warns about encryption).
        sockets = {"transport": "ipc", "ip": str(pathlib.Path(tmp) / "kernel")}
        start = time.perf_counter()
        try:
            nbclient.NotebookClient(
                nb,
                config=Config({"KernelManager": sockets}),
                timeout=None,
                kernel_name="python3",
                record_timing=False,  # no timestamps in the saved notebook
                resources={"metadata": {"path": str(path.parent)}},
            ).execute()
        finally:
            del os.environ[experiments.RUN_LOG]
        wall = time.perf_counter() - start
        runs = run_times(log.read_text().splitlines() if log.exists() else [])
    if not fast:
        save_notebook(nb, path.with_suffix(".ipynb"))
    return wall, runs


def save_notebook(nb: Any, path: pathlib.Path) -> bool:
    """Write the executed notebook `nb` to `path` unless it holds the same cells and
    outputs already (cell ids and execution timestamps aside); the saved cells'
    ids are kept. Returns whether it wrote."""
    import jupytext

    if path.exists():
        old = jupytext.read(path)
        if len(old.cells) == len(nb.cells):
            for new, was in zip(nb.cells, old.cells):
                if "id" in was:
                    new["id"] = was["id"]
        saved = jupytext.reads(jupytext.writes(nb, fmt="ipynb"), fmt="ipynb")
        if _comparable(old) == _comparable(saved):  # both as read from a file
            return False
    jupytext.write(nb, path)
    return True


def _comparable(nb: Any) -> Any:
    """`nb` as JSON without what changes at every execution."""
    d = json.loads(json.dumps(nb))
    for cell in d.get("cells", []):
        cell.get("metadata", {}).pop("execution", None)
    return d


def run_times(lines: list[str]) -> dict:
    """The runs of a run log (`experiments.RUN_LOG`), each counted once: how many
    (`runs`), how many trained in this execution (`trained`), and their training
    time summed (`train_s`; runs whose record has no time are left out of it)."""
    runs: dict[str, dict] = {}
    for line in lines:
        d = json.loads(line)
        seen = runs.setdefault(d["key"], d)
        seen["trained"] = seen["trained"] or d["trained"]
    walls = [d["wall_s"] for d in runs.values() if d["wall_s"] is not None]
    now = [d["wall_s"] or 0.0 for d in runs.values() if d["trained"]]
    return {
        "runs": len(runs),
        "trained": sum(d["trained"] for d in runs.values()),
        "train_s": round(float(sum(walls)), 1),
        "trained_now_s": round(float(sum(now)), 1),
        "stale": sum(bool(d.get("stale")) for d in runs.values()),
        "keys": sorted(runs),
    }


def _index(out_dir: pathlib.Path, name: str, keys: list[str]) -> bool:
    """The record keys notebook `name` read, into `records.json` (what `--verify`
    samples from); written only when they changed. Returns whether they did."""
    path = verify.index_path(out_dir)
    index = json.loads(path.read_text()) if path.exists() else {}
    if index.get(name) == keys or (not keys and name not in index):
        return False
    index[name] = keys
    path.write_text(json.dumps(dict(sorted(index.items())), indent=0) + "\n")
    return True


def _record(out_dir: pathlib.Path, name: str, wall: float, runs: dict) -> None:
    """The notebook's times into `out_dir/runtimes.json` if it trained, is not
    listed there, now reads other records (its runs were trained elsewhere, e.g.
    by a sweep's own command) or its records took another training time (re-trained
    elsewhere, e.g. re-stamped); else (a re-render from the same records, whatever
    the machine calls stale) into `runs/runtimes.json`."""
    other_records = _index(out_dir, name, runs.pop("keys", []))
    render = max(0.0, wall - runs.pop("trained_now_s", 0.0))
    entry = {"render_s": round(render, 1), **runs}
    path = out_dir / "runtimes.json"
    times = json.loads(path.read_text()) if path.exists() else {}
    listed = times.get(name, {})
    same = all(listed.get(k) == runs.get(k) for k in ("runs", "train_s"))
    if name in times and not runs.get("trained") and not other_records and same:
        path = repo_root() / "runs" / "runtimes.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        times = json.loads(path.read_text()) if path.exists() else {}
    times[name] = entry
    path.write_text(json.dumps(dict(sorted(times.items())), indent=1) + "\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sdiloco.paper",
        description="Regenerate the paper's tables and figures from notebooks/.",
    )
    p.add_argument(
        "names", nargs="*", help="run only notebooks whose name contains these"
    )
    p.add_argument(
        "--fast",
        action="store_true",
        default=os.environ.get("SDILOCO_FAST", "0") not in ("", "0"),
        help="tiny settings, same code path (< 1 min per notebook on 2 CPU cores)",
    )
    p.add_argument(
        "--out",
        help="output directory (default: paper_figures/, or runs/figures-fast/ with "
        "--fast, of the checkout)",
    )
    p.add_argument(
        "--notebooks",
        help="the notebooks' directory (default: notebooks/ of the checkout holding "
        "the current directory, or of $SDILOCO_REPO)",
    )
    p.add_argument(
        "--retrain",
        action="store_true",
        help="train every run again, replacing its record in paper_figures/runs/ "
        "(default: re-render from the committed records, training only what is missing)",
    )
    p.add_argument(
        "--restamp",
        action="store_true",
        help="train again only the runs whose record is not current and fully stamped "
        "on this machine (other numerics or machine type, or made before records "
        "carried their machine), replacing those records; resumable",
    )
    p.add_argument(
        "--shard",
        metavar="I/N",
        help="with --restamp: re-stamp the named notebooks' records straight from the "
        "configs they hold, cheapest first, the I-th of every N, without executing "
        "the notebooks; run N such processes side by side, then --restamp alone to "
        "re-render (it trains what is left and refuses a choice that moved)",
    )
    p.add_argument("--jobs", type=int, default=1, help="notebooks run at a time")
    p.add_argument("--list", action="store_true", help="list the notebooks and exit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    _verify_flags(p.add_argument_group("checking the records"))
    return p


def _verify_flags(p: Any) -> None:
    """`--verify` and the flags that go with it (`_verify`)."""
    p.add_argument(
        "--verify",
        type=int,
        metavar="K",
        help="retrain K records made by this code's numerics (a headline run, then one "
        "per notebook, sampled over the whole cost range with a seed that changes with "
        "the commit; a dear one for its first steps within a budget of about a tiny-xs "
        "run) and check them bitwise; with no current headline record, re-train a "
        "headline cell and check its seed-paired gap against the published interval; "
        "exit 1 if one fails",
    )
    p.add_argument(
        "--verify-seed",
        type=int,
        metavar="S",
        help="the sample's seed (default: from the commit)",
    )
    p.add_argument(
        "--verify-cell",
        action="store_true",
        help="with --verify: re-train the headline cell as well (about 6 tiny-xs runs)",
    )


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.retrain and args.restamp:
        p.error("--retrain trains every run again; --restamp only the unstamped: one.")
    shard = _shard(args.shard) if args.shard is not None else None
    if args.shard is not None and (shard is None or not args.restamp):
        why = "with --restamp only" if shard else "allowed: I/N, 1 <= I <= N (e.g. 1/2)"
        print(f"error: --shard={args.shard}; {why}.", file=sys.stderr)
        return 2
    if args.retrain or args.restamp:  # read by run_one, here and in the subprocesses
        os.environ["SDILOCO_RETRAIN"] = "1" if args.retrain else "unstamped"
    try:
        paths = notebooks(args.names, args.notebooks)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(x.stem for x in paths))
        return 0
    if args.jobs < 1:
        p.error(f"--jobs={args.jobs}; must be >= 1.")
    # Outputs sit next to the notebooks, in their checkout.
    root = paths[0].parent.resolve().parent
    if args.verify is not None:
        out = pathlib.Path(args.out or root / "paper_figures").resolve()
        return _verify(args.verify, args.verify_seed, args.verify_cell, out)
    if not args.fast:  # once here, for every notebook's kernel
        os.environ[provenance.FINGERPRINT_ENV] = provenance.environment_value()
    default = root / ("runs/figures-fast" if args.fast else "paper_figures")
    out_dir = pathlib.Path(args.out or default).resolve()
    if shard is not None:
        return _restamp_shard(paths, shard, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.fast and not os.environ.get(experiments.FAST_RUNS):
        # The notebooks' kernels and subprocesses share their FAST runs
        # (`experiments.FAST_RUNS`), for this command only.
        with tempfile.TemporaryDirectory(prefix="sdiloco-fast-runs-") as shared:
            os.environ[experiments.FAST_RUNS] = shared
            try:
                return _run_all(paths, out_dir, True, args.jobs, child=args.child)
            finally:
                del os.environ[experiments.FAST_RUNS]
    return _run_all(paths, out_dir, args.fast, args.jobs, child=args.child)


def _shard(text: str) -> tuple[int, int] | None:
    """`"I/N"` as `(I, N)`, or None unless 1 <= I <= N."""
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        return None
    return int(i), int(n)


def _restamp_shard(
    paths: list[pathlib.Path], shard: tuple[int, int], out_dir: pathlib.Path
) -> int:
    """`--restamp --shard I/N`: re-train the records the notebooks `paths` read
    (`records.json`) that this machine cannot vouch for, straight from their
    configs. The shard is fixed by the records alone, whatever is stamped yet:
    sorted by cost (steps x parameters), the I-th of every N, so a shard started
    again goes on with its own records. Other processes (other shards, a notebook
    re-stamping) may run beside it: a record is read again just before it is
    trained, and one re-stamped meanwhile is skipped. Prints a line per record;
    the notebooks re-render from them afterwards."""
    i, n = shard
    path = verify.index_path(out_dir)
    if not path.exists():
        print(f"error: no {path}; render the notebooks first.", file=sys.stderr)
        return 1
    index = json.loads(path.read_text())
    keys = sorted({key for p in paths for key in index.get(p.stem, [])})
    costs, todo = [], set()
    for key in keys:
        record_path = experiments.records_dir() / f"{key}.json"
        if record_path.exists():  # a missing one: the notebook trains it
            record = json.loads(record_path.read_text())
            summary = record["summary"]
            costs.append((summary["steps"] * summary["num_params"], key))
            if experiments.retrain(record):
                todo.add(key)
    shard_keys = [key for _, key in sorted(costs)][i - 1 :: n]
    mine = [key for key in shard_keys if key in todo]
    print(
        f"shard {i}/{n}: {len(mine)} of its {len(shard_keys)} records to re-stamp "
        f"({len(keys)} read by {len(paths)} notebooks, "
        f"{len(keys) - len(costs)} missing)",
        flush=True,
    )
    experiments.enable_compile_cache()
    for j, key in enumerate(mine, 1):
        start = time.perf_counter()
        if not experiments.restamp_record(key):
            print(f"{j}/{len(mine)} {key}: re-stamped meanwhile, skipped", flush=True)
            continue
        new = json.loads((experiments.records_dir() / f"{key}.json").read_text())
        before = new["replaced"]["final_eval"]
        after = new["evals"][-1]["eval/global"] if new["evals"] else None
        print(
            f"{j}/{len(mine)} {key}: {time.perf_counter() - start:.0f} s, final "
            f"loss {_loss(before)} -> {_loss(after)}"
            + (" (bitwise)" if new["replaced"]["bitwise"] else ""),
            flush=True,
        )
    return 0


def _loss(value: float | None) -> str:
    return "none" if value is None else f"{value:.4f}"


def _verify(k: int, seed: int | None, cell: bool, out_dir: pathlib.Path) -> int:
    """`--verify K`: retrain K current records (one headline, then one per notebook)
    bitwise; re-train a headline cell where no headline record is current."""
    if k < 1:
        print(f"error: --verify={k}; must be >= 1.", file=sys.stderr)
        return 2
    path = verify.index_path(out_dir)
    if not path.exists():
        print(f"error: no {path}; render the notebooks first.", file=sys.stderr)
        return 1
    experiments.enable_compile_cache()
    seed = verify.commit_seed() if seed is None else seed
    print(
        f"numerics of this code: fingerprint {provenance.fingerprint()}, probes "
        f"{provenance.probes()}; sample seed {seed}",
        flush=True,
    )
    index = json.loads(path.read_text())
    rows = verify.verify(experiments.records_dir(), index, k, seed)
    for row in rows:
        verdict = "bitwise equal" if row["equal"] else f"FAILED: {row['why']}"
        verdict += f" (largest relative gap {row['max_rel_gap']:.2g})"
        what = f"{row['model']}, {row['steps']} steps"
        if row["checked_steps"] < row["steps"]:
            what += f", the first {row['checked_steps']} within the budget"
        print(f"{row['notebook']}: {row['key']} ({what}): {verdict}", flush=True)
    if len(rows) < k:  # `verify.sample`: one record a notebook, past the headline
        print(
            f"checked {len(rows)} of the {k} records asked for: no more notebooks "
            "have records current on this machine",
            flush=True,
        )
    passed = all(r["passed"] for r in rows)
    if cell or not any(r["model"] in verify.HEADLINE_MODELS for r in rows):
        why = "asked" if cell else "no current headline record"
        print(f"re-training the headline cell ({why})", flush=True)
        result = verify.verify_cell()
        before, after = result["published"], result["retrained"]
        print(
            f"{result['cell']}: published gap {before['mean']:+.4f} "
            f"[{before['low']:+.4f}, {before['high']:+.4f}], retrained "
            f"{after['mean']:+.4f} [{after['low']:+.4f}, {after['high']:+.4f}]: "
            + ("inside" if result["passed"] else "FAILED: outside"),
            flush=True,
        )
        passed = passed and result["passed"]
    return 0 if passed else 1


def _run_one(
    path: pathlib.Path, out_dir: pathlib.Path, fast: bool, alone: bool
) -> tuple[str, float, int, dict]:
    """Run one notebook: here if it is the only one (its runs' times come back), else
    in a subprocess, which records its own times."""
    start = time.perf_counter()
    if alone:
        try:
            _, runs = execute(path, fast=fast, out_dir=out_dir)
        except Exception as e:  # a failing cell, a dead kernel: one line, no traceback
            return path.stem, time.perf_counter() - start, 1, _failure(path, e)
        _failure_log(path.stem).unlink(missing_ok=True)  # it fails no more
        return path.stem, time.perf_counter() - start, 0, runs
    cmd = [sys.executable, "-m", "sdiloco.paper", path.stem, "--out", str(out_dir)]
    cmd += ["--notebooks", str(path.parent), "--child"] + (["--fast"] if fast else [])
    rc = subprocess.run(cmd).returncode  # the child prints the notebook's line
    return path.stem, time.perf_counter() - start, rc, {"child": True}


def _failure(path: pathlib.Path, error: Exception) -> dict:
    """What the notebook's line says of `error`: the error the failing cell raised
    (nbclient's `ename: evalue`, its first line) or the exception itself, and where its
    whole text was written (`runs/failed/<name>.txt` of the checkout, not tracked)."""
    ename, evalue = getattr(error, "ename", None), getattr(error, "evalue", None)
    what = f"{ename}: {evalue}" if ename else f"{type(error).__name__}: {error}"
    log = _failure_log(path.stem)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(str(error) + "\n")
    first = what.strip().splitlines()[0] if what.strip() else what
    return {"failure": f"{first} (the whole error: {log})"}


def _failure_log(name: str) -> pathlib.Path:
    """Where the whole error of notebook `name`'s last failed execution is kept."""
    return repo_root() / "runs" / "failed" / f"{name}.txt"


def _stale_hint(name: str) -> str:
    """What a notebook's line says of records made by other numerics or another
    machine type: the commands that check them, or make them this machine's."""
    return (
        "(the others: other numerics or machine type; check a sample with "
        "python -m sdiloco.paper --verify 3, or make them this machine's with "
        f"python -m sdiloco.paper {name} --restamp)"
    )


def _run_all(
    paths: list, out_dir: pathlib.Path, fast: bool, jobs: int, child: bool = False
) -> int:
    """Run the notebooks, `jobs` at a time, one line each; 1 if any failed. A
    `child` (one notebook for a parent running several) prints no total."""
    failed = []
    total = time.perf_counter()
    alone = len(paths) == 1
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        runs_of = pool.map(lambda p: _run_one(p, out_dir, fast, alone), paths)
        for name, wall, rc, runs in runs_of:
            status = "ok" if rc == 0 else f"FAILED (exit {rc})"
            if "failure" in runs:
                status = f"FAILED: {runs['failure']}"
            if runs.get("runs"):
                current = runs["runs"] - runs.get("stale", 0)
                status += f"; {current} of {runs['runs']} records current"
                if current < runs["runs"]:
                    status += " " + _stale_hint(name)
            # A child printed its own line, unless it died before it could (a signal,
            # or an error outside the notebook: exit codes other than 0 and 1).
            if not runs.get("child") or rc not in (0, 1):
                print(f"{name}: {status} in {wall:.0f} s", flush=True)
            if rc:
                failed.append(name)
            elif not fast and alone:
                _record(out_dir, name, wall, runs)
    if not child:
        total_s = time.perf_counter() - total
        print(f"{len(paths) - len(failed)}/{len(paths)} notebooks in {total_s:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
