"""Tuning every method by one protocol, at a budget where the comparison means something.

The paper takes its hyper-parameters from the Scaling Laws for DiLoCo study
(docs/paper.md §1.13.3), which tunes the inner learning rate and the batch per method
and sweeps the outer learning rate. We tune each method (Data-Parallel, DiLoCo,
Streaming DiLoCo with overlapped FP4) the same way:

1. `regime` fixes the budget: tokens per parameter (20 is Chinchilla-optimal) and, for
   the DiLoCo family, the number of outer rounds (H = steps / rounds), so that a change
   of batch keeps the tokens and the rounds and only changes the steps;
2. `coordinate_search` sweeps one `Axis` at a time (the inner learning rate, 2x apart;
   the outer learning rate; the global batch), each with the others at their best so
   far, and extends an axis past its edge when the best value sits there;
3. every run evaluates on the **validation** split (`DataConfig.validation`), never on
   the held-out split the tables report.

A trial is an ordinary recorded run (`experiments.run_one`), so a sweep resumes where
it stopped and its records are committed with the artifacts.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..lab.config import TUNED, RunConfig, preset as make_preset
from ..lab.methods import DiLoCoConfig, StreamingConfig
from . import experiments

# Re-exported: the protocol's budget and its statistic live with the experiments.
from .experiments import Regime as Regime, paired_gap as paired_gap


@dataclasses.dataclass(frozen=True)
class Axis:
    """One hyper-parameter to sweep.

    Attributes:
        field: a dotted path into `RunConfig` (e.g. "inner.lr", "method.outer.lr",
            "data.global_batch_size").
        values: the initial grid, in increasing order.
        extend: `extend(value, direction) -> value` beyond an edge (direction -1 below
            the smallest, +1 above the largest); None keeps the grid fixed.
        max_extensions: how many values may be added past the edges in all.
    """

    field: str
    values: tuple[Any, ...]
    extend: Callable[[Any, int], Any] | None = None
    max_extensions: int = 2

    def __post_init__(self):
        if len(self.values) < 2:
            raise ValueError(
                f"Axis.values={self.values!r} for {self.field!r}; need >= 2 values."
            )
        if list(self.values) != sorted(self.values):
            raise ValueError(
                f"Axis.values={self.values!r} for {self.field!r}; must be increasing."
            )


def doubling(value: Any, direction: int) -> Any:
    """The next value of a 2x-apart grid, of the value's type (a learning rate, a
    batch size)."""
    return type(value)(value * 2.0**direction)


def step_by(delta: float, low: float) -> Callable[[float, int], float]:
    """`extend` adding `delta` per step, never below `low` (e.g. the outer lr)."""

    def extend(value: float, direction: int) -> float:
        return max(low, round(value + direction * delta, 10))

    return extend


@dataclasses.dataclass
class Trial:
    """One point of a sweep: the axis, its value, and the loss over seeds.

    `losses` are in `seeds` order: the search's own seeds first, then, for a value
    the noise rule confirmed (`Confirm`), its extra seeds."""

    axis: str
    value: Any
    config: RunConfig
    losses: list[float]
    seeds: tuple[int, ...] = (0,)

    @property
    def mean(self) -> float:
        return float(np.mean(self.losses))


@dataclasses.dataclass
class Search:
    """What `coordinate_search` found: the best config and every trial, in order.

    Attributes:
        best: the config at the chosen value of every axis.
        trials: every trained trial, in order.
        infeasible: `(field, value, reason)` of each value the budget cannot train
            (e.g. a batch so large that the rounds leave H < 2); never chosen.
        kept: `(field, value kept, best value, relative gap)` of each decision where
            the tie rule kept a value nearer the published one than the best trial
            (`coordinate_search`'s `published`); empty when every choice is the best.
        confirmed: one `Confirmation` per decision the noise rule (`Confirm`) took
            to more seeds, in order; empty without the rule.
    """

    best: RunConfig
    trials: list[Trial]
    infeasible: list[tuple[str, Any, str]] = dataclasses.field(default_factory=list)
    kept: list[tuple[str, Any, Any, float]] = dataclasses.field(default_factory=list)
    confirmed: list["Confirmation"] = dataclasses.field(default_factory=list)

    def best_values(self, axes: Sequence[Axis]) -> dict[str, Any]:
        """The chosen value of each axis."""
        return {a.field: get_field(self.best, a.field) for a in axes}


@dataclasses.dataclass(frozen=True)
class Confirm:
    """The noise rule: a decision whose best trials are closer than the seed noise is
    taken on more seeds.

    Once an axis' values are trained on the search's seeds, every value whose loss
    there is within `noise` (relative) of the best is a contender. Where there are
    two or more, each contender is trained on `seeds` as well, and the axis is
    decided among the contenders by the mean over all their seeds: the same seeds
    for every contender, so the comparison is paired by seed. A value further than
    `noise` from the best is not trained again. With a published choice the tie
    rule then applies to those means, with `tie` in place of the search's own (a
    mean over more seeds moves less with another machine's arithmetic).

    Attributes:
        noise: the relative seed noise of a one-seed comparison (`NOISE`), >= 0.
        seeds: the extra seeds, at least one, none of them among the search's own.
        tie: the tie rule's relative tolerance for a confirmed decision, >= 0.
    """

    noise: float
    seeds: tuple[int, ...]
    tie: float = 0.0

    def __post_init__(self):
        for name in ("noise", "tie"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"Confirm.{name}={value!r}; must be a finite number >= 0."
                )
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(
                f"Confirm.seeds={self.seeds!r}; need one or more distinct seeds."
            )


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """One decision the noise rule (`Confirm`) took to more seeds.

    Attributes:
        field: the axis.
        contenders: each contender's value → its losses, the search's seeds first.
        first: the value the search's own seeds alone made best.
        chosen: the value decided on every seed (after the tie rule, if any).
    """

    field: str
    contenders: dict[Any, list[float]]
    first: Any
    chosen: Any


def coordinate_search(
    base: RunConfig,
    axes: Sequence[Axis],
    *,
    regime: Regime,
    seeds: Sequence[int] = (0,),
    metric: str = "eval/global",
    train: Callable[[str, RunConfig, int], float] | None = None,
    published: Mapping[str, Any] | None = None,
    tie: float = 0.0,
    confirm: Confirm | None = None,
) -> Search:
    """Sweep each axis in turn at the best values so far; extend past an edge.

    A value the budget cannot train (`Regime.apply` refuses it, e.g. a batch that
    leaves H < 2) is skipped and listed in `Search.infeasible`.

    **The tie rule.** With `published` choices (a sweep run again, e.g. on another
    machine type, whose arithmetic moves every loss by a hair), each decision takes,
    among the values whose loss is within `tie` (relative) of the best, the one
    nearest the published value (on a log scale), not the best itself. So a search
    whose losses all move by less than `tie / (2 + tie)` retraces the published path
    exactly (the same trials, the same choices: each value the first search chose is
    still within `tie` of the best, and no other is nearer the published one; an edge
    that was extended towards it still is), while a gap larger than `tie` still
    moves the choice. Without `published` (or at `tie=0`, up to exact ties) each
    decision is the best trial.

    **The noise rule.** With `confirm`, a decision whose contenders are closer than
    the seed noise is taken on more seeds (`Confirm`); `Search.confirmed` lists
    each such decision.

    Args:
        base: the starting config (a preset at some model size).
        axes: the hyper-parameters, swept in this order.
        regime: the budget every trial is trained at (applied after each change, so
            a batch change keeps tokens and rounds).
        seeds: the seeds of every trial (the loss is their mean).
        metric: the final evaluation to minimise.
        train: `train(name, config, seed) -> loss`; default `experiments.run_one`
            (recorded, resumable) reading `metric`.
        published: field → the value a published search chose (`config.TUNED`);
            fields it lacks are decided by the best trial alone.
        tie: the relative loss gap within which a value nearer the published one is
            kept over the best (`TIE` in `tune`); >= 0.
        confirm: the noise rule (`CONFIRM` in `tune`); None decides on `seeds` alone.

    Returns:
        The `Search`.

    Raises:
        ValueError: if the base config does not evaluate on the validation split,
            `tie` is negative or not finite, `confirm` shares a seed with `seeds`,
            or no value of an axis can be trained at the budget.
    """
    _check_search(base, tie, seeds, confirm)

    def recorded(name: str, config: RunConfig, seed: int) -> float:
        return experiments.run_one(name, config, seed).final(metric)

    train_fn = recorded if train is None else train

    current, trials, infeasible = base, [], []
    losses_of: dict[str, dict[int, float]] = {}  # config → seed → loss

    def trial(axis: Axis, value: Any, extra: Sequence[int] = ()) -> Trial:
        changed = set_field(current, axis.field, value)
        want = (*seeds, *extra)
        try:
            config = regime.apply(changed)
        except ValueError as e:  # the budget cannot train it (e.g. H < 2): skip
            infeasible.append((axis.field, value, str(e)))
            return Trial(axis.field, value, changed, [math.inf] * len(want), want)
        have = losses_of.setdefault(config.to_json(), {})
        for s in want:
            if s not in have:
                have[s] = train_fn(f"{axis.field}={value}", config, s)
        t = Trial(axis.field, value, config, [have[s] for s in want], want)
        _record(trials, t, replace=bool(extra))
        return t

    published = published or {}
    kept: list[tuple[str, Any, Any, float]] = []
    confirmed: list[Confirmation] = []
    for axis in axes:
        try:
            best, low, gap, confirmation = _sweep(
                axis, trial, published.get(axis.field), tie, confirm
            )
        except ValueError as e:
            raise ValueError(f"{e} at {regime!r}: {infeasible[-1][2]}") from None
        if best != low:  # the tie rule kept another value than the best
            kept.append((axis.field, best, low, gap))
        if confirmation is not None:
            confirmed.append(confirmation)
        current = regime.apply(set_field(current, axis.field, best))
    return Search(current, trials, infeasible, kept, confirmed)


def _record(trials: list[Trial], t: Trial, *, replace: bool) -> None:
    """Add a trial to a search's list; a confirmed one (`replace`) takes the place
    of its axis and value's latest entry, which it extends by the extra seeds."""
    if not replace:
        trials.append(t)
        return
    same = [i for i, u in enumerate(trials) if (u.axis, u.value) == (t.axis, t.value)]
    trials[same[-1]] = t


Trainer = Callable[..., Trial]
"""`trial(axis, value, extra_seeds=()) -> Trial` inside `coordinate_search`."""


def _sweep(
    axis: Axis, trial: Trainer, target: Any, tie: float, confirm: Confirm | None
) -> tuple[Any, Any, float, Confirmation | None]:
    """One axis of `coordinate_search`: its values, extended past an edge while the
    choice sits there; returns the value kept, the best value, how far the kept
    value's loss is above the best's (relative), and the noise rule's confirmation
    (None where it did not apply).

    Every decision compares the values on the same seeds: the search's own (a
    confirmed value's extra seeds left out), or, where the noise rule applies, every
    seed of its contenders."""
    values, extensions = list(axis.values), 0
    done = {v: trial(axis, v) for v in values}
    while True:
        among, confirmation, decide_tie = values, None, tie
        score = {v: done[v].mean for v in values}
        if confirm is not None:
            among = _confirm(axis, values, done, trial, confirm)
            score = {v: _first_mean(done[v], confirm) for v in values}
            if among is not values:
                decide_tie = confirm.tie
                first = min(values, key=score.__getitem__)
                score = {v: done[v].mean for v in among}
        best, low = _pick(among, score, target, decide_tie)
        if among is not values:
            contenders = {v: done[v].losses for v in among}
            confirmation = Confirmation(axis.field, contenders, first, best)
        if math.isinf(score[low]):
            raise ValueError(f"no value of {axis.field!r} in {values} can be trained")
        gap = (score[best] - score[low]) / abs(score[low])
        edge = -1 if best == values[0] else (1 if best == values[-1] else 0)
        if not edge or axis.extend is None or extensions >= axis.max_extensions:
            return best, low, gap, confirmation
        new = axis.extend(best, edge)
        if new in done:
            return best, low, gap, confirmation
        values = sorted(values + [new])
        done[new] = trial(axis, new)
        extensions += 1


def _first_mean(t: Trial, confirm: Confirm) -> float:
    """A trial's mean loss on the search's own seeds (a confirmed trial's extra seeds
    left out), so that every value of an axis is compared on the same seeds."""
    return float(
        np.mean([x for s, x in zip(t.seeds, t.losses) if s not in confirm.seeds])
    )


def _confirm(
    axis: Axis,
    values: list[Any],
    done: dict[Any, Trial],
    trial: Trainer,
    confirm: Confirm,
) -> list[Any]:
    """The noise rule on one axis: the contenders (within `confirm.noise` of the best
    on the search's seeds), each trained on the extra seeds where there are two or
    more (`done` updated); returns the values the decision is among (`values`
    itself where the rule does not apply)."""
    first = {v: _first_mean(done[v], confirm) for v in values}
    low = min(first.values())
    if not math.isfinite(low):
        return values
    contenders = [v for v in values if first[v] <= low + confirm.noise * abs(low)]
    if len(contenders) < 2:
        return values
    for v in contenders:
        done[v] = trial(axis, v, confirm.seeds)
    return contenders


def _pick(
    values: list[Any], score: Mapping[Any, float], target: Any, tie: float
) -> tuple[Any, Any]:
    """An axis' decision and its best value by `score` (each value's loss): the
    decision is the best, or, with a published `target`, the value nearest it among
    those within `tie` of the best (`coordinate_search`)."""
    best = min(values, key=score.__getitem__)
    if target is None:
        return best, best
    low = score[best]
    near = [v for v in values if score[v] <= low + tie * abs(low)]
    return min(near, key=lambda v: (_distance(v, target), score[v])), best


def _check_search(
    base: RunConfig, tie: float, seeds: Sequence[int], confirm: Confirm | None
) -> None:
    """`coordinate_search`'s bad input, before any trial."""
    if not (math.isfinite(tie) and tie >= 0):
        raise ValueError(f"tie={tie!r}; must be a finite number >= 0.")
    if not seeds:
        raise ValueError(f"seeds={tuple(seeds)!r}; need at least one seed.")
    if confirm is not None and set(confirm.seeds) & set(seeds):
        raise ValueError(
            f"Confirm.seeds={confirm.seeds!r} shares seeds with seeds={tuple(seeds)!r}; "
            "the noise rule's seeds must be extra ones."
        )
    if not base.data.validation:
        raise ValueError(
            "DataConfig.validation=False in the base config; tuning must evaluate on "
            "the validation split, not on the held-out split the tables report."
        )


def _distance(value: Any, target: Any) -> float:
    """How far an axis value is from a published one: the log ratio for positive
    numbers (the grids are geometric or nearly so), else the difference."""
    if value > 0 and target > 0:
        return abs(math.log(value / target))
    return abs(value - target)


PRESETS: dict[str, str] = {
    "Data-Parallel": "data_parallel",
    "DiLoCo": "diloco",
    "Streaming FP4": "streaming_overlap_fp4",
}
"""The methods the protocol tunes, by their name in tables → preset name."""


def standard_axes(method_kind: str) -> tuple[Axis, ...]:
    """The protocol's axes for a method kind, in the order they are swept.

    The inner learning rate on a 2x grid; for the DiLoCo family the outer learning
    rate over {0.2, ..., 1.0} and the outer momentum (the small-H collapse of DiLoCo
    with the paper's momentum 0.9 is the momentum's); then the global batch. Edges
    extend (the inner lr up to four times, the outer lr and the batch twice).
    """
    inner = Axis("inner.lr", (1.5e-3, 3e-3, 6e-3, 1.2e-2), doubling, max_extensions=4)
    batch = Axis("data.global_batch_size", (16, 32, 64), doubling, max_extensions=2)
    if method_kind == "data_parallel":
        return (inner, batch)
    outer = Axis("method.outer.lr", (0.2, 0.4, 0.6, 0.8, 1.0), step_by(0.2, 0.1))
    momentum = Axis("method.outer.momentum", (0.5, 0.8, 0.9, 0.95))
    return (inner, outer, momentum, batch)


def fraction_step(value: float, direction: int) -> float:
    """`extend` for a fraction in (0, 1): half of it below, halfway to 1 above."""
    return value / 2 if direction < 0 else (1 + value) / 2


WARMUP: Axis = Axis(
    "inner.warmup_fraction", (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2), fraction_step
)
"""The schedule's axis: the warmup as a fraction of the steps, 2x apart, extended
past its edges (twice at most: 1/2 → 3/4 → 7/8)."""


TIE: float = 0.01
"""The protocol's tie rule (`coordinate_search`'s `tie`): a sweep run again keeps a
published choice while it is within 1 % of the best trial of its axis. A trial is one
seed, and seeds alone spread these losses by 0.1-1.5 %, so a gap under 1 % does not
rank two values; the arithmetic of another machine type moves a final loss by a
median 0.17 % (90 % of re-trained records within 0.54 %, `docs/decisions.md`), enough
to reorder the many near-ties of a sweep and, with them, the path of the trials after
them. With the rule a sweep re-trained elsewhere retraces the published path as long
as no loss moves by more than 0.5 %; a larger gap still moves a choice."""


NOISE: float = 0.006
"""The seed noise of one tuning comparison: the standard deviation, over seeds, of
the relative gap between two trials one grid step apart, trained on the same seed
(`seed_noise` of the `hyperparameter_sensitivity` notebook's 18 pairs of tiny-xs at
3 seeds: 0.61 %, 36 degrees of freedom). Two one-seed trials closer than this are not
ranked by one seed."""

CONFIRM: Confirm = Confirm(noise=NOISE, seeds=(1, 2), tie=0.003)
"""The protocol's noise rule: two more seeds (three in all, as every headline cell)
for each contender of a decision closer than `NOISE`. Three seeds shrink the noise of
a paired mean to NOISE / sqrt(3) = 0.35 %: two values a whole `NOISE` apart are then
ranked right 96 % of the time, where one seed ranks them right 84 % (a normal gap of
one and sqrt(3) standard deviations); closer values are near-ties whose choice moves
the loss by less than the noise itself, and a fourth and fifth seed (0.27 %) would
double the confirmation's cost for a little less. The tie rule on a confirmed mean
keeps a published choice within 0.3 %: the arithmetic of another machine type moves
a final loss by less than 0.54 % in 90 % of re-trained records, a mean of three by
about 0.54 / sqrt(3)."""


def seed_noise(sweeps: Sequence["Sensitivity"]) -> float:
    """`NOISE` from `sensitivity` sweeps: the pooled standard deviation over seeds of
    each moved point's relative gap to its tuned point, seed by seed (each point's
    own mean gap removed; n - 1 degrees of freedom per point)."""
    gaps = [
        np.asarray(losses) / np.asarray(s.tuned_losses) - 1
        for s in sweeps
        for points in s.moved.values()
        for losses in points.values()
    ]
    if not gaps or any(len(g) < 2 for g in gaps):
        raise ValueError("seed_noise needs moved points trained on two or more seeds")
    squares = sum(float(((g - g.mean()) ** 2).sum()) for g in gaps)
    return math.sqrt(squares / sum(len(g) - 1 for g in gaps))


def confirmation_rows(searches: Mapping[str, Search]) -> list[dict[str, Any]]:
    """One row per decision the noise rule took to more seeds, for a table: the
    search's label, the axis, the value the search's own seeds made best, each
    contender's mean over every seed, and the value chosen on them."""
    return [
        {
            "search": label,
            "axis": c.field,
            "one seed": f"{c.first:g}",
            "contenders (mean over seeds)": ", ".join(
                f"{v:g}: {np.mean(losses):.4f}"
                for v, losses in sorted(c.contenders.items())
            ),
            "chosen": f"{c.chosen:g}",
            "moved": "yes" if c.chosen != c.first else "",
        }
        for label, search in searches.items()
        for c in search.confirmed
    ]


def tune_warmup(
    preset: str,
    model: str,
    *,
    regime: Regime,
    seeds: Sequence[int] = (0,),
    axis: Axis = WARMUP,
    confirm: Confirm | None = None,
    at: Mapping[str, Any] | None = None,
) -> Search:
    """The warmup swept for one method and size, the other settings at their tuned
    values (`config.TUNED`, without a tuned warmup): the protocol's last axis, on the
    validation split, the same grid (`WARMUP`) and budget for every method. The
    published warmup is kept within `TIE` of the best; with `confirm` (`CONFIRM`)
    the noise rule decides a near-tie on more seeds. `at` (dotted field → value)
    sweeps it from other settings than the tuned ones (e.g. a batch the noise rule
    chose)."""
    base = make_preset(preset, model=model, data={"validation": True})
    for field, value in (at or {}).items():
        base = set_field(base, field, value)
    base = base.replace(inner={"warmup_fraction": None})
    return coordinate_search(
        regime.apply(base),
        [axis],
        regime=regime,
        seeds=seeds,
        published=TUNED.get(preset, {}).get(model),
        tie=TIE,
        confirm=confirm,
    )


def tune(
    preset: str,
    model: str,
    *,
    regime: Regime,
    seeds: Sequence[int] = (0,),
    axes: Sequence[Axis] | None = None,
    confirm: Confirm | None = None,
) -> Search:
    """The protocol for one method and model size: `coordinate_search` of
    `standard_axes` from the preset's defaults, on the validation split; a size
    already in the presets' table (`config.TUNED`) keeps its published choices
    within `TIE` of the best (the tie rule); with `confirm` (`CONFIRM`) a decision
    closer than the seed noise is taken on more seeds (the noise rule)."""
    base = make_preset(preset, tuned=False, model=model, data={"validation": True})
    axes = standard_axes(base.method.kind) if axes is None else axes
    return coordinate_search(
        regime.apply(base),
        axes,
        regime=regime,
        seeds=seeds,
        published=TUNED.get(preset, {}).get(model),
        tie=TIE,
        confirm=confirm,
    )


def save_tuned(
    searches: dict[tuple[str, str], Search], path: str | None = None
) -> dict[str, Any]:
    """Write the chosen values into the presets' table (`config.TUNED`).

    Each search writes the chosen value of the axes it swept; the size's other
    entries stay.

    While records are only re-stamped (`experiments.restamping`), a trial trained
    again on another machine may score a hair otherwise and tip a choice. Writing it
    would change the presets and so every record made from them; instead nothing is
    written and the moved choices are raised.

    Args:
        searches: (model size, method name in `PRESETS`) → its `Search`.
        path: the JSON file; default `sdiloco/lab/tuned.json`, which `config.preset`
            reads (sizes and methods not in `searches` keep their entries).

    Returns:
        The table written.

    Raises:
        ValueError: while re-stamping, if a choice differs from the table's, naming
            each (method, size, field, value in the table → value chosen now).
    """
    import json
    import pathlib

    from ..lab import config as config_lib

    target = pathlib.Path(
        path or pathlib.Path(config_lib.__file__).parent / "tuned.json"
    )
    table = json.loads(target.read_text()) if target.exists() else {}
    moved = []
    for (size, name), search in searches.items():
        swept = {t.axis for t in search.trials}
        axes = (*standard_axes(search.best.method.kind), WARMUP)
        chosen = search.best_values([a for a in axes if a.field in swept])
        entry = table.setdefault(PRESETS[name], {}).setdefault(size, {})
        moved += [
            f"{PRESETS[name]} {size} {field}: {entry[field]!r} -> {value!r}"
            for field, value in chosen.items()
            if field in entry and entry[field] != value
        ]
        entry.update(chosen)
    if moved and experiments.restamping():
        raise ValueError(
            f"re-stamping moved {len(moved)} tuned choice(s) of {target.name} ("
            + "; ".join(moved)
            + "); the table is left as it is. Compare the re-stamped trials with "
            "their `replaced` losses; to take the new choices, run the sweep without "
            "--restamp."
        )
    table["_source"] = (
        "sdiloco.paper.tuning via notebooks/hyperparameter_sweep: coordinate search "
        "on the validation split at 20 tokens per parameter and 50 outer rounds, one "
        "seed per trial (the warmup fraction swept last, from the others' choices, "
        "scored on every validation window); records in paper_figures/runs/."
    )
    target.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table


def neighbours(axis: Axis, value: Any) -> tuple[Any, Any]:
    """The values one grid step below and above `value` on `axis` (its `extend`
    where it has one, e.g. half and twice a learning rate; else the adjacent grid
    values, the edge value itself where there is none)."""
    if axis.extend is not None:
        return axis.extend(value, -1), axis.extend(value, 1)
    grid = sorted(set(axis.values) | {value})
    i = grid.index(value)
    return grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]


SHARED_FIELDS: tuple[str, ...] = (
    "inner.lr",
    "data.global_batch_size",
    "inner.warmup_fraction",
)
"""The axes every method has (the DiLoCo family's outer lr and momentum aside)."""


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """What `sensitivity` measured for one method: the tuned point and each axis
    moved alone, every value trained at the same seeds (so losses pair by seed).

    Attributes:
        tuned: axis field → its tuned value.
        tuned_losses: the tuned config's final loss per seed.
        moved: axis field → {moved value: final loss per seed}.
    """

    tuned: dict[str, Any]
    tuned_losses: list[float]
    moved: dict[str, dict[Any, list[float]]]

    def curve(self, field: str) -> dict[Any, list[float]]:
        """One axis's values in increasing order, the tuned one included."""
        points = {self.tuned[field]: self.tuned_losses, **self.moved[field]}
        return dict(sorted(points.items()))


def sensitivity(
    preset: str,
    model: str,
    *,
    regime: Regime,
    axes: Sequence[Axis],
    seeds: Sequence[int] = (0, 1, 2),
    metric: str = "eval/global",
) -> Sensitivity:
    """How much a method loses one grid step away from its tuned setting.

    From the tuned config (`config.TUNED`, on the validation split at `regime`),
    each axis is moved alone to its `neighbours` and trained at every seed. Values
    the budget cannot train (e.g. a batch that leaves H < 2) are left out. Every run
    is an ordinary recorded run (`experiments.run_one`): a sweep resumes.
    """
    best = regime.apply(make_preset(preset, model=model, data={"validation": True}))

    def losses(config: RunConfig, name: str) -> list[float]:
        return [experiments.run_one(name, config, s).final(metric) for s in seeds]

    tuned = {a.field: get_field(best, a.field) for a in axes}
    moved: dict[str, dict[Any, list[float]]] = {}
    base = losses(best, "tuned")
    for axis in axes:
        moved[axis.field] = {}
        for v in neighbours(axis, tuned[axis.field]):
            if v == tuned[axis.field]:
                continue
            try:
                config = regime.apply(set_field(best, axis.field, v))
            except ValueError:  # the budget cannot train it
                continue
            moved[axis.field][v] = losses(config, f"{axis.field}={v}")
    return Sensitivity(tuned, base, moved)


def headline(
    model: str,
    *,
    regime: Regime,
    seeds: Sequence[int] = (0, 1, 2),
    metric: str = "eval/global",
    budget: Regime | None = None,
    axes: Callable[[str], Sequence[Axis]] | None = None,
    confirm: Confirm | None = None,
) -> dict[str, list[float]]:
    """Each method at its tuned setting, evaluated on the held-out split, per seed.

    The tuned setting is the protocol's at `regime` (`tune`, read from its records);
    the evaluation split changes (`DataConfig.validation=False`) and, with a `budget`,
    so do the steps and H (e.g. 4x the tokens per parameter at the same settings).
    `axes(preset)` gives the axes the search swept (default `standard_axes`), and
    `confirm` the noise rule it ran with (`tune`).

    Returns:
        Method name → the final `metric` of each seed, in `seeds` order.
    """
    out = {}
    for name, preset in PRESETS.items():
        swept = None if axes is None else axes(preset)
        best = tune(preset, model, regime=regime, axes=swept, confirm=confirm).best
        config = best.replace(data={"validation": False})
        if budget is not None:
            config = budget.apply(config)
        out[name] = [experiments.run_one(name, config, s).final(metric) for s in seeds]
    return out


def rounds_sweep(
    model: str,
    rounds: Sequence[int],
    *,
    regime: Regime,
    seeds: Sequence[int] = (0, 1, 2),
    method: str = "Streaming FP4",
    metric: str = "eval/global",
    axes: Callable[[str], Sequence[Axis]] | None = None,
    published: Mapping[int, float] | None = None,
    confirm: Confirm | None = None,
) -> list[dict[str, Any]]:
    """The held-out gap to Data-Parallel at other numbers of outer rounds, same tokens.

    Separates the number of syncs from the training budget: for each R in `rounds`,
    `method` at its tuned setting (`tune` at `regime`) with H = steps // R, its outer
    learning rate swept again on the validation split at that H (the protocol's
    outer-lr axis, extended at its edges: the best outer lr grows with H; a
    `published` outer lr for R, rounds → lr, is kept within `TIE` of the best), then
    trained with `seeds` on the held-out split and paired by seed with Data-Parallel
    at its tuned setting (which has no rounds). `confirm` is the noise rule the
    tuned settings were searched with (`tune`); the outer lr per R is decided on one
    seed.

    Returns:
        One row per R: rounds, H, the outer lr chosen, the method's and
        Data-Parallel's losses per seed, and `paired_gap`.
    """
    preset = PRESETS[method]

    def tuned(p: str) -> RunConfig:
        swept = None if axes is None else axes(p)
        return tune(p, model, regime=regime, axes=swept, confirm=confirm).best

    dp = tuned("data_parallel").replace(data={"validation": False})
    dp_losses = [
        experiments.run_one("Data-Parallel", dp, s).final(metric) for s in seeds
    ]
    best = tuned(preset)
    swept = standard_axes(best.method.kind) if axes is None else axes(preset)
    outer = [a for a in swept if a.field == "method.outer.lr"]
    rows = []
    for r in rounds:
        at = dataclasses.replace(regime, rounds=r)
        config = at.apply(best)
        if outer:
            chosen = (published or {}).get(r)
            config = coordinate_search(
                config,
                outer,
                regime=at,
                published=None if chosen is None else {"method.outer.lr": chosen},
                tie=TIE,
            ).best
        config = config.replace(data={"validation": False})
        losses = [experiments.run_one(method, config, s).final(metric) for s in seeds]
        assert isinstance(config.method, DiLoCoConfig | StreamingConfig)
        rows.append(
            {
                "rounds": r,
                "H": config.method.sync_every,
                "outer lr": config.method.outer.lr,
                "losses": losses,
                "Data-Parallel losses": dp_losses,
                "gap": paired_gap(dp_losses, losses),
            }
        )
    return rows


def get_field(config: Any, path: str) -> Any:
    """The value at a dotted path of a config."""
    for part in path.split("."):
        config = getattr(config, part)
    return config


def set_field(config: RunConfig, path: str, value: Any) -> RunConfig:
    """`config` with the value at a dotted path changed (validated as usual)."""
    head, *rest = path.split(".")
    change: Any = value
    for part in reversed(rest):
        change = {part: change}
    return config.replace(**{head: change})


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sdiloco.paper.tuning MODEL [--method NAME ...]`: run the protocol.

    Trials are recorded in `paper_figures/runs/` like any learning run, so the sweep
    can be split over machines and sessions and the notebook re-renders from them.
    """
    args = _parser().parse_args(argv)
    experiments.enable_compile_cache()
    regime = Regime(args.tokens_per_param, args.rounds)
    for name, preset in PRESETS.items():
        if args.method and preset not in args.method:
            continue
        if args.warmup:
            search = tune_warmup(preset, args.model, regime=regime)
            print(name, args.model, search.best_values([WARMUP]), flush=True)
            continue
        search = tune(preset, args.model, regime=regime)
        axes = standard_axes(search.best.method.kind)
        print(name, args.model, search.best_values(axes), flush=True)
    if args.headline:
        _print_headline(args, regime)
    if args.rounds_sweep:
        _print_rounds_sweep(args, regime)
    return 0


def _parser():
    import argparse

    p = argparse.ArgumentParser(prog="python -m sdiloco.paper.tuning")
    p.add_argument("model", help="a model preset, e.g. tiny-xs")
    p.add_argument("--method", action="append", choices=sorted(PRESETS.values()))
    p.add_argument("--tokens-per-param", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument(
        "--warmup",
        action="store_true",
        help="sweep only the warmup fraction, from each method's tuned settings",
    )
    p.add_argument(
        "--headline-tokens-per-param",
        type=float,
        help="train the headline runs at this budget instead (same tuned settings)",
    )
    p.add_argument(
        "--headline",
        type=int,
        metavar="SEEDS",
        help="then train every method at its tuned setting on the held-out split "
        "with seeds 0..SEEDS-1 and print the seed-paired gaps to Data-Parallel",
    )
    p.add_argument(
        "--rounds-sweep",
        type=int,
        nargs="+",
        metavar="R",
        help="then the held-out gap of --rounds-method to Data-Parallel at each "
        "number of outer rounds R (same tokens; outer lr retuned at each H), with "
        "seeds 0..--rounds-seeds-1",
    )
    p.add_argument("--rounds-method", default="Streaming FP4", choices=list(PRESETS))
    p.add_argument("--rounds-seeds", type=int, default=3)
    return p


def _print_headline(args, regime: Regime) -> None:
    budget = None
    if args.headline_tokens_per_param is not None:
        budget = Regime(args.headline_tokens_per_param, args.rounds)
    losses = headline(
        args.model, regime=regime, seeds=range(args.headline), budget=budget
    )
    dp = losses["Data-Parallel"]
    for name, values in losses.items():
        gap = paired_gap(dp, values) if name != "Data-Parallel" else None
        print(name, args.model, [round(v, 4) for v in values], gap, flush=True)


def _print_rounds_sweep(args, regime: Regime) -> None:
    rows = rounds_sweep(
        args.model,
        args.rounds_sweep,
        regime=regime,
        seeds=range(args.rounds_seeds),
        method=args.rounds_method,
    )
    for row in rows:
        gap = row["gap"]
        print(
            args.rounds_method,
            args.model,
            f"rounds {row['rounds']} H {row['H']} outer lr {row['outer lr']}:",
            f"gap {100 * gap['relative']:+.2f} % "
            f"[{gap['low']:+.4f}, {gap['high']:+.4f}]",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
