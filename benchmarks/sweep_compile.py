"""CPU seconds of a learning-rate sweep, two versions of the library side by side.

A sweep's trials differ in their hyperparameters. Where those are constants of the
compiled step, every trial compiles its own programs; where they are values of the
optimizer state (`InnerConfig.build`, `OuterConfig.build`), the trials lower to one
program and XLA's compilation cache (`train.enable_compile_cache`) compiles it once.

Each variant runs in a fresh child process with an empty compilation cache of its
own: `--trials` runs of `--model` (streaming_overlap_fp4, M = 2) that differ only in
the inner learning rate, `--steps` steps each, and reports the child's CPU seconds
(user + system) and wall time. The variants alternate (`--repeats` rounds) and the
medians are compared. A version is a folder holding an `sdiloco` package (e.g.
`git worktree add /tmp/before REV`), put first on the child's `PYTHONPATH`.

    python -m benchmarks.sweep_compile --before /tmp/before --after .

`--notebook NAME` instead times `python -m sdiloco.paper NAME --fast` (the FAST
runs of a notebook, e.g. hyperparameter_sweep) with each version.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time


CHILD = """
import sys
import jax
from sdiloco.lab import config, train

cache, model, steps, trials = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
vary = sys.argv[5]
train.enable_compile_cache(cache)
base = config.preset("streaming_overlap_fp4", model=model, steps=steps)
base = base.replace(eval_every=steps, eval_windows=8)
with jax.numpy_dtype_promotion("standard"):
    for k in range(trials):
        if vary == "lr":
            trial = base.replace(inner={"lr": 1e-3 * 1.5**k})
        else:  # the warmup, as the sweep's warmup axis does
            trial = base.replace(inner={"warmup_fraction": 0.05 + 0.1 * k})
        train.run(trial, progress=False)
"""
"""The sweep, run in the child: trials that differ only in the inner lr, or only in
the warmup (`--vary`)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="folder with the old sdiloco")
    p.add_argument("--after", default=".", help="folder with the new sdiloco")
    p.add_argument("--model", default="tiny-xs")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--vary", choices=("lr", "warmup"), default="lr")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--notebook", help="time this notebook's FAST runs instead")
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name in ("before", "after"):
            folder = pathlib.Path(getattr(args, name)).resolve()
            runs[name].append(_measure(folder, args))
            print(name, runs[name][-1], flush=True)
    summary = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("cpu_s", "wall_s")}
        for name, rs in runs.items()
    }
    ratio = summary["after"]["cpu_s"] / summary["before"]["cpu_s"]
    print(json.dumps({"what": _what(args), **summary, "cpu_ratio": ratio}, indent=1))
    return 0


def _what(args: argparse.Namespace) -> str:
    if args.notebook:
        return f"python -m sdiloco.paper {args.notebook} --fast, cold cache"
    return (
        f"{args.trials} {args.vary} trials of {args.model}, {args.steps} steps each, "
        "one process, cold cache"
    )


def _measure(folder: pathlib.Path, args: argparse.Namespace) -> dict:
    """One child run of a version, with an empty compilation cache of its own."""
    with tempfile.TemporaryDirectory(prefix="sweep-cache-") as cache:
        env = {
            **os.environ,
            "PYTHONPATH": str(folder),
            "SDILOCO_JAX_CACHE": cache,
            "JAX_PLATFORMS": "cpu",
        }
        if args.notebook:
            cmd = [sys.executable, "-m", "sdiloco.paper", args.notebook, "--fast"]
            cmd += ["--out", os.path.join(cache, "out")]
        else:
            cmd = [sys.executable, "-c", CHILD, cache, args.model]
            cmd += [str(args.steps), str(args.trials), args.vary]
        start = time.perf_counter()
        before = os.times()
        proc = subprocess.run(
            cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=3600
        )
        after = os.times()
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return {"cpu_s": round(cpu, 1), "wall_s": round(time.perf_counter() - start, 1)}


if __name__ == "__main__":
    sys.exit(main())
