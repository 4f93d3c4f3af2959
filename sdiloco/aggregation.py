"""Aggregators: how the senders' decoded outer gradients of a fragment become one.

Every exchange ends the same way: each program holds every replica's
reconstruction of the fragment (`rows`, one `[M, ...]` array per piece, in float32
or wider) and knows who sent (`sent`, `[M]` bool; a replica that did not send has
a row of zeros). An aggregator turns them into the one outer gradient that the
outer optimizer takes:

    aggregator(rows, sent, steps) -> one `[...]` array per piece

`steps` (`[M]` int32, or None where the program does not know them, as on an
elastic island) counts the inner steps each sender took since its last send of the
fragment. The same aggregator runs in every exchange: the simulation, the mesh's
all-gather, the posted exchange and the elastic islands, inside the program that
holds the rows, so a robust one is robust everywhere.

Shipped here, each an `eqx.Module` with static configuration:

- `mean()`: the paper's plain mean over the senders (the default): summed in
  replica order, divided by M, then rescaled by M / senders (exactly 1.0 when all
  sent), so every exchange reproduces it bitwise;
- `token_weighted_mean()`: each sender weighted by its `steps`;
- `trimmed_mean(trim)`: per coordinate, the mean after dropping the `⌊trim·n⌋`
  largest and smallest of the n senders' values;
- `median()`: per coordinate, the median of the senders' values;
- `clipped_mean(max_norm=None, factor=2.0)`: each sender's row clipped to a norm
  (fixed, or `factor` times the senders' median norm), then the mean.

The plain and token-weighted means keep a non-finite row: the mean is then not
finite and the run's `nonfinite` policy decides (by default the round fails). The
robust ones treat a sender whose row is not finite as one that did not send: a
NaN replica cannot fail their round. With no sender left, every aggregator returns
zeros (the core takes no outer step for a fragment nobody sent).
"""

from collections.abc import Callable
from typing import Protocol

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from .participation import over_senders, where_replicas


class Aggregate(Protocol):
    """`aggregate(rows, sent, steps) -> one array per piece` (see the module)."""

    def __call__(
        self,
        rows: list[Array],
        sent: Bool[Array, " M"],
        steps: Int[Array, " M"] | None,
    ) -> list[Array]: ...


class Aggregator(eqx.Module):
    """Base of the aggregators here (any callable of `Aggregate`'s shape works)."""

    def __call__(
        self,
        rows: list[Array],
        sent: Bool[Array, " M"],
        steps: Int[Array, " M"] | None,
    ) -> list[Array]:
        raise NotImplementedError


class Mean(Aggregator):
    """The plain mean over the senders (the paper's Alg. 2, l.8)."""

    def __call__(self, rows, sent, steps):
        del steps
        kept = [where_replicas(sent, r, jnp.zeros_like(r)) for r in rows]
        mean = average(kept)
        return over_senders(mean, jnp.sum(sent), sent.shape[0])


class TokenWeightedMean(Aggregator):
    """`Σ w_m Δ_m / Σ w_m` over the senders, `w_m` the inner steps replica m took
    since its last send of the fragment: a straggler, or a replica that has just
    come back, counts for the work it did. Where the steps are unknown (None), or
    no sender took a step, it is the plain mean."""

    def __call__(self, rows, sent, steps):
        if steps is None:
            return Mean()(rows, sent, None)
        w = jnp.where(sent, steps, 0).astype(jnp.float32)
        total = jnp.sum(w)
        # each row scaled by n·w_m / Σw (exactly 1 when the weights are equal), so
        # the mean over the n senders is the weighted mean
        n = jnp.sum(sent).astype(jnp.float32)
        factor = jnp.where(total > 0, n * w / jnp.maximum(total, 1.0), 1.0)
        scaled = [
            r * factor.astype(r.dtype).reshape((-1,) + (1,) * (r.ndim - 1))
            for r in rows
        ]
        return Mean()(scaled, sent, None)


class TrimmedMean(Aggregator):
    """Per coordinate, the mean of the senders' values after dropping the
    `⌊trim·n⌋` smallest and largest (n senders; at least one value is kept).

    Attributes:
        trim: the fraction dropped at each end, in [0, 0.5).
    """

    trim: float = eqx.field(default=0.25, static=True)

    def __check_init__(self):
        if isinstance(self.trim, bool) or not 0 <= self.trim < 0.5:
            raise ValueError(f"trimmed_mean trim={self.trim!r}; allowed: [0, 0.5).")

    def __call__(self, rows, sent, steps):
        del steps
        sent = sent & _finite_rows(rows)
        n = jnp.sum(sent)
        k = jnp.floor(self.trim * n.astype(jnp.float32)).astype(n.dtype)
        k = jnp.minimum(k, (n - 1) // 2)
        return _middle_mean(rows, sent, k)


class Median(Aggregator):
    """Per coordinate, the median of the senders' values (the mean of the two
    middle ones for an even number of senders)."""

    def __call__(self, rows, sent, steps):
        del steps
        sent = sent & _finite_rows(rows)
        return _middle_mean(rows, sent, (jnp.sum(sent) - 1) // 2)


class ClippedMean(Aggregator):
    """The mean over the senders of their rows clipped to a norm: `max_norm`, or
    `factor` times the median of the senders' norms (a replica whose Δ is 10x the
    others' counts as one at the threshold). A row's norm is over all the
    fragment's pieces.

    Attributes:
        max_norm: a fixed threshold (None: relative to the median norm).
        factor: the threshold over the median norm, when `max_norm` is None.
    """

    max_norm: float | None = eqx.field(default=None, static=True)
    factor: float = eqx.field(default=2.0, static=True)

    def __check_init__(self):
        for name in ("max_norm", "factor"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not value > 0:
                raise ValueError(
                    f"clipped_mean {name}={value!r}; allowed: a positive number."
                )

    def __call__(self, rows, sent, steps):
        del steps
        sent = sent & _finite_rows(rows)
        safe = [where_replicas(sent, r, jnp.zeros_like(r)) for r in rows]
        norms = jnp.sqrt(sum(jnp.sum(_flat(r) ** 2, axis=1) for r in safe))
        if self.max_norm is None:
            n = jnp.sum(sent)
            median = _middle_mean([norms], sent, (n - 1) // 2)[0]
            threshold = self.factor * median
        else:
            threshold = jnp.asarray(self.max_norm, norms.dtype)
        scale = jnp.minimum(1.0, threshold / jnp.maximum(norms, 1e-30))
        clipped = [
            r * scale.astype(r.dtype).reshape((-1,) + (1,) * (r.ndim - 1)) for r in safe
        ]
        return Mean()(clipped, sent, None)


def average(values: list[Array]) -> list[Array]:
    """Mean over the replica axis, in the values' (wide) dtype (Alg. 2, l.8).

    Summed in replica order, then divided by M: a fixed order, so that an exchange
    that gathers every replica's payload on every device reproduces it bitwise.
    """
    return [replica_mean([v[m] for m in range(v.shape[0])]) for v in values]


def replica_mean(parts: list[Array]) -> Array:
    """The mean of one value per replica, in `average`'s order: summed in replica
    order, then divided by M."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total / len(parts)


def mean() -> Mean:
    """The plain mean over the senders (the default)."""
    return Mean()


def token_weighted_mean() -> TokenWeightedMean:
    """Each sender weighted by its inner steps since its last send."""
    return TokenWeightedMean()


def trimmed_mean(trim: float = 0.25) -> TrimmedMean:
    """The coordinate-wise mean without the `⌊trim·n⌋` extremes at each end."""
    return TrimmedMean(trim)


def median() -> Median:
    """The coordinate-wise median of the senders."""
    return Median()


def clipped_mean(max_norm: float | None = None, *, factor: float = 2.0) -> ClippedMean:
    """The mean of the senders' rows clipped to `max_norm` (or `factor` times the
    median norm)."""
    return ClippedMean(max_norm, factor)


def check_aggregator(aggregator: Callable) -> None:
    """Raises ValueError naming `aggregator` when it is not callable."""
    if not callable(aggregator):
        raise ValueError(
            f"aggregator={aggregator!r} is not callable; allowed: "
            "sdiloco.aggregation.mean(), median(), trimmed_mean(...), "
            "clipped_mean(...), token_weighted_mean() or a function "
            "(rows, sent, steps) -> list of arrays."
        )


# ----------------------------------------------------------------------------- helpers


def _flat(x: Array) -> Array:
    return x.reshape(x.shape[0], -1)


def _finite_rows(rows: list[Array]) -> Bool[Array, " M"]:
    """`[M]` whether each replica's row is finite in every piece."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(_flat(r)), 1) for r in rows]), 0)


def _middle_mean(rows: list[Array], sent: Array, k: Array) -> list[Array]:
    """Per coordinate, the mean of the senders' values ranked k .. n − k − 1 (n the
    senders; the others sort last as +inf); zeros when nobody sent."""
    n = jnp.sum(sent)
    out = []
    for r in rows:
        ranked = jnp.sort(where_replicas(sent, r, jnp.full_like(r, jnp.inf)), axis=0)
        rank = jnp.arange(r.shape[0]).reshape((-1,) + (1,) * (r.ndim - 1))
        keep = (rank >= k) & (rank < n - k)
        total = jnp.sum(jnp.where(keep, ranked, 0), axis=0)
        kept = jnp.maximum(n - 2 * k, 1).astype(r.dtype)
        out.append(jnp.where(n > 0, total / kept, 0).astype(r.dtype))
    return out
