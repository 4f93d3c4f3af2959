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
# **Here.** `tiny-s`, M = 2, 320 steps, H ∈ {5, 20, 80} (64, 16 and 4 rounds); DiLoCo (whole model,
# float32) against Streaming DiLoCo (3-layer strided fragments, float32, no overlap, so
# that only the fragmenting differs), one seed; Data-Parallel as the reference.

# %%
import matplotlib.pyplot as plt

from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "fig13_sync_every"
HS = (4,) if plotting.FAST else (5, 20, 80)
METHODS = {"DiLoCo": "diloco", "Streaming DiLoCo": "streaming"}
SEEDS = (0,)

# %%
configs = {
    f"{method}|H={h}": ex.setup(preset, sync_every=h)
    for method, preset in METHODS.items()
    for h in HS
}
results = ex.run_all(configs, SEEDS)
stats = ex.summarize(results)
dp = ex.summarize(ex.run_all({"Data-Parallel": ex.setup("data_parallel")}, SEEDS))[
    "Data-Parallel"
]

# %%
rows = [
    {
        "H": h,
        **{f"{m} loss": round(stats[f"{m}|H={h}"]["mean"], 4) for m in METHODS},
        "Streaming − DiLoCo": round(
            stats[f"Streaming DiLoCo|H={h}"]["mean"] - stats[f"DiLoCo|H={h}"]["mean"], 4
        ),
    }
    for h in HS
]
rows.append({"H": "Data-Parallel", "DiLoCo loss": round(dp["mean"], 4)})
plotting.save_table(
    rows,
    "fig13_sync_every",
    title="Fig. 13: held-out loss (nats/byte) vs H at a fixed 320 steps (tiny-s, M = 2, float32, τ = 0)",
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))

fig, ax = plt.subplots()
for (method, _), color in zip(METHODS.items(), ("tab:orange", "tab:green")):
    ax.plot(
        HS,
        [stats[f"{method}|H={h}"]["mean"] for h in HS],
        marker="o",
        color=color,
        label=method,
    )
ax.axhline(dp["mean"], color="tab:blue", ls="--", label="Data-Parallel")
ax.set_xscale("log")
ax.set_xticks(HS, [str(h) for h in HS])
ax.set_xlabel("inner steps between syncs H (log scale; 320 steps in all)")
ax.set_ylabel("held-out loss (nats/byte)")
ax.set_title("Fig. 13: varying H at a constant number of steps")
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
