"""Host offload: device bytes of a Streaming DiLoCo step with θ_g and the outer state on host.

One replica (M = 1: what one worker holds) of a deep MLP, `--layers` blocks of
`--width`² float32 weights, one fragment per block (P = `--layers`), Streaming DiLoCo
with overlapped FP4 (H = 2P, τ = 1): each step sends or receives a fragment. For the
plain step and for `sdiloco.offload(streaming_diloco(...))`, it prints, in units of N
(the parameter bytes), XLA's memory analysis of the compiled, state-donating step
(arguments and temporaries on the device; arguments in host memory), the device bytes
in use after a few steps where the backend reports them, the step time, and whether the
two runs' states are bitwise equal; and, as the floor, the same analysis of a plain
AdamW step of the model (3N of arguments, and the gradient's and update's temporaries).

The paper (§2.5) keeps on the accelerator only the fragment being synchronised of θ_g
and the outer state: per replica 3N (parameters and Adam) plus a fragment, against 5N
without offload. On CPU, host and device memory are one RAM and XLA's analysis does
not split them: run it on a GPU or TPU.

    python -m benchmarks.offload [--layers 16] [--width 1024] [--steps 40]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import sdiloco


def problem(layers: int, width: int, offload: bool):
    params = {
        "blocks": {
            "w": jr.normal(jr.key(0), (layers, width, width), jnp.float32)
            / np.sqrt(width)
        },
        "head": jr.normal(jr.key(1), (width,), jnp.float32) / np.sqrt(width),
    }

    def loss(p, batch):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(layer, batch["x"], p["blocks"]["w"])
        return jnp.mean((h @ p["head"] - batch["y"]) ** 2)

    fragments = sdiloco.fragments_by_layer(
        params, blocks=lambda p: p["blocks"], layers_per_fragment=1
    )
    alg = sdiloco.streaming_diloco(
        loss,
        inner=optax.adamw(1e-3),
        num_replicas=1,
        sync_every=2 * fragments.num_fragments,
        fragments=fragments,
        overlap=1,
        compressor="e3m0",
    )
    return (sdiloco.offload(alg) if offload else alg), params


def batches(width: int, steps: int):
    key = jr.key(2)
    out = []
    for t in range(steps):
        kx, ky = jr.split(jr.fold_in(key, t))
        out.append(
            {
                "x": jr.normal(kx, (1, 64, width), jnp.float32),
                "y": jr.normal(ky, (1, 64), jnp.float32),
            }
        )
    return out


def measure(layers: int, width: int, steps: int, offload: bool) -> dict:
    alg, params = problem(layers, width, offload)
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    data = batches(width, steps)
    state = alg.init(params, jr.key(3))
    del params
    step = sdiloco.jit_step(alg)
    lowered = jax.jit(lambda b, s: alg.step(s, b), donate_argnums=1).lower(
        data[0], state
    )
    start = time.perf_counter()
    analysis = lowered.compile().memory_analysis()
    compile_s = time.perf_counter() - start
    state, _ = step(state, data[0])
    jax.block_until_ready(state)
    start = time.perf_counter()
    for batch in data[1:]:
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    step_ms = 1e3 * (time.perf_counter() - start) / max(1, steps - 1)
    stats = jax.devices()[0].memory_stats() or {}
    return dict(
        offload=offload,
        n_bytes=n_bytes,
        args=analysis.argument_size_in_bytes,
        temp=analysis.temp_size_in_bytes,
        host_args=getattr(analysis, "host_argument_size_in_bytes", 0),
        in_use=stats.get("bytes_in_use"),
        peak=stats.get("peak_bytes_in_use"),
        compile_s=compile_s,
        step_ms=step_ms,
        state=jax.tree.map(np.asarray, state),
        kinds=sorted(
            {x.sharding.memory_kind for x in jax.tree.leaves(state.global_params)}
        ),
    )


def plain_optax(layers: int, width: int) -> dict:
    """The same model's AdamW step alone (no DiLoCo): the floor of any training step."""
    alg, params = problem(layers, width, False)
    loss = alg.spec.loss_fn
    opt = optax.adamw(1e-3)
    state = (params, opt.init(params))
    batch = jax.tree.map(lambda x: x[0], batches(width, 1)[0])

    def step(state, batch):
        p, s = state
        grads = jax.grad(loss)(p, batch)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    analysis = (
        jax.jit(step, donate_argnums=0).lower(state, batch).compile().memory_analysis()
    )
    return dict(args=analysis.argument_size_in_bytes, temp=analysis.temp_size_in_bytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    print(f"backend {jax.default_backend()}, device {jax.devices()[0].device_kind}")
    # Offload first: the backend's peak counter only grows, so each peak is its own.
    rows = [measure(args.layers, args.width, args.steps, o) for o in (True, False)]
    n = rows[0]["n_bytes"]
    frag = args.width * args.width * 4
    print(
        f"N = {n:,} B ({args.layers} blocks of {frag:,} B; largest fragment = "
        f"{frag / n:.3f} N)"
    )
    print(
        "| offload | device args (N) | device temp (N) | host args (N) | "
        "in use after steps (N) | peak (N) | compile (s) | step (ms) | θ_g memory |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        in_use = "-" if r["in_use"] is None else f"{r['in_use'] / n:.3f}"
        peak = "-" if r["peak"] is None else f"{r['peak'] / n:.3f}"
        print(
            f"| {r['offload']} | {r['args'] / n:.3f} | {r['temp'] / n:.3f} | "
            f"{r['host_args'] / n:.3f} | {in_use} | {peak} | {r['compile_s']:.1f} | "
            f"{r['step_ms']:.2f} | {','.join(r['kinds'])} |"
        )
    floor = plain_optax(args.layers, args.width)
    print(
        f"plain AdamW step of the same model: device args {floor['args'] / n:.3f} N, "
        f"temp {floor['temp'] / n:.3f} N"
    )
    same = all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(rows[0]["state"]), jax.tree.leaves(rows[1]["state"])
        )
    )
    print(f"states bitwise equal with and without offload: {same}")


if __name__ == "__main__":
    main()
