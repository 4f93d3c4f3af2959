"""Step cost: XLA's static cost analysis of each step program (a noise-free profile).

Usage: `python -m benchmarks.step_cost [--model tiny-s] [--batch 16]`

Timings on a shared machine are noisy; XLA's cost analysis of the compiled programs is
not. It counts FLOPs, bytes accessed and transcendentals of the plain optax step,
Data-Parallel's step, the streaming inner step alone (`sdiloco.inner.inner_steps`,
what a step with no sync due executes) and the whole streaming step (whose
`lax.cond` branches, sync work included, are all counted), and, from the compiled
HLO, how many elements the step copies outside its conditionals (state leaves that
pass through unchanged are copied unless the state is donated).

XLA counts the body of a loop once, so the scanned transformer blocks count as one
layer: compare the columns, not the absolute values.
"""

import argparse
import math
import re

import equinox as eqx
import jax

from benchmarks import _common, step_throughput
from sdiloco.lab import model as model_lib


def cost(fn, state, batch, *, donate: bool = True) -> dict[str, float]:
    """Cost analysis and entry-computation copies of `fn(state, batch)` compiled."""
    jitted = eqx.filter_jit(
        lambda b, s: fn(s, b), donate="all-except-first" if donate else "none"
    )
    with jax.numpy_dtype_promotion("standard"):
        compiled = jitted.lower(batch, state).compile().compiled
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0]
    return {
        "flops": float(analysis.get("flops", 0.0)),
        "bytes": float(analysis.get("bytes accessed", 0.0)),
        "transcendentals": float(analysis.get("transcendentals", 0.0)),
        "copied": entry_copies(compiled.as_text()),
    }


def entry_copies(hlo: str) -> int:
    """Elements copied by `copy` instructions of the entry computation (not of
    broadcasts, which are layout changes inside the model)."""
    entry = next(c for c in re.split(r"\n(?=\S.*\{\n)", hlo) if c.startswith("ENTRY"))
    total = 0
    for m in re.finditer(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\((\S+)\)", entry):
        if "broadcast" not in m.group(2):
            total += math.prod(int(d) for d in m.group(1).split(",") if d)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-s")
    parser.add_argument("--batch", type=int, default=16, help="global batch B")
    args = parser.parse_args()
    print(_common.machine())
    cs = _common.run_config(
        "streaming_overlap_fp4", model=args.model, global_batch=args.batch
    )
    cd = _common.run_config("data_parallel", model=args.model, global_batch=args.batch)
    rs, rd = _common.build(cs), _common.build(cd)
    inner = cs.inner.build(cs.steps)
    batch = _common.random_batches(1, 2, args.batch, rs.model_config.seq_len)[0]
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
    plain_init, plain_step = step_throughput.plain_optax(model_lib.loss_with_aux, inner)

    inner_only = _common.inner_only(inner)

    with jax.numpy_dtype_promotion("standard"):
        plain_state = plain_init(rs.model)
    rows = {
        "plain optax": cost(plain_step, plain_state, flat),
        "data_parallel": cost(rd.algorithm.step, rd.init_state(), batch),
        "streaming, inner step only": cost(inner_only, rs.init_state(), batch),
        "streaming, whole step (all branches)": cost(
            rs.algorithm.step, rs.init_state(), batch
        ),
        "streaming, whole step, state not donated": cost(
            rs.algorithm.step, rs.init_state(), batch, donate=False
        ),
    }
    dp = rows["data_parallel"]
    print(
        f"\nmodel {args.model}, M = 2, B × L = {args.batch} × {rs.model_config.seq_len}\n"
    )
    print(
        "| program | GFLOP | ÷ DP | MB accessed | ÷ DP | transcendentals (M) | ÷ DP "
        "| elements copied |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['flops'] / 1e9:.3f} | {r['flops'] / dp['flops']:.3f} | "
            f"{r['bytes'] / 1e6:.1f} | {r['bytes'] / dp['bytes']:.3f} | "
            f"{r['transcendentals'] / 1e6:.3f} | "
            f"{r['transcendentals'] / dp['transcendentals']:.3f} | {r['copied']:,} |"
        )
    print(f"\nat the end: {_common.machine()}")


if __name__ == "__main__":
    main()
