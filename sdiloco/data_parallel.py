"""Data-Parallel training, the baseline, with the same `init`/`step` interface.

Every step each of the M replicas computes the gradient of its own batch, the gradients
are averaged over the replicas (an all-reduce, in float32 or wider), and one
inner-optimizer step is taken on the single shared copy of the parameters. Accounting
follows the paper's Table 1: one gradient exchange puts `grad_bits` (16, bf16) bits per
parameter on the wire every step.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Int

from . import participation as participation_lib
from .base import Algorithm
from .communication import wide_dtype
from .custom_types import Batch, Metrics, Params
from .fragments import parameter_leaves
from .inner import check_batch, value_and_grad
from .participation import Participation


class DataParallelState(NamedTuple):
    """The state of a Data-Parallel run."""

    step: Int[Array, ""]  # [] int32
    global_params: Params  # the one copy of the parameters
    inner_state: optax.OptState  # the optimizer state of that copy

    replica_fields = ()
    """No field carries a replica axis: every replica holds the same copy."""


def data_parallel(
    loss_fn: Callable[..., Any],
    *,
    inner: optax.GradientTransformation,
    num_replicas: int = 2,
    grad_bits: int = 16,
) -> Algorithm[None]:
    """Data-Parallel: gradients averaged over the replicas every step, one inner step.

    Args:
        loss_fn: `loss_fn(params, batch) -> loss`, or `(loss, aux)` with `aux` a
            dict of arrays (reported in the metrics as `aux/...`).
        inner: the optimizer (any optax transformation).
        num_replicas: M >= 1; the batch has a leading axis M.
        grad_bits: bits per parameter of one gradient exchange (16: bf16, the paper's
            Table 1 assumption).

    Returns:
        The `Algorithm`; `bits_per_fragment(params)` has one entry, the bits of one
        gradient exchange.
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas (M)={num_replicas!r}; must be an integer >= 1.")
    if not isinstance(grad_bits, int) or grad_bits < 1:
        raise ValueError(f"grad_bits={grad_bits!r}; must be an integer >= 1.")
    grad_fn = value_and_grad(loss_fn)

    def bits_per_fragment(params: Params) -> np.ndarray:
        n = sum(int(np.prod(x.shape, dtype=np.int64)) for x in parameter_leaves(params))
        return np.asarray([grad_bits * n], dtype=object)

    def init(params: Params, key: Any = None) -> DataParallelState:
        """The initial state; `key` is unused (kept for a uniform signature)."""
        del key
        return DataParallelState(
            step=jnp.zeros((), jnp.int32),
            global_params=params,
            inner_state=inner.init(eqx.filter(params, eqx.is_inexact_array)),
        )

    def step(
        state: DataParallelState,
        batch: Batch,
        participation: Participation | None = None,
    ) -> tuple[DataParallelState, Metrics]:
        bits = float(bits_per_fragment(state.global_params)[0])
        return data_parallel_step(
            inner, grad_fn, num_replicas, bits, state, batch, participation
        )

    step.__doc__ = data_parallel_step.__doc__
    return Algorithm(init, step, bits_per_fragment, num_replicas, None)


def data_parallel_step(
    inner: optax.GradientTransformation,
    grad_fn: Callable[..., Any],
    num_replicas: int,
    bits: float,
    state: DataParallelState,
    batch: Batch,
    participation: Participation | None = None,
) -> tuple[DataParallelState, Metrics]:
    """One Data-Parallel step: per-replica gradients, all-reduce mean, one update.

    With a `participation`, the mean is over the replicas that compute (elastic
    Data-Parallel); a step where none computes changes nothing but the step
    counter. A returning replica needs no healing: the one copy is shared.
    """
    check_batch(batch, num_replicas)
    params = state.global_params
    (losses, aux), grads = eqx.filter_vmap(grad_fn, in_axes=(None, eqx.if_array(0)))(
        params, batch
    )
    if participation is None:
        grads = jax.tree.map(_mean, grads)
        new_params, inner_state = _update(inner, params, state.inner_state, grads)
    else:
        participation_lib.check(participation, num_replicas)
        computes = participation.computes
        losses = jnp.where(computes, losses, 0.0)
        grads = jax.tree.map(lambda g: _masked_mean(g, computes), grads)
        new_params, inner_state = _update_if_any(
            inner, params, state.inner_state, grads, jnp.any(computes)
        )
    metrics = _metrics(losses, aux, grads, bits)
    if participation is not None:
        count = jnp.maximum(jnp.sum(participation.computes), 1)
        metrics["loss/train"] = jnp.sum(losses) / count
    new_state = DataParallelState(
        step=state.step + 1, global_params=new_params, inner_state=inner_state
    )
    return new_state, metrics


def _update(inner: optax.GradientTransformation, params, inner_state, grads):
    updates, inner_state = inner.update(
        grads, inner_state, eqx.filter(params, eqx.is_inexact_array)
    )
    return eqx.apply_updates(params, updates), inner_state


def _mean(g: Array) -> Array:
    """Mean over the replicas, in the wide dtype."""
    return jnp.mean(g.astype(wide_dtype(g.dtype)), axis=0).astype(g.dtype)


def _masked_mean(g: Array, computes: Array) -> Array:
    """Mean over the replicas that compute, in the wide dtype (0 when none does)."""
    wide = g.astype(wide_dtype(g.dtype))
    mask = computes.reshape((-1,) + (1,) * (g.ndim - 1))
    total = jnp.sum(jnp.where(mask, wide, 0), axis=0)
    count = jnp.maximum(jnp.sum(computes), 1).astype(wide.dtype)
    return (total / count).astype(g.dtype)


def _update_if_any(inner, params, inner_state, grads, any_computes):
    """`_update`, or nothing changed when no replica computed."""
    new_params, new_inner = _update(inner, params, inner_state, grads)
    arrays = eqx.filter(new_params, eqx.is_array)
    arrays, new_inner = jax.tree.map(
        lambda n, o: jnp.where(any_computes, n, o),
        (arrays, new_inner),
        (eqx.filter(params, eqx.is_array), inner_state),
    )
    return eqx.combine(arrays, params), new_inner


def _metrics(losses: Array, aux: dict, grads: Any, bits: float) -> Metrics:
    """A Data-Parallel step's metrics: losses, bits on the wire, finiteness."""
    finite = [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]
    metrics = {
        "loss/train": jnp.mean(losses),
        "loss/replicas": losses,
        "comm/bits": jnp.asarray(bits, jnp.float32),
        "nonfinite": ~jnp.all(jnp.stack(finite)),
    }
    metrics.update({f"aux/{k}": jnp.mean(v, axis=0) for k, v in aux.items()})
    return metrics
