"""Streaming DiLoCo (Douillard et al., 2025, Alg. 2) as one pure, jittable step.

`streaming_diloco(...)` returns an `Algorithm`: a pair of pure functions
`init(params, key) -> state` and `step(state, batch) -> (state, metrics)`. Replicas live
on a leading axis M of the state and of the batch, and the inner step is vmapped over it.
Which fragment is sent, received or merged at step t is traced data (masks built from the
fragment labels), so `eqx.filter_jit(step)` compiles once and serves every step.

One step t ← t + 1 (SPEC §1):

1. inner: every replica takes one inner-optimizer step on its own batch (l.3-5);
2. send: every fragment due at t computes `Δ_m = θ_g − θ_m`, compresses it per replica,
   and averages it in float32 or wider; it is in flight until t + τ (l.6-8);
3. receive: a fragment whose earliest arrival is t takes its outer step on θ_g (l.11);
   each replica m whose arrival `sent + τ_m` is t merges
   `θ_m ← α·θ_m + (1 − α)·θ_g` on that fragment (l.12).

Vanilla DiLoCo is `diloco(...)`: the same code with P = 1, τ = 0, α = 0 and no
compressor. Data-Parallel, which is different maths, is in `data_parallel.py`.

This differs from the paper in:
1. Δ is taken against the global parameters θ_g kept in the state (PAPER.md §1.12):
   line 11's θ^(t−τ−H) is read as "the global value after the fragment's last sync".
2. Steps are 1-based and fragment p is first sent at `f_p` (default `H + round(pH/P)`),
   so every fragment's first outer gradient spans at least H inner steps.
3. A non-finite outer gradient is detected and handled by a policy (SPEC §5).
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from . import communication
from .compression import Compressor, quantizer
from .custom_types import Batch, Metrics, Params, Replicated
from .fragments import Fragments, check_matches, single_fragment
from .inner import check_batch, inner_steps, replicate
from .outer import merge, outer_init, outer_step
from .schedule import NEVER, make_schedule


NONFINITE_POLICIES = ("skip", "apply", "raise")


class StreamingState(NamedTuple):
    """The whole state of a Streaming DiLoCo run (one immutable pytree)."""

    step: Int[Array, ""]  # [] int32, number of steps taken (t)
    global_params: Params  # θ_g, one copy, the parameters' dtypes
    outer_state: optax.OptState  # param-like leaves once; other leaves [P, ...]
    replica_params: Replicated  # θ_m, [M, ...] per array leaf
    inner_state: optax.OptState  # [M, ...] per leaf, never synchronised
    inflight: Params  # Δ̄ of fragments in flight, [...] float32 or wider
    sent_at: Int[Array, " P"]  # [P] int32, step each fragment was last sent (-1: never)
    inflight_ok: Bool[Array, " P"]  # [P] bool, whether that Δ̄ was finite
    residual: Replicated | None  # error feedback, [M, ...] wide dtype; None when off
    key: Array  # [2] uint32, root key of stochastic compressors


class Algorithm(NamedTuple):
    """A distributed training algorithm: pure `init` and `step`, plus its accounting.

    Attributes:
        init: `init(params, key=None) -> state`.
        step: `step(state, batch) -> (state, metrics)`, pure and jittable; every leaf of
            `batch` has a leading axis of size `num_replicas`.
        bits_per_fragment: `bits_per_fragment(params) -> [P]` exact bits (Python ints)
            one replica puts on the wire to send each fragment (SPEC §3); for
            Data-Parallel, one entry: the bits of one gradient exchange.
        num_replicas: M.
    """

    init: Callable[..., Any]
    step: Callable[[Any, Batch], tuple[Any, Metrics]]
    bits_per_fragment: Callable[[Params], np.ndarray]
    num_replicas: int


def streaming_diloco(
    loss_fn: Callable[..., Any],
    *,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    num_replicas: int = 2,
    sync_every: int = 100,
    fragments: Fragments | None = None,
    overlap: int | Sequence[int] = 1,
    alpha: float = 0.5,
    first_send: Sequence[int] | None = None,
    compressor: Compressor | str | None = None,
    error_feedback: bool = False,
    nonfinite: str = "skip",
    has_aux: bool = False,
    exchange: Callable[..., Any] = communication.simulated_exchange,
) -> Algorithm:
    """Streaming DiLoCo (Alg. 2) with overlapped, compressed fragment syncs.

    Args:
        loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux`),
            for one replica's batch. `params` is whatever pytree `init` was given (an
            Equinox module included); gradients flow to its floating-point arrays.
        inner: the inner optimizer (any optax transformation), e.g. AdamW.
        outer: the outer optimizer; default `optax.sgd(0.4, momentum=0.9,
            nesterov=True)` (PAPER.md §1.6). Its state is kept per fragment.
        num_replicas: M >= 1.
        sync_every: H >= 1, inner steps between two sends of one fragment.
        fragments: the partition (see `fragments.py`); None syncs the whole model as
            one fragment.
        overlap: τ, one int or one per replica, 0 <= τ < H: a fragment sent at t is
            merged by replica m at t + τ_m.
        alpha: the mixing factor α in [0, 1] of the merge.
        first_send: f_p >= 1 per fragment; default `H + round(p·H/P)`.
        compressor: applied to each replica's Δ before the exchange (a `quantizer`,
            `dare`, `top_k`, `fed_dropout`; a format name such as "e3m0" is short for
            `quantizer(name)`); None sends float32.
        error_feedback: carry each replica's compression residual into its next send
            of that fragment (beyond the paper).
        nonfinite: what to do with a non-finite averaged outer gradient: "skip" (the
            default: skip that fragment's outer step and restore it to θ_g on every
            replica, a failed round), "apply" (no check), "raise" (a runtime error).
        has_aux: whether `loss_fn` returns `(loss, aux)` with `aux` a dict of arrays.
        exchange: how replicas exchange outer gradients:
            `exchange(compressor, fragments, deltas, key, sent) -> (mean, own)`; the default
            simulates all replicas on one device. `distributed.py` provides one that
            moves the packed low-bit payload between devices and hosts.

    Returns:
        The `Algorithm`.

    Raises:
        ValueError: on a bad configuration (SPEC §5), naming field, value and allowed.
    """
    outer = optax.sgd(0.4, momentum=0.9, nesterov=True) if outer is None else outer
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha!r}; must be in [0, 1].")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r}; allowed: {NONFINITE_POLICIES}.")
    if isinstance(compressor, str):
        compressor = quantizer(compressor)
    if compressor is not None and not isinstance(compressor, Compressor):
        raise ValueError(
            f"compressor={compressor!r} is not a Compressor; build one with "
            "sdiloco.quantizer(...), dare(...), top_k(...) or fed_dropout(...)."
        )
    if error_feedback and compressor is None:
        raise ValueError("error_feedback=True needs a compressor; got compressor=None.")
    if fragments is not None and not isinstance(fragments, Fragments):
        raise ValueError(f"fragments={fragments!r} is not a Fragments.")
    num_fragments = 1 if fragments is None else fragments.num_fragments
    schedule = make_schedule(
        sync_every, num_fragments, num_replicas, overlap, first_send
    )
    M = num_replicas

    def get_fragments(arrays: Params) -> Fragments:
        return single_fragment(arrays) if fragments is None else fragments

    def bits_per_fragment(params: Params) -> np.ndarray:
        return communication.bits_per_fragment(compressor, get_fragments(params))

    def init(params: Params, key: PRNGKeyArray | None = None) -> StreamingState:
        """The initial state: every replica and θ_g equal to `params`, t = 0."""
        frags = get_fragments(params)
        check_matches(frags, params)
        arrays = eqx.filter(params, eqx.is_inexact_array)
        replicas = replicate(params, M)
        inflight = jax.tree.map(
            lambda x: jnp.zeros(x.shape, communication.wide_dtype(x.dtype)), arrays
        )
        residual = None
        if error_feedback:
            residual = jax.tree.map(
                lambda x: jnp.zeros((M,) + x.shape, communication.wide_dtype(x.dtype)),
                arrays,
            )
        return StreamingState(
            step=jnp.zeros((), jnp.int32),
            global_params=params,
            outer_state=outer_init(outer, arrays, frags.num_fragments),
            replica_params=replicas,
            inner_state=eqx.filter_vmap(inner.init)(
                eqx.filter(replicas, eqx.is_inexact_array)
            ),
            inflight=inflight,
            sent_at=jnp.full((frags.num_fragments,), NEVER, jnp.int32),
            inflight_ok=jnp.ones((frags.num_fragments,), bool),
            residual=residual,
            key=_key_data(key),
        )

    def step(state: StreamingState, batch: Batch) -> tuple[StreamingState, Metrics]:
        """One step of Streaming DiLoCo (Alg. 2, l.3-12)."""
        check_batch(batch, M)
        t = state.step + 1
        # 1. Inner optimization on every replica (l.3-5).
        replicas, inner_state, losses, aux = inner_steps(
            loss_fn, inner, has_aux, state.replica_params, state.inner_state, batch
        )
        g_arrays, g_static = eqx.partition(state.global_params, eqx.is_inexact_array)
        r_arrays, r_static = eqx.partition(replicas, eqx.is_inexact_array)
        frags = get_fragments(g_arrays)
        treedef = jax.tree.structure(g_arrays)
        g_leaves = jax.tree.leaves(g_arrays)
        r_leaves = jax.tree.leaves(r_arrays)
        inflight = jax.tree.leaves(state.inflight)
        residual = None if state.residual is None else jax.tree.leaves(state.residual)

        # 2. Send the fragments due at t (l.6-8).
        sent = schedule.sent(t)

        def do_send(operands):
            inflight, sent_at, ok, residual = operands
            deltas = communication.outer_gradients(g_leaves, r_leaves)
            if residual is not None:
                deltas = [d + e for d, e in zip(deltas, residual)]
            key = jr.fold_in(state.key, t)
            mean, recon = exchange(compressor, frags, deltas, key, sent)
            mask = frags.mask(sent)
            inflight = [jnp.where(m, x, old) for m, x, old in zip(mask, mean, inflight)]
            if residual is not None:
                residual = [
                    jnp.where(m[None], d - q, e)
                    for m, d, q, e in zip(mask, deltas, recon, residual)
                ]
            finite = ~communication.nonfinite_fragments(frags, mean)
            sent_at = jnp.where(sent, t, sent_at)
            ok = jnp.where(sent, finite, ok)
            return inflight, sent_at, ok, residual

        inflight, sent_at, ok, residual = jax.lax.cond(
            jnp.any(sent),
            do_send,
            lambda operands: operands,
            (inflight, state.sent_at, state.inflight_ok, residual),
        )

        # 3a. Outer step of the fragments whose earliest arrival is t (l.9-11).
        due = schedule.outer_due(t, sent_at)
        failed = due & ~ok
        apply = due if nonfinite == "apply" else due & ok
        if nonfinite == "raise":
            g_leaves = eqx.error_if(
                g_leaves,
                jnp.any(failed),
                "non-finite outer gradient (nonfinite='raise')",
            )

        def do_outer(operands):
            def body(p, carry):
                return jax.lax.cond(
                    apply[p],
                    lambda c: outer_step(
                        outer,
                        frags,
                        p,
                        c[0],
                        c[1],
                        jax.tree.unflatten(treedef, inflight),
                    ),
                    lambda c: c,
                    carry,
                )

            return jax.lax.fori_loop(0, frags.num_fragments, body, operands)

        g_arrays, outer_state = jax.lax.cond(
            jnp.any(apply),
            do_outer,
            lambda operands: operands,
            (jax.tree.unflatten(treedef, g_leaves), state.outer_state),
        )
        g_leaves = jax.tree.leaves(g_arrays)

        # 3b. Each replica merges the fragments arriving for it at t (l.12).
        merging = schedule.merge_due(t, sent_at)
        keep_ok = jnp.ones_like(ok) if nonfinite == "apply" else ok

        def do_merge(r_leaves):
            due_masks = frags.mask(merging)
            ok_masks = frags.mask(keep_ok)
            return [
                merge(r, g, d, o, alpha)
                for r, g, d, o in zip(r_leaves, g_leaves, due_masks, ok_masks)
            ]

        r_leaves = jax.lax.cond(jnp.any(merging), do_merge, lambda r: r, r_leaves)

        new_state = StreamingState(
            step=t,
            global_params=eqx.combine(g_arrays, g_static),
            outer_state=outer_state,
            replica_params=eqx.combine(jax.tree.unflatten(treedef, r_leaves), r_static),
            inner_state=inner_state,
            inflight=jax.tree.unflatten(treedef, inflight),
            sent_at=sent_at,
            inflight_ok=ok,
            residual=None
            if residual is None
            else jax.tree.unflatten(treedef, residual),
            key=state.key,
        )
        bits = jnp.asarray(
            np.asarray(communication.bits_per_fragment(compressor, frags), np.float64),
            jnp.float32,
        )
        metrics = {
            "loss/train": jnp.mean(losses),
            "loss/replicas": losses,
            "sync/sent": sent,
            "sync/applied": apply,
            "sync/merged": merging,
            "sync/nonfinite": failed,
            "nonfinite": jnp.any(failed),
            "comm/bits": jnp.sum(jnp.where(sent, bits, jnp.zeros((), jnp.float32))),
        }
        metrics.update({f"aux/{k}": jnp.mean(v, axis=0) for k, v in aux.items()})
        return new_state, metrics

    return Algorithm(init, step, bits_per_fragment, M)


def diloco(
    loss_fn: Callable[..., Any],
    *,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    num_replicas: int = 2,
    sync_every: int = 100,
    has_aux: bool = False,
) -> Algorithm:
    """Vanilla DiLoCo (Douillard et al., 2023; Alg. 1): P = 1, τ = 0, α = 0, fp32.

    The same code path as `streaming_diloco`, with the whole model one fragment first
    sent at step H.
    """
    return streaming_diloco(
        loss_fn,
        inner=inner,
        outer=outer,
        num_replicas=num_replicas,
        sync_every=sync_every,
        fragments=None,
        overlap=0,
        alpha=0.0,
        has_aux=has_aux,
    )


def global_params(state: Any) -> Params:
    """θ_g: the parameters to evaluate by default (paper Table 3)."""
    return state.global_params


def replica_params(state: Any, m: int) -> Params:
    """The parameters of replica m."""
    return jax.tree.map(lambda x: x[m] if eqx.is_array(x) else x, state.replica_params)


def replica_average(state: Any) -> Params:
    """The average of the replicas' parameters (computed in float32 or wider)."""

    def avg(x):
        if not eqx.is_inexact_array(x):
            return x[0] if eqx.is_array(x) else x
        return jnp.mean(x.astype(communication.wide_dtype(x.dtype)), axis=0).astype(
            x.dtype
        )

    return jax.tree.map(avg, state.replica_params)


def _key_data(key: PRNGKeyArray | None) -> Array:
    if key is None:
        return jr.PRNGKey(0)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jr.key_data(key)
    return jnp.asarray(key)
