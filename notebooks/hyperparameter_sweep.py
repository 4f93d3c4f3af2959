# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Tuning every method by one protocol (beyond the paper)
#
# **Why.** The paper compares methods with hyper-parameters taken from the Scaling Laws
# for DiLoCo study, which tunes the inner learning rate and the batch per method and
# sweeps the outer learning rate. Comparing untuned defaults would test our defaults,
# not the methods.
#
# **Protocol** (`sdiloco.paper.tuning`). For Data-Parallel, DiLoCo and Streaming
# DiLoCo with overlapped FP4 (τ = 1, α = 0.5), at each model size:
# the budget is fixed at **20 tokens per parameter** (Chinchilla) and, for the DiLoCo
# family, **50 outer rounds** (H = steps / 50, so a larger batch keeps the tokens and
# the rounds and takes fewer steps); then one axis at a time, each at the best values
# so far: the inner learning rate (2x grid, extended past an edge), the outer learning
# rate ({0.2, …, 1.0}, extended), the outer momentum ({0.5, 0.8, 0.9, 0.95}), the
# global batch ({16, 32, 64}, extended twice; the inner learning rate up to four times). Every trial evaluates on the
# **validation** split (2 training plays set aside), never on the held-out split the
# tables report. One seed per trial.
#
# **Tie rule** (`tuning.TIE`). Run again, the sweep keeps each published choice
# (`sdiloco/lab/tuned.json`) while it is within 1 % of the best trial of its axis. One
# seed does not rank values that close, and another machine type's arithmetic moves
# a trial's loss by a median 0.17 %: without the rule a sweep re-trained elsewhere
# reorders near-ties and takes another path. The choices it keeps are listed below.

# %%
import dataclasses
from fractions import Fraction

import matplotlib.pyplot as plt

from sdiloco.lab import config as config_lib, model as model_lib
from sdiloco.paper import experiments as ex, plotting, tuning


plotting.style()
NOTEBOOK = "hyperparameter_sweep"
FAST = plotting.FAST
# Sizes whose sweep is complete; a new one is swept with
# `python -m sdiloco.paper.tuning MODEL` (its trials are recorded as they finish, over
# as many sessions as it takes) and added here when done.
SIZES = (
    ("tiny-xxs",)
    if FAST
    else ("tiny-xxxs", "tiny-xxs", "tiny-xs", "tiny-xs+", "tiny-s")
)
# The first four sizes were swept when a trial scored 16 of its own batches and warmed
# up for a sixth of the steps (`ex.REGIME_PER_BATCH`); tiny-xs+ was swept later, as
# the CLI sweeps now: every validation window scored, the warmup a sixth of the steps
# as a fraction (`ex.REGIME`). The budget (tokens per parameter, rounds) is the same.
REGIME = (
    tuning.Regime(0.5, 4, evals=1, eval_windows=32) if FAST else ex.REGIME_PER_BATCH
)
SWEPT_ON_EVERY_WINDOW = () if FAST else ("tiny-xs+",)


def regime_of(size):
    """The budget and the scoring a size's trials were run at."""
    return ex.REGIME if size in SWEPT_ON_EVERY_WINDOW else REGIME


SEEDS = (0,)


def axes(preset):
    """The protocol's axes (FAST mode: one, two values: the inner lr for
    Data-Parallel, the outer lr for the DiLoCo family, which the rounds sweep reuses)."""
    kind = config_lib.preset(preset).method.kind
    full = tuning.standard_axes(kind)
    if not FAST:
        return full
    one = "inner.lr" if kind == "data_parallel" else "method.outer.lr"
    return tuple(tuning.Axis(a.field, a.values[1:3]) for a in full if a.field == one)


def search_all(sizes, confirm=None):
    """The protocol for every method at each size: (size, method name) → Search."""
    return {
        (size, name): tuning.tune(
            preset,
            size,
            regime=regime_of(size),
            seeds=SEEDS,
            axes=axes(preset),
            confirm=confirm,
        )
        for size in sizes
        for name, preset in tuning.PRESETS.items()
    }


# %%
ex.enable_compile_cache()
searches = search_all(SIZES)
if not FAST:  # the presets' defaults for these sizes (`config.TUNED`)
    tuning.save_tuned(searches)

# %% [markdown]
# ## The chosen settings
#
# Per model size and method: the chosen value of each axis, the validation loss there,
# the budget (tokens per parameter, steps, H and rounds) and the number of trials.

# %%
best_rows = []
for (size, name), search in searches.items():
    b = search.best
    h = getattr(b.method, "sync_every", None)
    best_rows.append(
        {
            "model": size,
            "params": model_lib.preset(size).num_params(),
            "method": name,
            "inner lr": b.inner.lr,
            "outer lr": getattr(getattr(b.method, "outer", None), "lr", "-"),
            "outer momentum": getattr(
                getattr(b.method, "outer", None), "momentum", "-"
            ),
            "batch": b.data.global_batch_size,
            "steps": b.steps,
            "H": h or "-",
            "rounds": b.steps // h if h else "-",
            "tokens/param": round(
                b.steps
                * b.data.global_batch_size
                * model_lib.preset(size).seq_len
                / model_lib.preset(size).num_params(),
                1,
            ),
            "validation loss": round(
                next(t.mean for t in search.trials if t.config == b), 4
            ),
            "scored on": (
                "every window" if size in SWEPT_ON_EVERY_WINDOW else "16 batches"
            ),
            "trials": len({t.config.to_json() for t in search.trials}),
        }
    )
plotting.save_table(
    best_rows,
    "hyperparameter_sweep",
    title="Tuned settings per model size and method (validation split, one seed)",
    notes=(
        f"Budget: {REGIME.tokens_per_param:g} tokens per parameter, "
        f"{REGIME.rounds} outer rounds for the DiLoCo family. Protocol: "
        "`sdiloco.paper.tuning.standard_axes`, swept in order by "
        "`coordinate_search`. Validation loss in nats/byte, scored on 16 of the "
        "run's own batches (the sizes swept first) or on every validation window."
    ),
    notebook=NOTEBOOK,
    config={f"{s}|{n}": x.best for (s, n), x in searches.items()},
    seeds=SEEDS,
)
print(plotting.markdown_table(best_rows))
kept = [
    f"{name} at {size}: {field} = {value} kept, {gap:.2%} above the best ({best})"
    for (size, name), search in searches.items()
    for field, value, best, gap in search.kept
]
print("Kept by the tie rule:", "; ".join(kept) if kept else "none")

# %% [markdown]
# ## The loss surface along each axis
#
# Every trial, in the order the search ran it: validation loss against the value of the
# axis being swept (the other axes at their best values so far).

# %%
trial_rows = [
    {"model": size, "method": name, "axis": t.axis, "value": t.value, "loss": t.mean}
    for (size, name), search in searches.items()
    for t in search.trials
]
plotting.save_table(
    trial_rows,
    "hyperparameter_sweep_trials",
    title="Every trial of the tuning protocol (validation loss, nats/byte)",
    notebook=NOTEBOOK,
    seeds=SEEDS,
)
fields = list(dict.fromkeys(t["axis"] for t in trial_rows))
fig, axs = plt.subplots(
    len(SIZES),
    len(fields),
    figsize=(3.6 * len(fields), 3.2 * len(SIZES)),
    squeeze=False,
)
colors = dict(zip(tuning.PRESETS, ("tab:blue", "tab:orange", "tab:red")))
for i, size in enumerate(SIZES):
    for j, field in enumerate(fields):
        ax = axs[i, j]
        for name in tuning.PRESETS:
            pts = sorted(
                {
                    (r["value"], r["loss"])
                    for r in trial_rows
                    if r["model"] == size and r["method"] == name and r["axis"] == field
                }
            )
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, marker="o", color=colors[name], label=name)
        if field in ("inner.lr", "data.global_batch_size"):
            ax.set_xscale("log", base=2)
        ax.set_title(f"{size}: {field}", fontsize=9)
        ax.set_ylabel("validation loss")
axs[0, 0].legend(fontsize=8)
fig.tight_layout()
_ = plotting.save_figure(fig, "hyperparameter_sweep", notebook=NOTEBOOK, seeds=SEEDS)

# %% [markdown]
# ## The headline: each method at its tuned setting, on the held-out split
#
# Each method is trained at the setting chosen above, with three seeds, and evaluated on
# the held-out split (never seen by the search). The gap is Streaming's (or DiLoCo's)
# held-out loss minus Data-Parallel's, paired by seed: its mean and 95 % t-interval.
# At the tuning budget for every size and, for the three smallest, at a quarter and four
# times the tokens per parameter with the same settings and the same 50 outer rounds
# (so H grows with the budget; tiny-xxxs has no quarter: 50 rounds would leave H < 2).
# The paper's claim is a gap of about 1 %, our goal within 2 %.

# %%
BUDGETS = (
    {"tiny-xxs": (REGIME.tokens_per_param,)}
    if FAST
    else {
        "tiny-xxxs": (20.0, 80.0),  # at 5 tokens/param 50 rounds leave H < 2
        "tiny-xxs": (5.0, 20.0, 80.0),
        "tiny-xs": (5.0, 20.0, 80.0),
        "tiny-s": (20.0,),
    }
)
HEADLINE_SEEDS = (0, 1) if FAST else (0, 1, 2)
headline_rows = []
for size, budgets in BUDGETS.items():
    for tpp in budgets:
        budget = None
        if tpp != REGIME.tokens_per_param:
            budget = dataclasses.replace(REGIME, tokens_per_param=tpp)
        losses = tuning.headline(
            size,
            regime=REGIME,
            seeds=HEADLINE_SEEDS,
            budget=budget,
            axes=axes,
        )
        dp = losses["Data-Parallel"]
        for name, values in losses.items():
            if name == "Data-Parallel":
                continue
            gap = tuning.paired_gap(dp, values)
            dp_mean = sum(dp) / len(dp)
            headline_rows.append(
                {
                    "model": size,
                    "tokens/param": tpp,
                    "rounds": REGIME.rounds,
                    "method": name,
                    "Data-Parallel loss": round(dp_mean, 4),
                    "method loss": round(sum(values) / len(values), 4),
                    "gap": round(gap["mean"], 4),
                    "95 % interval": f"[{gap['low']:+.3f}, {gap['high']:+.3f}]",
                    "gap %": round(100 * gap["relative"], 2),
                    "interval % low": round(100 * gap["low"] / dp_mean, 2),
                    "interval % high": round(100 * gap["high"] / dp_mean, 2),
                    "seeds": len(values),
                }
            )
plotting.save_table(
    headline_rows,
    "hyperparameter_sweep_headline",
    title="Held-out gap to Data-Parallel at the tuned settings (seed-paired)",
    notes=(
        "Each method at its tuned setting (validation split), trained again with "
        "the listed seeds and evaluated on the held-out split; gap = method − "
        "Data-Parallel held-out loss (nats/byte), paired by seed, mean and 95 % "
        "t-interval. Rounds: outer rounds of the DiLoCo family (H = steps / rounds)."
    ),
    notebook=NOTEBOOK,
    seeds=HEADLINE_SEEDS,
)
print(plotting.markdown_table(headline_rows))

# %% [markdown]
# ## Rounds or tokens?
#
# The budgets above keep 50 outer rounds, so H grows with the tokens. To separate the
# two, Streaming FP4 is trained again at the tuning budget (20 tokens per parameter)
# with 12 to 200 outer rounds (H = steps / rounds), its outer learning rate swept again
# on the validation split at each H (the best outer lr grows with H), the rest at its
# tuned setting; then three seeds on the held-out split, paired with Data-Parallel's
# (`tuning.rounds_sweep`). Run again, each H keeps its published outer lr within 1 % of
# the best (the tie rule).

# %%
ROUNDS = (
    {"tiny-xxs": (2,)}
    if FAST
    else {s: (12, 25, 50, 100, 200) for s in ("tiny-xxs", "tiny-xs")}
)
# the outer lr each R was published with (kept within `tuning.TIE`, the tie rule)
published_rounds = plotting.published_results("hyperparameter_sweep_rounds")
rounds_rows = []
for size, rounds in ROUNDS.items():
    for row in tuning.rounds_sweep(
        size,
        rounds,
        regime=REGIME,
        seeds=HEADLINE_SEEDS,
        axes=axes,
        published={
            r["rounds"]: r["outer lr"] for r in published_rounds if r["model"] == size
        },
    ):
        gap, dp_mean = (
            row["gap"],
            sum(row["Data-Parallel losses"]) / len(row["Data-Parallel losses"]),
        )
        rounds_rows.append(
            {
                "model": size,
                "tokens/param": REGIME.tokens_per_param,
                "rounds": row["rounds"],
                "H": row["H"],
                "outer lr": row["outer lr"],
                "Data-Parallel loss": round(dp_mean, 4),
                "method loss": round(sum(row["losses"]) / len(row["losses"]), 4),
                "gap %": round(100 * gap["relative"], 2),
                "interval % low": round(100 * gap["low"] / dp_mean, 2),
                "interval % high": round(100 * gap["high"] / dp_mean, 2),
                "seeds": gap["n"],
            }
        )
plotting.save_table(
    rounds_rows,
    "hyperparameter_sweep_rounds",
    title="Streaming FP4's held-out gap to Data-Parallel against the outer rounds",
    notes=(
        f"{REGIME.tokens_per_param:g} tokens per parameter; H = steps / rounds; "
        "outer lr retuned at each H on the validation split, other settings tuned at "
        "50 rounds; gap = Streaming FP4 − Data-Parallel held-out loss, paired by "
        "seed, mean and 95 % t-interval, in % of Data-Parallel's loss."
    ),
    notebook=NOTEBOOK,
    seeds=HEADLINE_SEEDS,
)
print(plotting.markdown_table(rounds_rows))

# %%
fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(10.0, 3.8), sharey=True)
markers = {
    "tiny-xxxs": "v",
    "tiny-xxs": "o",
    "tiny-xs": "s",
    "tiny-xs+": "p",
    "tiny-s": "D",
}


def gap_bar(ax, x, r, color):
    ax.errorbar(
        x,
        r["gap %"],
        yerr=[[r["gap %"] - r["interval % low"]], [r["interval % high"] - r["gap %"]]],
        marker=markers.get(r["model"], "^"),
        color=color,
        capsize=3,
        linestyle="none",
    )


for r in headline_rows:
    x = r["tokens/param"] * (1.04 if r["method"] == "DiLoCo" else 0.96)
    gap_bar(ax, x, r, colors[r["method"]])
for r in rounds_rows:
    x = r["rounds"] * (1.04 if r["model"] == "tiny-xs" else 0.96)
    gap_bar(ax_r, x, r, colors["Streaming FP4"])
for name in ("DiLoCo", "Streaming FP4"):
    for size, m in markers.items():
        ax.plot(
            [],
            [],
            marker=m,
            color=colors[name],
            linestyle="none",
            label=f"{name}, {size}",
        )
for a in (ax, ax_r):
    a.axhline(0, color="black", lw=0.8)
    a.axhspan(-2, 2, color="tab:green", alpha=0.1, label="within 2 % (our goal)")
    a.set_xscale("log")
    a.minorticks_off()
budgets = sorted({r["tokens/param"] for r in headline_rows})
ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
ax.set_xlabel(f"tokens per parameter ({REGIME.rounds} outer rounds)")
ax.set_ylabel("held-out loss gap to Data-Parallel (%)")
ax.set_title("Against the training budget (bars: 95 % seed-paired t-intervals)")
ax.legend(fontsize=7)
ticks = sorted({r["rounds"] for r in rounds_rows})
ax_r.set_xticks(ticks, [str(t) for t in ticks])
ax_r.set_xlabel(
    f"outer rounds ({REGIME.tokens_per_param:g} tokens per parameter; H = steps / rounds)"
)
ax_r.set_title("Against the number of outer rounds (Streaming FP4)")
fig.tight_layout()
_ = plotting.save_figure(
    fig,
    "hyperparameter_sweep_headline",
    notebook=NOTEBOOK,
    seeds=HEADLINE_SEEDS,
    results=headline_rows + rounds_rows,
)

# %% [markdown]
# **What it shows.** At the tuned settings, 20 tokens per parameter, 50 outer rounds
# and 3 seeds, Streaming DiLoCo with overlapped FP4 trails Data-Parallel on the
# held-out split by +6.9 % (95 % interval +2.5 to +11.3 %) on tiny-xxxs (6,856
# parameters), +5.7 % (−1.3 to +12.7 %) on tiny-xxs, +5.2 % (+1.0 to +9.4 %) on
# tiny-xs and **+1.1 % (−0.7 to +3.0 %) on tiny-s** (312,512 parameters): within the
# 2 % goal at the largest size on the point estimate (the interval reaches +3.0 %), +5
# to +7 % below it. DiLoCo follows the same trend
# (+23.9, +13.5, +5.2, +1.6 %); at tiny-xxxs its search stayed at a poor point (inner lr
# 3e-3, momentum 0.9: the first axes were swept at batch 16, where 50 rounds leave
# H = 2, the small-H collapse; one pass of coordinate search does not leave it).
#
# More tokens at fixed rounds help the small models: from 20 to 80 tokens per parameter
# +6.9 → +1.5 % (−0.2 to +3.2 %) on tiny-xxxs and +5.7 → +3.2 % on tiny-xxs; on tiny-xs
# +15.5 % at 5 tokens per parameter (H = 8), +5.2 % at 20 and +2.4 % (−0.5 to +5.2 %) at
# 80. At a fixed 20 tokens per parameter, more outer rounds help too: from 12 rounds
# (H ≈ 140) to 200 (H = 8) the gap falls from +5.7 to +3.2 % on tiny-xxs and from +8.3
# to +4.5 % on tiny-xs, most of it by 100 rounds (+4.7 %, +4.0 %).
# Re-sweeping the outer learning rate at 50 rounds, after the other axes had moved,
# chose 1.2 instead of 0.6 on tiny-xxs and gave +4.7 % instead of +5.7 %: one pass of
# coordinate search leaves something on the table.
#
# So the gap closes with model size first (as the Scaling Laws for DiLoCo study finds:
# its M = 2 gap is +0.7 % at 35M parameters), then with tokens per parameter and
# rounds. The 2 % goal is met at tiny-s, the largest size tuned, on the point
# estimate; it is not met below it at the compute-optimal budget. (Re-made on one
# held-out set with every method at its tuned warmup, Fig. 5: +1.7 % [+1.3, +2.1 %]
# at tiny-s, so within 2 % on the point estimate but not on the whole interval.)

# %% [markdown]
# ## The schedule: the warmup, swept last
#
# The protocol's axes above leave the schedule at a warmup of a sixth of the steps. The
# warmup (as a fraction of the steps) joins them as the last axis, for every method
# with the same grid ({1/32, 1/16, 1/8, 1/4, 1/2}, extended past its upper edge to 3/4
# and 7/8) and the same budget, from each method's tuned settings, on the validation
# split, one seed, every validation window scored (`tuning.tune_warmup`). Swept at
# every tuned size, tiny-xxxs to tiny-s (5-7 trials per method and size; a trial at
# tiny-s takes 12-20 min on our 2 cores; the sweep is
# `python -m sdiloco.paper.tuning MODEL --warmup`, resumable). The chosen fractions go
# into `sdiloco/lab/tuned.json`, which `experiments.setup` and the CLI's
# `--tokens-per-param` read.

# %%
WARMUP_SIZE = "tiny-xxs" if FAST else "tiny-xs"  # the one-set headline's size below
WARMUP_SIZES = SIZES  # every tuned size
warmup_axis = (
    tuning.Axis(tuning.WARMUP.field, tuning.WARMUP.values[2:4])
    if FAST
    else tuning.WARMUP
)
warmup_regime = tuning.Regime(0.5, 4, evals=1, eval_windows=32) if FAST else ex.REGIME
warmup_presets = {
    name: preset
    for name, preset in tuning.PRESETS.items()
    if not FAST or name == "Streaming FP4"  # FAST: one method's code path
}
warmups = {
    (size, name): tuning.tune_warmup(
        preset, size, regime=warmup_regime, axis=warmup_axis
    )
    for size in WARMUP_SIZES
    for name, preset in warmup_presets.items()
}
if not FAST:
    tuning.save_tuned(warmups)


def _fraction(value: float) -> str:
    return str(Fraction(value).limit_denominator(64))


# The rows, and the table's summary read off the searches: which fraction won how
# often, and which optima sit at an edge of the values tried (so the optimum may lie
# beyond).
warmup_rows = []
winners: dict[str, list[str]] = {}
at_edge = []
for (size, name), search in warmups.items():
    chosen = search.best.inner.warmup_fraction
    winners.setdefault(_fraction(chosen), []).append(f"{name} at {size}")
    tried = [t.value for t in search.trials]
    if chosen in (min(tried), max(tried)):
        at_edge.append(f"{name} at {size} ({_fraction(chosen)})")
    for t in sorted(search.trials, key=lambda t: t.value):
        warmup_rows.append(
            {
                "model": size,
                "method": name,
                "warmup (fraction of steps)": round(t.value, 5),
                "validation loss": round(t.mean, 4),
                "chosen": "yes" if t.value == chosen else "",
            }
        )
common = max(winners, key=lambda f: len(winners[f]))
warmup_summary = (
    f"The chosen warmup is {common} of the steps for {len(winners[common])} of the "
    f"{len(warmups)} method-size pairs; "
    + "; ".join(
        f"{f} for {', '.join(pairs)}"
        for f, pairs in sorted(winners.items(), key=lambda kv: Fraction(kv[0]))
        if f != common
    )
    + ". "
    + (
        f"At an edge of the values tried: {', '.join(at_edge)}. "
        if at_edge
        else "Every optimum is interior to the values tried. "
    )
    + "".join(
        f"Kept by the tie rule: {name} at {size}, {_fraction(value)} "
        f"({gap:.2%} above the best trial, {_fraction(best)}). "
        for (size, name), search in warmups.items()
        for _, value, best, gap in search.kept
    )
)
plotting.save_table(
    warmup_rows,
    "hyperparameter_sweep_warmup",
    title=(
        f"The warmup swept last ({', '.join(WARMUP_SIZES)}; validation split, one seed)"
    ),
    notes=(
        "Each method at its tuned inner lr, outer lr and momentum, and batch; 20 "
        "tokens per parameter and 50 outer rounds; every validation window scored "
        "(standard error about 0.003 nats; one seed, so neighbouring values within "
        "a few hundredths are not told apart). "
        + warmup_summary
        + "The inner learning rates were tuned with a warmup of a sixth, so a longer "
        "warmup partly lowers a rate chosen a little high; a second pass over the "
        "learning rates at the new warmup would tell."
    ),
    notebook=NOTEBOOK,
    seeds=SEEDS,
)
print(plotting.markdown_table(warmup_rows))

# %% [markdown]
# ## Near-ties decided on three seeds (the noise rule)
#
# The searches above decide each axis on one seed. Where a decision's best values are
# closer than the seed noise (`tuning.NOISE`, 0.6 %: how much the gap between two
# settings one grid step apart moves from seed to seed, measured by the
# `hyperparameter_sensitivity` notebook), one seed is a coin toss. The noise rule
# (`tuning.CONFIRM`) trains each contender on seeds 1 and 2 as well and decides on the
# three-seed means (a published value is kept within 0.3 %). It is run here at tiny-xs,
# the size of the one-set headline and every re-run notebook; the other sizes keep
# their one-seed decisions (a tiny-s trial takes about ten minutes on our machines).
# Where it moves a choice away from the presets' table, the one-set headline is
# trained again at the confirmed setting (below); the presets' table itself is not
# rewritten here, since every notebook at that size trains from it.

# %%
CONFIRMED_SIZES = () if FAST else ("tiny-xs",)
confirmed = search_all(CONFIRMED_SIZES, confirm=tuning.CONFIRM)
confirmed_warmups = {
    (size, name): tuning.tune_warmup(
        preset, size, regime=ex.REGIME, axis=warmup_axis, confirm=tuning.CONFIRM
    )
    for size in CONFIRMED_SIZES
    for name, preset in tuning.PRESETS.items()
}
presets_of = {
    (size, name): config_lib.preset(tuning.PRESETS[name], model=size)
    for (size, name) in confirmed
}
confirmed_rows = []
for (size, name), search in [*confirmed.items(), *confirmed_warmups.items()]:
    for row in tuning.confirmation_rows({f"{name} at {size}": search}):
        chosen_before = tuning.get_field(presets_of[size, name], row["axis"])
        confirmed_rows.append({**row, "presets": f"{chosen_before:g}"})
# Each method's choices that the rule moved away from the presets' table
moved_from_presets = {
    (size, name): {
        field: value
        for field, value in search.best_values(axes(tuning.PRESETS[name])).items()
        if tuning.get_field(presets_of[size, name], field) != value
    }
    for (size, name), search in confirmed.items()
}
if confirmed_rows:  # FAST mode decides on one seed
    moved = [r for r in confirmed_rows if r["chosen"] != r["presets"]]
    plotting.save_table(
        confirmed_rows,
        "hyperparameter_sweep_confirmed",
        title=f"Near-ties decided on three seeds ({', '.join(CONFIRMED_SIZES)})",
        notes=(
            f"{len(confirmed_rows)} decisions had two or more values within "
            f"{tuning.NOISE:.1%} of the best on seed 0 (validation split); each "
            "contender was trained on seeds 1 and 2 and the choice taken on the "
            "three-seed mean (a published value kept within 0.3 %). 'one seed': the "
            "best on seed 0; 'presets': the value in `sdiloco/lab/tuned.json`. "
            f"{len(moved)} confirmed choice(s) differ from the presets: "
            + (
                "; ".join(
                    f"{r['search']}, {r['axis']} {r['presets']} → {r['chosen']}"
                    for r in moved
                )
                or "none"
            )
            + "."
        ),
        notebook=NOTEBOOK,
        seeds=(0, *tuning.CONFIRM.seeds),
    )
    print(plotting.markdown_table(confirmed_rows))

# %% [markdown]
# ## The headline again, on one held-out set and the tuned warmup
#
# The headline above scores each method on 16 of its own batches of held-out windows
# (128 windows for Data-Parallel at batch 8, 256 for Streaming at 16, out of 6,912),
# with a warmup of a sixth of the steps. Here the tiny-xs comparison is re-made at the
# one regime the CLI and every re-run notebook now share (`experiments.REGIME`): each
# method's tuned settings including the warmup chosen above, every held-out window
# scored (the evaluation's standard error is printed beside each loss), 3 seeds,
# seed-paired against Data-Parallel.

# %%
ONE_SET_SEEDS = (0,) if FAST else HEADLINE_SEEDS
ONE_SET = {
    "Data-Parallel": "data_parallel",
    "DiLoCo": "diloco",
    "Streaming FP4": "streaming_overlap_fp4",
}
if FAST:  # the notebook's FAST run stays within the tests' time limit
    del ONE_SET["DiLoCo"]
one_set = {
    name: [
        ex.run_one(name, ex.setup(preset, model=WARMUP_SIZE), s) for s in ONE_SET_SEEDS
    ]
    for name, preset in ONE_SET.items()
}
one_set_rows = []
dp_final = [r.final() for r in one_set["Data-Parallel"]]
for name, runs in one_set.items():
    final = [r.final() for r in runs]
    se = max(r.evals[-1].get("eval_se/global", float("nan")) for r in runs)
    c = runs[0].config
    one_set_rows.append(
        {
            "method": name,
            "held-out loss": ex.mean_pm(ex.describe(final), 4),
            "evaluation's standard error": f"{se:.4f}",
            "vs Data-Parallel": "—"
            if name == "Data-Parallel"
            else ex.gap_text(dp_final, final),
            "batch": c.data.global_batch_size,
            "steps": c.steps,
            "warmup": f"{c.inner.warmup_fraction:g}",
        }
    )
# The same headline where the noise rule moved a method's choice (the section above):
# that method at the confirmed setting, the presets' other values kept, and its
# warmup swept again there by the same protocol (`tuning.tune_warmup(at=...)`).
for (size, name), changes in moved_from_presets.items():
    if size != WARMUP_SIZE or not changes:
        continue
    rewarmed = tuning.tune_warmup(
        ONE_SET[name], size, regime=ex.REGIME, confirm=tuning.CONFIRM, at=changes
    )
    changes = {**changes, "inner.warmup_fraction": rewarmed.best.inner.warmup_fraction}
    c = ex.setup(ONE_SET[name], model=size)
    for field, value in changes.items():
        c = tuning.set_field(c, field, value)
    c = ex.REGIME.apply(c)
    final = [ex.run_one(name, c, s).final() for s in ONE_SET_SEEDS]
    one_set_rows.append(
        {
            "method": f"{name}, confirmed ("
            + ", ".join(f"{f} {v:g}" for f, v in changes.items())
            + ")",
            "held-out loss": ex.mean_pm(ex.describe(final), 4),
            "evaluation's standard error": "",
            "vs Data-Parallel": ex.gap_text(dp_final, final),
            "batch": c.data.global_batch_size,
            "steps": c.steps,
            "warmup": f"{c.inner.warmup_fraction:g}",
        }
    )
plotting.save_table(
    one_set_rows,
    "hyperparameter_sweep_one_set",
    title=(
        f"The headline on one held-out set ({WARMUP_SIZE}, "
        f"{ex.REGIME.tokens_per_param:g} tokens/param, {ex.REGIME.rounds} rounds, "
        f"tuned warmup, seeds {list(ONE_SET_SEEDS)})"
    ),
    notes=(
        "Every held-out window scored for every method (the standard error is the "
        "largest over seeds of the evaluation's own, over windows). Gaps: seed-paired "
        "relative mean and 95 % t-interval of the differences in nats. A 'confirmed' "
        "row: the method at the choice the noise rule made on three validation seeds "
        "where it differs from the presets' one-seed choice, its warmup swept again "
        "at that choice by the same protocol."
    ),
    notebook=NOTEBOOK,
    seeds=ONE_SET_SEEDS,
)
print(plotting.markdown_table(one_set_rows))

# %% [markdown]
# ## What the noise rule changed (tiny-xs)
#
# Of the 7 decisions at tiny-xs whose best values were within the seed noise on seed
# 0, three seeds kept the presets' value in 6. The one they moved is Streaming FP4's
# global batch: 8 beats 16 by 0.8 % on three validation seeds at the budget the
# searches were run at (16 of its own batches scored, warmup a sixth of the steps).
# It does not carry over to the one-set headline (every held-out window, the warmup
# swept last): there batch 8, with its warmup swept again (half the steps kept, 1/4
# within 0.1 %), is **+0.9 % [+0.005, +0.029] behind batch 16**, resolved, and its
# gap to Data-Parallel is +4.9 % [+0.061, +0.112] where batch 16's is +3.9 %
# [+0.048, +0.090]. So the headline keeps batch 16 and its +3.9 %: the protocol's
# batch decision was taken at the other scoring and warmup, and the batch and the
# warmup interact; a search re-run at the one-set budget would decide both together.
