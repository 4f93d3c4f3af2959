"""The compressor contract: what a compressor computes and what it puts on the wire.

Streaming DiLoCo (Douillard et al., 2025, §2.4 and Alg. 2 l.8) compresses each
replica's outer gradient Δ_{m,p} before the exchange and accumulates the received
values in float32 ("up to a float with 4 bits ... called E3M0"). Its Fig. 11 compares
lower precision (FP32, BF16, FP8, FP4) against setting values to zero (FedDropout,
DARE, Top-K). Every compressor is an `eqx.Module` with static configuration that acts
on **one tensor**:

* `compressor(x, key)` is the round trip, i.e. what the receivers reconstruct. It has
  the shape and dtype of `x` and is computed in float32, or in `x`'s dtype when that is
  wider (`compute_dtype`).
* `compressor.bits(shape)` is the exact number of bits one sender puts on the wire for
  a tensor of that shape: the payload plus the metadata (the `*_BITS` constants).
* `compressor.encode(x, key)` is the message itself: a dict of named arrays (integer
  codes, indices, float values or scales; a stage of a `chain` may nest the message
  of the next stage under `"values"`), `compressor.widths(shape)` the bits per
  element of each field on the wire, and `compressor.decode(message, shape, dtype)`
  the reconstruction. `decode(encode(x, key))` equals `compressor(x, key)`, and the
  fields' sizes times their widths add up to `bits(shape)` (`message_bits`). The
  default sends the dense reconstruction (`"values"`, 32 bits per element).

Callers vmap over replicas and over stacked layers themselves. Everything is jittable
and vmappable, and a configuration that needs randomness raises `ValueError` at trace
time when it is given no key (`check_key`).
"""

import abc
import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray


SCALE_BITS = 32
"""Metadata of a scaled quantizer: one float32 amax per group."""

SEED_BITS = 64
"""A PRNG seed from which receivers regenerate a random mask."""

VALUE_BITS = 32
"""One float32 value kept by a value-dropping compressor."""


class Quantized(NamedTuple):
    """What a sender puts on the wire for one tensor."""

    codes: Array  # [*shape] uint8 index into values(); bf16 / fp32 for those formats
    scale: Array  # [num_groups] float32 amax per group; [0] for bf16 / fp32


class Compressor(eqx.Module):
    """Abstract outer-gradient compressor acting on one tensor (Alg. 2 l.8)."""

    @property
    @abc.abstractmethod
    def needs_key(self) -> bool:
        """Whether the compressor is random (and needs a PRNG key)."""

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

    def encode(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> dict[str, Any]:
        """The message of one tensor: named arrays (default: the dense values)."""
        return {"values": self(x, key).astype(compute_dtype(x.dtype))}

    def decode(
        self, message: dict[str, Any], shape: tuple[int, ...], dtype: DTypeLike
    ) -> Float[Array, "*shape"]:
        """The reconstruction from `encode`'s message (default: the dense values)."""
        return message["values"].reshape(shape).astype(dtype)

    def widths(self, shape: tuple[int, ...]) -> dict[str, Any]:
        """Bits per element of each field of the message (float fields: 32, what
        `bits` counts for them; integer fields: their packed width)."""
        del shape
        return {"values": VALUE_BITS}


def message_bits(compressor: Compressor, shape: tuple[int, ...]) -> int:
    """Bits of the message of a float32 tensor of `shape`: every field's size times
    its width, summed (equal to `compressor.bits(shape)`; the tests check it)."""
    fields = message_shapes(compressor, shape)
    widths = jax.tree.leaves(compressor.widths(tuple(shape)))
    return sum(math.prod(f.shape) * w for f, w in zip(jax.tree.leaves(fields), widths))


def message_shapes(
    compressor: Compressor, shape: tuple[int, ...], dtype: DTypeLike = jnp.float32
) -> dict[str, Any]:
    """Shapes and dtypes of the fields of `encode`'s message (nothing computed)."""
    key = jax.ShapeDtypeStruct((2,), jnp.uint32) if compressor.needs_key else None
    x = jax.ShapeDtypeStruct(tuple(shape), dtype)
    return jax.eval_shape(lambda x, key: compressor.encode(x, key), x, key)


def check_key(compressor: Compressor, key: PRNGKeyArray | None) -> PRNGKeyArray | None:
    """Raise at trace time when a key-needing configuration gets no key.

    Returns:
        `key` when the compressor needs one, otherwise None.
    """
    if compressor.needs_key and key is None:
        raise ValueError(
            f"{type(compressor).__name__} needs a PRNG key (key=None given); pass "
            "key=jax.random.key(...)."
        )
    return key if compressor.needs_key else None


def compute_dtype(dtype: DTypeLike) -> np.dtype:
    """float32, or `dtype` itself when it is a wider float."""
    dtype = np.dtype(dtype)
    return dtype if jnp.finfo(dtype).bits > 32 else np.dtype(jnp.float32)
