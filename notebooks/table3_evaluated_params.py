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
# # Table 3: which parameters to evaluate
#
# **Paper.** "Evaluating the outer parameters, where each fragment has been
# synchronized at a different moment in time, yields better performance than any inner
# parameters": first replica 2.77, replicas' average 2.68, outer parameters 2.67.
#
# **Here.** Streaming DiLoCo with overlapped FP4 communication on `tiny-xs` at its
# tuned settings, at the one regime of the re-run notebooks (`experiments.setup`: 20
# tokens per parameter, 50 outer rounds, H = steps / 50, the tuned warmup, every
# held-out window scored), M = 2, three seeds; the same runs are evaluated with the
# first replica's parameters, the average of the replicas' parameters, and the outer
# (global) parameters θ_g, at every evaluation step. Downstream accuracy (HellaSwag) is not
# computable offline.

# %%
import matplotlib.pyplot as plt

from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "table3_evaluated_params"
SEEDS = ex.SEEDS
WHICH = {
    "First replica": "first",
    "Replicas average": "average",
    "Outer parameters": "global",
}
PAPER = {"First replica": 2.77, "Replicas average": 2.68, "Outer parameters": 2.67}

# %%
config = ex.setup(
    "streaming_overlap_fp4",
    eval_params=("first", "average", "global"),
)
results = ex.run_all({"streaming": config}, SEEDS)
rows = []
for label, key in WHICH.items():
    s = ex.summarize(results, f"eval/{key}")["streaming"]
    rows.append(
        {
            "Parameters evaluated": label,
            "Eval loss (paper)": PAPER[label],
            "Held-out loss, nats/byte (ours)": ex.mean_pm(s, 4),
            "_mean": s["mean"],
        }
    )
best = min(rows, key=lambda r: r["_mean"])["Parameters evaluated"]
outer = [r.final("eval/global") for r in results]
paired = "; ".join(
    f"{label} " + ex.gap_text(outer, [r.final(f"eval/{key}") for r in results])
    for label, key in WHICH.items()
    if key != "global"
)
columns = [k for k in rows[0] if not k.startswith("_")]
plotting.save_table(
    rows,
    "table3_evaluated_params",
    columns=columns,
    title=(
        f"Table 3: which parameters to evaluate ({ex.MODEL}, M = 2, overlapped FP4, "
        f"{ex.REGIME.tokens_per_param:g} tokens/param, "
        f"{config.steps // config.method.sync_every} rounds, H = {config.method.sync_every})"
    ),
    notes=(
        f"Mean ± std over seeds {list(SEEDS)}, at the end of training. Best here: "
        f"{best}. Seed-paired differences to the outer parameters: {paired}."
    ),
    notebook=NOTEBOOK,
    config=config,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows, columns))

fig, ax = plt.subplots()
for (label, key), color in zip(WHICH.items(), ("tab:gray", "tab:purple", "tab:red")):
    steps, values = ex.curve(results, "streaming", f"eval/{key}")
    ax.plot(steps, values.mean(0), marker="o", color=color, label=label)
ax.set_xlabel("inner step")
ax.set_ylabel("held-out loss (nats/byte)")
ax.set_title(f"Table 3 over training (mean of {len(SEEDS)} seeds)")
ax.legend()
plotting.save_figure(
    fig,
    "table3_evaluated_params_curves",
    notebook=NOTEBOOK,
    config=config,
    seeds=SEEDS,
    results=rows,
)
plt.show()
