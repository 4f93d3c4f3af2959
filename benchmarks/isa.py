"""Which XLA CPU settings make the numerics fingerprint depend on the machine, and
what capping them costs.

Each setting of `XLA_FLAGS` runs in a fresh process: it measures the numerics probes
(`sdiloco.paper.provenance.probes`, with no cached value) and times a segment of the
standard run (tiny-xs, Streaming DiLoCo with overlapped FP4, M = 2: the CPU time and
wall time of steps 41-140, after compiling and warming up, without evaluation). Settings whose probes are equal
compute the same numbers here; a setting is a candidate for equal numbers on *other*
x86 machines only if it removes what differs between them (the instruction set XLA
generates code for, the kernels libraries pick at run time), which one machine type
cannot show: see `docs/decisions.md` ("The same numbers on another machine").

Usage: `python -m benchmarks.isa [--out benchmarks/measured/isa.json]` (the probes of
every setting), then `python -m benchmarks.isa --timing 2 --only default "AVX2 cap"` on
an idle machine (the speed, alternating between the settings).
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks._common import load, machine


SETTINGS: dict[str, str] = {
    "default": "",
    "AVX512 cap": "--xla_cpu_max_isa=AVX512",
    "AVX2 cap": "--xla_cpu_max_isa=AVX2",
    "AVX cap": "--xla_cpu_max_isa=AVX",
    "SSE4_2 cap": "--xla_cpu_max_isa=SSE4_2",
    "no XNNPACK": "--xla_cpu_use_xnnpack=false",
    "AVX2 cap, no XNNPACK": "--xla_cpu_max_isa=AVX2 --xla_cpu_use_xnnpack=false",
}
"""Name → `XLA_FLAGS`."""


CHILD = """
import json, os, resource, time
import jax
from sdiloco.lab import train
from sdiloco.paper import experiments as ex, provenance

if os.environ.get("ISA_TIMING_ONLY") != "1":
    probes = provenance.probes()
    print(json.dumps({"fingerprint": provenance.fingerprint(), "probes": probes}))
    raise SystemExit
config = ex.setup("streaming_overlap_fp4", regime=ex.REGIME)
config = config.replace(steps=140, eval_every=140, log_every=140)
marks = {}
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
def callback(step, state, metrics):
    if step in (40, 140):
        jax.block_until_ready(state)
        marks[step] = (cpu(), time.perf_counter())
with jax.numpy_dtype_promotion("standard"):
    train.run(config, progress=False, callback=callback)
(c0, w0), (c1, w1) = marks[40], marks[140]
print(json.dumps({"cpu_s_per_step": (c1 - c0) / 100, "wall_s_per_step": (w1 - w0) / 100}))
"""


def measure(flags: str, timing_only: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SDILOCO_FINGERPRINT"}
    env["XLA_FLAGS"] = flags
    env["ISA_TIMING_ONLY"] = "1" if timing_only else "0"
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1]}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": round(time.perf_counter() - start, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.isa")
    p.add_argument("--out", default="benchmarks/measured/isa.json")
    p.add_argument("--only", nargs="*", help="setting names to run")
    p.add_argument("--skip-done", action="store_true", help="keep measured settings")
    p.add_argument(
        "--timing",
        type=int,
        metavar="R",
        help="only time the settings, R rounds alternating between them (run on an "
        "otherwise idle machine); kept under each setting's 'timing'",
    )
    args = p.parse_args(argv)
    rows = {}
    if os.path.exists(args.out):
        rows = json.load(open(args.out)).get("settings", {})
    if args.timing:
        names = [n for n in SETTINGS if not args.only or n in args.only]
        for _ in range(args.timing):
            for name in names:
                t = measure(SETTINGS[name], timing_only=True) | {"load": load()}
                rows.setdefault(name, {}).setdefault("timing", []).append(t)
                print(name, json.dumps(t), flush=True)
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "settings": rows}, f, indent=1)
        return
    for name, flags in SETTINGS.items():
        if (args.only and name not in args.only) or (
            args.skip_done and "probes" in rows.get(name, {})
        ):
            continue
        rows[name] = {"xla_flags": flags, **measure(flags), "load": load()}
        print(name, json.dumps(rows[name]), flush=True)
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "settings": rows}, f, indent=1)


if __name__ == "__main__":
    main()
