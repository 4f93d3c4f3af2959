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
# # Fig. 10: a different overlap τ per replica (τ1 = 1, τ2 swept)
#
# **Paper.** The second replica receives the global fragment τ2 steps after it was sent
# while the first gets it after τ1 = 1, α = 0.5 throughout. "Training is very robust for
# values of τ2 less than 5"; the loss degrades beyond.
#
# **Here.** `tiny-s`, M = 2, H = 20, overlapped float32 communication, α = 0.5,
# τ1 = 1 and τ2 ∈ {1, 2, 5, 10, 15} (a per-replica `overlap=(1, τ2)`; the outer step of
# a fragment happens at the earliest arrival, τ1), one seed. τ2 = 1 is the same run as
# Fig. 8's τ = 1, α = 0.5 (shared through the run cache).

# %%
import matplotlib.pyplot as plt

from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "fig10_heterogeneous_tau"
TAU2 = (1, 2) if plotting.FAST else (1, 2, 5, 10, 15)
SEEDS = (0,)
LABEL = ex.pretuning_label(SEEDS)

# %%
configs = {
    f"tau2={t}": ex.small_setup(
        "streaming_overlap", method={"overlap": 1 if t == 1 else (1, t), "alpha": 0.5}
    )
    for t in TAU2
}
results = ex.run_all(configs, SEEDS)
stats = ex.summarize(results)
ref = stats[f"tau2={TAU2[0]}"]["mean"]
rows = [
    {
        "tau1": 1,
        "tau2": t,
        "held-out loss (nats/byte)": round(stats[f"tau2={t}"]["mean"], 4),
        "vs tau2=1 (%)": round(100 * (stats[f"tau2={t}"]["mean"] / ref - 1), 2),
    }
    for t in TAU2
]
plotting.save_table(
    rows,
    "fig10_heterogeneous_tau",
    title="Fig. 10: per-replica overlap, τ1 = 1 and τ2 swept (tiny-s, M = 2, H = 20, α = 0.5)",
    notes=LABEL,
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))

fig, ax = plt.subplots()
ax.plot(
    TAU2,
    [stats[f"tau2={t}"]["mean"] for t in TAU2],
    marker="o",
    color="tab:red",
    label="Streaming, τ1 = 1, α = 0.5",
)
ax.set_xlabel("overlap of the second replica τ2 (inner steps)")
ax.set_ylabel("held-out loss (nats/byte)")
ax.set_title("Fig. 10: heterogeneous overlap")
ax.legend()
plotting.save_figure(
    fig,
    "fig10_heterogeneous_tau",
    label=LABEL,
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
    results=stats,
)
plt.show()
