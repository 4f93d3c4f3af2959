"""Throughput on a sync-heavy workload: Streaming DiLoCo against M plain optax models.

Usage: `python -m benchmarks.sync_heavy [--rounds 60] [--builds 2] [--layers 16]
[--dim 256] [--batch 4]`

The workload where synchronisation costs the most relative to compute: a ~1M-parameter
stacked MLP (`fragment_cost.stacked_mlp`), M = 2, a small batch, H = 20 and 2
fragments, so a send or an arrival happens every 10 steps. Streaming DiLoCo runs
through the documented entry point, `sdiloco.jit_step(alg)` (the state donated), in two
configurations: `float32`, the defaults of `streaming_diloco` (τ = 1, α = 0.5, float32
outer gradients), and `e3m0`, the same with the paper's 4-bit quantization. The
baseline, `plain`, is the same AdamW on M independent replicas, vmapped and jitted with
the state donated: the same inner work without any sync. It is jitted with `jax.jit`,
whose dispatch is in C++ (through `eqx.filter_jit` its step was 0.34 ms slower).

Timing. On a shared machine the speed of a core drifts by tens of percent over
seconds, more than the few percent measured here, so the programs are interleaved
finely: a round runs one *period* (H steps: every fragment sends once and arrives
once) of each program, in a new random order each round (with a fixed rotation one
program always followed the plain one, which in `compare_versions` cost the step
after it up to 7 ms), each timed to the end of its period. Every program is also
built `--builds` times (its own jitted step and state): two builds of one program
differ by where their code and buffers land, and a single plain build read 0.974
against its twin over 40 rounds. A round's time of a program is the mean over its
builds, its ratio the plain time over the program's (1.0: syncs are free); the median
over rounds is the result, the interquartile range its spread, and beside it the
ratio of the summed times and that of the builds' medians (each build's median
period, the median over builds: it holds when one build alone runs slow, which
happened to plain builds on this machine for whole runs). The first line of results, plain build 1 ÷ plain
build 2 (two identical programs), is the resolution of the measurement.

It also times the floor of a sync: the same arithmetic on contiguous arrays of one
fragment's size, with no gathers, loops or branches (a send: Δ of M replicas,
compressed, and their mean; an arrival: the outer Nesterov step and the α-merge of M
replicas), and prints the best ratio any implementation doing that work could reach:
`H · plain / (H · plain + P · (send + arrival))`.
"""

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import sdiloco
from benchmarks import _common
from benchmarks.fragment_cost import loss_fn, stacked_mlp


COMPRESSORS = {"float32": None, "e3m0": "e3m0"}
"""The Streaming programs timed, by name: their `compressor`."""
M, H = 2, 20
"""Replicas, and steps per period (each of the 2 fragments sends once per period)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--builds", type=int, default=2, help="builds per program")
    parser.add_argument("--batch", type=int, default=4, help="examples per replica")
    parser.add_argument("--layers", type=int, default=16, help="blocks (even)")
    parser.add_argument("--dim", type=int, default=256, help="block width")
    args = parser.parse_args()
    print(_common.machine())
    m, h = M, H
    params, inner, frags, period = workload(args.layers, args.dim, args.batch)

    programs = {}  # (name, build): (step, state)
    for b in range(args.builds):
        programs["plain", b] = plain_program(params, inner, m)
        for name, compressor in COMPRESSORS.items():
            programs[name, b] = streaming_program(params, inner, frags, compressor)

    runs = list(programs)
    for run in runs:  # warm-up: compile, and past the first sends and arrivals
        run_period(programs, run, period)
        run_period(programs, run, period)
    times = {run: [] for run in runs}
    rng = np.random.default_rng(0)
    for _ in range(args.rounds):
        for i in rng.permutation(len(runs)):
            times[runs[i]].append(run_period(programs, runs[i], period))

    def mean_time(name):  # [rounds], the mean over the program's builds
        return np.mean([times[name, b] for b in range(args.builds)], axis=0)

    def build_median(name):  # the median over builds of each build's median period
        return np.median([np.median(times[name, b]) for b in range(args.builds)])

    plain = mean_time("plain")
    step = float(np.median(plain)) / h
    print(
        f"{args.rounds} rounds of one period ({h} steps) per build, {args.builds} "
        f"builds per program, interleaved; plain step median {step * 1e3:.2f} ms "
        f"(range {plain.min() / h * 1e3:.2f}-{plain.max() / h * 1e3:.2f})"
    )
    medians = {
        name: "/".join(
            f"{np.median(times[name, b]) / h * 1e3:.2f}" for b in range(args.builds)
        )
        for name in ("plain", *COMPRESSORS)
    }
    print(
        "step medians (ms) of each build: "
        + ", ".join(f"{name} {v}" for name, v in medians.items())
    )
    if args.builds > 1:
        twin = np.asarray(times["plain", 0]) / np.asarray(times["plain", 1])
        q1, q3 = np.percentile(twin, [25, 75])
        print(
            f"plain build 1 ÷ plain build 2 (identical programs: the resolution): "
            f"median {np.median(twin):.3f} (interquartile {q1:.3f}-{q3:.3f})"
        )
    n = int(frags.sizes()[1])
    for name in COMPRESSORS:
        t = mean_time(name)
        ratio = plain / t
        q1, q3 = np.percentile(ratio, [25, 75])
        send, arrive = sync_floor(m, n, COMPRESSORS[name])
        bound = h * step / (h * step + frags.num_fragments * (send + arrive))
        print(
            f"plain ÷ streaming {name}: median {np.median(ratio):.3f} "
            f"(interquartile {q1:.3f}-{q3:.3f}; summed times {plain.sum() / t.sum():.3f}; "
            f"of the builds' medians {build_median('plain') / build_median(name):.3f}); "
            f"step {np.median(t) / h * 1e3:.2f} ms; floor of a sync of {n:,} values: "
            f"send {send * 1e3:.2f} ms, arrival {arrive * 1e3:.2f} ms, best reachable "
            f"ratio {bound:.3f}",
            flush=True,
        )
    print(f"at the end: {_common.machine()}")


def workload(layers: int = 16, dim: int = 256, batch: int = 4):
    """The sync-heavy workload: the stacked MLP's parameters, AdamW, its 2 fragments
    (embedding and head with the even blocks, the odd blocks) and one period of
    batches (H of them, `[M, batch, 32]` inputs)."""
    params = stacked_mlp(jr.key(0), layers, dim)
    frags = sdiloco.fragments_from_labels(
        params, {"embed": 0, "head": 0, "blocks": np.arange(layers) % 2}
    )
    xs = jr.normal(jr.key(1), (H, M, batch, 32))
    period = [{"x": x, "y": jnp.sin(x.sum(-1))} for x in xs]
    return params, optax.adamw(1e-3), frags, period


def streaming_program(params, inner, frags, compressor: str | None):
    """Streaming DiLoCo's defaults on the workload, through `sdiloco.jit_step`:
    the step and its first state."""
    alg = sdiloco.streaming_diloco(
        loss_fn,
        inner=inner,
        num_replicas=M,
        sync_every=H,
        fragments=frags,
        compressor=compressor,
    )
    return sdiloco.jit_step(alg), alg.init(params)


def run_period(programs: dict, name: Any, period: list) -> float:
    """Seconds to run `programs[name]`, a `(step, state)` pair, over `period` (one
    batch per step), blocked only at the end; the pair keeps the new state."""
    step, state = programs[name]
    start = time.perf_counter()
    for b in period:
        state, _ = step(state, b)
    jax.block_until_ready(state)
    programs[name] = (step, state)
    return time.perf_counter() - start


def plain_program(params, inner: optax.GradientTransformation, m: int):
    """The baseline: `inner` on M independent replicas of `params`, vmapped, jitted
    with the state donated (`jax.jit`, whose dispatch is in C++: the leanest way to
    run it). Returns the step and its first state."""

    def plain_step(state, batch):
        def one(p, s, b):
            g = jax.grad(loss_fn)(p, b)
            u, s = inner.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.vmap(one)(*state, batch), None

    reps = jax.tree.map(
        lambda x: jnp.array(jnp.broadcast_to(x, (m,) + x.shape)), params
    )
    return jax.jit(plain_step, donate_argnums=0), (reps, jax.vmap(inner.init)(reps))


def sync_floor(
    m: int, n: int, compressor: str | None, reps: int = 30
) -> tuple[float, float]:
    """Median seconds of the bare arithmetic of one send and one arrival of n values."""
    q = sdiloco.quantizer(compressor) if compressor else (lambda x: x)
    outer = optax.sgd(0.4, momentum=0.9, nesterov=True)
    g = jr.normal(jr.key(0), (n,))
    reps_m = jr.normal(jr.key(1), (m, n))
    mom = outer.init(g)

    @jax.jit
    def send(g, r):  # per replica, summed in order (a vmap is slower on XLA:CPU)
        total = q(g - r[0])
        for k in range(1, m):
            total = total + q(g - r[k])
        return total / m

    @jax.jit
    def arrive(g, mom, grad, r):
        u, mom = outer.update(grad, mom, g)
        g = g + u
        return g, mom, 0.5 * r + 0.5 * g[None]

    grad = send(g, reps_m)
    jax.block_until_ready(arrive(g, mom, grad, reps_m))
    times = {"send": [], "arrive": []}
    for _ in range(reps):
        for kind, fn in (
            ("send", lambda: send(g, reps_m)),
            ("arrive", lambda: arrive(g, mom, grad, reps_m)),
        ):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[kind].append(time.perf_counter() - start)
    return float(np.median(times["send"])), float(np.median(times["arrive"]))


if __name__ == "__main__":
    main()
