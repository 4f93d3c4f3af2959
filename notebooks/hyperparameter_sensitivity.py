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
# # Beyond the paper: is Streaming DiLoCo harder to tune than Data-Parallel?
#
# **Question.** The paper's authors answer reviewers that Streaming DiLoCo is not
# harder to tune than Data-Parallel. How much does each method lose when one
# hyper-parameter sits one grid step away from its tuned value?
#
# **Setup.** Each method (Data-Parallel, DiLoCo, Streaming DiLoCo with overlapped FP4)
# starts from its tuned settings on tiny-xs (`sdiloco/lab/tuned.json`, from the
# `hyperparameter_sweep` notebook) at 20 tokens per parameter and 50 outer rounds, on
# the validation split (every validation window scored). Each of the axes the three
# methods share is moved alone, one grid step down and up (`tuning.sensitivity`): the
# inner learning rate (x 1/2, x 2), the global batch (x 1/2, x 2; the tokens and
# rounds stay, so the steps change) and the warmup (1/4 and 3/4 of the steps around
# the tuned 1/2). Three seeds per point, seed-paired with the tuned point. The
# DiLoCo family's outer learning rate and momentum have no Data-Parallel counterpart
# and are not moved here.
#
# **Statistic.** A method's sensitivity is the mean relative loss increase over its
# six moved points, computed per seed; the comparison between two methods is the
# seed-paired difference of their sensitivities with a 95 % t-interval.

# %%
import matplotlib.pyplot as plt
import numpy as np

from sdiloco.paper import experiments as ex, plotting, tuning


plotting.style()
NOTEBOOK = "hyperparameter_sensitivity"
SEEDS = ex.SEEDS
MODEL = ex.MODEL
FIELDS = ("inner.lr",) if ex.FAST else tuning.SHARED_FIELDS
LABELS = {
    "inner.lr": "inner learning rate",
    "data.global_batch_size": "global batch (sequences)",
    "inner.warmup_fraction": "warmup (fraction of the steps)",
}


def axes(preset: str) -> list[tuning.Axis]:
    kind = tuning.make_preset(preset, model=MODEL).method.kind
    every = (*tuning.standard_axes(kind), tuning.WARMUP)
    return [a for a in every if a.field in FIELDS]


sweeps = {
    name: tuning.sensitivity(
        preset, MODEL, regime=ex.REGIME, axes=axes(preset), seeds=SEEDS
    )
    for name, preset in tuning.PRESETS.items()
    if not ex.FAST or name != "DiLoCo"  # FAST: Data-Parallel and one method
}


# %%
rows, increases = [], {}
for name, sweep in sweeps.items():
    per_seed = []  # each moved point's relative increase, per seed
    for field, points in sweep.moved.items():
        for value, losses in points.items():
            per_seed.append(np.asarray(losses) / np.asarray(sweep.tuned_losses) - 1)
            rows.append(
                {
                    "method": name,
                    "axis": LABELS[field],
                    "tuned": f"{sweep.tuned[field]:g}",
                    "moved to": f"{value:g}",
                    "validation loss": ex.mean_pm(ex.describe(losses), 4),
                    "vs tuned": ex.gap_text(sweep.tuned_losses, losses),
                }
            )
    increases[name] = np.mean(per_seed, axis=0)

summary = []
for name, inc in increases.items():
    row = {
        "method": name,
        "tuned loss": ex.mean_pm(ex.describe(sweeps[name].tuned_losses), 4),
        "points moved": sum(len(p) for p in sweeps[name].moved.values()),
        "mean increase, per seed": " / ".join(f"{100 * x:+.2f} %" for x in inc),
        "mean increase": f"{100 * inc.mean():+.2f} %",
        "minus Data-Parallel's": "—",
    }
    if name != "Data-Parallel":
        d = inc - increases["Data-Parallel"]
        if d.size > 1:
            gap = ex.paired_gap(np.zeros_like(d), d)
            row["minus Data-Parallel's"] = (
                f"{100 * gap['mean']:+.2f} points "
                f"[{100 * gap['low']:+.2f}, {100 * gap['high']:+.2f}]"
            )
        else:
            row["minus Data-Parallel's"] = f"{100 * d.mean():+.2f} points (one seed)"
    summary.append(row)

config = tuning.make_preset("streaming_overlap_fp4", model=MODEL)
title = (
    f"One step from the tuned setting ({MODEL}, validation split, "
    f"{ex.REGIME.tokens_per_param:g} tokens/param, {ex.REGIME.rounds} rounds, "
    f"seeds {list(SEEDS)})"
)
plotting.save_table(
    rows,
    NOTEBOOK,
    title=title,
    notes=(
        "Validation loss: mean ± std over seeds. vs tuned: seed-paired relative mean "
        "and 95 % t-interval of the differences in nats (negative: the neighbour is "
        "better than the tuned value, which was chosen on one seed)."
    ),
    notebook=NOTEBOOK,
    seeds=SEEDS,
)
# The seed noise of one tuning comparison (`tuning.seed_noise`): how much the gap
# between two settings one grid step apart moves from seed to seed. The tuning
# protocol's noise rule (`tuning.NOISE`) is this number.
noise = tuning.seed_noise(list(sweeps.values())) if len(SEEDS) > 1 else None
noise_text = (
    ""
    if noise is None
    else f" The seed noise of one comparison (the standard deviation over seeds of "
    f"a moved point's gap to the tuned point, pooled over the {len(rows)} points): "
    f"{noise:.2%} (`tuning.NOISE` = {tuning.NOISE:.1%})."
)
plotting.save_table(
    summary,
    f"{NOTEBOOK}_summary",
    title=f"Sensitivity: the mean loss increase one grid step away ({MODEL})",
    notes=(
        "Per seed, the mean over the moved points of loss ÷ tuned loss − 1; the last "
        "column is the seed-paired difference from Data-Parallel's, in percentage "
        "points, with its 95 % t-interval (positive: more sensitive than "
        "Data-Parallel)." + noise_text
    ),
    notebook=NOTEBOOK,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))
print(plotting.markdown_table(summary))
print(noise_text.strip())

# %%
fig, panels = plt.subplots(1, len(FIELDS), figsize=(4.2 * len(FIELDS), 3.8))
panels = np.atleast_1d(panels)
colors = {"Data-Parallel": "tab:gray", "DiLoCo": "tab:blue", "Streaming FP4": "tab:red"}
for ax, field in zip(panels, FIELDS):
    for name, sweep in sweeps.items():
        curve = sweep.curve(field)
        values = list(curve)
        base = np.asarray(sweep.tuned_losses)
        rel = np.asarray([np.asarray(curve[v]) / base - 1 for v in values])
        mean = 100 * rel.mean(1)
        half = [100 * ex.t_half_width(row) for row in rel]
        ax.errorbar(
            values,
            mean,
            yerr=half,
            marker="o",
            capsize=3,
            color=colors[name],
            label=name,
        )
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(LABELS[field])
    ax.minorticks_off()
panels[0].set_ylabel("validation loss vs tuned (%)")
panels[0].legend()
fig.suptitle(
    f"One hyper-parameter moved from the tuned setting ({MODEL}; "
    "bars: 95 % seed-paired t-intervals)"
)
plotting.save_figure(
    fig, NOTEBOOK, notebook=NOTEBOOK, config=config, seeds=SEEDS, results=summary
)
plt.show()
