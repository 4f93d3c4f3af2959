"""Outer-gradient compressors: low-precision quantizers and value-dropping baselines.

Streaming DiLoCo (Douillard et al., 2025, §2.4 and Alg. 2 l.8) compresses each
replica's outer gradient Δ_{m,p} before the exchange and accumulates the received
values in float32 ("up to a float with 4 bits ... called E3M0"). Its Fig. 11 compares
lower precision (FP32, BF16, FP8, FP4) against setting values to zero (FedDropout,
DARE, Top-K). Every compressor here is an `eqx.Module` with static configuration that
acts on **one tensor**:

* `compressor(x, key)` is the round trip, i.e. what the receivers reconstruct. It has
  the shape and dtype of `x` and is computed in float32, or in `x`'s dtype when that is
  wider.
* `compressor.bits(shape)` is the exact number of bits one sender puts on the wire for
  a tensor of that shape: the payload plus the metadata.

Callers vmap over replicas and over stacked layers themselves. Everything is jittable
and vmappable, and a configuration that needs randomness raises `ValueError` at trace
time when it is given no key.

The paper does not say how E3M0 was scaled or rounded (PAPER.md §1.8, §7.7). Our
choices follow SPEC §2:

1. Scaling: each group (the whole tensor, a row, or a block of `block_size` elements)
   sends its max |x| ("amax") as float32 metadata. The group is normalised by
   `M / amax` so that amax lands on the format's largest value M.
2. Rounding: either nearest, with ties going to the neighbour whose magnitude code is
   even (IEEE round-half-to-even on the magnitude bit pattern for e2m1 / e4m3 / e5m2,
   and the same rule on the exponent code for e3m0 and on the integer for int4), or
   stochastic and unbiased.
3. E3M0 follows the eXmY convention (Agrawal et al., 2024): bias 3, exponent code 0 is
   zero, and the magnitudes are 2^-2 … 2^4. It has no inf or NaN.
"""

import abc
import functools as ft
import math
from fractions import Fraction
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray


FORMATS: tuple[str, ...] = (
    "e3m0",
    "e2m1",
    "e1m2",
    "int4",
    "e4m3",
    "e5m2",
    "bf16",
    "fp32",
)
"""Supported formats. All but `bf16` and `fp32` are scaled (amax metadata per group)."""

GRANULARITIES: tuple[str, ...] = ("tensor", "row", "block")
"""Scaling groups: the whole tensor, each slice along the last axis, or flat blocks."""

ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
"""Rounding modes onto the format's value set."""

_BITS_PER_ELEMENT = {
    "e3m0": 4,
    "e2m1": 4,
    "e1m2": 4,
    "int4": 4,
    "e4m3": 8,
    "e5m2": 8,
    "bf16": 16,
    "fp32": 32,
}
_CAST_FORMATS = {"bf16": 7, "fp32": 23}  # plain casts: format -> mantissa bits
_SCALE_BITS = 32  # one float32 amax per group
_SEED_BITS = 64  # a PRNG seed from which receivers regenerate a random mask
_VALUE_BITS = 32  # one float32 value kept by a value-dropping compressor


class Quantized(NamedTuple):
    """What a sender puts on the wire for one tensor."""

    codes: Array  # [*shape] uint8 index into values(); bf16 / fp32 for those formats
    scale: Array  # [num_groups] float32 amax per group; [0] for bf16 / fp32


class Compressor(eqx.Module):
    """Abstract outer-gradient compressor acting on one tensor (Alg. 2 l.8)."""

    needs_key: eqx.AbstractVar[bool]

    @abc.abstractmethod
    def __call__(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """Compress and decompress `x`: the value the receivers reconstruct.

        Args:
            x: One tensor (one replica's outer gradient of one leaf or one layer).
            key: PRNG key. Required when `needs_key` is true, otherwise ignored.

        Returns:
            The reconstruction, with the same shape and dtype as `x`.
        """

    @abc.abstractmethod
    def bits(self, shape: tuple[int, ...]) -> int:
        """Exact bits one sender puts on the wire for one tensor of this shape."""


class Quantizer(Compressor):
    """Low-precision quantizer with per-group max scaling (Streaming DiLoCo §2.4).

    A scaled format (any format of at most 8 bits) splits the tensor into groups. It
    sends each group's amax = max |x| as float32 metadata, plus one code per element:
    the normalised value `x * (M / amax)` rounded onto the format's sorted signed value
    table. M is the largest value of the format. The receiver reconstructs
    `(values[codes] / M) * amax`, in that order, so the group's largest element comes
    back exactly and quantize ∘ dequantize ∘ quantize = quantize. A group whose amax is
    zero stays exactly zero. A non-finite amax makes the whole group non-finite, so the
    caller can detect it. `bf16` and `fp32` are plain casts with no metadata.

    Attributes:
        format: One of `FORMATS`.
        granularity: `"tensor"` (one group), `"row"` (slices along the last axis; a 0-d
            or 1-d tensor is one group) or `"block"` (the flattened tensor in groups of
            `block_size` consecutive elements, where the last group may be partial).
            Ignored by `bf16` and `fp32`.
        block_size: Elements per group for `"block"` granularity.
        rounding: `"nearest"` (ties to even magnitude code) or `"stochastic"` (unbiased,
            needs a key).
    """

    format: str = eqx.field(default="e3m0", static=True)
    granularity: str = eqx.field(default="tensor", static=True)
    block_size: int = eqx.field(default=32, static=True)
    rounding: str = eqx.field(default="nearest", static=True)

    def __check_init__(self):
        _check_choice("format", self.format, FORMATS)
        _check_choice("granularity", self.granularity, GRANULARITIES)
        _check_choice("rounding", self.rounding, ROUNDINGS)
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size < 1
        ):
            raise ValueError(
                f"Quantizer block_size={self.block_size!r} is not allowed; expected an "
                "integer >= 1."
            )

    @property
    def needs_key(self) -> bool:
        """Whether a PRNG key is required (stochastic rounding)."""
        return self.rounding == "stochastic"

    @property
    def bits_per_element(self) -> int:
        """Payload bits per element (4, 8, 16 or 32)."""
        return _BITS_PER_ELEMENT[self.format]

    @property
    def scaled(self) -> bool:
        """Whether the format sends one float32 amax per group."""
        return self.format not in _CAST_FORMATS

    def num_groups(self, shape: tuple[int, ...]) -> int:
        """Number of scaling groups (metadata entries) for a tensor of this shape."""
        return _group_layout(self, tuple(shape))[0] if self.scaled else 0

    def bits(self, shape: tuple[int, ...]) -> int:
        """Exact bits on the wire: numel x bits/element + groups x 32 (float32 amax).

        Padding of a partial last block is not counted. `bf16` costs 16 bits per element
        and `fp32` costs 32, with no metadata.
        """
        shape = tuple(shape)
        return math.prod(shape) * self.bits_per_element + _SCALE_BITS * self.num_groups(
            shape
        )

    def values(self) -> np.ndarray:
        """The format's finite value set: sorted, signed, containing 0 once.

        `fp32` has too many values to list and raises `ValueError`.
        """
        if self.format == "fp32":
            raise ValueError(
                "Quantizer format='fp32' has no enumerable value table; values() is "
                f"available for {FORMATS[:-1]}."
            )
        if self.format == "bf16":
            return _finite_values(jnp.bfloat16, np.uint16).copy()
        return _signed_table(self.format).copy()

    def __call__(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """Round trip `dequantize(quantize(x, key), x.shape, x.dtype)` (Alg. 2 l.8)."""
        return self.dequantize(self.quantize(x, key), x.shape, x.dtype)

    def quantize(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Quantized:
        """Encode one tensor: codes per element and float32 amax per group.

        Args:
            x: Tensor to send.
            key: PRNG key, required for stochastic rounding.

        Returns:
            `Quantized(codes, scale)`.
        """
        key = _check_key(self, key)
        cdtype = _compute_dtype(x.dtype)
        xc = x.astype(cdtype)
        if not self.scaled:
            return Quantized(_cast(xc, self.format, key), jnp.zeros((0,), jnp.float32))
        mags = _magnitudes(self.format)
        top = float(mags[-1])
        num_groups, group_size, numel = _group_layout(self, x.shape)
        groups = _to_groups(xc.reshape(-1), num_groups, group_size)
        scale = jnp.max(jnp.abs(groups), axis=1, initial=0.0).astype(jnp.float32)
        amax = scale.astype(cdtype)
        # An all-zero group stays zero (its codes are 0 whatever the normaliser). A
        # non-finite amax decodes every element of its group to inf or NaN.
        ok = jnp.isfinite(amax) & (amax > 0)
        safe = jnp.where(ok, amax, jnp.ones_like(amax))[:, None]
        inv = top / safe
        # M / amax overflows for a tiny amax (below M / max float): divide instead.
        v = jnp.where(jnp.isfinite(inv), groups * inv, (groups / safe) * top)
        a = jnp.minimum(jnp.abs(v), top)
        if self.rounding == "nearest":
            mag_code = _round_nearest(a, mags)
        else:
            u = jr.uniform(key, a.shape, cdtype)
            mag_code = _round_stochastic(a, mags, u)
        signed = jnp.where(v < 0, -mag_code, mag_code) + (len(mags) - 1)
        codes = signed.astype(jnp.uint8).reshape(-1)[:numel].reshape(x.shape)
        return Quantized(codes, scale)

    def dequantize(
        self, q: Quantized, shape: tuple[int, ...], dtype: DTypeLike
    ) -> Float[Array, "..."]:
        """Decode what `quantize` produced: `(values[codes] / M) * amax` per group.

        Args:
            q: Codes and scales of one tensor.
            shape: The tensor's shape.
            dtype: The dtype to return. The computation runs in float32, or in `dtype`
                when that is wider.

        Returns:
            The reconstructed tensor.
        """
        shape = tuple(shape)
        if not self.scaled:
            return q.codes.reshape(shape).astype(dtype)
        cdtype = _compute_dtype(dtype)
        # values / M, rounded once to cdtype: the same numbers as dividing in cdtype,
        # as a table, which XLA cannot rewrite into a multiplication by a rounded 1/M.
        table = _signed_table(self.format)
        table = jnp.asarray(table / table[-1], cdtype)
        num_groups, group_size, numel = _group_layout(self, shape)
        t = table[q.codes.reshape(-1).astype(jnp.int32)]
        groups = _to_groups(t, num_groups, group_size)
        y = groups * q.scale.astype(cdtype)[:, None]
        return y.reshape(-1)[:numel].reshape(shape).astype(dtype)


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
        return _kept(self.rate, math.prod(tuple(shape))) * _VALUE_BITS + _SEED_BITS

    def _factor(self, n: int, k: int) -> float:
        """What the kept values are multiplied by."""
        return 1.0

    def __call__(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """Zero all but a random subset of `k` entries, rescaled by `_factor(n, k)`."""
        key = _check_key(self, key)
        n = x.size
        if n == 0:
            return x
        k = _kept(self.rate, n)
        keep = _random_subset(key, n, k).reshape(x.shape)
        factor = self._factor(n, k)
        if factor == 1.0:
            out = jnp.where(keep, x, jnp.zeros_like(x))
        else:
            xc = x.astype(_compute_dtype(x.dtype))
            out = jnp.where(keep, xc * factor, jnp.zeros_like(xc)).astype(x.dtype)
        return _pass_nonfinite(x, out)


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
        return self.num_kept(n) * (_VALUE_BITS + (n - 1).bit_length()) if n else 0

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


def quantizer(
    format: str = "e3m0",
    *,
    granularity: str = "tensor",
    block_size: int = 32,
    rounding: str = "nearest",
) -> Quantizer:
    """Build the outer-gradient quantizer of Streaming DiLoCo §2.4 (default: E3M0).

    Args:
        format: One of `FORMATS`: `"e3m0"` (the paper's FP4, values ±{0, 1/4, …, 16}),
            `"e2m1"`, `"e1m2"`, `"int4"` (±{0..7}), `"e4m3"` (max 448), `"e5m2"` (max
            57344), `"bf16"` or `"fp32"` (plain casts).
        granularity: `"tensor"`, `"row"` or `"block"` scaling groups.
        block_size: Elements per group for `"block"` granularity.
        rounding: `"nearest"` (ties to even magnitude code) or `"stochastic"`.

    Returns:
        A `Quantizer`. Call it as `q(x, key)` for the round trip, and use
        `q.bits(shape)` for the wire cost.

    Raises:
        ValueError: On an unknown format, granularity or rounding, or block_size < 1.

    Examples:
        >>> import jax.numpy as jnp
        >>> q = quantizer("e3m0")
        >>> q(jnp.array([16.0, 5.0, -0.1, 0.0])).tolist()
        [16.0, 4.0, 0.0, 0.0]
        >>> q.bits((4,))
        48
    """
    return Quantizer(format, granularity, block_size, rounding)


def fed_dropout(rate: float) -> Compressor:
    """FedDropout baseline of Streaming DiLoCo Fig. 11 (Wen et al., 2022).

    Args:
        rate: Fraction of entries zeroed, in [0, 1).

    Returns:
        A `FedDropout` compressor (needs a key).
    """
    return FedDropout(rate)


def dare(rate: float) -> Compressor:
    """DARE baseline of Streaming DiLoCo Fig. 11 (Yu et al., 2024).

    Args:
        rate: Fraction of entries dropped, in [0, 1). The kept ones are rescaled.

    Returns:
        A `Dare` compressor (needs a key).
    """
    return Dare(rate)


def top_k(fraction: float) -> Compressor:
    """Top-K baseline of Streaming DiLoCo Fig. 11.

    Args:
        fraction: Fraction of entries kept (largest |x| per tensor), in (0, 1].

    Returns:
        A `TopK` compressor.
    """
    return TopK(fraction)


# ----------------------------------------------------------------------------- helpers


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"Quantizer {field}={value!r} is not supported; expected one of {allowed}."
        )


def _check_rate(name: str, rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(
            f"{name} rate={rate!r} is not allowed; expected 0 <= rate < 1."
        )


def _check_key(compressor: Compressor, key: PRNGKeyArray | None) -> PRNGKeyArray | None:
    """Raise at trace time when a key-needing configuration gets no key."""
    if compressor.needs_key and key is None:
        raise ValueError(
            f"{type(compressor).__name__} needs a PRNG key (key=None given); pass "
            "key=jax.random.key(...)."
        )
    return key if compressor.needs_key else None


def _compute_dtype(dtype: DTypeLike) -> np.dtype:
    """float32, or `dtype` itself when it is a wider float."""
    dtype = np.dtype(dtype)
    return dtype if jnp.finfo(dtype).bits > 32 else np.dtype(jnp.float32)


def _kept(rate: float, n: int) -> int:
    """ceil((1 - rate) * n), exact for the decimal `rate` as written."""
    return math.ceil((1 - _decimal(rate)) * n)


def _decimal(value: float) -> Fraction:
    """The shortest decimal that round-trips to `value`, as an exact fraction.

    `ceil(0.1 * 1000)` must be 100, and neither float arithmetic (0.7 * 10 is 7.000…1)
    nor the float's exact binary value (0.1 is 0.1000…0555) give that.
    """
    return Fraction(repr(float(value)))


def _random_subset(key: PRNGKeyArray, n: int, k: int) -> Array:
    """A boolean [n] mask with exactly k uniformly chosen True entries."""
    return jr.permutation(key, n) < k


def _pass_nonfinite(x: Array, out: Array) -> Array:
    """Keep non-finite inputs visible even where they would be dropped."""
    return jnp.where(jnp.isfinite(x), out, x)


def _group_layout(q: Quantizer, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(num_groups, group_size, numel); groups are padded to group_size."""
    numel = math.prod(shape)
    if q.granularity == "row" and len(shape) >= 2:
        return math.prod(shape[:-1]), shape[-1], numel
    if q.granularity == "block":
        return -(-numel // q.block_size), q.block_size, numel
    return 1, numel, numel


def _to_groups(flat: Array, num_groups: int, group_size: int) -> Array:
    pad = num_groups * group_size - flat.shape[0]
    if pad:
        flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
    return flat.reshape(num_groups, group_size)


@ft.cache
def _magnitudes(format: str) -> np.ndarray:
    """Sorted non-negative values of a scaled format, as float64 (read-only)."""
    if format == "int4":
        mags = np.arange(8, dtype=np.float64)
    elif format in ("e3m0", "e2m1", "e1m2"):
        exp_bits, man_bits = int(format[1]), int(format[3])
        bias = {"e3m0": 3, "e2m1": 1, "e1m2": 1}[format]
        mags = np.array(
            [
                _exmy(e, m, man_bits, bias)
                for e in range(2**exp_bits)
                for m in range(2**man_bits)
            ]
        )
        mags = np.unique(mags)
    else:
        dtype = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[format]
        mags = _finite_values(dtype, np.uint8)
        mags = mags[mags >= 0]
    mags.flags.writeable = False
    return mags


def _exmy(e: int, m: int, man_bits: int, bias: int) -> float:
    """Value of exponent code e and mantissa code m in eXmY (code 0 is subnormal)."""
    if e == 0:
        return (m / 2**man_bits) * 2.0 ** (1 - bias)
    return (1 + m / 2**man_bits) * 2.0 ** (e - bias)


@ft.cache
def _finite_values(dtype: type, uint: type) -> np.ndarray:
    """All finite values of a small float dtype, sorted and unique (±0 merged)."""
    n = 2 ** (8 * np.dtype(uint).itemsize)
    with np.errstate(invalid="ignore"):  # NaN bit patterns
        values = np.arange(n, dtype=uint).view(dtype).astype(np.float64)
    values = np.unique(values[np.isfinite(values)])
    values.flags.writeable = False
    return values


@ft.cache
def _signed_table(format: str) -> np.ndarray:
    """Sorted signed values; magnitude index i with sign s has code n - 1 + s * i."""
    mags = _magnitudes(format)
    table = np.concatenate([-mags[:0:-1], mags])
    table.flags.writeable = False
    return table


def _search_method(table: Array) -> str:
    """`compare_all` is 3-4x faster than the default gather loop on XLA:CPU for the
    4-bit tables (<= 8 entries) but ~10x slower for FP8's ~127 (benchmarks/README.md)."""
    return "compare_all" if table.shape[0] <= 16 else "scan"


def _round_nearest(a: Array, mags: np.ndarray) -> Array:
    """Index of the nearest magnitude; exact ties go to the even index.

    Every midpoint of these tables is exactly representable in float32, so comparing `a`
    against the midpoints is exact, and no subtraction rounds.
    """
    mids = jnp.asarray((mags[1:] + mags[:-1]) / 2, a.dtype)
    below = jnp.searchsorted(mids, a, side="left", method=_search_method(mids))
    below = below.astype(jnp.int32)  # number of midpoints < a
    at = jnp.take(mids, jnp.minimum(below, len(mids) - 1))
    tie = (below < len(mids)) & (at == a)
    return jnp.where(tie & (below % 2 == 1), below + 1, below)


def _round_stochastic(a: Array, mags: np.ndarray, u: Array) -> Array:
    """Lower or upper neighbour, with P(upper) = (a - lo) / (hi - lo): E[value] = a."""
    table = jnp.asarray(mags, a.dtype)
    lo = jnp.searchsorted(table, a, side="right", method=_search_method(table))
    lo = lo.astype(jnp.int32) - 1
    lo = jnp.clip(lo, 0, len(mags) - 2)
    lo_v, hi_v = jnp.take(table, lo), jnp.take(table, lo + 1)
    p_up = (a - lo_v) / (hi_v - lo_v)
    return lo + (u < p_up).astype(jnp.int32)


def _cast(x: Array, format: str, key: PRNGKeyArray | None) -> Array:
    """bf16 / fp32 cast: nearest-even, or stochastic when a key is given."""
    target = jnp.bfloat16 if format == "bf16" else jnp.float32
    if key is None:
        return x.astype(target)
    return _stochastic_truncate(x, key, _CAST_FORMATS[format]).astype(target)


def _stochastic_truncate(x: Array, key: PRNGKeyArray, mantissa_bits: int) -> Array:
    """Stochastic rounding to `mantissa_bits`: add random low bits, then truncate.

    Adding a uniform random integer below 2^d to the bit pattern and clearing the low d
    bits rounds the magnitude up with probability (dropped part) / 2^d. The result is
    unbiased, including for subnormals, and inf / NaN stay non-finite.
    """
    info = jnp.finfo(x.dtype)
    drop = int(info.nmant) - mantissa_bits
    if drop <= 0:
        return x
    uint = {32: jnp.uint32, 64: jnp.uint64}[info.bits]
    pattern = jax.lax.bitcast_convert_type(x, uint)
    noise = jr.bits(key, x.shape, uint) >> np.array(info.bits - drop, uint)
    mask = np.array((2**info.bits - 1) ^ (2**drop - 1), uint)
    return jax.lax.bitcast_convert_type((pattern + noise) & mask, x.dtype)
