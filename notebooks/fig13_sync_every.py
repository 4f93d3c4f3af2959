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
# # Fig. 13: the sync period H, DiLoCo vs Streaming DiLoCo
#
# **Paper.** With the total number of steps fixed, H is varied for DiLoCo and Streaming
# DiLoCo. "A too small H produce[s] noisy small-normed outer gradients and a too high H
# will see replicas drifting apart … while Streaming DiLoCo has similar behavior as
# DiLoCo when H increases, it is more robust to low values of H."
#
# **Here.** `tiny-xs`, M = 2, at the one regime of the re-run notebooks
# (`experiments.setup`: the tuned warmup, every held-out window scored) and the
# compute-optimal 20 tokens per parameter, with the
# number of outer rounds swept 50 → 800 (H = 64, 16 and 4 inner steps; the steps stay
# fixed): the small-H side, where DiLoCo collapsed in our untuned runs. The large-H
# side (12 to 50 rounds, Streaming FP4) is in the `hyperparameter_sweep` notebook.
# DiLoCo (whole model, float32) at its tuned settings against Streaming DiLoCo (3-layer
# strided fragments, float32, no overlap) at the same settings (its tuned inner
# learning rate, batch, outer optimizer and warmup), so that only the fragmenting
# differs; and DiLoCo with the paper's outer optimizer (Nesterov, lr 0.4,
# momentum 0.9) to show where the small-H collapse comes from. Three seeds;
# Data-Parallel (tuned) as the reference.

# %%
import dataclasses

import matplotlib.pyplot as plt

from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "fig13_sync_every"
ROUNDS = (2,) if plotting.FAST else (50, 200, 800)
SEEDS = ex.SEEDS
diloco = ex.setup("diloco", regime=ex.REGIME)
TUNED = {  # DiLoCo's tuned settings, its warmup included, for every method of the sweep
    "inner": {"lr": diloco.inner.lr, "warmup_fraction": diloco.inner.warmup_fraction},
    "data": {"global_batch_size": diloco.data.global_batch_size},
}
TUNED_OUTER = {"lr": diloco.method.outer.lr, "momentum": diloco.method.outer.momentum}
METHODS = {
    "DiLoCo": ("diloco", {"outer": TUNED_OUTER}),
    "Streaming DiLoCo": ("streaming", {"outer": TUNED_OUTER}),
    "DiLoCo, paper's outer optimizer": (
        "diloco",
        {"outer": {"lr": 0.4, "momentum": 0.9}},
    ),
}

# %%
configs = {
    f"{method}|R={r}": ex.setup(
        preset,
        regime=dataclasses.replace(ex.REGIME, rounds=r),
        method=method_changes,
        **TUNED,
    )
    for method, (preset, method_changes) in METHODS.items()
    for r in ROUNDS
}
H = {r: configs[f"DiLoCo|R={r}"].method.sync_every for r in ROUNDS}
results = ex.run_all(configs, SEEDS)
stats = ex.summarize(results)
dp_results = ex.run_all(
    {"Data-Parallel": ex.setup("data_parallel", regime=ex.REGIME)}, SEEDS
)
dp = ex.summarize(dp_results)["Data-Parallel"]


def gap(method: str, r: int) -> str:
    """Seed-paired gap of `method` at `r` rounds to Data-Parallel."""
    return ex.gap_text(
        ex.finals(dp_results, "Data-Parallel"), ex.finals(results, f"{method}|R={r}")
    )


# %%
steps = configs[f"DiLoCo|R={ROUNDS[0]}"].steps
rows = [
    {
        "outer rounds": r,
        "H": H[r],
        **{f"{m}: loss": ex.mean_pm(stats[f"{m}|R={r}"], 4) for m in METHODS},
        **{f"{m}: vs Data-Parallel": gap(m, r) for m in METHODS},
        "Streaming DiLoCo vs DiLoCo": ex.gap_text(
            ex.finals(results, f"DiLoCo|R={r}"),
            ex.finals(results, f"Streaming DiLoCo|R={r}"),
        ),
    }
    for r in ROUNDS
]
rows.append(
    {"outer rounds": "Data-Parallel", "H": 1, "DiLoCo: loss": ex.mean_pm(dp, 4)}
)
plotting.save_table(
    rows,
    "fig13_sync_every",
    title=(
        f"Fig. 13: held-out loss (nats/byte) vs H at a fixed {steps} steps ({ex.MODEL}, "
        f"{ex.REGIME.tokens_per_param:g} tokens/param, M = 2, float32, τ = 0)"
    ),
    notes=(
        f"Mean ± std over seeds {list(SEEDS)}; gaps: seed-paired, relative mean "
        "[95 % interval in nats/byte]. DiLoCo's tuned settings for every row: inner lr "
        f"{diloco.inner.lr}, batch {diloco.data.global_batch_size}, outer lr "
        f"{diloco.method.outer.lr}, momentum {diloco.method.outer.momentum} (the "
        "paper's outer optimizer: lr 0.4, momentum 0.9)."
    ),
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))

fig, ax = plt.subplots()
hs = [H[r] for r in ROUNDS]
for method, color in zip(METHODS, ("tab:orange", "tab:green", "tab:gray")):
    mean = [stats[f"{method}|R={r}"]["mean"] for r in ROUNDS]
    low = [stats[f"{method}|R={r}"]["min"] for r in ROUNDS]
    high = [stats[f"{method}|R={r}"]["max"] for r in ROUNDS]
    ax.plot(hs, mean, marker="o", color=color, label=method)
    ax.fill_between(hs, low, high, color=color, alpha=0.15)
ax.axhline(dp["mean"], color="tab:blue", ls="--", label="Data-Parallel")
ax.set_xscale("log")
ax.minorticks_off()
ax.set_xticks(hs, [str(h) for h in hs])
ax.set_xlabel(f"inner steps between syncs H (log scale; {steps} steps in all)")
ax.set_ylabel("held-out loss (nats/byte)")
ax.set_title("Fig. 13: varying H at a constant number of steps (band: min-max)")
ax.legend()
plotting.save_figure(
    fig,
    "fig13_sync_every",
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
    results=stats,
)
plt.show()
