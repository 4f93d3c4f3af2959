"""The low-precision quantizer of Streaming DiLoCo §2.4: per-group scaling and codes.

The paper does not say how E3M0 was scaled or rounded (docs/paper.md §1.8, §7.7). Our
choices follow docs/contract.md §2:

1. Scaling: each group (the whole tensor, a row, or a block of `block_size` elements)
   sends its max |x| ("amax") as float32 metadata. The group is normalised by
   `M / amax` so that amax lands on the format's largest value M.
2. Rounding: either nearest, with ties going to the neighbour whose magnitude code is
   even (IEEE round-half-to-even on the magnitude bit pattern for e2m1 / e4m3 / e5m2,
   and the same rule on the exponent code for e3m0 and on the integer for int4), or
   stochastic and unbiased.
3. E3M0 follows the eXmY convention (Agrawal et al., 2024): bias 3, exponent code 0 is
   zero, and the magnitudes are 2^-2 … 2^4. It has no inf or NaN.

Scaling (1) lives here; the value tables and rounding (2, 3) in `formats`.
"""

import math
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from . import formats
from .base import SCALE_BITS, Compressor, Quantized, check_key, compute_dtype
from .formats import FORMATS, ROUNDINGS


GRANULARITIES: tuple[str, ...] = ("tensor", "row", "block")
"""Scaling groups: the whole tensor, each slice along the last axis, or flat blocks."""


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
        return formats.BITS_PER_ELEMENT[self.format]

    @property
    def scaled(self) -> bool:
        """Whether the format sends one float32 amax per group."""
        return self.format not in formats.CAST_FORMATS

    def num_groups(self, shape: tuple[int, ...]) -> int:
        """Number of scaling groups (metadata entries) for a tensor of this shape."""
        return group_layout(self, tuple(shape))[0] if self.scaled else 0

    def bits(self, shape: tuple[int, ...]) -> int:
        """Exact bits on the wire: numel x bits/element + groups x 32 (float32 amax).

        Padding of a partial last block is not counted. `bf16` costs 16 bits per element
        and `fp32` costs 32, with no metadata.
        """
        shape = tuple(shape)
        return math.prod(shape) * self.bits_per_element + SCALE_BITS * self.num_groups(
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
            return formats.finite_values(jnp.bfloat16, np.uint16).copy()
        return formats.signed_table(self.format).copy()

    def __call__(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """Round trip `dequantize(quantize(x, key), x.shape, x.dtype)` (Alg. 2 l.8)."""
        return self.dequantize(self.quantize(x, key), x.shape, x.dtype)

    def encode(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> dict[str, Array]:
        """The message: `{"codes": ..., "scale": ...}` of `quantize`."""
        return self.quantize(x, key)._asdict()

    def decode(
        self, message: dict[str, Array], shape: tuple[int, ...], dtype: DTypeLike
    ) -> Float[Array, "..."]:
        """`dequantize` of the message."""
        return self.dequantize(Quantized(**message), shape, dtype)

    def widths(self, shape: tuple[int, ...]) -> dict[str, int]:
        """Codes at the format's bits per element, scales at 32 bits."""
        del shape
        return {"codes": self.bits_per_element, "scale": SCALE_BITS}

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
        key = check_key(self, key)
        cdtype = compute_dtype(x.dtype)
        xc = x.astype(cdtype)
        if not self.scaled:
            return Quantized(
                formats.cast(xc, self.format, key), jnp.zeros((0,), jnp.float32)
            )
        mags = formats.magnitudes(self.format)
        top = float(mags[-1])
        num_groups, group_size, numel = group_layout(self, x.shape)
        groups = to_groups(xc.reshape(-1), num_groups, group_size)
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
            mag_code = formats.round_nearest(a, mags)
        else:
            assert key is not None  # check_key raised on a missing key
            u = jr.uniform(key, a.shape, cdtype)
            mag_code = formats.round_stochastic(a, mags, u)
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
        cdtype = compute_dtype(dtype)
        # values / M, rounded once to cdtype: the same numbers as dividing in cdtype,
        # as a table, which XLA cannot rewrite into a multiplication by a rounded 1/M.
        table = formats.signed_table(self.format)
        table = jnp.asarray(table / table[-1], cdtype)
        num_groups, group_size, numel = group_layout(self, shape)
        t = table[q.codes.reshape(-1).astype(jnp.int32)]
        groups = to_groups(t, num_groups, group_size)
        y = groups * q.scale.astype(cdtype)[:, None]
        return y.reshape(-1)[:numel].reshape(shape).astype(dtype)


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
            `"e2m1"`, `"e1m2"`, `"int4"` (±{0..7}), `"int2"` (±{0, 1}, ternary in
            two bits), `"int8"` (±{0..127}), `"e4m3"` (max 448), `"e5m2"` (max
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
    return Quantizer(
        format=format, granularity=granularity, block_size=block_size, rounding=rounding
    )


# ----------------------------------------------------------------------------- helpers


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"Quantizer {field}={value!r} is not supported; expected one of {allowed}."
        )


def group_layout(q: Any, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(num_groups, group_size, numel) of a compressor with a `granularity` and a
    `block_size` (a `Quantizer`, a `MinMax`); groups are padded to group_size."""
    numel = math.prod(shape)
    if q.granularity == "row" and len(shape) >= 2:
        return math.prod(shape[:-1]), shape[-1], numel
    if q.granularity == "block":
        return -(-numel // q.block_size), q.block_size, numel
    return 1, numel, numel


def to_groups(flat: Array, num_groups: int, group_size: int) -> Array:
    """`flat` as `[num_groups, group_size]`, the last group padded with zeros."""
    pad = num_groups * group_size - flat.shape[0]
    if pad:
        flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
    return flat.reshape(num_groups, group_size)
