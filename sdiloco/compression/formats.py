"""Low-precision formats: their value tables and rounding onto them.

A scaled format (at most 8 bits) is a finite, sorted set of magnitudes; a code is the
signed index into `signed_table`. `bf16` and `fp32` are plain casts. This module
implements choices 2 (rounding) and 3 (the E3M0 value set) of those listed in
`sdiloco.compression.quantizers`, which adds the per-group scaling. Everything here is
static NumPy except the rounding functions, which trace.

`Quantizer` looks these functions up on this module at trace time (`formats.name`), so
a benchmark can swap one in for the duration of a trace.
"""

import functools as ft

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, PRNGKeyArray


FORMATS: tuple[str, ...] = (
    "e3m0",
    "e2m1",
    "e1m2",
    "int4",
    "int2",
    "int8",
    "e4m3",
    "e5m2",
    "bf16",
    "fp32",
)
"""Supported formats. All but `bf16` and `fp32` are scaled (amax metadata per group)."""

ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
"""Rounding modes onto the format's value set."""

BITS_PER_ELEMENT = {
    "e3m0": 4,
    "e2m1": 4,
    "e1m2": 4,
    "int4": 4,
    "int2": 2,
    "int8": 8,
    "e4m3": 8,
    "e5m2": 8,
    "bf16": 16,
    "fp32": 32,
}
"""Payload bits per element of each format."""

INT_LEVELS = {"int2": 2, "int4": 8, "int8": 128}
"""The symmetric integer formats -> their number of magnitudes (2-bit is ternary,
±{0, 1}, the one symmetric grid with a zero in two bits)."""

CAST_FORMATS = {"bf16": 7, "fp32": 23}
"""The plain casts (no scaling, no metadata): format -> mantissa bits."""


@ft.cache
def magnitudes(format: str) -> np.ndarray:
    """Sorted non-negative values of a scaled format, as float64 (read-only)."""
    if format in INT_LEVELS:  # symmetric integers: ±{0, 1, ..., 2^(b-1) - 1}
        mags = np.arange(INT_LEVELS[format], dtype=np.float64)
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
        mags = finite_values(dtype, np.uint8)
        mags = mags[mags >= 0]
    mags.flags.writeable = False
    return mags


@ft.cache
def finite_values(dtype: type, uint: type) -> np.ndarray:
    """All finite values of a small float dtype, sorted and unique (±0 merged)."""
    n = 2 ** (8 * np.dtype(uint).itemsize)
    with np.errstate(invalid="ignore"):  # NaN bit patterns
        values = np.arange(n, dtype=uint).view(dtype).astype(np.float64)
    values = np.unique(values[np.isfinite(values)])
    values.flags.writeable = False
    return values


@ft.cache
def signed_table(format: str) -> np.ndarray:
    """Sorted signed values; magnitude index i with sign s has code n - 1 + s * i."""
    mags = magnitudes(format)
    table = np.concatenate([-mags[:0:-1], mags])
    table.flags.writeable = False
    return table


def round_nearest(a: Array, mags: np.ndarray) -> Array:
    """Index of the nearest magnitude; exact ties go to the even index.

    Every midpoint of these tables is exactly representable in float32, so comparing `a`
    against the midpoints is exact, and no subtraction rounds. A table of zero and
    consecutive powers of two (E3M0) is rounded on the bit pattern instead
    (`_round_nearest_pow2`, the same indices, about 3x faster on XLA:CPU).

    Args:
        a: Magnitudes to round, in `[0, mags[-1]]` or NaN (NaN gives the top index).
        mags: Sorted magnitudes (`magnitudes(format)`).
    """
    if _powers_of_two(mags):
        return _round_nearest_pow2(a, mags)
    mids_np = (mags[1:] + mags[:-1]) / 2
    if len(mids_np) <= SMALL_TABLE:
        # Each midpoint is a scalar constant: one elementwise pass, and nothing of
        # the input's size that does not depend on the input (XLA hoists such a
        # broadcast out of the loop over due fragments, to run at every step).
        below = _count_below(a, mids_np, strict=True)
        tie = jnp.zeros(a.shape, bool)  # a exactly on an odd midpoint (below = k)
        for k in range(1, len(mids_np), 2):
            tie = tie | (a == np.asarray(mids_np[k], a.dtype))
        return below + tie.astype(jnp.int32)
    mids = jnp.asarray(mids_np, a.dtype)
    below = jnp.searchsorted(mids, a, side="left", method="scan")
    below = below.astype(jnp.int32)  # number of midpoints < a
    at = jnp.take(mids, jnp.minimum(below, len(mids) - 1))
    tie = (below < len(mids)) & (at == a)
    return jnp.where(tie & (below % 2 == 1), below + 1, below)


SMALL_TABLE = 16
"""Tables of at most this many entries are searched by one comparison per entry
against a scalar (the 4-bit formats); larger ones (FP8's ~127) by `searchsorted`."""


def _count_below(a: Array, table: np.ndarray, strict: bool) -> Array:
    """How many entries of the sorted `table` are `< a` (`strict`) or `<= a`, as
    `searchsorted(table, a, side="left" / "right")`; NaN counts every entry, like
    `searchsorted`, which sorts NaN last."""
    count = jnp.zeros(a.shape, jnp.int32)
    for t in table:
        t = np.asarray(t, a.dtype)
        count = count + jnp.logical_not(a <= t if strict else a < t).astype(jnp.int32)
    return count


def _powers_of_two(mags: np.ndarray) -> bool:
    """Whether `mags` is 0 followed by consecutive powers of two (at least two)."""
    if len(mags) < 3 or mags[0] != 0:
        return False
    exps = np.log2(mags[1:])
    return bool(np.all(exps == np.round(exps)) and np.all(np.diff(exps) == 1))


def _round_nearest_pow2(a: Array, mags: np.ndarray) -> Array:
    """`round_nearest` for `mags` = 0, 2^lo, ..., 2^hi, on the float's bit pattern.

    Between 2^e and 2^(e+1) the midpoint is 1.5 * 2^e: adding half the mantissa range
    to the bit pattern carries into the exponent exactly when the mantissa is at or
    above it, so the rounded exponent is read off the high bits. A mantissa exactly at
    the midpoint is a tie and goes to the even index; below 2^lo the choice is between
    0 and 2^lo, whose midpoint 2^(lo - 1) is compared directly.
    """
    info = jnp.finfo(a.dtype)
    uint = {32: jnp.uint32, 64: jnp.uint64}[info.bits]
    nmant, bias = int(info.nmant), int(info.maxexp) - 1
    lo = int(np.log2(mags[1]))
    pattern = jax.lax.bitcast_convert_type(a, uint)
    half = np.array(1 << (nmant - 1), uint)
    rounded = ((pattern + half) >> np.array(nmant, uint)).astype(jnp.int32)
    up = rounded - (bias + lo - 1)  # index of the rounded power of two
    tie = (pattern & np.array((1 << nmant) - 1, uint)) == half
    index = jnp.where(tie & (up % 2 == 1), up - 1, up)
    small = jnp.asarray(mags[1] / 2, a.dtype)
    index = jnp.where(a < mags[1], (a > small).astype(jnp.int32), index)
    return jnp.minimum(index, len(mags) - 1)


def round_stochastic(a: Array, mags: np.ndarray, u: Array) -> Array:
    """Lower or upper neighbour, with P(upper) = (a - lo) / (hi - lo): E[value] = a."""
    table = jnp.asarray(mags, a.dtype)
    if len(mags) <= SMALL_TABLE:
        lo = _count_below(a, mags, strict=False) - 1
    else:
        lo = jnp.searchsorted(table, a, side="right", method="scan")
        lo = lo.astype(jnp.int32) - 1
    lo = jnp.clip(lo, 0, len(mags) - 2)
    lo_v, hi_v = jnp.take(table, lo), jnp.take(table, lo + 1)
    p_up = (a - lo_v) / (hi_v - lo_v)
    return lo + (u < p_up).astype(jnp.int32)


def cast(x: Array, format: str, key: PRNGKeyArray | None) -> Array:
    """bf16 / fp32 cast: nearest-even, or stochastic when a key is given."""
    target = jnp.bfloat16 if format == "bf16" else jnp.float32
    if key is None:
        return x.astype(target)
    return _stochastic_truncate(x, key, CAST_FORMATS[format]).astype(target)


# ----------------------------------------------------------------------------- helpers


def _exmy(e: int, m: int, man_bits: int, bias: int) -> float:
    """Value of exponent code e and mantissa code m in eXmY (code 0 is subnormal)."""
    if e == 0:
        return (m / 2**man_bits) * 2.0 ** (1 - bias)
    return (1 + m / 2**man_bits) * 2.0 ** (e - bias)


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
