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
# # Fig. 2: sequential vs strided fragment patterns
#
# **Paper.** "Streaming pattern: sequential (left) and strided (right). Colors denote the
# fragment. A different fragment is synchronized each time." Rows are the embeddings
# and layers 1-8, the x-axis is time.
#
# **Here.** The picture is drawn from the library's own fragment assignment
# (`sdiloco.fragments_by_layer`) and sync schedule (`sdiloco.make_schedule`) for an
# 8-layer transformer with 2 layers per fragment: each cell is coloured by the fragment
# of that layer at the steps where that fragment is sent, over two sync periods.
# Non-block parameters (embedding, final norm) are fragment 0, as in
# docs/contract.md §1.

# %%
import dataclasses

import jax.numpy as jnp
import jax.random as jr
import matplotlib.pyplot as plt
import numpy as np

import sdiloco
from sdiloco.lab import model as model_lib
from sdiloco.paper import plotting


plotting.style()
NOTEBOOK = "fig02_fragment_patterns"
LAYERS, PER_FRAGMENT, H = 8, 2, 8  # the paper's drawing: 8 layers

# %%
config = dataclasses.replace(model_lib.preset("tiny-xs"), num_layers=LAYERS)
model = model_lib.Transformer(config, key=jr.key(0))


def layer_fragments(pattern: str) -> tuple[np.ndarray, int]:
    """Fragment of [embeddings, layer 1..L], read off the library's labels."""
    frags = sdiloco.fragments_by_layer(
        model,
        blocks=lambda m: m.blocks,
        layers_per_fragment=PER_FRAGMENT,
        pattern=pattern,
    )
    per_row = next(lab for lab in frags.labels if lab.ndim == 1)
    scalar = {int(lab) for lab in frags.labels if lab.ndim == 0}
    assert scalar == {0}, scalar  # every non-block leaf is fragment 0
    return np.concatenate([[0], per_row]), frags.num_fragments


def sends(num_fragments: int, steps: int) -> np.ndarray:
    """[steps, P]: which fragments the schedule sends at t = 1..steps."""
    schedule = sdiloco.make_schedule(H, num_fragments, num_replicas=2)
    return np.stack(
        [
            np.asarray(schedule.sent(jnp.asarray(t, jnp.int32)))
            for t in range(1, steps + 1)
        ]
    )


# %%
steps = 3 * H
fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
cmap = plt.get_cmap("tab10")
table = []
for ax, pattern in zip(axes, ("sequential", "strided")):
    labels, P = layer_fragments(pattern)
    sent = sends(P, steps)
    grid = np.full((LAYERS + 1, steps), np.nan)
    for t in range(steps):
        for row, frag in enumerate(labels):
            if sent[t, frag]:
                grid[row, t] = frag
    ax.imshow(
        np.ma.masked_invalid(grid),
        cmap=cmap,
        vmin=0,
        vmax=10,
        aspect="auto",
        interpolation="none",
        extent=(0.5, steps + 0.5, LAYERS + 0.5, -0.5),
    )
    for row, frag in enumerate(labels):  # fragment colour key on the left margin
        ax.add_patch(
            plt.Rectangle((-0.6, row - 0.5), 0.9, 1, color=cmap(frag), clip_on=False)
        )
    ax.set_xlim(-0.6, steps + 0.5)
    ax.set_title(f"{pattern}: {P} fragments")
    ax.set_xlabel(f"time (inner step; H = {H})")
    table.append(
        {
            "pattern": pattern,
            **{
                f"fragment {p}": ", ".join(
                    "Emb" if r == 0 else f"L{r}" for r in np.flatnonzero(labels == p)
                )
                for p in range(P)
            },
        }
    )
axes[0].set_yticks(
    range(LAYERS + 1), ["Embeddings"] + [f"Layer {i}" for i in range(1, LAYERS + 1)]
)
axes[0].set_ylabel("layers")
fig.suptitle("Fig. 2: which layers are synchronised when (colour = fragment)")
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig02_fragment_patterns",
    notebook=NOTEBOOK,
    config={"num_layers": LAYERS, "layers_per_fragment": PER_FRAGMENT, "sync_every": H},
    results=table,
)
plt.show()

# %%
plotting.save_table(
    table,
    "fig02_fragment_assignment",
    title="Fig. 2: layers of each fragment (library assignment, 8 layers, 2 per fragment)",
    notebook=NOTEBOOK,
    config={"num_layers": LAYERS, "layers_per_fragment": PER_FRAGMENT},
)
print(plotting.markdown_table(table))

# %% [markdown]
# **Agrees with the paper.** Sequential fragments are contiguous blocks of layers
# (1-2, 3-4, ...); strided fragments interleave them (1 and 5, 2 and 6, ...), and one
# fragment is sent every H / P steps. The embeddings are a fragment of their own here
# (fragment 0, docs/contract.md §1); the paper's drawing colours them like the layers.
