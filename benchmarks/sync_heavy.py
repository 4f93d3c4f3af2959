"""Throughput on a sync-heavy workload: Streaming DiLoCo against M plain optax models.

Usage: `python -m benchmarks.sync_heavy [--rounds 40] [--builds 4] [--layers 16]
[--dim 256] [--batch 4] [--per-step]`

The workload where synchronisation costs the most relative to compute: a ~1M-parameter
stacked MLP (`fragment_cost.stacked_mlp`), M = 2, a small batch, H = 20 and 2
fragments, so a send or an arrival happens every 10 steps. Streaming DiLoCo runs
through the documented entry point, `sdiloco.jit_step(alg)` (the state donated), in two
configurations: `float32`, the defaults of `streaming_diloco` (τ = 1, α = 0.5, float32
outer gradients), and `e3m0`, the same with the paper's 4-bit quantization. The
baseline, `plain`, is the same AdamW on M independent replicas, vmapped and jitted with
the state donated: the same inner work without any sync. It is jitted with `jax.jit`,
whose dispatch is in C++ (through `eqx.filter_jit` its step was 0.34 ms slower).
Two more programs split the gap. `inner-only` is the float32 one with H so large that
it never syncs: plain ÷ inner-only is what carrying Streaming's state and metrics
through an inner step costs, inner-only ÷ float32 what the syncs cost. `bare` is the
plain program plus only the arithmetic of the float32 syncs, on contiguous arrays of
each fragment's size, at the steps where float32 sends and receives
(`bare_program`): plain ÷ bare is the best ratio an implementation that makes the
syncs' own passes over memory could read in this run (one that fused them into the
inner steps' update might do better), bare ÷ float32 what this one costs beyond that.

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
happened to plain builds on this machine for whole runs). The first line of results,
plain build 1 ÷ plain build 2 (two identical programs), is the resolution of the
measurement. The default of 4 builds (2 until 2026-12-02) averages over more
placements; what still moves the result, by several percent from one run to the
next, is the machine (`benchmarks/README.md`).

It also times the floor of a sync alone: the same arithmetic as `bare`'s, each call
run again and again on the same inputs (a send: Δ of M replicas, compressed, their
mean and whether it is finite; an arrival: the outer Nesterov step and the α-merge of
M replicas), and prints the ratio it implies, `H · plain / (H · plain + P · (send +
arrival))`. Run alone, with its operands in cache, the arithmetic is faster than
within training: in two probes `bare`'s syncs cost 1.7 and 2.0 times what this bound
assumes, so it is optimistic.

Bytes. First of all it prints the bytes each program moves as XLA counts them
(`traffic`): a plain step, the bare syncs of a period, and the least that any sync
making passes of its own must move. The workload is bound by memory bandwidth, so
`H·plain / (H·plain + syncs)` bounds the ratio without the machine's noise: 0.9655
with the bare syncs as XLA compiles them, 0.9768 with the least (2026-12-02).

`--per-step` times each step alone (blocked until done) by its position in the
period, for plain, inner-only, float32 and bare, instead of whole periods: which steps
carry the cost. Blocking exposes each call's dispatch, so steps read slower than in
the default mode, and one build's placement still moves a step by tenths of a ms.
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
from sdiloco import schedule


COMPRESSORS = {"float32": None, "e3m0": "e3m0"}
"""The Streaming programs timed, by name: their `compressor`."""
M, H = 2, 20
"""Replicas, and steps per period (each of the 2 fragments sends once per period)."""
NEVER = 10**6
"""H of the `inner-only` program: no sync falls within a run."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--builds", type=int, default=4, help="builds per program")
    parser.add_argument("--batch", type=int, default=4, help="examples per replica")
    parser.add_argument("--layers", type=int, default=16, help="blocks (even)")
    parser.add_argument("--dim", type=int, default=256, help="block width")
    parser.add_argument(
        "--per-step",
        action="store_true",
        help="time each step alone (blocked) by its position in the period",
    )
    args = parser.parse_args()
    print(_common.machine())
    m, h = M, H
    params, inner, frags, period = workload(args.layers, args.dim, args.batch)
    moved = traffic(params, inner, frags, period[0])
    print(
        f"bytes moved as XLA counts them, in N = {moved['N']:,} bytes (the model in "
        f"float32): a plain step {moved['plain']:.2f} N, a period of {h} "
        f"{h * moved['plain']:.1f} N; the bare syncs of a period {moved['bare']:.2f} N, "
        f"the least a sync in passes of its own moves {moved['least']:.2f} N; "
        f"plain ÷ (plain + syncs) at equal bandwidth: {moved['bound_bare']:.4f} with "
        f"the bare syncs, {moved['bound_least']:.4f} with the least"
    )
    if args.per_step:
        return per_step(params, inner, frags, period, args.builds, args.rounds)

    names = ("plain", *COMPRESSORS, "inner-only", "bare")
    times = interleaved(
        params, inner, frags, period, names, args.builds, args.rounds, run_period
    )

    def mean_time(name):  # [rounds], the mean over the program's builds
        return mean_over_builds(times, name, args.builds)

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
        for name in ("plain", "inner-only", "bare", *COMPRESSORS)
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
    inner_only = mean_time("inner-only")
    print(
        f"plain ÷ inner-only (the state and metrics carried, no sync): median "
        f"{np.median(plain / inner_only):.3f} (of the builds' medians "
        f"{build_median('plain') / build_median('inner-only'):.3f}); inner-only ÷ "
        f"float32 (the syncs): median {np.median(inner_only / mean_time('float32')):.3f} "
        f"(of the builds' medians "
        f"{build_median('inner-only') / build_median('float32'):.3f})"
    )
    bare = mean_time("bare")
    print(
        f"plain ÷ bare (plain, plus the bare arithmetic of the float32 syncs: the best "
        f"a sync in passes of its own could read here): median {np.median(plain / bare):.3f} "
        f"(of the builds' medians {build_median('plain') / build_median('bare'):.3f}); "
        f"bare ÷ float32 (the implementation's own cost): median "
        f"{np.median(bare / mean_time('float32')):.3f} (of the builds' medians "
        f"{build_median('bare') / build_median('float32'):.3f})"
    )
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
            f"send {send * 1e3:.2f} ms, arrival {arrive * 1e3:.2f} ms, ratio at that "
            f"floor {bound:.3f}",
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


def streaming_program(
    params, inner, frags, compressor: str | None, sync_every: int = H
):
    """Streaming DiLoCo's defaults on the workload, through `sdiloco.jit_step`:
    the step and its first state."""
    alg = sdiloco.streaming_diloco(
        loss_fn,
        inner=inner,
        num_replicas=M,
        sync_every=sync_every,
        fragments=frags,
        compressor=compressor,
    )
    return sdiloco.jit_step(alg), alg.init(params)


def program(params, inner, frags, name: str) -> tuple:
    """A new build of the program `name` on the workload: its step and first state."""
    if name == "plain":
        return plain_program(params, inner, M)
    if name == "bare":
        return bare_program(params, inner, frags)
    if name == "inner-only":
        return streaming_program(params, inner, frags, None, sync_every=NEVER)
    return streaming_program(params, inner, frags, COMPRESSORS[name])


def interleaved(
    params, inner, frags, period, names, builds: int, rounds: int, timer
) -> dict:
    """`builds` builds of each program in `names`, warmed up (compiled, and past the
    first sends and arrivals), then `rounds` rounds of one period of each, in a new
    random order each round. Returns `{(name, build): [timer(...) per round]}`."""
    programs = {
        (name, b): program(params, inner, frags, name)
        for b in range(builds)
        for name in names
    }
    runs = list(programs)
    for run in runs:
        run_period(programs, run, period)
        run_period(programs, run, period)
    times = {run: [] for run in runs}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for i in rng.permutation(len(runs)):
            times[runs[i]].append(timer(programs, runs[i], period))
    return times


def mean_over_builds(times: dict, name: str, builds: int) -> np.ndarray:
    """The times of program `name` per round (and per step, if the timer gave
    several), the mean over its builds: `times` as `interleaved` returns them."""
    return np.mean([times[name, b] for b in range(builds)], axis=0)


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


def traffic(params, inner: optax.GradientTransformation, frags, batch) -> dict:
    """Bytes moved, as XLA counts them: `cost_analysis()["bytes accessed"]` of the
    compiled program (each operation's operands and outputs, with no credit for
    caches), in units of N, the model's bytes in float32. `plain`: one step of the
    plain program (all M replicas); `bare`: the bare send and arrival of every
    fragment (`bare_sync`), that is the syncs of one period; `least`: what a sync in
    passes of its own cannot move less than, a send reading θ_g and the M replicas
    and writing Δ̄ ((M + 2)·n for a fragment of n bytes; its finiteness check fused
    into that pass), an arrival reading Δ̄, θ_g, the momentum and the M replicas and
    writing all but Δ̄ back ((2M + 5)·n). Where a step's time follows the bytes it
    moves (this workload is bound by memory bandwidth on a CPU), a period of H plain
    steps and the syncs reads at best `H·plain / (H·plain + syncs)`: `bound_bare`,
    `bound_least`."""
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))

    def moved(jitted, *args) -> float:
        return bytes_accessed(jitted, *args) / n_bytes

    step, state = plain_program(params, inner, M)
    plain = moved(step, state, batch)
    send, arrive, outer = bare_sync(M, None)
    bare = 0.0
    for n in (int(x) for x in frags.sizes()):
        g, r = jnp.zeros(n), jnp.zeros((M, n))
        bare += moved(jax.jit(send), g, r)
        bare += moved(jax.jit(arrive), g, outer.init(g), g, r)
    least = float((M + 2) + (2 * M + 5))  # per period, every fragment once: Σ n = N
    return {
        "N": n_bytes,
        "plain": plain,
        "bare": bare,
        "least": least,
        "bound_bare": H * plain / (H * plain + bare),
        "bound_least": H * plain / (H * plain + least),
    }


def bytes_accessed(jitted, *args) -> float:
    """XLA's count of the bytes a call of `jitted` on `args` moves (compiled)."""
    cost = jitted.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older jax: one per device
    return float(cost["bytes accessed"])


def per_step(params, inner, frags, period, builds: int, rounds: int) -> None:
    """Each step timed alone (dispatch, then blocked until done), by its position in
    the period, for plain, inner-only, float32 and bare, interleaved as in the
    default mode: which steps carry the cost. Blocking exposes each call's dispatch,
    which the default mode overlaps, so the steps read slower than there."""
    names = ("plain", "inner-only", "float32", "bare")
    times = interleaved(params, inner, frags, period, names, builds, rounds, run_steps)
    # Per position: the median over rounds of the mean over builds, in ms.
    at = {
        name: 1e3 * np.median(mean_over_builds(times, name, builds), axis=0)
        for name in names
    }
    when = bare_schedule(frags.num_fragments)  # steps 2H + 1 ... 3H, and so on
    sends = [t for t in range(1, H + 1) if when.sent(2 * H + t).any()]
    print(
        f"per step (ms; {rounds} rounds, {builds} builds): sends at positions {sends} "
        f"of the period, each arriving at the next step (the last one at position 1 "
        f"of the next period)"
    )
    print("position    " + " ".join(f"{t:6d}" for t in range(1, H + 1)))
    for name in names:
        print(f"{name:11s} " + " ".join(f"{x:6.2f}" for x in at[name]))
    print("minus plain")
    for name in names[1:]:
        d = at[name] - at["plain"]
        print(
            f"{name:11s} " + " ".join(f"{x:+6.2f}" for x in d) + f"  sum {d.sum():+.2f}"
        )


def run_steps(programs: dict, name: Any, period: list) -> list[float]:
    """`run_period`, each step timed alone: seconds per step."""
    step, state = programs[name]
    out = []
    for b in period:
        start = time.perf_counter()
        state, _ = step(state, b)
        jax.block_until_ready(state)
        out.append(time.perf_counter() - start)
    programs[name] = (step, state)
    return out


def bare_sync(m: int, compressor: str | None):
    """The bare arithmetic of a sync of one fragment held in contiguous arrays:
    `send(g, r) -> (Δ̄, finite)`, the mean over the M replicas `r` `[M, n]` of their
    compressed `g − r[m]` and whether it is finite (the default `nonfinite="skip"`
    needs it); `arrive(g, mom, Δ̄, r) -> (g, mom, r)`, the outer Nesterov step and the
    α-merge (α = 0.5) of every replica. Both unjitted."""
    q = sdiloco.quantizer(compressor) if compressor else (lambda x: x)
    outer = optax.sgd(0.4, momentum=0.9, nesterov=True)

    def send(g, r):  # per replica, summed in order (a vmap is slower on XLA:CPU)
        total = q(g - r[0])
        for k in range(1, m):
            total = total + q(g - r[k])
        mean = total / m
        return mean, jnp.all(jnp.isfinite(mean))

    def arrive(g, mom, grad, r):
        u, mom = outer.update(grad, mom, g)
        g = g + u
        return g, mom, 0.5 * r + 0.5 * g[None]

    return send, arrive, outer


def sync_floor(
    m: int, n: int, compressor: str | None, reps: int = 30
) -> tuple[float, float]:
    """Median seconds of the bare arithmetic of one send and one arrival of n values
    (`bare_sync`), each run alone, again and again on the same inputs."""
    send, arrive, outer = bare_sync(m, compressor)
    send, arrive = jax.jit(send), jax.jit(arrive)
    g = jr.normal(jr.key(0), (n,))
    reps_m = jr.normal(jr.key(1), (m, n))
    mom = outer.init(g)
    grad = send(g, reps_m)[0]
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


def bare_schedule(num_fragments: int) -> schedule.Schedule:
    """When `bare_program` sends and receives: `streaming_diloco`'s default schedule
    with H = `H`, `num_fragments` fragments and τ = 1. Fragment p is sent at step t
    (1-based) where `.sent(t)[p]`, and arrives τ steps later."""
    return schedule.make_schedule(H, num_fragments, M, overlap=1)


def bare_program(params, inner: optax.GradientTransformation, frags):
    """The plain program plus the bare arithmetic of Streaming's float32 syncs
    (`bare_sync`), each fragment held in contiguous arrays of its own, at the steps
    where the `float32` program sends and receives it (`bare_schedule`). What no
    implementation that makes the syncs' own passes over memory can beat, timed
    beside the others: the arithmetic alone, with the caches and memory bandwidth
    that the inner steps leave it. Its sends and arrivals are jitted calls of their
    own (a few tens of µs of dispatch each, four per period); an arrival's arrays are
    donated, a send writes a new Δ̄ (where Streaming writes its in-flight slot).
    """
    step, state = plain_program(params, inner, M)
    send, arrive, outer = bare_sync(M, None)
    send, arrive = jax.jit(send), jax.jit(arrive, donate_argnums=(0, 1, 3))
    syncs = []  # per fragment: θ_g's piece, the replicas', (Δ̄, finite), momentum
    for p, n in enumerate(int(x) for x in frags.sizes()):
        g = jr.normal(jr.key(2 * p), (n,))
        syncs.append([g, jr.normal(jr.key(2 * p + 1), (M, n)), None, outer.init(g)])
    when = bare_schedule(len(syncs))
    tau = min(when.overlap)
    t = [0]  # steps taken, on the host

    def bare_step(state, batch):
        plain_state, _ = state
        plain_state, _ = step(plain_state, batch)
        t[0] += 1
        sent, arrived = when.sent(t[0]), when.sent(t[0] - tau)
        for p, sync in enumerate(syncs):
            if sent[p]:
                sync[2] = send(sync[0], sync[1])
            if arrived[p]:
                g, mom, r = arrive(sync[0], sync[3], sync[2][0], sync[1])
                sync[0], sync[3], sync[1] = g, mom, r
        return (plain_state, [list(x) for x in syncs]), None

    return bare_step, (state, None)


if __name__ == "__main__":
    main()
