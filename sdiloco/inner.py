"""The inner optimization: every replica steps alone, vmapped over the replica axis.

Streaming DiLoCo, Alg. 2, l.3-5: `θ_m ← InnerOpt(θ_m, ∇L(θ_m; x_m))`. The inner
optimizer state is per replica and is never synchronised, reset or touched by a sync
(docs/paper.md §1.9).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

from .custom_types import Batch, Params, Replicated


def replicate(params: Params, num_replicas: int) -> Replicated:
    """M copies of `params`: every array leaf gets a leading replica axis."""
    return jax.tree.map(
        lambda x: (
            jnp.broadcast_to(x, (num_replicas,) + x.shape) if eqx.is_array(x) else x
        ),
        params,
    )


def check_batch(batch: Batch, num_replicas: int) -> None:
    """Raise ValueError unless every leaf of `batch` has a leading axis of size M."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch has no array leaves.")
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(x)
        if not shape or shape[0] != num_replicas:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape {shape}; "
                f"its leading axis must be the number of replicas M={num_replicas}."
            )


def value_and_grad(
    loss_fn: Callable[..., Any],
) -> Callable[[Params, Batch], tuple[tuple[Array, dict], Params]]:
    """`(loss, aux), grads` of `loss_fn` w.r.t. the floating-point arrays of params.

    `loss_fn` returns the loss, or a pair `(loss, aux)` with `aux` a dict of arrays
    (read at trace time: the aux of a loss without one is `{}`)."""

    def with_aux(params, batch):
        out = loss_fn(params, batch)
        if not isinstance(out, tuple):
            return out, {}
        if len(out) != 2 or not isinstance(out[1], dict):
            raise ValueError(
                f"loss_fn returned a tuple of {len(out)} whose second item is a "
                f"{type(out[-1]).__name__}; allowed: the loss, or (loss, aux) with "
                "aux a dict of arrays."
            )
        return out

    return eqx.filter_value_and_grad(with_aux, has_aux=True)


def inner_steps(
    loss_fn: Callable[..., Any],
    inner: optax.GradientTransformation,
    replicas: Replicated,
    inner_state: optax.OptState,
    batch: Batch,
) -> tuple[Replicated, optax.OptState, Float[Array, " M"], dict]:
    """One inner step on every replica, vmapped over the leading replica axis.

    Returns:
        The new replica parameters and inner states, the loss of each replica `[M]`,
        and the aux dict of each replica (leaves with a leading M axis).
    """
    grad_fn = value_and_grad(loss_fn)

    def one(params, opt_state, x):
        (loss, aux), grads = grad_fn(params, x)
        updates, opt_state = inner.update(
            grads, opt_state, eqx.filter(params, eqx.is_inexact_array)
        )
        return eqx.apply_updates(params, updates), opt_state, loss, aux

    return eqx.filter_vmap(one)(replicas, inner_state, batch)
