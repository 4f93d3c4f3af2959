"""Bits on the wire: total and peak bits per replica for DP, DiLoCo and Streaming FP4.

Usage: `python -m benchmarks.bits [--model 1B tiny-s] [--steps 24300] [--no-check]`

The accounting is exact and needs no training: `alg.bits_per_fragment(params)` gives
the bits one replica puts on the wire to send each fragment (payload plus float32
scales, Python integers), and the library's schedule says which fragments are sent at
each step. Data-Parallel sends one bf16 gradient (16 bits per parameter) every step.
The model is built under `jax.eval_shape` (shapes only), so the paper's 1B model costs
no memory.

The paper (docs/paper.md §1.8, Table 1): over a run, Streaming DiLoCo with overlapped
FP4 communication at H = 100 exchanges ~400× fewer bits than Data-Parallel
(100 steps × 16/4), and syncing fragments of |p| = 3 of L = 24 layers divides the
peak bits per step by L/|p| = 8 (against DiLoCo at the same precision).

Unless `--no-check` is given, it also trains a tiny model for 3H steps with each method and
checks that the step's metrics (`sync/sent`, `comm/bits`) agree with this accounting.
"""

import argparse
import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

from benchmarks import _common, compile_count
from sdiloco.lab import config as config_lib, model as model_lib
from sdiloco.schedule import make_schedule


METHODS = {
    "Data-Parallel (bf16 gradients)": ("data_parallel", {}),
    "DiLoCo (fp32)": ("diloco", {}),
    "Streaming DiLoCo (fp32, no overlap)": ("streaming", {}),
    "Streaming DiLoCo, overlapped FP4": ("streaming_overlap_fp4", {}),
}
"""Display name → (preset, method changes)."""

PAPER_TOTAL_RATIO = {25: 441 / 1.10, 100: 1767 / 4.42, 250: 4418 / 11.05}
"""Table 1: terabytes exchanged by Data-Parallel ÷ by Streaming FP4, per token budget."""


def abstract(model: str, fn: Any) -> Any:
    """`fn(params)` for a model preset's parameters built under `jax.eval_shape`.

    The parameters are abstract (shapes and dtypes only), so even the paper's 1B model
    costs no memory; `fn` may return anything (e.g. Python integers).
    """
    out = []

    def build():
        out.append(fn(model_lib.Transformer(model_lib.preset(model), key=jr.key(0))))

    jax.eval_shape(build)
    return out[0]


def num_params(params: Any) -> int:
    """N, the number of floating-point parameters."""
    leaves = jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))
    return sum(int(np.prod(x.shape, dtype=np.int64)) for x in leaves)


def bits_per_fragment(config: config_lib.RunConfig) -> np.ndarray:
    """`alg.bits_per_fragment(params)` of a config's algorithm and model (exact ints)."""

    def fn(params):
        alg = config.method.build(model_lib.loss_with_aux, optax.identity(), params)
        return alg.bits_per_fragment(params)

    return abstract(config.model, fn)


def sent_matrix(config: config_lib.RunConfig, num_fragments: int, steps: int):
    """Which fragments are sent at steps 1..T, `[T, P]` bool, from the library's schedule.

    Data-Parallel "sends" its one gradient every step.
    """
    m = config.method
    if m.kind == "data_parallel":
        return np.ones((steps, 1), bool)
    overlap = getattr(m, "overlap", 0)  # DiLoCo has none
    schedule = make_schedule(m.sync_every, num_fragments, m.num_replicas, overlap)
    t = jnp.arange(1, steps + 1, dtype=jnp.int32)
    return np.asarray(jax.vmap(schedule.sent)(t))


def accounting(bits_per_fragment: np.ndarray, sent: np.ndarray) -> dict[str, Any]:
    """Exact per-step, total and peak bits of one replica (Python integers).

    Args:
        bits_per_fragment: `[P]` bits to send each fragment.
        sent: `[T, P]` which fragments are sent at each step.
    """
    bits = [int(b) for b in bits_per_fragment]
    per_step = [sum(b for b, s in zip(bits, row) if s) for row in sent.tolist()]
    return {
        "per_step": per_step,
        "total": sum(per_step),
        "peak": max(per_step),
        "sends": int(sent.sum()),
        "bits_per_fragment": bits,
    }


def table(model: str, sync_every: int, steps: int, replicas: int = 2) -> dict:
    """The accounting of every method in `METHODS` for a model preset.

    Returns:
        Display name → `accounting(...)` plus `config`, `num_fragments`,
        `max_fragment` (parameters of the largest fragment) and `period_bits` (bits
        of one H-step period once every fragment is syncing).
    """
    n = abstract(model, num_params)
    out = {}
    for name, (preset, changes) in METHODS.items():
        method = {"num_replicas": replicas, **changes}
        if preset != "data_parallel":
            method["sync_every"] = sync_every
        config = config_lib.preset(preset, model=model, method=method, steps=steps)
        bits = bits_per_fragment(config)
        row = accounting(bits, sent_matrix(config, len(bits), steps))
        sizes = abstract(model, ft.partial(_fragment_sizes, config))
        h = 1 if preset == "data_parallel" else sync_every
        row.update(
            config=config,
            num_params=n,
            num_fragments=len(bits),
            max_fragment=max(sizes),
            period_bits=sum(row["bits_per_fragment"]),
            period=h,
        )
        out[name] = row
    return out


def ratios(rows: dict) -> dict[str, float]:
    """Data-Parallel ÷ each method (total, peak, per period), DiLoCo ÷ streaming peak."""
    dp = rows["Data-Parallel (bf16 gradients)"]
    diloco = rows["DiLoCo (fp32)"]
    out = {}
    for name, row in rows.items():
        out[f"{name}/total"] = dp["total"] / row["total"]
        out[f"{name}/peak"] = dp["peak"] / row["peak"]
        # Asymptotic: DP's bits over H steps ÷ one period's sends of every fragment.
        out[f"{name}/period"] = dp["period_bits"] * row["period"] / row["period_bits"]
        out[f"{name}/peak_vs_diloco"] = diloco["peak"] / row["peak"]
    return out


def check(model: str = "tiny-xs", sync_every: int = 4, batch: int = 4) -> list[str]:
    """Train each method for 3H steps and compare its metrics with the accounting.

    Returns:
        One line per method; raises AssertionError on a disagreement.
    """
    steps = 3 * sync_every
    lines = []
    for name, (preset, changes) in METHODS.items():
        config = _common.run_config(
            preset,
            model=model,
            sync_every=sync_every,
            global_batch=batch,
            steps=steps,
            **changes,
        )
        alg_bits = bits_per_fragment(config)
        expected = accounting(alg_bits, sent_matrix(config, len(alg_bits), steps))
        got = compile_count.count_compiles(config, steps)
        measured = accounting(alg_bits, got["sent"])
        assert got["sent"].shape == (steps, len(alg_bits)), name
        assert measured["per_step"] == expected["per_step"], name
        # comm/bits is float32: exact for these small integers.
        assert got["bits"] == [float(b) for b in expected["per_step"]], name
        lines.append(
            f"{name}: {steps} steps, {expected['sends']} sends, total "
            f"{expected['total']:,} bits, peak {expected['peak']:,} bits per step: "
            "metrics agree"
        )
    return lines


def _fragment_sizes(config: config_lib.RunConfig, params: Any) -> list[int]:
    """Parameters per fragment (the whole model for DP and DiLoCo)."""
    if not isinstance(config.method, config_lib.StreamingConfig):
        return [num_params(params)]
    return [int(s) for s in config.method.fragments(params).sizes()]


def report(rows: dict, model: str, steps: int, sync_every: int) -> str:
    """The accounting and ratios as Markdown."""
    r = ratios(rows)
    first = next(iter(rows.values()))
    n = first["num_params"]
    layers = model_lib.preset(model).num_layers
    lines = [
        f"model {model}: N = {n:,} parameters, L = {layers} layers, "
        f"H = {sync_every}, T = {steps:,} steps, bits per replica",
        "",
        "| method | P | largest fragment (params) | sends | total bits | "
        "peak bits/step | DP ÷ total | DP ÷ total per period | DP ÷ peak | "
        "DiLoCo ÷ peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['num_fragments']} | {row['max_fragment']:,} | "
            f"{row['sends']:,} | {row['total']:.4g} | {row['peak']:.4g} | "
            f"{r[name + '/total']:.2f} | {r[name + '/period']:.2f} | "
            f"{r[name + '/peak']:.2f} | {r[name + '/peak_vs_diloco']:.3f} |"
        )
    k = model_lib.preset(model).num_layers // 3
    lines += [
        "",
        "paper: DP ÷ Streaming FP4 total ≈ 400 (Table 1: "
        + ", ".join(f"{b}B tokens {v:.1f}" for b, v in PAPER_TOTAL_RATIO.items())
        + f"); DiLoCo ÷ Streaming peak = L/|p| = {layers}/3 = {k}; ours "
        f"N/|p_max| = {n / rows['Streaming DiLoCo (fp32, no overlap)']['max_fragment']:.3f}",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["1B", "tiny-s"])
    parser.add_argument("--sync-every", type=int, default=100, help="H")
    parser.add_argument(
        "--steps", type=int, default=24_300, help="T (Table 1, 25B tokens: 24,300)"
    )
    parser.add_argument("--no-check", dest="check", action="store_false")
    args = parser.parse_args()
    print(_common.machine())
    for model in args.model:
        print()
        rows = table(model, args.sync_every, args.steps)
        print(report(rows, model, args.steps, args.sync_every))
    if args.check:
        print("\nshort real runs (tiny-xs, M = 2, H = 4, 12 steps):")
        for line in check():
            print(line)
    print(f"\nload average at the end: {_common.load()}")


if __name__ == "__main__":
    main()
