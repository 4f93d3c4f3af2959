"""Decoder-only transformer with blocks stacked on a layer axis.

The model family of the Streaming DiLoCo paper (Chinchilla-style decoder, QK-norm and a
PaLM z-loss of 1e-4; Douillard et al., 2025, §2.1 and Table 2). What the paper leaves
open follows nanodo (Liu et al., 2024): pre-norm, GELU MLP with hidden = 4 × width, no
biases, tied input/output embedding. Positions are rotary and the norms are RMSNorm.

Every transformer block lives in **one** `Block` whose array leaves carry a leading
layer axis of size `num_layers`; `Transformer.__call__` applies them with
`jax.lax.scan`. A fragment of the model (Streaming DiLoCo, §2.2) is therefore a set of
indices into that axis of every leaf of `model.blocks`. The embedding and the final norm
have no layer axis.

Batch format (used by `loss_fn` and produced by `sdiloco.lab.data`):
`{"inputs": int32[B, L], "targets": int32[B, L]}`, where `targets` are `inputs` shifted
left by one token.
"""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Integer, PRNGKeyArray


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the decoder-only transformer."""

    vocab_size: int
    """Number of token ids (256 for byte-level data, 32,000 in the paper)."""
    num_layers: int
    """Number of transformer blocks (the length of the stacked layer axis)."""
    width: int
    """Model (residual stream) dimension d."""
    num_heads: int
    """Attention heads; head size is `width // num_heads` (64 for the paper scales)."""
    mlp_hidden: int
    """Hidden size of the GELU MLP (4 × width in the paper family)."""
    seq_len: int
    """Training context length L (the longest input `__call__` accepts)."""
    z_loss: float = 1e-4
    """Coefficient of the PaLM z-loss `mean(logsumexp(logits)²)` (paper §2.1)."""
    dtype: str = "float32"
    """Parameter and activation dtype: "float32" or "bfloat16"."""
    init_std: float = 0.02
    """Std of the normal init of the (tied) embedding; kernels use 1/sqrt(fan_in)."""
    rope_base: float = 10_000.0
    """Base of the rotary position frequencies."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    scan_unroll: int = 1
    """Blocks unrolled per iteration of the scan over layers (1: a rolled loop, cheap to
    compile at any depth). The tiny presets unroll fully: on XLA:CPU the backward pass
    of a rolled scan costs about twice as much as the unrolled one."""

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "width", "num_heads", "mlp_hidden"):
            _check(name, getattr(self, name), "an int >= 1", _is_pos_int)
        _check("seq_len", self.seq_len, "an int >= 1", _is_pos_int)
        if self.width % self.num_heads != 0:
            raise ValueError(
                f"ModelConfig.width={self.width} must be divisible by "
                f"num_heads={self.num_heads}."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"ModelConfig.width // num_heads = {self.head_dim} must be even "
                "(rotary positions rotate pairs of features)."
            )
        _check("z_loss", self.z_loss, "a float >= 0", lambda v: v >= 0)
        _check("dtype", self.dtype, f"one of {sorted(_DTYPES)}", _DTYPES.__contains__)
        _check("init_std", self.init_std, "a float > 0", lambda v: v > 0)
        _check("rope_base", self.rope_base, "a float > 0", lambda v: v > 0)
        _check("norm_eps", self.norm_eps, "a float > 0", lambda v: v > 0)
        _check("scan_unroll", self.scan_unroll, "an int >= 1", _is_pos_int)

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.width // self.num_heads

    @property
    def jnp_dtype(self):
        """The parameter dtype as a NumPy/JAX dtype."""
        return _DTYPES[self.dtype]

    def num_params_per_layer(self) -> int:
        """Parameters of one transformer block (attention, MLP and three norms)."""
        d, f, k = self.width, self.mlp_hidden, self.head_dim
        attention = 4 * d * self.num_heads * k  # q, k, v, out projections
        mlp = 2 * d * f
        norms = 2 * d + 2 * k  # pre-attention, pre-MLP; query and key norms
        return attention + mlp + norms

    def num_params(self, include_embedding: bool = True) -> int:
        """Number of parameters, computed analytically.

        Args:
            include_embedding: Count the tied `vocab_size × width` embedding too.

        Returns:
            `L·(4·d·H·K + 2·d·F + 2·d + 2·K) + d (+ V·d)`; with K = 64, F = 4d this is
            the `12·L·d²` of the paper's Table 2 plus the norms.

        Examples:
            >>> PAPER_SCALES["35M"].num_params()
            35265792
        """
        n = self.num_layers * self.num_params_per_layer() + self.width
        if include_embedding:
            n += self.vocab_size * self.width
        return n


def _is_pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check(name: str, value, allowed: str, ok) -> None:
    if not ok(value):
        raise ValueError(
            f"ModelConfig.{name}={value!r} is invalid; expected {allowed}."
        )


def _paper(hidden: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=32_000,
        num_layers=layers,
        width=hidden // 4,
        num_heads=heads,
        mlp_hidden=hidden,
        seq_len=1024,
    )


PAPER_SCALES: dict[str, ModelConfig] = {
    "35M": _paper(2048, 6, 8),
    "100M": _paper(3072, 9, 12),
    "200M": _paper(4096, 12, 16),
    "300M": _paper(5120, 15, 20),
    "500M": _paper(6144, 18, 24),
    "1B": _paper(8192, 24, 32),
    "4B": _paper(12288, 36, 48),
}
"""The paper's Table 2 scales: "Hidden dim" is the MLP size, width = hidden / 4, head
size 64, vocabulary 32,000, sequence length 1,024 (docs/paper.md §2.1, §1.13.3)."""


def _tiny(width: int, layers: int, heads: int, seq_len: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=256,
        num_layers=layers,
        width=width,
        num_heads=heads,
        mlp_hidden=4 * width,
        seq_len=seq_len,
        scan_unroll=layers,
    )


TINY_SCALES: dict[str, ModelConfig] = {
    "tiny-xxxs": _tiny(8, 6, 1, 64),  # 6,856 params
    "tiny-xxs": _tiny(16, 6, 1, 64),  # 22,928 params
    "tiny-xs": _tiny(32, 6, 2, 64),  # 82,528
    "tiny-xs+": _tiny(40, 6, 2, 64),  # 126,200; a rung between tiny-xs and tiny-s
    "tiny-s": _tiny(64, 6, 2, 64),  # 312,512
    "tiny-m": _tiny(96, 6, 2, 64),  # 689,952
    "tiny-l": _tiny(128, 6, 4, 64),  # 1,214,464
    "tiny-deep": _tiny(64, 12, 2, 128),  # 608,576; 4 fragments of 3 layers
}
"""Byte-level (vocab 256) models small enough to train on two CPU cores. Like the
paper's 35M model they have 6 layers (two fragments of 3 blocks plus the non-block
fragment); the ladder shares a sequence length of 64 (so a step is the same tokens at
every size) and spans 177x in parameters (tiny-xxxs, the bottom rung of the tuned
ladder, is cheap enough to tune in minutes); tiny-deep has 12 layers for fragment
ablations."""


def preset(name: str) -> ModelConfig:
    """Return the `ModelConfig` of a named scale (`PAPER_SCALES` or `TINY_SCALES`).

    Args:
        name: e.g. "35M", "1B" or "tiny-s".

    Returns:
        The frozen config.

    Examples:
        >>> preset("tiny-deep").num_layers
        12
    """
    if name in PAPER_SCALES:
        return PAPER_SCALES[name]
    if name in TINY_SCALES:
        return TINY_SCALES[name]
    raise ValueError(
        f"Unknown model preset {name!r}; expected one of "
        f"{sorted(PAPER_SCALES) + sorted(TINY_SCALES)}."
    )


class RMSNorm(eqx.Module):
    """Root-mean-square norm over the last axis with a learned scale (no bias)."""

    scale: Float[Array, " n"]
    eps: float = eqx.field(static=True)

    def __init__(self, size: int, *, eps: float, dtype):
        self.scale = jnp.ones((size,), dtype=dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch n"]) -> Float[Array, "*batch n"]:
        x32 = x.astype(jnp.float32)
        ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(ms + self.eps)
        scale = jnp.reshape(self.scale.astype(jnp.float32), (1,) * (x.ndim - 1) + (-1,))
        return (y * scale).astype(x.dtype)


class Attention(eqx.Module):
    """Causal multi-head self-attention with QK-norm and rotary positions."""

    w_q: Float[Array, "d h k"]
    w_k: Float[Array, "d h k"]
    w_v: Float[Array, "d h k"]
    w_o: Float[Array, "h k d"]
    q_norm: RMSNorm
    k_norm: RMSNorm
    rope_base: float = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        d, h, k = config.width, config.num_heads, config.head_dim
        dtype = config.jnp_dtype
        # One draw for all four projections (fan-in d = h·k for each); see `_normal`.
        w_4xDxHxK = _normal(key, (4, d, h, k), d, dtype)
        self.w_q, self.w_k, self.w_v = w_4xDxHxK[0], w_4xDxHxK[1], w_4xDxHxK[2]
        self.w_o = jnp.reshape(w_4xDxHxK[3], (h, k, d))
        self.q_norm = RMSNorm(k, eps=config.norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(k, eps=config.norm_eps, dtype=dtype)
        self.rope_base = config.rope_base

    def __call__(self, x_BxLxD: Float[Array, "B L D"]) -> Float[Array, "B L D"]:
        q_BxLxHxK = self.q_norm(jnp.einsum("bld,dhk->blhk", x_BxLxD, self.w_q))
        k_BxLxHxK = self.k_norm(jnp.einsum("bld,dhk->blhk", x_BxLxD, self.w_k))
        v_BxLxHxK = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.w_v)
        q_BxLxHxK = _rotary(q_BxLxHxK, self.rope_base)
        k_BxLxHxK = _rotary(k_BxLxHxK, self.rope_base)

        L, K = x_BxLxD.shape[1], q_BxLxHxK.shape[-1]
        att_BxHxLxL = jnp.einsum(
            "bqhk,bshk->bhqs",
            q_BxLxHxK.astype(jnp.float32),
            k_BxLxHxK.astype(jnp.float32),
        ) / math.sqrt(K)
        causal_1x1xLxL = jnp.tril(jnp.ones((L, L), dtype=bool))[None, None]
        att_BxHxLxL = jnp.where(causal_1x1xLxL, att_BxHxLxL, -jnp.inf)
        att_BxHxLxL = jax.nn.softmax(att_BxHxLxL, axis=-1).astype(x_BxLxD.dtype)
        out_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", att_BxHxLxL, v_BxLxHxK)
        return jnp.einsum("blhk,hkd->bld", out_BxLxHxK, self.w_o)


class MLP(eqx.Module):
    """Two-matrix GELU MLP without biases."""

    w_up: Float[Array, "d f"]
    w_down: Float[Array, "f d"]

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        d, f = config.width, config.mlp_hidden
        w_2xDxF = _normal(key, (2, d, f), 1, config.jnp_dtype)  # one draw
        self.w_up = w_2xDxF[0] * (1.0 / math.sqrt(d))
        self.w_down = jnp.reshape(w_2xDxF[1], (f, d)) * (1.0 / math.sqrt(f))

    def __call__(self, x_BxLxD: Float[Array, "B L D"]) -> Float[Array, "B L D"]:
        h_BxLxF = jax.nn.gelu(jnp.einsum("bld,df->blf", x_BxLxD, self.w_up))
        return jnp.einsum("blf,fd->bld", h_BxLxF, self.w_down)


class Block(eqx.Module):
    """One pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    Inside `Transformer` every array leaf of the (single) `Block` has an extra leading
    layer axis; `__call__` here acts on one layer's slice.
    """

    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: MLP

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        k_attn, k_mlp = jr.split(key)
        dtype = config.jnp_dtype
        self.attn_norm = RMSNorm(config.width, eps=config.norm_eps, dtype=dtype)
        self.attn = Attention(config, key=k_attn)
        self.mlp_norm = RMSNorm(config.width, eps=config.norm_eps, dtype=dtype)
        self.mlp = MLP(config, key=k_mlp)

    def __call__(self, x_BxLxD: Float[Array, "B L D"]) -> Float[Array, "B L D"]:
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD))
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))


# This differs from (or fills gaps in) the paper in:
# 1. The paper names only "Chinchilla architecture", QKNorm and z-loss 1e-4; the norm
#    type (RMSNorm, also for QK-norm), rotary positions, GELU, tied embeddings and the
#    init are nanodo-like choices (docs/paper.md §2.1 marks them [not found]).
# 2. The companion paper uses a 32,768-token vocabulary and length 2,048; the presets
#    follow Streaming DiLoCo's Table 2 (32,000) and its C4 length 1,024.
class Transformer(eqx.Module):
    """Decoder-only transformer; `blocks` are stacked on a leading layer axis.

    Init (like nanodo, which uses fan-in scaled kernels): every kernel is normal with
    std 1/sqrt(fan_in); the tied embedding is normal with std `config.init_std` (0.02),
    so the logits start small and the initial loss is ≈ ln(vocab_size); norm scales
    start at 1.

    Attributes:
        embedding: `[V, D]`, used for the input lookup and (transposed) the output.
        blocks: one `Block` whose every array leaf has leading axis `num_layers`.
        final_norm: RMSNorm before the output projection.
        config: the `ModelConfig` (static).
    """

    embedding: Float[Array, "v d"]
    blocks: Block
    final_norm: RMSNorm
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        k_emb, k_blocks = jr.split(key)
        dtype = config.jnp_dtype
        shape = (config.vocab_size, config.width)
        self.embedding = config.init_std * _normal(k_emb, shape, 1, dtype)
        block_keys = jr.split(k_blocks, config.num_layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(block_keys)
        self.final_norm = RMSNorm(config.width, eps=config.norm_eps, dtype=dtype)
        self.config = config

    def __call__(self, tokens_BxL: Integer[Array, "B L"]) -> Float[Array, "B L V"]:
        """Next-token logits (float32) for a batch of token ids.

        Args:
            tokens_BxL: token ids in `[0, vocab_size)`, with `L <= config.seq_len`.

        Returns:
            Logits `[B, L, vocab_size]` in float32; position `i` sees tokens `<= i`.
        """
        if tokens_BxL.shape[1] > self.config.seq_len:
            raise ValueError(
                f"Sequence length {tokens_BxL.shape[1]} exceeds "
                f"ModelConfig.seq_len={self.config.seq_len}."
            )
        x_BxLxD = jnp.take(self.embedding, tokens_BxL, axis=0)
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def apply_block(x_BxLxD, block_params):
            block = eqx.combine(block_params, static)
            return block(x_BxLxD), None

        x_BxLxD, _ = jax.lax.scan(
            apply_block, x_BxLxD, params, unroll=self.config.scan_unroll
        )
        x_BxLxD = self.final_norm(x_BxLxD)
        return jnp.einsum(
            "bld,vd->blv",
            x_BxLxD.astype(jnp.float32),
            self.embedding.astype(jnp.float32),
        )


def loss_with_aux(
    model: Transformer, batch: dict[str, Integer[Array | np.ndarray, "B L"]]
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Cross-entropy plus PaLM z-loss, and the parts separately.

    The training objective of the paper (§2.1: "a Z-loss … with a factor of 1e−4"):
    `mean(CE) + z_loss · mean(logsumexp(logits)²)`, averaged over all `B·L` positions.

    Args:
        model: the transformer.
        batch: `{"inputs": int[B, L], "targets": int[B, L]}`.

    Returns:
        `(loss, aux)` with `aux = {"ce": mean cross-entropy in nats (what eval reports),
        "z": mean logsumexp² (before the coefficient)}`.
    """
    inputs, targets = batch["inputs"], batch["targets"]
    logits_BxLxV = model(jnp.asarray(inputs))
    lse_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_BxL = jnp.take_along_axis(
        logits_BxLxV, jnp.asarray(targets)[..., None], axis=-1
    )[..., 0]
    ce = jnp.mean(lse_BxL - target_BxL)
    z = jnp.mean(jnp.square(lse_BxL))
    loss = ce + model.config.z_loss * z
    return loss, {"ce": ce, "z": z}


def sequence_losses(
    model: Transformer, batch: dict[str, Integer[Array | np.ndarray, "B L"]]
) -> Float[Array, " B"]:
    """Mean cross-entropy of each sequence of `batch`, in nats per token (no z-loss).

    The evaluation's unit: `mean(sequence_losses(model, batch))` is `loss_with_aux`'s
    `"ce"` for a batch, and a set of windows is scored as the mean over its windows.
    """
    logits_BxLxV = model(jnp.asarray(batch["inputs"]))
    lse_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_BxL = jnp.take_along_axis(
        logits_BxLxV, jnp.asarray(batch["targets"])[..., None], axis=-1
    )[..., 0]
    return jnp.mean(lse_BxL - target_BxL, axis=-1)


def loss_fn(
    model: Transformer, batch: dict[str, Integer[Array | np.ndarray, "B L"]]
) -> Float[Array, ""]:
    """Training loss: `loss_with_aux(model, batch)[0]`.

    Args:
        model: the transformer.
        batch: `{"inputs": int[B, L], "targets": int[B, L]}`.

    Returns:
        Scalar float32 loss (cross-entropy + z-loss).
    """
    return loss_with_aux(model, batch)[0]


def bits_per_byte(loss_nats: float | Float[Array, ""]) -> float | Float[Array, ""]:
    """Convert a per-byte cross-entropy in nats to bits per byte (`loss / ln 2`).

    Only meaningful for byte-level tokens (vocab 256), where one token is one byte.

    Examples:
        >>> round(bits_per_byte(math.log(256)), 6)
        8.0
    """
    return loss_nats / math.log(2)


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int, dtype) -> Array:
    """I.i.d. normal draws with std `1/sqrt(fan_in)`.

    Drawn flat and reshaped: XLA:CPU compiles a rank-4 `jr.normal` about 5× slower
    than a rank-1 one, and every random call is compiled separately, so the model
    makes one flat draw per module to keep start-up (and the tests) fast.
    """
    flat = jr.normal(key, (math.prod(shape),), dtype=dtype)
    return jnp.reshape(flat, shape) * (1.0 / math.sqrt(fan_in))


def _rotary(x_BxLxHxK: Array, base: float) -> Array:
    """Rotate feature pairs `(i, i + K/2)` by angle `position · base^(-2i/K)`."""
    L, K = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1]
    inv_freq = base ** (-jnp.arange(0, K // 2, dtype=jnp.float32) * (2.0 / K))
    angle_LxK2 = jnp.arange(L, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(angle_LxK2)[None, :, None, :]
    sin = jnp.sin(angle_LxK2)[None, :, None, :]
    x32 = x_BxLxHxK.astype(jnp.float32)
    x1, x2 = x32[..., : K // 2], x32[..., K // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)
