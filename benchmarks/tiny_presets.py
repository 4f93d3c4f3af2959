"""Tokens per second of every tiny model preset, Data-Parallel vs Streaming DiLoCo (M = 2).

    python benchmarks/tiny_presets.py [--steps 30] [--batch 16]

Both methods train the same model on the same tokens per step (the global batch split
over M = 2 replicas); the Streaming run is the paper's final method (τ = 1, α = 0.5,
E3M0, 3 layers per fragment) with H = 10 so that the timed steps include syncs. Times
are medians over the timed steps after a warm-up step (which includes compilation,
reported separately).
"""

import argparse
import os
import time

import jax
import numpy as np

import sdiloco
from sdiloco.lab import config as config_lib, data as data_lib, model as model_lib
from sdiloco.lab.train import build


def measure(preset: str, model: str, steps: int, batch: int) -> dict:
    method = {} if preset == "data_parallel" else {"sync_every": 10}
    cfg = config_lib.preset(
        preset, model=model, data={"global_batch_size": batch}, method=method
    )
    r = build(cfg)
    state = r.init_state()
    iterators = r.iterators()
    step = sdiloco.jit_step(r.algorithm)  # the state donated (not the batch)
    batches = [
        data_lib.stack_batches([next(it) for it in iterators]) for _ in range(steps + 1)
    ]
    t = time.perf_counter()
    state, _ = step(state, batches[0])
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t
    times = []
    for b in batches[1:]:
        t = time.perf_counter()
        state, _ = step(state, b)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    tokens = batch * r.model_config.seq_len
    return {
        "compile_s": compile_s,
        "step_s": float(np.median(times)),
        "tokens_per_s": tokens / float(np.median(times)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print("| model | params | method | compile (s) | step (ms) | tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, mc in model_lib.TINY_SCALES.items():
        for preset in ("data_parallel", "streaming_overlap_fp4"):
            m = measure(preset, name, args.steps, args.batch)
            print(
                f"| {name} | {mc.num_params():,} | {preset} | {m['compile_s']:.1f} | "
                f"{1e3 * m['step_s']:.0f} | {m['tokens_per_s']:,.0f} |",
                flush=True,
            )
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
