"""Sync cost against the number of fragments: work proportional to the fragment.

Usage: `python -m benchmarks.fragment_cost [--layers 16] [--dim 256] [--rounds 30]
[--compressor e3m0|float32]`

One model (a stack of `layers` d×d tanh blocks plus an input and an output layer,
about 1M parameters at the defaults), M = 2, τ = 1, E3M0 (or float32 outer gradients,
`--compressor float32`: the defaults of `streaming_diloco`), split into P = 2, 4, 8, 16
fragments of `layers / P` strided blocks each (the small input and output layers join
fragment 0). For each
P: the compile time of the step, and the extra wall time of a step that sends one block
fragment and of one where it arrives (outer step and merge) over an inner-only step,
measured on crafted states of one compiled program (`sync_cost.crafted_states`),
interleaved over rounds (median of the per-round differences). With work proportional
to the fragment, the extra time falls like 1/P; the compile time should not grow with P
(one compiled branch serves every same-shaped fragment).
"""

import argparse
import collections as co
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import sdiloco
from benchmarks import _common
from benchmarks.sync_cost import crafted_states


def stacked_mlp(key, layers: int, dim: int, d_in: int = 32) -> dict:
    k1, k2, k3 = jr.split(key, 3)
    return {
        "embed": jr.normal(k1, (d_in, dim)) / d_in**0.5,
        "blocks": jr.normal(k2, (layers, dim, dim)) / dim**0.5,
        "head": jr.normal(k3, (dim,)) / dim**0.5,
    }


def loss_fn(params, batch):
    h = batch["x"] @ params["embed"]
    h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), h, params["blocks"])
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="examples per replica")
    parser.add_argument("--sync-every", type=int, default=64, help="H (>= 3P)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--compressor", default="e3m0", choices=("e3m0", "float32"))
    args = parser.parse_args()
    compressor = None if args.compressor == "float32" else args.compressor
    print(_common.machine())
    params = stacked_mlp(jr.key(0), args.layers, args.dim)
    n = sum(x.size for x in jax.tree.leaves(params))
    x = jr.normal(jr.key(1), (2, args.batch, 32))
    batch = {"x": x, "y": jnp.sin(x.sum(-1))}
    rows = {}
    for num in (2, 4, 8, 16):  # P; layers strided, the non-block params in fragment 0
        labels = {"embed": 0, "head": 0, "blocks": np.arange(args.layers) % num}
        frags = sdiloco.fragments_from_labels(params, labels)
        alg = sdiloco.streaming_diloco(
            loss_fn,
            inner=optax.adamw(1e-3),
            num_replicas=2,
            sync_every=args.sync_every,
            fragments=frags,
            overlap=1,
            compressor=compressor,
        )
        step = eqx.filter_jit(alg.step)
        state = alg.init(params)
        start = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - start
        for _ in range(3):
            state, _ = compiled(state, batch)
        states = crafted_states(state, alg.spec.schedule.first_send, args.sync_every)
        kinds = {"inner": states["inner"], "send": states["send p=1"]}
        kinds["arrive"] = states["arrive p=1"]
        for s in kinds.values():
            jax.block_until_ready(compiled(s, batch))
        times = co.defaultdict(list)
        for _ in range(args.rounds):
            for kind, s in kinds.items():
                _, wall, _ = _common.timed(lambda s=s: compiled(s, batch))
                times[kind].append(wall)
        inner = np.asarray(times["inner"])
        extra = {
            k: float(np.median(np.asarray(times[k]) - inner))
            for k in ("send", "arrive")
        }
        size = int(frags.sizes()[1])
        rows[num] = (compile_s, float(np.median(inner)), extra, size)
    print(
        f"\nstacked MLP, {args.layers} blocks of {args.dim}², N = {n:,}; M = 2, H = "
        f"{args.sync_every}, τ = 1, {args.compressor}; {args.rounds} interleaved "
        "rounds, wall ms "
        "(medians)\n"
    )
    print(
        "| P | fragment 1 (params) | compile s | inner-only step | send extra | "
        "arrive extra | send extra × P / 2 |"
    )
    print("|---|---|---|---|---|---|---|")
    for num, (c, inner, extra, size) in rows.items():
        print(
            f"| {num} | {size:,} | {c:.2f} | {inner * 1e3:.2f} | "
            f"{extra['send'] * 1e3:+.2f} | {extra['arrive'] * 1e3:+.2f} | "
            f"{extra['send'] * 1e3 * num / 2:+.2f} |"
        )
    first, last = rows[min(rows)], rows[max(rows)]
    print(
        f"\ncompile time P = {max(rows)} ÷ P = {min(rows)}: {last[0] / first[0]:.2f}; "
        f"send extra ratio: {last[2]['send'] / first[2]['send']:.3f} (1/P would be "
        f"{min(rows) / max(rows):.3f}), arrive: "
        f"{last[2]['arrive'] / first[2]['arrive']:.3f}"
    )
    print(f"\nat the end: {_common.machine()}")


if __name__ == "__main__":
    main()
