"""Fig. 4, measured: compute utilization of real training steps on an emulated WAN.

Usage (as root, with iproute2; takes about 15 minutes on two cores):

    python -m benchmarks.measured_utilization
        [--methods NAME ...] [--redo] [--out benchmarks/measured/fig04_utilization.json]
        [--extra-rates MBIT ...]

For each method of `wan_train_worker.METHODS`, two processes (one replica each, each
pinned to its own core) train a tiny transformer in two network namespaces joined by
a shaped link (`benchmarks/wan.py`). The link's rate changes between timing windows:
first no limit, then every rate of the method's grid, then no limit again. The
measured compute utilization at rate b is the seconds per step with no limit (the
mean of the first and last windows) over the seconds per step at b. Beside it, the
simulator (`sdiloco.sim.utilization.simulate`, window "steady") predicts the CU of the
same method for the same step time, bits per parameter and zero latency (the kernel
here has no netem, so the link adds no latency).

Each method's grid is 8 rates, a factor 2 apart, centred on the simulator's knee (the
bandwidth of CU = 0.8 for that step time). The output JSON holds every window's
seconds per step, the CU, the simulator's CU, and the courier's trace of one window.
"""

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

import sdiloco.sim.utilization as ut
from benchmarks import wan
from benchmarks._common import communicate_all, xla_flags
from benchmarks.wan_train_worker import METHODS


ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "measured" / "fig04_utilization.json"
"""Where the measurement is kept (the notebook `fig04_measured_utilization` reads it)."""
GRID_POINTS = 8
GRID_FACTOR = 2.0


def sim_method(
    name: str, sync_every: int, layers_per_fragment: int, bits_per_param: float
) -> ut.Method:
    """The simulator's description of a measured method."""
    kind, tau, _, _ = METHODS[name]
    if kind == "data_parallel":
        return ut.data_parallel_method(bits_per_param)
    if kind == "diloco":
        return ut.diloco_method(sync_every, bits_per_param)
    return ut.streaming_method(
        sync_every,
        layers_per_fragment=layers_per_fragment,
        overlap_steps=tau,
        bits_per_param=bits_per_param,
    )


def bits_per_param(record: dict) -> float:
    """Bits one replica sends per parameter for a full sync, as measured."""
    n = record["num_params"]
    if "message_bytes" in record:
        return 8 * sum(record["message_bytes"]) / n
    if "bits_per_fragment" in record:  # float32 messages: the accounting is the wire
        return sum(record["bits_per_fragment"]) / n
    return 32.0  # Data-Parallel: a float32 gradient all-reduce (M = 2: 4N bytes out)


def simulated_cu(record: dict, rates_mbit, step_time: float) -> list[float]:
    """The simulator's CU at each rate (Mbit/s) for the measured step time."""
    work = ut.Workload(
        num_layers=record["num_layers"],
        step_time=float(step_time),
        num_params=float(record["num_params"]),
    )
    method = sim_method(
        record["method"],
        record["sync_every"],
        record["layers_per_fragment"],
        bits_per_param(record),
    )
    return [
        ut.simulate(work, method, r / 1e3, window_end="steady").compute_utilization
        for r in rates_mbit
    ]


def knee(rates, cu, target: float = 0.8) -> float:
    """The rate where CU first reaches `target` (log-interpolated; inf: never)."""
    rates, cu = np.asarray(rates, float), np.asarray(cu, float)
    order = np.argsort(rates)
    rates, cu = rates[order], cu[order]
    for i, (r, c) in enumerate(zip(rates, cu)):
        if c >= target:
            if i == 0:
                return float(r)
            r0, c0 = rates[i - 1], cu[i - 1]
            f = (target - c0) / (c - c0)
            return float(math.exp(math.log(r0) + f * (math.log(r) - math.log(r0))))
    return math.inf


def run_method(name: str, args, rates: list[float] | None = None) -> dict:
    """Train one method across the windows: no limit, each rate, no limit.

    Without `rates`, the grid (`grid_for`) is chosen once the first window has
    measured the step time. The window of the middle rate is traced. The workers
    get two host CPU devices each and the environment's other XLA flags (none for the
    published figures; the tests' compile-fast flags under pytest).
    """
    fixed = rates
    windows = (GRID_POINTS if fixed is None else len(fixed)) + 2
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags(2),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    cores = os.cpu_count() or 1
    options = {
        "--method": name,
        "--windows": windows,
        "--model": args.model,
        "--batch": args.batch,
        "--sync-every": args.sync_every,
        "--layers-per-fragment": args.layers_per_fragment,
        "--periods": args.periods,
    }
    if getattr(args, "overlap", None) is not None:
        options["--overlap"] = args.overlap
    net = wan.Wan(2, burst_ms=1, min_burst=args.min_burst, queue_bytes=1 << 22)
    with tempfile.TemporaryDirectory() as tmp, net:
        control = pathlib.Path(tmp)
        extra = [str(x) for kv in options.items() for x in kv]
        argv = ["-m", "benchmarks.wan_train_worker", f"{net.ip(0)}:23461", "2"]
        procs = net.start(
            lambda i: [
                *("taskset", "-c", str(i % cores), sys.executable, *argv, str(i)),
                *("--control", str(control), *extra),
            ],
            env=env,
            cwd=ROOT,
        )
        try:
            deadline = time.time() + args.timeout
            rates = [None] + ([] if fixed is None else [*fixed, None])
            for i in range(windows):
                ready = _wait(control / f"ready_{i}", procs, deadline, name)
                if i == 1 and fixed is None:
                    meta = json.loads(ready)
                    rates += grid_for(meta, meta["seconds_per_step"][0]) + [None]
                net.set_rate(rates[i])
                trace = i == 1 + (windows - 2) // 2
                (control / f"go_{i}").write_text("trace" if trace else "")
                print(
                    f"  {name}: window {i}, {rates[i] or 'no limit'} Mbit/s", flush=True
                )
            left = max(1.0, deadline - time.time())
            outs = [out for out, _ in communicate_all(procs, left)]
        finally:
            for p in procs:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(o[-3000:] for o in outs))
    line = next(x for x in outs[0].splitlines() if x.startswith("{"))
    record = json.loads(line)
    grid = rates[1:-1]
    sec = record["seconds_per_step"]
    base = 0.5 * (sec[0] + sec[-1])
    record["rates_mbit"] = grid
    record["step_time_no_limit"] = [sec[0], sec[-1]]
    record["cu"] = [base / s for s in sec[1:-1]]
    record["cu_simulated"] = simulated_cu(record, grid, base)
    record["bits_per_param"] = bits_per_param(record)
    record["knee_measured"] = knee(grid, record["cu"])
    record["knee_simulated"] = knee(grid, record["cu_simulated"])
    return record


def merge(record: dict, more: dict) -> dict:
    """A method's record with the windows of a second run (`--extra-rates`) added:
    each run's CU is relative to its own no-limit windows."""
    out = dict(record)
    rows = sorted(
        zip(
            record["rates_mbit"] + more["rates_mbit"],
            record["cu"] + more["cu"],
            record["cu_simulated"] + more["cu_simulated"],
        )
    )
    out["rates_mbit"], out["cu"], out["cu_simulated"] = map(list, zip(*rows))
    out["extra_runs"] = record.get("extra_runs", []) + [
        {k: more[k] for k in ("rates_mbit", "seconds_per_step", "step_time_no_limit")}
    ]
    out["knee_measured"] = knee(out["rates_mbit"], out["cu"])
    out["knee_simulated"] = knee(out["rates_mbit"], out["cu_simulated"])
    return out


def grid_for(meta: dict, step_time: float) -> list[float]:
    """`GRID_POINTS` rates a factor 2 apart around the simulator's CU = 0.8 rate."""
    fine = np.logspace(-3, 4, 281)  # Mbit/s
    centre = knee(fine, simulated_cu(meta, fine, step_time))
    lo = centre / GRID_FACTOR ** (GRID_POINTS / 2 - 0.5)
    return [float(f"{lo * GRID_FACTOR**k:.3g}") for k in range(GRID_POINTS)]


def _wait(path: pathlib.Path, procs, deadline: float, name: str) -> str:
    while not path.exists():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(_outputs(procs))
        if time.time() > deadline:
            raise TimeoutError(f"{name}: {path.name} never appeared")
        time.sleep(0.02)
    time.sleep(0.05)  # the writer's JSON is complete
    return path.read_text()


def _outputs(procs) -> str:
    out = []
    for p in procs:
        p.kill()
        out.append((p.communicate()[0] or "")[-3000:])
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.measured_utilization")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--methods", nargs="*", default=list(METHODS))
    p.add_argument("--model", default="tiny-xs")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--sync-every", type=int, default=15)
    p.add_argument("--periods", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--redo", action="store_true", help="measure recorded methods again")
    p.add_argument(
        "--extra-rates",
        type=float,
        nargs="*",
        help="measure the recorded --methods at these rates too and merge them in",
    )
    p.add_argument("--layers-per-fragment", type=int, default=3)
    p.add_argument("--min-burst", type=int, default=2048)
    args = p.parse_args(argv)
    ok, why = wan.available()
    if not ok:
        print(f"cannot emulate a WAN here: {why}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"methods": {}}
    if args.extra_rates:
        for name in args.methods:
            old = results["methods"][name]
            more = run_method(name, args, rates=args.extra_rates)
            results["methods"][name] = merge(old, more)
            out.write_text(json.dumps(results, indent=1))
            print(f"{name}: CU {more['cu']} at {args.extra_rates} Mbit/s", flush=True)
        return 0
    for name in args.methods:
        if name in results["methods"] and not args.redo:
            print(f"{name}: recorded, skipped (--redo to measure again)")
            continue
        record = run_method(name, args)
        results["methods"][name] = record
        results["setup"] = {
            "model": args.model,
            "batch_per_replica": args.batch,
            "sync_every": args.sync_every,
            "layers_per_fragment": args.layers_per_fragment,
            "timed_periods": args.periods,
            "replicas": 2,
            "min_burst_bytes": args.min_burst,
        }
        out.write_text(json.dumps(results, indent=1))
        base = float(np.mean(record["step_time_no_limit"]))
        print(
            f"{name}: {base * 1e3:.1f} ms/step, {record['bits_per_param']:.2f} "
            f"bits/param, knee (CU 0.8) measured {record['knee_measured']:.3g} vs "
            f"simulated {record['knee_simulated']:.3g} Mbit/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
