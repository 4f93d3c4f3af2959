"""Step throughput: Streaming DiLoCo vs Data-Parallel vs a plain optax loop.

Usage: `python -m benchmarks.step_throughput [--model tiny-s] [--batch 16] [--rounds 80]`

Three programs train the same model on the same global batch of `B × L` tokens per
step, each one `eqx.filter_jit` region with the state donated:

- **streaming**: Streaming DiLoCo with overlapped FP4 communication (M = 2, 3 layers
  per fragment strided, τ = 1, α = 0.5, E3M0), `sdiloco.lab.config`'s preset;
- **data_parallel**: Data-Parallel with the same M and inner optimizer;
- **plain**: one model and `config.inner.build(steps)` (the identical optax chain) on
  the `[B, L]` batch, with no replica axis at all.

A fourth, **streaming+search_rounding**, is the streaming step traced with the
library's previous `sdiloco.compression.formats.round_nearest` for E3M0
(`round_nearest_search`: a search over the midpoints; the library now rounds E3M0 on
the bit pattern), the before of that change.

They run interleaved, `--per-round` steps each per round (in alternating order), every
step timed on its own (blocking), so all see the same load. A streaming step is
classified by its metrics as "send" (`sync/sent`), "arrive" (`sync/applied` or
`sync/merged`: the outer step and the merge τ = 1 steps later) or "inner only". The
ratios are medians over rounds of per-round ratios (robust to the load changing), and
the cost of a sync is paired the same way against the Data-Parallel step of each round
(`benchmarks/sync_cost.py` measures it more precisely, at a small batch).

`--sync-every` is small (12) so that sends and arrivals are half the streaming steps
and are measured often; the throughput at the paper's H = 100 is then
`t_inner + P·(Δ_send + Δ_arrive) / H` (each fragment is sent once and arrives once per
H steps), reported beside the directly measured worst case.
"""

import argparse
import collections as co
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _common
from sdiloco.compression import formats
from sdiloco.lab import model as model_lib


@dataclasses.dataclass
class Variant:
    """One program under test: a jitted step, its state, and its batches."""

    step: Callable[[Any, Any], tuple[Any, dict]]
    state: Any
    batches: list[Any]


@dataclasses.dataclass(frozen=True)
class Record:
    """One timed step."""

    variant: str
    round: int
    t: int  # the step index after this step (1-based, as in the state)
    wall: float  # seconds
    cpu: float  # process CPU seconds (all threads)
    kind: str  # "inner", "send" or "arrive" ("inner" for the baselines)


def plain_optax(loss_fn: Callable[..., Any], inner: Any) -> tuple[Callable, Callable]:
    """A plain optax training loop on one model: `(init(params), step(state, batch))`."""

    def init(params):
        return params, inner.init(eqx.filter(params, eqx.is_inexact_array))

    def step(state, batch):
        params, opt_state = state
        (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            params, batch
        )
        updates, opt_state = inner.update(
            grads, opt_state, eqx.filter(params, eqx.is_inexact_array)
        )
        return (eqx.apply_updates(params, updates), opt_state), {"loss/train": loss}

    return init, step


def round_nearest_search(a: jax.Array, mags: np.ndarray) -> jax.Array:
    """`sdiloco.compression.formats.round_nearest` by search, for every table.

    The library's rounding before E3M0 got its bit-pattern path (bitwise the same
    codes): `jnp.searchsorted` over the midpoints, comparing against every midpoint
    for the 4-bit formats (7 midpoints; ~3-4x faster than the default loop of gathers
    on XLA:CPU) and the loop for FP8's ~126.
    """
    mids = jnp.asarray((mags[1:] + mags[:-1]) / 2, a.dtype)
    method = "compare_all" if len(mids) <= 16 else "scan"
    below = jnp.searchsorted(mids, a, side="left", method=method).astype(jnp.int32)
    at = jnp.take(mids, jnp.minimum(below, len(mids) - 1))
    tie = (below < len(mids)) & (at == a)
    return jnp.where(tie & (below % 2 == 1), below + 1, below)


def with_search_rounding(step: Callable) -> Callable:
    """`step` traced with `round_nearest_search` in place of the library's.

    The swap lasts only while `step` is traced (once, inside jit), so no other
    program sees it.
    """

    def patched(state, batch):
        original = formats.round_nearest
        formats.round_nearest = round_nearest_search
        try:
            return step(state, batch)
        finally:
            formats.round_nearest = original

    return patched


def make_variants(
    *,
    model: str = "tiny-s",
    global_batch: int = 16,
    sync_every: int = 12,
    replicas: int = 2,
    num_batches: int = 4,
    patched: bool = True,
) -> tuple[dict[str, Variant], dict[str, Any]]:
    """The three programs, sharing the model, the tokens and the inner optimizer.

    Args:
        model: a model preset.
        global_batch: B, sequences per step over all replicas.
        sync_every: H of the streaming variant.
        replicas: M.
        num_batches: distinct batches to cycle through.
        patched: also time "streaming+search_rounding", the streaming step with the
            previous rounding by search (see `with_search_rounding`).

    Returns:
        The variants, and facts about the setup (P, L, parameter count, steps).
    """
    cs = _common.run_config(
        "streaming_overlap_fp4",
        model=model,
        replicas=replicas,
        sync_every=sync_every,
        global_batch=global_batch,
    )
    cd = _common.run_config(
        "data_parallel", model=model, replicas=replicas, global_batch=global_batch
    )
    rs, rd = _common.build(cs), _common.build(cd)
    seq_len = rs.model_config.seq_len
    batches = _common.random_batches(num_batches, replicas, global_batch, seq_len)
    flat = [jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), b) for b in batches]
    with jax.numpy_dtype_promotion("standard"):
        plain_init, plain_step = plain_optax(
            model_lib.loss_with_aux, cs.inner.build(cs.steps)
        )
        variants = {
            "streaming": Variant(
                _common.jit_step(rs.algorithm.step),
                _common.fresh(rs.init_state()),
                batches,
            ),
            "data_parallel": Variant(
                _common.jit_step(rd.algorithm.step),
                _common.fresh(rd.init_state()),
                batches,
            ),
            "plain": Variant(
                _common.jit_step(plain_step),
                _common.fresh(plain_init(rs.model)),
                flat,
            ),
        }
        if patched:
            variants["streaming+search_rounding"] = Variant(
                _common.jit_step(with_search_rounding(rs.algorithm.step)),
                _common.fresh(rs.init_state()),
                batches,
            )
    info = {
        "num_fragments": len(rs.algorithm.bits_per_fragment(rs.model)),
        "seq_len": seq_len,
        "num_params": rs.model_config.num_params(),
        "tokens_per_step": global_batch * seq_len,
    }
    return variants, info


def measure(
    variants: dict[str, Variant], *, rounds: int, per_round: int, warmup: int
) -> list[Record]:
    """Run the variants interleaved and time every step.

    Each variant first takes `warmup` untimed steps (the compile included); then, for
    each of `rounds` rounds, each variant in turn takes `per_round` timed steps.
    """
    counters = {name: 0 for name in variants}

    def one(name: str, r: int) -> Record:
        v = variants[name]
        batch = v.batches[counters[name] % len(v.batches)]
        (v.state, metrics), wall, cpu = _common.timed(lambda: v.step(v.state, batch))
        counters[name] += 1
        return Record(name, r, counters[name], wall, cpu, _kind(metrics))

    for name in variants:
        for _ in range(warmup):
            one(name, -1)
    records = []
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in order:
            records.extend(one(name, r) for _ in range(per_round))
    return records


def summarize(
    records: list[Record], *, num_fragments: int, clock: str = "wall"
) -> dict[str, float]:
    """Median step times, sync costs and throughput ratios (see the module docstring).

    Args:
        records: from `measure`.
        num_fragments: P of the streaming variants.
        clock: "wall" or "cpu".

    Returns:
        `t/<variant>` and `t/<variant>/<kind>` (median seconds per step),
        `cost/<variant>/send|arrive` (median send/arrival step minus median inner-only
        step), `ratio/<variant>/<what>_vs_<baseline>` (baseline step time ÷ streaming
        step time: a throughput ratio, > 1 means streaming is faster) and `sem/...`
        (the standard error of each ratio's median, 1.2533 σ / √rounds).
    """
    values: dict[tuple[str, str, int], list[float]] = co.defaultdict(list)
    for rec in records:
        for kind in ("all", rec.kind):
            values[rec.variant, kind, rec.round].append(getattr(rec, clock))
    variants = list(dict.fromkeys(rec.variant for rec in records))
    rounds = sorted({rec.round for rec in records})
    out: dict[str, float] = {}

    def median(variant: str, kind: str) -> float:
        pooled = [v for r in rounds for v in values[variant, kind, r]]
        return float(np.median(pooled)) if pooled else float("nan")

    def paired(name: str, base: str, variant: str, kind: str, agg=np.median) -> None:
        """Median over rounds of agg(base's steps) / agg(variant's `kind` steps)."""
        ratios = [
            agg(values[base, "all", r]) / agg(values[variant, kind, r])
            for r in rounds
            if values[base, "all", r] and values[variant, kind, r]
        ]
        out[f"ratio/{name}"] = float(np.median(ratios)) if ratios else float("nan")
        out[f"sem/{name}"] = 1.2533 * float(np.std(ratios)) / np.sqrt(len(ratios))

    for v in variants:
        out[f"t/{v}"] = median(v, "all")
    baselines = [v for v in variants if not v.startswith("streaming")]
    for v in variants:
        if not v.startswith("streaming"):
            continue
        for kind in ("inner", "send", "arrive"):
            out[f"t/{v}/{kind}"] = median(v, kind)
        for kind in ("send", "arrive"):
            out[f"cost/{v}/{kind}"] = _paired_cost(values, rounds, v, kind)
        sync = out[f"cost/{v}/send"] + out[f"cost/{v}/arrive"]
        for base in baselines:
            paired(f"{v}/inner_steps_vs_{base}", base, v, "inner")
            # Whole rounds as run: sends and arrivals in the proportion of H.
            paired(f"{v}/as_run_vs_{base}", base, v, "all", agg=np.mean)
            # The paper's H = 100: P sends and P arrivals per H steps.
            inner = out[f"ratio/{v}/inner_steps_vs_{base}"]
            extra = num_fragments * sync / 100 / out[f"t/{base}"]
            out[f"ratio/{v}/h100_vs_{base}"] = 1 / (1 / inner + extra)
            # Its error is dominated by the inner-step ratio's.
            out[f"sem/{v}/h100_vs_{base}"] = out[f"sem/{v}/inner_steps_vs_{base}"]
    if "plain" in baselines and "data_parallel" in baselines:
        paired("data_parallel_vs_plain", "plain", "data_parallel", "all")
    return out


def _paired_cost(values: dict, rounds: list[int], variant: str, kind: str) -> float:
    """Median over rounds of (variant's `kind` step − the control's steps), minus the
    same for its inner-only steps; Data-Parallel (or the first baseline) is the
    control, so the load's drift between rounds cancels."""
    control = "data_parallel"

    def diffs(k: str) -> list[float]:
        return [
            np.mean(values[variant, k, r]) - np.mean(values[control, "all", r])
            for r in rounds
            if values[variant, k, r] and values[control, "all", r]
        ]

    d, base = diffs(kind), diffs("inner")
    return float(np.median(d) - np.median(base)) if d and base else float("nan")


def report(
    summaries: dict[str, dict[str, float]], info: dict[str, Any], sync_every: int
) -> str:
    """The wall- and CPU-clock summaries as Markdown tables."""
    wall, cpu = summaries["wall"], summaries["cpu"]
    tok = info["tokens_per_step"]
    lines = [
        "| program, steps | wall ms/step | CPU ms/step | tokens/s (wall) |",
        "|---|---|---|---|",
    ]
    for key in sorted(k for k in wall if k.startswith("t/")):
        name = key[2:].replace("/", ", ") + ("" if "/" in key[2:] else ", all")
        lines.append(
            f"| {name} | {wall[key] * 1e3:.1f} | {cpu[key] * 1e3:.1f} | "
            f"{tok / wall[key]:,.0f} |"
        )
    lines += ["", "| extra cost of a step | wall ms | CPU ms |", "|---|---|---|"]
    for key in sorted(k for k in wall if k.startswith("cost/")):
        lines.append(
            f"| {key[5:].replace('/', ', ')} | {wall[key] * 1e3:+.2f} | "
            f"{cpu[key] * 1e3:+.2f} |"
        )
    lines += [
        "",
        "| throughput ratio (baseline step time ÷ streaming step time) | wall ± s.e. "
        "| CPU ± s.e. | target |",
        "|---|---|---|---|",
    ]
    for key in (k for k in wall if k.startswith("ratio/")):
        name = key[6:]
        target = next((t for s, t in TARGETS.items() if name.endswith(s)), None)
        met = "" if target is None else f"≥ {target}"
        pretty = name.replace("as_run", f"as run (H = {sync_every})")
        pretty = pretty.replace("h100", "at H = 100 (amortized)")
        lines.append(
            f"| {pretty.replace('/', ', ')} | {wall[key]:.4f} ± "
            f"{wall['sem/' + name]:.4f} | {cpu[key]:.4f} ± {cpu['sem/' + name]:.4f} "
            f"| {met} |"
        )
    return "\n".join(lines)


TARGETS = {"vs_data_parallel": 0.97, "vs_plain": 0.95}
"""The issue's targets for the throughput ratios."""


def _kind(metrics: dict) -> str:
    if "sync/sent" not in metrics:
        return "inner"
    if np.asarray(metrics["sync/sent"]).any():
        return "send"
    if (
        np.asarray(metrics["sync/applied"]).any()
        or np.asarray(metrics["sync/merged"]).any()
    ):
        return "arrive"
    return "inner"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-s")
    parser.add_argument("--batch", type=int, default=16, help="global batch B")
    parser.add_argument("--sync-every", type=int, default=12, help="H (streaming)")
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--per-round", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=12, help="untimed steps, >= H")
    parser.add_argument(
        "--no-patch",
        dest="patched",
        action="store_false",
        help="skip the streaming+search_rounding variant",
    )
    parser.add_argument("--save", help="write the timed steps to this JSON file")
    parser.add_argument("--load", help="report the steps saved by --save (no timing)")
    args = parser.parse_args()
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        print(saved["machine"])
        records = [Record(**r) for r in saved["records"]]
        info, header = saved["info"], saved["header"]
        print(header)
        _print_report(records, info, saved["sync_every"])
        return
    print(_common.machine())
    variants, info = make_variants(
        model=args.model,
        global_batch=args.batch,
        sync_every=args.sync_every,
        patched=args.patched,
    )
    header = (
        f"model {args.model} ({info['num_params']:,} params, P = "
        f"{info['num_fragments']}), M = 2, B × L = {args.batch} × {info['seq_len']}, "
        f"H = {args.sync_every}, {args.rounds} rounds × {args.per_round} steps "
        "per program\n"
    )
    print(header)
    records = measure(
        variants, rounds=args.rounds, per_round=args.per_round, warmup=args.warmup
    )
    machine = _common.machine()
    if args.save:
        with open(args.save, "w") as f:
            json.dump(
                {
                    "machine": machine,
                    "header": header,
                    "info": info,
                    "sync_every": args.sync_every,
                    "records": [dataclasses.asdict(r) for r in records],
                },
                f,
            )
    _print_report(records, info, args.sync_every)
    print(f"\nat the end: {machine}")


def _print_report(records: list[Record], info: dict[str, Any], sync_every: int):
    summaries = {
        clock: summarize(records, num_fragments=info["num_fragments"], clock=clock)
        for clock in ("wall", "cpu")
    }
    print(report(summaries, info, sync_every))


if __name__ == "__main__":
    main()
