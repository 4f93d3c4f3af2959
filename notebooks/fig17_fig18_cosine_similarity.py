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
# # Figs. 17-18: cosine similarity between the replicas' outer gradients
#
# **Paper.** With M = 2, the cosine similarity of the two replicas' outer gradients
# "starts from slightly correlated (≈ 0.1), spends [most] of the training time close to
# orthogonal (≈ 0.0), and ends slightly inversely correlated (≈ −0.1)"; the larger the
# model, the lower the similarity (Fig. 17: (a) all fragments but the embedding,
# (b) the embedding fragment). Per layer (Fig. 18), the first transformer layer has a
# markedly higher similarity at every scale.
#
# **Here.** Streaming DiLoCo with overlapped FP4 communication at its tuned settings,
# M = 2, at the one regime of the re-run notebooks (`experiments.setup`: 20 tokens
# per parameter, 50 outer rounds), three sizes (`tiny-xxs`, `tiny-xs`, `tiny-s`:
# 14x in parameters), 3 seeds. At every step that sends a fragment,
# `sdiloco.outer_gradient_cosine` measures the cosine between the two replicas'
# Δ = θ_g − θ_m of that fragment (before quantization) and of each of its layers.
# Fragment 0 is the non-block parameters (embedding and final norm). Each number in
# the table is a mean over seeds of a per-run mean, with the 95 % t-interval over
# seeds; the differences (last third − first third, layer 1 − layers 2+) are taken
# within each run, then over seeds.

# %%
import matplotlib.pyplot as plt
import numpy as np

from sdiloco.lab import model as model_lib
from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "fig17_fig18_cosine_similarity"
SIZES = ("tiny-xxs",) if plotting.FAST else ("tiny-xxs", "tiny-xs", "tiny-s")
SEEDS = ex.SEEDS

# %%
configs = {size: ex.setup("streaming_overlap_fp4", model=size) for size in SIZES}
results = ex.run_all(configs, SEEDS, callback_factory=ex.cosine_callback)
cos = {(r.name, r.seed): r.extra for r in results}


def per_run(size: str, seed: int) -> dict[str, float]:
    """One run's summary cosines (means over its sends)."""
    frag = np.asarray(cos[size, seed]["fragment"])
    blocks, embed = frag[frag[:, 1] > 0], frag[frag[:, 1] == 0]
    layer = np.asarray(cos[size, seed]["layer"])
    thirds = [t.mean() for t in np.array_split(blocks[:, 2], 3)]
    first, rest = layer[layer[:, 1] == 0, 2].mean(), layer[layer[:, 1] > 0, 2].mean()
    return {
        "blocks: first third": thirds[0],
        "blocks: middle third": thirds[1],
        "blocks: last third": thirds[2],
        "blocks: last − first third": thirds[2] - thirds[0],
        "embedding fragment": embed[:, 2].mean(),
        "layer 1": first,
        "layers 2+": rest,
        "layer 1 − layers 2+": first - rest,
    }


def interval(values) -> str:
    """Mean over seeds and its 95 % t-interval (the mean alone for one seed)."""
    v = np.asarray(values, np.float64)
    if v.size < 2:
        return f"{v.mean():+.3f} (one seed)"
    h = ex.t_half_width(v)
    return f"{v.mean():+.3f} [{v.mean() - h:+.3f}, {v.mean() + h:+.3f}]"


summaries = {size: [per_run(size, s) for s in SEEDS] for size in SIZES}
rows = [
    {"model": f"{size} ({model_lib.preset(size).num_params():,})"}
    | {
        key: interval([run[key] for run in summaries[size]])
        for key in summaries[size][0]
    }
    for size in SIZES
]
plotting.save_table(
    rows,
    "fig17_fig18_cosine_similarity",
    title=(
        "Figs. 17-18: mean cosine similarity of the two replicas' outer gradients "
        f"(overlapped FP4, M = 2, 20 tokens/param, 50 rounds, seeds {list(SEEDS)})"
    ),
    notes=(
        "Per run: means over the sends in each third of training (block fragments), "
        "over all sends (embedding fragment), and per layer over all sends of its "
        "fragment; differences within the run. Each cell: mean over seeds and the "
        "95 % t-interval over seeds."
    ),
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
)
print(plotting.markdown_table(rows))


def mean_curve(
    size: str, key: str, select
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fraction of training done (the sizes train for different numbers of steps),
    mean over seeds and half-range over seeds of the selected cosines."""
    runs = [np.asarray(cos[size, s][key]) for s in SEEDS]
    picked = [r[select(r)] for r in runs]
    values = np.stack([p[:, 2] for p in picked])
    done = picked[0][:, 0] / configs[size].steps
    return done, values.mean(0), (values.max(0) - values.min(0)) / 2


# %%
results_json = {f"{size}/seed={seed}": v for (size, seed), v in cos.items()}
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for size, color in zip(SIZES, ("tab:blue", "tab:orange", "tab:green")):
    for ax, wanted in ((axes[0], lambda p: p > 0), (axes[1], lambda p: p == 0)):
        done, mean, half = mean_curve(size, "fragment", lambda r: wanted(r[:, 1]))
        ax.plot(done, mean, marker=".", ms=3, lw=1, color=color, label=size)
        ax.fill_between(done, mean - half, mean + half, color=color, alpha=0.2)
for ax, title in zip(
    axes, ("(a) all fragments but the embedding", "(b) embedding fragment")
):
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("fraction of training (inner steps ÷ steps)")
    ax.set_title(title)
    ax.legend()
axes[0].set_ylabel("cosine similarity of the replicas' Δ")
fig.suptitle(
    "Fig. 17: cosine similarity between outer gradients across scales (M = 2; "
    f"mean of {len(SEEDS)} seeds, band: their range)"
)
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig17_cosine_per_fragment",
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
    results=results_json,
)
plt.show()

# %%
fig, axes = plt.subplots(
    1, len(SIZES), figsize=(4.5 * len(SIZES), 3.8), sharey=True, squeeze=False
)
for ax, size in zip(axes[0], SIZES):
    n = model_lib.preset(size).num_layers
    shades = plt.get_cmap("viridis")(np.linspace(0, 0.9, n))
    for i in range(n):
        done, mean, _ = mean_curve(size, "layer", lambda r, i=i: r[:, 1] == i)
        ax.plot(done, mean, lw=1, color=shades[i], label=f"layer {i + 1}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_title(size)
    ax.set_xlabel("fraction of training (inner steps ÷ steps)")
axes[0][0].set_ylabel("cosine similarity of the replicas' Δ")
axes[0][-1].legend(fontsize=7)
fig.suptitle(f"Fig. 18: per layer (darker = earlier layer; mean of {len(SEEDS)} seeds)")
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig18_cosine_per_layer",
    notebook=NOTEBOOK,
    config=configs,
    seeds=SEEDS,
    results=results_json,
)
plt.show()
