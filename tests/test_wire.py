"""The packed wire format: bit packing at any width, and a fragment's message.

`pack_bits` is checked against a NumPy reference at every kind of width (dividing 8,
multiples of 8, the others); a `Wire` message is checked to be the accounting's bits
(rounded up once per width), to round-trip bitwise to the simulation's reconstruction,
and, for a 4-bit quantizer, to keep the layout of `pack4` codes followed by the scales.
The exchanges over a mesh are in `tests/test_distributed.py`.
"""

import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_trees_equal, toy_params
from hypothesis import given, settings, strategies as st

import sdiloco
from sdiloco import communication, distributed
from sdiloco.distributed.exchange import assemble, replica_keys
from sdiloco.distributed.wire import Wire, pack_bits, unpack_bits


M = 2
RECIPES = [
    None,
    "bf16",
    "e3m0",
    "e4m3:block5",
    "int2,ef",
    "int4:row:sr",
    "int8mm",
    "int2mm:block64",
    "topk:0.1",
    "topk:0.02/64,int2,ef:0.9",
    "topk:0.05/32,int4:sr",
    "dare:0.5",
    "dropout:0.3",
]


def _reference_pack(codes: np.ndarray, width: int) -> np.ndarray:
    """NumPy: each code's low `width` bits, least significant first, into bytes."""
    n = codes.shape[-1]
    shifts = np.arange(width, dtype=np.uint64)
    bits = (codes[..., None].astype(np.uint64) >> shifts) & np.uint64(1)
    bits = bits.astype(np.uint8).reshape(codes.shape[:-1] + (n * width,))
    size = -(-n * width // 8)
    pad = np.zeros(codes.shape[:-1] + (8 * size - n * width,), np.uint8)
    bits = np.concatenate([bits, pad], axis=-1).reshape(codes.shape[:-1] + (size, 8))
    return (bits << np.arange(8, dtype=np.uint8)).sum(-1).astype(np.uint8)


@given(
    width=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 20, 32]),
    n=st.sampled_from([0, 1, 7, 16]),
    batch=st.sampled_from([(), (3,)]),
    dtype=st.sampled_from([np.uint8, np.int32, np.uint32]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=20)
def test_pack_bits_matches_numpy_and_round_trips(width, n, batch, dtype, seed):
    rng = np.random.default_rng(seed)
    top = min(2**width, np.iinfo(dtype).max + 1)
    codes = rng.integers(0, top, batch + (n,), dtype=np.uint64).astype(dtype)
    packed = pack_bits(jnp.asarray(codes), width)
    assert packed.dtype == jnp.uint8
    assert packed.shape == batch + (math.ceil(n * width / 8),)
    np.testing.assert_array_equal(np.asarray(packed), _reference_pack(codes, width))
    unpacked = np.asarray(unpack_bits(packed, n, width))
    assert unpacked.dtype == (np.uint8 if width <= 8 else np.uint32)
    np.testing.assert_array_equal(unpacked.astype(np.uint64), codes.astype(np.uint64))


def test_pack_bits_drops_high_bits_and_width_zero_sends_nothing():
    codes = jnp.array([0x1F, 0x23], jnp.uint8)
    assert pack_bits(codes, 4).tolist() == [0x3F]  # low nibbles 0xF, 0x3
    assert pack_bits(codes, 0).shape == (0,)
    assert unpack_bits(jnp.zeros((0,), jnp.uint8), 5, 0).tolist() == [0] * 5
    assert pack_bits(codes, 4).tolist() == distributed.pack4(codes).tolist()


def _problem(recipe):
    params = toy_params(jr.key(0), dim=40, hidden=3)
    frags = sdiloco.fragments_by_layer(
        params, blocks=lambda p: p["blocks"], layers_per_fragment=2
    )
    leaves = jax.tree.leaves(params)
    keys = jr.split(jr.key(1), len(leaves))
    deltas = [jr.normal(k, (M,) + x.shape) for k, x in zip(keys, leaves)]
    compressor = None
    if recipe is not None:
        compressor, _ = sdiloco.compression.parse_with_feedback(recipe)
    return compressor, frags, deltas, jr.key_data(jr.key(2))


@pytest.mark.parametrize("recipe", RECIPES)
def test_message_is_the_accounting(recipe):
    compressor, frags, deltas, key = _problem(recipe)
    keys = replica_keys(key, len(deltas), M)
    bits = communication.bits_per_fragment(compressor, frags)
    for p, b in enumerate(bits):
        wire = Wire(compressor, frags, deltas, keys, p)
        # Exact up to one padding per width class (integer fields of one width share
        # one bitstream), and the compiled message has that many bytes.
        assert b / 8 <= wire.num_bytes < b / 8 + len(wire.streams) + 1
        one = [x[0] for x in deltas], [k[0] for k in keys]
        message = jax.eval_shape(wire.encode, *one)
        assert message.shape == (wire.num_bytes,) and message.dtype == jnp.uint8


@pytest.mark.parametrize(
    "recipe",
    [None, "int2mm:block64", "int4:row:sr", "topk:0.05/32,int4:sr", "dropout:0.3"],
)
def test_decoded_message_is_the_simulation_bitwise(recipe):
    """Without a mesh (the mesh exchanges: `tests/test_distributed.py`)."""
    compressor, frags, deltas, key = _problem(recipe)
    keys = replica_keys(key, len(deltas), M)

    @jax.jit
    def through_the_wire(deltas, keys):
        wires = [Wire(compressor, frags, deltas, keys, p) for p in range(3)]
        pieces = [jax.vmap(w.decode)(jax.vmap(w.encode)(deltas, keys)) for w in wires]
        return assemble(wires, frags, pieces)

    ref = jax.jit(communication.compress, static_argnums=(0, 1))(
        compressor, frags, deltas, key
    )
    assert_trees_equal(through_the_wire(deltas, keys), ref)


def test_four_bit_message_is_pack4_codes_then_scales():
    compressor, frags, deltas, key = _problem("e3m0")
    keys = replica_keys(key, len(deltas), M)
    wire = Wire(compressor, frags, deltas, keys, 1)  # rows 0, 2 of W and of u
    assert list(wire.streams) == [4] and len(wire.groups) == 2
    one = [x[0] for x in deltas], [k[0] for k in keys]
    message = wire.encode(*one)
    codes, scales = [], []
    for g in wire.groups:
        x, k = one[0][g.leaf], one[1][g.leaf]
        rows = jr.split(k, x.shape[0])[g.rows]
        q = jax.vmap(compressor.quantize)(x[g.rows], rows)
        codes.append(q.codes.reshape(-1))
        scales.append(q.scale.reshape(-1))
    body = distributed.pack4(jnp.concatenate(codes))
    tail = jax.lax.bitcast_convert_type(jnp.concatenate(scales), jnp.uint8)
    expected = jnp.concatenate([body, tail.reshape(-1)])
    np.testing.assert_array_equal(np.asarray(message), np.asarray(expected))


class _Misdeclared(sdiloco.Compressor):
    """A compressor whose widths name a field its message does not have."""

    needs_key = False

    def __call__(self, x, key=None):
        return x

    def bits(self, shape):
        return 32 * math.prod(shape)

    def widths(self, shape):
        return {"values": 32, "index": 8}


def test_bad_input():
    with pytest.raises(ValueError, match="width=33"):
        pack_bits(jnp.zeros((2,), jnp.uint32), 33)
    with pytest.raises(ValueError, match="do not fit"):
        unpack_bits(jnp.zeros((2,), jnp.uint8), 3, 6)
    _, frags, deltas, key = _problem(None)
    keys = replica_keys(key, len(deltas), M)
    with pytest.raises(ValueError, match="one width per field"):
        Wire(_Misdeclared(), frags, deltas, keys, 0)
