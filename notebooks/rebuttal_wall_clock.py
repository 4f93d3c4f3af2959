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
# # Rebuttal table: wall-clock time at 1 / 10 / 100 / 1000 Gbit/s
#
# **Paper.** The authors' OpenReview rebuttal (docs/paper.md §9; not in the paper
# itself) estimates the wall-clock time of training a 1B model, 0.1 s of pure compute per step,
# 186,250 steps (5.2 h of pure compute), at four bandwidths written as "GiB":
# Data-Parallel 21 days / 2 days / 10 h / 5 h, DiLoCo 12 h / 6 h / 5 h / 5 h, Streaming
# DiLoCo with overlapped FP4 communication 6 h / 5 h / 5 h / 5 h at 1 / 10 / 100 / 1000.
# The numbers are rounded; the unit and the bits per parameter are not stated.
#
# **Here.** `sdiloco.sim.utilization.wall_clock_hours` simulates the 1B workload
# (`paper_workload("1B")`: 24 layers, 0.1 s per step) at each bandwidth in **Gbit/s**
# and extrapolates the steady-state compute utilization to 186,250 steps. Methods as
# in Table 4: Data-Parallel, DiLoCo H = 100, Streaming DiLoCo H = 100 with 3 layers
# per fragment (8 fragments), τ = 1 and FP4 (a quarter of the bits). The main
# constant is 16 bits per parameter (bf16 gradients of a nominal 1e9-parameter model,
# `BF16_BITS_PER_PARAM`, which reproduces Table 1 within 2 %); the Table-4 fit, 13.4
# bits per parameter (`TABLE4_BITS_PER_PARAM`), is given as a second column. We also
# ask the simulator which constant the rebuttal's Data-Parallel number at 1 implies.

# %%
import matplotlib.pyplot as plt
import numpy as np

import sdiloco.sim.utilization as ut
from sdiloco.paper import plotting
from sdiloco.sim import reference


plotting.style()
NOTEBOOK = "rebuttal_wall_clock"
# Analytic: the whole notebook runs in a few seconds, so FAST mode uses the same settings.
STEPS = reference.REBUTTAL_STEPS
BANDWIDTHS = (1.0, 10.0, 100.0, 1000.0)
WORKLOAD = ut.paper_workload("1B")
BITS = {"bf16": ut.BF16_BITS_PER_PARAM, "table4": ut.TABLE4_BITS_PER_PARAM}

# The rebuttal's numbers (docs/paper.md §9): `sdiloco.sim.reference`.
PAPER_HOURS = reference.REBUTTAL_HOURS
PAPER_TEXT = reference.REBUTTAL_TEXT


def methods(bits_per_param: float) -> dict[str, ut.Method]:
    """The rebuttal's three methods, with the Table 4 settings."""
    return {
        "Data-Parallel": ut.data_parallel_method(bits_per_param),
        "DiLoCo": ut.diloco_method(100, bits_per_param),
        "Streaming DiLoCo, overlapped FP4": ut.streaming_method(
            100,
            layers_per_fragment=3,
            overlap_steps=1,
            fp4=True,
            bits_per_param=bits_per_param,
        ),
    }


def fmt(hours: float) -> str:
    """Hours as the rebuttal writes them: days from 2 days up, else hours."""
    return f"{hours / 24:.1f} days" if hours >= 48 else f"{hours:.1f} h"


# %%
hours = {
    key: {
        name: {bw: ut.wall_clock_hours(WORKLOAD, m, bw, STEPS) for bw in BANDWIDTHS}
        for name, m in methods(bits).items()
    }
    for key, bits in BITS.items()
}
print(f"pure compute: {STEPS * WORKLOAD.step_time / 3600:.2f} h")

table = []
for bw in BANDWIDTHS:
    row = {"bandwidth (Gbit/s; rebuttal: 'GiB')": f"{bw:g}"}
    for name in PAPER_HOURS:
        row[f"{name}: paper"] = PAPER_TEXT[name][bw]
        row[f"{name}: ours, 16 bit/param"] = fmt(hours["bf16"][name][bw])
        row[f"{name}: ours, 13.4 bit/param"] = fmt(hours["table4"][name][bw])
    table.append(row)
print(plotting.markdown_table(table))

# %% [markdown]
# Which bits per parameter would make our Data-Parallel land on the rebuttal's
# "21 days" at 1 Gbit/s? Scan the constant through the simulator.

# %%
scan = np.linspace(4.0, 20.0, 161)
dp_at_1 = np.array(
    [
        ut.wall_clock_hours(WORKLOAD, ut.data_parallel_method(float(b)), 1.0, STEPS)
        for b in scan
    ]
)
implied_bits = float(np.interp(PAPER_HOURS["Data-Parallel"][1.0], dp_at_1, scan))
print(f"the rebuttal's DP at 1 Gbit/s (504 h) implies {implied_bits:.1f} bits/param")

# %%
notes = (
    f"1B workload (24 layers, 0.1 s/step), {STEPS:,} steps = "
    f"{STEPS * WORKLOAD.step_time / 3600:.2f} h of pure compute. Bandwidth in Gbit/s "
    "(1e9 bit/s) over one link (M = 2, ring factor 1), latency 0. DiLoCo: H = 100; "
    "Streaming: H = 100, 3 layers/fragment strided (P = 8), τ = 1, FP4 = 1/4 of the "
    "bits. Hours = steps × 0.1 s / steady-state CU "
    "(`sdiloco.sim.utilization.wall_clock_hours`). 16 bit/param = bf16 "
    "(`BF16_BITS_PER_PARAM`, the Table 1 fit); 13.4 bit/param = `TABLE4_BITS_PER_PARAM` "
    f"(the Table 4 fit). The rebuttal's DP number at 1 implies {implied_bits:.1f} "
    "bit/param in our simulator. Paper numbers: docs/paper.md §9 (OpenReview "
    "rebuttal), rounded, unit written 'GiB'."
)
_ = plotting.save_table(
    table,
    "rebuttal_wall_clock",
    title="Rebuttal table: wall-clock time of a 1B model, 186,250 steps (paper vs ours)",
    notes=notes,
    notebook=NOTEBOOK,
    config={
        "workload": WORKLOAD,
        "num_steps": STEPS,
        "bandwidths_gbps": BANDWIDTHS,
        "bits_per_param": BITS,
        "methods": {k: methods(b) for k, b in BITS.items()},
    },
    hours=hours,
    paper_hours=PAPER_HOURS,
    implied_bits_per_param_dp_1gbps=implied_bits,
)

# %%
fig, ax = plt.subplots(figsize=(6.4, 4.0))
colors = dict(
    zip(
        PAPER_HOURS,
        (
            plotting.METHOD_COLORS["data_parallel"],
            plotting.METHOD_COLORS["diloco"],
            plotting.METHOD_COLORS["streaming_overlap_fp4"],
        ),
    )
)
for name, c in colors.items():
    ax.plot(
        BANDWIDTHS,
        [hours["bf16"][name][b] for b in BANDWIDTHS],
        "-o",
        color=c,
        label=f"{name} (ours, 16 bit/param)",
    )
    ax.plot(
        BANDWIDTHS,
        [PAPER_HOURS[name][b] for b in BANDWIDTHS],
        "x",
        color=c,
        markersize=9,
        mew=2,
        label=f"{name} (rebuttal)",
    )
ax.axhline(
    STEPS * WORKLOAD.step_time / 3600, color="grey", ls=":", label="pure compute"
)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("bandwidth (Gbit/s)")
ax.set_ylabel("wall-clock time (hours)")
ax.set_title("1B model, 186,250 steps of 0.1 s")
ax.legend(fontsize=7)
fig.tight_layout()
plotting.save_figure(
    fig,
    "rebuttal_wall_clock_plot",
    notebook=NOTEBOOK,
    config={"workload": WORKLOAD, "num_steps": STEPS, "bits_per_param": BITS["bf16"]},
    results=hours,
)
plt.show()

# %% [markdown]
# **Verdict.** Pure compute is 5.17 h (the rebuttal's "5 h"). **Agrees** for DiLoCo
# and Streaming DiLoCo with overlapped FP4 at every bandwidth within the rebuttal's
# rounding: with 16 bit/param we get DiLoCo 13.4 / 6.0 / 5.2 / 5.2 h (rebuttal 12 /
# 6 / 5 / 5 h) and Streaming FP4 6.6 / 5.2 / 5.2 / 5.2 h (6 / 5 / 5 / 5 h); with
# 13.4 bit/param DiLoCo at 1 Gbit/s is 12.1 h and Streaming 6.2 h. Data-Parallel at
# 100 and 1000 Gbit/s agrees (10.1 h and 5.2 h vs 10 h and 5 h). **Differs** for
# Data-Parallel at low bandwidth: 34.6 days at 1 Gbit/s and 3.5 days at 10 Gbit/s
# with 16 bit/param (29.0 and 3.0 days with 13.4) against the rebuttal's 21 and 2
# days. Our simulator reaches the rebuttal's 21 days only with about 9.7 bits per
# parameter, so the rebuttal probably used a smaller message (e.g. fewer synchronised
# parameters, or a different bandwidth unit); the ordering and the 100x gap between
# Data-Parallel and Streaming DiLoCo at 1 Gbit/s hold either way.
