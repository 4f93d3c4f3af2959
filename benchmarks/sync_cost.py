"""Sync cost: a step that sends (or receives) a fragment vs one that does not.

Usage: `python -m benchmarks.sync_cost [--model tiny-s] [--batch 2] [--rounds 40]`

The work of a sync (Δ = θ_g − θ_m, quantize and dequantize every replica's Δ, the
float32 mean; at the arrival, the outer Nesterov step and the α-merge) scales with the
parameters, not the tokens, so it is measured at a small batch where it is not drowned
by the inner step's noise. One compiled streaming step (not donated) is replayed on
crafted states that differ only in `step` and `sent_at`, so the same call is an
inner-only step, a step that sends fragment p, or one where fragment p arrives. The
states are interleaved in rounds; the cost of a kind is the median over rounds of
(its step − the inner-only step of the same round).

Two programs: the library's step, and the same step traced with the previous
rounding by search (`step_throughput.round_nearest_search`; the library now rounds
E3M0 on the bit pattern), the before/after of that change. A third, `sdiloco.inner.inner_steps` alone, shows what the sync
machinery costs on a step where nothing is due (the `lax.cond`s should skip it all).
"""

import argparse
import collections as co

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _common, step_throughput
from sdiloco.schedule import NEVER, default_first_send


def crafted_states(state, first_send: tuple[int, ...], sync_every: int) -> dict:
    """States whose next step is inner-only, a send of fragment p, or its arrival.

    Every other field (parameters, optimizer states, in-flight values) is `state`'s.
    Assumes τ = 1 and that `first_send` are all distinct modulo H.
    """
    base = 10 * sync_every  # a multiple of H, past every first send
    num = len(first_send)
    sends = {(f - sync_every) % sync_every for f in first_send}
    quiet = next(
        t
        for t in range(base + 1, base + sync_every)
        if t % sync_every not in sends and (t - 1) % sync_every not in sends
    )

    def at(step: int, sent_at: list[int]):
        return state._replace(
            step=jnp.asarray(step, jnp.int32),
            sent_at=jnp.asarray(sent_at, jnp.int32),
        )

    never = [NEVER] * num
    out = {"inner": at(quiet - 1, never)}
    for p, f in enumerate(first_send):
        t = base + (f - sync_every) % sync_every  # f_p + kH
        out[f"send p={p}"] = at(t - 1, never)
        arrived = list(never)
        arrived[p] = t
        out[f"arrive p={p}"] = at(t, arrived)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-s")
    parser.add_argument("--batch", type=int, default=2, help="global batch B")
    parser.add_argument("--sync-every", type=int, default=12, help="H")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    print(_common.machine())
    H = args.sync_every
    config = _common.run_config(
        "streaming_overlap_fp4",
        model=args.model,
        sync_every=H,
        global_batch=args.batch,
    )
    run = _common.build(config)
    batch = _common.random_batches(1, 2, args.batch, run.model_config.seq_len)[0]
    programs = {
        "library": run.algorithm.step,
        "search rounding (before)": step_throughput.with_search_rounding(
            run.algorithm.step
        ),
    }
    inner_alone = _common.inner_only(config.inner.build(config.steps))

    jitted = {
        name: eqx.filter_jit(lambda s, b, f=f: f(s, b))
        for name, f in {**programs, "inner_steps alone": inner_alone}.items()
    }

    def call(name, state):
        with jax.numpy_dtype_promotion("standard"):
            return jitted[name](state, batch)

    # A realistic state: three real steps, so the replicas differ from θ_g.
    state = run.init_state()
    for _ in range(3):
        state, _ = call("library", state)
    num_fragments = len(run.algorithm.bits_per_fragment(run.model))
    states = crafted_states(state, default_first_send(H, num_fragments), H)
    for kind, s in states.items():  # check the crafted states do what they say
        _, m = call("library", s)
        sent = np.asarray(m["sync/sent"])
        applied = np.asarray(m["sync/applied"])
        p = int(kind[-1]) if "=" in kind else None
        assert sent.any() == kind.startswith(
            "send"
        ) and applied.any() == kind.startswith("arrive"), kind
        assert p is None or sent[p] or applied[p], kind
        call("search rounding (before)", s)
    call("inner_steps alone", states["inner"])
    times: dict[tuple[str, str], list[float]] = co.defaultdict(list)
    for r in range(args.rounds):
        for name in programs if r % 2 == 0 else list(programs)[::-1]:
            for kind, s in states.items():
                _, wall, _ = _common.timed(lambda: call(name, s))
                times[name, kind].append(wall)
        _, wall, _ = _common.timed(lambda: call("inner_steps alone", states["inner"]))
        times["inner_steps alone", "inner"].append(wall)
    print(
        f"\nmodel {args.model}, M = 2, P = {num_fragments}, B × L = {args.batch} × "
        f"{run.model_config.seq_len}, {args.rounds} rounds; wall ms, median "
        "(cost: median over rounds of the step minus the inner-only step ± s.e.)\n"
    )
    print("| step | " + " | ".join(programs) + " |")
    print("|---|" + "---|" * len(programs))
    for kind in states:
        cells = []
        for name in programs:
            t = np.asarray(times[name, kind])
            d = t - np.asarray(times[name, "inner"])
            cell = f"{np.median(t) * 1e3:.2f}"
            if kind != "inner":
                sem = 1.2533 * np.std(d) / np.sqrt(len(d))
                cell += f" (cost {np.median(d) * 1e3:+.2f} ± {sem * 1e3:.2f})"
            cells.append(cell)
        print(f"| {kind} | " + " | ".join(cells) + " |")
    alone = np.asarray(times["inner_steps alone", "inner"])
    d = np.asarray(times["library", "inner"]) - alone
    print(
        f"\nthe library's inner-only step minus `inner_steps` alone (the sync machinery "
        f"when nothing is due: schedule, skipped lax.conds, metrics): "
        f"{np.median(d) * 1e3:+.2f} ± {1.2533 * np.std(d) / np.sqrt(len(d)) * 1e3:.2f}"
        f" ms (inner_steps alone: {np.median(alone) * 1e3:.2f} ms)"
    )
    print(f"\nat the end: {_common.machine()}")


if __name__ == "__main__":
    main()
