"""Compute-utilization simulator behind Table 4 and Figs. 3, 4, 7, 9, 15 and 16.

Pure NumPy, independent of the training code (Streaming DiLoCo §3.1 and appendix;
docs/paper.md §5). One replica is simulated, since all replicas are identical. Each step runs
the forward of layers 1..L and then the backward of layers L..1. On a step where a
layer's fragment is due, the layer's (outer) gradient reduction is released when its
backward ends. Reductions cross one cross-worker link in FIFO order. The forward of
that layer in the step that needs the update waits for the reduction: the next step,
or 1 + τ steps later with overlap. Compute utilization (CU) is the pure compute time
over the wall time.

Units: bandwidth in Gbit/s (1e9 bit/s) and times in seconds. Latency, also in
seconds, is added to the arrival of every per-layer reduction message. It delays the
message but does not hold the link.

The simulator takes a `Workload` (`sim.workloads`) and a `Method` (`sim.methods`);
this module re-exports both modules' public names, so `import sdiloco.sim.utilization
as ut` gives the whole simulator.

Examples:
    >>> import sdiloco.sim.utilization as ut
    >>> w = ut.paper_workload("1B")
    >>> round(ut.required_bandwidth(w, ut.data_parallel_method(), 0.5), 2)
    86.85
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .checks import check, positive
from .methods import (
    BF16_BITS_PER_PARAM as BF16_BITS_PER_PARAM,
    FP4_FACTOR as FP4_FACTOR,
    TABLE4_BITS_PER_PARAM as TABLE4_BITS_PER_PARAM,
    Method as Method,
    data_parallel_method as data_parallel_method,
    diloco_method as diloco_method,
    eager_method as eager_method,
    streaming_method as streaming_method,
    table4_methods as table4_methods,
)
from .workloads import (
    Workload as Workload,
    paper_workload as paper_workload,
    step_time_from_flops as step_time_from_flops,
)


GBIT = 1e9
"""Bits per Gbit: bandwidths are in Gbit/s = 1e9 bit/s, as in Table 4."""

BANDWIDTH_GRID = np.logspace(-1, 3, 50)
"""Table 4's Gbit/s grid (docs/paper.md §5.2 item 7): 0.1 to 1000, ×1.207 per point."""

TABLE4_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
"""The compute utilizations of Table 4's columns."""

WINDOW_ENDS = ("link_idle", "steady")
"""How the simulated window ends; see `simulate`."""

TRACE_DTYPE = np.dtype(
    [("kind", "U8"), ("layer", "i4"), ("step", "i4"), ("start", "f8"), ("end", "f8")]
)
"""dtype of `SimResult.trace`; kind is "forward", "backward" or "reduce"."""


class SimResult(NamedTuple):
    """The output of `simulate`."""

    compute_utilization: float
    """num_steps · step_time / wall_time, in (0, 1]."""
    wall_time: float
    """Seconds the window of num_steps steps takes, stalls included."""
    num_steps: int
    """Steps in the window."""
    trace: np.ndarray
    """Every event, as a `TRACE_DTYPE` array sorted by start. It includes the τ + 1
    steps without syncs that follow the window, so each reduction's waiting forward
    appears. A reduction runs from the moment the link starts sending it to its
    arrival, which is `latency` after the link is done with it."""


class BandwidthRow(NamedTuple):
    """One row of Table 4."""

    model: str
    num_layers: int
    step_time: float
    method: str
    gbps: tuple[float, ...]
    """Gbit/s that reaches each target CU (`inf` if the grid never does)."""


# This differs from the paper in:
# 1. Backward w.r.t. activations and w.r.t. parameters are one node per layer taking
#    2/3 of the layer's time. The paper draws two nodes, but the lumped DAG of
#    docs/paper.md §5.2 already reproduces Table 4.
# 2. Only transformer blocks are simulated. The embedding fragment (docs/paper.md §1.4) is
#    left out.
# 3. The link is one FIFO queue shared by all reductions. The bits of a full sync are
#    split evenly over the layers, and each layer's message arrives `latency` seconds
#    after the link has sent it.
# 4. With pipeline parallelism (an extension the reviewers asked for, docs/paper.md §9), a
#    stall at any layer's forward delays the rest of the step. All stages share the
#    one link.
def simulate(
    workload: Workload,
    method: Method,
    bandwidth: float,
    *,
    latency: float = 0.0,
    num_steps: int | None = None,
    window_end: str = "link_idle",
) -> SimResult:
    """Simulate one replica's DAG of forwards, backwards and reductions (§5.1, §5.2).

    Args:
        workload: the model and its step time.
        method: when reductions happen and how many bits they carry.
        bandwidth: link bandwidth in Gbit/s; `math.inf` makes communication free.
        latency: seconds from sending a per-layer reduction to its arrival.
        num_steps: steps in the window; the default is `method.default_num_steps()`.
        window_end: "link_idle" (the paper's choice, which reproduces Table 4) ends the
            window once its last step has computed and the link has carried every
            reduction it released. "steady" ends it at the τ-th step after the window,
            counting only the stalls that the window's syncs cause in the forwards
            that wait for them. This is the steady state of a long run, where the
            last syncs' communication overlaps the steps that follow.

    Returns:
        CU, wall time and the event trace.
    """
    check(positive(bandwidth) or bandwidth == math.inf, "bandwidth", bandwidth, "> 0")
    num_steps = _num_steps(method, num_steps)
    wall, events = _run(
        workload,
        method,
        np.array([bandwidth], dtype=np.float64),
        latency,
        num_steps,
        window_end,
        record=True,
    )
    trace = np.concatenate(events)
    trace = trace[np.argsort(trace["start"], kind="stable")]
    return SimResult(
        compute_utilization=num_steps * workload.step_time / float(wall[0]),
        wall_time=float(wall[0]),
        num_steps=num_steps,
        trace=trace,
    )


def utilization_curve(
    workload: Workload,
    method: Method,
    bandwidths: np.ndarray | Sequence[float] = BANDWIDTH_GRID,
    *,
    latency: float = 0.0,
    num_steps: int | None = None,
    window_end: str = "link_idle",
) -> np.ndarray:
    """CU at each bandwidth in Gbit/s, all simulated at once (Figs. 4, 7, 15, 16).

    Example:
        >>> w = paper_workload("1B")
        >>> cu = utilization_curve(w, data_parallel_method(), [10.0, 1e3])
        >>> cu.round(3)
        array([0.073, 0.994])
    """
    bandwidths = np.asarray(bandwidths, dtype=np.float64)
    check(
        bandwidths.ndim == 1 and bool(np.all(bandwidths > 0)),
        "bandwidths",
        bandwidths,
        "a 1-D array of floats > 0",
    )
    num_steps = _num_steps(method, num_steps)
    wall, _ = _run(
        workload, method, bandwidths, latency, num_steps, window_end, record=False
    )
    return num_steps * workload.step_time / wall


def tau_sweep(
    workload: Workload,
    method: Method,
    taus: Sequence[int] | np.ndarray,
    bandwidths: np.ndarray | Sequence[float] = BANDWIDTH_GRID,
    *,
    latency: float = 0.0,
    window_end: str = "link_idle",
) -> np.ndarray:
    """CU for each overlap τ (rows) and bandwidth (columns) (Fig. 9; §3.3.2).

    Every τ uses the same window, `method.default_num_steps()` steps.
    """
    return np.stack(
        [
            utilization_curve(
                workload,
                dataclasses.replace(method, overlap_steps=int(tau)),
                bandwidths,
                latency=latency,
                num_steps=method.default_num_steps(),
                window_end=window_end,
            )
            for tau in taus
        ]
    )


def required_bandwidth(
    workload: Workload,
    method: Method,
    target_cu: float | Sequence[float] | np.ndarray,
    *,
    grid: np.ndarray | Sequence[float] = BANDWIDTH_GRID,
    latency: float = 0.0,
    window_end: str = "link_idle",
) -> float | np.ndarray:
    """The first grid bandwidth in Gbit/s whose CU reaches the target (Table 4; §5.2).

    Args:
        workload: the model and its step time.
        method: the method.
        target_cu: one target, or several, each in (0, 1].
        grid: increasing bandwidths in Gbit/s.
        latency: seconds from sending a per-layer reduction to its arrival.
        window_end: see `simulate`.

    Returns:
        The bandwidth, or `inf` if no grid point reaches the target; an array when
        several targets are given.
    """
    targets = np.atleast_1d(np.asarray(target_cu, dtype=np.float64))
    check(
        targets.ndim == 1 and bool(np.all((targets > 0) & (targets <= 1))),
        "target_cu",
        target_cu,
        "floats in (0, 1]",
    )
    grid = np.asarray(grid, dtype=np.float64)
    check(
        grid.ndim == 1 and grid.size > 0 and bool(np.all(np.diff(grid) > 0)),
        "grid",
        grid,
        "a non-empty increasing 1-D array",
    )
    cu = utilization_curve(
        workload, method, grid, latency=latency, window_end=window_end
    )
    reached = cu[None, :] >= targets[:, None]
    out = np.where(reached.any(axis=1), grid[np.argmax(reached, axis=1)], np.inf)
    return float(out[0]) if np.ndim(target_cu) == 0 else out


def bandwidth_table(
    workloads: Sequence[Workload],
    methods: Sequence[Method],
    targets: Sequence[float] = TABLE4_TARGETS,
    *,
    grid: np.ndarray | Sequence[float] = BANDWIDTH_GRID,
    latency: float = 0.0,
) -> list[BandwidthRow]:
    """Table 4: Gbit/s to reach each CU, for every workload × method (appendix)."""
    rows = []
    for w in workloads:
        for m in methods:
            gbps = required_bandwidth(w, m, list(targets), grid=grid, latency=latency)
            rows.append(
                BandwidthRow(
                    w.name,
                    w.num_layers,
                    w.step_time,
                    m.name,
                    tuple(map(float, np.atleast_1d(gbps))),
                )
            )
    return rows


def format_bandwidth_table(
    rows: Sequence[BandwidthRow], targets: Sequence[float] = TABLE4_TARGETS
) -> str:
    """Markdown in Table 4's layout, values rounded to 0.1 Gbit/s."""
    lines = [
        "| Model size | # layers | Step time | Method | "
        + " | ".join(f"{t:.0%}" for t in targets)
        + " |",
        "|" + "---|" * (4 + len(targets)),
    ]
    for r in rows:
        vals = " | ".join(
            "not reached" if math.isinf(v) else f"{v:.1f}" for v in r.gbps
        )
        lines.append(
            f"| {r.model} | {r.num_layers} | {r.step_time:g}s | {r.method} | {vals} |"
        )
    return "\n".join(lines)


def wall_clock_hours(
    workload: Workload,
    method: Method,
    bandwidth: float,
    num_steps: int,
    *,
    latency: float = 0.0,
) -> float:
    """Hours for `num_steps` training steps at `bandwidth` Gbit/s (Table 1; §6.2).

    Extrapolates the steady-state CU (`window_end="steady"`) of the simulated window:
    hours = num_steps · step_time / CU / 3600.

    Example:
        >>> w, dp = paper_workload("1B"), data_parallel_method(BF16_BITS_PER_PARAM)
        >>> round(wall_clock_hours(w, dp, 1.0, 24_300), 1)
        108.2
    """
    check(num_steps >= 1, "num_steps", num_steps, "an int >= 1")
    check(positive(bandwidth) or bandwidth == math.inf, "bandwidth", bandwidth, "> 0")
    cu = utilization_curve(
        workload, method, [bandwidth], latency=latency, window_end="steady"
    )
    return num_steps * workload.step_time / float(cu[0]) / 3600.0


# ------------------------------------------------------------------------------------
# Private helpers.


def _num_steps(method: Method, num_steps: int | None) -> int:
    if num_steps is None:
        return method.default_num_steps()
    check(num_steps >= 1, "num_steps", num_steps, "None or an int >= 1")
    return num_steps


def _layer_times(workload: Workload):
    """Per-layer times inside one step of length T, without stalls.

    Returns (fwd_start, fwd_end, bwd_start, release), each of shape [L]. They are the
    start of the layer's first forward (the one that needs fresh weights), the end of
    its last forward, the start of its first backward, and the end of its last
    backward, when its gradient is final and its reduction is released.

    With one stage and one microbatch this is the paper's step: forward T/3 and
    backward 2T/3, split evenly over the layers. With S stages and m GPipe microbatches,
    a step is m + S − 1 forward slots of t_f followed by as many backward slots of
    t_b = 2 t_f. Stage k holds contiguous layers and runs them in turn inside a slot.
    """
    L, T = workload.num_layers, workload.step_time
    S, m = workload.pipeline_stages, workload.microbatches
    t_f = T / (3 * (m + S - 1))
    t_b = 2 * t_f
    stage = np.arange(L) * S // L
    size = np.bincount(stage, minlength=S)[stage]  # layers in this layer's stage
    i = np.arange(L) - np.searchsorted(stage, stage)  # position inside its stage
    fwd_start = stage * t_f + i * t_f / size
    fwd_end = (stage + m - 1) * t_f + (i + 1) * t_f / size
    backward = (m + S - 1) * t_f
    bwd_start = backward + (S - 1 - stage) * t_b + (size - 1 - i) * t_b / size
    release = backward + (S + m - 2 - stage) * t_b + (size - i) * t_b / size
    return fwd_start, fwd_end, bwd_start, np.minimum(release, T)


def _run(workload, method, bandwidths, latency, num_steps, window_end, record):
    """Schedule the DAG for K bandwidths at once; returns wall times [K] and events.

    Each recurrence is max-plus and is solved with `np.maximum.accumulate`. The
    forward of layer ℓ starts at max(start of ℓ−1 + gap, arrival of ℓ's due
    reduction). The link finishes sending the k-th reduction of a step at
    max(finish of the (k−1)-th, its release) + bits / bandwidth, and the reduction
    arrives `latency` seconds later.
    """
    check(math.isfinite(latency) and latency >= 0, "latency", latency, "a float >= 0")
    check(window_end in WINDOW_ENDS, "window_end", window_end, f"one of {WINDOW_ENDS}")
    L, T = workload.num_layers, workload.step_time
    H, tau = method.inner_steps, method.overlap_steps
    fwd_start, fwd_end, bwd_start, release = _layer_times(workload)
    order = np.argsort(release, kind="stable")  # FIFO order of one step's releases
    frag = method.fragment_of_layer(L)
    offsets = method.sync_offsets(int(frag.max()) + 1)
    steps = np.arange(num_steps)
    sends = ((steps[:, None] + 1 - offsets[None, :]) % H == 0)[:, frag[order]]
    bits = workload.num_params * method.bits_per_param / L
    occupy = bits / (bandwidths * GBIT)  # [K] seconds the link needs per layer
    K = bandwidths.size
    clock = np.zeros(K)  # start of the current step if it does not stall
    link_free = np.zeros(K)  # when the link has sent everything released so far
    arrived = np.zeros(K)  # arrival of the last reduction
    due = {}  # step -> (layers, end of their reductions [K, n])
    events = []
    for s in range(num_steps + tau + 1):
        if s == num_steps:
            window_done = np.maximum(clock, arrived)
        pending = due.pop(s, None)
        if pending is None:
            shift, start = clock, None
        else:
            layers, done = pending
            lag = np.full((K, L), -np.inf)
            lag[:, layers] = done - fwd_start[layers]
            lag[:, 0] = np.maximum(lag[:, 0], clock)
            start = np.maximum.accumulate(lag, axis=1)  # forward start − fwd_start
            shift = start[:, -1]
        if record:
            f0 = (clock[0] if start is None else start[0]) + fwd_start
            events.append(_events("forward", s, f0, f0 - fwd_start + fwd_end))
            events.append(
                _events("backward", s, shift[0] + bwd_start, shift[0] + release)
            )
        layers = order[sends[s]] if s < num_steps else order[:0]
        if layers.size:
            k = np.arange(layers.size)
            lag = shift[:, None] + release[layers] - k * occupy[:, None]
            lag[:, 0] = np.maximum(lag[:, 0], link_free)
            sent = np.maximum.accumulate(lag, axis=1) + (k + 1) * occupy[:, None]
            link_free = sent[:, -1]
            done = sent + latency
            arrived = done[:, -1]
            due[s + 1 + tau] = (layers, done)
            if record:
                events.append(
                    _events("reduce", s, sent[0] - occupy[0], done[0], layers)
                )
        clock = shift + T
    if window_end == "link_idle":
        return window_done, events
    # Step num_steps + τ waits for the window's last sync; the τ steps before it are
    # compute the next window would have done anyway.
    return shift - tau * T, events


def _events(kind, step, start, end, layers=None):
    out = np.empty(len(start), dtype=TRACE_DTYPE)
    out["kind"] = kind
    out["layer"] = np.arange(len(start)) if layers is None else layers
    out["step"] = step
    out["start"] = start
    out["end"] = end
    return out
