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
# # Fig. 11: compressing the outer gradients, value dropping vs low-precision floats
#
# **Paper.** Outer gradients are compressed either by dropping values (FedDropout,
# DARE, Top-K) or by casting them to lower-precision floats (FP32, BF16, FP8, FP4
# E3M0). Low-precision floats keep the evaluation loss of FP32 down to 4 bits, while
# value dropping degrades it; the final method therefore sends E3M0.
#
# **Here.** Streaming DiLoCo with overlapped communication (τ = 1, α = 0.5) on
# `tiny-xs` (82,528 parameters), M = 2, at the one regime of the re-run notebooks
# (`experiments.REGIME`): 20 tokens per parameter, 50 outer rounds (H = 32), the final
# method's tuned settings (`config.TUNED["streaming_overlap_fp4"]`, its tuned warmup
# included) with only the compressor changed, every run scored on all 6,912 held-out
# windows; three seeds, read as seed-paired differences to FP32 with a 95 % interval. The x-axis is
# the exact number of bits one replica puts on the wire per parameter per sync (from
# the library's bit accounting: scales, indices and seeds included), so value-dropping
# and float formats share one axis. FedDropout and DARE drop a random subset (DARE
# rescales the kept values), Top-K keeps the largest magnitudes; each at drop rates 0.5
# and 0.875. A compressor with a seed that ends worse than guessing every byte
# uniformly (ln 256 = 5.55 nats/byte) is marked "diverged" and drawn off the axis.

# %%
import math

import matplotlib.pyplot as plt

from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "fig11_compression"
SEEDS = ex.SEEDS
FORMATS = {"FP32": None, "BF16": "bf16", "FP8 (E4M3)": "e4m3", "FP4 (E3M0)": "e3m0"}
SPARSIFIERS = {"FedDropout": "fed_dropout", "DARE": "dare", "Top-K": "top_k"}
RATES = (0.5, 0.875)
if plotting.FAST:
    FORMATS, SPARSIFIERS, RATES = {"FP4 (E3M0)": "e3m0"}, {"DARE": "dare"}, (0.5,)

# %%
configs = {
    name: ex.setup("streaming_overlap_fp4", regime=ex.REGIME, method={"quantizer": fmt})
    for name, fmt in FORMATS.items()
}
for name, kind in SPARSIFIERS.items():
    for rate in RATES:
        configs[f"{name}|{rate}"] = ex.setup(
            "streaming_overlap_fp4",
            regime=ex.REGIME,
            method={"quantizer": None, "sparsifier": kind, "drop_rate": rate},
        )
results = ex.run_all(configs, SEEDS)
stats = ex.summarize(results)
bits = {name: ex.bits_per_param_per_sync(c) for name, c in configs.items()}


# %%
REF = next(iter(configs))  # FP32 (FP4 in FAST mode)


UNIFORM = math.log(256)  # nats/byte of guessing every byte uniformly


def diverged(name: str) -> bool:
    """Whether a seed of `name` ended worse than uniform guessing."""
    return stats[name]["max"] > UNIFORM


first = configs[REF]
H = first.method.sync_every
rows = []
for name in configs:
    family, _, rate = name.partition("|")
    rows.append(
        {
            "compressor": family,
            "drop rate": float(rate) if rate else 0.0,
            "bits per parameter per sync": round(bits[name], 3),
            "held-out loss (nats/byte)": ex.mean_pm(stats[name]),
            f"vs {REF}, paired by seed": (
                "-"
                if name == REF
                else "diverged"
                if diverged(name)
                else ex.gap_text(ex.finals(results, REF), ex.finals(results, name))
            ),
            "_mean": stats[name]["mean"],
            "_std": stats[name]["std"],
            "_diverged": diverged(name),
        }
    )
columns = [k for k in rows[0] if not k.startswith("_")]
plotting.save_table(
    rows,
    "fig11_compression",
    columns=columns,
    title=(
        f"Fig. 11: outer-gradient compression ({first.model}, M = 2, H = {H}, "
        f"{first.steps // H} rounds, {ex.REGIME.tokens_per_param:g} tokens/param, "
        "τ = 1, α = 0.5)"
    ),
    notes=(
        f"Mean ± std over seeds {list(SEEDS)}; gaps are seed-paired: relative mean "
        "[95 % t-interval of the differences, nats/byte]."
    ),
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows, columns))

# %%
fig, ax = plt.subplots()
COLORS = {
    **{f: "tab:red" for f in FORMATS},
    **dict(zip(SPARSIFIERS, ("tab:blue", "tab:green", "tab:purple"))),
}
for r in rows:
    if r["_diverged"]:  # off the axis: marked at its top
        ax.annotate(
            f"{r['compressor']} {r['drop rate']}: diverged ({r['_mean']:.1f})",
            (r["bits per parameter per sync"], 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -14),
            textcoords="offset points",
            ha="left",
            fontsize=8,
            color=COLORS[r["compressor"]],
            arrowprops={"arrowstyle": "->", "color": COLORS[r["compressor"]]},
        )
rows_shown = [r for r in rows if not r["_diverged"]]
floats = [r for r in rows_shown if r["compressor"] in FORMATS]
ax.errorbar(
    [r["bits per parameter per sync"] for r in floats],
    [r["_mean"] for r in floats],
    yerr=[r["_std"] for r in floats],
    marker="s",
    capsize=3,
    color="tab:red",
    label="low-precision floats",
)
for r in floats:
    ax.annotate(
        r["compressor"],
        (r["bits per parameter per sync"], r["_mean"]),
        textcoords="offset points",
        xytext=(4, 6),
        fontsize=8,
    )
for family in SPARSIFIERS:
    mine = sorted(
        (r for r in rows_shown if r["compressor"] == family),
        key=lambda r: r["bits per parameter per sync"],
    )
    ax.errorbar(
        [r["bits per parameter per sync"] for r in mine],
        [r["_mean"] for r in mine],
        yerr=[r["_std"] for r in mine],
        marker="o",
        capsize=3,
        color=COLORS[family],
        label=f"{family} (drop {', '.join(str(r['drop rate']) for r in mine)})",
    )
low = min(r["_mean"] - r["_std"] for r in rows_shown)
high = max(r["_mean"] + r["_std"] for r in rows_shown)
ax.set_ylim(low - 0.05 * (high - low), high + 0.25 * (high - low))
ax.set_xscale("log", base=2)
ax.set_xlabel("bits per parameter per sync (log scale)")
ax.set_ylabel("held-out loss (nats/byte)")
ax.set_title(f"Fig. 11: compressing outer gradients ({len(SEEDS)} seeds, ± std)")
ax.legend(fontsize=8)
plotting.save_figure(
    fig,
    "fig11_compression",
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
    results=stats,
)
plt.show()
