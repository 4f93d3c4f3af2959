"""Memory: bytes of the training state, measured, against the analytic count and §2.5.

Usage: `python -m benchmarks.memory [--model tiny-s] [--replicas 2]`

Measured: the bytes of every array of `alg.init(model)`, part by part, for Streaming
DiLoCo (overlapped FP4, the default preset), DiLoCo and Data-Parallel; and XLA's memory
analysis of each compiled step (arguments, outputs, temporaries). Analytic: N
parameters of b bytes, Adam's two moments, optax's int32 counters, and for Streaming
the global copy, the outer Nesterov momentum and the in-flight buffer.

The paper (§2.5, docs/paper.md §1.10) counts per replica: Data-Parallel 3N (parameters
and Adam), DiLoCo 5N (plus global parameters and outer momentum), i.e. 5/3. Our state also
keeps `inflight`, the averaged outer gradient Δ̄ of the fragments in flight, in K slots
the size of the largest fragment (K read off the schedule, 1 by default;
`sdiloco.inflight`): 5N + the largest fragment for Streaming, 6N for DiLoCo (whose one
fragment is the whole model). The simulated state holds all M replicas on one device
and the shared parts once; "per replica" below is what one worker holds in a
deployment: its replica and inner state, plus its own copy of the shared parts.
"""

import argparse
from typing import Any

import equinox as eqx
import jax
import numpy as np

import sdiloco
from benchmarks import _common
from sdiloco.sim import memory as memory_lib


def nbytes(tree: Any) -> int:
    """Bytes of the arrays of a pytree (its non-array leaves cost nothing)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if eqx.is_array(x))


def measured(state: Any) -> dict[str, int]:
    """Bytes of each field of a state NamedTuple."""
    return {name: nbytes(getattr(state, name)) for name in state._fields}


def analytic(
    num_params: int,
    method: str,
    *,
    replicas: int,
    num_fragments: int = 1,
    inflight_values: int | None = None,
    bytes_per_value: int = 4,
) -> dict[str, int]:
    """The bytes each field should hold, counted from N (float32 parameters).

    The inner optimizer is the presets' `clip_by_global_norm → adamw(schedule)`
    with its peak learning rate, warmup and length values of the state
    (`optax.inject_hyperparams`): two moments per parameter, three int32 counters
    (Adam's, the schedule's and the injection's), the float32 learning rate and the
    int32 warmup and length per replica. The outer optimizer, SGD
    with Nesterov momentum, keeps one momentum per parameter and, per fragment, the
    injection's counter, learning rate and momentum. The in-flight buffer holds
    `inflight_values` values (`num_slots × slot_size` of the run's layout; default
    N, one whole-model slot).
    """
    n = num_params * bytes_per_value
    inner = 2 * n + 3 * 4 + 4 + 2 * 4
    if method == "data_parallel":
        return {"step": 4, "global_params": n, "inner_state": inner}
    return {
        "step": 4,
        "global_params": n,
        "outer_state": n + num_fragments * 3 * 4,
        "replica_params": replicas * n,
        "inner_state": replicas * inner,
        # K slots of the largest fragment, float32 (or wider) outer gradients:
        "inflight": (num_params if inflight_values is None else inflight_values) * 4,
        "sent_at": 4 * num_fragments,
        "inflight_ok": num_fragments,
        # who sent each fragment's Δ in flight (bool) and their inner steps (int32):
        "senders": num_fragments * replicas,
        "sent_steps": 4 * num_fragments * replicas,
        "alive": replicas,
        # inner steps each replica took since each fragment's last sync (token weights):
        "steps_since": 4 * replicas * num_fragments,
        # The plug-ins' state (error feedback's residual, Eager's stand-ins: M×N
        # each); the α-merge alone keeps none:
        "plugin_state": 0,
        "key": 8,
        # The posted exchange's packed messages (none with the in-step exchange):
        "outbox": 0,
        "inbox": 0,
    }


def per_replica(parts: dict[str, int], fields: tuple[str, ...], replicas: int) -> int:
    """What one worker holds: 1/M of the replica fields (`fields`, as the state
    declares them in `replica_fields`), all of the rest."""
    shared = sum(v for k, v in parts.items() if k not in fields)
    return shared + sum(parts.get(k, 0) for k in fields) // replicas


def step_memory(run: Any, state: Any) -> dict[str, int]:
    """XLA's memory analysis of the compiled step (state donated, batch not)."""
    batch = _common.random_batches(
        1,
        run.config.method.num_replicas,
        run.config.data.global_batch_size,
        run.model_config.seq_len,
    )[0]
    jitted = eqx.filter_jit(
        lambda b, s: run.algorithm.step(s, b), donate="all-except-first"
    )
    with jax.numpy_dtype_promotion("standard"):
        compiled = jitted.lower(batch, state).compile().compiled
    m = compiled.memory_analysis()
    return {
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "aliased": int(m.alias_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-s")
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    print(_common.machine())
    M = args.replicas
    rows, fields = {}, {}
    for preset in ("streaming_overlap_fp4", "diloco", "data_parallel"):
        config = _common.run_config(preset, model=args.model, replicas=M)
        run = _common.build(config)
        state = run.init_state()
        n = sum(
            int(np.prod(x.shape))
            for x in jax.tree.leaves(eqx.filter(run.model, eqx.is_inexact_array))
        )
        p = len(run.algorithm.bits_per_fragment(run.model))
        method = "data_parallel" if preset == "data_parallel" else "streaming"
        fields[preset] = sdiloco.replica_fields(state)
        slots = state.inflight.size if hasattr(state, "inflight") else None
        rows[preset] = (
            measured(state),
            analytic(n, method, replicas=M, num_fragments=p, inflight_values=slots),
            step_memory(run, state),
        )
    print(f"model {args.model}: N = {n:,} float32 parameters, M = {M}\n")
    field_names = list(rows["streaming_overlap_fp4"][0])
    print(
        "| state field | " + " | ".join(f"{k} measured (analytic)" for k in rows) + " |"
    )
    print("|---|" + "---|" * len(rows))
    for field in field_names:
        cells = []
        for meas, ana, _ in rows.values():
            cells.append(f"{meas[field]:,} ({ana[field]:,})" if field in meas else "-")
        print(f"| {field} | " + " | ".join(cells) + " |")
    totals = {k: (sum(m.values()), sum(a.values())) for k, (m, a, _) in rows.items()}
    print(
        "| **total (simulated, all M replicas)** | "
        + " | ".join(f"{m:,} ({a:,})" for m, a in totals.values())
        + " |"
    )
    per = {k: per_replica(m, fields[k], M) for k, (m, _, _) in rows.items()}
    dp = per["data_parallel"]
    print(
        "| **per replica (deployed)** | "
        + " | ".join(f"{v:,} = {v / dp:.4f} × DP" for v in per.values())
        + " |"
    )
    ours = per["streaming_overlap_fp4"]
    slot = rows["streaming_overlap_fp4"][0]["inflight"]
    print(
        f"\nper replica ÷ Data-Parallel: ours {ours / dp:.4f} = "
        f"{ours / (4 * n):.4f} N (the paper's 5 copies + one in-flight slot of the "
        f"largest fragment, {slot / (4 * n):.4f} N); without the slot "
        f"{(ours - slot) / dp:.4f}; paper §2.5: "
        f"{memory_lib.overhead_vs_data_parallel(n, 'diloco'):.4f} (5/3). "
        f"sdiloco.sim.memory (paper's count): "
        f"{memory_lib.memory_footprint(n, 'diloco').hbm_bytes:,.0f} B; ours {ours:,} B"
    )
    print(
        "\n| compiled step (XLA memory analysis, bytes) | arguments | outputs | "
        "aliased (donated) | temporaries |"
    )
    print("|---|---|---|---|---|")
    for k, (_, _, s) in rows.items():
        print(
            f"| {k} | {s['arguments']:,} | {s['outputs']:,} | {s['aliased']:,} | "
            f"{s['temporaries']:,} |"
        )
    print()
    print(offload_line(args.model, M, dp))
    print()
    print(paper_scale_table())
    print(f"\nload average at the end: {_common.load()}")


def offload_line(model: str, replicas: int, dp_per_replica: float) -> str:
    """Streaming FP4's state per replica with `offload=True`, by memory kind."""
    config = _common.run_config("streaming_overlap_fp4", model=model, replicas=replicas)
    run = _common.build(config)
    with jax.numpy_dtype_promotion("standard"):
        alg = config.method.build(
            run.algorithm.spec.loss_fn,
            config.inner.build(config.steps),
            run.model,
            offload=True,
        )
        state = alg.init(run.model, jax.random.key(0))
    n = 4 * sum(
        int(np.prod(x.shape))
        for x in jax.tree.leaves(eqx.filter(run.model, eqx.is_inexact_array))
    )
    kinds: dict[str, float] = {}
    for name, b in sdiloco.per_replica_bytes(state).items():
        leaves = [x for x in jax.tree.leaves(getattr(state, name)) if eqx.is_array(x)]
        kind = leaves[0].sharding.memory_kind if leaves else "device"
        kinds[kind] = kinds.get(kind, 0.0) + b
    device, host = kinds.get("device", 0.0), kinds.get("pinned_host", 0.0)
    return (
        f"with offload=True, per replica: device {device:,.0f} B = {device / n:.4f} N "
        f"= {device / dp_per_replica:.4f} × DP (3 N + the in-flight slot), host "
        f"{host:,.0f} B = {host / n:.4f} N (θ_g and the outer momentum); the paper's "
        "+2 % needs small fragments: see benchmarks/h200/offload.txt"
    )


def paper_scale_table() -> str:
    """Per-replica GiB at the paper's scales: §2.5's counts and ours (analytic; the
    largest fragment taken as 3 of the L layers' share of N)."""
    gib = memory_lib.GIB
    lines = [
        "| N, layers | Data-Parallel (3N) | DiLoCo, paper (5N) | "
        "ours, Streaming (5N + 3 layers) | Streaming, paper, outer state offloaded | "
        "ours ÷ DP |",
        "|---|---|---|---|---|---|",
    ]
    for n, layers in ((1.27e9, 24), (100e9, 108)):
        dp = memory_lib.memory_footprint(n, "data_parallel").hbm_bytes
        di = memory_lib.memory_footprint(n, "diloco").hbm_bytes
        sd = memory_lib.memory_footprint(n, "streaming", num_layers=layers).hbm_bytes
        ours = di + 4 * n * 3 / layers  # one slot of a 3-layer fragment
        lines.append(
            f"| {n:.3g}, {layers} | {dp / gib:,.1f} | {di / gib:,.1f} | "
            f"{ours / gib:,.1f} | {sd / gib:,.1f} | {ours / dp:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
