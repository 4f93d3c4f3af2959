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
# # Fig. 12: the number of replicas M, constant global batch vs constant local batch
#
# **Paper.** M is scaled from 2 upwards (the caption says to 4, the appendix text to 8)
# for DiLoCo and Streaming DiLoCo at a constant token budget: (a) keeping the global
# batch constant (smaller per-replica batches), (b) keeping the per-replica batch
# constant (a larger global batch, hence fewer steps). Loss grows with M in both, and
# Streaming DiLoCo tracks DiLoCo.
#
# **Here.** `tiny-xs` at the one regime of the re-run notebooks (`experiments.setup`:
# each method's tuned settings, 20 tokens per parameter, 50 outer rounds, every
# held-out window scored), M ∈ {2, 4} (the caption's range; two CPU cores did not
# leave time for 8), DiLoCo and Streaming DiLoCo with overlapped FP4, 3 seeds, the
# same tokens in every run: (a) the tuned global batch split over the replicas;
# (b) the tuned batch per pair of replicas kept, so M = 4 doubles the global batch
# and halves the steps (and H, the rounds staying 50). Gaps are seed-paired against
# M = 2.

# %%
import matplotlib.pyplot as plt

from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "fig12_num_replicas"
REPLICAS = (2, 4)
METHODS = {"DiLoCo": "diloco", "Streaming FP4": "streaming_overlap_fp4"}
if plotting.FAST:
    METHODS = {"Streaming FP4": "streaming_overlap_fp4"}
MODES = {"constant global batch": 1, "constant local batch": 2}
"""How much the global batch grows from M = 2 to M = 4."""
if plotting.FAST:
    MODES = {"constant global batch": 1}
SEEDS = ex.SEEDS


def config(preset: str, m: int, growth: int):
    tuned = ex.setup(preset).data.global_batch_size
    changes = {} if m == 2 else {"method": {"num_replicas": m}}
    if m > 2 and growth > 1:
        changes["data"] = {"global_batch_size": tuned * growth}
    return ex.setup(preset, **changes)


# %%
configs = {
    f"{mode}|{method}|M={m}": config(preset, m, growth)
    for mode, growth in MODES.items()
    for method, preset in METHODS.items()
    for m in REPLICAS
}
results = ex.run_all(configs, SEEDS)
stats = ex.summarize(results)

# %%
rows = []
for name, c in configs.items():
    mode, method, m = name.split("|")
    base = f"{mode}|{method}|M={REPLICAS[0]}"
    rows.append(
        {
            "batch": mode,
            "method": method,
            "M": int(m[2:]),
            "global batch (sequences)": c.data.global_batch_size,
            "steps": c.steps,
            "H": c.method.sync_every,
            "held-out loss (nats/byte)": ex.mean_pm(stats[name], 4),
            "vs M = 2": "—"
            if name == base
            else ex.gap_text(ex.finals(results, base), ex.finals(results, name)),
        }
    )
plotting.save_table(
    rows,
    "fig12_num_replicas",
    title=(
        f"Fig. 12: scaling M at a constant token budget ({ex.MODEL}, "
        f"{ex.REGIME.tokens_per_param:g} tokens/param, {ex.REGIME.rounds} rounds, "
        f"seeds {list(SEEDS)})"
    ),
    notes=(
        "Held-out loss: mean ± std over seeds, every held-out window. vs M = 2: "
        "seed-paired relative mean and 95 % t-interval of the differences in nats."
    ),
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))

fig, axes = plt.subplots(
    1, len(MODES), figsize=(5.5 * len(MODES), 4), sharey=True, squeeze=False
)
for ax, mode in zip(axes[0], MODES):
    for (method, _), color in zip(METHODS.items(), ("tab:orange", "tab:red")):
        ax.errorbar(
            REPLICAS,
            [stats[f"{mode}|{method}|M={m}"]["mean"] for m in REPLICAS],
            yerr=[stats[f"{mode}|{method}|M={m}"]["std"] for m in REPLICAS],
            marker="o",
            capsize=3,
            color=color,
            label=method,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(REPLICAS, [str(m) for m in REPLICAS])
    ax.set_xlabel("replicas M")
    ax.set_title(f"({'ab'[list(MODES).index(mode)]}) {mode}")
    ax.legend()
axes[0][0].set_ylabel("held-out loss (nats/byte)")
fig.suptitle(
    f"Fig. 12: number of replicas at a constant token budget ({ex.MODEL}; "
    "bars: std over seeds)"
)
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig12_num_replicas",
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
    results=stats,
)
plt.show()
