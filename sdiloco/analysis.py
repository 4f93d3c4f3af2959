"""Diagnostics of a run's state: how similar the replicas' outer gradients are, and
what is in flight.

Streaming DiLoCo's Figs. 17-18 plot the cosine similarity between the replicas' outer
gradients Δ_m = θ_g − θ_m over training, per fragment and per layer. `outer_gradient_cosine`
computes it from a `StreamingState` for any partition: the run's own fragments, or
`fragments_by_layer(..., layers_per_fragment=1)` for one value per layer (fragment 0 is
then the non-block parameters).

Read after a step that sent fragment p with τ >= 1, the state holds exactly the Δ_m
that was sent (the merge and outer step come τ steps later); with τ = 0 they have already
been applied, so read the state before the sending step instead.

`inflight_outer_gradients` reads the averaged outer gradients waiting in the in-flight
slots of a `StreamingState` back into the parameters' structure. The plainer readers of
any algorithm's state are here too: `global_params`, `replica_params`,
`replica_average` and `per_replica_bytes`.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .base import AlgorithmState, replica_fields
from .custom_types import Params
from .fragments import Fragments
from .inflight import Visit
from .streaming import StreamingSpec, StreamingState


@eqx.filter_jit
def outer_gradient_cosine(state, fragments: Fragments) -> Float[Array, " P"]:
    """Mean over replica pairs of cos(Δ_a, Δ_b), restricted to each fragment.

    Args:
        state: a `StreamingState` with M >= 2 replicas.
        fragments: the partition to report (need not be the run's own).

    Returns:
        `[P]` float32: the mean pairwise cosine similarity for each fragment (0 where a
        fragment's Δ is zero on some replica).
    """
    g = jax.tree.leaves(eqx.filter(state.global_params, eqx.is_inexact_array))
    r = jax.tree.leaves(eqx.filter(state.replica_params, eqx.is_inexact_array))
    m = r[0].shape[0]
    if m < 2:
        raise ValueError(f"outer_gradient_cosine needs M >= 2 replicas; got M={m}.")
    p = fragments.num_fragments
    gram = jnp.zeros((p, m, m), jnp.float32)
    for x_g, x_r, labels in zip(g, r, fragments.labels):
        delta = (x_g[None] - x_r).astype(jnp.float32)  # [M, ...]
        if labels.ndim == 0:
            flat = delta.reshape(m, -1)
            gram = gram.at[int(labels)].add(flat @ flat.T)
        else:  # one label per row (layer) of a stacked leaf
            rows = delta.reshape(m, delta.shape[1], -1)  # [M, L, n]
            per_row = jnp.einsum("aln,bln->lab", rows, rows)
            gram = gram.at[jnp.asarray(labels)].add(per_row)
    norms = jnp.sqrt(jnp.diagonal(gram, axis1=1, axis2=2))  # [P, M]
    denom = norms[:, :, None] * norms[:, None, :]
    cos = jnp.where(denom > 0, gram / jnp.where(denom > 0, denom, 1.0), 0.0)
    off = 1.0 - jnp.eye(m, dtype=jnp.float32)
    return jnp.sum(cos * off[None], axis=(1, 2)) / (m * (m - 1))


def inflight_outer_gradients(spec: StreamingSpec, state: StreamingState) -> Any:
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
    layout = spec.layout(arrays)
    in_flight = jnp.asarray(spec.schedule.in_flight(state.step, state.sent_at))

    def one(v: Visit, inflight, out):
        return v.scatter(out, layout.read(inflight, v.group, v.p))

    out = [jnp.zeros(x.shape, state.inflight.dtype) for x in leaves]
    out = layout.for_each(in_flight, one, out, state.inflight)
    return jax.tree.unflatten(treedef, out)


def per_replica_bytes(state: AlgorithmState) -> dict[str, float]:
    """Bytes one replica holds of each field of `state` in a deployment.

    A replica field holds 1/M of its bytes per replica (its own slice); a shared field
    is held whole by every replica (each worker keeps its own copy). `state` may be
    abstract (`jax.eval_shape(alg.init, params)`): nothing needs to be allocated.
    """
    fields = replica_fields(state)
    out = {}
    for name in state._fields:
        leaves = [
            x
            for x in jax.tree.leaves(getattr(state, name))
            if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
        ]
        total = float(sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves))
        if name in fields and leaves:
            total /= leaves[0].shape[0]
        out[name] = total
    return out


def global_params(state: AlgorithmState) -> Params:
    """θ_g: the parameters to evaluate by default (paper Table 3)."""
    return state.global_params


def replica_params(state: Any, m: int) -> Params:
    """The parameters of replica m (of a state with a `replica_params` field)."""
    return jax.tree.map(lambda x: x[m] if eqx.is_array(x) else x, state.replica_params)


def replica_average(state: Any) -> Params:
    """The average of the replicas' parameters (computed in float32 or wider)."""

    def avg(x):
        if not eqx.is_inexact_array(x):
            return x[0] if eqx.is_array(x) else x
        wide = jnp.promote_types(x.dtype, jnp.float32)
        return jnp.mean(x.astype(wide), axis=0).astype(x.dtype)

    return jax.tree.map(avg, state.replica_params)
