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
  (fixed, or `factor` times the senders' median norm), then the mean;
- `steps_weighted_mean(power=1.0)`: each sender weighted by `steps ** power`
  (Decoupled DiLoCo's tokens² / steps is `power = 1` with equal batches);
- `radial_directional(power=0.0, plain_shapes=(), scope="piece")`: Decoupled
  DiLoCo's merge of norms and directions apart, the weighted mean norm times the
  unit weighted-mean direction, per piece; pieces of the given shapes (the
  embeddings) by the weighted mean;
- `quorum(k, inner=mean())`: `inner` where at least k replicas sent; a round
  with fewer fails (non-finite), which leaves θ_g and the outer state as if nobody
  had sent.

The plain, token- and steps-weighted means and the radial-directional average
keep a non-finite row: the result is then not finite and the run's `nonfinite`
policy decides (by default the round fails). The robust ones treat a sender whose
row is not finite as one that did not send: a NaN replica cannot fail their round.
With no sender left, every aggregator returns zeros (the core takes no outer step
for a fragment nobody sent).
"""

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from .participation import over_senders, where_replicas


SCOPES = ("piece", "fragment")


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
        return Mean()(_scaled(rows, _weight_factors(sent, w)), sent, None)


class StepsWeightedMean(Aggregator):
    """`Σ w_m Δ_m / Σ w_m` over the senders with `w_m = steps_m ** power`, `steps_m`
    the inner steps replica m took since the fragment's last send (or since it came
    back). Where the steps are unknown (None), or every sender's weight is 0, it is
    the plain mean; `power = 0` is the plain mean and `power = 1` the token-weighted
    mean, both bitwise.

    Decoupled DiLoCo weighs a learner by `tokens² / s`, s its steps since it last
    *received* the fragment. With equal batches of b tokens a sender's Δ holds
    `b·steps_m` tokens, so where `s = steps_m` the weight is `b²·steps_m ∝ steps_m`:
    `power = 1`, today's token weighting. In this core s is less than `steps_m` only
    by the steps m took between the fragment's previous send and its merge of that
    round (the overlap τ): a replica that did not send a round still merges its
    outcome, and one that comes back adopts θ_g and starts its count at 0, so
    missing rounds does not make the two counts differ. With τ > 0 the replicas that
    computed every step still weigh alike under both formulas, but a straggler's
    exact weight `b²·steps_m² / s_m` needs s_m, which the core does not give an
    aggregator. `power = 2` weighs by tokens² alone (every learner equally stale).

    Attributes:
        power: the exponent, a finite number >= 0.
    """

    power: float = eqx.field(default=1.0, static=True)

    def __check_init__(self):
        _check_power("steps_weighted_mean", self.power)

    def __call__(self, rows, sent, steps):
        w = _step_weights(sent, steps, self.power)
        return Mean()(_scaled(rows, _weight_factors(sent, w)), sent, None)


class RadialDirectional(Aggregator):
    """Decoupled DiLoCo's radial-directional average: norms and directions merged
    apart. Over the senders with weights `w_m = steps_m ** power` (normalised; equal
    weights where `power = 0` or the steps are unknown):

        r̄ = Σ w_m ‖x_m‖,   d̄ = Σ w_m x_m / ‖x_m‖,   result = r̄ · d̄ / ‖d̄‖

    (a zero row has direction 0; a zero d̄ gives 0). Against the mean, the result
    keeps the senders' mean length when their directions disagree, where the mean
    shrinks. `x_m` is one piece of sender m's row (`scope = "piece"`, the default:
    each parameter leaf, or the rows of a stacked leaf that the fragment holds, has
    its own norm), or its row over all the fragment's pieces (`scope = "fragment"`).
    A piece whose shape (without M) is in `plain_shapes` takes the weighted mean of
    the senders instead, and is left out of the fragment's norm: Decoupled DiLoCo
    averages the embeddings plainly, and an embedding is one whole leaf, so its
    piece is the leaf's shape, e.g. `((vocab, d_model),)` (every piece of that
    shape matches). A non-finite sender makes the result non-finite (the run's
    `nonfinite` policy decides); nobody sending gives zeros.

    Attributes:
        power: the weights' exponent (0: equal; 1: token weighting).
        plain_shapes: piece shapes that take the weighted mean.
        scope: "piece" or "fragment": what one norm is taken over.
    """

    power: float = eqx.field(default=0.0, static=True)
    plain_shapes: tuple[tuple[int, ...], ...] = eqx.field(default=(), static=True)
    scope: str = eqx.field(default="piece", static=True)

    def __check_init__(self):
        _check_power("radial_directional", self.power)
        if not all(_is_shape(s) for s in self.plain_shapes):
            raise ValueError(
                f"radial_directional plain_shapes={self.plain_shapes!r}; allowed: a "
                "tuple of shapes, each a tuple of ints >= 0, e.g. ((50304, 512),)."
            )
        if self.scope not in SCOPES:
            raise ValueError(
                f"radial_directional scope={self.scope!r}; allowed: {SCOPES}."
            )

    def __call__(self, rows, sent, steps):
        factor = _weight_factors(sent, _step_weights(sent, steps, self.power))
        shapes = [tuple(r.shape[1:]) for r in rows]
        plain = [k for k, shape in enumerate(shapes) if shape in self.plain_shapes]
        radial = [k for k in range(len(rows)) if k not in plain]
        groups = [[k] for k in radial] if self.scope == "piece" else [radial]
        means = Mean()(_scaled([rows[k] for k in plain], factor), sent, None)
        out = dict(zip(plain, means))
        for group in filter(None, groups):
            out.update(zip(group, _radial([rows[k] for k in group], sent, factor)))
        return [out[k] for k in range(len(rows))]


class Quorum(Aggregator):
    """A minimum quorum: `inner`'s result where at least `k` replicas sent, and a
    failed round where fewer (but some) did. Nobody sending gives zeros, as always.

    A failed round is NaN in every element: the core then finds the outer gradient
    not finite and, under the default `nonfinite="skip"`, takes no outer step and
    restores θ_g where a replica merges, exactly as when nobody sends: θ_g, the outer
    optimizer's state and the replicas are bitwise those of a round nobody sent;
    the step's metrics report `sync/nonfinite` (and no `sync/applied`). Zeros would
    not do: a fragment that somebody sent takes its outer step, and a zero outer
    gradient still moves θ_g and the momentum (momentum decays and is applied). So
    use it with `nonfinite="skip"`: "raise" stops the run at a missed quorum and
    "apply" applies the NaN. The senders are counted as `sent` marks them (whether
    their rows are finite or not: a robust `inner` may then drop some); `k` larger
    than M never merges.

    Attributes:
        k: the least number of senders that merges, an int >= 1.
        inner: the aggregator of a round that has its quorum.
    """

    k: int = eqx.field(static=True)
    inner: Callable[..., list[Array]] = eqx.field(default=Mean(), static=True)

    def __check_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"quorum k={self.k!r}; allowed: an int >= 1.")
        if not callable(self.inner):
            raise ValueError(
                f"quorum inner={self.inner!r}; allowed: an aggregator, e.g. mean()."
            )

    def __call__(self, rows, sent, steps):
        merged = self.inner(rows, sent, steps)
        n = jnp.sum(sent)
        ok = (n >= self.k) | (n == 0)
        return [jnp.where(ok, x, jnp.nan) for x in merged]


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


def steps_weighted_mean(power: float = 1.0) -> StepsWeightedMean:
    """Each sender weighted by `steps ** power` (1: Decoupled DiLoCo's tokens² /
    steps with equal batches, the token-weighted mean)."""
    return StepsWeightedMean(power)


def radial_directional(
    power: float = 0.0,
    *,
    plain_shapes: Sequence[Sequence[int]] = (),
    scope: str = "piece",
) -> RadialDirectional:
    """Decoupled DiLoCo's radial-directional average (the weighted mean norm times
    the unit weighted-mean direction), the pieces shaped as in `plain_shapes` by the
    weighted mean."""
    return RadialDirectional(power, _as_shapes(plain_shapes), scope)


def quorum(k: int, inner: Callable[..., list[Array]] = Mean()) -> Quorum:
    """`inner`'s result where at least `k` replicas sent, else a failed round (no
    outer step, as when nobody sends; use with `nonfinite="skip"`)."""
    return Quorum(k, inner)


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
            "clipped_mean(...), token_weighted_mean(), steps_weighted_mean(...), "
            "radial_directional(...), quorum(...) or a function "
            "(rows, sent, steps) -> list of arrays."
        )


# ----------------------------------------------------------------------------- helpers


def _flat(x: Array) -> Array:
    return x.reshape(x.shape[0], -1)


def _scaled(rows: list[Array], factor: Array) -> list[Array]:
    """Each replica's row times its `[M]` factor."""
    return [
        r * factor.astype(r.dtype).reshape((-1,) + (1,) * (r.ndim - 1)) for r in rows
    ]


def _weight_factors(sent: Array, w: Array) -> Array:
    """`[M]` factors `n·w_m / Σw` over the n senders (`w` 0 for the others; all 1
    where Σw = 0): scaling the rows by them makes the mean over the senders the
    weighted mean, and equal weights scale by exactly 1."""
    total = jnp.sum(w)
    n = jnp.sum(sent).astype(jnp.float32)
    # positive weights here are >= 1 (steps ** power, steps >= 1), so the maximum
    # only guards the division where Σw = 0
    return jnp.where(total > 0, n * w / jnp.maximum(total, 1.0), 1.0)


def _step_weights(sent: Array, steps: Array | None, power: float) -> Array:
    """`[M]` float32 weights `steps ** power` of the senders (0 for the others);
    1 for every sender where `power` is 0 or the steps are unknown."""
    if steps is None or power == 0:
        return sent.astype(jnp.float32)
    s = steps.astype(jnp.float32)
    # an integral power as repeated products (`** 1` is `s` exactly)
    w = s ** int(power) if float(power).is_integer() else s**power
    return jnp.where(sent, w, 0.0)


def _radial(rows: list[Array], sent: Array, factor: Array) -> list[Array]:
    """`r̄ · d̄ / ‖d̄‖` (`RadialDirectional`) with one norm over `rows`' pieces,
    weighted by `factor` (`_weight_factors`)."""
    norms = jnp.sqrt(sum(jnp.sum(_flat(r) ** 2, axis=1) for r in rows))
    units = _scaled(rows, 1 / jnp.where(norms > 0, norms, 1))
    (radius,) = Mean()(_scaled([norms], factor), sent, None)
    direction = Mean()(_scaled(units, factor), sent, None)
    length = jnp.sqrt(sum(jnp.sum(d**2) for d in direction))
    scale = radius / jnp.where(length > 0, length, 1)
    return [d * scale.astype(d.dtype) for d in direction]


def _check_power(name: str, power: float) -> None:
    """Raises ValueError naming `power` unless it is a finite number >= 0."""
    if (
        isinstance(power, bool)
        or not isinstance(power, int | float)
        or not (math.isfinite(power) and power >= 0)
    ):
        raise ValueError(f"{name} power={power!r}; allowed: a finite number >= 0.")


def _is_shape(shape: object) -> bool:
    """Whether `shape` is a tuple of ints >= 0."""
    return isinstance(shape, tuple) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    )


def _as_shapes(shapes: Any) -> Any:
    """`shapes` as a tuple of tuples of ints where it is a sequence of sequences of
    integers (else as given, for `RadialDirectional`'s check to name)."""
    try:
        return tuple(tuple(operator.index(d) for d in s) for s in shapes)
    except TypeError:
        return shapes


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
