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
# # Fig. 5 + Table 5: scaling over model sizes
#
# **Paper.** From 35M to 4B parameters on C4 (chinchilla-optimal budgets), Data-Parallel,
# DiLoCo H = 30, and Streaming DiLoCo with overlapped FP4 communication at H = 30 and
# H = 100 reach nearly the same evaluation loss at every scale (e.g. 1B: 2.49, 2.49,
# 2.48, 2.50), "with usually a slight advantage for Data-Parallel". The fitted slope of
# log loss against log flops is −0.13149 for Data-Parallel and −0.13539 for Streaming
# DiLoCo.
#
# **Here.** Four byte-level models from 22,928 to 689,952 parameters (30x), the same
# 320 steps of 16 × 64 bytes each (so flops = 6 · N · tokens grow with N; not
# chinchilla-optimal: the budget is what two CPU cores allow), M = 2. H is scaled to our
# ~100x shorter runs: the paper's H = 30 → 6 and H = 100 → 20. Two seeds for
# Data-Parallel and for Streaming at H = 20 (the headline pair), one for the other two.
# The slope is the least-squares fit of log(loss) on log(flops), as in the paper.

# %%
import matplotlib.pyplot as plt
import numpy as np

from sdiloco.lab import model as model_lib
from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "fig05_table5_scaling"
SIZES = (
    ("tiny-xxs", "tiny-xs")
    if plotting.FAST
    else ("tiny-xxs", "tiny-xs", "tiny-s", "tiny-m")
)
METHODS = {
    "Data-Parallel": ("data_parallel", {}),
    "DiLoCo H=30": ("diloco", {"sync_every": ex.paper_h(30)}),
    "Streaming FP4, H=30": ("streaming_overlap_fp4", {"sync_every": ex.paper_h(30)}),
    "Streaming FP4, H=100": ("streaming_overlap_fp4", {"sync_every": ex.paper_h(100)}),
}
SEEDS = {
    "Data-Parallel": (0, 1),
    "DiLoCo H=30": (0,),
    "Streaming FP4, H=30": (0,),
    "Streaming FP4, H=100": (0, 1),
}
if plotting.FAST:
    METHODS = {k: METHODS[k] for k in ("Data-Parallel", "Streaming FP4, H=100")}
    SEEDS = {k: (0,) for k in METHODS}
PAPER = {  # Table 5, eval loss on C4 at 35M ... 1B (4B rows incomplete)
    "Data-Parallel": [3.51, 3.19, 2.97, 2.80, 2.67, 2.49],
    "DiLoCo H=30": [3.54, 3.21, 2.98, 2.81, 2.68, 2.49],
    "Streaming FP4, H=30": [3.53, 3.21, 2.98, 2.81, 2.67, 2.48],
    "Streaming FP4, H=100": [3.56, 3.22, 3.00, 2.83, 2.69, 2.50],
}

# %%
configs, seeds = {}, {}
for method, (preset, kw) in METHODS.items():
    for size in SIZES:
        configs[f"{method}|{size}"] = ex.small_setup(preset, model=size, **kw)
        seeds[f"{method}|{size}"] = SEEDS[method]
results = ex.run_all(configs, seeds)
stats = ex.summarize(results)


def flops(size: str) -> float:
    c = configs[f"Data-Parallel|{size}"]
    tokens = c.steps * c.data.global_batch_size * model_lib.preset(size).seq_len
    return 6.0 * model_lib.preset(size).num_params() * tokens


# %%
rows, slopes = [], {}
for method in METHODS:
    x = np.log([flops(s) for s in SIZES])
    y = np.log([stats[f"{method}|{s}"]["mean"] for s in SIZES])
    slopes[method] = float(np.polyfit(x, y, 1)[0])
    for size in SIZES:
        s = stats[f"{method}|{size}"]
        rows.append(
            {
                "Model size": f"{size} ({model_lib.preset(size).num_params():,})",
                "Flops": f"{flops(size):.2e}",
                "Method": method,
                "Held-out loss (nats/byte)": ex.mean_pm(s),
                "Bits/byte": round(ex.bits_per_byte(s["mean"]), 3),
                "vs Data-Parallel (%)": round(
                    100 * (s["mean"] / stats[f"Data-Parallel|{size}"]["mean"] - 1), 2
                ),
            }
        )
slope_rows = [
    {
        "Method": m,
        "slope of log loss vs log flops (ours)": round(v, 5),
        "paper": {"Data-Parallel": -0.13149, "Streaming FP4, H=100": -0.13539}.get(
            m, "n/a"
        ),
    }
    for m, v in slopes.items()
]
plotting.save_table(
    rows,
    "table5_scaling",
    title="Table 5: scaling (ours: byte-level Shakespeare, 320 steps of 1,024 bytes, M = 2)",
    notes=f"Seeds per method: {SEEDS}. Mean ± std where two seeds. Paper H = 30 / 100 are our H = {ex.paper_h(30)} / {ex.paper_h(100)}.\n\n"
    + plotting.markdown_table(slope_rows),
    notebook=NOTEBOOK,
    config=configs,
    seeds=sorted({s for v in SEEDS.values() for s in v}),
    slopes=slopes,
)
print(plotting.markdown_table(rows))
print(plotting.markdown_table(slope_rows))

# %%
colors = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for method in METHODS:
    f = [flops(s) for s in SIZES]
    m = [stats[f"{method}|{s}"]["mean"] for s in SIZES]
    e = [stats[f"{method}|{s}"]["std"] for s in SIZES]
    axes[0].errorbar(
        f,
        m,
        yerr=e,
        marker="o",
        capsize=3,
        color=colors[method],
        label=f"{method} (log-log slope {slopes[method]:.3f})",
    )
    rel = [
        100 * (stats[f"{method}|{s}"]["mean"] / stats[f"Data-Parallel|{s}"]["mean"] - 1)
        for s in SIZES
    ]
    axes[1].plot(f, rel, marker="o", color=colors[method], label=method)
axes[0].set_xscale("log")
axes[0].set_xlabel("training flops (6 · N · tokens)")
axes[0].set_ylabel("held-out loss (nats/byte)")
axes[0].set_title("(a) loss vs flops (mean ± std over seeds)")
axes[0].legend(fontsize=8)
axes[1].set_xscale("log")
axes[1].axhline(0, color="k", lw=0.8)
axes[1].set_xlabel("training flops (6 · N · tokens)")
axes[1].set_ylabel("loss relative to Data-Parallel (%)")
axes[1].set_title("(b) gap to Data-Parallel")
axes[1].legend(fontsize=8)
fig.suptitle(
    "Fig. 5: scaling (HellaSwag, panel (b) of the paper, is not computable offline)"
)
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig05_scaling",
    notebook=NOTEBOOK,
    config=configs,
    seeds=[0, 1],
    results={"stats": stats, "slopes": slopes},
)
plt.show()
