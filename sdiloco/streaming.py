"""Streaming DiLoCo (Douillard et al., 2025, Alg. 2) as one pure, jittable step.

`streaming_diloco(...)` validates its arguments into a `StreamingSpec` (everything
static) and returns an `Algorithm`: `init(params, key) -> state` and
`step(state, batch) -> (state, metrics)`. The step is five pure functions of the
state, each testable alone, in the order of Alg. 2:

1. `inner_update` (l.3-5): every replica takes one inner-optimizer step on its own
   batch, and t ← t + 1;
2. `send` (l.6-8): every fragment due at t computes `Δ_m = θ_g − θ_m` per replica,
   compresses it, and averages it in float32 or wider into its in-flight slot;
3. `receive` (posted exchange only): decode the messages a courier delivered;
4. `outer_update` (l.9-11): a fragment whose outer gradient arrives at t takes its
   outer step on θ_g;
5. `merge_arrivals` (l.12): each replica m whose arrival `sent + τ_m` is t merges
   that fragment, `θ_m ← α·θ_m + (1 − α)·θ_g` by default.

Around the exchange, plug-ins (`plugins.py`: error feedback, the merges of
`merging.py`, a user's own) transform each replica's outer gradient before it is
compressed, keep state of their own, and take in the outer step on arrival; an
aggregator (`aggregation.py`) turns the senders' reconstructions into one outer
gradient. The core calls them and knows none of them.

Steps 1-2 are `local_phase` (nothing from other replicas) and 3-5 `sync_phase`; a
`distributed.Courier` runs them as two programs and moves the messages between them.
Replicas live on a leading axis M of the state and of the batch; which fragment is
sent, received or merged at t is traced data, so the step compiles once
(`sdiloco.jit_step(alg)`), and a sync touches only its fragment's elements
(docs/implementation.md). Vanilla DiLoCo is `diloco(...)`: P = 1, τ = 0, α = 0.

This differs from the paper in:
1. Δ is taken against the global parameters θ_g kept in the state (docs/paper.md
   §1.12): line 11's θ^(t−τ−H) is read as "the global value after the fragment's last
   sync".
2. Steps are 1-based and fragment p is first sent at `f_p` (default `H + round(pH/P)`),
   so every fragment's first outer gradient spans at least H inner steps.
3. A non-finite outer gradient is detected and handled by a policy
   (docs/contract.md §5).
"""

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from . import communication, participation as participation_lib
from ._xla import run_if
from .aggregation import check_aggregator, mean as plain_mean
from .base import Algorithm, Exchange, PostedExchange
from .compression import Compressor
from .compression.spec import parse_with_feedback
from .custom_types import Batch, Metrics, Params, Replicated
from .fragments import Fragments, check_matches, single_fragment
from .inflight import Group, Layout, Visit, make_layout
from .inner import check_batch, inner_steps, replicate
from .merging import alpha_merge
from .outer import (
    GlobalMemory,
    check_outer,
    fragment_outer_step,
    outer_init,
    outer_step_pieces,
)
from .participation import Participation, where_replicas
from .plugins import Arrival, Chain, Plugin, Send, as_plugin, chain, is_finite
from .schedule import NEVER, Schedule, make_schedule


NONFINITE_POLICIES = ("skip", "apply", "raise")


class StreamingState(NamedTuple):
    """The whole state of a Streaming DiLoCo run (one immutable pytree)."""

    step: Int[Array, ""]  # [] int32, number of steps taken (t)
    global_params: Params  # θ_g, one copy, the parameters' dtypes
    outer_state: optax.OptState  # param-like leaves once; other leaves [P, ...]
    replica_params: Replicated  # θ_m, [M, ...] per array leaf
    inner_state: optax.OptState  # [M, ...] per leaf, never synchronised
    inflight: Array  # [K, S] Δ̄ of fragments in flight, one slot each, float32+
    sent_at: Int[Array, " P"]  # [P] int32, step each fragment was last sent (-1: never)
    inflight_ok: Bool[Array, " P"]  # [P] bool, whether that Δ̄ was finite
    senders: Bool[Array, "P M"]  # [P, M] bool, who sent the Δ in flight of p
    sent_steps: Int[Array, "P M"]  # [P, M] int32, their inner steps since their
    # previous send of p (what a token-weighted aggregator weighs)
    alive: Bool[Array, " M"]  # [M] bool, who was alive at the last step (elastic)
    steps_since: Int[Array, "M P"]  # inner steps of m since p's last send
    plugin_state: Any  # the plug-ins' (`plugins.Plugin.init`), leaves [M, ...]
    key: Array  # [2] uint32, root key of stochastic compressors
    # Posted exchange only (None otherwise), K in-flight slots of B bytes:
    outbox: Array | None = None  # [M, K, B] uint8, each replica's packed messages
    inbox: Array | None = None  # [K, M, B] uint8, every replica's, once delivered
    # (an island of an elastic job: every island's, `PostedExchange.inbox_rows`)

    replica_fields = ("replica_params", "inner_state", "plugin_state", "outbox")
    """The fields whose leaves carry the leading replica axis M."""


class StreamingSpec(NamedTuple):
    """Everything static about a Streaming DiLoCo run, validated by `streaming_diloco`.

    Jitted code closes over it; it is never traced. `fragments` None means the whole
    model is one fragment (resolved against the parameters with `fragments_of`).
    """

    loss_fn: Callable[..., Any]
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    schedule: Schedule
    fragments: Fragments | None
    compressor: Compressor | None
    plugin: Chain  # the plug-ins, one of which merges
    aggregator: Callable[..., list[Array]]
    nonfinite: str
    exchange: Exchange | PostedExchange
    memory: GlobalMemory = GlobalMemory()

    @property
    def num_replicas(self) -> int:
        """M."""
        return self.schedule.num_replicas

    @property
    def posted(self) -> bool:
        """Whether the exchange is posted: encoded in the step that sends, moved
        between steps, decoded in the step of the outer update (`PostedExchange`)."""
        return isinstance(self.exchange, PostedExchange)

    def fragments_of(self, params: Params) -> Fragments:
        """The fragments of `params` (one fragment when none were given)."""
        return single_fragment(params) if self.fragments is None else self.fragments

    def layout(self, params: Params) -> Layout:
        """The fragment groups and in-flight slots for `params` (static)."""
        arrays = eqx.filter(params, eqx.is_inexact_array)
        return make_layout(self.fragments_of(arrays), self.schedule)

    def message_bytes(self, params: Params) -> np.ndarray:
        """`[P]` bytes of one replica's packed message for each fragment (what it
        posts when it sends fragment p; posted exchange only)."""
        if not self.posted:
            raise ValueError(
                f"message_bytes: exchange={self.exchange!r} is not posted."
            )
        layout, like = self.layout(params), _leaves(params)
        sizes = [_message_bytes(self, g, like) for g in layout.groups]
        return np.asarray([sizes[g] for g in layout.group_of], np.int64)


class LocalResult(NamedTuple):
    """What `local_phase` hands `sync_phase`: what the step's metrics report of it."""

    losses: Array  # [M] each replica's loss
    aux: dict[str, Array]  # each leaf [M, ...], the loss function's aux
    sent: Bool[Array, " P"]  # which fragments were sent at t
    participation: Participation | None = None  # who took part at t (None: all)


def streaming_diloco(
    loss_fn: Callable[..., Any],
    *,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    num_replicas: int = 2,
    sync_every: int = 100,
    fragments: Fragments | None = None,
    overlap: int | Sequence[int] = 1,
    alpha: float | None = None,
    compressor: Compressor | str | None = None,
    plugins: Plugin | Sequence[Plugin] = (),
    aggregator: Callable[..., list[Array]] = plain_mean(),
    nonfinite: str = "skip",
    exchange: Exchange | PostedExchange = communication.simulated_exchange,
) -> Algorithm[StreamingSpec]:
    """Streaming DiLoCo (Alg. 2) with overlapped, compressed fragment syncs.

    Args:
        loss_fn: `loss_fn(params, batch) -> loss`, or `(loss, aux)` with `aux` a
            dict of arrays (reported in the metrics as `aux/...`), for one
            replica's batch. `params` is whatever pytree `init` was given (an
            Equinox module included); gradients flow to its floating-point arrays.
        inner: the inner optimizer (any optax transformation), e.g. AdamW.
        outer: the outer optimizer; default `optax.sgd(0.4, momentum=0.9,
            nesterov=True)` (docs/paper.md §1.6). Its state is kept per fragment
            and must mirror the parameters (adafactor is refused); a transform over
            the tree (`clip_by_global_norm`) sees one fragment at a time.
        num_replicas: M >= 1.
        sync_every: H >= 1, inner steps between two sends of one fragment.
        fragments: the partition (see `fragments.py`), with the step each fragment
            is first sent (`Fragments.first_send`; default `H + round(p·H/P)`);
            None syncs the whole model as one fragment, first sent at H.
        overlap: τ, one int or one per replica, 0 <= τ < H: a fragment sent at t is
            merged by replica m at t + τ_m.
        alpha: the mixing factor α in [0, 1] of the paper's merge: short for the
            plug-in `merging.alpha_merge(alpha)`; None is α = 0.5 unless `plugins`
            holds another merge (giving both is an error).
        compressor: applied to each replica's Δ before the exchange (a `quantizer`,
            `dare`, `top_k`, `fed_dropout`, or stages composed with
            `compression.chain`); None sends float32. A spec string such as "e3m0"
            or "topk:0.02/64,int2,ef:0.9" is short for its stages, and a closing
            `ef[:β]` for the plug-in `plugins.error_feedback(β)`. A stochastic
            compressor needs the `key` argument of `init`.
        plugins: what each replica does around the exchange, with state of its
            own (`plugins.py`): `error_feedback(β)` carries each replica's
            compression residual into its next send of a fragment, `eager()`
            merges the Eager way; one `Plugin` or a sequence, composed in order.
        aggregator: how the senders' decoded outer gradients of a fragment become
            one (`aggregation.py`): the plain mean over the senders (default),
            `token_weighted_mean`, `trimmed_mean`, `median`, `clipped_mean`, or a
            function `(rows, sent, steps) -> list of arrays`.
        nonfinite: what to do with a non-finite averaged outer gradient: "skip" (the
            default: skip that fragment's outer step and restore it to θ_g on every
            replica, a failed round), "apply" (no check), "raise" (a runtime error).
        exchange: how replicas exchange outer gradients: the default simulates
            them on one device; `distributed.sharded_exchange` moves the packed
            payload between devices and hosts in the step that sends; a
            `PostedExchange` (`distributed.posted_exchange`) encodes there and
            decodes at the outer update, moved in between by a `distributed.Courier`
            (docs/implementation.md).

    Returns:
        The `Algorithm`; its `step(state, batch, participation=None)` takes who
        takes part (`sdiloco.participation`). `offload(alg)` keeps θ_g and the
        outer state in host memory.

    Raises:
        ValueError: on a bad configuration (docs/contract.md §5), naming the field, the
            value and what is allowed.
    """
    outer = optax.sgd(0.4, momentum=0.9, nesterov=True) if outer is None else outer
    compressor, plugin = _check_options(
        alpha, nonfinite, compressor, plugins, aggregator, fragments
    )
    schedule = _schedule(sync_every, fragments, num_replicas, overlap)
    _check_outer(outer, fragments)
    spec = StreamingSpec(
        loss_fn=loss_fn,
        inner=inner,
        outer=outer,
        schedule=schedule,
        fragments=fragments,
        compressor=compressor,
        plugin=plugin,
        aggregator=aggregator,
        nonfinite=nonfinite,
        exchange=exchange,
    )
    return _algorithm(spec)


def offload(alg: Algorithm[StreamingSpec]) -> Algorithm[StreamingSpec]:
    """`alg` with θ_g and the outer optimizer state kept in host memory
    (`pinned_host`): a sync moves only its fragment's pieces to the device, for its
    Δ, outer step and merge (the paper's offloading, docs/paper.md §1.10). The
    numbers are bitwise those without offload; the device then holds the replicas,
    their inner state, the in-flight slots and one fragment at a time. Works on a
    mesh too. Needs a backend with host memory kinds (GPU, TPU; on CPU host and
    device memory are the same RAM)."""
    return _algorithm(alg.spec._replace(memory=GlobalMemory(True)))


def _algorithm(spec: StreamingSpec) -> Algorithm[StreamingSpec]:
    """The `Algorithm` of a validated spec."""

    def init(params: Params, key: PRNGKeyArray | None = None) -> StreamingState:
        return streaming_init(spec, params, key)

    def step(
        state: StreamingState,
        batch: Batch,
        participation: Participation | None = None,
    ) -> tuple[StreamingState, Metrics]:
        return streaming_step(spec, state, batch, participation)

    init.__doc__ = streaming_init.__doc__
    step.__doc__ = streaming_step.__doc__
    bits = ft.partial(_bits_per_fragment, spec)
    return Algorithm(init, step, bits, spec.num_replicas, spec)


def diloco(
    loss_fn: Callable[..., Any],
    *,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    num_replicas: int = 2,
    sync_every: int = 100,
    aggregator: Callable[..., list[Array]] = plain_mean(),
    nonfinite: str = "skip",
    exchange: Exchange | PostedExchange = communication.simulated_exchange,
) -> Algorithm[StreamingSpec]:
    """Vanilla DiLoCo (Douillard et al., 2023; Alg. 1): P = 1, τ = 0, α = 0, fp32.

    The same code path as `streaming_diloco`, with the whole model one fragment first
    sent at step H (`aggregator` as there; `offload(diloco(...))` moves the whole of
    θ_g and the outer state to the device at each sync).
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
        aggregator=aggregator,
        nonfinite=nonfinite,
        exchange=exchange,
    )


def streaming_init(
    spec: StreamingSpec, params: Params, key: PRNGKeyArray | None = None
) -> StreamingState:
    """The initial state: every replica and θ_g equal to `params`, t = 0.

    Args:
        spec: the run's static description.
        params: the initial parameters (any pytree).
        key: the root key of stochastic compressors; required when the compressor
            needs randomness, ignored otherwise.

    Raises:
        ValueError: if the fragments do not match `params`, or a stochastic compressor
            gets no key.
    """
    if key is None and spec.compressor is not None and spec.compressor.needs_key:
        raise ValueError(
            f"key=None, but the compressor {type(spec.compressor).__name__} is "
            "stochastic; pass init(params, key=jax.random.key(seed))."
        )
    frags = spec.fragments_of(params)
    check_matches(frags, params)
    arrays = eqx.filter(params, eqx.is_inexact_array)
    layout = spec.layout(arrays)
    wide = jnp.result_type(*[_wide(x) for x in jax.tree.leaves(arrays)])
    replicas = replicate(params, spec.num_replicas)
    plugin_state = spec.plugin.init(
        jax.tree.leaves(arrays), spec.num_replicas, frags.num_fragments
    )
    global_params, outer_state = (
        params,
        outer_init(spec.outer, arrays, frags.num_fragments),
    )
    if spec.memory.offload:
        global_params, outer_state = _to_host((global_params, outer_state))
    outbox = inbox = None
    if spec.posted:
        size = int(max(spec.message_bytes(arrays)))
        outbox = jnp.zeros((spec.num_replicas, layout.num_slots, size), jnp.uint8)
        rows = cast(PostedExchange, spec.exchange).inbox_rows(spec.num_replicas)
        inbox = jnp.zeros((layout.num_slots, rows, size), jnp.uint8)
    return StreamingState(
        step=jnp.zeros((), jnp.int32),
        global_params=global_params,
        outer_state=outer_state,
        replica_params=replicas,
        inner_state=eqx.filter_vmap(spec.inner.init)(
            eqx.filter(replicas, eqx.is_inexact_array)
        ),
        inflight=jnp.zeros((layout.num_slots, layout.slot_size), wide),
        sent_at=jnp.full((frags.num_fragments,), NEVER, jnp.int32),
        inflight_ok=jnp.ones((frags.num_fragments,), bool),
        senders=jnp.ones((frags.num_fragments, spec.num_replicas), bool),
        sent_steps=jnp.zeros((frags.num_fragments, spec.num_replicas), jnp.int32),
        alive=jnp.ones((spec.num_replicas,), bool),
        steps_since=jnp.zeros((spec.num_replicas, frags.num_fragments), jnp.int32),
        plugin_state=plugin_state,
        key=jnp.zeros((2,), jnp.uint32) if key is None else _key_data(key),
        outbox=outbox,
        inbox=inbox,
    )


def streaming_step(
    spec: StreamingSpec,
    state: StreamingState,
    batch: Batch,
    participation: Participation | None = None,
) -> tuple[StreamingState, Metrics]:
    """One step of Streaming DiLoCo (Alg. 2, l.3-12): inner, send, outer, merge.

    With a `participation`, replicas that come back heal first, and only those that
    take part compute, send and merge (`sdiloco.participation`); None is everyone.
    """
    state, local = local_phase(spec, state, batch, participation)
    return sync_phase(spec, state, local)


def local_phase(
    spec: StreamingSpec,
    state: StreamingState,
    batch: Batch,
    participation: Participation | None = None,
) -> tuple[StreamingState, LocalResult]:
    """The half of a step that needs nothing from other replicas: `heal` (with a
    participation), `inner_update`, then `send` (skipped when nothing is due,
    `_xla.run_if`)."""
    check_batch(batch, spec.num_replicas)
    computes = sends = None
    if participation is not None:
        participation_lib.check(participation, spec.num_replicas)
        state = heal(spec, state, participation.alive)
        computes, sends = participation.computes, participation.sends
    state, losses, aux = inner_update(spec, state, batch, computes)
    sent = jnp.asarray(spec.schedule.sent(state.step))
    state = run_if(jnp.any(sent), lambda s: send(spec, s, sends), state)
    return state, LocalResult(losses, aux, sent, participation)


def sync_phase(
    spec: StreamingSpec, state: StreamingState, local: LocalResult
) -> tuple[StreamingState, Metrics]:
    """The half of a step that needs every replica's outer gradient: `receive`,
    `outer_update` and `merge_arrivals` (skipped when nothing arrives), and the
    step's metrics. A courier delivers the messages due at t between the halves."""

    alive = None if local.participation is None else local.participation.alive

    def sync(state: StreamingState) -> StreamingState:
        state = outer_update(spec, receive(spec, state))[0]
        return merge_arrivals(spec, state, alive)[0]

    # A fragment received or stepped at t is merged at t by the replicas whose τ is
    # τ_min, so nothing else happens at a step where nobody merges.
    # (`arriving` has no replica axis, which a mesh would split.)
    merged = spec.schedule.merge_due(state.step, state.sent_at)
    if alive is not None:
        merged = merged & alive[:, None]
    arriving = spec.schedule.arriving(state.step, state.sent_at)
    state = run_if(jnp.any(arriving), sync, state)
    applied, failed = _outcome(spec, state)
    if spec.memory.offload:  # the program's outputs stay in host memory
        state = state._replace(
            global_params=_to_host(state.global_params),
            outer_state=_to_host(state.outer_state),
        )
    frags = spec.fragments_of(eqx.filter(state.global_params, eqx.is_inexact_array))
    bits = communication.bits_per_fragment(spec.compressor, frags).astype(np.float32)
    computed = None if local.participation is None else local.participation.computes
    losses, aux = local.losses, local.aux
    if computed is not None:  # what a replica that took no step reports: 0
        losses, aux = where_replicas(computed, (losses, aux), (0 * losses, aux))
        aux = jax.tree.map(lambda v: where_replicas(computed, v, 0 * v), aux)
    metrics = {
        "loss/train": participation_lib.mean_over(losses, computed),
        "loss/replicas": losses,
        "sync/sent": local.sent,
        "sync/applied": applied,
        "sync/merged": merged,
        "sync/nonfinite": failed,
        "nonfinite": jnp.any(failed),
        "comm/bits": jnp.sum(jnp.where(local.sent, bits, 0.0)),
    }
    metrics.update(
        {f"aux/{k}": participation_lib.mean_over(v, computed) for k, v in aux.items()}
    )
    metrics.update({f"replicas/aux/{k}": v for k, v in aux.items()})
    return state, metrics


def heal(
    spec: StreamingSpec, state: StreamingState, alive: Bool[Array, " M"]
) -> StreamingState:
    """Replicas alive now but not at the last step come back before their inner step.

    Such a replica adopts θ_g for every fragment, its plug-ins' state starts afresh
    (`init`), and it takes a copy of the inner optimizer state of the first replica
    alive at both steps, so that its learning-rate schedule (optax schedules count
    the state's steps) and moments match a replica training the same θ_g (a fresh
    state from θ_g when no replica stayed alive). Fragments in flight are merged on
    arrival like every replica's. `state.alive` becomes `alive`.
    """
    back = alive & ~state.alive

    def restore(state: StreamingState) -> StreamingState:
        g = eqx.filter(state.global_params, eqx.is_inexact_array)
        g = jax.tree.map(spec.memory.fetch, g)
        fresh = replicate(spec.inner.init(g), spec.num_replicas)
        live = alive & state.alive
        donor = jnp.argmax(live)  # the first live replica (0 when none)
        peer = jax.tree.map(
            lambda x: jnp.broadcast_to(x[donor], x.shape), state.inner_state
        )
        fresh = jax.tree.map(lambda c, r: jnp.where(jnp.any(live), c, r), peer, fresh)
        state = adopt_global(spec, state, back)
        return state._replace(
            inner_state=where_replicas(back, fresh, state.inner_state)
        )

    state = run_if(jnp.any(back), restore, state)
    since = jnp.where(back[:, None], 0, state.steps_since)
    return state._replace(alive=alive, steps_since=since)


def adopt_global(
    spec: StreamingSpec, state: StreamingState, back: Bool[Array, " M"] | None = None
) -> StreamingState:
    """The replicas `back` (None: all) start again from θ_g: their parameters become
    θ_g and their plug-ins' state `init`'s (the inner optimizer state is the caller's: `heal`, or a peer's in an elastic
    job). Every way back into the rounds goes through here."""
    back = jnp.ones((spec.num_replicas,), bool) if back is None else back
    g = jax.tree.map(
        spec.memory.fetch, eqx.filter(state.global_params, eqx.is_inexact_array)
    )
    num_fragments = state.sent_at.shape[0]
    fresh = spec.plugin.init(jax.tree.leaves(g), spec.num_replicas, num_fragments)
    replicas = eqx.combine(replicate(g, spec.num_replicas), state.replica_params)
    return state._replace(
        replica_params=where_replicas(back, replicas, state.replica_params),
        plugin_state=where_replicas(back, fresh, state.plugin_state),
    )


def inner_update(
    spec: StreamingSpec,
    state: StreamingState,
    batch: Batch,
    computes: Bool[Array, " M"] | None = None,
) -> tuple[StreamingState, Array, dict]:
    """One inner step on every replica (Alg. 2, l.3-5); the step counter becomes t + 1.

    With `computes`, a replica not computing keeps its parameters and inner state.

    Returns:
        The new state, each replica's loss `[M]` and its aux dict (leaves `[M, ...]`).
    """
    replicas, inner_state, losses, aux = inner_steps(
        spec.loss_fn,
        spec.inner,
        state.replica_params,
        state.inner_state,
        batch,
    )
    if computes is not None:
        replicas, inner_state = where_replicas(
            computes,
            (replicas, inner_state),
            (state.replica_params, state.inner_state),
        )
    took = jnp.ones((spec.num_replicas, 1), jnp.int32)
    if computes is not None:
        took = computes[:, None].astype(jnp.int32)
    state = state._replace(
        step=state.step + 1,
        replica_params=replicas,
        inner_state=inner_state,
        steps_since=state.steps_since + took,
    )
    return state, losses, aux


def send(
    spec: StreamingSpec,
    state: StreamingState,
    sends: Bool[Array, " M"] | None = None,
) -> StreamingState:
    """Send the fragments due at t = `state.step` (Alg. 2, l.6-8).

    For each sent fragment p, on its elements only: `Δ_m = θ_g − θ_m` per replica,
    through the plug-ins' `before_send`, exchanged (compressed per replica, the
    reconstructions aggregated over the senders in float32 or wider) into p's
    in-flight slot, with `sent_at[p] = t`, who sent and whether the result is
    finite; then the plug-ins' `after_send`. With a posted exchange each replica's
    packed message goes into p's outbox slot instead (`receive` decodes and
    aggregates it).

    With `sends`, a replica not sending contributes a zero Δ (every compressor sends
    zero as zero) and the aggregator leaves it out.
    """
    layout = spec.layout(state.global_params)
    t = state.step
    sent_by = jnp.ones((spec.num_replicas,), bool) if sends is None else sends
    one = ft.partial(_send_fragment, spec, layout, sends, sent_by)
    g_tree = eqx.filter(state.global_params, eqx.is_inexact_array)
    replicas, static = eqx.partition(state.replica_params, eqx.is_inexact_array)
    key = jr.fold_in(state.key, t)
    outer = (g_tree, state.outer_state)
    inputs = (_leaves(g_tree), key, outer, state.steps_since)
    carry = {
        "slots": state.inflight,
        "ok": state.inflight_ok,
        "outbox": state.outbox,
        "replicas": jax.tree.leaves(replicas),
        "plugin": state.plugin_state,
    }
    sent = jnp.asarray(spec.schedule.sent(t))
    carry = layout.for_each(sent, one, carry, inputs)
    replicas = jax.tree.unflatten(jax.tree.structure(replicas), carry["replicas"])
    return state._replace(
        replica_params=eqx.combine(replicas, static),
        inflight=carry["slots"],
        inflight_ok=carry["ok"],
        sent_at=jnp.where(sent, t, state.sent_at),
        senders=jnp.where(sent[:, None], sent_by[None, :], state.senders),
        sent_steps=jnp.where(sent[:, None], state.steps_since.T, state.sent_steps),
        steps_since=jnp.where(sent[None, :], 0, state.steps_since),
        outbox=carry["outbox"],
        plugin_state=carry["plugin"],
    )


def _send_fragment(spec, layout, sends, sent_by, v: Visit, inputs, carry) -> dict:
    """`send`'s work for fragment `v`: Δ, the plug-ins' `before_send`, the exchange
    (or the outbox), the plug-ins' `after_send`."""
    g_leaves, key, (params, outer_state), steps_since = inputs
    g = [spec.memory.fetch(x) for x in v.gather(g_leaves)]

    def standin(grads: list[Array]) -> list[Array]:
        def step(grads):
            return outer_step_pieces(
                spec.outer, v, params, outer_state, grads, spec.memory
            )

        return jax.vmap(step)(grads)

    ctx = Send(v, sends, g, standin)
    deltas = communication.outer_gradients(g, v.gather(carry["replicas"], 1))
    deltas, plugin_state = spec.plugin.before_send(ctx, deltas, carry["plugin"])
    if sends is not None:  # nothing of a replica that does not send
        deltas = [where_replicas(sends, d, jnp.zeros_like(d)) for d in deltas]
    frags, key = v.group.piece_fragments(), jr.fold_in(key, v.p)
    if isinstance(spec.exchange, PostedExchange):
        messages, own = spec.exchange.encode(spec.compressor, frags, deltas, key)
        carry["outbox"] = _write_message(layout, carry["outbox"], v.p, messages)
    else:
        steps = steps_since[:, v.p]

        def aggregate(rows: list[Array]) -> list[Array]:
            return spec.aggregator(rows, sent_by, steps)

        mean, own = spec.exchange(spec.compressor, frags, deltas, key, aggregate)
        carry["slots"] = layout.write(carry["slots"], v.group, v.p, mean)
        carry["ok"] = carry["ok"].at[v.p].set(is_finite(mean))
    carry["replicas"], carry["plugin"] = spec.plugin.after_send(
        ctx, deltas, own, carry["replicas"], plugin_state
    )
    return carry


def receive(spec: StreamingSpec, state: StreamingState) -> StreamingState:
    """Decode the messages of the fragments whose outer step is at t (posted exchange).

    For each such fragment, every replica's packed message (delivered into the
    fragment's inbox slot between steps) is decoded and the reconstructions
    aggregated over the senders in float32 or wider: the in-flight slot and the
    finiteness flag then hold what an in-step exchange would have stored at the send.
    Who sent is what the send recorded, or on an elastic island the messages'
    presence marks.
    Without a posted exchange this is the identity.
    """
    if not spec.posted:
        return state
    layout, like = spec.layout(state.global_params), _leaves(state.global_params)
    exchange = cast(PostedExchange, spec.exchange)

    def one(v: Visit, inputs, carry):
        (inbox, senders, sent_steps), (slots, ok) = inputs, carry
        deltas, frags = _deltas_like(spec, v.group, like), v.group.piece_fragments()
        size = exchange.message_bytes(spec.compressor, frags, deltas, state.key)
        k = jnp.asarray(layout.slot_of)[v.p]
        messages = jax.lax.dynamic_index_in_dim(inbox, k, 0, keepdims=False)
        messages = messages[:, :size]
        rows, present = exchange.decode(
            spec.compressor, frags, messages, deltas, state.key
        )
        if present is None:
            mean = spec.aggregator(rows, senders[v.p], sent_steps[v.p])
        else:  # an island: who was a member of the round, their steps unknown
            mean = spec.aggregator(rows, present, None)
        return layout.write(slots, v.group, v.p, mean), ok.at[v.p].set(is_finite(mean))

    due = spec.schedule.outer_due(state.step, state.sent_at)
    carry = (state.inflight, state.inflight_ok)
    inputs = (state.inbox, state.senders, state.sent_steps)
    slots, ok = layout.for_each(due, one, carry, inputs)
    return state._replace(inflight=slots, inflight_ok=ok)


def outer_update(
    spec: StreamingSpec, state: StreamingState
) -> tuple[StreamingState, Bool[Array, " P"], Bool[Array, " P"]]:
    """The outer step of every fragment whose earliest arrival is t (Alg. 2, l.9-11).

    `θ_g[p], s_p ← OuterOpt(θ_g[p], s_p, Δ̄_p)` for each such fragment p, one fragment
    at a time; a fragment whose Δ̄ was not finite is skipped under the "skip" policy,
    fails the step under "raise", and is applied under "apply".

    Returns:
        The new state, which fragments took their outer step `[P]`, and which arrived
        with a non-finite outer gradient `[P]`.
    """
    applied, failed = _outcome(spec, state)
    params, static = eqx.partition(state.global_params, eqx.is_inexact_array)
    if spec.nonfinite == "raise":
        params = eqx.error_if(
            params, jnp.any(failed), "non-finite outer gradient (nonfinite='raise')"
        )
    layout = spec.layout(params)

    def one(v: Visit, inflight, carry):
        grads = layout.read(inflight, v.group, v.p)
        params, outer_state = carry
        return fragment_outer_step(
            spec.outer, v, params, outer_state, grads, spec.memory
        )

    carry = (params, state.outer_state)
    params, outer_state = layout.for_each(applied, one, carry, state.inflight)
    state = state._replace(
        global_params=eqx.combine(params, static), outer_state=outer_state
    )
    return state, applied, failed


def merge_arrivals(
    spec: StreamingSpec,
    state: StreamingState,
    alive: Bool[Array, " M"] | None = None,
) -> tuple[StreamingState, Bool[Array, "M P"]]:
    """Each replica merges the fragments arriving for it at t (Alg. 2, l.12).

    The plug-ins' `on_arrival` (the α-merge `θ_m ← α·θ_m + (1 − α)·θ_g` by
    default) on the fragment, for every replica m with `sent_at + τ_m = t`; where
    the fragment's outer gradient was not finite (unless the policy is "apply"),
    or no replica sent it, `Arrival.ok` is false and a merge restores θ_g. With
    `alive`, a replica that is not alive merges nothing.

    Returns:
        The new state and which fragments each replica merged `[M, P]`.
    """
    merging = spec.schedule.merge_due(state.step, state.sent_at)
    if alive is not None:
        merging = merging & alive[:, None]
    keep = (state.inflight_ok | (spec.nonfinite == "apply")) & _sent(state)
    replicas, static = eqx.partition(state.replica_params, eqx.is_inexact_array)
    r_leaves, r_def = jax.tree.flatten(replicas)

    def one(v: Visit, g_leaves, carry):
        arrival = Arrival(v, g_leaves, merging[:, v.p], keep[v.p], spec.memory.fetch)
        return spec.plugin.on_arrival(arrival, *carry)

    arriving = spec.schedule.arriving(state.step, state.sent_at)
    carry = (r_leaves, state.plugin_state)
    layout = spec.layout(state.global_params)
    r_leaves, plugin_state = layout.for_each(
        arriving, one, carry, _leaves(state.global_params)
    )
    replicas = eqx.combine(jax.tree.unflatten(r_def, r_leaves), static)
    return state._replace(replica_params=replicas, plugin_state=plugin_state), merging


def _check_outer(
    outer: optax.GradientTransformation, fragments: Fragments | None
) -> None:
    """`outer.check_outer` on the fragments' shapes where they are given (else
    `init` checks it, when the parameters are known)."""
    if fragments is not None:
        shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in fragments.shapes]
        check_outer(outer, shapes)


def _check_options(alpha, nonfinite, compressor, plugins, aggregator, fragments):
    """Validate `streaming_diloco`'s options; returns the compressor and the
    plug-ins as one chain that merges (the α-merge added when none does)."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r}; allowed: {NONFINITE_POLICIES}.")
    if alpha is not None and (isinstance(alpha, bool) or not 0 <= alpha <= 1):
        raise ValueError(f"alpha={alpha!r}; must be in [0, 1].")
    feedback, given = None, compressor
    if isinstance(compressor, str):
        compressor, feedback = parse_with_feedback(compressor)
    if compressor is not None and not isinstance(compressor, Compressor):
        raise ValueError(
            f"compressor={compressor!r} is not a Compressor; build one with "
            "sdiloco.quantizer(...), compression.chain(...), top_k(...) or a spec "
            "string."
        )
    if fragments is not None and not isinstance(fragments, Fragments):
        raise ValueError(f"fragments={fragments!r} is not a Fragments.")
    check_aggregator(aggregator)
    plugin = as_plugin(plugins)
    if feedback is not None:
        if any(isinstance(p, type(feedback)) for p in plugin.plugins):
            raise ValueError(
                f"compressor={given!r} ends in error feedback (ef) and plugins hold "
                "error_feedback(...); allowed: one of the two."
            )
        plugin = chain(feedback, *plugin.plugins)
    if plugin.merges and alpha is not None:
        raise ValueError(
            f"alpha={alpha!r} with plugins that merge ({plugin}); allowed: one of "
            "the two (alpha builds the α-merge)."
        )
    if not plugin.merges:
        plugin = chain(*plugin.plugins, alpha_merge(0.5 if alpha is None else alpha))
    return compressor, plugin


def _schedule(sync_every, fragments, num_replicas, overlap) -> Schedule:
    """The sync schedule of `streaming_diloco`'s arguments (validated)."""
    if fragments is None:
        return make_schedule(sync_every, 1, num_replicas, overlap)
    return make_schedule(
        sync_every, fragments.num_fragments, num_replicas, overlap, fragments.first_send
    )


def _bits_per_fragment(spec: StreamingSpec, params: Params) -> np.ndarray:
    """Exact bits one replica puts on the wire per fragment (`Algorithm`)."""
    arrays = eqx.filter(params, eqx.is_inexact_array)
    return communication.bits_per_fragment(spec.compressor, spec.fragments_of(arrays))


def _write_message(layout: Layout, outbox: Array, p: Array, messages: Array) -> Array:
    """`outbox` `[M, K, B]` with fragment p's messages `[M, b]` in p's slot."""
    k = jnp.asarray(layout.slot_of)[p]
    zero = jnp.zeros_like(k)
    return jax.lax.dynamic_update_slice(outbox, messages[:, None, :], (zero, k, zero))


def _outcome(
    spec: StreamingSpec, state: StreamingState
) -> tuple[Bool[Array, " P"], Bool[Array, " P"]]:
    """Which fragments take their outer step at t, and which of them arrived with a
    non-finite outer gradient (`outer_update`'s report)."""
    due = spec.schedule.outer_due(state.step, state.sent_at) & _sent(state)
    failed = due & ~state.inflight_ok
    applied = due if spec.nonfinite == "apply" else due & state.inflight_ok
    return applied, failed


def _to_host(tree: Any) -> Any:
    """The array leaves of `tree` in host memory (`pinned_host`), others unchanged."""
    return jax.tree.map(
        lambda x: jax.device_put(x, jax.memory.Space.Host) if eqx.is_array(x) else x,
        tree,
    )


def _sent(state: StreamingState) -> Bool[Array, " P"]:
    """Whether any replica sent the Δ in flight of each fragment."""
    return jnp.any(state.senders, axis=1)


def _deltas_like(spec: StreamingSpec, group: Group, leaves: list[Any]) -> list[Any]:
    """Shapes and dtypes of a group's `[M, ...]` outer gradients."""
    return [
        jax.ShapeDtypeStruct((spec.num_replicas,) + shape, _wide(leaves[i]))
        for i, shape in zip(group.leaves, group.shapes)
    ]


def _message_bytes(spec: StreamingSpec, group: Group, leaves: list[Any]) -> int:
    """Bytes of one replica's packed message for a member of `group`."""
    exchange = cast(PostedExchange, spec.exchange)
    deltas = _deltas_like(spec, group, leaves)
    key = jnp.zeros((2,), jnp.uint32)
    return exchange.message_bytes(spec.compressor, group.piece_fragments(), deltas, key)


def _leaves(params: Params) -> list[Array]:
    return jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))


def _wide(x: Array) -> jnp.dtype:
    return communication.wide_dtype(x.dtype)


def _key_data(key: PRNGKeyArray) -> Array:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jr.key_data(key)
    return jnp.asarray(key)
