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
# # Beyond the paper: the compression frontier
#
# *Draft: `python -m sdiloco.paper` does not run `notebooks/drafts/`. It moves to
# `notebooks/` once its runs are recorded (`python -m sdiloco.paper.frontier --shard I
# N`, resumable), so that the figure command re-renders it from records.*
#
# **Question.** Each paper of the DiLoCo family reports its own recipe for what goes on
# the wire, at its own scale: 4-bit floats (Streaming DiLoCo, E3M0), 2-bit with error
# feedback (MuLoCo, with Muon inside), top-k with 2-bit values and error feedback
# (SparseLoCo), int8 (INTELLECT-1). Side by side, on one model, one budget and one
# tuning protocol: how many bits per parameter per outer round does each send, and
# what does it cost in held-out loss?
#
# **Here.** `tiny-xs`, 20 tokens per parameter, 50 outer rounds, every held-out
# window (`experiments.REGIME`), M = 2 and M = 4 (the global batch kept), three
# seeds, read as seed-paired gaps to Data-Parallel with 95 % intervals. Every recipe is
# Streaming DiLoCo with the paper's fragments and overlap (τ = 1, α = 0.5); only what
# is sent and the optimizers change (`sdiloco.paper.frontier.RECIPES`). **Tuning:**
# each recipe by the same reduced protocol (`frontier.tune`): the inner learning rate
# (2x apart), then the outer learning rate, on the validation split, seed 0, M = 2,
# from the final method's tuned settings; the outer momentum, batch and warmup keep
# the final method's values (SparseLoCo's outer SGD has none). **The x-axis** is read
# from the compiled wire (`frontier.wire_bits`: the bytes of every fragment's packed
# message, as the exchanges send it), not from a formula.

# %%
import matplotlib.pyplot as plt
import numpy as np

from sdiloco.paper import experiments as ex, frontier, plotting


plotting.style()
NOTEBOOK = "compression_frontier"
SEEDS = ex.SEEDS
MODEL = ex.MODEL
REPLICAS = (2,) if plotting.FAST else (2, 4)
RECIPES = list(frontier.RECIPES)[:2] if plotting.FAST else list(frontier.RECIPES)

# %%
searches = {r: frontier.tune(r, MODEL, regime=ex.REGIME) for r in RECIPES}
configs, baselines = {}, {}
for m in REPLICAS:
    baselines[f"M={m}"] = frontier.baseline(m, model=MODEL, regime=ex.REGIME)
    for r in RECIPES:
        configs[f"M={m}|{r}"] = frontier.tuned_config(
            r, searches[r], model=MODEL, regime=ex.REGIME, num_replicas=m
        )
results = ex.run_all(configs, SEEDS)
baseline = ex.run_all(baselines, SEEDS)
bits = {r: frontier.wire_bits(configs[f"M={REPLICAS[0]}|{r}"]) for r in RECIPES}
first = configs[f"M={REPLICAS[0]}|{RECIPES[0]}"]
H = first.method.sync_every
ROUNDS = first.steps // H

# %%
rows, points = [], {m: {} for m in REPLICAS}
for m in REPLICAS:
    dp = ex.finals(baseline, f"M={m}")
    for r in RECIPES:
        losses = ex.finals(results, f"M={m}|{r}")
        chosen = searches[r].best_values(frontier.axes(r, MODEL))
        gap = 100 * (np.mean(losses) - np.mean(dp)) / np.mean(dp)
        points[m][r] = (bits[r], gap)
        rows.append(
            {
                "M": m,
                "recipe": r,
                "bits/param/round (wire)": round(bits[r], 3),
                "inner lr": chosen["inner.lr"],
                "outer lr": chosen["method.outer.lr"],
                "held-out loss": ex.mean_pm(ex.describe(losses), 4),
                "vs Data-Parallel": ex.gap_text(dp, losses),
                f"vs {frontier.PAPER}": "—"
                if r == frontier.PAPER or frontier.PAPER not in RECIPES
                else ex.gap_text(ex.finals(results, f"M={m}|{frontier.PAPER}"), losses),
            }
        )
fronts = {m: frontier.frontier(points[m]) for m in REPLICAS}
for row in rows:
    row["on the frontier"] = "yes" if row["recipe"] in fronts[row["M"]] else ""
title = (
    f"The compression frontier ({MODEL}, H = {H}, {ROUNDS} rounds, "
    f"{ex.REGIME.tokens_per_param:g} tokens/param, seeds {list(SEEDS)})"
)
notes = (
    "Seed-paired gaps: relative mean [95 % t-interval of the differences, nats/byte]. "
    "Bits per parameter per outer round from the compiled wire (every fragment once "
    "per round; codes packed at their width, scales and kept values raw). Each recipe "
    "tuned on the validation split at M = 2 (inner lr, then outer lr); M = 4 reuses "
    "those values. 'On the frontier': no recipe with as few or fewer bits has a lower "
    "mean gap."
)
plotting.save_table(
    rows,
    NOTEBOOK,
    title=title,
    notes=notes,
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))

# %%
fig, axes = plt.subplots(
    1, len(REPLICAS), figsize=(6 * len(REPLICAS), 4.5), squeeze=False
)
for ax, m in zip(axes[0], REPLICAS):
    dp = np.asarray(ex.finals(baseline, f"M={m}"))
    for r in RECIPES:
        losses = np.asarray(ex.finals(results, f"M={m}|{r}"))
        gaps = 100 * (losses - dp) / dp.mean()
        paper = r == frontier.PAPER
        ax.errorbar(
            bits[r],
            gaps.mean(),
            yerr=ex.t_half_width(gaps),
            marker="*" if paper else "o",
            markersize=12 if paper else 6,
            capsize=3,
            color="tab:red" if paper else "tab:blue",
        )
        ax.annotate(
            r,
            (bits[r], gaps.mean()),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    front = fronts[m]
    ax.plot(
        [points[m][r][0] for r in front],
        [points[m][r][1] for r in front],
        "k--",
        lw=1,
        label="Pareto frontier",
    )
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bits per parameter per outer round (compiled wire)")
    ax.set_ylabel("gap to Data-Parallel (%)")
    ax.set_title(f"M = {m} (mean, 95 % interval over {len(SEEDS)} seeds; ★ the paper)")
    ax.legend()
fig.suptitle(title)
plotting.save_figure(
    fig, NOTEBOOK, notebook=NOTEBOOK, config=configs, seeds=SEEDS, results=rows
)
plt.show()
