"""Checking the committed records by training them again (`python -m sdiloco.paper
--verify K`).

Which records: the figure command writes `paper_figures/records.json`, the record
keys each notebook read. `sample` takes one **headline** record (tiny-xs or larger)
and then one record per notebook in a shuffled order, each drawn from all of that
group's current records, the dearest as likely as the cheapest (tiny-s headline runs,
Muon and SparseLoCo recipes among them), until it has `k`; the seed rotates with the
commit, so successive CI runs check different records across the whole cost range.

How: a record made by code of this numerics (`provenance.is_current`) must come back
bitwise. A record within the budget (`BUDGET`, parameter-steps: about a tiny-xs
headline run) is trained whole and its evaluations compared, as many and each equal.
A dearer one is trained for its first steps that fit the budget (`prefix_steps`; the
schedule and the data are the whole run's) and every training-metric row and
evaluation it recorded up to there is compared: a prefix checks the code's numbers on
that run's configuration, not its last steps. A record of another
fingerprint (other code, or this code on another machine type) cannot be checked
bitwise; such a machine re-trains a headline cell instead (`verify_cell`): the
Streaming FP4 and Data-Parallel runs of one cell, every seed, whose new seed-paired
gap must lie inside the interval the records publish.
"""

import json
import pathlib
import random
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ..lab import objects, train
from ..lab.config import RunConfig
from . import experiments, provenance
from .plotting import git_commit


HEADLINE_MODELS: tuple[str, ...] = ("tiny-xs", "tiny-xs+", "tiny-s")
"""The model sizes of the headline runs (the smaller ones are for trends)."""

BUDGET: int = 1612 * 82_528
"""Parameter-steps one record's check may train (steps × parameters): about one
tiny-xs headline run (1,612 steps of 82,528 parameters, ~1 CPU-minute here)."""

TIMING_FIELDS: frozenset[str] = frozenset({"tokens_per_s"})
"""Row fields that measure the machine's speed, not the numbers: not compared."""


def index_path(out_dir: pathlib.Path) -> pathlib.Path:
    """Where the figure command writes the record keys each notebook read."""
    return out_dir / "records.json"


def commit_seed() -> int:
    """A sampling seed that changes with every commit (0 outside a checkout)."""
    commit = git_commit()
    try:
        return int(commit[:8], 16)
    except ValueError:
        return 0


def _load(records: pathlib.Path, key: str) -> tuple[RunConfig, dict] | None:
    path = records / f"{key}.json"
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    if not objects.recreatable(d["config"]):  # a user's object: never re-created,
        return None  # so never counted as reproducible
    return RunConfig.from_json(json.dumps(d["config"])), d


def _params(config: RunConfig) -> int:
    return config.model_config().num_params()


def prefix_steps(config: RunConfig, params: int, budget: int = BUDGET) -> int:
    """The steps of `config` a check trains: all of them if they fit `budget`
    parameter-steps, else the most whole logging periods that do (at least one)."""
    if config.steps * params <= budget:
        return config.steps
    periods = max(1, budget // (params * config.log_every))
    return min(config.steps, periods * config.log_every)


def sample(
    records: pathlib.Path, index: Mapping[str, Sequence[str]], k: int, seed: int
) -> list[tuple[str, str, RunConfig, dict]]:
    """Up to `k` current records as `(notebook, key, config, record)`: a headline
    record first (if one is current), then one per notebook (module docstring)."""
    rng = random.Random(seed)
    current: dict[str, list[tuple[str, RunConfig, dict]]] = {}
    for notebook in sorted(index):
        for key in sorted(set(index[notebook])):
            loaded = _load(records, key)
            if loaded and provenance.is_current(loaded[1]):
                current.setdefault(notebook, []).append((key, *loaded))
    headline = sorted(
        (key, nb, c, d)
        for nb, runs in current.items()
        for key, c, d in runs
        if c.model in HEADLINE_MODELS
    )
    chosen = []
    if headline:
        key, nb, c, d = rng.choice(headline)
        chosen.append((nb, key, c, d))
    notebooks = sorted(current)
    rng.shuffle(notebooks)
    for nb in notebooks:
        if len(chosen) >= k:
            break
        key, c, d = rng.choice(sorted(current[nb], key=lambda x: x[0]))
        if key not in {x[1] for x in chosen}:
            chosen.append((nb, key, c, d))
    return chosen[:k]


def compare(
    new: Sequence[dict], old: Sequence[dict], rows: tuple[list, list] = ([], [])
) -> dict[str, Any]:
    """Evaluation lists (and training-metric `rows`, new and recorded, timing fields
    left out) compared: `equal` (bitwise, same lengths), the largest relative gap of
    a held-out loss over the common evaluations, and `why` not."""
    gaps = [
        abs(a[m] - b[m]) / abs(b[m])
        for a, b in zip(new, old)
        for m in a
        if m.startswith("eval/") and m in b
    ]
    new_rows, old_rows = ([_text(r) for r in x] for x in rows)
    why = ""
    if len(new) != len(old):
        why = f"{len(new)} evaluations retrained vs {len(old)} recorded"
    elif [_text(e) for e in new] != [_text(e) for e in old]:
        why = "evaluations differ"
    elif len(new_rows) != len(old_rows):
        why = f"{len(new_rows)} metric rows retrained vs {len(old_rows)} recorded"
    elif new_rows != old_rows:
        first = next(i for i, (a, b) in enumerate(zip(new_rows, old_rows)) if a != b)
        why = f"training metrics differ from step {rows[0][first]['step']}"
    return {"equal": not why, "max_rel_gap": max(gaps, default=0.0), "why": why}


def _text(row: Mapping[str, Any]) -> str:
    """A row (or an evaluation) as canonical JSON, timing fields left out: equal
    texts are bitwise equal numbers, NaN (a diverged trial's) included."""
    kept = {k: v for k, v in row.items() if k not in TIMING_FIELDS}
    return json.dumps(kept, sort_keys=True)


def verify(
    records: pathlib.Path,
    index: Mapping[str, Sequence[str]],
    k: int,
    seed: int,
    budget: int = BUDGET,
) -> list[dict[str, Any]]:
    """Retrain the records `sample` picks, whole or their first `prefix_steps`
    within `budget`, and compare them bitwise (`compare`).

    Returns:
        One row per record: notebook, key, model, steps, the steps checked, the
        comparison, `passed`.
    """
    rows = []
    for notebook, key, config, d in sample(records, index, k, seed):
        checked = prefix_steps(config, _params(config), budget)
        with jax.numpy_dtype_promotion("standard"):
            history = train.run(config, progress=False, stop_after=checked)
        upto = [e for e in d["evals"] if e["step"] <= checked]
        recorded = [r for r in d["rows"] if r["step"] <= checked]
        result = compare(history.evals, upto, (history.rows, recorded))
        row = {"notebook": notebook, "key": key, "model": config.model}
        row |= {"steps": config.steps, "checked_steps": checked, **result}
        rows.append(row | {"passed": row["equal"]})
    return rows


def headline_cell(
    regime: experiments.Regime = experiments.REGIME,
) -> dict[str, RunConfig]:
    """The cell `verify_cell` re-trains by default: Streaming FP4 and Data-Parallel at
    tiny-xs, the standard budget, the held-out split (every headline table's row)."""
    return {
        "Data-Parallel": experiments.setup("data_parallel", regime=regime),
        "Streaming FP4": experiments.setup("streaming_overlap_fp4", regime=regime),
    }


def verify_cell(
    cell: Mapping[str, RunConfig] | None = None,
    seeds: Sequence[int] = experiments.SEEDS,
    records: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Re-train a cell (baseline first, then the method) at every seed, without
    reading or writing records, and check the new seed-paired gap against the one the
    records publish.

    Passes when the new mean gap lies inside the published 95 % interval.

    Raises:
        ValueError: if a run of the cell has no record (nothing is published).
    """
    cell = headline_cell() if cell is None else cell
    records = experiments.records_dir() if records is None else records
    (base_name, base), (name, method) = list(cell.items())
    published, new = {}, {}
    for label, config in ((base_name, base), (name, method)):
        published[label], new[label] = [], []
        for s in seeds:
            c = experiments.with_seed(config, s)
            loaded = _load(records, experiments.record_key(c))
            if loaded is None:
                raise ValueError(
                    f"verify_cell: no record of {label!r} seed {s} "
                    f"({experiments.record_key(c)}); nothing is published to check."
                )
            published[label].append(loaded[1]["evals"][-1]["eval/global"])
            with jax.numpy_dtype_promotion("standard"):
                new[label].append(train.run(c, progress=False).final_eval())
    before = experiments.paired_gap(published[base_name], published[name])
    after = experiments.paired_gap(new[base_name], new[name])
    inside = before["low"] <= after["mean"] <= before["high"]
    return {
        "cell": f"{name} vs {base_name} ({method.model})",
        "published": before,
        "retrained": after,
        "passed": bool(inside),
    }
