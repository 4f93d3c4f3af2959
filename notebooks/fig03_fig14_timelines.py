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
# # Fig. 3 and Fig. 14: simulated timelines of forward, backward and reduction
#
# **Paper.** Fig. 3: "Simulation of a schedule interleaving forward passes (in blue),
# backward passes w.r.t. activations and parameters (resp. in light and dark green),
# and (outer) gradient reduction (in purple)", for four methods: Data-Parallel
# (gradients of the full model every step), DiLoCo (every H = 2 steps), Streaming
# DiLoCo ("the fragment size is a single layer and there are two fragments ... every
# H = 2 steps") and Streaming DiLoCo with overlap ("gradients ... are only needed after
# τ steps (in this example τ = 1)"). Fig. 14 draws the same for Streaming DiLoCo with a
# sequential and a strided pattern: "the strided pattern will never have multiple early
# layers to be synchronize together. Therefore, it is easier to overlap their
# communication with the first few layers' forward of the next step." The paper prints
# no numbers for these drawings.
#
# **Here.** Every box is an event of the library's simulator trace
# (`sdiloco.sim.utilization.simulate(..., )`'s `SimResult.trace`): forward blue, backward
# green (the simulator lumps backward w.r.t. activations and parameters into one node
# per layer, 2/3 of the step), reduction purple on a separate network lane. The
# workload is small so the picture is legible: step time 1 s of pure compute, 2 layers
# (Fig. 3) or 4 layers (Fig. 14), bf16 gradients (16 bits/param) over a 1 Gbit/s link,
# with a parameter count chosen so that one layer's reduction takes 0.5 s (Fig. 3), a
# bit longer than that layer's backward (1/3 s). The window is 4 steps; the trace also
# shows the τ + 1 steps after it, whose forwards wait for the window's last syncs.

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

import sdiloco.sim.utilization as ut
from sdiloco.paper import plotting


plotting.style()
NOTEBOOK = "fig03_fig14_timelines"
# The simulator is analytic and runs in milliseconds: FAST mode uses the same settings.
STEP_TIME, BANDWIDTH, BITS, NUM_STEPS = 1.0, 1.0, ut.BF16_BITS_PER_PARAM, 4
KIND_COLORS = {"forward": "tab:blue", "backward": "tab:green", "reduce": "tab:purple"}


def workload(num_layers: int, seconds_per_layer_message: float) -> ut.Workload:
    """A toy workload whose per-layer reduction takes the given time at BANDWIDTH."""
    params = seconds_per_layer_message * BANDWIDTH * ut.GBIT * num_layers / BITS
    return ut.Workload(num_layers=num_layers, step_time=STEP_TIME, num_params=params)


def draw(ax, res: ut.SimResult, title: str, num_layers: int) -> None:
    """Compute lane (y = 1) and network lane (y = 0) of one simulated trace."""
    for ev in res.trace:
        y = 0.0 if ev["kind"] == "reduce" else 1.0
        width = ev["end"] - ev["start"]
        ax.barh(
            y,
            width,
            left=ev["start"],
            height=0.6,
            color=KIND_COLORS[str(ev["kind"])],
            edgecolor="white",
            linewidth=0.8,
            alpha=1.0 if ev["step"] < res.num_steps else 0.45,
        )
        if width > 0.07:
            label = {"forward": "F", "backward": "B", "reduce": "R"}[str(ev["kind"])]
            ax.text(
                ev["start"] + width / 2,
                y,
                f"{label}{ev['layer'] + 1}",
                ha="center",
                va="center",
                fontsize=7 if width > 0.12 else 5.5,
                color="white",
            )
    ax.set_yticks([0, 1], ["network", "compute"])
    ax.set_ylim(-0.5, 1.5)
    ax.grid(axis="y", visible=False)
    ax.set_title(
        f"{title}: CU = {res.compute_utilization:.0%} "
        f"({res.num_steps} steps in {res.wall_time:.2f} s)",
        fontsize=9,
        loc="left",
    )


LEGEND = [
    Patch(color=KIND_COLORS["forward"], label="forward (F<layer>)"),
    Patch(color=KIND_COLORS["backward"], label="backward (B<layer>)"),
    Patch(color=KIND_COLORS["reduce"], label="(outer) gradient reduction (R<layer>)"),
    Patch(color="grey", alpha=0.45, label="steps after the window"),
]

# %% [markdown]
# ## Fig. 3: Data-Parallel, DiLoCo, Streaming DiLoCo, Streaming DiLoCo with overlap

# %%
W3 = workload(num_layers=2, seconds_per_layer_message=0.5)
FIG3_METHODS = {
    "Data-Parallel": ut.data_parallel_method(BITS),
    "DiLoCo (H = 2)": ut.diloco_method(2, BITS),
    "Streaming DiLoCo (1 layer/fragment, P = 2, H = 2)": ut.streaming_method(
        2, layers_per_fragment=1, bits_per_param=BITS
    ),
    "Streaming DiLoCo with overlap (τ = 1)": ut.streaming_method(
        2, layers_per_fragment=1, overlap_steps=1, bits_per_param=BITS
    ),
}
fig3_results = {
    name: ut.simulate(W3, m, BANDWIDTH, num_steps=NUM_STEPS)
    for name, m in FIG3_METHODS.items()
}
fig, axes = plt.subplots(len(fig3_results), 1, figsize=(10, 6.2), sharex=True)
for ax, (name, res) in zip(axes, fig3_results.items()):
    draw(ax, res, name, W3.num_layers)
axes[-1].set_xlabel("time (s)")
axes[0].legend(handles=LEGEND, ncol=4, loc="lower left", bbox_to_anchor=(0, 1.25))
fig.suptitle(
    f"Fig. 3: simulated schedule, {W3.num_layers} layers, step time {STEP_TIME:g} s, "
    f"one layer's reduction {W3.num_params * BITS / W3.num_layers / ut.GBIT / BANDWIDTH:g} s "
    f"at {BANDWIDTH:g} Gbit/s",
    y=1.0,
)
fig.tight_layout()
fig3_table = [
    {
        "method": name,
        "compute utilization": round(res.compute_utilization, 4),
        "wall time of 4 steps (s)": round(res.wall_time, 4),
        "reductions in window": int(
            np.sum((res.trace["kind"] == "reduce") & (res.trace["step"] < NUM_STEPS))
        ),
    }
    for name, res in fig3_results.items()
]
config3 = {
    "num_layers": W3.num_layers,
    "step_time_s": STEP_TIME,
    "num_params": W3.num_params,
    "bits_per_param": BITS,
    "bandwidth_gbps": BANDWIDTH,
    "num_steps": NUM_STEPS,
    "methods": {k: m for k, m in FIG3_METHODS.items()},
}
plotting.save_figure(
    fig, "fig03_timelines", notebook=NOTEBOOK, config=config3, results=fig3_table
)
plt.show()
print(plotting.markdown_table(fig3_table))

# %% [markdown]
# ## Fig. 14: Streaming DiLoCo, sequential vs strided pattern
#
# 4 layers, 2 layers per fragment (P = 2), H = 2, τ = 0: one fragment is synchronised
# at every step. Sequential fragments are {1, 2} and {3, 4}; strided ones {1, 3} and
# {2, 4}.

# %%
W14 = workload(num_layers=4, seconds_per_layer_message=0.3)
FIG14_METHODS = {
    pattern: ut.streaming_method(
        2, layers_per_fragment=2, pattern=pattern, bits_per_param=BITS
    )
    for pattern in ("sequential", "strided")
}
fig14_results = {
    p: ut.simulate(W14, m, BANDWIDTH, num_steps=NUM_STEPS)
    for p, m in FIG14_METHODS.items()
}
fig, axes = plt.subplots(2, 1, figsize=(10, 4.0), sharex=True)
for ax, (pattern, res) in zip(axes, fig14_results.items()):
    frags = FIG14_METHODS[pattern].fragment_of_layer(W14.num_layers)
    groups = "; ".join(
        "{" + ", ".join(str(i + 1) for i in np.flatnonzero(frags == p)) + "}"
        for p in range(int(frags.max()) + 1)
    )
    draw(ax, res, f"Streaming DiLoCo, {pattern} fragments {groups}", W14.num_layers)
axes[-1].set_xlabel("time (s)")
axes[0].legend(handles=LEGEND, ncol=4, loc="lower left", bbox_to_anchor=(0, 1.2))
fig.suptitle(
    f"Fig. 14: sequential vs strided, {W14.num_layers} layers, H = 2, step time "
    f"{STEP_TIME:g} s, one layer's reduction "
    f"{W14.num_params * BITS / W14.num_layers / ut.GBIT / BANDWIDTH:g} s",
    y=1.0,
)
fig.tight_layout()
fig14_table = [
    {
        "pattern": pattern,
        "compute utilization": round(res.compute_utilization, 4),
        "wall time of 4 steps (s)": round(res.wall_time, 4),
    }
    for pattern, res in fig14_results.items()
]
config14 = {
    "num_layers": W14.num_layers,
    "step_time_s": STEP_TIME,
    "num_params": W14.num_params,
    "bits_per_param": BITS,
    "bandwidth_gbps": BANDWIDTH,
    "num_steps": NUM_STEPS,
    "methods": FIG14_METHODS,
}
plotting.save_figure(
    fig,
    "fig14_sequential_vs_strided",
    notebook=NOTEBOOK,
    config=config14,
    results=fig14_table,
)
plt.show()
print(plotting.markdown_table(fig14_table))

# %% [markdown]
# **Agrees with the paper (qualitatively; the paper's drawings carry no numbers).**
# Fig. 3: Data-Parallel reduces both layers at every step and the next forward waits
# for the last (first-layer) reduction: CU 60 % on this toy workload (4 steps in
# 6.67 s). DiLoCo with H = 2 stalls as long, but only every other step: 75 %.
# Streaming DiLoCo sends one 1-layer fragment per step with the same total bits; the
# layer-2 fragment's reduction hides behind layer 1's backward, so only the steps
# that sync layer 1 stall, and by one message instead of two: 80 %. With overlap
# τ = 1 no forward of the window waits (the reduction has a whole step to arrive);
# the only loss is the link finishing the last reduction after the window: 89 %.
# Fig. 14: with sequential fragments, layers 1 and 2 are reduced back to back at the
# end of the backward and layer 1's forward waits for both; with strided fragments,
# layer 3's reduction overlaps the backward of layers 2-1, so the stall is about one
# message (CU 85 % strided vs 82 % sequential here), the paper's argument for the
# strided pattern. **Differs:** the simulator draws the backward as one green box per
# layer (activations and parameters lumped, docs/paper.md §5.2), where the paper draws
# two shades of green; the CU values are for this toy workload only.
