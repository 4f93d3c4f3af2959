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
# # Beyond the paper: Eager updates against the α-merge across the overlap τ
#
# **Question.** Our Fig. 8 measures a cost of overlap: the per-seed slope of the
# α = 0.5 gap to Data-Parallel against τ is resolved (about +1 % at τ = 15, where the
# paper saw < 0.2 % up to τ = 10). Eager updates (Kale et al., arXiv 2502.12996) use
# the overlap differently: at the send each replica applies the outer step it can
# take alone (its own outer gradient standing in for the average), and when the
# average arrives it swaps the stand-in for the real step, keeping its inner progress
# (`sdiloco.Eager`). Does Eager remove the cost of overlap?
#
# **Here.** `tiny-xs`, the one regime of the re-run notebooks (`experiments.setup`: 20
# tokens per parameter, 50 outer rounds, the tuned warmup, every held-out window),
# Streaming DiLoCo at the tuned settings of the final method with float32
# communication (as Fig. 8, to isolate τ), M = 2 and M = 4 (the global batch kept),
# τ ∈ {1, 2, 5, 10}, three merges: α = 0.5, α = 0 (at M = 2 both Fig. 8's runs) and
# Eager; three seeds each, read as seed-paired differences with 95 % intervals. Eager
# runs at the α-merge's tuned settings (not tuned on its own: labelled so), and M = 4
# at M = 2's. The one-outer-step form of Eager (τ = H) is not offered
# (`docs/decisions.md`), so τ stops at 10.

# %%
import matplotlib.pyplot as plt
import numpy as np

from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "eager_overlap"
SEEDS = ex.SEEDS
TAUS = (1,) if plotting.FAST else (1, 2, 5, 10)
REPLICAS = (2,) if plotting.FAST else (2, 4)
MERGES = {
    "alpha=0.5": {"alpha": 0.5},
    "alpha=0": {"alpha": 0.0},
    "eager": {"merge": "eager"},
}

# %%
configs, baselines = {}, {}
for m in REPLICAS:
    baselines[f"M={m}"] = ex.setup(
        "data_parallel", regime=ex.REGIME, method={"num_replicas": m}
    )
    for tau in TAUS:
        for name, merge in MERGES.items():
            configs[f"M={m}|tau={tau}|{name}"] = ex.setup(
                "streaming_overlap_fp4",
                regime=ex.REGIME,
                method={"quantizer": None, "overlap": tau, "num_replicas": m, **merge},
            )
results = ex.run_all(configs, SEEDS)
baseline = ex.run_all(baselines, SEEDS)
stats = ex.summarize(results)
first = configs[next(iter(configs))]
H = first.method.sync_every
ROUNDS = first.steps // H


def gaps(m, name):
    """`[seeds, τ]`: the relative gap to Data-Parallel at the same M (%)."""
    dp = ex.finals(baseline, f"M={m}")  # each τ paired with it by seed id
    pairs = [ex.paired(dp, ex.finals(results, f"M={m}|tau={t}|{name}")) for t in TAUS]
    gap = [100 * (loss - base) / base for base, loss in pairs]
    return np.asarray(gap)  # [τ, seeds]


# %%
rows = []
for m in REPLICAS:
    dp = ex.finals(baseline, f"M={m}")
    for tau in TAUS:
        row = {"M": m, "tau": tau}
        for name in MERGES:
            run = f"M={m}|tau={tau}|{name}"
            row[f"{name} vs DP"] = ex.gap_text(dp, ex.finals(results, run))
        for other in ("alpha=0.5", "alpha=0"):
            row[f"eager - {other}"] = ex.gap_text(
                ex.finals(results, f"M={m}|tau={tau}|{other}"),
                ex.finals(results, f"M={m}|tau={tau}|eager"),
            )
        rows.append(row)
slopes = []
for m in REPLICAS:
    for name in MERGES:
        if len(TAUS) < 2 or len(SEEDS) < 2:
            slopes.append({"M": m, "merge": name, "slope": "(FAST: no fit)"})
            continue
        fit = ex.seed_slopes(TAUS, gaps(m, name).T)
        slopes.append(
            {
                "M": m,
                "merge": name,
                "gap slope, % per step of tau": (
                    f"{fit['slope']:+.3f} [{fit['low']:+.3f}, {fit['high']:+.3f}]"
                ),
                "seeds": fit["n"],
            }
        )
    if len(TAUS) >= 2 and len(SEEDS) >= 2:  # the paired test: eager's slope less α's
        fit = ex.seed_slopes(TAUS, (gaps(m, "eager") - gaps(m, "alpha=0.5")).T)
        slopes.append(
            {
                "M": m,
                "merge": "eager - alpha=0.5",
                "gap slope, % per step of tau": (
                    f"{fit['slope']:+.3f} [{fit['low']:+.3f}, {fit['high']:+.3f}]"
                ),
                "seeds": fit["n"],
            }
        )
title = (
    f"Eager vs the alpha-merge across tau ({first.model}, H = {H}, {ROUNDS} rounds, "
    f"{ex.REGIME.tokens_per_param:g} tokens/param, float32 communication)"
)
notes = (
    "Seed-paired gaps: relative mean [95 % t-interval of the differences, nats/byte], "
    f"seeds {list(SEEDS)}. Eager runs at the alpha-merge's tuned settings (untuned)."
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
plotting.save_table(
    slopes,
    f"{NOTEBOOK}_slopes",
    title="The cost of overlap: the slope of the gap to Data-Parallel against tau",
    notes=(
        "Per seed, the least-squares slope of the gap against tau; the mean of the "
        "seeds' slopes with its 95 % t-interval (seeds - 1 dof). 'eager - "
        "alpha=0.5': the slope of eager's gap less alpha=0.5's, seed by seed."
    ),
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))
print(plotting.markdown_table(slopes))

# %%
colors = {"alpha=0.5": "tab:red", "alpha=0": "tab:gray", "eager": "tab:blue"}
fig, axes = plt.subplots(
    1, len(REPLICAS), figsize=(5 * len(REPLICAS), 4), squeeze=False
)
for ax, m in zip(axes[0], REPLICAS):
    for name in MERGES:
        y = gaps(m, name)
        mean = y.mean(1)
        half = [ex.t_half_width(row) for row in y]
        label = f"{name} (untuned)" if name == "eager" else name
        ax.errorbar(
            TAUS,
            mean,
            yerr=half,
            marker="o",
            capsize=3,
            color=colors[name],
            label=label,
        )
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xlabel("overlapped inner steps τ")
    ax.set_ylabel("gap to Data-Parallel (%)")
    ax.set_title(f"M = {m} (mean and 95 % interval over {len(SEEDS)} seeds)")
    ax.legend()
fig.suptitle("Eager updates vs the α-merge", y=1.03)
plotting.save_figure(
    fig, NOTEBOOK, notebook=NOTEBOOK, config=configs, seeds=SEEDS, results=stats
)
plt.show()

# %% [markdown]
# ## Verdict
#
# Printed below from the records, each a seed-paired difference inside its 95 %
# interval.
#
# - **Does Eager remove the cost of overlap? Not resolved.** Its slope against τ is
#   the smallest in the mean at both M, but the interval of the slope difference
#   spans 0, and the half-width of Eager's own slope interval is several times the
#   difference of the means.
# - **Eager sits behind α = 0.5 at every τ measured and both M** (resolved).
# - **Against α = 0**, the same step taken on arrival without the stand-in, Eager is
#   resolved ahead only where printed below; elsewhere the two are not told apart.
#   In the streaming form, taking the averaged step on arrival throws away what
#   α = 0.5's averaging of local and global keeps, and the stand-in step does not win
#   it back over τ ≤ 10. Eager runs at the α-merge's settings, untuned.


# %%
def resolved(g):
    return "resolved" if g["low"] > 0 or g["high"] < 0 else "not resolved"


lines = []
if len(SEEDS) < 2 or len(TAUS) < 2:
    lines.append("(FAST: one seed or one tau, no verdict)")
else:
    for m in REPLICAS:
        fits = {n: ex.seed_slopes(TAUS, gaps(m, n).T) for n in MERGES}
        paired = ex.seed_slopes(TAUS, (gaps(m, "eager") - gaps(m, "alpha=0.5")).T)
        diff = fits["alpha=0.5"]["slope"] - fits["eager"]["slope"]
        half = (fits["eager"]["high"] - fits["eager"]["low"]) / 2
        lines.append(
            f"M = {m}: slope of the gap, % per step of tau: eager "
            f"{fits['eager']['slope']:+.3f}, alpha=0.5 {fits['alpha=0.5']['slope']:+.3f}; "
            f"eager - alpha=0.5 {paired['slope']:+.3f} [{paired['low']:+.3f}, "
            f"{paired['high']:+.3f}] ({resolved(paired)}); the half-width of eager's "
            f"own slope interval is {half / abs(diff):.0f}x the difference of the means."
        )
        for other in ("alpha=0.5", "alpha=0"):
            cells = []
            for tau in TAUS:
                base = ex.finals(results, f"M={m}|tau={tau}|{other}")
                eager = ex.finals(results, f"M={m}|tau={tau}|eager")
                g = ex.paired_gap(base, eager)
                cells.append(f"tau = {tau} {ex.gap_text(base, eager)} ({resolved(g)})")
            lines.append(f"M = {m}, eager - {other}: " + "; ".join(cells))
print("\n".join(lines))
