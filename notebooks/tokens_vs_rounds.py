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
# # Beyond the paper: tokens or rounds, which closes the gap to Data-Parallel?
#
# **Question.** Streaming DiLoCo's gap to Data-Parallel shrinks on longer runs
# (Tables 1/7: 20 → 80 → 200 tokens per parameter at a fixed H, so the rounds grow
# with the tokens). Is it the tokens or the number of outer rounds?
#
# **Setup.** `tiny-xs` at the one regime of the re-run notebooks (`experiments.setup`:
# each method at its tuned settings, its tuned warmup, every held-out window scored),
# Streaming DiLoCo with overlapped FP4 (M = 2) against Data-Parallel, 3 seeds. Two
# lines through the standard cell (20 tokens per parameter, 50 rounds):
# - **tokens vary, rounds fixed**: 10 / 20 / 40 tokens per parameter at 50 rounds
#   (H = steps / 50 grows with the tokens);
# - **rounds vary, tokens fixed**: 25 / 50 / 100 rounds at 20 tokens per parameter
#   (H = 64 / 32 / 16).
#
# The hyper-parameters stay at their tuned values (tuned at 20 tokens per parameter
# and 50 rounds) in every cell. Each gap is Streaming's held-out loss minus
# Data-Parallel's at the same tokens, seed-paired, with its 95 % t-interval.

# %%
import dataclasses

import matplotlib.pyplot as plt
import numpy as np

from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "tokens_vs_rounds"
SEEDS = ex.SEEDS
BASE = ex.REGIME
TOKENS = (BASE.tokens_per_param,) if plotting.FAST else (10.0, 20.0, 40.0)
ROUNDS = (BASE.rounds,) if plotting.FAST else (25, 50, 100)
DP, STREAMING = "data_parallel", "streaming_overlap_fp4"


def regime(tokens: float, rounds: int | None):
    return dataclasses.replace(BASE, tokens_per_param=tokens, rounds=rounds)


cells = sorted(
    {(t, BASE.rounds) for t in TOKENS} | {(BASE.tokens_per_param, r) for r in ROUNDS}
)
configs = {f"{DP} tokens={t:g}": ex.setup(DP, regime=regime(t, None)) for t in TOKENS}
configs |= {
    f"{STREAMING} tokens={t:g} rounds={r}": ex.setup(STREAMING, regime=regime(t, r))
    for t, r in cells
}
results = ex.run_all(configs, SEEDS)

# %%
rows, gaps = [], {}
for t, r in cells:
    name = f"{STREAMING} tokens={t:g} rounds={r}"
    dp = ex.finals(results, f"{DP} tokens={t:g}")
    ours = ex.finals(results, name)
    config = configs[name]
    gaps[t, r] = (
        ex.paired_gap(dp, ours) if len(SEEDS) > 1 else {"mean": ours[0] - dp[0]}
    )
    rows.append(
        {
            "tokens/param": f"{t:g}",
            "rounds": r,
            "H": config.method.sync_every,
            "steps (Streaming)": config.steps,
            "Data-Parallel": ex.mean_pm(ex.describe(dp), 4),
            "Streaming FP4": ex.mean_pm(ex.describe(ours), 4),
            "Streaming − Data-Parallel": ex.gap_text(dp, ours),
        }
    )
plotting.save_table(
    rows,
    "tokens_vs_rounds",
    title=(
        f"Tokens or rounds ({ex.MODEL}, Streaming FP4 M = 2 vs Data-Parallel, tuned "
        f"settings, seeds {list(SEEDS)})"
    ),
    notes=(
        "Held-out loss: mean ± std over seeds, every held-out window. Gap: "
        "seed-paired relative mean and 95 % t-interval of the differences in nats, "
        "against Data-Parallel at the same tokens per parameter."
    ),
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
lines = (
    (axes[0], [(t, BASE.rounds) for t in TOKENS], 0, "tokens per parameter"),
    (axes[1], [(BASE.tokens_per_param, r) for r in ROUNDS], 1, "outer rounds"),
)
for ax, line, index, label in lines:
    x = np.array([cell[index] for cell in line], float)
    mean = np.array([gaps[c]["mean"] for c in line])
    low = np.array([gaps[c].get("low", gaps[c]["mean"]) for c in line])
    high = np.array([gaps[c].get("high", gaps[c]["mean"]) for c in line])
    ax.errorbar(
        x, mean, yerr=[mean - low, high - mean], marker="o", capsize=3, color="tab:red"
    )
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.set_xlabel(label)
axes[0].set_title(f"tokens vary ({BASE.rounds} rounds)")
axes[1].set_title(f"rounds vary ({BASE.tokens_per_param:g} tokens/param)")
axes[0].set_ylabel("Streaming FP4 − Data-Parallel (nats/byte)")
fig.suptitle(
    f"Tokens or rounds ({ex.MODEL}; bars: 95 % seed-paired t-interval, "
    f"{len(SEEDS)} seeds)"
)
fig.tight_layout()
plotting.save_figure(
    fig,
    "tokens_vs_rounds",
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
    results={f"{t:g}/{r}": g for (t, r), g in gaps.items()},
)
plt.show()
