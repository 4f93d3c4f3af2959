"""Learning experiments for the paper-figure notebooks: runs over seeds, cached, summarised.

A notebook describes its comparison as named `RunConfig`s; `run_all` trains each over
the requested seeds (`with_seed` sets the model seed and the data order) and returns one
`Result` per (name, seed). Finished runs are cached on disk by the hash of their config
(`$SDILOCO_RUN_CACHE`, default `paper_figures/runs/` of the checkout, committed), so notebooks that share
a run (e.g. Table 5 and Table 6) train it once and a re-run only trains what changed.
FAST mode (`plotting.FAST`) never reads or writes the cache; its runs may be shared
between processes through a folder of their own (`FAST_RUNS`).

`setup` builds the standard run: a preset at its tuned settings, at a `Regime` budget
(tokens per parameter and outer rounds; 20 and 50 by default), evaluated on the
held-out split.

`summarize` reduces results to mean ± standard deviation over seeds (plus min and max),
which is what every learning table reports; `paired_gap` gives the seed-paired
difference of two methods with its 95 % t-interval and `gap_text` writes it as a
table cell (or the one-seed relative difference in FAST mode). `finals` returns a run
name's final losses with their seed ids (`Finals`), and `paired`, under both, matches
two such lists by seed id, not by position: a seed one side lacks fails loudly.
"""

import dataclasses
import hashlib
import json
import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..analysis import outer_gradient_cosine
from ..fragments import fragments_by_layer
from ..lab import train
from ..lab.config import PerBatch as PerBatch, Regime as Regime, RunConfig, preset
from ..lab.methods import StreamingConfig
from ..lab.model import preset as preset_model
from ..lab.train import enable_compile_cache as enable_compile_cache
from . import provenance
from .plotting import FAST, REPO_ROOT


MODEL: str = "tiny-xs"
"""The standard learning model (82,528 parameters), tuned by the protocol of
`sdiloco.paper.tuning` (`config.TUNED`)."""
REGIME: Regime = Regime(0.15, 2, evals=2, eval_windows=32) if FAST else Regime(20.0, 50)
"""The standard budget: the compute-optimal 20 tokens per parameter and 50 outer
rounds, the budget the presets were tuned at, every method scored on every held-out
window, each preset's tuned warmup (FAST: about 13 steps of tiny-xs, 2 rounds)."""
REGIME_PER_BATCH: Regime = (
    REGIME
    if FAST
    else Regime(20.0, 50, eval_windows=PerBatch(16), warmup_fraction=1 / 6)
)
"""The standard budget as the records made before the fixed evaluation set used it:
each run scored on 16 of its own batches of held-out windows, warmup a sixth of the
steps. Only the tuning protocol's own trials and its first headline
(`hyperparameter_sweep`) use it now, so that their records stay readable; their
tables say so."""
SEEDS: tuple[int, ...] = (0,) if FAST else (0, 1, 2)
"""The seeds of every headline comparison (read as seed-paired differences)."""


def setup(
    name: str, *, model: str = MODEL, regime: Regime = REGIME, **changes: Any
) -> RunConfig:
    """A preset at its tuned settings, `changes`, then the budget of `regime`.

    `config.preset(name, tuned=True, model=model)` (the tuning protocol's inner and
    outer learning rates, outer momentum and batch for that method and size, where
    it swept them), then `changes` (`inner`/`method`/`data` as dicts), then
    `regime.apply`, which sets the steps, H (unless `regime.rounds` is None: pass
    `sync_every` in `changes` with such a regime to fix H yourself), the warmup and
    the evaluations. Evaluation is on the held-out split.
    """
    config = preset(name, tuned=True, model=model)
    return regime.apply(config.replace(**changes) if changes else config)


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
_T975 += (2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
_T975 += (2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Student's t at 97.5 % (two-sided 95 %) with `df` degrees of freedom: the
    printed table to 30, then the Cornish-Fisher expansion about the normal's 1.96
    (within 1e-4 of the exact quantile there)."""
    if df < 1:
        raise ValueError(f"t975 needs df >= 1; got df={df}.")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_half_width(values: Sequence[float] | np.ndarray) -> float:
    """Half the width of the 95 % t-interval of the mean of `values` (0 for one)."""
    v = np.asarray(values, np.float64)
    if v.size < 2:
        return 0.0
    return float(t975(v.size - 1) * v.std(ddof=1) / np.sqrt(v.size))


def trend(
    x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray
) -> dict[str, float]:
    """The least-squares slope of `y` on `x` with its 95 % t-interval (n − 2 degrees
    of freedom), e.g. a seed-paired gap against log model size, one point per
    (size, seed): the residual spread then holds the seed noise and any curvature.

    Raises:
        ValueError: with fewer than three points or a constant `x` (no interval).
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size != y.size or x.size < 3 or np.ptp(x) == 0:
        raise ValueError(
            f"trend needs >= 3 points of equal length and a varying x; got "
            f"{x.size} x and {y.size} y values."
        )
    dx = x - x.mean()
    slope = float(dx @ (y - y.mean()) / (dx @ dx))
    residual = y - y.mean() - slope * dx
    se = math.sqrt(residual @ residual / (x.size - 2) / (dx @ dx))
    half = t975(x.size - 2) * se
    return {"slope": slope, "low": slope - half, "high": slope + half, "n": x.size}


def seed_slopes(
    x: Sequence[float] | np.ndarray, ys: Sequence[Sequence[float]] | np.ndarray
) -> dict[str, float]:
    """The slope of `y` on `x` fitted per seed (`ys[s]` over `x`), then the mean of the
    seeds' slopes with its 95 % t-interval (seeds − 1 degrees of freedom): for points
    that share a seed (the same model, data and baseline at every x), so the seeds,
    not the points, are the independent draws.

    Raises:
        ValueError: with fewer than two seeds or two distinct x values.
    """
    x, ys = np.asarray(x, np.float64), np.asarray(ys, np.float64)
    if ys.ndim != 2 or ys.shape[1] != x.size or len(ys) < 2 or np.ptp(x) < 1e-300:
        raise ValueError(
            f"seed_slopes needs [seeds >= 2, {x.size}] values over a varying x; got "
            f"shape {ys.shape}."
        )
    dx = x - x.mean()
    slopes = (ys - ys.mean(1, keepdims=True)) @ dx / (dx @ dx)
    half = t_half_width(slopes)
    mean = float(slopes.mean())
    return {"slope": mean, "low": mean - half, "high": mean + half, "n": len(slopes)}


def describe(values: Sequence[float]) -> dict[str, float]:
    """Mean, std (ddof=1; 0 for one value), min, max and n (what `mean_pm` reads)."""
    v = np.asarray(values, np.float64)
    return {
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
        "min": float(v.min()),
        "max": float(v.max()),
        "n": int(v.size),
    }


class Finals(list):
    """The final values of one name's runs, in seed order, with their seed ids.

    A list of floats (`np.asarray`, `describe`, indexing work as on any list) that
    also carries `seeds` (one id per value) and the `name` of the runs, so that
    `paired` (and `paired_gap`, `gap_text`) match two of them by seed id.
    """

    def __init__(self, values: Sequence[float], seeds: Sequence[int], name: str = ""):
        super().__init__(values)
        self.seeds = tuple(int(s) for s in seeds)
        self.name = name
        if len(self.seeds) != len(self):
            raise ValueError(
                f"Finals {name!r}: {len(self)} values but {len(self.seeds)} seeds."
            )
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"Finals {name!r}: a seed repeats in {list(self.seeds)}.")


def paired(
    base: Sequence[float], other: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """`base` and `other` as float64 arrays, one seed pair per position.

    Where both carry their seed ids (`Finals`, as `finals` returns them), the pairs
    are matched by seed id, in `base`'s seed order; so the order either side lists
    its seeds in does not matter. Otherwise (plain sequences, paired by how they were
    built) they pair by position.

    Raises:
        ValueError: if one side lacks a seed the other has (the message names both
            sides and the missing seed ids), or plain sequences differ in length.
    """
    if isinstance(base, Finals) and isinstance(other, Finals):
        missing = {
            (other.name, base.name): sorted(set(base.seeds) - set(other.seeds)),
            (base.name, other.name): sorted(set(other.seeds) - set(base.seeds)),
        }
        wrong = [
            f"{where!r} lacks seed(s) {seeds} that {there!r} has"
            for (where, there), seeds in missing.items()
            if seeds
        ]
        if wrong:
            raise ValueError(
                f"seed-paired {other.name!r} − {base.name!r}: " + "; ".join(wrong) + "."
            )
        at = dict(zip(other.seeds, other))
        values = [at[s] for s in base.seeds]
        return np.asarray(base, np.float64), np.asarray(values, np.float64)
    if len(base) != len(other):
        raise ValueError(
            f"seed pairs need equal lengths; got {len(base)} base and {len(other)} "
            "other values."
        )
    return np.asarray(base, np.float64), np.asarray(other, np.float64)


def paired_gap(base: Sequence[float], other: Sequence[float]) -> dict[str, float]:
    """Seed-paired `other − base`: mean, 95 % t-interval and the relative mean gap.

    The pairs are matched by seed id where both sides carry one (`paired`).

    Raises:
        ValueError: with fewer than two pairs (no interval), or sides that do not
            pair (`paired`).
    """
    b, o = paired(base, other)
    d = o - b
    if d.size < 2:
        raise ValueError(f"paired_gap needs >= 2 seed pairs; got {d.size}.")
    half = t_half_width(d)
    return {
        "mean": float(d.mean()),
        "low": float(d.mean() - half),
        "high": float(d.mean() + half),
        "relative": float(d.mean() / scale) if (scale := np.mean(b)) else math.nan,
        "n": int(d.size),
    }


def gap_text(base: Sequence[float], other: Sequence[float]) -> str:
    """Seed-paired `other − base` as one table cell.

    With two or more seed pairs, the relative mean gap and the 95 % t-interval of the
    differences in the loss's own units (`paired_gap`): `"+2.4 % [-0.012, +0.031]"`.
    With one pair (FAST mode) there is no interval: `"+2.4 % (one seed)"`. The pairs
    are matched by seed id where both sides carry one (`paired`).

    Raises:
        ValueError: if the sequences are empty, differ in length, or lack a seed the
            other side has (`paired`).
    """
    both = isinstance(base, Finals) and isinstance(other, Finals)
    if not len(base) or not len(other) or (len(base) != len(other) and not both):
        raise ValueError(
            f"gap_text needs equal, non-empty seed lists; got {len(base)} base and "
            f"{len(other)} other losses."
        )
    b, o = paired(base, other)  # by seed id where both carry one; raises if one lacks
    if b.size == 1:
        return f"{100 * (o[0] - b[0]) / b[0]:+.1f} % (one seed)"
    gap = paired_gap(base, other)
    return f"{100 * gap['relative']:+.1f} % [{gap['low']:+.3f}, {gap['high']:+.3f}]"


@dataclasses.dataclass
class Result:
    """One finished run: its name in the comparison, its seed and what it produced."""

    name: str
    seed: int
    config: RunConfig
    evals: list[dict]
    rows: list[dict]
    summary: dict
    extra: dict = dataclasses.field(default_factory=dict)
    """What a callback collected (recorded with the run)."""

    def final(self, metric: str = "eval/global") -> float:
        """The metric at the last evaluation."""
        return float(self.evals[-1][metric])


def with_seed(config: RunConfig, seed: int) -> RunConfig:
    """`config` with model seed and data order both set from `seed`."""
    return config.replace(seed=seed, data={"seed": seed})


def records_dir() -> pathlib.Path:
    """Where finished runs are recorded (`$SDILOCO_RUN_CACHE`, or the checkout's
    `paper_figures/runs/`, committed with the artifacts)."""
    return pathlib.Path(
        os.environ.get("SDILOCO_RUN_CACHE", REPO_ROOT / "paper_figures" / "runs")
    )


def record_key(config: RunConfig) -> str:
    """The record's name: a hash of the config's JSON (its `name` left out), so a
    record is found by what was trained, whichever notebook asks."""
    text = config.replace(name="").to_json()
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def retrain(record: Mapping[str, Any] | None = None) -> bool:
    """Whether to train a run again over its `record` (`SDILOCO_RETRAIN`): `1`
    trains every run again; `unstamped` only those whose record is not both current
    (`provenance.is_current`: this code's numerics on this machine type) and fully
    stamped (`provenance.is_stamped`), so a machine re-stamps what it can vouch
    for and leaves the rest (resumable: what it re-stamped is skipped next time)."""
    if restamping():
        return record is None or not (
            provenance.is_current(record) and provenance.is_stamped(record)
        )
    return os.environ.get("SDILOCO_RETRAIN", "0") not in ("", "0")


def restamping() -> bool:
    """Whether this process only re-stamps records (`--restamp`,
    `SDILOCO_RETRAIN=unstamped`): it trains again what it cannot vouch for and
    changes no choice made from them (`tuning.save_tuned` refuses to)."""
    return os.environ.get("SDILOCO_RETRAIN", "0") == "unstamped"


def run_one(
    name: str,
    config: RunConfig,
    seed: int,
    *,
    callback_factory: Callable[[Any], tuple[Callable, Callable[[], dict]]]
    | None = None,
    progress: bool = False,
) -> Result:
    """Train `config` with `seed` (or read its record) and return its `Result`.

    A finished run is recorded as `records_dir()/<record_key>.json` (config, evals,
    history rows, summary, and the `code` that made it: `provenance.code()`),
    written atomically; a later call reads it instead of
    training, unless `retrain()`. FAST mode neither reads nor writes records; it
    keeps its finished runs in memory for the process instead (a notebook that asks
    twice for one run trains it once), and in `$SDILOCO_FAST_RUNS` where that is set
    (`FAST_RUNS`: the notebooks of one FAST session train a run they share once).

    Args:
        callback_factory: `factory(run) -> (callback, collect)`: `callback` goes to
            `train.run`, `collect()` returns what it gathered (JSON-serialisable;
            `Result.extra`). Such a run is recorded under its own key (the config's
            and the factory's name), with what it collected.
    """
    c = with_seed(config, seed)
    key = record_key(c)
    if callback_factory is not None:
        key = f"{key}-{callback_factory.__name__}"
    path = records_dir() / f"{key}.json"
    if FAST and (d := _fast_run(key)) is not None:
        return Result(name, seed, c, d["evals"], d["rows"], d["summary"], d["extra"])
    old = json.loads(path.read_text()) if not FAST and path.exists() else None
    if old is not None and not retrain(old):
        d = old
        _log_run(key, False, d["summary"], stale=not provenance.is_current(d))
        extra = d.get("extra", {})
        return Result(name, seed, c, d["evals"], d["rows"], d["summary"], extra)
    callback, collect = None, dict
    if callback_factory is not None:
        callback, collect = callback_factory(train.build(c))
    h = train.run(c, progress=progress, callback=callback)
    extra = collect()
    d = {**h.to_dict(), "extra": extra} if extra else h.to_dict()
    if FAST:
        _keep_fast_run(key, {**d, "extra": extra})
    else:
        record = {**d, "code": provenance.code()}
        if old is not None:  # what training again changed of the record it replaces
            record["replaced"] = _replaced(old, h.evals)
        _write_whole(path, record)
    _log_run(key, True, h.summary)
    return Result(name, seed, c, h.evals, h.rows, h.summary, extra)


RUN_LOG = "SDILOCO_RUN_LOG"
"""Environment variable: a file to which `run_one` appends one JSON line per run it
returns (`key`, whether it `trained` now, the run's training `wall_s`, whether its
record is `stale`: made by code of another numerics fingerprint, `provenance`);
`sdiloco.paper` sets it to learn how long a notebook's runs took to train."""


def _log_run(
    key: str, trained: bool, summary: Mapping[str, Any], stale: bool = False
) -> None:
    path = os.environ.get(RUN_LOG)
    if path:
        line = {"key": key, "trained": trained, "wall_s": summary.get("wall_s")}
        line["stale"] = stale
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _replaced(old: Mapping[str, Any], evals: Sequence[Mapping[str, Any]]) -> dict:
    """A new record's note of the one it replaced: who made that (fingerprint, CPU
    model when it says), its final evaluation, and whether every evaluation came
    back bitwise (the spread across machine types, readable from the records)."""
    code = old.get("code", {})
    before = list(old.get("evals", []))
    return {
        "fingerprint": code.get("fingerprint"),
        "cpu": code.get("machine", {}).get("cpu"),
        "final_eval": float(before[-1]["eval/global"]) if before else None,
        "bitwise": before == [dict(e) for e in evals],
    }


_FAST_RUNS: dict[str, dict[str, Any]] = {}
"""FAST mode's finished runs in this process, by record key."""

FAST_RUNS = "SDILOCO_FAST_RUNS"
"""Environment variable: a folder where FAST mode keeps its finished runs for other
processes (`<record key>.json`, as a record less its `code`), so that the notebooks
of one FAST session (the notebook tests, both pytest workers; `python -m
sdiloco.paper --fast`) train a run they share once: a FAST Data-Parallel or
Streaming FP4 run at the standard budget is in up to ten notebooks. Unset, each
process trains its own. Never the records' folder: nothing in it is a record."""


def _shared_fast_run(key: str) -> pathlib.Path | None:
    """Where FAST run `key` is kept for other processes (None: `FAST_RUNS` unset)."""
    folder = os.environ.get(FAST_RUNS)
    return pathlib.Path(folder) / f"{key}.json" if folder else None


def _fast_run(key: str) -> dict[str, Any] | None:
    """A FAST run finished in this process or, in `$SDILOCO_FAST_RUNS`, in another."""
    path = _shared_fast_run(key)
    if key not in _FAST_RUNS and path is not None and path.exists():
        _FAST_RUNS[key] = json.loads(path.read_text())
    return _FAST_RUNS.get(key)


def _keep_fast_run(key: str, d: dict[str, Any]) -> None:
    _FAST_RUNS[key] = d
    if (path := _shared_fast_run(key)) is not None:
        _write_whole(path, d)


def _write_whole(path: pathlib.Path, d: Mapping[str, Any]) -> None:
    """`d` as JSON at `path`, never partial: this process's own temporary file, then
    a rename (two processes that finish one run at once, re-stamp shards beside a
    notebook, each write theirs whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(d, separators=(",", ":")))
    tmp.replace(path)


def run_all(
    configs: Mapping[str, RunConfig],
    seeds: Sequence[int] | Mapping[str, Sequence[int]] = (0,),
    **kwargs: Any,
) -> list[Result]:
    """Train every named config for every seed (seeds may differ per name)."""
    enable_compile_cache()
    out = []
    for name, config in configs.items():
        for seed in seeds[name] if isinstance(seeds, Mapping) else seeds:
            out.append(run_one(name, config, seed, **kwargs))
    return out


def summarize(
    results: Sequence[Result], metric: str = "eval/global"
) -> dict[str, dict[str, float]]:
    """Per name: mean, std (ddof=1; 0 for one seed), min, max and n of `metric`."""
    by_name: dict[str, list[float]] = {}
    for r in results:
        by_name.setdefault(r.name, []).append(r.final(metric))
    return {name: describe(values) for name, values in by_name.items()}


def finals(results: Sequence[Result], name: str, metric: str = "eval/global") -> Finals:
    """The final `metric` of every run named `name`, in seed order, with the seed ids
    (`Finals`: `paired_gap` and `gap_text` pair two of them by seed id).

    Raises:
        ValueError: if no result has that name, or one seed has two runs.
    """
    runs = sorted((r for r in results if r.name == name), key=lambda r: r.seed)
    if not runs:
        raise ValueError(f"no results named {name!r}.")
    return Finals([r.final(metric) for r in runs], [r.seed for r in runs], name)


def mean_pm(stats: Mapping[str, float], digits: int = 3) -> str:
    """`"2.345 ± 0.012"` (or just the mean for one seed)."""
    if stats["n"] > 1:
        return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"
    return f"{stats['mean']:.{digits}f}"


def curve(
    results: Sequence[Result], name: str, metric: str = "eval/global"
) -> tuple[np.ndarray, np.ndarray]:
    """Steps `[T]` and values `[seeds, T]` of an eval metric over training for `name`."""
    runs = [r for r in results if r.name == name]
    if not runs:
        raise ValueError(f"no results named {name!r}.")
    steps = np.asarray([e["step"] for e in runs[0].evals])
    values = np.asarray([[e[metric] for e in r.evals] for r in runs], np.float64)
    return steps, values


def bits_per_fragment(config: RunConfig) -> list[int]:
    """Bits one replica sends to sync each fragment once (exact Python ints).

    The algorithm's own accounting (`Algorithm.bits_per_fragment`), so scales, indices
    and seeds of the compressor are included.
    """
    r = train.build(config)
    return [int(b) for b in r.algorithm.bits_per_fragment(r.model)]


def bits_per_param_per_sync(config: RunConfig) -> float:
    """Bits one replica sends per parameter to sync every fragment once (float32: 32)."""
    num_params = preset_model(config.model).num_params()
    return sum(bits_per_fragment(config)) / num_params


def bits_per_byte(nats: float) -> float:
    """Nats per byte (the corpus is byte-level) to bits per byte."""
    return nats / math.log(2)


def cosine_callback(run: train.Run) -> tuple[Callable, Callable[[], dict]]:
    """A `run_one` callback factory recording the replicas' outer-gradient cosine.

    At every step that sends a fragment it records, for that fragment, the mean pairwise
    cosine similarity of the replicas' Δ (`analysis.outer_gradient_cosine`) and the same
    per transformer layer of the fragment. Needs τ >= 1 (see `analysis`).

    Returns:
        `(callback, collect)`; `collect()` gives `{"fragment": [(step, p, cos)],
        "layer": [(step, layer, cos)]}` (layers 0-based; fragment 0 is the non-block
        parameters).
    """
    method = run.config.method
    if not isinstance(method, StreamingConfig):
        raise ValueError(f"cosine_callback needs a Streaming run; got {method.kind!r}.")
    if min(np.atleast_1d(method.overlap)) < 1:
        raise ValueError(
            f"cosine_callback needs overlap >= 1; got overlap={method.overlap!r}."
        )
    frags = method.fragments(run.model)
    per_layer = fragments_by_layer(
        run.model,
        blocks=lambda m: m.blocks,
        layers_per_fragment=1,
        pattern="sequential",
    )
    layer_of = next(lab for lab in frags.labels if lab.ndim == 1)  # fragment per layer
    out: dict[str, list] = {"fragment": [], "layer": []}

    def callback(step: int, state: Any, metrics: dict) -> None:
        sent = np.asarray(metrics["sync/sent"]).reshape(-1)
        if not sent.any():
            return
        cos_f = np.asarray(outer_gradient_cosine(state, frags))
        cos_l = np.asarray(outer_gradient_cosine(state, per_layer))
        for p in np.flatnonzero(sent):
            out["fragment"].append((step, int(p), float(cos_f[p])))
            for layer in np.flatnonzero(layer_of == p):
                out["layer"].append((step, int(layer), float(cos_l[layer + 1])))

    return callback, lambda: out


CALLBACKS: dict[str, Callable[[Any], tuple[Callable, Callable[[], dict]]]] = {
    "cosine_callback": cosine_callback,
}
"""The callback factories a record's key can name (`<config key>-<factory name>`)."""


def restamp_record(key: str) -> bool:
    """Train the record `key` again from the config it holds, as a notebook's
    `run_one` would, if `retrain` says so (under `--restamp`: this machine cannot
    vouch for it). Returns whether it trained. Reading the record first, a record
    another process has re-stamped meanwhile is left alone.

    Raises:
        ValueError: no record `key`, a callback it names that is not in `CALLBACKS`,
            or a config that does not hash to its key.
    """
    path = records_dir() / f"{key}.json"
    if not path.exists():
        raise ValueError(f"record {key!r}: no {path}.")
    record = json.loads(path.read_text())
    if not retrain(record):
        return False
    config = RunConfig.from_json(json.dumps(record["config"]))
    base, _, callback = key.partition("-")
    if callback and callback not in CALLBACKS:
        raise ValueError(
            f"record {key!r} names callback {callback!r}; allowed: {sorted(CALLBACKS)}."
        )
    if record_key(config) != base:
        raise ValueError(
            f"record {key!r}: its config hashes to {record_key(config)!r}, not to its "
            "name; it cannot be trained again from it."
        )
    factory = CALLBACKS[callback] if callback else None
    run_one(config.name or key, config, config.seed, callback_factory=factory)
    return True
