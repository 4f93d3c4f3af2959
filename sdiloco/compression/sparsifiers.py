"""Value-dropping baselines of Streaming DiLoCo Fig. 11: FedDropout, DARE, Top-K.

Where a quantizer lowers the precision of every value, these send a subset of the
values at full precision and zero the rest. `bits` counts an ideal sparse wire: the
kept values as float32 plus either a 64-bit seed (random subsets, which receivers
regenerate) or an index per kept value (Top-K). Non-finite inputs stay visible in the
output even where they would be dropped, so callers can detect them.
"""

import math
from fractions import Fraction
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .base import SEED_BITS, VALUE_BITS, Compressor, check_key, compute_dtype


class _RandomSubset(Compressor):
    """Keep a uniform random subset of `k = ceil((1 - rate) * n)` entries, zero the rest.

    Receivers regenerate the subset from a 64-bit seed, so the wire carries the k kept
    values as float32 plus the seed. Subclasses choose the factor of the kept values.
    """

    rate: eqx.AbstractVar[float]

    def __check_init__(self):
        _check_rate(type(self).__name__, self.rate)

    @property
    def needs_key(self) -> bool:
        """Always true: the kept subset is random."""
        return True

    def bits(self, shape: tuple[int, ...]) -> int:
        """Kept values x 32 + a 64-bit seed."""
        return _kept(self.rate, math.prod(tuple(shape))) * VALUE_BITS + SEED_BITS

    def _factor(self, n: int, k: int) -> float:
        """What the kept values are multiplied by."""
        return 1.0

    def __call__(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """Zero all but a random subset of `k` entries, rescaled by `_factor(n, k)`."""
        key = check_key(self, key)
        n = x.size
        if n == 0:
            return x
        k = _kept(self.rate, n)
        assert key is not None  # check_key raised on a missing key
        keep = _random_subset(key, n, k).reshape(x.shape)
        factor = self._factor(n, k)
        if factor == 1.0:
            out = jnp.where(keep, x, jnp.zeros_like(x))
        else:
            xc = x.astype(compute_dtype(x.dtype))
            out = jnp.where(keep, xc * factor, jnp.zeros_like(xc)).astype(x.dtype)
        return _pass_nonfinite(x, out)

    def encode(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> dict[str, Array]:
        """The kept values (rescaled; NaN when any input is not finite) and the
        64-bit seed the receivers regenerate the subset from."""
        key = check_key(self, key)
        assert key is not None  # check_key raised on a missing key
        seed = (
            jr.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        )
        n, k = x.size, _kept(self.rate, x.size)
        index = _subset_index(seed, n, k)
        xc = x.reshape(-1).astype(compute_dtype(x.dtype))
        factor = self._factor(n, k) if n else 1.0
        values = xc[index] if factor == 1.0 else xc[index] * factor
        return {"values": poison(x, values), "seed": seed.astype(jnp.uint32)}

    def decode(
        self, message: dict[str, Array], shape: tuple[int, ...], dtype: Any
    ) -> Float[Array, "*shape"]:
        """The kept values at the positions the seed regenerates, zeros elsewhere."""
        n = math.prod(tuple(shape))
        index = _subset_index(message["seed"], n, message["values"].shape[0])
        out = jnp.zeros((n,), message["values"].dtype).at[index].set(message["values"])
        return out.reshape(shape).astype(dtype)

    def widths(self, shape: tuple[int, ...]) -> dict[str, int]:
        """Values at 32 bits, the seed as two 32-bit words."""
        del shape
        return {"values": VALUE_BITS, "seed": SEED_BITS // 2}


class FedDropout(_RandomSubset):
    """FedDropout (Wen et al., 2022): send a random subset, zero the rest, no rescale.

    Exactly `k = ceil((1 - rate) * n)` entries are kept: a uniform random subset drawn
    from `key`. Receivers regenerate the subset from the 64-bit seed, so the wire
    carries k float32 values plus the seed (Streaming DiLoCo Fig. 11).

    Attributes:
        rate: Fraction of entries dropped, in [0, 1).
    """

    rate: float = eqx.field(static=True)


class Dare(_RandomSubset):
    """DARE (Yu et al., 2024): drop a random subset and rescale the kept values.

    Exactly `k = ceil((1 - rate) * n)` entries are kept (a uniform random subset drawn
    from `key`) and multiplied by `n / k`. This factor equals `1 / (1 - rate)` whenever
    `(1 - rate) * n` is an integer. With it, E[output] = x exactly.

    Attributes:
        rate: Fraction of entries dropped, in [0, 1).
    """

    # This differs from the DARE paper in:
    # 1. The kept set has a fixed size (as in FedDropout), so `bits` is exact, not an
    #    expectation, and the rescale factor is n / k instead of 1 / (1 - rate).

    rate: float = eqx.field(static=True)

    def _factor(self, n: int, k: int) -> float:
        """`n / k`: unbiased for a fixed-size uniform subset."""
        return n / k


class TopK(Compressor):
    """Top-K: keep the `k = ceil(fraction * n)` entries of largest |x|, zero the rest.

    The wire carries each kept value as float32 plus its index (ceil(log2 n) bits).
    Ties are broken towards lower flat indices, so exactly k entries are kept.

    Attributes:
        fraction: Fraction of entries kept, in (0, 1].
    """

    fraction: float = eqx.field(static=True)

    def __check_init__(self):
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(
                f"TopK fraction={self.fraction!r} is not allowed; expected "
                "0 < fraction <= 1."
            )

    @property
    def needs_key(self) -> bool:
        """Always false: the selection is deterministic."""
        return False

    def num_kept(self, n: int) -> int:
        """k = ceil(fraction * n), exact for the decimal `fraction` as written."""
        return math.ceil(_decimal(self.fraction) * n)

    def bits(self, shape: tuple[int, ...]) -> int:
        """k x (32 + ceil(log2 n)) bits: a float32 value and an index per kept entry."""
        n = math.prod(tuple(shape))
        return self.num_kept(n) * (VALUE_BITS + (n - 1).bit_length()) if n else 0

    def __call__(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """Zero all entries except the k largest in magnitude."""
        del key
        n = x.size
        if n == 0:
            return x
        _, idx = jax.lax.top_k(jnp.abs(x.reshape(-1)), self.num_kept(n))
        keep = jnp.zeros((n,), jnp.bool_).at[idx].set(True).reshape(x.shape)
        return _pass_nonfinite(x, jnp.where(keep, x, jnp.zeros_like(x)))

    def encode(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> dict[str, Array]:
        """The kept values (non-finite when any input is) and their flat indices."""
        del key
        values, index = top_k_rows(x.reshape(1, -1), self.num_kept(x.size))
        return {"values": poison(x, values[0]), "index": index[0]}

    def decode(
        self, message: dict[str, Array], shape: tuple[int, ...], dtype: Any
    ) -> Float[Array, "*shape"]:
        """The kept values scattered into zeros."""
        n = math.prod(tuple(shape))
        rows = scatter_rows(message["values"][None], message["index"][None], n)
        return rows.reshape(shape).astype(dtype)

    def widths(self, shape: tuple[int, ...]) -> dict[str, int]:
        """Values at 32 bits, indices at ceil(log2 n) bits."""
        return {"values": VALUE_BITS, "index": index_bits(math.prod(tuple(shape)))}


def fed_dropout(rate: float) -> Compressor:
    """FedDropout baseline of Streaming DiLoCo Fig. 11 (Wen et al., 2022).

    Args:
        rate: Fraction of entries zeroed, in [0, 1).

    Returns:
        A `FedDropout` compressor (needs a key).
    """
    return FedDropout(rate=rate)


def dare(rate: float) -> Compressor:
    """DARE baseline of Streaming DiLoCo Fig. 11 (Yu et al., 2024).

    Args:
        rate: Fraction of entries dropped, in [0, 1). The kept ones are rescaled.

    Returns:
        A `Dare` compressor (needs a key).
    """
    return Dare(rate=rate)


def top_k(fraction: float) -> Compressor:
    """Top-K baseline of Streaming DiLoCo Fig. 11.

    Args:
        fraction: Fraction of entries kept (largest |x| per tensor), in (0, 1].

    Returns:
        A `TopK` compressor.
    """
    return TopK(fraction=fraction)


# ----------------------------------------------------------------------------- helpers


def _check_rate(name: str, rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(
            f"{name} rate={rate!r} is not allowed; expected 0 <= rate < 1."
        )


def _kept(rate: float, n: int) -> int:
    """ceil((1 - rate) * n), exact for the decimal `rate` as written."""
    return math.ceil((1 - _decimal(rate)) * n)


def _decimal(value: float) -> Fraction:
    """The shortest decimal that round-trips to `value`, as an exact fraction.

    `ceil(0.1 * 1000)` must be 100, and neither float arithmetic (0.7 * 10 is 7.000…1)
    nor the float's exact binary value (0.1 is 0.1000…0555) give that.
    """
    return Fraction(repr(float(value)))


def _subset_index(key: PRNGKeyArray, n: int, k: int) -> Array:
    """The positions of `_random_subset(key, n, k)`, in increasing order."""
    return jnp.nonzero(_random_subset(key, n, k), size=k)[0]


def _random_subset(key: PRNGKeyArray, n: int, k: int) -> Array:
    """A boolean [n] mask with exactly k uniformly chosen True entries."""
    return jr.permutation(key, n) < k


def top_k_rows(rows: Array, k: int) -> tuple[Array, Array]:
    """The `k` entries of largest |x| of each row `[r, n]` and their column indices
    (`uint32`), ties to the lower index."""
    _, index = jax.lax.top_k(jnp.abs(rows), k)
    return jnp.take_along_axis(rows, index, axis=1), index.astype(jnp.uint32)


def scatter_rows(values: Array, index: Array, n: int) -> Array:
    """Rows `[r, n]` of zeros with `values` `[r, k]` at their column `index`."""
    rows = jnp.arange(values.shape[0])[:, None]
    out = jnp.zeros((values.shape[0], n), values.dtype)
    return out.at[rows, index.astype(jnp.int32)].set(values)


def index_bits(n: int) -> int:
    """Bits of an index into `n` entries: ceil(log2 n) (0 for a single entry)."""
    return (n - 1).bit_length()


def poison(x: Array, values: Array) -> Array:
    """`values`, all NaN when `x` has a non-finite entry (dropped or not), so that a
    receiver of a sparse message still sees that the sender's input was not finite."""
    return jnp.where(jnp.all(jnp.isfinite(x)), values, jnp.full_like(values, jnp.nan))


def _pass_nonfinite(x: Array, out: Array) -> Array:
    """Keep non-finite inputs visible even where they would be dropped."""
    return jnp.where(jnp.isfinite(x), out, x)
