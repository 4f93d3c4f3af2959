"""The compression frontier: every recipe of the DiLoCo family on one model, one
budget and one tuning protocol (`notebooks/compression_frontier.py`).

A recipe is a preset and the changes that make it (`RECIPES`). Each is tuned by a
reduced form of the protocol of `sdiloco.paper.tuning`: `coordinate_search` on the
validation split, seed 0, of the inner learning rate (2x apart) and then the outer
learning rate, each from the tuned settings of the paper's final method at that size
and extended past an edge where the best sits there; the outer momentum, the batch and
the warmup keep the final method's tuned values (SparseLoCo's outer SGD has no
momentum). The recipes are tuned with M = 2 replicas; M = 4 reuses those values.

The x-axis of the frontier is read from the compiled wire (`wire_bits`): the bytes
of every fragment's packed message (`sdiloco.distributed.wire.Wire`, the layout the
mesh and the elastic exchanges send), traced for the model of the config.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.random as jr

from ..distributed.exchange import replica_keys
from ..distributed.wire import Wire
from ..lab import train
from ..lab.config import RunConfig, preset as make_preset
from . import experiments
from .tuning import Axis, Confirm, Search, coordinate_search, doubling, step_by


RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("streaming_overlap_fp4", {"method": {"quantizer": None}}),
    "bf16": ("streaming_overlap_fp4", {"method": {"quantizer": "bf16"}}),
    "E4M3": ("streaming_overlap_fp4", {"method": {"quantizer": "e4m3"}}),
    "E3M0 (paper)": ("streaming_overlap_fp4", {}),
    "E2M1": ("streaming_overlap_fp4", {"method": {"quantizer": "e2m1"}}),
    "int8 min-max": (
        "streaming_overlap_fp4",
        {"method": {"quantizer": None, "compressor": "int8mm"}},
    ),
    "2-bit + EF": (
        "streaming_overlap_fp4",
        {"method": {"quantizer": None, "compressor": "int2:row,ef"}},
    ),
    "SparseLoCo (top-2 % + 2-bit + EF)": (
        "sparseloco",
        {"method": {"compressor": "topk:0.02/64,int2,ef:0.9"}},
    ),
    "MuLoCo (Muon + 2-bit + EF)": ("muloco", {}),
    "E3M0 + Muon": ("streaming_overlap_fp4", {"inner": {"kind": "muon"}}),
    "fp32 + Muon": (
        "streaming_overlap_fp4",
        {"method": {"quantizer": None}, "inner": {"kind": "muon"}},
    ),
}
"""Recipe name → (preset, changes). Every recipe is Streaming DiLoCo with the paper's
overlap (τ = 1, α = 0.5) and fragments; only what is sent and the optimizers change.
The 2-bit recipes scale per row (`int2:row`): one scale per tensor zeroes most
entries (`config.muloco_preset`)."""

PAPER = "E3M0 (paper)"
"""The paper's point, marked on the plot."""

CHECK_MODEL = "tiny-xxs" if experiments.FAST else "tiny-s"
"""The size the `CHECKED` recipes are run again at (FAST mode: a smaller one, the
same code path in a third of the time)."""
CHECKED: tuple[str, ...] = (
    "E3M0 + Muon",
    "MuLoCo (Muon + 2-bit + EF)",
    "E4M3",
    "E3M0 (paper)",
)
"""The four recipes re-run at `CHECK_MODEL` to see whether the ranking holds with
size: the lowest mean gaps at M = 2 on `experiments.MODEL` among the recipes of the
first sweep (E3M0 and 2-bit + EF tie for fourth within a thousandth of a nat; the
paper's point is taken). "fp32 + Muon", added after it as the uncompressed reference
of the Muon recipes, is not among them."""


def axes(recipe: str, model: str) -> tuple[Axis, Axis]:
    """The two swept axes of `recipe`, each centred on its preset's tuned value."""
    base = make_preset(RECIPES[recipe][0], model=model, **RECIPES[recipe][1])
    lr = base.inner.lr
    inner = Axis("inner.lr", (lr / 2, lr, 2 * lr), doubling, max_extensions=2)
    outer_config = getattr(base.method, "outer")  # every recipe is DiLoCo-family
    o = outer_config.lr
    if outer_config.kind == "sgd":  # around 1: the EF sum replaces momentum
        outer = Axis("method.outer.lr", (o / 2, o, 1.5 * o), step_by(o / 2, o / 4))
    else:
        grid = (round(o - 0.2, 10), o, round(o + 0.2, 10))
        outer = Axis("method.outer.lr", grid, step_by(0.2, 0.1))
    return inner, outer


def tune(
    recipe: str,
    model: str,
    *,
    regime: experiments.Regime,
    num_replicas: int = 2,
    seeds: Sequence[int] = (0,),
    swept: Sequence[Axis] | None = None,
    confirm: Confirm | None = None,
) -> Search:
    """The reduced protocol for one recipe (module docstring), recorded and
    resumable like every run.

    Args:
        swept: the axes to search, in order; default `axes(recipe, model)`. An axis
            left out keeps the recipe's starting value (`tuned_config` reads it so).
        confirm: the noise rule (`tuning.CONFIRM`): a decision closer than the seed
            noise taken on more seeds.
    """
    name, changes = RECIPES[recipe]
    method = {**changes.get("method", {}), "num_replicas": num_replicas}
    base = make_preset(
        name, model=model, data={"validation": True}, **{**changes, "method": method}
    )
    swept = axes(recipe, model) if swept is None else swept
    return coordinate_search(
        regime.apply(base), swept, regime=regime, seeds=seeds, confirm=confirm
    )


def tuned_config(
    recipe: str,
    search: Search,
    *,
    model: str,
    regime: experiments.Regime,
    num_replicas: int = 2,
) -> RunConfig:
    """`recipe` at the values `search` chose, on the held-out split, with M replicas."""
    chosen = search.best_values(axes(recipe, model))
    return _config(recipe, chosen, model, regime, num_replicas)


def transferred_config(
    recipe: str,
    search: Search,
    *,
    model: str,
    regime: experiments.Regime,
    num_replicas: int = 2,
) -> RunConfig:
    """`recipe` at another size, with the tuning `search` did at `experiments.MODEL`
    carried over instead of repeated: the inner learning rate as the chosen multiple
    of the final method's tuned value (tuned per size), the outer learning rate as
    chosen (it is size-free in the tuned table). A check of a ranking, not a tuning."""
    name, changes = RECIPES[recipe]
    chosen = search.best_values(axes(recipe, experiments.MODEL))
    centre = make_preset(name, model=experiments.MODEL, **changes).inner.lr
    here = make_preset(name, model=model, **changes).inner.lr
    chosen = {**chosen, "inner.lr": here * chosen["inner.lr"] / centre}
    return _config(recipe, chosen, model, regime, num_replicas)


def _config(
    recipe: str,
    chosen: Mapping[str, float],
    model: str,
    regime: experiments.Regime,
    num_replicas: int,
) -> RunConfig:
    """`recipe` with the inner and outer learning rates of `chosen`, on the held-out
    split, with M replicas."""
    name, changes = RECIPES[recipe]
    method = {
        **changes.get("method", {}),
        "num_replicas": num_replicas,
        "outer": {"lr": chosen["method.outer.lr"]},
    }
    inner = {**changes.get("inner", {}), "lr": chosen["inner.lr"]}
    return experiments.setup(
        name,
        model=model,
        regime=regime,
        **{**changes, "method": method, "inner": inner},
    )


def baseline(num_replicas: int, *, model: str, regime: experiments.Regime) -> RunConfig:
    """Data-Parallel at its tuned settings with M replicas (the same global batch)."""
    return experiments.setup(
        "data_parallel",
        model=model,
        regime=regime,
        method={"num_replicas": num_replicas},
    )


def muon_axis(model: str) -> Axis:
    """The inner learning rate of Data-Parallel with Muon inside, 2x apart, centred
    on AdamW Data-Parallel's tuned value at `model`."""
    lr = make_preset("data_parallel", model=model).inner.lr
    return Axis("inner.lr", (lr / 2, lr, 2 * lr), doubling, max_extensions=2)


def tune_muon_baseline(
    model: str,
    *,
    regime: experiments.Regime,
    seeds: Sequence[int] = (0,),
    confirm: Confirm | None = None,
) -> Search:
    """Data-Parallel with Muon inside, its inner learning rate tuned by the recipes'
    protocol (validation split, seed 0, M = 2): the baseline the Muon recipes are
    read against as well, so that their gap is what the wire costs, not what Muon
    does inside."""
    base = make_preset(
        "data_parallel",
        model=model,
        data={"validation": True},
        inner={"kind": "muon"},
        method={"num_replicas": 2},
    )
    return coordinate_search(
        regime.apply(base),
        (muon_axis(model),),
        regime=regime,
        seeds=seeds,
        confirm=confirm,
    )


def muon_baseline(
    search: Search, num_replicas: int, *, model: str, regime: experiments.Regime
) -> RunConfig:
    """Data-Parallel with Muon inside at the inner learning rate `search` chose."""
    lr = search.best_values((muon_axis(model),))["inner.lr"]
    return experiments.setup(
        "data_parallel",
        model=model,
        regime=regime,
        method={"num_replicas": num_replicas},
        inner={"kind": "muon", "lr": lr},
    )


def wire_bits(config: RunConfig) -> float:
    """Bits per parameter per outer round of `config`, from the compiled wire.

    Every fragment is sent once per round; its message is what `Wire.encode` returns
    for one replica, traced (`jax.eval_shape`) for this model's parameters, with the
    exchange's keys. Without a compressor the values travel as raw float32.
    """
    run = train.build(config)
    spec = run.algorithm.spec
    params = eqx.filter(run.model, eqx.is_inexact_array)
    leaves = jax.tree.leaves(params)
    fragments = spec.fragments_of(params)
    deltas = [jax.ShapeDtypeStruct((1,) + x.shape, x.dtype) for x in leaves]
    keys = replica_keys(jr.key_data(jr.key(0)), len(leaves), 1)
    total = 0
    for p in range(fragments.num_fragments):
        wire = Wire(spec.compressor, fragments, deltas, keys, p)
        one = [jax.ShapeDtypeStruct(d.shape[1:], d.dtype) for d in deltas]
        message = jax.eval_shape(wire.encode, one, [k[0] for k in keys])
        total += message.shape[0]
    return 8 * total / sum(x.size for x in leaves)


def frontier(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """The recipes on the Pareto frontier of (bits, gap): no other recipe has fewer
    or equal bits and a lower gap (ordered by bits)."""
    names = sorted(points, key=lambda n: (points[n][0], points[n][1]))
    front, best = [], float("inf")
    for n in names:
        if points[n][1] < best:
            front.append(n)
            best = points[n][1]
    return front


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sdiloco.paper.frontier [--shard I N] [--replicas 2 4] [--check |
    --muon-baseline]`:
    train the frontier's runs in the order the notebook needs them, resumable (every
    run is a record): each recipe's tuning at M = 2, then its three seeds at each M;
    `--check`, the `CHECKED` recipes' three seeds at `CHECK_MODEL` (M = 2);
    `--muon-baseline`, Data-Parallel with Muon inside (tuned, three seeds per M). `--shard I
    N` takes every N-th recipe from the I-th, so that N processes share the work."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m sdiloco.paper.frontier")
    p.add_argument("--shard", type=int, nargs=2, default=(0, 1), metavar=("I", "N"))
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--model", default=experiments.MODEL)
    p.add_argument(
        "--check",
        action="store_true",
        help=f"train only the size check: {len(CHECKED)} recipes at {CHECK_MODEL}",
    )
    p.add_argument(
        "--muon-baseline",
        action="store_true",
        help="train only Data-Parallel with Muon inside: its tuning, then 3 seeds per M",
    )
    args = p.parse_args(argv)
    i, n = args.shard
    if not 0 <= i < n:
        p.error(f"--shard {i} {n}: need 0 <= I < N.")
    experiments.enable_compile_cache()
    regime = experiments.REGIME
    if args.muon_baseline:
        search = tune_muon_baseline(args.model, regime=regime)
        for m in args.replicas:
            _seeds(
                f"Data-Parallel (Muon) M={m}",
                muon_baseline(search, m, model=args.model, regime=regime),
            )
        return 0
    if args.check:
        for r in [r for j, r in enumerate(CHECKED) if j % n == i]:
            search = tune(r, experiments.MODEL, regime=regime)
            c = transferred_config(r, search, model=CHECK_MODEL, regime=regime)
            _seeds(f"{r} {CHECK_MODEL}", c)
        return 0
    mine = [r for j, r in enumerate(RECIPES) if j % n == i]
    searches: dict[str, Search] = {}
    for m in args.replicas:
        if i == 0:
            dp = baseline(m, model=args.model, regime=regime)
            for seed in experiments.SEEDS:
                experiments.run_one("Data-Parallel", dp, seed)
        for r in mine:
            if r not in searches:
                searches[r] = tune(r, args.model, regime=regime)
                print(r, "tuned:", searches[r].best_values(axes(r, args.model)))
            c = tuned_config(
                r, searches[r], model=args.model, regime=regime, num_replicas=m
            )
            _seeds(f"{r} M={m}", c)
    return 0


def _seeds(label: str, config: RunConfig) -> None:
    """Train (or read) `config` at every seed of the notebooks, a line each."""
    for seed in experiments.SEEDS:
        loss = experiments.run_one(label, config, seed).final()
        print(f"{label} seed {seed}: {loss:.4f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
