"""The exchange of outer gradients: Δ per replica, compression, average, accounting.

Streaming DiLoCo, Alg. 2, l.7-8 and §2.4: each replica computes its outer gradient
`Δ_m = θ_g − θ_m` on the fragments being sent, compresses it on its own (the paper
quantizes "each replica's unreduced outer gradients"), and the replicas average the
reconstructed values **in float32 or wider** ("the accumulation is done in FP32").

Compressors act per *group*: a whole leaf, or one row of a leaf labelled per row (one
layer of a stacked transformer), so a quantization scale never spans two fragments.
"""

import functools as ft
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from .aggregation import average
from .compression import Compressor
from .fragments import Fragments


def wide_dtype(dtype) -> jnp.dtype:
    """The dtype outer gradients are averaged in: float32, or the parameters' if wider."""
    dtype = jnp.dtype(dtype)
    return dtype if jnp.finfo(dtype).bits >= 32 else jnp.dtype(jnp.float32)


def outer_gradients(
    global_leaves: list[Array], replica_leaves: list[Array]
) -> list[Array]:
    """`Δ_m = θ_g − θ_m` for every replica, in the wide dtype (Alg. 2, l.7)."""
    return [outer_gradient(g[None], r) for g, r in zip(global_leaves, replica_leaves)]


def outer_gradient(g: Array, r: Array) -> Array:
    """`θ_g − θ_m` of one leaf (or piece) in the wide dtype; `g` broadcasts against
    `r`."""
    w = wide_dtype(g.dtype)
    return g.astype(w) - r.astype(w)


def compress(
    compressor: Compressor | None,
    fragments: Fragments,
    deltas: list[Array],
    key: PRNGKeyArray,
) -> list[Array]:
    """What the receivers reconstruct of each replica's Δ (per replica, per group).

    Args:
        compressor: the compressor, or None to send the wide values as they are.
        fragments: the partition (its labels define the groups).
        deltas: one `[M, ...]` array per parameter leaf.
        key: randomness for stochastic compressors (split per leaf, replica and row).

    Returns:
        The reconstructed `[M, ...]` outer gradients, same dtypes as `deltas`.
    """
    if compressor is None:
        return deltas
    out = []
    for i, (d, labels) in enumerate(zip(deltas, fragments.labels)):
        f = ft.partial(_per_row, compressor) if labels.ndim == 1 else compressor
        keys = jr.split(jr.fold_in(key, i), d.shape[0])
        out.append(jnp.stack([f(d[m], keys[m]) for m in range(d.shape[0])]))
    return out


def simulated_exchange(
    compressor: Compressor | None,
    fragments: Fragments,
    deltas: list[Array],
    key: PRNGKeyArray,
    aggregate: Callable[[list[Array]], list[Array]] = lambda rows: average(rows),
) -> tuple[list[Array], list[Array]]:
    """The exchange with all replicas on one device: compress, then aggregate.

    This is the default `exchange` of `streaming_diloco` (a `base.Exchange`). The
    sharded one (`distributed.sharded_exchange`) returns the same values.

    Args:
        compressor: the compressor, or None.
        fragments: the partition.
        deltas: each replica's outer gradient, one `[M, ...]` array per leaf.
        key: randomness for stochastic compressors.
        aggregate: how the reconstructions become one (`aggregation.py`; the
            algorithm passes its aggregator over the senders); default the plain
            mean over all M.

    Returns:
        `aggregate` of the reconstructed outer gradients (one `[...]` array per
        leaf, wide dtype), and each replica's own reconstruction `[M, ...]` (what
        error feedback subtracts).
    """
    recon = compress(compressor, fragments, deltas, key)
    return aggregate(recon), recon


def _per_row(compressor: Compressor, x: Array, key: PRNGKeyArray) -> Array:
    """`compressor` applied to each row of `x` alone (one group per row)."""
    return jax.vmap(compressor)(x, jr.split(key, x.shape[0]))


def bits_per_fragment(
    compressor: Compressor | None, fragments: Fragments
) -> np.ndarray:
    """Exact bits one replica puts on the wire to send each fragment (docs/contract.md §3).

    Payload plus metadata, summed over the fragment's groups. Without a compressor,
    outer gradients travel as float32: 32 bits per element.

    Returns:
        Python integers in an object array of shape `[P]`.
    """
    if compressor is None:
        return fragments.group_sum(
            lambda shape: 32 * int(np.prod(shape, dtype=np.int64))
        )
    return fragments.group_sum(compressor.bits)
