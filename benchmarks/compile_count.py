"""Compile count: the training step is traced and compiled once for a whole run.

Usage: `python -m benchmarks.compile_count [--model tiny-s] [--sync-every 10]`

The step runs as `sdiloco.lab.train.run` runs it (one jitted step, batches from the grain
iterators, stacked on the host) for `--periods` × H steps, long enough that every
fragment is sent and arrives at least twice. Three counters must all read one:

- Python traces of the step (a counter in the traced function);
- `eqx.debug.assert_max_traces(max_traces=1)` (raises on a second trace);
- XLA compilations started while the loop runs (JAX's
  `/jax/core/compile/backend_compile_duration` monitoring event).
"""

import argparse
import collections as co
import time
from typing import Any

import equinox as eqx
import jax
import numpy as np

from benchmarks import _common
from sdiloco.lab import data as data_lib


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def count_compiles(config: Any, steps: int) -> dict[str, Any]:
    """Run `steps` steps of `config`'s algorithm and count traces and compilations.

    Args:
        config: a `RunConfig` (any method).
        steps: steps to take.

    Returns:
        `traces` (Python traces of the step), `compiles` (XLA compilations during the
        loop, by function name), `bits` (the `comm/bits` metric of every step),
        `sent` (the `sync/sent` metric of every step, `[steps, P]`; all true for
        Data-Parallel), for (Streaming) DiLoCo `sends`/`applied` (per fragment) and
        `merges` (per replica and fragment) over the run, and `seconds`.
    """
    run = _common.build(config)
    traces = 0

    def step(state, batch):
        nonlocal traces
        traces += 1
        return run.algorithm.step(state, batch)

    jitted = _common.jit_step(eqx.debug.assert_max_traces(step, max_traces=1))
    state = _common.fresh(run.init_state())
    iterators = run.iterators()
    compiles: co.Counter[str] = co.Counter()

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        del duration
        if event == _COMPILE_EVENT:
            compiles[kwargs.get("fun_name", "?")] += 1

    totals: dict[str, Any] = {}
    bits, sent = [], []
    t0 = time.perf_counter()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(steps):
            batch = data_lib.stack_batches([next(it) for it in iterators])
            state, metrics = jitted(state, batch)
            bits.append(float(metrics["comm/bits"]))
            sent.append(np.asarray(metrics.get("sync/sent", [True]), bool))
            for key, name in (
                ("sync/sent", "sends"),
                ("sync/applied", "applied"),
                ("sync/merged", "merges"),
            ):
                if key in metrics:
                    value = np.asarray(metrics[key], np.int64)
                    totals[name] = totals.get(name, 0) + value
        jax.block_until_ready(state)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return {
        "traces": traces,
        "compiles": dict(compiles),
        "seconds": time.perf_counter() - t0,
        "bits": bits,
        "sent": np.stack(sent),
        **{k: v.tolist() for k, v in totals.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-s")
    parser.add_argument("--sync-every", type=int, default=10, help="H")
    parser.add_argument("--periods", type=int, default=3, help="steps = periods × H")
    parser.add_argument("--batch", type=int, default=16, help="global batch B")
    args = parser.parse_args()
    print(_common.machine())
    steps = args.periods * args.sync_every
    print(f"model {args.model}, M = 2, H = {args.sync_every}, {steps} steps\n")
    print(
        "| method | steps | traces | XLA compiles in the loop | sends per fragment "
        "| outer steps per fragment | merges per replica × fragment | s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for preset in ("streaming_overlap_fp4", "diloco", "data_parallel"):
        config = _common.run_config(
            preset,
            model=args.model,
            sync_every=args.sync_every,
            global_batch=args.batch,
            steps=steps,
        )
        out = count_compiles(config, steps)
        n = sum(out["compiles"].values())
        print(
            f"| {preset} | {steps} | {out['traces']} | {n} | "
            f"{out.get('sends', '-')} | {out.get('applied', '-')} | "
            f"{out.get('merges', '-')} | {out['seconds']:.1f} |"
        )
    print(f"\nload average at the end: {_common.load()}")


if __name__ == "__main__":
    main()
