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
# # Tuning every method by one protocol (beyond the paper)
#
# **Why.** The paper compares methods with hyper-parameters taken from the Scaling Laws
# for DiLoCo study, which tunes the inner learning rate and the batch per method and
# sweeps the outer learning rate. Comparing untuned defaults would test our defaults,
# not the methods.
#
# **Protocol** (`sdiloco.paper.tuning`). For Data-Parallel, DiLoCo and Streaming
# DiLoCo with overlapped FP4 (τ = 1, α = 0.5), at each model size:
# the budget is fixed at **20 tokens per parameter** (Chinchilla) and, for the DiLoCo
# family, **50 outer rounds** (H = steps / 50, so a larger batch keeps the tokens and
# the rounds and takes fewer steps); then one axis at a time, each at the best values
# so far: the inner learning rate (2x grid, extended past an edge), the outer learning
# rate ({0.2, …, 1.0}, extended), the outer momentum ({0.5, 0.8, 0.9, 0.95}), the
# global batch ({16, 32, 64}, extended twice; the inner learning rate up to four times). Every trial evaluates on the
# **validation** split (2 training plays set aside), never on the held-out split the
# tables report. One seed per trial.

# %%
import matplotlib.pyplot as plt

from sdiloco.lab import config as config_lib, model as model_lib
from sdiloco.paper import experiments as ex, plotting, tuning


plotting.style()
NOTEBOOK = "hyperparameter_sweep"
FAST = plotting.FAST
# Sizes whose sweep is complete; a larger one is swept with
# `python -m sdiloco.paper.tuning MODEL` (its trials are recorded as they finish, over
# as many sessions as it takes) and added here when done.
SIZES = ("tiny-xxs",) if FAST else ("tiny-xxs", "tiny-xs")
REGIME = tuning.Regime(0.5, 4, evals=1, eval_batches=2) if FAST else tuning.Regime()
SEEDS = (0,)


def axes(preset):
    """The protocol's axes (the first two, two values each, in FAST mode)."""
    full = tuning.standard_axes(config_lib.preset(preset).method.kind)
    if not FAST:
        return full
    return tuple(tuning.Axis(a.field, a.values[1:3]) for a in full[:2])


# %%
ex.enable_compile_cache()
searches = {
    (size, name): tuning.tune(
        preset, size, regime=REGIME, seeds=SEEDS, axes=axes(preset)
    )
    for size in SIZES
    for name, preset in tuning.PRESETS.items()
}

# %% [markdown]
# ## The chosen settings
#
# Per model size and method: the best value of each axis, the validation loss there,
# the budget (tokens per parameter, steps, H and rounds) and the number of trials.

# %%
best_rows = []
for (size, name), search in searches.items():
    b = search.best
    h = getattr(b.method, "sync_every", None)
    best_rows.append(
        {
            "model": size,
            "params": model_lib.preset(size).num_params(),
            "method": name,
            "inner lr": b.inner.lr,
            "outer lr": getattr(getattr(b.method, "outer", None), "lr", "-"),
            "outer momentum": getattr(
                getattr(b.method, "outer", None), "momentum", "-"
            ),
            "batch": b.data.global_batch_size,
            "steps": b.steps,
            "H": h or "-",
            "rounds": b.steps // h if h else "-",
            "tokens/param": round(
                b.steps
                * b.data.global_batch_size
                * model_lib.preset(size).seq_len
                / model_lib.preset(size).num_params(),
                1,
            ),
            "validation loss": round(min(t.mean for t in search.trials), 4),
            "trials": len({t.config.to_json() for t in search.trials}),
        }
    )
plotting.save_table(
    best_rows,
    "hyperparameter_sweep",
    title="Tuned settings per model size and method (validation split, one seed)",
    notes=(
        f"Budget: {REGIME.tokens_per_param:g} tokens per parameter, "
        f"{REGIME.rounds} outer rounds for the DiLoCo family. Protocol: "
        "`sdiloco.paper.tuning.standard_axes`, swept in order by "
        "`coordinate_search`. Validation loss in nats/byte."
    ),
    notebook=NOTEBOOK,
    config={f"{s}|{n}": x.best for (s, n), x in searches.items()},
    seeds=SEEDS,
)
print(plotting.markdown_table(best_rows))

# %% [markdown]
# ## The loss surface along each axis
#
# Every trial, in the order the search ran it: validation loss against the value of the
# axis being swept (the other axes at their best values so far).

# %%
trial_rows = [
    {"model": size, "method": name, "axis": t.axis, "value": t.value, "loss": t.mean}
    for (size, name), search in searches.items()
    for t in search.trials
]
plotting.save_table(
    trial_rows,
    "hyperparameter_sweep_trials",
    title="Every trial of the tuning protocol (validation loss, nats/byte)",
    notebook=NOTEBOOK,
    seeds=SEEDS,
)
fields = list(dict.fromkeys(t["axis"] for t in trial_rows))
fig, axs = plt.subplots(
    len(SIZES),
    len(fields),
    figsize=(3.6 * len(fields), 3.2 * len(SIZES)),
    squeeze=False,
)
colors = dict(zip(tuning.PRESETS, ("tab:blue", "tab:orange", "tab:red")))
for i, size in enumerate(SIZES):
    for j, field in enumerate(fields):
        ax = axs[i, j]
        for name in tuning.PRESETS:
            pts = sorted(
                {
                    (r["value"], r["loss"])
                    for r in trial_rows
                    if r["model"] == size and r["method"] == name and r["axis"] == field
                }
            )
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, marker="o", color=colors[name], label=name)
        if field in ("inner.lr", "data.global_batch_size"):
            ax.set_xscale("log", base=2)
        ax.set_title(f"{size}: {field}", fontsize=9)
        ax.set_ylabel("validation loss")
axs[0, 0].legend(fontsize=8)
fig.tight_layout()
plotting.save_figure(fig, "hyperparameter_sweep", notebook=NOTEBOOK, seeds=SEEDS)
