"""The packed wire format of the sharded exchange: one `uint8` message per fragment.

A message is `codes ++ scales`: every scaling group's codes flattened and concatenated
(two 4-bit codes per byte with `pack4`; one byte for 8-bit formats; the raw bytes of
bf16 / fp32 casts and of the dense values of other compressors), then every group's
float32 scales as raw bytes. `Wire` is the static layout of one fragment's message,
built at trace time; it encodes one replica's Δ into its message and decodes a
message back into that replica's reconstruction.
"""

import dataclasses
import functools as ft
import math
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, UInt8

from ..compression import Quantized, Quantizer


def pack4(codes: UInt8[Array, "*batch n"]) -> UInt8[Array, "*batch half"]:
    """Two 4-bit codes per byte: element `2i` in the low nibble, `2i + 1` in the high.

    An odd count is padded with a zero code. Bits above the low four are dropped.

    Examples:
        >>> pack4(jnp.array([1, 2, 15], jnp.uint8)).tolist()
        [33, 15]
    """
    n = codes.shape[-1]
    codes = codes & jnp.uint8(0x0F)
    if n % 2:
        pad = jnp.zeros(codes.shape[:-1] + (1,), jnp.uint8)
        codes = jnp.concatenate([codes, pad], axis=-1)
    pairs = codes.reshape(codes.shape[:-1] + (-1, 2))
    return pairs[..., 0] | jnp.left_shift(pairs[..., 1], jnp.uint8(4))


def unpack4(packed: UInt8[Array, "*batch half"], n: int) -> UInt8[Array, "*batch n"]:
    """Inverse of `pack4`: the first `n` 4-bit codes.

    Examples:
        >>> unpack4(jnp.array([33, 15], jnp.uint8), 3).tolist()
        [1, 2, 15]
    """
    if not 0 <= n <= 2 * packed.shape[-1]:
        raise ValueError(f"n={n} codes do not fit in {packed.shape[-1]} bytes.")
    lo = packed & jnp.uint8(0x0F)
    hi = jnp.right_shift(packed, jnp.uint8(4))
    both = jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (-1,))
    return both[..., :n]


@dataclasses.dataclass(frozen=True)
class Group:
    """One scaling group of a fragment: a whole leaf, or some rows of a leaf."""

    leaf: int
    rows: np.ndarray | None  # row indices of a leaf labelled per row


class Wire:
    """The static layout of one fragment's message (built at trace time).

    A message is `codes ++ scales`: every group's codes flattened and concatenated
    (packed two per byte for 4-bit formats, otherwise their raw bytes), then every
    group's float32 scales as raw bytes.
    """

    def __init__(self, compressor, fragments, deltas, keys, p):
        self.compressor = compressor
        self.packed = isinstance(compressor, Quantizer) and (
            compressor.bits_per_element == 4
        )
        self.groups, self.shapes, self.dtypes, self.layout = [], [], [], []
        for i, labels in enumerate(fragments.labels):
            rows = None if labels.ndim == 0 else np.flatnonzero(labels == p)
            if (rows is None and int(labels) != p) or (
                rows is not None and not rows.size
            ):
                continue
            shape, key = deltas[i].shape[1:], keys[i].shape[1:]
            if rows is not None:
                shape, key = (len(rows),) + shape[1:], (len(rows),) + key
            self.groups.append(Group(i, rows))
            self.shapes.append(shape)
            self.dtypes.append(deltas[i].dtype)
            # Shapes and dtypes of this group's codes and scales, for one replica.
            self.layout.append(
                jax.eval_shape(
                    ft.partial(self._encode_group, rows=rows is not None),
                    jax.ShapeDtypeStruct(shape, deltas[i].dtype),
                    jax.ShapeDtypeStruct(key, keys[i].dtype),
                )
            )
        self.code_sizes = [math.prod(c.shape) for c, _ in self.layout]
        self.code_bytes = [
            n * c.dtype.itemsize for n, (c, _) in zip(self.code_sizes, self.layout)
        ]
        self.scale_sizes = [math.prod(s.shape) for _, s in self.layout]
        total = sum(self.code_sizes)
        self.body_bytes = -(-total // 2) if self.packed else sum(self.code_bytes)

    def _encode_group(self, x, key, *, rows):
        """Codes and float32 scales of one group's tensor (rows vmapped)."""
        c = self.compressor

        def one(x, key):
            if isinstance(c, Quantizer):
                q = c.quantize(x, key)
                return q.codes, q.scale
            y = x if c is None else c(x, key)
            return y, jnp.zeros((0,), jnp.float32)

        return jax.vmap(one)(x, key) if rows else one(x, key)

    def _decode_group(self, codes, scale, shape, dtype, rows):
        """The reconstruction of one group from its codes and scales."""
        c = self.compressor

        def one(codes, scale, shape):
            if isinstance(c, Quantizer):
                return c.dequantize(Quantized(codes, scale), shape, dtype)
            return codes

        if rows:
            return jax.vmap(lambda k, s: one(k, s, shape[1:]))(codes, scale)
        return one(codes, scale, shape)

    def encode(self, deltas: list[Array], keys: list[Array]) -> Array:
        """One replica's message, from its Δ and keys (as `communication.compress`)."""
        codes, scales = [], []
        for g in self.groups:
            x, k = deltas[g.leaf], keys[g.leaf]
            if g.rows is None:
                c, s = self._encode_group(x, k, rows=False)
            else:
                row_keys = jr.split(k, x.shape[0])[g.rows]
                c, s = self._encode_group(x[g.rows], row_keys, rows=True)
            codes.append(c.reshape(-1))
            scales.append(s.reshape(-1))
        if self.packed:
            body = pack4(jnp.concatenate(codes))
        else:
            body = jnp.concatenate([_to_bytes(c) for c in codes])
        return jnp.concatenate([body, _to_bytes(jnp.concatenate(scales))])

    def decode(self, message: Array) -> list[Array]:
        """One replica's reconstruction of every group, from its message."""
        body = message[: self.body_bytes]
        if self.packed:
            parts = _split(unpack4(body, sum(self.code_sizes)), self.code_sizes)
        else:
            parts = _split(body, self.code_bytes)
        scales = _from_bytes(
            message[self.body_bytes :], jnp.float32, (sum(self.scale_sizes),)
        )
        out = []
        for g, part, scale, (c, s), shape, dtype in zip(
            self.groups,
            parts,
            _split(scales, self.scale_sizes),
            self.layout,
            self.shapes,
            self.dtypes,
        ):
            codes = _from_bytes(part, c.dtype, c.shape)
            out.append(
                self._decode_group(
                    codes, scale.reshape(s.shape), shape, dtype, g.rows is not None
                )
            )
        return out


# ----------------------------------------------------------------------------- helpers


def _split(x: Array, sizes: list[int]) -> list[Array]:
    offsets = np.cumsum([0] + sizes)
    return [x[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def _to_bytes(x: Array) -> Array:
    x = x.reshape(-1)
    if x.dtype == jnp.uint8:
        return x
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: Array, dtype: Any, shape: tuple[int, ...]) -> Array:
    dtype = jnp.dtype(dtype)
    if dtype == jnp.uint8:
        return b.reshape(shape)
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dtype).reshape(shape)
    return jax.lax.bitcast_convert_type(b.reshape(-1, dtype.itemsize), dtype).reshape(
        shape
    )
