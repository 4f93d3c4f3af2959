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
# **Here.** `tiny-s`, M ∈ {2, 4} (the caption's range; two CPU cores did not leave time for 8), H = 20, DiLoCo (float32) and Streaming DiLoCo with
# overlapped FP4 communication, one seed, 327,680 training bytes in every run:
# (a) 16 sequences per step over all replicas for 320 steps; (b) 8 sequences per
# replica, so 320 / 160 steps for M = 2 / 4.

# %%
import matplotlib.pyplot as plt

from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "fig12_num_replicas"
REPLICAS = (2, 4)
METHODS = {"DiLoCo": "diloco", "Streaming FP4": "streaming_overlap_fp4"}
if plotting.FAST:
    METHODS = {"Streaming FP4": "streaming_overlap_fp4"}
MODES = {
    "constant global batch": lambda m: (16, ex.STEPS),
    "constant local batch": lambda m: (8 * m, ex.STEPS * 2 // m),
}
if plotting.FAST:
    MODES = {"constant global batch": MODES["constant global batch"]}
SEEDS = (0,)
LABEL = ex.pretuning_label(SEEDS)

# %%
configs = {}
for mode, shape in MODES.items():
    for method, preset in METHODS.items():
        for m in REPLICAS:
            batch, steps = shape(m)
            configs[f"{mode}|{method}|M={m}"] = ex.small_setup(
                preset,
                steps=steps,
                sync_every=ex.paper_h(100),
                method={"num_replicas": m},
                data={"global_batch_size": batch},
            )
results = ex.run_all(configs, SEEDS)
stats = ex.summarize(results)

# %%
rows = []
for name, c in configs.items():
    mode, method, m = name.split("|")
    rows.append(
        {
            "batch": mode,
            "method": method,
            "M": int(m[2:]),
            "global batch (sequences)": c.data.global_batch_size,
            "steps": c.steps,
            "held-out loss (nats/byte)": round(stats[name]["mean"], 4),
        }
    )
plotting.save_table(
    rows,
    "fig12_num_replicas",
    title="Fig. 12: scaling M at a constant token budget (tiny-s, H = 20)",
    notes=LABEL,
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
        ax.plot(
            REPLICAS,
            [stats[f"{mode}|{method}|M={m}"]["mean"] for m in REPLICAS],
            marker="o",
            color=color,
            label=method,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(REPLICAS, [str(m) for m in REPLICAS])
    ax.set_xlabel("replicas M")
    ax.set_title(f"({'ab'[list(MODES).index(mode)]}) {mode}")
    ax.legend()
axes[0][0].set_ylabel("held-out loss (nats/byte)")
fig.suptitle("Fig. 12: number of replicas at a constant token budget")
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig12_num_replicas",
    label=LABEL,
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
    results=stats,
)
plt.show()
