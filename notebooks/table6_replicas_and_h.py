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
# # Table 6: number of replicas M ∈ {2, 4} × sync period H ∈ {30, 100}
#
# **Paper.** Streaming DiLoCo with overlapped FP4 communication from 35M to 1B: more
# replicas cost a little loss (1B: 2.48 → 2.50 at H = 30, 2.50 → 2.53 at H = 100) and
# syncing less often costs a little too (2.48 → 2.50 at M = 2); the gaps shrink with
# scale.
#
# **Here.** Two sizes (`tiny-xxs`, `tiny-xs`) at their tuned settings, at the one
# regime of the re-run notebooks (`experiments.setup`: 20 tokens per parameter, the
# tuned warmup, every held-out window scored), with a constant global batch (M = 4 halves the batch per replica; the
# paper does not say whether Table 6 keeps the global batch). The paper's H = 100 and
# H = 30 are 3.3x apart; we ask for 50 and 167 outer rounds (H = steps // rounds: 32
# # and 9 inner steps for tiny-xs, so that 50 and 179 rounds happen, the table's
# column). Three seeds; the M = 2, 50-round runs at tiny-xs are the one-set headline
# runs of the `hyperparameter_sweep` notebook (found by config in the run records).

# %%
import dataclasses

from sdiloco.paper import experiments as ex, plotting


NOTEBOOK = "table6_replicas_and_h"
SIZES = ("tiny-xs",) if plotting.FAST else ("tiny-xxs", "tiny-xs")
REPLICAS = (2, 4)
ROUNDS = {
    100: ex.REGIME.rounds,
    30: round(ex.REGIME.rounds * 100 / 30),
}  # paper H → ours
if plotting.FAST:
    ROUNDS = {100: ex.REGIME.rounds}
PAPER_1B = {(2, 30): 2.48, (4, 30): 2.50, (2, 100): 2.50, (4, 100): 2.53}
SEEDS = ex.SEEDS

# %%
configs = {
    f"{size}|M={m}|H={h}": ex.setup(
        "streaming_overlap_fp4",
        model=size,
        regime=dataclasses.replace(ex.REGIME, rounds=rounds),
        method={"num_replicas": m},
    )
    for size in SIZES
    for h, rounds in ROUNDS.items()
    for m in REPLICAS
}
results = ex.run_all(configs, SEEDS)
stats = ex.summarize(results)


def gap(base: str, other: str) -> str:
    """Seed-paired relative gap of run `other` to run `base` ("-" for itself)."""
    if base == other:
        return "-"
    return ex.gap_text(ex.finals(results, base), ex.finals(results, other))


# %%
rows = []
for name, c in configs.items():
    size, m, h = name.split("|")
    m, h = int(m[2:]), int(h[2:])
    rows.append(
        {
            "Model size": size,
            "M": m,
            "H (paper)": h,
            "rounds (ours)": c.steps // c.method.sync_every,
            "H (ours)": c.method.sync_every,
            "Held-out loss (nats/byte)": ex.mean_pm(stats[name], 4),
            "vs M=2 same H": gap(f"{size}|M=2|H={h}", name),
            "vs H=100 same M": gap(f"{size}|M={m}|H=100", name),
            "Paper 1B eval loss": PAPER_1B[(m, h)],
        }
    )
plotting.save_table(
    rows,
    "table6_replicas_and_h",
    title=(
        "Table 6: M × H for Streaming DiLoCo with overlapped FP4 (ours: tuned, "
        f"{ex.REGIME.tokens_per_param:g} tokens/param, constant global batch)"
    ),
    notes=(
        f"Mean ± std over seeds {list(SEEDS)}; gaps seed-paired: relative mean "
        "[95 % interval in nats/byte]. The paper's losses are C4 at 1B; ours are "
        "held-out Shakespeare in nats per byte, so compare the direction of the "
        "differences, not the values."
    ),
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))
