"""The packed wire format of the exchanges: one `uint8` message per fragment.

A message carries what the compressor encodes (`Compressor.encode`: a dict of named
arrays, a chain's next stage nested under `"values"`), field by field at the width the
compressor gives it (`Compressor.widths`):

* **integer fields** (quantization codes, positions of kept values, seeds) are packed at
  their width: every integer field of the same width, over all of the fragment's
  groups, goes into one little-endian bitstream (`pack_bits`: element `i` takes bits
  `[i·w, (i+1)·w)`, least significant first), padded once to a whole byte. 4-bit codes
  are therefore two per byte, element `2i` in the low nibble (`pack4`); a field of
  width 0 (an index into a single entry) takes no bytes;
* **float fields** (kept values, amax scales, min and max, bf16 casts) travel as their
  raw bytes.

The message is the bitstreams in increasing width, then every group's float fields in
group order. Its bytes are the compressor's `bits` over the fragment, divided by 8 and
rounded up once per width (`tests/test_wire.py`); for a 4-bit quantizer it is the
codes two per byte followed by the float32 scales. Without a compressor, the values
travel as their raw (float32) bytes.

`Wire` is the static layout of one fragment's message, built at trace time; it encodes
one replica's Δ into its message and decodes a message back into that replica's
reconstruction: `decode(encode(Δ))` is bitwise the simulation's `compressor(Δ, key)`,
with the simulation's keys (`communication.compress`).
"""

import dataclasses
import functools as ft
import math
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Shaped, UInt8

from ..compression import Compressor


MAX_WIDTH = 32
"""The widest integer field `pack_bits` packs (a uint32 or int32 field)."""


def pack_bits(codes: Shaped[Array, "*batch n"], width: int) -> UInt8[Array, "*batch b"]:
    """Pack the low `width` bits of each code into bytes, least significant first.

    Element `i` takes bits `[i·width, (i+1)·width)` of the stream, and bit `j` of the
    stream is bit `j % 8` of byte `j // 8`: `b = ceil(n·width / 8)` bytes, the last
    one padded with zero bits. Bits above the low `width` are dropped. Widths that
    divide 8 shift codes into place; multiples of 8 split them into bytes; the others
    go through their bits.

    Args:
        codes: integer codes (any integer dtype), packed along the last axis.
        width: bits per code, 0 to 32 (0: nothing is sent).

    Examples:
        >>> pack_bits(jnp.array([1, 2, 15], jnp.uint8), 4).tolist()
        [33, 15]
        >>> pack_bits(jnp.array([5, 63, 1], jnp.int32), 6).tolist()  # 18 bits
        [197, 31, 0]
    """
    _check_width(width)
    batch, n = codes.shape[:-1], codes.shape[-1]
    size = -(-n * width // 8)
    if width == 0 or n == 0:
        return jnp.zeros(batch + (size,), jnp.uint8)
    u = _as_uint32(codes)
    if width < MAX_WIDTH:
        u = u & jnp.uint32((1 << width) - 1)
    if 8 % width == 0:
        per = 8 // width
        u = jnp.pad(u.astype(jnp.uint8), [(0, 0)] * len(batch) + [(0, size * per - n)])
        shifts = jnp.arange(per, dtype=jnp.uint8) * jnp.uint8(width)
        fields = jnp.left_shift(
            u.reshape(batch + (size, per)), _last(shifts, u.ndim + 1)
        )
        return jnp.sum(fields, axis=-1, dtype=jnp.uint8)  # disjoint bits: an OR
    if width % 8 == 0:
        shifts = jnp.arange(width // 8, dtype=jnp.uint32) * jnp.uint32(8)
        parts = jnp.right_shift(u[..., None], _last(shifts, u.ndim + 1)) & jnp.uint32(
            0xFF
        )
        return parts.astype(jnp.uint8).reshape(batch + (size,))
    bits = jnp.right_shift(
        u[..., None], _last(jnp.arange(width, dtype=jnp.uint32), u.ndim + 1)
    )
    bits = (bits & jnp.uint32(1)).astype(jnp.uint8).reshape(batch + (n * width,))
    bits = jnp.pad(bits, [(0, 0)] * len(batch) + [(0, 8 * size - n * width)])
    weights = jnp.left_shift(jnp.uint8(1), jnp.arange(8, dtype=jnp.uint8))
    bits = bits.reshape(batch + (size, 8))
    return jnp.sum(bits * _last(weights, bits.ndim), axis=-1, dtype=jnp.uint8)


def unpack_bits(
    packed: UInt8[Array, "*batch b"], n: int, width: int
) -> Shaped[Array, "*batch n"]:
    """Inverse of `pack_bits`: the first `n` codes of `width` bits.

    Returns:
        `uint8` codes for widths up to 8, `uint32` codes for wider ones.

    Raises:
        ValueError: when `n` codes of `width` bits do not fit in the bytes given.

    Examples:
        >>> unpack_bits(jnp.array([33, 15], jnp.uint8), 3, 4).tolist()
        [1, 2, 15]
        >>> unpack_bits(jnp.array([197, 31, 0], jnp.uint8), 3, 6).tolist()
        [5, 63, 1]
    """
    _check_width(width)
    batch, size = packed.shape[:-1], packed.shape[-1]
    if not 0 <= n * width <= 8 * size:
        raise ValueError(
            f"n={n} codes of width={width} bits do not fit in {size} bytes."
        )
    dtype = jnp.uint8 if width <= 8 else jnp.uint32
    if width == 0 or n == 0:
        return jnp.zeros(batch + (n,), dtype)
    if 8 % width == 0:
        per = 8 // width
        shifts = jnp.arange(per, dtype=jnp.uint8) * jnp.uint8(width)
        codes = jnp.right_shift(packed[..., None], _last(shifts, packed.ndim + 1))
        codes = codes & jnp.uint8((1 << width) - 1)
        return codes.reshape(batch + (size * per,))[..., :n]
    if width % 8 == 0:
        k = width // 8
        parts = packed[..., : n * k].reshape(batch + (n, k)).astype(jnp.uint32)
        shifts = jnp.arange(k, dtype=jnp.uint32) * jnp.uint32(8)
        parts = jnp.left_shift(parts, _last(shifts, parts.ndim))
        return jnp.sum(parts, axis=-1, dtype=jnp.uint32)
    bits = jnp.right_shift(
        packed[..., None], _last(jnp.arange(8, dtype=jnp.uint8), packed.ndim + 1)
    )
    bits = (bits & jnp.uint8(1)).reshape(batch + (8 * size,))[..., : n * width]
    bits = bits.reshape(batch + (n, width)).astype(jnp.uint32)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(width, dtype=jnp.uint32))
    codes = jnp.sum(bits * _last(weights, bits.ndim), axis=-1, dtype=jnp.uint32)
    return codes.astype(dtype)


def pack4(codes: UInt8[Array, "*batch n"]) -> UInt8[Array, "*batch half"]:
    """Two 4-bit codes per byte (`pack_bits(codes, 4)`): element `2i` in the low
    nibble, `2i + 1` in the high.

    An odd count is padded with a zero code. Bits above the low four are dropped.

    Examples:
        >>> pack4(jnp.array([1, 2, 15], jnp.uint8)).tolist()
        [33, 15]
    """
    return pack_bits(codes, 4)


def unpack4(packed: UInt8[Array, "*batch half"], n: int) -> UInt8[Array, "*batch n"]:
    """Inverse of `pack4`: the first `n` 4-bit codes.

    Examples:
        >>> unpack4(jnp.array([33, 15], jnp.uint8), 3).tolist()
        [1, 2, 15]
    """
    return unpack_bits(packed, n, 4)


@dataclasses.dataclass(frozen=True)
class Group:
    """One group of a fragment: a whole leaf, or some rows of a leaf labelled per row."""

    leaf: int
    rows: np.ndarray | None  # row indices of a leaf labelled per row


@dataclasses.dataclass(frozen=True)
class Field:
    """One array of a group's message, as it is laid out on the wire."""

    shape: tuple[int, ...]  # for one replica (rows of a per-row group first)
    dtype: np.dtype
    width: int | None  # bits per element in its bitstream; None: a float field

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


class Wire:
    """The static layout of one fragment's message (built at trace time).

    Args:
        compressor: the compressor (None: raw values).
        fragments: the partition.
        deltas: one `[M, ...]` array (or its shape) per leaf.
        keys: the `[M, ...]` keys of `communication.compress`, per leaf.
        p: the fragment.

    Attributes:
        groups: the fragment's groups (whole leaves, or rows of leaves).
        fields: per group, its message's fields (in `jax.tree` order).
        streams: `{width: [element counts of its fields, in order]}` of the integer
            fields.
        num_bytes: the bytes of a message.
    """

    def __init__(self, compressor: Compressor | None, fragments, deltas, keys, p: int):
        self.compressor = compressor
        self.groups: list[Group] = []
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[Any] = []
        self.treedefs: list[Any] = []
        self.fields: list[list[Field]] = []
        for i, labels in enumerate(fragments.labels):
            rows = None if labels.ndim == 0 else np.flatnonzero(labels == p)
            if (rows is None and int(labels) != p) or (
                rows is not None and not rows.size
            ):
                continue
            shape, key = tuple(deltas[i].shape[1:]), tuple(keys[i].shape[1:])
            if rows is not None:
                shape, key = (len(rows),) + shape[1:], (len(rows),) + key
            message = jax.eval_shape(
                ft.partial(self._encode_group, rows=rows is not None),
                jax.ShapeDtypeStruct(shape, deltas[i].dtype),
                jax.ShapeDtypeStruct(key, keys[i].dtype),
            )
            leaves, treedef = jax.tree.flatten(message)
            widths = self._widths(shape[1:] if rows is not None else shape, treedef)
            self.groups.append(Group(i, rows))
            self.shapes.append(shape)
            self.dtypes.append(deltas[i].dtype)
            self.treedefs.append(treedef)
            self.fields.append(
                [
                    Field(tuple(x.shape), np.dtype(x.dtype), _width(x.dtype, w))
                    for x, w in zip(leaves, widths)
                ]
            )
        self.streams: dict[int, list[int]] = {}
        for f in (f for fields in self.fields for f in fields):
            if f.width:  # an integer field of width 0 takes no bytes
                self.streams.setdefault(f.width, []).append(f.size)
        self.streams = dict(sorted(self.streams.items()))
        self.stream_bytes = {w: -(-sum(n) * w // 8) for w, n in self.streams.items()}
        self.float_bytes = [
            f.size * f.dtype.itemsize
            for fields in self.fields
            for f in fields
            if f.width is None
        ]
        self.num_bytes = sum(self.stream_bytes.values()) + sum(self.float_bytes)

    def encode(self, deltas: list[Array], keys: list[Array]) -> UInt8[Array, " B"]:
        """One replica's message, from its Δ and keys (as `communication.compress`)."""
        streams: dict[int, list[Array]] = {w: [] for w in self.streams}
        floats = []
        for g, fields in zip(self.groups, self.fields):
            x, k = deltas[g.leaf], keys[g.leaf]
            if g.rows is None:
                message = self._encode_group(x, k, rows=False)
            else:
                row_keys = jr.split(k, x.shape[0])[g.rows]
                message = self._encode_group(x[g.rows], row_keys, rows=True)
            for f, value in zip(fields, jax.tree.leaves(message)):
                if f.width is None:
                    floats.append(_to_bytes(value))
                elif f.width:
                    streams[f.width].append(value.reshape(-1))
        parts = [
            pack_bits(jnp.concatenate([_as_uint32(v) for v in values]), w)
            for w, values in streams.items()
        ]
        parts += floats
        if not parts:
            return jnp.zeros((0,), jnp.uint8)
        return jnp.concatenate(parts)

    def decode(self, message: UInt8[Array, " B"]) -> list[Array]:
        """One replica's reconstruction of every group, from its message."""
        start, streams = 0, {}
        for w, sizes in self.streams.items():
            body = message[start : start + self.stream_bytes[w]]
            streams[w] = iter(_split(unpack_bits(body, sum(sizes), w), sizes))
            start += self.stream_bytes[w]
        floats = iter(_split(message[start:], self.float_bytes))
        out = []
        for g, fields, treedef, shape, dtype in zip(
            self.groups, self.fields, self.treedefs, self.shapes, self.dtypes
        ):
            leaves = []
            for f in fields:
                if f.width is None:
                    leaves.append(_from_bytes(next(floats), f.dtype, f.shape))
                elif f.width:
                    leaves.append(_from_uint(next(streams[f.width]), f.dtype, f.shape))
                else:
                    leaves.append(jnp.zeros(f.shape, f.dtype))
            group = jax.tree.unflatten(treedef, leaves)
            out.append(self._decode_group(group, shape, dtype, g.rows is not None))
        return out

    def _widths(self, shape: tuple[int, ...], treedef) -> list[Any]:
        """The compressor's width of each field, in `jax.tree` order."""
        if self.compressor is None:
            return [None]
        widths = self.compressor.widths(shape)
        if jax.tree.structure(widths) != treedef:
            raise ValueError(
                f"{type(self.compressor).__name__}.widths({shape}) has the fields "
                f"{jax.tree.structure(widths)}, but its message has {treedef}; "
                "expected one width per field of encode()'s message."
            )
        return jax.tree.leaves(widths)

    def _encode_group(self, x, key, *, rows):
        """The message of one group's tensor (rows vmapped)."""
        c = self.compressor

        def one(x, key):
            return {"values": x} if c is None else c.encode(x, key)

        return jax.vmap(one)(x, key) if rows else one(x, key)

    def _decode_group(self, message, shape, dtype, rows):
        """The reconstruction of one group from its message."""
        c = self.compressor

        def one(message, shape):
            if c is None:
                return message["values"].reshape(shape)
            return c.decode(message, shape, dtype)

        if rows:
            return jax.vmap(lambda m: one(m, shape[1:]))(message)
        return one(message, shape)


# ----------------------------------------------------------------------------- helpers


def _check_width(width: int) -> None:
    if isinstance(width, bool) or not isinstance(width, int | np.integer):
        raise ValueError(f"width={width!r}; expected an integer 0 to {MAX_WIDTH}.")
    if not 0 <= width <= MAX_WIDTH:
        raise ValueError(f"width={width}; expected an integer 0 to {MAX_WIDTH}.")


def _last(v: Array, ndim: int) -> Array:
    """A 1-d `v` along the last of `ndim` axes (explicit ranks: no rank promotion)."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


def _width(dtype: Any, width: Any) -> int | None:
    """A field's width on the wire: None for a float field (its raw bytes)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return None
    width = int(width)
    _check_width(width)
    return width


def _as_uint32(x: Array) -> Array:
    """Integer codes as uint32 (a 32-bit signed field reinterpreted bit for bit)."""
    if x.dtype == jnp.uint32:
        return x
    if jnp.dtype(x.dtype).itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return x.astype(jnp.uint32)


def _from_uint(x: Array, dtype: Any, shape: tuple[int, ...]) -> Array:
    """Unpacked codes back in their field's dtype and shape (`_as_uint32` undone)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 4 and dtype != jnp.uint32:
        x = jax.lax.bitcast_convert_type(x.astype(jnp.uint32), dtype)
    return x.astype(dtype).reshape(shape)


def _split(x: Array, sizes: list[int]) -> list[Array]:
    offsets = np.cumsum([0] + list(sizes))
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
