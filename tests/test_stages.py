"""Tests for sdiloco.compression.stages and .spec: compression as composable stages.

Properties (hypothesis) of every stage and chain, exact wire accounting from the
message, error feedback's identity, NumPy references for the new stages, the spec
grammar and its errors, and independent randomness per replica and fragment.
"""

import dataclasses

import equinox as eqx
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import plugin_state
from hypothesis import given

import sdiloco
from sdiloco.compression import (
    ChunkedTopK,
    chain,
    chunked_top_k,
    dare,
    message_bits,
    min_max,
    parse,
    parse_with_feedback,
    quantizer,
    top_k,
)
from sdiloco.inflight import Group, Visit
from sdiloco.plugins import ErrorFeedback, Send, error_feedback


SPECS = (
    "e3m0",
    "int2",
    "int8",
    "int8mm",
    "int4mm:block8:sr",
    "topk:0.1",
    "topk:0.25/8",
    "topk:0.25/8,int2",
    "topk:0.05/16,int4:row:sr",
    "dare:0.5",
    "dropout:0.25",
)
SHAPES = ((13,), (4, 6), (3, 5, 2))


def _key(seed, c=None):
    """An rbg key (fast to compile); a raw threefry key for the random-subset
    compressors, whose message carries the key's 64 bits as their seed."""
    if isinstance(c, (sdiloco.compression.Dare, sdiloco.compression.FedDropout)):
        return jr.key_data(jr.key(seed))
    return jr.key(seed, impl="rbg")


@eqx.filter_jit
def _round_trip(c, x, key):
    key = key if c.needs_key else None
    return c(x, key), c.decode(c.encode(x, key), x.shape, x.dtype)


_values = st.floats(-1e3, 1e3, width=32, allow_subnormal=False)


@st.composite
def tensors(draw):
    shape = draw(st.sampled_from(SHAPES))
    return draw(hnp.arrays(np.float32, shape, elements=_values))


@pytest.mark.parametrize("spec", SPECS)
@given(x=tensors(), seed=st.integers(0, 2**31 - 1))
def test_decode_of_encode_is_the_round_trip(spec, x, seed):
    """The message carries exactly what the receivers reconstruct."""
    c = parse(spec)
    y, z = _round_trip(c, jnp.asarray(x), _key(seed, c))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(z))
    assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("spec", SPECS + ("topk:0.25/8,int2,ef:0.9",))
@pytest.mark.parametrize("shape", SHAPES + ((1,), (640,)))
def test_bits_are_the_message(spec, shape):
    """`bits` equals the message's fields' sizes times their widths."""
    codec, _ = parse_with_feedback(spec)
    assert codec is not None
    assert codec.bits(shape) == message_bits(codec, shape) > 0


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_zero_maps_to_zero(spec, shape):
    c = parse(spec)
    y, _ = _round_trip(c, jnp.zeros(shape), _key(0, c))
    np.testing.assert_array_equal(np.asarray(y), 0.0)


def test_one_stage_chain_is_that_stage_bitwise():
    x = jr.normal(jr.key(3), (7, 9))
    for stage in (quantizer("e3m0"), quantizer("int4", rounding="stochastic")):
        key = _key(5) if stage.needs_key else None
        a = chain(stage)(x, key)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(stage(x, key)))
        assert chain(stage) is stage


_dyadic = st.integers(-(2**10), 2**10).map(lambda i: np.float32(i / 8))


@pytest.mark.parametrize(
    "spec", ["e3m0,ef", "int2,ef:0.5", "topk:0.25/8,int2,ef", "topk:0.3,ef:0.5"]
)
@given(
    d=hnp.arrays(np.float32, (4, 6), elements=_dyadic),
    e=hnp.arrays(np.float32, (4, 6), elements=_dyadic),
)
def test_error_feedback_sent_plus_residual_is_input_plus_decayed_residual(spec, d, e):
    """sent + new residual = Δ + β·old residual, exactly (on values whose sums and
    scaled grid points are exact in float32: multiples of 1/8 below 2^7). The
    plug-in's hooks on one fragment that is the whole tensor."""
    codec, fb = parse_with_feedback(spec)
    assert isinstance(fb, ErrorFeedback) and codec is not None
    whole = Group((0,), (0,), (None,), (d.shape[1:],))
    send = Send(Visit.of(whole, 0), None, [], lambda g: g)
    (a,), state = fb.before_send(send, [jnp.asarray(d)], [jnp.asarray(e)])
    sent = codec(a)
    _, (new,) = fb.after_send(send, [a], [sent], [], state)
    lhs = np.asarray(sent, np.float64) + np.asarray(new, np.float64)
    rhs = d.astype(np.float64) + fb.beta * e.astype(np.float64)
    np.testing.assert_array_equal(lhs, rhs)


@pytest.mark.parametrize("spec", ["int2:sr", "int8mm:tensor:sr", "int4mm:row:sr"])
def test_stochastic_rounding_is_unbiased(spec):
    c = parse(spec)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(12,)), jnp.float32)
    n = 4000
    ys = np.asarray(jax.vmap(c, in_axes=(None, 0))(x, jr.split(_key(1), n)), np.float64)
    # each sample lies on one of the two grid neighbours: the mean is within 4 std
    # errors of x, with the spacing of the grid bounding the spread
    spread = ys.std(0)
    bound = 4 * spread / np.sqrt(n) + 1e-6 * np.abs(np.asarray(x))
    assert np.all(np.abs(ys.mean(0) - np.asarray(x)) <= bound)
    assert np.sum(spread > 0) >= 10  # really randomised (a group's max is exact)


def _np_chunked_top_k(x, fraction, chunk):
    """float64 reference: the ceil(fraction·chunk) largest |x| of each chunk, ties to
    the lower position."""
    flat = np.asarray(x, np.float64).reshape(-1)
    n = flat.size
    rows = np.zeros(-(-n // chunk) * chunk)
    rows[:n] = flat
    rows = rows.reshape(-1, chunk)
    k = int(np.ceil(fraction * chunk - 1e-12))
    out = np.zeros_like(rows)
    for r, row in enumerate(rows):
        keep = np.argsort(-np.abs(row), kind="stable")[:k]
        out[r, keep] = row[keep]
    return out.reshape(-1)[:n].reshape(np.shape(x))


@given(
    x=tensors(),
    chunk=st.sampled_from([1, 3, 8, 64]),
    frac=st.sampled_from([0.1, 0.5, 1.0]),
)
def test_chunked_top_k_matches_numpy(x, chunk, frac):
    y = chunked_top_k(frac, chunk=chunk)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), _np_chunked_top_k(x, frac, chunk))


def test_chunked_top_k_bits():
    c = chunked_top_k(0.02, chunk=64)  # 2 kept per chunk of 64 (ceil 1.28)
    assert c.kept == 2 and c.bits((640,)) == 10 * 2 * (32 + 6)
    assert chunked_top_k(1.0, chunk=1).bits((5,)) == 5 * 32  # one entry: no index


def _np_min_max(x, bits):
    """float64 reference of one group: nearest of 2^bits levels from min to max."""
    x = np.asarray(x, np.float64)
    lo, hi = x.min(), x.max()
    if hi == lo:
        return np.full_like(x, lo)
    top = 2**bits - 1
    codes = np.round((x - lo) / (hi - lo) * top)
    return lo + codes * (hi - lo) / top


@given(
    x=hnp.arrays(np.float32, (3, 16), elements=_values), bits=st.sampled_from([2, 4, 8])
)
def test_min_max_rows_match_numpy(x, bits):
    y = np.asarray(min_max(bits, granularity="row")(jnp.asarray(x)))
    ref = np.stack([_np_min_max(row, bits) for row in x])
    # float32 arithmetic against float64: a few ulps of the group's range, and any
    # code that lands exactly on a rounding boundary may go either way
    span = (x.max(1) - x.min(1))[:, None].astype(np.float64)
    assert np.all(
        np.abs(y - ref) <= span * (1e-5 + (np.abs(y - ref) > 0) / (2**bits - 1))
    )
    np.testing.assert_allclose(y.min(1), x.min(1), rtol=1e-6)  # the range is exact
    assert min_max(bits, granularity="row").bits((3, 16)) == 48 * bits + 3 * 64


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "expected stages separated by commas"),
        ("e3m1", "unknown stage 'e3m1'"),
        ("topk:abc", "'abc' is not a number"),
        ("topk", "expected one fraction"),
        ("topk:0.1/0", "chunk=0"),
        ("topk:1.5", "fraction=1.5"),
        ("int4:blok3", "unknown option 'blok3'"),
        ("ef,int2", "stage 0 is ef, which must be the last stage"),
        ("int2,topk:0.1", "no float 'values' for the next stage"),
        ("ef", "no compressing stage before ef"),
        ("int2,ef:1.5", "beta=1.5"),
        ("int9mm", "unknown stage 'int9mm'"),
    ],
)
def test_bad_spec_is_one_line_naming_the_value(spec, match):
    for read in (parse, parse_with_feedback):
        with pytest.raises(ValueError, match=match) as info:
            read(spec)
        assert "\n" not in str(info.value) and repr(spec) in str(info.value)


@pytest.mark.parametrize("spec", ["int2,ef", "topk:0.02/64,int2,ef:0.9"])
def test_parse_refuses_error_feedback_which_is_a_plug_in(spec):
    with pytest.raises(ValueError, match="ends in error feedback, a plug-in") as info:
        parse(spec)
    assert "\n" not in str(info.value) and repr(spec) in str(info.value)


def test_spec_builds_the_stages():
    assert parse("none") is None
    assert parse_with_feedback("none") == (None, None)
    assert parse_with_feedback("int2") == (quantizer("int2"), None)
    c, ef = parse_with_feedback("topk:0.02/64,int2,ef:0.9")
    assert c == chain(chunked_top_k(0.02, chunk=64), quantizer("int2"))
    assert ef == error_feedback(0.9)
    assert parse_with_feedback("int2,ef") == (quantizer("int2"), error_feedback(1.0))
    assert parse("topk:0.1") == top_k(0.1) and parse("dare:0.5") == dare(0.5)
    assert parse("int4:block64:sr") == quantizer(
        "int4", granularity="block", block_size=64, rounding="stochastic"
    )
    assert parse("int8mm") == min_max(8, granularity="row")
    assert isinstance(c, sdiloco.compression.Chain)
    assert isinstance(c.stages[0], ChunkedTopK) and isinstance(ef, ErrorFeedback)


# ----------------------------------------------------- in the algorithm: keys, state


def _loss(p, b):
    return 0.5 * jnp.mean((b["x"] @ p["a"] + b["x"] @ p["b"] - b["y"]) ** 2)


def _ef_residuals(compressor, *, first_send=(2, 2)):
    """The error-feedback residuals after one send of two identical fragments by two
    replicas that trained on identical data (so every Δ is the same)."""
    params = {"a": jnp.linspace(-1, 1, 16), "b": jnp.linspace(-1, 1, 16)}
    alg = sdiloco.streaming_diloco(
        _loss,
        inner=optax.sgd(0.1),
        num_replicas=2,
        sync_every=2,
        fragments=dataclasses.replace(
            sdiloco.fragments_from_labels(params, {"a": 0, "b": 1}),
            first_send=first_send,
        ),
        overlap=1,
        compressor=compressor,
    )
    state = alg.init(params, jr.key(0))
    x = jnp.broadcast_to(jnp.linspace(0.5, 1.5, 16 * 4).reshape(4, 16), (2, 4, 16))
    batch = {"x": x, "y": jnp.ones((2, 4))}
    for _ in range(2):
        state, _ = alg.step(state, batch)
    assert int(state.sent_at[0]) == 2
    return plugin_state(alg, state, ErrorFeedback)


@pytest.mark.parametrize("spec", ["int4:sr,ef", "topk:0.5/4,int2:sr,ef:0.9"])
def test_every_replica_and_fragment_draws_its_own_key(spec):
    """Identical Δ on two replicas and in two fragments sent at the same step: a
    stochastic compressor must round them independently (one key reused across
    replicas or fragments would make the residuals equal)."""
    res = _ef_residuals(spec)
    a, b = np.asarray(res["a"]), np.asarray(res["b"])
    assert np.any(a != 0)
    assert not np.array_equal(a[0], a[1]), "replicas share a key"
    assert not np.array_equal(a, b), "fragments share a key"
    # nearest rounding of the same Δ is the same everywhere (the check can fail)
    det = _ef_residuals("int4,ef")
    np.testing.assert_array_equal(np.asarray(det["a"])[0], np.asarray(det["a"])[1])
    np.testing.assert_array_equal(np.asarray(det["a"]), np.asarray(det["b"]))
