"""Two versions of the library side by side: the cost of each kind of step.

Usage:
    git archive <commit> sdiloco | tar -x -C /tmp/old
    python -m benchmarks.compare_versions /tmp/old/sdiloco sdiloco [--compressor e3m0]
        [--rounds 60]

A change to the sync path is judged by its effect on the time of a step, which on a
shared machine drifts by more than the change. So both versions run in one process
(each package loaded under its own name; the package imports itself relatively), on
the sync-heavy workload of `sync_heavy.py` (a ~1M-parameter stacked MLP, M = 2,
H = 20, 2 fragments), compiled with `sdiloco.jit_step`, and every kind of step is
timed in turn in each round: a plain vmapped AdamW step, and for each version an
inner-only step, a send and an arrival of each fragment, on crafted states
(`sync_cost.crafted_states`; each call gets a fresh copy, as the state is donated),
in a random order.
It prints, per version, the extra time of each kind (the inner-only step over the
plain one, the others over the inner-only step), and the medians of the paired
differences new − old; and whether the two versions' states are bitwise equal after
3H steps from the same start (a change meant to be bitwise neutral must print
`True`).

The same directory given twice is the control: two copies of one version, whose
differences show how fine the measurement is on the machine at the time (in one
session: −0.45 and +0.13 ms for the arrival extras, +8.8 ms per whole period of about
200 ms; `benchmarks/README.md`).

Then, as `sync_heavy.py` does for one version, whole periods (H steps from the
run's own state, not blocked between steps, so that dispatch overlaps as in
training) of the plain program and of each version, in a random order, `--periods`
rounds: plain ÷ each version (median over rounds) and the paired new − old.
"""

import argparse
import importlib.util
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

from benchmarks import _common
from benchmarks.fragment_cost import loss_fn, stacked_mlp
from benchmarks.sync_cost import crafted_states
from benchmarks.sync_heavy import plain_program, run_period


KINDS = {
    "inner": "inner",
    "send 1": "send p=1",
    "arrive 1": "arrive p=1",
    "send 0": "send p=0",
    "arrive 0": "arrive p=0",
}
"""The kinds of step timed, by label: their `crafted_states` key."""


def load(path: str, name: str):
    """The package at `path` (a copy of `sdiloco/`), imported as `name`."""
    where = pathlib.Path(path).resolve()
    if not (where / "__init__.py").is_file():
        raise SystemExit(f"error: {path} is not a copy of the sdiloco package")
    spec = importlib.util.spec_from_file_location(
        name, where / "__init__.py", submodule_search_locations=[str(where)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the old version's package directory")
    parser.add_argument("new", help="the new version's package directory")
    parser.add_argument("--compressor", default=None, help="e.g. e3m0 (float32)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--periods", type=int, default=30, help="rounds of periods")
    args = parser.parse_args()
    print(_common.machine())
    versions = {
        "old": load(args.old, "sdiloco_old"),
        "new": load(args.new, "sdiloco_new"),
    }
    m, h, layers = 2, 20, 16
    params = stacked_mlp(jr.key(0), layers, 256)
    inner = optax.adamw(1e-3)
    x = jr.normal(jr.key(1), (m, 4, 32))
    batch = {"x": x, "y": jnp.sin(x.sum(-1))}

    programs = {"plain": plain_program(params, inner, m)}
    runs = {"plain": programs["plain"]}  # name: (step, state) of whole periods
    finals = {}
    for name, lib in versions.items():
        labels = {"embed": 0, "head": 0, "blocks": np.arange(layers) % 2}
        alg = lib.streaming_diloco(
            loss_fn,
            inner=inner,
            num_replicas=m,
            sync_every=h,
            fragments=lib.fragments_from_labels(params, labels),
            compressor=args.compressor,
        )
        step, state = lib.jit_step(alg), alg.init(params, key=jr.key(2))
        for _ in range(3 * h):
            state, _ = step(state, batch)
        finals[name] = [np.asarray(x) for x in jax.tree.leaves(state)]
        states = crafted_states(state, alg.spec.schedule.first_send, h)
        for label, key in KINDS.items():
            programs[f"{name} {label}"] = (step, states[key])
        runs[name] = (step, state)

    def fresh(state):
        return jax.block_until_ready(
            jax.tree.map(lambda a: jnp.copy(a) if eqx.is_array(a) else a, state)
        )

    names = list(programs)
    times = {k: [] for k in names}
    rng = np.random.default_rng(0)
    for r in range(args.rounds + 1):  # round 0 warms up
        # A new order each round: no kind always follows the same one.
        for k in rng.permutation(names):
            step, state = programs[k]
            state = fresh(state)
            start = time.perf_counter()
            jax.block_until_ready(step(state, batch))
            if r:
                times[k].append(time.perf_counter() - start)
    t = {k: np.asarray(v) * 1e3 for k, v in times.items()}
    print(
        f"\ncompressor {args.compressor or 'float32'}; {args.rounds} interleaved rounds; "
        f"plain step {np.median(t['plain']):.2f} ms; extra ms (medians): the inner-only "
        "step over the plain one, the others over the inner-only step\n"
    )
    print("| kind | old | new | new − old (paired) |")
    print("|---|---|---|---|")
    for label in KINDS:
        base = {
            v: t["plain"] if label == "inner" else t[f"{v} inner"] for v in versions
        }
        extra = {v: np.median(t[f"{v} {label}"] - base[v]) for v in versions}
        paired = np.median(t[f"new {label}"] - t[f"old {label}"])
        print(
            f"| {label} | {extra['old']:+.2f} | {extra['new']:+.2f} | {paired:+.2f} |"
        )
    equal = all(np.array_equal(a, b) for a, b in zip(finals["old"], finals["new"]))
    print(f"\nstates after {3 * h} steps bitwise equal: {equal}")

    xs = jr.normal(jr.key(3), (h, m, 4, 32))
    period = [{"x": x, "y": jnp.sin(x.sum(-1))} for x in xs]

    names = list(runs)
    spans = {k: [] for k in names}
    for r in range(args.periods + 1):  # round 0 warms up
        for k in rng.permutation(names):
            took = run_period(runs, k, period)
            if r:
                spans[k].append(took)
    spans = {k: np.asarray(v) for k, v in spans.items()}
    ratios = {v: np.median(spans["plain"] / spans[v]) for v in versions}
    paired = np.median(spans["new"] - spans["old"]) * 1e3
    print(
        f"whole periods ({h} steps), {args.periods} rounds: plain ÷ old "
        f"{ratios['old']:.3f}, plain ÷ new {ratios['new']:.3f}; new − old "
        f"{paired:+.1f} ms per period (plain period {np.median(spans['plain']) * 1e3:.1f} ms)"
    )
    print(f"at the end: {_common.machine()}")


if __name__ == "__main__":
    main()
