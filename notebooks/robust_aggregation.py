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
# # Beyond the paper: robust aggregation when one replica turns bad
#
# **Question.** Streaming DiLoCo averages the replicas' outer gradients. One replica
# that sends garbage (a bug, a bad host, a flipped sign) then moves θ_g as much as
# an honest one. Do the robust aggregators of `sdiloco.aggregation` (a
# coordinate-wise trimmed mean, a median, a norm-clipped mean) keep training on
# course, and what do they cost when nobody is bad?
#
# **Here.** `tiny-xs`, the one regime of the re-run notebooks (`experiments.setup`:
# 20 tokens per parameter, 50 outer rounds, the tuned warmup, every held-out
# window), the headline Streaming DiLoCo (E3M0, τ = 1, α = 0.5) at its tuned
# settings with M = 4 replicas (the global batch kept). Replica 0 sends, at every
# send, from the start: its Δ sign-flipped, Δ × 10, Gaussian noise of Δ's norm, or
# NaN (`sdiloco.sim.faults.bad_replica`; it keeps training honestly on its data).
# Four aggregators: the mean (the paper's), `trimmed_mean(0.25)`, `median()` and
# `clipped_mean()` (each row clipped to twice the senders' median norm); three
# seeds each, read as seed-paired differences with 95 % intervals against the mean
# with nobody bad. With M = 4 senders a 25 % trim drops one value at each end, which
# is the median of four; they differ only when a NaN row is left out (three
# senders: the trimmed mean keeps all three, the median the middle one).

# %%
import matplotlib.pyplot as plt
import numpy as np

from sdiloco import aggregation
from sdiloco.paper import experiments as ex, plotting
from sdiloco.sim.faults import bad_replica


plotting.style()
NOTEBOOK = "robust_aggregation"
SEEDS = ex.SEEDS
REPLICAS = 4
AGGREGATORS = {
    "mean": None,
    "trimmed mean": aggregation.trimmed_mean(0.25),
    "median": aggregation.median(),
    "clipped mean": aggregation.clipped_mean(),
}
FAULTS = {"none": None, "sign": "sign", "x10": "scale", "noise": "noise", "NaN": "nan"}
if plotting.FAST:
    AGGREGATORS = {k: AGGREGATORS[k] for k in ("mean", "median")}
    FAULTS = {k: FAULTS[k] for k in ("none", "sign")}

# %%
configs = {}
for fault, kind in FAULTS.items():
    for name, aggregator in AGGREGATORS.items():
        method = {"num_replicas": REPLICAS}
        if aggregator is not None:
            method["aggregator"] = aggregator
        if kind is not None:
            method["plugins"] = (bad_replica(kind),)
        configs[f"{fault}|{name}"] = ex.setup(
            "streaming_overlap_fp4", regime=ex.REGIME, method=method
        )
results = ex.run_all(configs, SEEDS)
stats = ex.summarize(results)
first = configs[next(iter(configs))]
H = first.method.sync_every
ROUNDS = first.steps // H
clean = ex.finals(results, "none|mean")

# %%
rows = []
for fault in FAULTS:
    row = {"bad replica sends": fault}
    for name in AGGREGATORS:
        finals = ex.finals(results, f"{fault}|{name}")
        losses = np.asarray(list(finals), float)
        row[name] = (
            f"{np.nanmean(losses):.4f}"
            if np.all(np.isfinite(losses))
            else f"{np.nanmean(losses):.4f} ({int(np.sum(~np.isfinite(losses)))} NaN)"
        )
        row[f"{name} vs clean mean"] = ex.gap_text(clean, finals)
    rows.append(row)
title = (
    f"Robust aggregation, one bad replica of M = {REPLICAS} ({first.model}, H = {H}, "
    f"{ROUNDS} rounds, {ex.REGIME.tokens_per_param:g} tokens/param, E3M0)"
)
notes = (
    "Held-out loss (nats/byte, mean over seeds); 'vs clean mean': the seed-paired "
    "relative gap to the plain mean with nobody bad [95 % t-interval of the "
    f"differences], seeds {list(SEEDS)}. The aggregators run at the mean's tuned "
    "settings (not re-tuned)."
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
def percent_gap(fault, name):
    """The seed-paired gap to the clean mean in % of its loss, and the interval's
    half-width (0 with one seed)."""
    base, other = ex.paired(clean, ex.finals(results, f"{fault}|{name}"))
    d = other - base
    half = ex.t_half_width(d) if d.size > 1 else 0.0
    return 100 * d.mean() / base.mean(), 100 * half / base.mean()


fig, ax = plt.subplots(figsize=(9, 4))
width = 0.8 / len(AGGREGATORS)
for j, name in enumerate(AGGREGATORS):
    means, halves = zip(*(percent_gap(fault, name) for fault in FAULTS))
    x = np.arange(len(FAULTS)) + (j - (len(AGGREGATORS) - 1) / 2) * width
    shown = np.clip(np.nan_to_num(means, nan=25.0), None, 25.0)
    ax.bar(x, shown, width, yerr=np.nan_to_num(halves), capsize=2, label=name)
ax.set_xticks(np.arange(len(FAULTS)), list(FAULTS))
ax.set_xlabel("what the bad replica sends")
ax.set_ylabel("gap to the clean mean (%, clipped at 25)")
ax.axhline(0.0, color="black", lw=0.8)
ax.legend()
ax.set_title(
    f"One bad replica of {REPLICAS}: mean and 95 % interval over {len(SEEDS)} seeds"
)
plotting.save_figure(
    fig, NOTEBOOK, notebook=NOTEBOOK, config=configs, seeds=SEEDS, results=stats
)
plt.show()

# %% [markdown]
# ## Verdict
#
# From the records (3 seeds, gaps to the plain mean with nobody bad, seed-paired 95 %
# intervals; printed below):
#
# - **Nobody bad: no cost resolved.** The median (and the 25 % trimmed mean, the same
#   numbers with four finite senders) reads −0.1 % [−0.016, +0.013], the clipped mean
#   +0.1 % [−0.002, +0.006] nats/byte.
# - **Δ × 10: the mean pays +6.9 % (resolved); every robust aggregator removes it**
#   (median −0.8 % [−0.040, +0.008], clipped −0.1 % [−0.021, +0.018]: no cost
#   resolved).
# - **NaN: the mean cannot train**: every round fails under `nonfinite="skip"`, and
#   the held-out loss stays at 5.55 nats/byte, ln 256, the untrained model's
#   (+188 %); the robust ones leave the NaN sender out and show no resolved cost
#   (median +0.3 % [−0.006, +0.016]).
# - **A sign flip is reduced, not removed**: median +3.5 % against the mean's +5.6 %
#   (both resolved); the clipped mean is the mean here, since a flip keeps the norm.
# - **Noise of Δ's norm costs +1.5 % whatever the aggregator** (resolved for all
#   four, with the same mean): no aggregator here removes it.
#
# So: a median or a clip is free insurance against a replica that blows up or goes
# NaN, at this scale; neither defends against a replica that sends a plausible but
# wrong direction. One model size, M = 4, the mean's tuned settings.


# %%
def verdict(fault, name):
    finals = ex.finals(results, f"{fault}|{name}")
    g = ex.paired_gap(clean, finals)
    if not np.isfinite(g["mean"]):
        return f"{fault}, {name}: diverged (NaN)"
    side = "resolved" if g["low"] > 0 or g["high"] < 0 else "not resolved"
    return f"{fault}, {name}: {ex.gap_text(clean, finals)} ({side})"


if len(SEEDS) < 2:
    print("(FAST: one seed, no verdict)")
else:
    print("\n".join(verdict(f, n) for f in FAULTS for n in AGGREGATORS))
