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
# # Fig. 4 + Table 4: compute utilization vs WAN bandwidth (1B, 10B, 100B)
#
# **Paper.** Fig. 4 plots the simulated compute utilization (CU, the fraction of
# wall time spent computing) against the bandwidth between workers (Gbit/s, log
# scale) for a 1B (24 layers, 0.1 s/step), 10B (48 layers, 0.8 s/step) and 100B
# (108 layers, 4.9 s/step) model and five methods: Data-Parallel, Vanilla DiLoCo
# (H = 100), Streaming DiLoCo (3 layers per fragment, strided), the same with
# overlapped communication (τ = 1), and with overlapped FP4 communication. Table 4 is
# the numeric version: the Gbit/s needed to reach CU = 50 / 80 / 90 / 95 / 99 %.
# Its 1B rows are e.g. Data-Parallel 86.8 / 152.6 / 184.2 / 222.3 / 569.0 and
# Streaming DiLoCo w/ overlapped FP4 0.4 / 0.9 / 1.7 / 2.0 / 3.0 Gbit/s. The caption
# says the best method reaches 95 % CU at all three scales with 1-5 Gbit/s, where
# Data-Parallel needs "100, 200, and 300 Gbit/s"; the text adds that with overlap the
# required bandwidth *drops* as the model grows (longer steps hide more transfer).
#
# **Here.** The library's simulator (`sdiloco.sim.utilization`, docs/paper.md §5.2: a
# per-layer DAG of forwards, backwards and FIFO reductions, 13.4 bits per parameter,
# FP4 = 13.4 / 4, latency 0) is run for the paper's three workloads and its five
# methods (`table4_methods`). Table 4 is read off the paper's bandwidth grid
# (`BANDWIDTH_GRID`, 50 points from 0.1 to 1000 Gbit/s) with `bandwidth_table`; the
# curves use a finer grid. The paper's 1B row values are printed beside ours. Its 10B
# and 100B rows are held out of our copy of the paper (they check the simulator), so
# for those rows we print our numbers only.

# %%
import matplotlib.pyplot as plt
import numpy as np

import sdiloco.sim.utilization as ut
from sdiloco.paper import plotting
from sdiloco.sim import reference


plotting.style()
NOTEBOOK = "fig04_table4_compute_utilization"
SIZES = ("1B", "10B", "100B")
# The curves: the paper's 50-point grid in FAST mode, 4x finer in the full run.
CURVE_GRID = ut.BANDWIDTH_GRID if plotting.FAST else np.logspace(-1, 3, 197)

GRID_STEP = ut.BANDWIDTH_GRID[1] / ut.BANDWIDTH_GRID[0]  # ×1.207 per grid point

workloads = [ut.paper_workload(n) for n in SIZES]
methods = ut.table4_methods()
config = {
    "workloads": workloads,
    "methods": methods,
    "targets": ut.TABLE4_TARGETS,
    "table_grid_gbps": ut.BANDWIDTH_GRID,
    "curve_grid_points": len(CURVE_GRID),
    "latency_s": 0.0,
    "bits_per_param": ut.TABLE4_BITS_PER_PARAM,
}

# %% [markdown]
# ## Fig. 4: CU vs bandwidth
#
# Crosses on panel (a) are the paper's Table 4 1B values, placed at their target CU.
# Table 4 reports the first grid point whose CU reaches the target, so a cross that
# agrees with our simulator sits on, or up to one grid step (×1.207) right of, our
# curve of the same colour.

# %%
curves = {
    w.name: {m.name: ut.utilization_curve(w, m, CURVE_GRID) for m in methods}
    for w in workloads
}

fig, axes = plt.subplots(1, 3, figsize=(14, 4.3), sharey=True)
for ax, w, letter in zip(axes, workloads, "abc"):
    for m, key in zip(methods, reference.TABLE4_METHOD_KEYS):
        ax.plot(
            CURVE_GRID,
            curves[w.name][m.name],
            color=plotting.METHOD_COLORS[key],
            lw=1.8,
        )
    if w.name == "1B":
        for m, key in zip(methods, reference.TABLE4_METHOD_KEYS):
            ax.scatter(
                reference.TABLE4_1B_GBPS[m.name],
                ut.TABLE4_TARGETS,
                marker="x",
                s=30,
                color=plotting.METHOD_COLORS[key],
                zorder=3,
            )
    ax.set_xscale("log")
    ax.set_xlim(CURVE_GRID[0], CURVE_GRID[-1])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("WAN bandwidth (Gbit/s)")
    ax.set_title(f"({letter}) {w.name}: {w.num_layers} layers, {w.step_time:g} s/step")
axes[0].set_ylabel("compute utilization")
handles = [
    plt.Line2D([], [], color=plotting.METHOD_COLORS[k], lw=1.8, label=m.name)
    for m, k in zip(methods, reference.TABLE4_METHOD_KEYS)
] + [
    plt.Line2D(
        [], [], color="grey", marker="x", ls="", label="paper, Table 4 (1B only)"
    )
]
fig.legend(handles=handles, loc="lower center", ncol=3, bbox_to_anchor=(0.5, -0.1))
fig.suptitle(
    "Fig. 4: simulated compute utilization (H = 100, 3 layers/fragment, τ = 1)"
)
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig04_compute_utilization",
    notebook=NOTEBOOK,
    config=config,
    results={
        "bandwidth_gbps": CURVE_GRID,
        "cu": curves,
    },
)
plt.show()

# %% [markdown]
# ## Table 4: Gbit/s to reach a compute utilization
#
# Cells are "ours (paper)" for 1B. For 10B and 100B only ours: the paper's rows are
# held out of our copy. The last column is the largest gap to the paper's 1B row, in
# steps of the paper's grid (×1.207), after allowing for the paper's rounding to
# 0.1 Gbit/s (0 = the same value).

# %%
rows = ut.bandwidth_table(workloads, methods)
print(ut.format_bandwidth_table(rows))


def cell(ours: float, paper: float | None) -> str:
    """One table cell: our Gbit/s, then the paper's in brackets when it is known."""
    text = "not reached" if np.isinf(ours) else f"{ours:.1f}"
    return text if paper is None else f"{text} ({paper:.1f})"


table, gaps = [], {}
for r in rows:
    paper = reference.TABLE4_1B_GBPS[r.method] if r.model == "1B" else None
    entry = {
        "Model size": r.model,
        "# layers": r.num_layers,
        "Step time": f"{r.step_time:g}s",
        "Method": r.method,
    }
    for t, ours, p in zip(ut.TABLE4_TARGETS, r.gbps, paper or [None] * 5):
        entry[f"CU {t:.0%}"] = cell(ours, p)
    if paper is None:
        entry["max gap (grid steps)"] = "held out"
    else:
        # The paper prints to 0.1 Gbit/s: its value lies in [p - 0.05, p + 0.05].
        ours, lo, hi = np.asarray(r.gbps), np.subtract(paper, 0.05), np.add(paper, 0.05)
        gap = np.maximum(0, np.maximum(np.log(lo / ours), np.log(ours / hi)))
        gap = gap / np.log(GRID_STEP)
        gaps[r.method] = float(gap.max())
        entry["max gap (grid steps)"] = f"{gap.max():.2f}"
    table.append(entry)

plotting.save_table(
    table,
    "table4_bandwidth",
    title="Table 4: Gbit/s to reach a compute utilization CU, ours (paper)",
    notes=(
        "Ours: `sdiloco.sim.utilization.bandwidth_table` on the paper's grid "
        "(logspace(-1, 3, 50) Gbit/s), 13.4 bits/param (FP4: /4), latency 0, "
        "H = 100, 3 layers/fragment strided, τ = 1. Paper values in brackets (1B "
        "only); the paper's 10B and 100B rows are held out of our copy, so only our "
        "numbers are shown for them. A gap of 1 grid step = a factor 1.207; values "
        "are printed to 0.1 Gbit/s, so 86.85 appears as 86.9 here and 86.8 in the paper."
    ),
    notebook=NOTEBOOK,
    config=config,
    ours_gbps={f"{r.model} {r.method}": r.gbps for r in rows},
    paper_gbps_1b=reference.TABLE4_1B_GBPS,
)
print(plotting.markdown_table(table))

# %% [markdown]
# ## The caption's and the text's claims, checked

# %%
fp4, dp = methods[-1].name, methods[0].name
by = {(r.model, r.method): dict(zip(ut.TABLE4_TARGETS, r.gbps)) for r in rows}
for s in SIZES:
    print(
        f"{s}: CU 95 % needs {by[s, fp4][0.95]:.1f} Gbit/s (overlapped FP4) vs "
        f"{by[s, dp][0.95]:.1f} (Data-Parallel); CU 50 % for Data-Parallel: "
        f"{by[s, dp][0.5]:.1f}; CU 99 % overlapped FP4: {by[s, fp4][0.99]:.1f}"
    )
print(f"largest 1B gap to the paper: {max(gaps.values()):.2f} grid steps")
on_point = sum(  # our grid point is the one nearest to the paper's printed value
    o == ut.BANDWIDTH_GRID[np.argmin(np.abs(np.log(ut.BANDWIDTH_GRID / p)))]
    for r in rows
    if r.model == "1B"
    for o, p in zip(r.gbps, reference.TABLE4_1B_GBPS[r.method])
)
print(f"1B cells on the grid point nearest the paper's value: {on_point} of 25")

# %% [markdown]
# **Agrees.** All 25 1B cells of Table 4 are within one grid step of the paper's
# (largest gap 0.66 step after the paper's rounding to 0.1 Gbit/s), and 24 of 25 are
# the grid point nearest to the paper's printed value: the four non-FP4 rows match
# exactly (86.85 prints as 86.9 here, 86.8 there; 6.25 as 6.3 vs 6.2). The FP4 row is
# 0.3 / 1.0 / 1.7 / 2.0 / 2.9 against the paper's 0.4 / 0.9 / 1.7 / 2.0 / 3.0: its
# 50 % cell is one grid step lower (0.32 vs 0.39 Gbit/s), and the paper's 0.9 is not
# a grid point, so the paper did something slightly different for FP4. The qualitative claims hold: Streaming DiLoCo beats DiLoCo at equal bits
# (100B, CU 99 %: 19.3 vs 184.2 Gbit/s); only the overlapped variants approach 100 %
# CU; with overlapped FP4 the best method reaches 95 % CU at 2.0 / 1.4 / 1.2 Gbit/s
# for 1B / 10B / 100B (inside the caption's 1-5 Gbit/s) and the required bandwidth
# falls as the model grows (CU 99 %: 2.9 → 1.7 → 1.4 Gbit/s).
#
# **Differs.** Our Data-Parallel needs 222 / 268 / 391 Gbit/s for CU 95 % at
# 1B / 10B / 100B, not the caption's "100, 200, and 300 Gbit/s". The caption is at
# odds with the paper's own Table 4, whose 1B Data-Parallel row needs 222.3 Gbit/s for
# 95 % (and 86.8 for 50 %), so the caption's figures are loose round numbers; ours
# grow with scale as the caption's do. The 10B and 100B rows cannot be compared
# number by number: they are held out of our copy of the paper.
