"""Compression as stages: `chain` composes compressors.

The methods after Streaming DiLoCo compress outer gradients in several steps: SparseLoCo
keeps the top-k entries of each chunk, quantizes the kept values to 2 bits and feeds
the residual back into the next round; MuLoCo sends 2-bit values with error feedback;
INTELLECT-1 sends int8 with a min-max range. Each step here is a `Compressor` of its
own, and `chain(*stages)` composes them:

* the first stage encodes the tensor; every next stage encodes the `"values"` field of
  the message before it (the kept values of a sparsifier, say), so its message nests
  there. `decode` undoes the stages in reverse order;
* a message's bits are its fields' sizes times their widths, so a chain's `bits` is
  exact by construction, whatever its stages.

Stages hold no state. Error feedback, which keeps each replica's residual, is a
plug-in (`sdiloco.plugins.error_feedback`), as is any stage that needs state; a spec
string's closing `ef` builds it (`spec.parse_with_feedback`).

Also here: `chunked_top_k` (SparseLoCo's sparsifier) and `min_max` (the affine int8
quantizer with a range per row or block).
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from .base import (
    SCALE_BITS,
    VALUE_BITS,
    Compressor,
    check_key,
    compute_dtype,
    message_bits,
    message_shapes,
)
from .formats import ROUNDINGS
from .quantizers import GRANULARITIES, group_layout, to_groups
from .sparsifiers import _decimal, index_bits, poison, scatter_rows, top_k_rows


class ChunkedTopK(Compressor):
    """Top-k per chunk: keep the `k = ceil(fraction * chunk)` entries of largest |x|
    of every `chunk` consecutive elements (SparseLoCo's sparsifier).

    The flattened tensor is cut into chunks (the last one padded with zeros), and
    each chunk sends its k values as float32 and their positions in the chunk
    (ceil(log2 chunk) bits each). Ties go to the lower position. A non-finite input
    makes every sent value NaN, so the receivers see it.

    Attributes:
        fraction: fraction of each chunk kept, in (0, 1].
        chunk: elements per chunk, >= 1.
    """

    fraction: float = eqx.field(static=True)
    chunk: int = eqx.field(default=64, static=True)

    def __check_init__(self):
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(
                f"chunked_top_k fraction={self.fraction!r} is not allowed; expected "
                "0 < fraction <= 1."
            )
        _check_positive_int("chunked_top_k chunk", self.chunk)

    @property
    def needs_key(self) -> bool:
        """Always false: the selection is deterministic."""
        return False

    @property
    def kept(self) -> int:
        """Entries kept per chunk: ceil(fraction * chunk), for the decimal written."""
        return min(self.chunk, math.ceil(_decimal(self.fraction) * self.chunk))

    def chunks(self, shape: tuple[int, ...]) -> int:
        """Number of chunks of a tensor of this shape."""
        return -(-math.prod(tuple(shape)) // self.chunk)

    def bits(self, shape: tuple[int, ...]) -> int:
        """Chunks x k x (32 + ceil(log2 chunk))."""
        return self.chunks(shape) * self.kept * (VALUE_BITS + index_bits(self.chunk))

    def widths(self, shape: tuple[int, ...]) -> dict[str, int]:
        """Values at 32 bits, positions at ceil(log2 chunk) bits."""
        del shape
        return {"values": VALUE_BITS, "index": index_bits(self.chunk)}

    def encode(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> dict[str, Array]:
        """`{"values": [chunks, k], "index": [chunks, k]}`."""
        del key
        flat = x.reshape(-1).astype(compute_dtype(x.dtype))
        rows = to_groups(flat, self.chunks(x.shape), self.chunk)
        values, index = top_k_rows(rows, self.kept)
        return {"values": poison(x, values), "index": index}

    def decode(
        self, message: dict[str, Array], shape: tuple[int, ...], dtype: DTypeLike
    ) -> Float[Array, "*shape"]:
        """The kept values at their positions, zeros elsewhere."""
        rows = scatter_rows(message["values"], message["index"], self.chunk)
        n = math.prod(tuple(shape))
        return rows.reshape(-1)[:n].reshape(shape).astype(dtype)

    def __call__(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """The round trip `decode(encode(x))`."""
        return self.decode(self.encode(x, key), x.shape, x.dtype)


class MinMax(Compressor):
    """Affine integer quantizer: each group sends its min and max as float32 and each
    element the nearest of `2^bits` evenly spaced levels between them (INTELLECT-1's
    int8 "min-max" quantization of outer gradients).

    A group whose min equals its max decodes to that value exactly (an all-zero
    group stays zero). The padding of a partial last block takes part in its range.

    Attributes:
        code_bits: bits per code, 2 to 8.
        granularity: `"tensor"`, `"row"` (slices along the last axis) or `"block"`.
        block_size: elements per group for `"block"`.
        rounding: `"nearest"` (half to even) or `"stochastic"` (unbiased, needs a key).
    """

    code_bits: int = eqx.field(default=8, static=True)
    granularity: str = eqx.field(default="row", static=True)
    block_size: int = eqx.field(default=64, static=True)
    rounding: str = eqx.field(default="nearest", static=True)

    def __check_init__(self):
        if self.code_bits not in range(2, 9) or isinstance(self.code_bits, bool):
            raise ValueError(
                f"min_max bits={self.code_bits!r} is not allowed; expected an integer "
                "from 2 to 8."
            )
        _check_in("min_max granularity", self.granularity, GRANULARITIES)
        _check_in("min_max rounding", self.rounding, ROUNDINGS)
        _check_positive_int("min_max block_size", self.block_size)

    @property
    def needs_key(self) -> bool:
        """Whether a PRNG key is required (stochastic rounding)."""
        return self.rounding == "stochastic"

    def bits(self, shape: tuple[int, ...]) -> int:
        """numel x bits + groups x 64 (a float32 min and max)."""
        groups, _, numel = group_layout(self, tuple(shape))
        return numel * self.code_bits + groups * 2 * SCALE_BITS

    def widths(self, shape: tuple[int, ...]) -> dict[str, int]:
        """Codes at `code_bits`, the range at 32 bits."""
        del shape
        return {"codes": self.code_bits, "low": SCALE_BITS, "high": SCALE_BITS}

    def encode(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> dict[str, Array]:
        """`{"codes": [*shape] uint8, "low": [groups], "high": [groups]}`."""
        key = check_key(self, key)
        cdtype = compute_dtype(x.dtype)
        groups, size, numel = group_layout(self, x.shape)
        g = to_groups(x.reshape(-1).astype(cdtype), groups, size)
        low = jnp.min(g, axis=1, initial=jnp.inf).astype(jnp.float32)
        high = jnp.max(g, axis=1, initial=-jnp.inf).astype(jnp.float32)
        span = (high - low).astype(cdtype)[:, None]
        top = 2**self.code_bits - 1
        safe = jnp.where(span > 0, span, jnp.ones_like(span))
        v = jnp.clip((g - low.astype(cdtype)[:, None]) / safe * top, 0, top)
        if self.rounding == "nearest":
            v = jnp.round(v)
        else:
            assert key is not None  # check_key raised on a missing key
            v = jnp.minimum(jnp.floor(v + jr.uniform(key, v.shape, cdtype)), top)
        codes = jnp.where(span > 0, v, 0).astype(jnp.uint8)
        codes = codes.reshape(-1)[:numel].reshape(x.shape)
        return {"codes": codes, "low": low, "high": high}

    def decode(
        self, message: dict[str, Array], shape: tuple[int, ...], dtype: DTypeLike
    ) -> Float[Array, "*shape"]:
        """`low + code * (high - low) / (2^bits - 1)` per group."""
        cdtype = compute_dtype(dtype)
        groups, size, numel = group_layout(self, tuple(shape))
        codes = to_groups(message["codes"].reshape(-1).astype(cdtype), groups, size)
        low = message["low"].astype(cdtype)[:, None]
        step = (message["high"].astype(cdtype)[:, None] - low) / (2**self.code_bits - 1)
        y = low + codes * step
        return y.reshape(-1)[:numel].reshape(shape).astype(dtype)

    def __call__(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """The round trip `decode(encode(x, key))`."""
        return self.decode(self.encode(x, key), x.shape, x.dtype)


class Chain(Compressor):
    """Compressors applied in turn (see the module docstring); built by `chain`.

    Attributes:
        stages: the compressing stages, first to last.
    """

    stages: tuple[Compressor, ...]

    def __check_init__(self):
        if not self.stages:
            raise ValueError("chain() needs at least one compressing stage.")
        for i, stage in enumerate(self.stages[:-1]):
            fields = message_shapes(stage, (64,))
            if "values" not in fields:
                raise ValueError(
                    f"chain stage {i} ({type(stage).__name__}) is followed by "
                    f"{type(self.stages[i + 1]).__name__}, but its message "
                    f"{sorted(fields)} has no float 'values' for the next stage; "
                    "allowed: a stage that keeps float values (a sparsifier) "
                    "before another stage, a quantizer last."
                )

    @property
    def needs_key(self) -> bool:
        """Whether any stage is random."""
        return any(s.needs_key for s in self.stages)

    def bits(self, shape: tuple[int, ...]) -> int:
        """The message's fields' sizes times their widths."""
        return message_bits(self, shape)

    def widths(self, shape: tuple[int, ...]) -> dict[str, Any]:
        """Each stage's widths, the next stage's nested under `"values"`."""
        return self._widths(0, jax.ShapeDtypeStruct(tuple(shape), jnp.float32))

    def encode(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> dict[str, Any]:
        """Stage 0's message, each next stage's nested under `"values"`."""
        return self._encode(0, x, key)

    def decode(
        self, message: dict[str, Any], shape: tuple[int, ...], dtype: DTypeLike
    ) -> Float[Array, "*shape"]:
        """The stages undone, last first."""
        return self._decode(0, message, jax.ShapeDtypeStruct(tuple(shape), dtype))

    def __call__(
        self, x: Float[Array, "*shape"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """The round trip through every stage (one stage: that stage's own)."""
        if len(self.stages) == 1:
            return self.stages[0](x, key)
        return self.decode(self.encode(x, key), x.shape, x.dtype)

    def _encode(self, i: int, x: Array, key: PRNGKeyArray | None) -> dict[str, Any]:
        message = dict(self.stages[i].encode(x, _stage_key(key, i)))
        if i + 1 < len(self.stages):
            message["values"] = self._encode(i + 1, message["values"], key)
        return message

    def _decode(self, i: int, message: dict[str, Any], like: Any) -> Array:
        stage = self.stages[i]
        if i + 1 < len(self.stages):
            values = message_shapes(stage, like.shape, like.dtype)["values"]
            message = {
                **message,
                "values": self._decode(i + 1, message["values"], values),
            }
        return stage.decode(message, like.shape, like.dtype)

    def _widths(self, i: int, like: Any) -> dict[str, Any]:
        stage = self.stages[i]
        widths = dict(stage.widths(like.shape))
        if i + 1 < len(self.stages):
            values = message_shapes(stage, like.shape, like.dtype)["values"]
            widths["values"] = self._widths(i + 1, values)
        return widths


def chain(*stages: Compressor) -> Compressor:
    """Compose compressing stages, each applied to the `"values"` of the message
    before it.

    Returns:
        A `Chain`, or the one stage itself (so `chain(quantizer("e3m0"))` is the
        quantizer).

    Raises:
        ValueError: on an empty chain, a stage that is not a `Compressor` (error
            feedback is a plug-in: `streaming_diloco(plugins=error_feedback(β))`),
            or a stage that leaves no float values for the stage after it.

    Examples:
        >>> from sdiloco.compression import quantizer
        >>> c = chain(chunked_top_k(0.25, chunk=8), quantizer("int2"))
        >>> c.bits((64,))  # 8 chunks x 2 kept x (2 + 3 bits) + one float32 scale
        112
    """
    for i, stage in enumerate(stages):
        if not isinstance(stage, Compressor):
            raise ValueError(
                f"chain stage {i}={stage!r} is not a Compressor; error feedback is a "
                "plug-in: streaming_diloco(plugins=sdiloco.error_feedback(beta))."
            )
    return stages[0] if len(stages) == 1 else Chain(stages=tuple(stages))


def chunked_top_k(fraction: float, chunk: int = 64) -> ChunkedTopK:
    """SparseLoCo's sparsifier: the top `fraction` of every `chunk` elements.

    Examples:
        >>> import jax.numpy as jnp
        >>> chunked_top_k(0.5, chunk=2)(jnp.array([1.0, -3.0, 2.0, 0.5])).tolist()
        [0.0, -3.0, 2.0, 0.0]
    """
    return ChunkedTopK(fraction=fraction, chunk=chunk)


def min_max(
    bits: int = 8,
    *,
    granularity: str = "row",
    block_size: int = 64,
    rounding: str = "nearest",
) -> MinMax:
    """Affine `bits`-bit quantizer with a float32 min and max per group.

    Examples:
        >>> import jax.numpy as jnp
        >>> min_max(8)(jnp.array([0.0, 1.0, 0.5])).tolist()  # 0.5 -> code 128 of 255
        [0.0, 1.0, 0.501960813999176]
    """
    return MinMax(
        code_bits=bits,
        granularity=granularity,
        block_size=block_size,
        rounding=rounding,
    )


# ----------------------------------------------------------------------------- helpers


def _stage_key(key: PRNGKeyArray | None, i: int) -> PRNGKeyArray | None:
    """Stage 0 uses the chain's key itself; stage i > 0 its own `fold_in`."""
    return None if key is None else jr.fold_in(key, i)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; expected an integer >= 1.")


def _check_in(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(
            f"{name}={value!r} is not supported; expected one of {allowed}."
        )
