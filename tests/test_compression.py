"""Tests for sdiloco.compression: properties, references, bit costs, errors."""

import math

import equinox as eqx
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given

from sdiloco.compression import (
    FORMATS,
    GRANULARITIES,
    Compressor,
    Quantized,
    Quantizer,
    dare,
    fed_dropout,
    formats,
    quantizer,
    top_k,
)


SCALED = ("e3m0", "e2m1", "e1m2", "int4", "int2", "int8", "e4m3", "e5m2")
CASTS = ("bf16", "fp32")
BLOCK = 5
# 13 and 24 elements: with blocks of 5, both end in a partial block (3 and 4).
SHAPES = ((13,), (4, 6))
CONFIGS = [(f, g) for f in SCALED for g in GRANULARITIES] + [
    (f, "tensor") for f in CASTS
]
ML_DTYPES = {
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
}
EXPECTED_MAGNITUDES = {
    "e3m0": [0, 0.25, 0.5, 1, 2, 4, 8, 16],
    "e2m1": [0, 0.5, 1, 1.5, 2, 3, 4, 6],
    "e1m2": [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75],
    "int4": [0, 1, 2, 3, 4, 5, 6, 7],
    "int2": [0, 1],
}


@eqx.filter_jit
def _encode(q, x):
    qz = q.quantize(x)
    return qz, q.dequantize(qz, x.shape, x.dtype)


@eqx.filter_jit
def _encode_stochastic(q, x, key):
    qz = q.quantize(x, key)
    return qz, q.dequantize(qz, x.shape, x.dtype)


@eqx.filter_jit
def _apply(c, x, key=None):
    """Any compressor's round trip, compiled once per (compressor, shape, dtype)."""
    return c(x, key)


@eqx.filter_jit
def _apply_many(c, x, keys):
    """The round trip of one x under many keys."""
    return jax.vmap(c, in_axes=(None, 0))(x, keys)


@eqx.filter_jit
def _apply_all(cs, x, key):
    """Several compressors in one compiled program (one compilation, not many)."""
    return [c(x, key) for c in cs]


@eqx.filter_jit
def _encode_all(qs, x, key):
    out = []
    for q in qs:
        qz = q.quantize(x, key)
        out.append((qz, q.dequantize(qz, x.shape, x.dtype)))
    return out


def _rbg(seed):
    """A PRNG key of the "rbg" implementation.

    The compressors work with any key type. Threefry (the default) takes seconds to
    compile on CPU, so most tests use rbg keys; `test_jit_and_vmap_match_a_loop` uses
    the default implementation.
    """
    return jr.key(seed, impl="rbg")


def _normal(seed, shape, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def _q(fmt, gran, rounding="nearest"):
    return quantizer(fmt, granularity=gran, block_size=BLOCK, rounding=rounding)


def _group_ids(shape, gran, block=BLOCK):
    """Independent reference for the scaling groups: one group id per flat element."""
    n = math.prod(shape)
    if gran == "row" and len(shape) >= 2:
        return np.arange(n) // shape[-1]
    if gran == "block":
        return np.arange(n) // block
    return np.zeros(n, np.int64)


def _group_amax(x, gran):
    """Per-element amax of its group, in float64."""
    ids = _group_ids(x.shape, gran)
    amax = np.zeros(ids.max() + 1 if ids.size else 0)
    np.maximum.at(amax, ids, np.abs(x.reshape(-1)).astype(np.float64))
    return amax, amax[ids].reshape(x.shape)


def _max_half_spacing(fmt):
    mags = quantizer(fmt).values()
    return float(np.max(np.diff(mags))) / 2


def _bits_of(a):
    """Bit pattern of a float array, with -0.0 folded into +0.0."""
    a = np.asarray(a) + np.zeros((), np.asarray(a).dtype)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


_small = st.floats(-1e3, 1e3, width=32, allow_subnormal=False).map(
    lambda v: np.float32(0.0) if abs(v) < 1e-12 else np.float32(v)
)


@st.composite
def tensors(draw, shapes=SHAPES, elements=_small):
    shape = draw(st.sampled_from(shapes))
    return draw(hnp.arrays(np.float32, shape, elements=elements))


# --------------------------------------------------------------------- value tables


@pytest.mark.parametrize("fmt", sorted(EXPECTED_MAGNITUDES))
def test_4bit_tables(fmt):
    values = quantizer(fmt).values()
    mags = np.array(EXPECTED_MAGNITUDES[fmt], np.float64)
    np.testing.assert_array_equal(values, np.concatenate([-mags[:0:-1], mags]))


@pytest.mark.parametrize("fmt", sorted(ML_DTYPES))
def test_tables_match_ml_dtypes(fmt):
    dtype = ML_DTYPES[fmt]
    raw = np.arange(256, dtype=np.uint8)
    if fmt == "e2m1":
        raw = raw[:16]
    ref = raw.view(dtype).astype(np.float64)
    ref = np.unique(ref[np.isfinite(ref)])
    values = quantizer(fmt).values()
    np.testing.assert_array_equal(values, ref)
    assert values[-1] == float(ml_dtypes.finfo(dtype).max)
    assert len(values) == {"e2m1": 15, "e4m3": 253, "e5m2": 247}[fmt]


def test_bf16_table_and_fp32():
    values = quantizer("bf16").values()
    assert values[-1] == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert np.all(np.diff(values) > 0) and 0.0 in values
    with pytest.raises(ValueError, match="fp32"):
        quantizer("fp32").values()


# ------------------------------------------------------------- algebraic properties


@pytest.mark.parametrize("fmt,gran", CONFIGS)
@given(x=tensors())
def test_dequantized_values_lie_on_the_scaled_grid(fmt, gran, x):
    q = _q(fmt, gran)
    qz, y = _encode(q, jnp.asarray(x))
    assert isinstance(qz, Quantized)
    assert y.shape == x.shape and y.dtype == jnp.float32
    if fmt in CASTS:
        assert qz.scale.shape == (0,)
        ref = x.astype(ml_dtypes.bfloat16) if fmt == "bf16" else x
        np.testing.assert_array_equal(np.asarray(qz.codes), ref)
        np.testing.assert_array_equal(np.asarray(y), ref.astype(np.float32))
        return
    table = q.values()
    top = table[-1]
    codes = np.asarray(qz.codes)
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    assert np.all(codes < len(table))
    amax, amax_el = _group_amax(x, gran)
    assert qz.scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(qz.scale), amax.astype(np.float32))
    ref = (table[codes] / top) * amax_el  # float64
    np.testing.assert_array_max_ulp(np.asarray(y), ref.astype(np.float32), maxulp=1)


@pytest.mark.parametrize("fmt,gran", CONFIGS)
@given(x=tensors())
def test_quantize_is_idempotent(fmt, gran, x):
    q = _q(fmt, gran)
    qz, y = _encode(q, jnp.asarray(x))
    qz2, y2 = _encode(q, y)
    np.testing.assert_array_equal(np.asarray(qz2.codes), np.asarray(qz.codes))
    np.testing.assert_array_equal(np.asarray(qz2.scale), np.asarray(qz.scale))
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))


@pytest.mark.parametrize("fmt,gran", CONFIGS)
@given(x=tensors())
def test_sign_symmetry(fmt, gran, x):
    q = _q(fmt, gran)
    qz, y = _encode(q, jnp.asarray(x))
    qz_neg, y_neg = _encode(q, jnp.asarray(-x))
    # Bitwise, except that a zero code always decodes to +0.0.
    np.testing.assert_array_equal(_bits_of(y_neg), _bits_of(-np.asarray(y)))
    if fmt in SCALED:
        mirror = len(q.values()) - 1 - np.asarray(qz.codes).astype(np.int64)
        np.testing.assert_array_equal(np.asarray(qz_neg.codes), mirror)


@pytest.mark.parametrize("fmt,gran", CONFIGS)
@given(x=tensors(), k=st.integers(-4, 4))
def test_power_of_two_equivariance(fmt, gran, x, k):
    q = _q(fmt, gran)
    factor = np.float32(2.0**k)
    qz, y = _encode(q, jnp.asarray(x))
    qz_k, y_k = _encode(q, jnp.asarray(x * factor))
    np.testing.assert_array_equal(np.asarray(y_k), np.asarray(y) * factor)
    if fmt in SCALED:
        np.testing.assert_array_equal(np.asarray(qz_k.codes), np.asarray(qz.codes))


@pytest.mark.parametrize("fmt,gran", CONFIGS)
@given(x=tensors())
def test_error_bound(fmt, gran, x):
    q = _q(fmt, gran)
    _, y = _encode(q, jnp.asarray(x))
    err = np.abs(np.asarray(y, np.float64) - x.astype(np.float64))
    if fmt == "fp32":
        assert np.all(err == 0)
        return
    if fmt == "bf16":
        assert np.all(err <= np.abs(x.astype(np.float64)) * 2.0**-8)
        return
    _, amax_el = _group_amax(x, gran)
    ulp = np.spacing(amax_el.astype(np.float32)).astype(np.float64)
    bound = _max_half_spacing(fmt) * amax_el / q.values()[-1] + 4 * ulp
    assert np.all(err <= bound)


@pytest.mark.parametrize("fmt,gran", [(f, g) for f, g in CONFIGS if f in SCALED])
@given(x=tensors())
def test_codes_are_nearest(fmt, gran, x):
    """The code is a nearest table value to the normalised x * (M / amax) (float32)."""
    q = _q(fmt, gran)
    qz, _ = _encode(q, jnp.asarray(x))
    table = q.values()
    top = np.float32(table[-1])
    _, amax_el = _group_amax(x, gran)
    amax_el = amax_el.astype(np.float32)
    safe = np.where(amax_el > 0, amax_el, np.float32(1))
    v = np.minimum(np.maximum(x * (top / safe), -top), top).astype(np.float64)
    dist = np.abs(table[np.asarray(qz.codes)] - v)
    assert np.all(dist <= np.min(np.abs(table - v[..., None]), axis=-1))


@pytest.mark.parametrize("fmt,gran", [(f, g) for f, g in CONFIGS if f in SCALED])
@given(x=tensors())
def test_zero_groups_stay_zero(fmt, gran, x):
    q = _q(fmt, gran)
    ids = _group_ids(x.shape, gran)
    flat = x.reshape(-1).copy()
    flat[ids == 0] = 0.0
    if ids.max() > 0:
        flat[np.argmax(ids == 1)] = 3.0  # group 1 is certainly non-zero
    x = flat.reshape(x.shape)
    qz, y = _encode(q, jnp.asarray(x))
    y = np.asarray(y).reshape(-1)
    assert np.all(np.isfinite(y))
    assert np.all(y[ids == 0] == 0.0) and np.asarray(qz.scale)[0] == 0.0
    amax, amax_el = _group_amax(x, gran)
    # Every non-zero group is non-zero after the round trip: its max comes back exactly.
    for g in np.flatnonzero(amax > 0):
        members = np.abs(flat[ids == g])
        assert np.abs(y[ids == g])[np.argmax(members)] == np.float32(amax[g])


@pytest.mark.parametrize("gran", GRANULARITIES)
def test_scalars_and_empty_tensors(gran):
    q = _q("e3m0", gran)
    for value in (0.0, -3.0, 0.3):
        y = _apply(q, jnp.asarray(value, jnp.float32))
        assert y.shape == () and y.dtype == jnp.float32
        assert float(y) == np.float32(value)
    y = _apply(q, jnp.zeros((3, 0), jnp.float32))
    assert y.shape == (3, 0) and y.dtype == jnp.float32


@pytest.mark.parametrize("fmt", ["e3m0", "e5m2"])
def test_tiny_groups(fmt):
    """M / amax overflows float32 for amax below M / 3.4e38: still exact zeros and max."""
    x = np.zeros(13, np.float32)
    x[[2, 7]] = [1e-37, -3e-38]
    qz, y = _encode(_q(fmt, "tensor"), jnp.asarray(x))
    y = np.asarray(y)
    assert np.all(np.isfinite(y)) and y[2] == x[2]
    assert np.all(y[x == 0] == 0) and y[7] < 0


# ------------------------------------------------------------- reference numerics


@pytest.mark.parametrize("fmt", sorted(ML_DTYPES))
@given(data=st.data())
def test_nearest_rounding_matches_ml_dtypes(fmt, data):
    q = quantizer(fmt)
    top = float(q.values()[-1])
    elements = st.floats(-top, top, width=32, allow_subnormal=False)
    x = data.draw(hnp.arrays(np.float32, (4, 6), elements=elements))
    x[0, 0] = top  # amax = M, so the normalised values are x itself
    qz, _ = _encode(q, jnp.asarray(x))
    ref = np.asarray(x).astype(ML_DTYPES[fmt]).astype(np.float64)
    np.testing.assert_array_equal(q.values()[np.asarray(qz.codes)], ref)


@pytest.mark.parametrize("fmt", sorted(ML_DTYPES))
def test_ties_match_ml_dtypes(fmt):
    """Every midpoint of the value table rounds as ml_dtypes (round-half-to-even)."""
    q = quantizer(fmt)
    values = q.values()
    mids = ((values[1:] + values[:-1]) / 2).astype(np.float32)
    x = np.concatenate([[values[-1]], mids]).astype(np.float32)
    qz, _ = _encode(q, jnp.asarray(x))
    ref = x.astype(ML_DTYPES[fmt]).astype(np.float64)
    np.testing.assert_array_equal(q.values()[np.asarray(qz.codes)], ref)


def _nearest_index_f64(a: np.ndarray, mags: np.ndarray) -> np.ndarray:
    """Index of the nearest of `mags` in float64, exact ties to the even index."""
    dist = np.abs(a.astype(np.float64)[:, None] - mags[None, :])
    best = dist.min(axis=1, keepdims=True)
    nearest = dist == best
    first = nearest.argmax(axis=1)
    tie = nearest.sum(axis=1) > 1
    return np.where(tie & (first % 2 == 1), first + 1, first)


_E3M0 = formats.magnitudes("e3m0")
_E3M0_EDGES = np.concatenate(
    [_E3M0, (_E3M0[1:] + _E3M0[:-1]) / 2, [1e-45, 0.0625, 0.1875]]
)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(
    data=st.data(),
    a=hnp.arrays(
        np.float64,
        st.integers(1, 64),
        elements=st.floats(0.0, float(_E3M0[-1]), width=32),
    ),
)
def test_e3m0_rounding_on_the_bit_pattern_is_nearest_ties_to_even(dtype, data, a):
    """E3M0 (zero and powers of two) is rounded on the float's bit pattern; it must be
    the float64 nearest index, ties to even, at the midpoints and their neighbours
    too, for float32 and float64 inputs (subnormals included)."""
    edge = data.draw(st.sampled_from(list(_E3M0_EDGES)))
    step = data.draw(st.sampled_from([0.0, -np.inf, np.inf]))
    a = np.append(a, np.nextafter(np.asarray(edge, dtype), step)).astype(dtype)
    a = np.minimum(a, _E3M0[-1]).astype(dtype)
    with jax.enable_x64(dtype == np.float64):
        got = np.asarray(formats.round_nearest(jnp.asarray(a), _E3M0))
    np.testing.assert_array_equal(got, _nearest_index_f64(a, _E3M0))


@pytest.mark.parametrize("fmt", sorted(EXPECTED_MAGNITUDES))
def test_ties_go_to_even_magnitude_code(fmt):
    mags = np.array(EXPECTED_MAGNITUDES[fmt])
    mids = (mags[1:] + mags[:-1]) / 2
    x = np.zeros(24, np.float32)  # amax = M, so the normalised values are x itself
    n = 1 + 2 * len(mids)
    x[:n] = np.concatenate([[mags[-1]], mids, -mids])
    qz, _ = _encode(quantizer(fmt), jnp.asarray(x.reshape(4, 6)))
    codes = np.asarray(qz.codes).reshape(-1)[1:n].astype(np.int64)
    mag_code = np.abs(codes - (len(mags) - 1))
    lower = np.arange(len(mids))
    expected = np.where(lower % 2 == 0, lower, lower + 1)
    np.testing.assert_array_equal(mag_code, np.concatenate([expected, expected]))


_BIG = float(np.float32(1e30))


@given(x=tensors(elements=st.floats(-_BIG, _BIG, width=32, allow_subnormal=False)))
def test_bf16_nearest_matches_astype(x):
    y = _apply(quantizer("bf16"), jnp.asarray(x))
    ref = jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))


# ------------------------------------------------------------ stochastic rounding


P_UP = np.array([0.2, 0.5, 0.7, 0.35, 0.9, 0.1, 0.6, 0.45])


def _between_neighbours(fmt):
    """x with known neighbours lo < |x| < hi and P(round up) = P_UP, and amax = M."""
    if fmt == "bf16":
        base = _normal(0, len(P_UP)).view(np.uint32) & np.uint32(0xFFFF0000)
        low = np.round(P_UP * 2**16).astype(np.uint32)
        x = (base | low).view(np.float32)
        lo = np.abs(base.view(np.float32)).astype(np.float64)
        hi = np.abs((base + np.uint32(0x10000)).view(np.float32)).astype(np.float64)
        return x, lo, hi
    values = quantizer(fmt).values()
    mags = values[len(values) // 2 :]
    idx = np.linspace(0, len(mags) - 2, len(P_UP)).astype(np.int64)
    lo, hi = mags[idx], mags[idx + 1]
    signs = np.where(np.arange(len(P_UP)) % 2 == 0, 1.0, -1.0)
    x = np.concatenate([[mags[-1]], signs * (lo + P_UP * (hi - lo))])
    return (
        x.astype(np.float32),
        np.concatenate([[mags[-1]], lo]),
        np.concatenate([[mags[-1]], hi]),
    )


@pytest.mark.parametrize("fmt", ["e3m0", "int4", "e4m3", "bf16"])
def test_stochastic_rounding_is_unbiased(fmt):
    q = quantizer(fmt, rounding="stochastic")
    assert q.needs_key
    x, lo, hi = _between_neighbours(fmt)
    n = 2000
    ys = np.asarray(_apply_many(q, jnp.asarray(x), jr.split(_rbg(1234), n)))
    mag = np.abs(ys).astype(np.float64)
    # Every sample is one of the two neighbours, with the sign of x.
    assert np.all((mag == lo) | (mag == hi)) and np.all(ys * x >= 0)
    # Unbiased: the mean is within 4 standard errors of x (Bernoulli variance).
    p = (np.abs(x) - lo) / np.where(hi > lo, hi - lo, 1.0)
    se = (hi - lo) * np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(mag.mean(0) - np.abs(x)) <= 4 * se + 1e-7 * np.abs(x))
    assert np.all(se[1:] > 0)  # every value but the max really is randomised


@pytest.mark.parametrize("fmt", SCALED)
@given(x=tensors(shapes=((4, 6),)), seed=st.integers(0, 2**31 - 1))
def test_stochastic_rounding_on_grid_and_symmetric(fmt, x, seed):
    q = _q(fmt, "tensor", "stochastic")
    key = _rbg(seed)
    qz, y = _encode_stochastic(q, jnp.asarray(x), key)
    qz_neg, _ = _encode_stochastic(q, jnp.asarray(-x), key)
    table = q.values()
    codes = np.asarray(qz.codes)
    amax = np.float64(np.max(np.abs(x), initial=0.0))
    ref = table[codes] / table[-1] * amax
    np.testing.assert_array_max_ulp(np.asarray(y), ref.astype(np.float32), maxulp=1)
    err = np.abs(np.asarray(y, np.float64) - x)
    assert np.all(err <= 2 * _max_half_spacing(fmt) * amax / table[-1] * (1 + 1e-6))
    np.testing.assert_array_equal(np.asarray(qz_neg.codes), len(table) - 1 - codes)
    # The largest element always comes back exactly.
    if amax > 0:
        assert np.abs(np.asarray(y)).max() == np.float32(amax)


def test_stochastic_bf16_lands_on_neighbours():
    x = np.random.default_rng(1).normal(size=64).astype(np.float32)
    ys = np.asarray(
        _apply_many(quantizer("bf16", rounding="stochastic"), x, jr.split(_rbg(0), 8))
    )
    pattern = x.view(np.uint32) & np.uint32(0xFFFF0000)
    down = pattern.view(np.float32)  # truncated towards zero
    up = (pattern + np.uint32(0x10000)).view(np.float32)  # next bf16 away from zero
    assert np.all((ys == down) | (ys == up))
    assert np.any(ys == down) and np.any(ys == up)
    np.testing.assert_array_equal(ys.astype(ml_dtypes.bfloat16).astype(np.float32), ys)


# ------------------------------------------------------------------------ bit cost


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "shape,groups",
    [
        ((), {"tensor": 1, "row": 1, "block": 1}),
        ((7,), {"tensor": 1, "row": 1, "block": 1}),
        ((3, 10), {"tensor": 1, "row": 3, "block": 4}),  # 30 = 3 x 8 + 6
        ((2, 3, 16), {"tensor": 1, "row": 6, "block": 12}),  # 96 = 12 x 8
        ((3, 0), {"tensor": 1, "row": 3, "block": 0}),
    ],
)
def test_bit_cost(fmt, shape, groups):
    n = math.prod(shape)
    per_element = {"bf16": 16, "fp32": 32, "e4m3": 8, "e5m2": 8, "int8": 8, "int2": 2}
    per_element = per_element.get(fmt, 4)
    for gran in GRANULARITIES:
        q = quantizer(fmt, granularity=gran, block_size=8)
        metadata = 0 if fmt in CASTS else 32 * groups[gran]
        assert q.bits(shape) == n * per_element + metadata
        assert isinstance(q.bits(shape), int)


def test_bit_cost_paper_ratio():
    """E3M0 per tensor costs about 4 bits per parameter, a quarter of bf16."""
    shape = (1024, 1024)
    ratio = quantizer("bf16").bits(shape) / quantizer("e3m0").bits(shape)
    assert 3.99 < ratio <= 4.0


def test_dropping_bit_costs():
    assert top_k(0.1).bits((1000,)) == 100 * (32 + 10)
    assert top_k(1.0).bits((1,)) == 32
    assert top_k(0.3).bits((10,)) == 3 * (32 + 4)
    assert fed_dropout(0.25).bits((10, 10)) == 75 * 32 + 64
    assert fed_dropout(0.7).bits((10,)) == 3 * 32 + 64
    assert dare(0.9).bits((10,)) == 1 * 32 + 64
    assert dare(0.0).bits((4, 4)) == 16 * 32 + 64


# ------------------------------------------------------------- value dropping


def test_fed_dropout_keeps_a_random_subset_without_rescale():
    rate = 0.3
    x = jnp.asarray(np.random.default_rng(0).normal(size=(20, 50)).astype(np.float32))
    c = fed_dropout(rate)
    assert c.needs_key
    keys = jr.split(_rbg(0), 200)
    ys = np.asarray(_apply_many(c, x, keys))
    kept = ys != 0
    assert np.all(kept.sum(axis=(1, 2)) == math.ceil((1 - rate) * x.size))
    np.testing.assert_array_equal(ys[kept], np.broadcast_to(x, ys.shape)[kept])
    freq = kept.mean(0)  # each entry kept with probability 1 - rate
    assert abs(freq.mean() - (1 - rate)) < 1e-6
    assert np.all(np.abs(freq - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / 200))
    assert not np.array_equal(kept[0], kept[1])


def test_dare_is_mean_preserving():
    rate = 0.6
    x = jnp.asarray(np.random.default_rng(1).normal(size=(50,)).astype(np.float32))
    c = dare(rate)
    keys = jr.split(_rbg(7), 2000)
    ys = np.asarray(_apply_many(c, x, keys), np.float64)
    kept = ys != 0
    assert np.all(kept.sum(1) == 20)
    np.testing.assert_allclose(
        ys[kept], (np.broadcast_to(x, ys.shape)[kept] / (1 - rate)), rtol=1e-6
    )
    mean, se = ys.mean(0), ys.std(0) / np.sqrt(len(ys))
    assert np.all(np.abs(mean - np.asarray(x)) <= 4 * se)


@given(seed=st.integers(0, 2**31 - 1), frac=st.sampled_from([0.01, 0.1, 0.5, 1.0]))
def test_top_k_keeps_exactly_the_k_largest(seed, frac):
    x = _normal(seed, (6, 40))
    c = top_k(frac)
    assert not c.needs_key
    y = np.asarray(_apply(c, jnp.asarray(x)))
    k = {0.01: 3, 0.1: 24, 0.5: 120, 1.0: 240}[frac]
    largest = np.argsort(-np.abs(x).reshape(-1))[:k]
    expected = np.zeros(x.size, np.float32)
    expected[largest] = x.reshape(-1)[largest]
    np.testing.assert_array_equal(y.reshape(-1), expected)


@pytest.mark.parametrize(
    "c", [fed_dropout(0.5), dare(0.5), top_k(0.25)], ids=["fed", "dare", "topk"]
)
def test_dropping_propagates_non_finite(c):
    x = jnp.asarray([0.0, 1.0, np.nan, 2.0, np.inf, 0.5, -np.inf, 0.1], jnp.float32)
    ys = np.asarray(_apply_many(c, x, jr.split(_rbg(0), 4)))
    assert np.all(np.isnan(ys[:, 2])) and np.all(ys[:, 4] == np.inf)
    assert np.all(ys[:, 6] == -np.inf)


# ------------------------------------------------------------- non-finite inputs


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_propagates(fmt, bad):
    x = np.linspace(-1, 1, 13, dtype=np.float32)
    x[3] = bad
    _, y = _encode(_q(fmt, "block" if fmt in SCALED else "tensor"), jnp.asarray(x))
    y = np.asarray(y)
    assert not np.isfinite(y[3])
    if fmt in SCALED:  # the whole block is flagged; other blocks are untouched
        assert not np.any(np.isfinite(y[:BLOCK])) and np.all(np.isfinite(y[BLOCK:]))


# ----------------------------------------------------------- jit, vmap, dtypes


@pytest.mark.parametrize("fmt,rounding", [("e3m0", "stochastic"), ("e4m3", "nearest")])
def test_jit_and_vmap_match_a_loop(fmt, rounding):
    """vmap over replicas with one key each, using the default (threefry) keys."""
    x = jnp.asarray(_normal(0, (3, 4, 6)))
    keys = jr.split(jr.key(1), 3)
    q = _q(fmt, "row", rounding)
    y = jax.jit(jax.vmap(q))(x, keys)
    loop = jnp.stack([_encode_stochastic(q, x[i], keys[i])[1] for i in range(3)])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(loop))


def test_vmap_over_replicas_and_layers():
    """The training step vmaps over replicas and the layer axis of stacked leaves."""
    x = jnp.asarray(_normal(0, (2, 3, 4, 6)))
    q = _q("e3m0", "block")
    y = jax.jit(jax.vmap(jax.vmap(q)))(x)
    loop = jnp.stack([jnp.stack([_encode(q, xl)[1] for xl in xr]) for xr in x])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(loop))


F64_CASES = [(f, "nearest") for f in FORMATS] + [
    ("e3m0", "stochastic"),
    ("bf16", "stochastic"),
    ("fp32", "stochastic"),
]


def test_float64_input_returns_float64():
    qs = tuple(_q(f, "row", r) for f, r in F64_CASES)
    with jax.enable_x64(True):
        x = jnp.asarray(_normal(0, (4, 6), np.float64))
        outs = _encode_all(qs, x, _rbg(1))
    x = np.asarray(x)
    for (fmt, rounding), q, (qz, y) in zip(F64_CASES, qs, outs):
        assert y.dtype == jnp.float64 and y.shape == x.shape, (fmt, rounding)
        y = np.asarray(y)
        assert np.all(np.isfinite(y))
        if fmt in SCALED:
            assert qz.scale.dtype == jnp.float32 and qz.codes.dtype == jnp.uint8
            bound = 0.8 if fmt == "int2" else 0.3  # ternary: coarse by design
            assert np.linalg.norm(y - x) / np.linalg.norm(x) < bound
            # Decoded in float64: (values / M) rounded to float64, times the scale.
            table = q.values()
            scale = np.asarray(qz.scale, np.float64)[:, None]
            np.testing.assert_array_equal(
                y, (table / table[-1])[np.asarray(qz.codes)] * scale
            )
        elif fmt == "bf16":
            assert qz.codes.dtype == jnp.bfloat16
            np.testing.assert_array_equal(
                y, y.astype(ml_dtypes.bfloat16).astype(np.float64)
            )
            assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-7)
        else:
            assert qz.codes.dtype == jnp.float32
            np.testing.assert_array_equal(y, y.astype(np.float32).astype(np.float64))
            assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-23)
            if rounding == "nearest":
                np.testing.assert_array_equal(y, x.astype(np.float32))


def test_bf16_input_returns_bf16():
    cs = (
        _q("e3m0", "block"),
        _q("e4m3", "row", "stochastic"),
        _q("bf16", "tensor"),
        _q("fp32", "tensor"),
        fed_dropout(0.5),
        dare(0.5),
        top_k(0.5),
    )
    x = jnp.asarray(_normal(0, (4, 6))).astype(jnp.bfloat16)
    outs = _apply_all(cs, x, _rbg(0))
    for c, y in zip(cs, outs):
        assert y.dtype == jnp.bfloat16 and y.shape == x.shape, c
    for y in outs[2:4]:  # bf16 and fp32 are exact for bf16 input
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_quantizer_is_a_static_compressor():
    q = quantizer("e2m1", granularity="block", block_size=16, rounding="stochastic")
    same = Quantizer("e2m1", "block", 16, "stochastic")
    assert isinstance(q, Quantizer) and isinstance(q, Compressor)
    assert jax.tree.leaves(q) == [] and q == same and hash(q) == hash(same)
    assert not quantizer().needs_key and q.needs_key
    with pytest.raises(TypeError):
        Compressor()  # abstract


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: quantizer("e9m9"), "format='e9m9'.*e3m0"),
        (lambda: quantizer("e3m0", granularity="col"), "granularity='col'.*tensor"),
        (lambda: quantizer("e3m0", rounding="up"), "rounding='up'.*stochastic"),
        (lambda: quantizer("e3m0", block_size=0), "block_size=0.*>= 1"),
        (lambda: quantizer("e3m0", block_size=-3), "block_size=-3"),
        (lambda: fed_dropout(1.0), "rate=1.0.*0 <= rate < 1"),
        (lambda: fed_dropout(-0.1), "rate=-0.1"),
        (lambda: dare(1.5), "rate=1.5"),
        (lambda: dare(float("nan")), "rate=nan"),
        (lambda: top_k(0.0), "fraction=0.0.*0 < fraction <= 1"),
        (lambda: top_k(1.5), "fraction=1.5"),
    ],
)
def test_bad_configuration_raises(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    "c",
    [
        quantizer("e3m0", rounding="stochastic"),
        quantizer("bf16", rounding="stochastic"),
        fed_dropout(0.5),
        dare(0.5),
    ],
)
def test_missing_key_raises_at_trace_time(c):
    x = jnp.ones((4,))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        jax.eval_shape(c, x)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        _apply(c, x)
