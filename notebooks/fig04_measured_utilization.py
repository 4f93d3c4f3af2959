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
# # Fig. 4, measured: compute utilization of real steps on an emulated WAN
#
# **Paper.** Fig. 4 and Table 4 are *simulated*: compute utilization (CU, the
# fraction of wall time spent computing) against the bandwidth between two workers.
# Overlapping FP4 communication with the next inner step needs about 100x less
# bandwidth than Data-Parallel for the same CU (1B: 2.0 vs 222.3 Gbit/s at CU 95 %).
# The sister notebook `fig04_table4_compute_utilization` reproduces that simulation.
#
# **Here.** The same comparison, measured. Two processes, each one replica of a
# tiny transformer on its own CPU core, train in two Linux network namespaces joined
# by a token-bucket-shaped link (`benchmarks/wan.py`). The exchange runs over JAX's
# multi-process CPU collectives. For the overlapped methods it is the library's
# `distributed.Courier`: the step that sends only encodes, and the all-gather runs on
# a second device of each process, from a thread of its own, while the next inner
# step computes. The measured CU at rate b is the seconds per step with no limit
# divided by the seconds per step at b. Beside it is the simulator's prediction for
# the same step time and bits per parameter, with zero latency: the kernel here has
# no netem, so the link adds no latency.
#
# The measurement needs root and about 30 minutes on two idle cores:
# `python -m benchmarks.measured_utilization`. This notebook only reads its record,
# `benchmarks/measured/fig04_utilization.json`, so it renders in seconds anywhere.

# %%
import json

import matplotlib.pyplot as plt
import numpy as np

from benchmarks.measured_utilization import RESULTS, knee
from sdiloco.paper import plotting


plotting.style()
NOTEBOOK = "fig04_measured_utilization"
record = json.loads(RESULTS.read_text())
setup, runs = record["setup"], record["methods"]
NAMES = {
    "data_parallel": "Data-Parallel",
    "diloco": "DiLoCo",
    "streaming": "Streaming DiLoCo",
    "streaming_overlap_in_step": "+ overlap τ=1, exchange in the step",
    "streaming_overlap": "+ overlap τ=1 (courier)",
    "streaming_overlap_fp4": "+ overlap τ=1 + FP4 (courier)",
}
COLORS = {**plotting.METHOD_COLORS, "streaming_overlap_in_step": "tab:gray"}
order = [n for n in NAMES if n in runs]
first = runs[order[0]]
print(
    f"model {setup['model']}: {first['num_params']:,} parameters, "
    f"{first['num_layers']} layers; M = {setup['replicas']}; "
    f"{setup['batch_per_replica']} sequences of 64 bytes per replica and step; "
    f"H = {setup['sync_every']}, {setup['layers_per_fragment']} layers per fragment; "
    f"{setup['timed_periods']} x H timed steps per window after H untimed ones"
)

# %% [markdown]
# ## CU against bandwidth, measured and simulated
#
# Solid lines and dots: measured. Dashed: the simulator, fed the measured step time
# (no limit) and bits per parameter. Each method's 8 rates are a factor 2 apart,
# centred on the simulator's CU = 0.8 rate.

# %%
fig, ax = plt.subplots(figsize=(8, 4.6))
for name in order:
    r = runs[name]
    c = COLORS[name]
    ax.plot(r["rates_mbit"], r["cu"], "o-", color=c, lw=1.6, ms=4, label=NAMES[name])
    ax.plot(r["rates_mbit"], r["cu_simulated"], "--", color=c, lw=1.2, alpha=0.8)
ax.plot([], [], "k--", lw=1.2, label="simulator, same step time and bits")
ax.set_xscale("log")
top = max(max(r["cu"]) for r in runs.values())
ax.set_ylim(0, max(1.05, top + 0.02))
ax.axhline(1.0, color="k", lw=0.6)
ax.set_xlabel("link rate each way (Mbit/s)")
ax.set_ylabel("compute utilization")
ax.legend(fontsize=8, loc="lower right")
ax.set_title(
    f"Measured CU, {setup['model']}, 2 processes over a shaped link "
    f"(H = {setup['sync_every']})"
)
fig.tight_layout()
plotting.save_figure(
    fig,
    "fig04_measured_utilization",
    notebook=NOTEBOOK,
    config=setup,
    results={
        n: {k: runs[n][k] for k in ("rates_mbit", "cu", "cu_simulated")} for n in order
    },
)
plt.show()

# %% [markdown]
# ## Knees, and the bandwidth each method needs
#
# A knee is the rate where CU first reaches a target (log-interpolated between grid
# points), at CU 0.5 (communication as long as computation) and CU 0.8, measured and
# simulated. The grid step is a factor 2, so "within one grid step" means a ratio of
# measured to simulated knee in [1/2, 2]. "Rate for CU 0.95" is the lowest measured
# rate with CU >= 0.95 (">" when no rate reached it). Data-Parallel was measured
# again at 254, 508 and 1016 Mbit/s (`--extra-rates`), above its first grid, to find
# where it reaches CU 0.95. A window's CU is within about ±0.04 (CU > 1 happens).


# %%
def rate_for(r, target):
    ok = [b for b, c in zip(r["rates_mbit"], r["cu"]) if c >= target]
    return min(ok) if ok else None


rows, knees = [], {}
for name in order:
    r = runs[name]
    row = {
        "method": NAMES[name],
        "ms/step, no limit": 1e3 * float(np.mean(r["step_time_no_limit"])),
        "bits/param": r["bits_per_param"],
    }
    for target in (0.5, 0.8):
        got = knee(r["rates_mbit"], r["cu"], target)
        sim = knee(r["rates_mbit"], r["cu_simulated"], target)
        knees[name, target] = got
        row[f"knee {target} measured / simulated (Mbit/s)"] = f"{got:.3g} / {sim:.3g}"
        row[f"ratio at {target}"] = got / sim
    need = rate_for(r, 0.95)
    row["rate for CU 0.95 (Mbit/s)"] = (
        f"{need:g}" if need is not None else f"> {max(r['rates_mbit']):g}"
    )
    rows.append(row)
within = {
    name: all(
        0.5
        <= knees[name, t]
        / knee(runs[name]["rates_mbit"], runs[name]["cu_simulated"], t)
        <= 2
        for t in (0.5, 0.8)
    )
    for name in order
}
notes = (
    "Within one grid step of the simulator at both targets: "
    + ", ".join(f"{NAMES[n]} {'yes' if ok else 'no'}" for n, ok in within.items())
    + "."
)
if "data_parallel" in runs and "streaming_overlap_fp4" in runs:
    for target in (0.5, 0.8):
        ratio = knees["data_parallel", target] / knees["streaming_overlap_fp4", target]
        notes += (
            f" At CU {target}, Data-Parallel needs {ratio:.0f}x the bandwidth of "
            "overlapped FP4."
        )
    dp, fp4 = runs["data_parallel"], runs["streaming_overlap_fp4"]
    a, b = rate_for(dp, 0.95), rate_for(fp4, 0.95)
    if a is not None and b is not None:
        below = max(x for x in dp["rates_mbit"] if x < a)
        below_b = max(x for x in fp4["rates_mbit"] if x < b)
        ka = knee(dp["rates_mbit"], dp["cu"], 0.95)
        kb = knee(fp4["rates_mbit"], fp4["cu"], 0.95)
        notes += (
            f" CU 0.95: Data-Parallel between {below:g} and {a:g} Mbit/s "
            f"(interpolated {ka:.3g}), overlapped FP4 between {below_b:g} and {b:g} "
            f"(interpolated {kb:.3g}): {ka / kb:.0f}x (bracket {below / b:.0f}x to "
            f"{a / below_b:.0f}x)."
        )
if "streaming_overlap" in runs and "streaming_overlap_in_step" in runs:
    gain = knees["streaming_overlap_in_step", 0.8] / knees["streaming_overlap", 0.8]
    notes += (
        f" The same fp32 Streaming with tau = 1: the courier reaches CU 0.8 at "
        f"{gain:.1f}x less bandwidth than the exchange inside the step."
    )
if top > 1:
    notes += (
        f" Measured CU reaches {top:.2f}: CU is the compute-only step time over the "
        "measured step time, both timed on this 2-core machine, so a step with its "
        "exchange can time a few percent faster than the reference (timing noise of "
        "that size, not a gain)."
    )
plotting.save_table(
    rows,
    "fig04_measured_knees",
    title="Fig. 4 measured: knees (CU 0.5 and 0.8) and the rate for CU 0.95",
    notes=notes,
    notebook=NOTEBOOK,
    config=setup,
)
print(plotting.markdown_table(rows))
print(notes)

# %% [markdown]
# ## The overlap, seen in a trace
#
# One window of the overlapped FP4 run, at the middle rate of its grid: when each
# step ended (the loop waits for every step here, so the steps are the bars) and,
# for every message, when the courier's thread started its all-gather and when the
# bytes had arrived. A transfer that spans steps ran while they computed; the red
# dots mark how long the loop waited for a message before the step that needs it
# (the rest of the transfer was hidden).

# %%
name = next(
    (n for n in ("streaming_overlap_fp4", "streaming_overlap") if n in runs), None
)
trace = runs[name]["traces"][0] if name and runs[name]["traces"] else None
if trace is not None:
    rate = runs[name]["rates_mbit"][trace["window"] - 1]
    fig, ax = plt.subplots(figsize=(9, 2.8))
    ends = np.asarray(trace["step_ends"])
    starts = np.concatenate([[0.0], ends[:-1]])
    ax.broken_barh(
        list(zip(starts, ends - starts)), (0.6, 0.8), facecolors=["#9ecae1", "#6baed6"]
    )
    for e in trace["events"]:
        ax.broken_barh(
            [(e["started"], e["arrived"] - e["started"])], (1.8, 0.8), color="tab:red"
        )
        ax.text(e["started"], 2.75, f"frag {e['fragment']}", fontsize=7)
        if e.get("waited", 0) > 0.005:
            ax.plot(e["arrived"], 2.2, "o", color="darkred", ms=4)
    ax.set_yticks([1.0, 2.2], ["inner steps", "all-gather"])
    ax.set_xlabel("seconds into the window")
    ax.set_ylim(0.3, 3.1)
    hidden = [
        max(0.0, (e["arrived"] - e["started"]) - e.get("waited", 0.0))
        for e in trace["events"]
    ]
    total = sum(e["arrived"] - e["started"] for e in trace["events"])
    ax.set_title(
        f"{NAMES[name]} at {rate:g} Mbit/s: {sum(hidden):.2f} of {total:.2f} s of "
        "transfer hidden behind inner steps"
    )
    fig.tight_layout()
    plotting.save_figure(
        fig,
        "fig04_measured_trace",
        notebook=NOTEBOOK,
        config=setup,
        results={"method": name, "rate_mbit": rate, **trace},
    )
    plt.show()
