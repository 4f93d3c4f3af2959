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
# # Table 1 + Table 7: Data-Parallel vs Streaming DiLoCo with overlapped FP4, three token budgets, M = 2 and 4
#
# **Paper.** A 1B model on Dolma at 25B / 100B / 250B tokens. Streaming DiLoCo with
# overlapped FP4 communication (M = 2, H = 100) reaches the same evaluation loss as
# Data-Parallel (2.66 vs 2.67, 2.51 vs 2.52, 2.45 vs 2.45) while exchanging 400x fewer
# bytes (1.10 vs 441 TB at 25B) and needing 0.88 h instead of 109 h at 1 Gbit/s. With
# M = 4 (twice the global batch, half the steps) the loss is slightly worse (2.73,
# 2.54, 2.47).
#
# **Here.** The same comparison at small scale on the embedded Shakespeare corpus, at
# the paper's budgets in units of the compute-optimal one: `tiny-xs` (82,528
# parameters) at 20, 80 and 200 tokens per parameter (1x, 4x and 10x: the paper's
# 25B / 100B / 250B tokens are 1x / 4x / 10x of its 1B model's Chinchilla budget). Every
# method runs at its tuned settings (`config.TUNED`, from the `hyperparameter_sweep`
# notebook: inner and outer learning rates, outer momentum and batch chosen on a
# validation split at 20 tokens per parameter and 50 rounds, the warmup last: half the
# steps for every method at tiny-xs, kept as a fraction at every budget), on one
# held-out set (`experiments.REGIME`: every run scored on all 6,912 held-out windows,
# the evaluation's standard error about 0.0025 nats/byte). As in the paper, H stays
# fixed as the budget grows, so the rounds grow with it: 50, 200 and 500 outer rounds
# (H = 32 for M = 2). M = 4 doubles the global batch (same tokens, half the steps) and
# keeps the number of rounds (H = 16; the paper keeps H, which would leave 25 rounds at
# 1x). Three seeds, read as seed-paired differences with a 95 % interval. The hours
# columns are the simulator's at the paper's own scale (1B, 0.1 s/step, 16 bits per
# parameter), the bytes columns are exact counts of our runs. Downstream accuracies
# (HellaSwag, PiQA, ARC-Easy) cannot be computed offline: we report held-out loss and
# bits per byte.

# %%
import math

import matplotlib.pyplot as plt

from sdiloco.lab import model as model_lib
from sdiloco.paper import experiments as ex, plotting
from sdiloco.sim import reference, utilization as ut


plotting.style()
NOTEBOOK = "table1_table7_overtraining"
SEEDS = ex.SEEDS
BUDGETS = {"25B": 1, "100B": 4, "250B": 10}  # x the compute-optimal budget
if plotting.FAST:  # one budget: three compilations are the FAST-mode floor
    BUDGETS = {"100B": 1}
PAPER_STEPS = reference.TABLE1_1B_STEPS  # 1B, Table 1
PAPER = {  # Tables 1 and 7: (terabytes exchanged, eval loss)
    "Data-Parallel": {"25B": (441, 2.67), "100B": (1767, 2.52), "250B": (4418, 2.45)},
    "Ours, M=2": {"25B": (1.10, 2.66), "100B": (4.42, 2.51), "250B": (11.05, 2.45)},
    "Ours, M=4": {"25B": (0.55, 2.73), "100B": (2.21, 2.54), "250B": (5.52, 2.47)},
}
NUM_PARAMS = model_lib.preset(ex.MODEL).num_params()

# %%
configs = {}
for label, factor in BUDGETS.items():
    regime = ex.REGIME.scaled(factor)
    configs[f"Data-Parallel|{label}"] = ex.setup("data_parallel", regime=regime)
    ours = ex.setup("streaming_overlap_fp4", regime=regime)
    configs[f"Ours, M=2|{label}"] = ours
    configs[f"Ours, M=4|{label}"] = ex.setup(
        "streaming_overlap_fp4",
        regime=regime,
        method={"num_replicas": 4},
        data={"global_batch_size": 2 * ours.data.global_batch_size},
    )
results = ex.run_all(configs, SEEDS)
stats = ex.summarize(results)


def rounds(config) -> str:
    """Outer rounds and H of a run ("-" for Data-Parallel)."""
    h = getattr(config.method, "sync_every", None)
    return "-" if h is None else f"{config.steps // h} (H = {h})"


# %% [markdown]
# The hours at the paper's scale come from the simulator (`sdiloco.sim.utilization`): the
# 1B workload at 0.1 s per step, the paper's step counts, bf16 (16 bits per parameter)
# for Data-Parallel and FP4 for ours; M = 4 takes half the steps.

# %%
workload = ut.paper_workload("1B")
sim_methods = {
    "Data-Parallel": ut.data_parallel_method(ut.BF16_BITS_PER_PARAM),
    "Ours": ut.streaming_method(
        100, overlap_steps=1, fp4=True, bits_per_param=ut.BF16_BITS_PER_PARAM
    ),
}


def hours(method: str, label: str, bandwidth: float) -> float:
    key = "Data-Parallel" if method == "Data-Parallel" else "Ours"
    steps = PAPER_STEPS[label] // (2 if method == "Ours, M=4" else 1)
    return ut.wall_clock_hours(workload, sim_methods[key], bandwidth, steps)


def dp_batch(label: str) -> int:
    return configs[f"Data-Parallel|{label}"].data.global_batch_size


rows = []
for name in configs:
    method, label = name.split("|")
    runs = [r for r in results if r.name == name]
    s = stats[name]
    bits = runs[0].summary["bits_total"]
    dp_bits = next(r for r in results if r.name == f"Data-Parallel|{label}").summary[
        "bits_total"
    ]
    tb, paper_loss = PAPER[method][label]
    rows.append(
        {
            "Method": method,
            "Token budget (paper)": label,
            "Tokens (ours)": runs[0].summary["tokens"],
            "Tokens/param (ours)": round(runs[0].summary["tokens"] / NUM_PARAMS, 1),
            "Outer rounds (ours)": rounds(configs[name]),
            "Hours w/ +inf Gbit/s (1B sim)": round(hours(method, label, math.inf), 2),
            "Hours w/ 1 Gbit/s (1B sim)": round(hours(method, label, 1.0), 2),
            "TB exchanged (paper)": tb,
            "MB exchanged per replica (ours)": round(bits / 8e6, 3),
            "DP / this, bytes (ours)": round(dp_bits / bits, 1) if bits else math.inf,
            "same at equal batch": round(
                dp_bits / bits * dp_batch(label) / configs[name].data.global_batch_size,
                1,
            )
            if bits
            else math.inf,
            "Eval loss (paper)": paper_loss,
            "Held-out loss, nats/byte (ours)": ex.mean_pm(s),
            "Bits/byte (ours)": round(ex.bits_per_byte(s["mean"]), 3),
            "_mean": s["mean"],
            "_std": s["std"],
        }
    )
columns = [k for k in rows[0] if not k.startswith("_")]
plotting.save_table(
    rows,
    "table1_table7_overtraining",
    columns=columns,
    title="Tables 1 and 7: Data-Parallel vs Streaming DiLoCo with overlapped FP4 (ours at small scale)",
    notes=(
        f"Ours: {ex.MODEL} on Shakespeare at tuned settings, mean ± std over seeds "
        f"{list(SEEDS)}; held-out loss in nats per byte. Hours: simulator at the paper's "
        "1B scale. Bytes: exact counts of one replica's sends in our runs (Data-Parallel: "
        "a bf16 gradient every step, the paper's accounting; ours: E3M0 outer gradients, "
        "one fragment every H/P steps). Data-Parallel's tuned batch is smaller than "
        "ours, so it takes more steps for the same tokens; 'same at equal batch' is "
        "the byte ratio Data-Parallel would have at our batch."
    ),
    notebook=NOTEBOOK,
    config={n: c for n, c in configs.items()},
    seeds=SEEDS,
)
print(plotting.markdown_table(rows, columns))

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 4))
colors = {
    "Data-Parallel": plotting.METHOD_COLORS["data_parallel"],
    "Ours, M=2": plotting.METHOD_COLORS["streaming_overlap_fp4"],
    "Ours, M=4": "tab:brown",
}
for method, color in colors.items():
    mine = [r for r in rows if r["Method"] == method]
    tokens = [r["Tokens (ours)"] for r in mine]
    axes[0].errorbar(
        tokens,
        [r["_mean"] for r in mine],
        yerr=[r["_std"] for r in mine],
        marker="o",
        capsize=3,
        color=color,
        label=method,
    )
    largest = f"{method}|{list(BUDGETS)[-1]}"
    steps, values = ex.curve(results, largest)
    tok = steps * configs[largest].data.global_batch_size * 64
    axes[1].plot(tok, values.mean(0), color=color, label=method)
    axes[1].fill_between(tok, values.min(0), values.max(0), color=color, alpha=0.2)
axes[0].set_xscale("log")
axes[0].set_xlabel("training tokens (bytes)")
axes[0].set_ylabel("held-out loss (nats/byte)")
axes[0].set_title("final loss per token budget (mean ± std over seeds)")
axes[1].set_xlabel("training tokens (bytes)")
axes[1].set_ylabel("held-out loss (nats/byte)")
axes[1].set_title("largest budget: loss over training (band: min-max over seeds)")
for method in ("Ours, M=2", "Ours, M=4"):
    if len(SEEDS) < 2:
        break
    tokens, mean, low, high = [], [], [], []
    for label in BUDGETS:
        dp = ex.finals(results, f"Data-Parallel|{label}")
        g = ex.paired_gap(dp, ex.finals(results, f"{method}|{label}"))
        k = 100 / stats[f"Data-Parallel|{label}"]["mean"]
        tokens.append(
            next(r for r in results if r.name == f"{method}|{label}").summary["tokens"]
        )
        mean.append(100 * g["relative"])
        low.append(100 * g["relative"] - g["low"] * k)
        high.append(g["high"] * k - 100 * g["relative"])
    axes[2].errorbar(
        tokens,
        mean,
        yerr=[low, high],
        marker="o",
        capsize=3,
        color=colors[method],
        label=method,
    )
axes[2].axhline(0, color="k", lw=0.8)
axes[2].set_xscale("log")
axes[2].set_xlabel("training tokens (bytes)")
axes[2].set_ylabel("gap to Data-Parallel (%)")
axes[2].set_title("gap (bars: 95 % seed-paired t-intervals)")
for ax in axes:
    ax.legend()
for ax in (axes[0], axes[2]):  # one label per budget, none in between
    ax.minorticks_off()
    ticks = sorted(r["Tokens (ours)"] for r in rows if r["Method"] == "Data-Parallel")
    ax.set_xticks(ticks, [f"{t / 1e6:.1f}M" for t in ticks])
fig.tight_layout()
plotting.save_figure(
    fig,
    "table1_table7_overtraining",
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
    results=rows,
)
plt.show()

# %% [markdown]
# Seeds set both the initialisation and the data order. Every method runs with the
# same seeds, so the paired difference, seed by seed, is the measurement to read: its
# mean and 95 % t-interval over the seeds (`experiments.paired_gap`).

# %%
gap_rows = []
for method in ("Ours, M=2", "Ours, M=4"):
    for label in BUDGETS:
        dp = ex.finals(results, f"Data-Parallel|{label}")
        ours = ex.finals(results, f"{method}|{label}")
        paper_gap = PAPER[method][label][1] - PAPER["Data-Parallel"][label][1]
        row = {
            "Method": method,
            "Token budget (paper)": label,
            "Tokens/param (ours)": BUDGETS[label] * ex.REGIME.tokens_per_param,
            "Outer rounds (ours)": rounds(configs[f"{method}|{label}"]),
            "paper: minus Data-Parallel": round(paper_gap, 2),
            "paper: relative (%)": round(
                100 * paper_gap / PAPER["Data-Parallel"][label][1], 1
            ),
            "ours: minus Data-Parallel, per seed": ", ".join(
                f"{o - d:+.3f}" for d, o in zip(*ex.paired(dp, ours))
            ),
            "ours: relative mean [95 % interval, nats/byte]": ex.gap_text(dp, ours),
        }
        gap_rows.append(row)
plotting.save_table(
    gap_rows,
    "table1_table7_paired_gap",
    title="Tables 1 and 7: loss of ours minus Data-Parallel, paired by seed (nats/byte)",
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(gap_rows))

# %% [markdown]
# ## Verdict
#
# Printed below from the records: ours minus Data-Parallel, seed-paired, with its 95 %
# interval, at each budget.
#
# - **M = 2: close to Data-Parallel only with more rounds, and not equal.** Behind it,
#   resolved, at 1x and 4x; at 10x no gap is resolved, but a gap under 2 % is not
#   shown either (the interval's upper end is printed). The paper's runs tie at every
#   budget.
# - **M = 4 converges to Data-Parallel with the budget**: far behind at 1x (half the
#   steps, on a tiny model far from converged), behind at 4x (resolved), no gap
#   resolved at 10x, where the paper reports about 1 %.
# - **Bytes and hours agree with the paper**: two orders of magnitude fewer bytes, also
#   at equal batch, and the simulator's hours within a few percent of Table 1's.

# %%
lines = []
for method in ("Ours, M=2", "Ours, M=4"):
    cells = []
    for label in BUDGETS:
        dp = ex.finals(results, f"Data-Parallel|{label}")
        ours = ex.finals(results, f"{method}|{label}")
        if len(SEEDS) < 2:
            cells.append(f"{BUDGETS[label]}x {ex.gap_text(dp, ours)}")
            continue
        g = ex.paired_gap(dp, ours)
        state = "resolved" if g["low"] > 0 or g["high"] < 0 else "not resolved"
        top = 100 * g["high"] / stats[f"Data-Parallel|{label}"]["mean"]
        cells.append(
            f"{BUDGETS[label]}x {ex.gap_text(dp, ours)} ({state}; at most {top:+.1f} %)"
        )
    lines.append(f"{method} minus Data-Parallel: " + "; ".join(cells))
print("\n".join(lines))
