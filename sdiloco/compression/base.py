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

Callers vmap over replicas and over stacked layers themselves. Everything is jittable
and vmappable, and a configuration that needs randomness raises `ValueError` at trace
time when it is given no key (`check_key`).
"""

import abc
from typing import NamedTuple

import equinox as eqx
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
