"""Tests of the stacked-block transformer, its presets and its loss."""

import dataclasses
import functools as ft
import math

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

from sdiloco.lab.model import (
    PAPER_SCALES,
    TINY_SCALES,
    ModelConfig,
    Transformer,
    _rotary,
    bits_per_byte,
    loss_fn,
    loss_with_aux,
    preset,
)


SMALL = ModelConfig(
    vocab_size=256, num_layers=3, width=32, num_heads=2, mlp_hidden=128, seq_len=16
)

# docs/paper.md §2.1, derived sizes: (non-embedding, + tied embedding), in parameters.
PAPER_COUNTS = {
    "35M": (18.9e6, 35.3e6),
    "100M": (63.7e6, 88.3e6),
    "200M": (151.0e6, 183.8e6),
    "300M": (294.9e6, 335.9e6),
    "500M": (509.6e6, 558.8e6),
    "1B": (1208e6, 1273.5e6),
    "4B": (4077e6, 4175e6),
}
# Table 2: hidden dim, layers, heads.
TABLE_2 = {
    "35M": (2048, 6, 8),
    "100M": (3072, 9, 12),
    "200M": (4096, 12, 16),
    "300M": (5120, 15, 20),
    "500M": (6144, 18, 24),
    "1B": (8192, 24, 32),
    "4B": (12288, 36, 48),
}


# XLA compilations dominate the runtime on CPU, so the tests share one model, build
# data with NumPy, and go through three jitted functions: `_forward`,
# `_logits_by_python_loop` and the training step of `test_jit_..._learns`.
@ft.cache
def _small_model() -> Transformer:
    return eqx.filter_jit(Transformer)(SMALL, key=jr.key(0))


def _tokens(seed: int = 0, batch: int = 2, length: int = SMALL.seq_len) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, SMALL.vocab_size, (batch, length), dtype=np.int32)


def _batch(seed: int = 0, batch: int = 2) -> dict[str, np.ndarray]:
    tokens = _tokens(seed, batch, SMALL.seq_len + 1)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@eqx.filter_jit
def _forward(model, batch):
    """(loss_fn, loss_with_aux, logits) in one compiled function."""
    return loss_fn(model, batch), loss_with_aux(model, batch), model(batch["inputs"])


def _logits(model, tokens):
    return _forward(model, {"inputs": tokens, "targets": tokens})[2]


def _count(model) -> int:
    """Number of parameters; works for arrays and for `jax.ShapeDtypeStruct` leaves."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(model))


def test_output_shape_and_dtype():
    logits = _logits(_small_model(), _tokens())
    assert logits.shape == (2, SMALL.seq_len, SMALL.vocab_size)
    assert logits.dtype == jnp.float32


def test_blocks_are_stacked_on_a_layer_axis():
    model = _small_model()
    leaves = jax.tree.leaves(model.blocks)
    assert len(leaves) == 10  # 2 norms, q/k/v/o, q/k norms, 2 MLP matrices
    assert all(leaf.shape[0] == SMALL.num_layers for leaf in leaves)
    assert model.embedding.shape == (SMALL.vocab_size, SMALL.width)


@hypothesis.given(j=st.integers(0, SMALL.seq_len - 1), shift=st.integers(1, 255))
def test_causal(j, shift):
    """Changing token j changes no logit at positions < j (but does change some >= j)."""
    model, tokens = _small_model(), _tokens()
    changed = tokens.copy()
    changed[:, j] = (changed[:, j] + shift) % SMALL.vocab_size
    before, after = _logits(model, tokens), _logits(model, changed)
    np.testing.assert_allclose(before[:, :j], after[:, :j], rtol=0, atol=1e-6)
    assert not np.allclose(before[:, j:], after[:, j:])


@eqx.filter_jit
def _logits_by_python_loop(model, tokens):
    params, static = eqx.partition(model.blocks, eqx.is_array)
    x = jnp.take(model.embedding, tokens, axis=0)
    for i in range(model.config.num_layers):
        block = eqx.combine(jax.tree.map(lambda a: a[i], params), static)
        x = block(x)
    return jnp.einsum("bld,vd->blv", model.final_norm(x), model.embedding)


def test_scan_equals_python_loop():
    model, tokens = _small_model(), _tokens(1)
    expected = _logits_by_python_loop(model, tokens)
    np.testing.assert_allclose(_logits(model, tokens), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(TINY_SCALES))
def test_param_count_formula_tiny(name):
    config = TINY_SCALES[name]
    model = eqx.filter_eval_shape(Transformer, config, key=jr.key(0))
    assert _count(model) == config.num_params()
    assert _count(model.blocks) + config.width == config.num_params(
        include_embedding=False
    )
    assert _count(model.blocks) == config.num_layers * config.num_params_per_layer()


def test_tiny_ladder():
    sizes = {name: c.num_params() for name, c in TINY_SCALES.items()}
    assert len(sizes) >= 4
    assert max(sizes.values()) >= 10 * min(sizes.values())
    assert any(
        c.num_layers >= 12 and c.num_layers % 3 == 0 for c in TINY_SCALES.values()
    )
    for c in TINY_SCALES.values():
        assert c.vocab_size == 256 and 64 <= c.seq_len <= 128
        assert c.mlp_hidden == 4 * c.width


@pytest.mark.parametrize("name", sorted(PAPER_SCALES))
def test_paper_scales_abstract(name):
    """Each Table 2 scale builds abstractly and matches docs/paper.md §2.1 (1 %)."""
    config = preset(name)
    hidden, layers, heads = TABLE_2[name]
    assert (config.mlp_hidden, config.num_layers, config.num_heads) == TABLE_2[name]
    assert config.width == hidden // 4 and config.head_dim == 64
    assert config.vocab_size == 32_000 and config.seq_len == 1024
    model = eqx.filter_eval_shape(Transformer, config, key=jr.key(0))
    assert isinstance(model.embedding, jax.ShapeDtypeStruct)
    non_embedding, total = PAPER_COUNTS[name]
    assert _count(model) == config.num_params()
    assert config.num_params() == pytest.approx(total, rel=0.01)
    assert config.num_params(include_embedding=False) == pytest.approx(
        non_embedding, rel=0.01
    )


def test_initial_loss_near_log_vocab():
    loss, (loss2, aux), _ = _forward(_small_model(), _batch())
    assert set(aux) == {"ce", "z"}
    assert jnp.isfinite(loss) and loss == loss2
    assert abs(float(aux["ce"]) - math.log(SMALL.vocab_size)) < 0.1
    np.testing.assert_allclose(loss, aux["ce"] + SMALL.z_loss * aux["z"], rtol=1e-6)


def test_loss_matches_optax_reference():
    batch = _batch(1)
    _, (_, aux), logits = _forward(_small_model(), batch)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    z = jnp.square(jax.nn.logsumexp(logits, axis=-1))
    np.testing.assert_allclose(aux["ce"], jnp.mean(ce), rtol=1e-5)
    np.testing.assert_allclose(aux["z"], jnp.mean(z), rtol=1e-5)


def test_bf16_params():
    config = dataclasses.replace(SMALL, dtype="bfloat16")
    abstract = eqx.filter_eval_shape(Transformer, config, key=jr.key(0))
    assert {x.dtype for x in jax.tree.leaves(abstract)} == {jnp.dtype(jnp.bfloat16)}
    # The f32 test model cast to bf16 on the host (no second init or per-leaf casts to
    # compile), with the bf16 config.
    leaves = [
        jnp.asarray(np.asarray(x).astype(jnp.bfloat16))
        for x in jax.tree.leaves(_small_model())
    ]
    model = jax.tree.unflatten(jax.tree.structure(abstract), leaves)
    assert model.config.dtype == "bfloat16"
    batch = _batch()
    grads = jax.eval_shape(eqx.filter_grad(loss_fn), model, batch)
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
    loss, (_, aux), logits = _forward(model, batch)
    assert loss.dtype == logits.dtype == jnp.float32
    assert jnp.isfinite(loss)
    assert abs(float(aux["ce"]) - math.log(SMALL.vocab_size)) < 0.1


def test_jit_loss_and_grad_compiles_and_learns():
    """A few jitted SGD steps on one batch lower the loss (the gradient is right)."""
    model, batch = _small_model(), _batch(2, batch=4)

    @eqx.filter_jit
    def step(model):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        return jax.tree.map(lambda p, g: p - 1.0 * g, model, grads), loss

    losses = []
    for _ in range(5):
        model, loss = step(model)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses
    assert jax.tree.structure(model) == jax.tree.structure(_small_model())


@ft.cache
def _rotated(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    length, dim = 12, 8
    x = np.random.default_rng(seed).normal(size=(2, 1, 1, dim)).astype(np.float32)
    x = np.broadcast_to(x, (2, length, 1, dim))  # the same q (and k) at every position
    rotated = jax.jit(_rotary, static_argnums=1)(x, 10_000.0)
    return np.asarray(rotated[0, :, 0]), np.asarray(rotated[1, :, 0]), np.asarray(x)


@hypothesis.given(
    shift=st.integers(0, 6),
    i=st.integers(0, 5),
    j=st.integers(0, 5),
    seed=st.integers(0, 2),
)
def test_rotary_depends_on_relative_position(shift, i, j, seed):
    """Rotated q·k depends only on the offset i - j (the point of rotary positions)."""
    q, k, x = _rotated(seed)
    np.testing.assert_allclose(
        q[i] @ k[j], q[i + shift] @ k[j + shift], rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(np.linalg.norm(q[i]), np.linalg.norm(x[0, 0]), 1e-5)


def test_sequence_longer_than_config_raises():
    with pytest.raises(ValueError, match="seq_len"):
        _logits(_small_model(), _tokens(length=SMALL.seq_len + 1))


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", 0),
        ("num_layers", 0),
        ("width", -4),
        ("num_heads", 3),  # 32 is not divisible by 3
        ("num_heads", 32),  # head size 1 is odd
        ("mlp_hidden", 0),
        ("seq_len", 0),
        ("z_loss", -1.0),
        ("dtype", "float16"),
        ("init_std", 0.0),
    ],
)
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(SMALL, **{field: value})


def test_unknown_preset():
    with pytest.raises(ValueError, match="tiny-s"):
        preset("tiny-xxl")


def test_bits_per_byte():
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)
    np.testing.assert_allclose(bits_per_byte(jnp.array(math.log(2))), 1.0, rtol=1e-6)
