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
# **Here.** Streaming DiLoCo with overlapped FP4 communication, M = 2, H = 20, three
# sizes (`tiny-xs`, `tiny-s`, `tiny-m`), one seed. At every step that sends a
# fragment, `sdiloco.outer_gradient_cosine` measures the cosine between the two
# replicas' Δ = θ_g − θ_m of that fragment (before quantization) and of each of its
# layers. Fragment 0 is the non-block parameters (embedding and final norm).

# %%
import matplotlib.pyplot as plt
import numpy as np

from sdiloco.lab import model as model_lib
from sdiloco.paper import experiments as ex, plotting


plotting.style()
NOTEBOOK = "fig17_fig18_cosine_similarity"
SIZES = ("tiny-xs",) if plotting.FAST else ("tiny-xs", "tiny-s", "tiny-m")
LABEL = ex.pretuning_label([0], model=", ".join(SIZES))

# %%
configs = {size: ex.small_setup("streaming_overlap_fp4", model=size) for size in SIZES}
results = ex.run_all(configs, (0,), callback_factory=ex.cosine_callback)
cos = {r.name: r.extra for r in results}

# %%
rows = []
for size in SIZES:
    frag = np.asarray(cos[size]["fragment"])
    blocks, embed = frag[frag[:, 1] > 0], frag[frag[:, 1] == 0]
    layer = np.asarray(cos[size]["layer"])
    thirds = np.array_split(blocks[:, 2], 3)
    rows.append(
        {
            "model": f"{size} ({model_lib.preset(size).num_params():,})",
            "blocks: first third": round(float(thirds[0].mean()), 3),
            "blocks: middle third": round(float(thirds[1].mean()), 3),
            "blocks: last third": round(float(thirds[2].mean()), 3),
            "embedding fragment (mean)": round(float(embed[:, 2].mean()), 3),
            "layer 1 (mean)": round(float(layer[layer[:, 1] == 0, 2].mean()), 3),
            "layers 2+ (mean)": round(float(layer[layer[:, 1] > 0, 2].mean()), 3),
        }
    )
plotting.save_table(
    rows,
    "fig17_fig18_cosine_similarity",
    title="Figs. 17-18: mean cosine similarity of the two replicas' outer gradients",
    notes=(
        "Means over the sends in each third of training (block fragments), over all "
        "sends (embedding fragment), and per layer over all sends of its fragment. "
        + LABEL
    ),
    notebook=NOTEBOOK,
    config=configs,
    seeds=[0],
)
print(plotting.markdown_table(rows))

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for size, color in zip(SIZES, ("tab:blue", "tab:orange", "tab:green")):
    frag = np.asarray(cos[size]["fragment"])
    for ax, mask in ((axes[0], frag[:, 1] > 0), (axes[1], frag[:, 1] == 0)):
        ax.plot(frag[mask, 0], frag[mask, 2], marker=".", lw=1, color=color, label=size)
for ax, title in zip(
    axes, ("(a) all fragments but the embedding", "(b) embedding fragment")
):
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("inner step")
    ax.set_title(title)
    ax.legend()
axes[0].set_ylabel("cosine similarity of the replicas' Δ")
fig.suptitle("Fig. 17: cosine similarity between outer gradients across scales (M = 2)")
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig17_cosine_per_fragment",
    label=LABEL,
    notebook=NOTEBOOK,
    config=configs,
    seeds=[0],
    results=cos,
)
plt.show()

# %%
fig, axes = plt.subplots(
    1, len(SIZES), figsize=(4.5 * len(SIZES), 3.8), sharey=True, squeeze=False
)
for ax, size in zip(axes[0], SIZES):
    layer = np.asarray(cos[size]["layer"])
    n = model_lib.preset(size).num_layers
    shades = plt.get_cmap("viridis")(np.linspace(0, 0.9, n))
    for i in range(n):
        sel = layer[:, 1] == i
        ax.plot(
            layer[sel, 0], layer[sel, 2], lw=1, color=shades[i], label=f"layer {i + 1}"
        )
    ax.axhline(0, color="k", lw=0.8)
    ax.set_title(size)
    ax.set_xlabel("inner step")
axes[0][0].set_ylabel("cosine similarity of the replicas' Δ")
axes[0][-1].legend(fontsize=7)
fig.suptitle("Fig. 18: per layer (darker = earlier layer)")
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig18_cosine_per_layer",
    label=LABEL,
    notebook=NOTEBOOK,
    config=configs,
    seeds=[0],
    results=cos,
)
plt.show()
