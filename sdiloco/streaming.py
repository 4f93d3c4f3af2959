"""Streaming DiLoCo (Douillard et al., 2025, Alg. 2) as one pure, jittable step.

`streaming_diloco(...)` validates its arguments into a `StreamingSpec` (everything
static) and returns an `Algorithm`: `init(params, key) -> state` and
`step(state, batch) -> (state, metrics)`. The step is a composition of four
module-level pure functions of the state, each testable alone:

1. `inner_update`: every replica takes one inner-optimizer step on its own batch
   (Alg. 2, l.3-5), and t ← t + 1;
2. `send`: every fragment due at t computes `Δ_m = θ_g − θ_m`, compresses it per
   replica, and averages it in float32 or wider; it is in flight until t + τ (l.6-8);
3. `outer_update`: a fragment whose earliest arrival is t takes its outer step on θ_g
   (l.11);
4. `merge_arrivals`: each replica m whose arrival `sent + τ_m` is t merges
   `θ_m ← α·θ_m + (1 − α)·θ_g` on that fragment (l.12).

Steps 1-2 are `local_phase` (nothing from other replicas) and 3-4 `sync_phase`; with a
posted exchange (`distributed.posted_exchange`) `send` only encodes each replica's
message into the state's outbox, a `distributed.Courier` moves the messages between
the two phases, and `receive` (first in `sync_phase`) decodes and averages them.

Replicas live on a leading axis M of the state and of the batch. Which fragment is
sent, received or merged at t is traced data, so the step compiles once and serves
every step (`sdiloco.jit_step(alg)`). A sync touches only its fragment's elements, and
the averaged outer gradient waits in one of the in-flight slots the schedule needs
(`inflight.py`), so both the work and the memory of a sync scale with the fragment.

Vanilla DiLoCo is `diloco(...)`: the same code with P = 1, τ = 0, α = 0 and no
compressor. Data-Parallel, which is different maths, is in `data_parallel.py`.

This differs from the paper in:
1. Δ is taken against the global parameters θ_g kept in the state (docs/paper.md
   §1.12): line 11's θ^(t−τ−H) is read as "the global value after the fragment's last
   sync".
2. Steps are 1-based and fragment p is first sent at `f_p` (default `H + round(pH/P)`),
   so every fragment's first outer gradient spans at least H inner steps.
3. A non-finite outer gradient is detected and handled by a policy
   (docs/contract.md §5).
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
from .base import Algorithm, Exchange, PostedExchange
from .compression import Compressor, quantizer
from .custom_types import Batch, Metrics, Params, Replicated
from .fragments import Fragments, check_matches, single_fragment
from .inflight import Layout, make_layout
from .inner import check_batch, inner_steps, replicate
from .outer import fragment_outer_step, is_elementwise, merge, outer_init
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
    residual: Replicated | None  # error feedback, [M, ...] wide dtype; None when off
    key: Array  # [2] uint32, root key of stochastic compressors
    # Posted exchange only (None otherwise), K in-flight slots of B bytes:
    outbox: Array | None = None  # [M, K, B] uint8, each replica's packed messages
    inbox: Array | None = None  # [K, M, B] uint8, every replica's, once delivered

    replica_fields = ("replica_params", "inner_state", "residual", "outbox")
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
    alpha: float
    compressor: Compressor | None
    error_feedback: bool
    nonfinite: str
    has_aux: bool
    exchange: Exchange | PostedExchange
    offload: bool = False

    def fetch(self, x: Array) -> Array:
        """A piece of θ_g or of the outer state, moved to the device if offloaded."""
        return jax.device_put(x, jax.memory.Space.Device) if self.offload else x

    def store(self, x: Array) -> Array:
        """A piece to write into θ_g or the outer state, moved to host if offloaded."""
        return jax.device_put(x, jax.memory.Space.Host) if self.offload else x

    @property
    def num_replicas(self) -> int:
        """M."""
        return self.schedule.num_replicas

    def fragments_of(self, params: Params) -> Fragments:
        """The fragments of `params` (one fragment when none were given)."""
        return single_fragment(params) if self.fragments is None else self.fragments

    def layout_of(self, params: Params) -> Layout:
        """The fragment groups and in-flight slots for `params` (static)."""
        return make_layout(self.fragments_of(params), self.schedule)

    @property
    def posted(self) -> bool:
        """Whether the exchange is posted: encoded in the step that sends, moved
        between steps, decoded in the step of the outer update (`PostedExchange`)."""
        return isinstance(self.exchange, PostedExchange)


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
    exchange: Exchange | PostedExchange = communication.simulated_exchange,
    offload: bool = False,
) -> Algorithm:
    """Streaming DiLoCo (Alg. 2) with overlapped, compressed fragment syncs.

    Args:
        loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux`),
            for one replica's batch. `params` is whatever pytree `init` was given (an
            Equinox module included); gradients flow to its floating-point arrays.
        inner: the inner optimizer (any optax transformation), e.g. AdamW.
        outer: the outer optimizer; default `optax.sgd(0.4, momentum=0.9,
            nesterov=True)` (docs/paper.md §1.6). Its state is kept per fragment.
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
            `quantizer(name)`); None sends float32. A stochastic compressor needs the
            `key` argument of `init`.
        error_feedback: carry each replica's compression residual into its next send
            of that fragment (beyond the paper).
        nonfinite: what to do with a non-finite averaged outer gradient: "skip" (the
            default: skip that fragment's outer step and restore it to θ_g on every
            replica, a failed round), "apply" (no check), "raise" (a runtime error).
        has_aux: whether `loss_fn` returns `(loss, aux)` with `aux` a dict of arrays.
        exchange: how replicas exchange outer gradients (an `Exchange`); the default
            simulates all replicas on one device, `distributed.sharded_exchange`
            moves the packed low-bit payload between devices and hosts within the
            step that sends. A `PostedExchange` (`distributed.posted_exchange`)
            only encodes in that step: the state then carries an outbox and an
            inbox of packed messages, something outside the step (a
            `distributed.Courier`) moves them while the next τ inner steps compute,
            and the step of the outer update decodes them. It needs τ >= 1.
        offload: keep θ_g and the outer optimizer state in host memory (the
            `pinned_host` memory kind) and move only the pieces of the fragment being
            synchronised to the device, for its Δ, outer step and merge (the paper's
            offloading, docs/paper.md §1.10). The numbers are bitwise those without
            offload; the device then holds the replicas, their inner state, the
            in-flight slots and one fragment at a time. Works on a mesh too (the
            sharded state keeps θ_g and the outer state in host memory). Needs a
            backend with host memory kinds (GPU, TPU; on CPU host and device memory
            are the same RAM).

    Returns:
        The `Algorithm`.

    Raises:
        ValueError: on a bad configuration (docs/contract.md §5), naming the field, the
            value and what is allowed.
    """
    outer = optax.sgd(0.4, momentum=0.9, nesterov=True) if outer is None else outer
    compressor = _check_options(alpha, nonfinite, compressor, error_feedback, fragments)
    num_fragments = 1 if fragments is None else fragments.num_fragments
    schedule = make_schedule(
        sync_every, num_fragments, num_replicas, overlap, first_send
    )
    if isinstance(exchange, PostedExchange) and min(schedule.overlap) < 1:
        raise ValueError(
            f"overlap (tau)={schedule.overlap} with a posted exchange; allowed: every "
            "tau >= 1 (with tau = 0 the outer step is in the step that sends, so "
            "there is no step to move the messages behind)."
        )
    spec = StreamingSpec(
        loss_fn=loss_fn,
        inner=inner,
        outer=outer,
        schedule=schedule,
        fragments=fragments,
        alpha=alpha,
        compressor=compressor,
        error_feedback=error_feedback,
        nonfinite=nonfinite,
        has_aux=has_aux,
        exchange=exchange,
        offload=offload,
    )

    def init(params: Params, key: PRNGKeyArray | None = None) -> StreamingState:
        return streaming_init(spec, params, key)

    def step(state: StreamingState, batch: Batch) -> tuple[StreamingState, Metrics]:
        return streaming_step(spec, state, batch)

    def bits_per_fragment(params: Params) -> np.ndarray:
        return communication.bits_per_fragment(compressor, spec.fragments_of(params))

    init.__doc__ = streaming_init.__doc__
    step.__doc__ = streaming_step.__doc__
    return Algorithm(init, step, bits_per_fragment, num_replicas, spec)


def diloco(
    loss_fn: Callable[..., Any],
    *,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    num_replicas: int = 2,
    sync_every: int = 100,
    nonfinite: str = "skip",
    has_aux: bool = False,
    exchange: Exchange | PostedExchange = communication.simulated_exchange,
    offload: bool = False,
) -> Algorithm:
    """Vanilla DiLoCo (Douillard et al., 2023; Alg. 1): P = 1, τ = 0, α = 0, fp32.

    The same code path as `streaming_diloco`, with the whole model one fragment first
    sent at step H (`offload` as there: with one fragment, the whole of θ_g and the
    outer state visit the device at each sync).
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
        nonfinite=nonfinite,
        has_aux=has_aux,
        exchange=exchange,
        offload=offload,
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
    layout = spec.layout_of(arrays)
    wide = jnp.result_type(*[_wide(x) for x in jax.tree.leaves(arrays)])
    replicas = replicate(params, spec.num_replicas)
    residual = None
    if spec.error_feedback:
        residual = jax.tree.map(
            lambda x: jnp.zeros((spec.num_replicas,) + x.shape, _wide(x)), arrays
        )
    global_params, outer_state = (
        params,
        outer_init(spec.outer, arrays, frags.num_fragments),
    )
    if spec.offload:
        global_params, outer_state = _to_host((global_params, outer_state))
    outbox = inbox = None
    if spec.posted:
        size = max(_message_bytes(spec, g, arrays) for g in layout.groups)
        outbox = jnp.zeros((spec.num_replicas, layout.num_slots, size), jnp.uint8)
        inbox = jnp.zeros((layout.num_slots, spec.num_replicas, size), jnp.uint8)
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
        residual=residual,
        key=jnp.zeros((2,), jnp.uint32) if key is None else _key_data(key),
        outbox=outbox,
        inbox=inbox,
    )


def streaming_step(
    spec: StreamingSpec, state: StreamingState, batch: Batch
) -> tuple[StreamingState, Metrics]:
    """One step of Streaming DiLoCo (Alg. 2, l.3-12): inner, send, outer, merge."""
    state, local = local_phase(spec, state, batch)
    return sync_phase(spec, state, local)


def local_phase(
    spec: StreamingSpec, state: StreamingState, batch: Batch
) -> tuple[StreamingState, dict]:
    """The first half of a step, which needs nothing from other replicas: the inner
    step and the sends (`inner_update`, `send`; the sends in a loop that runs only
    when a fragment is due, `_gated`).

    Returns:
        The new state and what `sync_phase` needs to finish the step: the per-replica
        losses (`loss/replicas`, `[M]`) and aux (`replicas/aux/...`), and which
        fragments were sent (`sync/sent`).
    """
    check_batch(batch, spec.num_replicas)
    state, losses, aux = inner_update(spec, state, batch)
    sent = spec.schedule.sent(state.step)  # what `send` reports; all False if idle
    state = _gated(jnp.any(sent), lambda s: send(spec, s)[0], state)
    local = {"loss/replicas": losses, "sync/sent": sent}
    local.update({f"replicas/aux/{k}": v for k, v in aux.items()})
    return state, local


def sync_phase(
    spec: StreamingSpec, state: StreamingState, local: dict
) -> tuple[StreamingState, Metrics]:
    """The second half of a step: `receive`, `outer_update`, `merge_arrivals` (in a
    loop that runs only when something arrives, `_gated`), and the step's metrics.
    A posted exchange's courier delivers the messages due at t between the two
    halves, so they move while the inner step of t computes."""
    losses, sent = local["loss/replicas"], local["sync/sent"]
    prefix = "replicas/aux/"
    aux = {k.removeprefix(prefix): v for k, v in local.items() if k.startswith(prefix)}

    def sync(state):
        state = receive(spec, state)
        state = outer_update(spec, state)[0]
        return merge_arrivals(spec, state)[0]

    # A fragment received or stepped at t is merged at t by the replicas whose τ is
    # τ_min, so a step where nobody merges has nothing else to do either. Which
    # replicas merge is read off the schedule outside the loop (inside, XLA would
    # split it over a mesh's replicas, and gather it back for the metrics).
    merged = spec.schedule.merge_due(state.step, state.sent_at)
    arriving = spec.schedule.arriving(state.step, state.sent_at)
    state = _gated(jnp.any(arriving), sync, state)
    # What `outer_update` applied, read off the state after the loop (`receive` may
    # have set the finiteness flags): all False when nothing arrived.
    applied, failed = _outcome(spec, state)
    if spec.offload:  # the outputs stay in host memory
        state = state._replace(
            global_params=_to_host(state.global_params),
            outer_state=_to_host(state.outer_state),
        )
    frags = spec.fragments_of(eqx.filter(state.global_params, eqx.is_inexact_array))
    bits = np.asarray(communication.bits_per_fragment(spec.compressor, frags), float)
    metrics = {
        "loss/train": jnp.mean(losses),
        "loss/replicas": losses,
        "sync/sent": sent,
        "sync/applied": applied,
        "sync/merged": merged,
        "sync/nonfinite": failed,
        "nonfinite": jnp.any(failed),
        "comm/bits": jnp.sum(jnp.where(sent, jnp.asarray(bits, jnp.float32), 0.0)),
    }
    metrics.update({f"aux/{k}": jnp.mean(v, axis=0) for k, v in aux.items()})
    metrics.update({f"replicas/aux/{k}": v for k, v in aux.items()})
    return state, metrics


def inner_update(
    spec: StreamingSpec, state: StreamingState, batch: Batch
) -> tuple[StreamingState, Array, dict]:
    """One inner step on every replica (Alg. 2, l.3-5); the step counter becomes t + 1.

    Returns:
        The new state, each replica's loss `[M]` and its aux dict (leaves `[M, ...]`).
    """
    replicas, inner_state, losses, aux = inner_steps(
        spec.loss_fn,
        spec.inner,
        spec.has_aux,
        state.replica_params,
        state.inner_state,
        batch,
    )
    state = state._replace(
        step=state.step + 1, replica_params=replicas, inner_state=inner_state
    )
    return state, losses, aux


def send(
    spec: StreamingSpec, state: StreamingState
) -> tuple[StreamingState, Bool[Array, " P"]]:
    """Send the fragments due at t = `state.step` (Alg. 2, l.6-8).

    For each sent fragment, on its elements only: `Δ_m = θ_g − θ_m` per replica (plus
    its error-feedback residual), compressed per replica and averaged over replicas in
    float32 or wider, is stored in the fragment's in-flight slot, with `sent_at = t`
    and whether it is finite. With a posted exchange, each replica's packed message
    goes into the fragment's outbox slot instead (`receive` decodes and averages it).
    Nothing else changes; a step that sends nothing computes nothing.

    Returns:
        The new state and which fragments were sent `[P]`.
    """
    t = state.step
    sent = spec.schedule.sent(t)
    g_leaves = _leaves(state.global_params)
    r_leaves = _leaves(state.replica_params)
    layout = spec.layout_of(eqx.filter(state.global_params, eqx.is_inexact_array))

    # Without a compressor the simulated exchange is elementwise: the mean over
    # replicas of Δ_m, computed where it is stored.
    elementwise = (
        spec.compressor is None
        and spec.exchange is communication.simulated_exchange
        and not spec.error_feedback
    )

    def mean_delta(g, *replicas):  # a piece (or row) of θ_g and of each replica
        # `average(outer_gradients(...))`, with each replica's row read on its own. A
        # row read across the replica axis and then split per replica (`Δ[m]`) was
        # slow on XLA:CPU when the row index is known only at run time (a group of
        # several fragments): at P = 4 a send took 1.9-2.2 ms more than an
        # inner-only step, and 0.3-0.6 ms this way.
        g = spec.fetch(g)
        deltas = [communication.outer_gradient(g, r) for r in replicas]
        return communication.replica_mean(deltas)

    def one(v, inputs, carry):
        g_leaves, r_leaves = inputs
        slots, ok, residual, outbox = carry
        e = None if residual is None else v.group.gather(residual, v.j, axis=1)
        key = jr.fold_in(jr.fold_in(state.key, t), v.p)
        frags = v.group.piece_fragments()

        def compute(g_touched, r_touched, j, e, key):
            g, r = _read_pieces(spec, v.group, g_touched, r_touched, j)
            deltas = communication.outer_gradients(g, r)
            if e is not None:
                deltas = [d + x for d, x in zip(deltas, e)]
            if spec.compressor is None:
                return exchange(deltas, key)
            # A compressor reads Δ in several passes (a scale, then the codes): Δ is
            # written out once, as the operand of a conditional (fused into those
            # passes, the strided reads made an E3M0 send twice as slow on XLA:CPU).
            if spec.exchange is not communication.simulated_exchange:
                return v.isolated(exchange, deltas, key)
            # On one device, each replica's Δ is its own operand: XLA:CPU copied a
            # slice of a stacked Δ out before each of the compressor's reductions
            # (E3M0 at P = 2: 0.0-1.0 ms less per send, two runs). A sharded
            # exchange keeps the `[M, ...]` operand, split over the devices.
            per_replica = [[d[m] for m in range(d.shape[0])] for d in deltas]
            return v.isolated(_stacked(exchange), per_replica, key)

        def exchange(deltas, key):
            if spec.posted:
                out, recon = spec.exchange.encode(spec.compressor, frags, deltas, key)
                finite = jnp.ones((), bool)
            else:
                out, recon = spec.exchange(
                    spec.compressor, frags, deltas, key, jnp.ones(1, bool)
                )
                finite = _finite(out)
            errors = None if e is None else [d - q for d, q in zip(deltas, recon)]
            return out, finite, errors

        touched = (
            [g_leaves[i] for i in v.group.leaves],
            [r_leaves[i] for i in v.group.leaves],
        )
        if elementwise:  # Δ̄ written into the slot row by row, in place
            per_replica = [[x[m] for x in touched[1]] for m in range(spec.num_replicas)]
            slots = layout.write_rows(
                slots,
                v.group,
                v.p,
                v.j,
                mean_delta,
                (touched[0], *per_replica),
                (0,) * (1 + spec.num_replicas),
            )
            # Read back from the slot (the values are no longer anywhere else);
            # `isfinite`, as `_finite`'s sum would first copy the slot's row out.
            row = layout.read(slots, v.group, v.p)
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in row]))
            return slots, ok.at[v.p].set(finite), residual, outbox
        out, finite, errors = v.isolated(compute, *touched, v.j, e, key)
        if spec.posted:
            k = jnp.asarray(layout.slot_of)[v.p]
            outbox = jax.lax.dynamic_update_slice(
                outbox, out[:, None, :], (0 * k, k, 0 * k)
            )
        else:
            slots = layout.write(slots, v.group, v.p, out)
            ok = ok.at[v.p].set(finite)
        if errors is not None:
            residual = v.group.scatter(residual, v.j, errors, axis=1)
        return slots, ok, residual, outbox

    residual = None if state.residual is None else jax.tree.leaves(state.residual)
    slots, ok, residual, outbox = layout.for_each(
        sent,
        one,
        (state.inflight, state.inflight_ok, residual, state.outbox),
        (g_leaves, r_leaves),
    )
    state = state._replace(
        outbox=outbox,
        inflight=slots,
        sent_at=jnp.where(sent, t, state.sent_at),
        inflight_ok=ok,
        residual=None
        if residual is None
        else jax.tree.unflatten(jax.tree.structure(state.residual), residual),
    )
    return state, sent


def receive(spec: StreamingSpec, state: StreamingState) -> StreamingState:
    """Decode the messages of the fragments whose outer step is at t (posted exchange).

    For each such fragment, every replica's packed message (delivered into the
    fragment's inbox slot between steps) is decoded and the reconstructions averaged
    over replicas in float32 or wider, in replica order: the in-flight slot and the
    finiteness flag then hold what an in-step exchange would have stored at the send.
    Without a posted exchange this is the identity.
    """
    if not spec.posted:
        return state
    due = spec.schedule.outer_due(state.step, state.sent_at)
    arrays = eqx.filter(state.global_params, eqx.is_inexact_array)
    layout = spec.layout_of(arrays)
    like = _leaves(arrays)

    def one(v, inbox, carry):
        slots, ok = carry
        deltas = _deltas_like(spec, v.group, like)
        frags = v.group.piece_fragments()
        size = spec.exchange.message_bytes(spec.compressor, frags, deltas, state.key)
        k = jnp.asarray(layout.slot_of)[v.p]
        messages = jax.lax.dynamic_slice(
            inbox, (k, 0 * k, 0 * k), (1, spec.num_replicas, size)
        )[0]

        def compute(messages):
            mean = spec.exchange.decode_mean(
                spec.compressor, frags, messages, deltas, state.key
            )
            return mean, _finite(mean)

        mean, finite = v.isolated(compute, messages)
        return layout.write(slots, v.group, v.p, mean), ok.at[v.p].set(finite)

    slots, ok = layout.for_each(
        due, one, (state.inflight, state.inflight_ok), state.inbox
    )
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
    g_arrays, g_static = eqx.partition(state.global_params, eqx.is_inexact_array)
    if spec.nonfinite == "raise":
        g_arrays = eqx.error_if(
            g_arrays, jnp.any(failed), "non-finite outer gradient (nonfinite='raise')"
        )
    layout = spec.layout_of(g_arrays)
    # An elementwise outer optimizer takes the step a row at a time, in place.
    elementwise = is_elementwise(spec.outer, g_arrays, state.outer_state)

    def one(v, inflight, carry):
        in_place = (~v.live).astype(jnp.int32) if elementwise else None
        return fragment_outer_step(
            spec.outer,
            v.group,
            v.j,
            v.p,
            *carry,
            inflight,  # read inside the update: XLA fuses the read into it
            spec.fetch,
            spec.store,
            v.isolated,
            read_grad=lambda slots: layout.read(slots, v.group, v.p),
            in_place=in_place,
        )

    g_arrays, outer_state = layout.for_each(
        applied, one, (g_arrays, state.outer_state), state.inflight
    )
    state = state._replace(
        global_params=eqx.combine(g_arrays, g_static), outer_state=outer_state
    )
    return state, applied, failed


def merge_arrivals(
    spec: StreamingSpec, state: StreamingState
) -> tuple[StreamingState, Bool[Array, "M P"]]:
    """Each replica merges the fragments arriving for it at t (Alg. 2, l.12).

    `θ_m ← α·θ_m + (1 − α)·θ_g` on the fragment for every replica m with
    `sent_at + τ_m = t`; a fragment whose outer gradient was not finite is restored to
    θ_g instead (unless the policy is "apply").

    Returns:
        The new state and which fragments each replica merged `[M, P]`.
    """
    merging = spec.schedule.merge_due(state.step, state.sent_at)
    keep = state.inflight_ok
    if spec.nonfinite == "apply":
        keep = jnp.ones_like(keep)
    g_leaves = _leaves(state.global_params)
    r_arrays, r_static = eqx.partition(state.replica_params, eqx.is_inexact_array)
    r_leaves, r_def = jax.tree.flatten(r_arrays)
    layout = spec.layout_of(eqx.filter(state.global_params, eqx.is_inexact_array))

    def one(v, g_leaves, r_leaves):
        due, ok = merging[:, v.p], keep[v.p]

        def mix(r, g):  # a piece, or a row of one, of every replica and of θ_g
            shape = (-1,) + (1,) * g.ndim
            g = spec.fetch(g)
            return merge(r, g, due.reshape(shape), ok.reshape(shape[1:]), spec.alpha)

        r_leaves, unknown_zero = list(r_leaves), (~v.live).astype(jnp.int32)
        for k, i in enumerate(v.group.leaves):
            r_leaves[i] = v.group.update_one(
                k, r_leaves[i], v.j, mix, (g_leaves[i],), (1, 0), unknown_zero
            )
        return r_leaves

    arriving = spec.schedule.arriving(state.step, state.sent_at)
    r_leaves = layout.for_each(arriving, one, r_leaves, g_leaves)
    r_arrays = jax.tree.unflatten(r_def, r_leaves)
    state = state._replace(replica_params=eqx.combine(r_arrays, r_static))
    return state, merging


def inflight_outer_gradients(spec: StreamingSpec, state: StreamingState) -> Params:
    """The in-flight buffer, read out: Δ̄ of every fragment in flight at `state.step`.

    A fragment is in flight from its send until its outer step (`t < sent_at +
    τ_min`). Returns the parameters' structure (inexact arrays) holding each in-flight
    fragment's averaged outer gradient on its elements, zeros elsewhere, in the wide
    dtype.

    Raises:
        ValueError: with a posted exchange, where Δ̄ exists only once it has arrived.
    """
    if spec.posted:
        raise ValueError(
            "inflight_outer_gradients with a posted exchange: the averaged outer "
            "gradient is decoded at its arrival, so nothing in flight can be read."
        )
    arrays = eqx.filter(state.global_params, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(arrays)
    layout = spec.layout_of(arrays)
    in_flight = spec.schedule.in_flight(state.step, state.sent_at)

    def one(v, inflight, out):
        return v.group.scatter(out, v.j, layout.read(inflight, v.group, v.p))

    out = [jnp.zeros(x.shape, state.inflight.dtype) for x in leaves]
    out = layout.for_each(in_flight, one, out, state.inflight)
    return jax.tree.unflatten(treedef, out)


def message_bytes(spec: StreamingSpec, params: Params) -> np.ndarray:
    """Bytes of one replica's packed message for each fragment (posted exchange).

    Returns:
        `[P]` int64: what each replica posts when it sends fragment p.
    """
    if not spec.posted:
        raise ValueError(
            f"message_bytes: exchange={spec.exchange!r} is not a posted exchange."
        )
    arrays = eqx.filter(params, eqx.is_inexact_array)
    layout = spec.layout_of(arrays)
    per_group = [_message_bytes(spec, g, arrays) for g in layout.groups]
    return np.asarray([per_group[g] for g in layout.group_of], np.int64)


def _check_options(alpha, nonfinite, compressor, error_feedback, fragments):
    """Validate `streaming_diloco`'s options; returns the compressor (a name built)."""
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
    return compressor


def _gated(
    due: Bool[Array, ""],
    fn: Callable[[StreamingState], StreamingState],
    state: StreamingState,
) -> StreamingState:
    """`fn(state)` if `due`, else `state`.

    A loop of 0 or 1 iteration, not a `lax.cond`: a while loop updates the state it
    carries in place, where a conditional holding the parameters made XLA copy them
    (`Layout.for_each`). Most steps sync nothing; they then run one loop condition
    instead of the set-up of every group's loop in `send`, `outer_update` and
    `merge_arrivals`. On the sync-heavy benchmark that was 41 XLA:CPU thunks
    (770 in all instead of 811; the plain AdamW step has 713) and 0.55 ms of a
    10 ms step (`benchmarks/compare_versions.py`). The barrier ties the body to the
    iteration, so that XLA hoists none of it out of the loop.

    The loop carries the state only: what a phase reports (which fragments were
    sent, applied) is read off the schedule and the state outside it. A value
    carried for the idle case would be one more small computation ready at the
    start of the step, and XLA:CPU hands the work of a step to its thread pool
    when more than 8 are ready at once (`benchmarks/README.md`).
    """
    dynamic, static = eqx.partition(state, eqx.is_array)

    def body(carry):
        dynamic = jax.lax.optimization_barrier(carry[1])
        new = eqx.partition(fn(eqx.combine(dynamic, static)), eqx.is_array)[0]
        return jnp.zeros_like(carry[0]), new

    # The loop carries `due` itself as its condition rather than a counter, whose
    # start (a constant) XLA would copy into the loop at every step.
    dynamic = jax.lax.while_loop(lambda carry: carry[0], body, (due, dynamic))[1]
    return eqx.combine(dynamic, static)


def _stacked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(deltas, key)` called with each leaf's per-replica parts `[Δ_0, Δ_1, ...]`,
    stacked into the `[M, ...]` array it takes (whose slices XLA reads from the parts)."""

    def call(parts: list[list[Array]], key: PRNGKeyArray) -> Any:
        return fn([jnp.stack(p) for p in parts], key)

    return call


def _outcome(
    spec: StreamingSpec, state: StreamingState
) -> tuple[Bool[Array, " P"], Bool[Array, " P"]]:
    """Which fragments take their outer step at t, and which of them arrived with a
    non-finite outer gradient (`outer_update`'s report)."""
    due = spec.schedule.outer_due(state.step, state.sent_at)
    failed = due & ~state.inflight_ok
    applied = due if spec.nonfinite == "apply" else due & state.inflight_ok
    return applied, failed


def _to_host(tree: Any) -> Any:
    """The array leaves of `tree` in host memory (`pinned_host`), others unchanged."""
    return jax.tree.map(
        lambda x: jax.device_put(x, jax.memory.Space.Host) if eqx.is_array(x) else x,
        tree,
    )


def _read_pieces(
    spec: StreamingSpec,
    group: Any,
    g_touched: list[Array],
    r_touched: list[Array],
    j: Array,
) -> tuple[list[Array], list[Array]]:
    """Member j's pieces of θ_g's and of the replicas' touched leaves. Called inside
    `Visit.isolated`, so that XLA fuses these reads into the work on them."""
    g = [
        spec.fetch(group.gather_one(k, x, j, fused=True))
        for k, x in enumerate(g_touched)
    ]
    r = [group.gather_one(k, x, j, 1, fused=True) for k, x in enumerate(r_touched)]
    return g, r


def _finite(values: list[Array]) -> Array:
    # x - x is 0 where x is finite and NaN where it is not; the sum cannot overflow.
    return jnp.isfinite(sum(jnp.sum(v - v) for v in values))


def _deltas_like(spec: StreamingSpec, group: Any, leaves: list[Array]) -> list[Any]:
    """Shapes and dtypes of a group's `[M, ...]` outer gradients."""
    return [
        jax.ShapeDtypeStruct((spec.num_replicas,) + shape, _wide(leaves[i]))
        for i, shape in zip(group.leaves, group.shapes)
    ]


def _message_bytes(spec: StreamingSpec, group: Any, arrays) -> int:
    """Bytes of one replica's packed message for a member of `group`."""
    deltas = _deltas_like(spec, group, _leaves(arrays))
    key = jnp.zeros((2,), jnp.uint32)
    return spec.exchange.message_bytes(
        spec.compressor, group.piece_fragments(), deltas, key
    )


def _leaves(params: Params) -> list[Array]:
    return jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))


def _wide(x: Array) -> jnp.dtype:
    return communication.wide_dtype(x.dtype)


def _key_data(key: PRNGKeyArray) -> Array:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jr.key_data(key)
    return jnp.asarray(key)
