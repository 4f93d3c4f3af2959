"""One process of the measured compute utilization (Fig. 4) over the emulated WAN.

Usage (started by `benchmarks/measured_utilization.py` inside a `Wan` namespace):

    python -m benchmarks.wan_train_worker COORDINATOR NUM_PROCESSES PROCESS_ID
        --method NAME --control DIR --windows N [--model tiny-xs] [--batch 64]
        [--sync-every 15] [--layers-per-fragment 3] [--periods 2]

Each process holds one replica of a tiny transformer on its first CPU device (its
second device is the courier's communication device) and trains it with one method
of `METHODS` on random tokens. The run is a series of timing windows; before window
i, process 0 writes `DIR/ready_i` (the seconds per step of the windows so far) and
waits for `DIR/go_i`, which the driver writes
once it has set the link's rate for that window; then both processes meet at a
barrier (a `go_i` that reads "trace" asks for the time each step of the window
ends, and the courier's events). A window is H untimed steps (the pipeline reaches its steady state) and then
`periods`·H timed steps, ended by waiting for the state. Process 0 prints one JSON
line: the seconds per step of every window, the message bytes of a sync, the
parameter count and, for the courier's methods, its per-message events.
"""

import argparse
import json
import os
import pathlib
import time

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
from jax.experimental import multihost_utils

import sdiloco
from sdiloco import distributed
from sdiloco.lab import cluster, methods, model as model_lib


METHODS = {
    # name: (kind, overlap τ, quantizer, courier)
    "data_parallel": ("data_parallel", 0, None, False),
    "diloco": ("diloco", 0, None, False),
    "streaming": ("streaming", 0, None, False),
    "streaming_overlap_in_step": ("streaming", 1, None, False),
    "streaming_overlap": ("streaming", 1, None, True),
    "streaming_overlap_fp4": ("streaming", 1, "e3m0", True),
}
"""The measured methods. `streaming_overlap_in_step` is τ = 1 with the exchange
inside the step that sends (`sharded_exchange`): the same numbers as
`streaming_overlap`, nothing hidden."""


def build(
    name: str,
    model_name: str,
    sync_every: int,
    layers_per_fragment: int,
    mesh,
    comm,
    overlap: int | None = None,
):
    """The algorithm, its step function and whether a courier drives it (`overlap`
    replaces the method's τ when it has one)."""
    kind, tau, quant, courier = METHODS[name]
    if overlap is not None and tau > 0:
        tau = overlap
    mc = model_lib.preset(model_name)
    model = model_lib.Transformer(mc, key=jr.PRNGKey(0))
    inner = optax.adamw(1e-3)
    loss = model_lib.loss_with_aux
    exchange = (
        distributed.posted_exchange(mesh)
        if courier
        else distributed.sharded_exchange(mesh)
    )
    if kind == "data_parallel":
        alg = sdiloco.data_parallel(loss, inner=inner, num_replicas=2)
    elif kind == "diloco":
        alg = sdiloco.diloco(
            loss,
            inner=inner,
            num_replicas=2,
            sync_every=sync_every,
            exchange=exchange,
        )
    else:
        cfg = methods.StreamingConfig(
            num_replicas=2,
            sync_every=sync_every,
            layers_per_fragment=layers_per_fragment,
            overlap=tau,
            quantizer=quant,
        )
        alg = cfg.build(loss, inner, model, exchange=exchange)
    if courier:
        step = distributed.Courier(alg, mesh, comm)
    else:
        step = distributed.sharded_step(alg.step, mesh, metrics="local")
    return alg, model, step, mc


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("coordinator")
    p.add_argument("num_processes", type=int)
    p.add_argument("process_id", type=int)
    p.add_argument("--method", choices=sorted(METHODS), required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--windows", type=int, required=True)
    p.add_argument("--model", default="tiny-xs")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--sync-every", type=int, default=15)
    p.add_argument("--layers-per-fragment", type=int, default=3)
    p.add_argument("--periods", type=int, default=2)
    p.add_argument("--overlap", type=int, help="τ of the overlapped methods (1)")
    args = p.parse_args(argv)
    cluster.connect(args.coordinator, args.num_processes, args.process_id, timeout_s=60)
    control = pathlib.Path(args.control)
    primary = jax.process_index() == 0
    try:
        m = 2
        mesh, comm = distributed.courier_meshes(m)
        alg, model, step, mc = build(
            args.method,
            args.model,
            args.sync_every,
            args.layers_per_fragment,
            mesh,
            comm,
            args.overlap,
        )
        state = distributed.shard_state(alg.init(model, jr.key(1)), mesh)
        rng = np.random.default_rng(0)
        mine = distributed.process_replicas(mesh, m)
        batches = []
        for _ in range(4):
            shape = (m, args.batch, mc.seq_len + 1)
            tokens = rng.integers(0, 256, shape, np.int32)[mine]
            host = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}
            batches.append(distributed.shard_batch(host, mesh, m))
        h = args.sync_every
        count = [0]

        def run(n, trace=None):
            nonlocal state
            for _ in range(n):
                state, _ = step(state, batches[count[0] % len(batches)])
                count[0] += 1
                if trace is not None:
                    jax.block_until_ready(state)
                    trace.append(time.perf_counter())
            jax.block_until_ready(state)

        run(2 * h)  # compile and warm up
        meta = {
            "method": args.method,
            "num_params": int(
                sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
            ),
            "num_layers": mc.num_layers,
            "sync_every": h,
            "layers_per_fragment": args.layers_per_fragment,
        }
        if alg.spec is not None:
            meta["bits_per_fragment"] = [int(b) for b in alg.bits_per_fragment(model)]
            if alg.spec.posted:
                meta["message_bytes"] = alg.spec.message_bytes(model).tolist()
        seconds, traces = [], []
        for i in range(args.windows):
            if isinstance(step, distributed.Courier):
                step.drain()
            if primary:
                ready = {"seconds_per_step": seconds, **meta}
                (control / f"ready_{i}").write_text(json.dumps(ready))
                deadline = time.time() + 600
                while not (control / f"go_{i}").exists():
                    if time.time() > deadline:
                        raise TimeoutError(f"no go_{i} from the driver")
                    time.sleep(0.01)
            multihost_utils.sync_global_devices(f"window_{i}")
            tracing = (control / f"go_{i}").read_text() == "trace"
            run(h)
            trace = [] if tracing else None
            first_event = len(getattr(step, "events", []))
            start = time.perf_counter()
            run(args.periods * h, trace)
            seconds.append((time.perf_counter() - start) / (args.periods * h))
            if trace is not None:
                stamps = ("posted", "started", "arrived")
                events = [
                    {k: (e[k] - start if k in stamps else e[k]) for k in e}
                    for e in getattr(step, "events", [])[first_event:]
                    if "arrived" in e
                ]
                ends = [t - start for t in trace]
                traces.append({"window": i, "step_ends": ends, "events": events})
        if isinstance(step, distributed.Courier):
            step.close()
        if primary:
            out = {**meta, "seconds_per_step": seconds, "traces": traces}
            print(json.dumps(out), flush=True)
    finally:
        cluster.disconnect()


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
