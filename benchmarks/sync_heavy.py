"""Throughput on a sync-heavy workload: Streaming DiLoCo against M plain optax models.

Usage: `python -m benchmarks.sync_heavy [--runs 6] [--steps 200] [--layers 16]
[--dim 256] [--batch 4]`

The workload where synchronisation costs the most relative to compute: a ~1M-parameter
stacked MLP (`fragment_cost.stacked_mlp`), M = 2, a small batch, H = 20 and 2
fragments, so a send or an arrival happens every 10 steps. Streaming DiLoCo runs
through the documented entry point, `sdiloco.jit_step(alg)` (the state donated); the
baseline is the same AdamW on M independent replicas, vmapped and jitted with the state
donated: the same inner work without any sync. A third program is the library's step
with the previous E3M0 rounding (a search over the midpoints,
`step_throughput.with_search_rounding`): the before of the bit-pattern rounding. Runs
rotate (each program first in turn) and each times `steps` steps after a warm-up; a
ratio is the baseline's wall time over the program's (1.0: syncs are free), per round.

It also times the floor of a sync on this workload: the same arithmetic on contiguous
arrays of one fragment's size, with no gathers, loops or branches (a send: Δ of M
replicas, E3M0 quantization with `sdiloco.quantizer`, the mean; an arrival: the outer
Nesterov step and the α-merge of M replicas), and prints the best ratio any
implementation doing that work could reach: `H · plain / (H · plain + P · (send +
arrival))`.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import sdiloco
from benchmarks import _common
from benchmarks.fragment_cost import loss_fn, stacked_mlp
from benchmarks.step_throughput import with_search_rounding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4, help="examples per replica")
    parser.add_argument("--layers", type=int, default=16, help="blocks (even)")
    parser.add_argument("--dim", type=int, default=256, help="block width")
    args = parser.parse_args()
    print(_common.machine())
    m, h = 2, 20
    params = stacked_mlp(jr.key(0), args.layers, args.dim)
    inner = optax.adamw(1e-3)
    frags = sdiloco.fragments_from_labels(
        params, {"embed": 0, "head": 0, "blocks": np.arange(args.layers) % 2}
    )
    alg = sdiloco.streaming_diloco(
        loss_fn,
        inner=inner,
        num_replicas=m,
        sync_every=h,
        fragments=frags,
        overlap=1,
        compressor="e3m0",
    )
    xs = jr.normal(jr.key(1), (args.steps, m, args.batch, 32))
    batches = [{"x": x, "y": jnp.sin(x.sum(-1))} for x in xs]

    def plain_step(state, batch):
        def one(p, s, b):
            g = jax.grad(loss_fn)(p, b)
            u, s = inner.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.vmap(one)(*state, batch), None

    plain = eqx.filter_jit(plain_step, donate="all")

    def fresh_plain():
        reps = jax.tree.map(lambda x: jnp.broadcast_to(x, (m,) + x.shape), params)
        reps = jax.tree.map(jnp.array, reps)
        return reps, jax.vmap(inner.init)(reps)

    def run(kind: str) -> float:
        if kind == "plain":
            state, step = fresh_plain(), lambda s, b: plain(s, b)
        elif kind == "streaming":
            state, step = alg.init(params), sdiloco.jit_step(alg)
        else:  # the library's step with the previous E3M0 rounding (by search)
            state = alg.init(params)
            step = sdiloco.jit_step(with_search_rounding(alg.step))
        for b in batches[:h]:  # warm-up: compile, and past the first sends
            state, _ = step(state, b)
        jax.block_until_ready(state)
        start = time.perf_counter()
        for b in batches:
            state, _ = step(state, b)
        jax.block_until_ready(state)
        return time.perf_counter() - start

    kinds = ("plain", "streaming", "search")
    ratios: dict[str, list[float]] = {"streaming": [], "search": []}
    for r in range(args.runs):
        order = kinds[r % 3 :] + kinds[: r % 3]  # each kind first in turn
        t = {k: run(k) for k in order}
        for k in ratios:
            ratios[k].append(t["plain"] / t[k])
        print(
            f"run {r}: plain {t['plain'] * 1e3 / args.steps:.2f} ms/step, streaming "
            f"{t['streaming'] * 1e3 / args.steps:.2f} ms/step (ratio "
            f"{ratios['streaming'][-1]:.3f}), with search rounding "
            f"{t['search'] * 1e3 / args.steps:.2f} ms/step (ratio "
            f"{ratios['search'][-1]:.3f})",
            flush=True,
        )
    for k, label in (("streaming", "streaming"), ("search", "search rounding")):
        v = ratios[k]
        print(
            f"\nplain ÷ {label} over {args.runs} interleaved runs of {args.steps} "
            f"steps: median {np.median(v):.3f}, range {min(v):.3f}-{max(v):.3f}"
        )
    send, arrive = sync_floor(m, int(frags.sizes()[1]))
    step = np.median([run("plain") for _ in range(3)]) / args.steps
    bound = h * step / (h * step + 2 * (send + arrive))
    print(
        f"floor of one sync of a {int(frags.sizes()[1]):,}-value fragment: send "
        f"{send * 1e3:.2f} ms, arrival {arrive * 1e3:.2f} ms; plain step "
        f"{step * 1e3:.2f} ms; best reachable ratio {bound:.3f}"
    )
    print(f"at the end: {_common.machine()}")


def sync_floor(m: int, n: int, reps: int = 30) -> tuple[float, float]:
    """Median seconds of the bare arithmetic of one send and one arrival of n values."""
    q = sdiloco.quantizer("e3m0")
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
