"""A readable compressor spec, for configs and the command line.

`parse("topk:0.02/64,int2")` builds `chain(chunked_top_k(0.02, chunk=64),
quantizer("int2"))`; `parse_with_feedback("topk:0.02/64,int2,ef:0.9")` also returns
the error-feedback plug-in the closing `ef:0.9` names (`plugins.error_feedback(0.9)`,
what `streaming_diloco(compressor=spec)` adds to its plug-ins). A spec is stages
separated by commas, each a name with options after colons:

| stage | meaning |
|---|---|
| `e3m0`, `int2`, `int4`, `int8`, `e2m1`, `e4m3`, `bf16`, `fp32`, ... (`FORMATS`) | `quantizer(format)`; options `row`, `tensor`, `blockN` (scale groups) and `sr` (stochastic rounding), e.g. `int4:block64:sr` |
| `int8mm` (also `int2mm` ... `int8mm`) | `min_max(bits)`: a float32 min and max per group; options as above, default `row` |
| `topk:F` | `top_k(F)`: the fraction F of largest entries per tensor |
| `topk:F/C` | `chunked_top_k(F, chunk=C)`: the fraction F of every C elements |
| `dare:R`, `dropout:R` | `dare(R)`, `fed_dropout(R)`: drop the fraction R at random |
| `ef`, `ef:B` | the plug-in `error_feedback(B)` (B = 1 by default); last only, `parse_with_feedback` |
| `none` | no compression (float32), alone |

A bad spec raises `ValueError` in one line naming the spec, the stage and what is
allowed.
"""

from typing import Any, NamedTuple

from .base import Compressor
from .formats import FORMATS
from .quantizers import GRANULARITIES, quantizer
from .sparsifiers import dare, fed_dropout, top_k
from .stages import chain, chunked_top_k, min_max


MIN_MAX = {f"int{b}mm": b for b in range(2, 9)}
"""The min-max stage names and their bits."""

GRAMMAR = (
    "stages separated by commas: a format "
    f"({'|'.join(FORMATS)})[:row|tensor|blockN][:sr], int8mm[:row|tensor|blockN], "
    "topk:F, topk:F/CHUNK, dare:R, dropout:R, and ef[:BETA] last; or 'none'"
)
"""What `parse` accepts, in one line (for error messages and `--help`)."""


def parse(spec: str) -> Compressor | None:
    """The compressor a spec describes (None for `"none"`).

    Raises:
        ValueError: naming the spec, the bad stage and what is allowed (a closing
            `ef` included: that is a plug-in, `parse_with_feedback`).

    Examples:
        >>> parse("e3m0") == quantizer("e3m0")
        True
        >>> parse("topk:0.02/64,int2").bits((640,))  # 10 chunks x 2 x (2 + 6) + 32
        192
    """
    compressor, beta = _parse(spec)
    if beta is not None:
        raise ValueError(
            f"compressor spec={spec!r} ends in error feedback, a plug-in; allowed: "
            "parse_with_feedback(spec), or streaming_diloco(compressor=spec)."
        )
    return compressor


def parse_with_feedback(spec: str) -> tuple[Compressor | None, Any]:
    """The compressor a spec describes and the `plugins.ErrorFeedback` its closing
    `ef[:B]` names (None without one).

    Examples:
        >>> c, ef = parse_with_feedback("topk:0.02/64,int2,ef:0.9")
        >>> c.bits((640,)), ef.beta
        (192, 0.9)
    """
    from ..plugins import error_feedback  # the plug-ins build on the compressors

    compressor, beta = _parse(spec)
    return compressor, None if beta is None else error_feedback(beta)


def _parse(spec: str) -> tuple[Compressor | None, float | None]:
    """The compressing stages of a spec and the β of its closing `ef` (or None)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"compressor spec={spec!r}; expected {GRAMMAR}.")
    parts = [p.strip() for p in spec.split(",")]
    if parts == ["none"]:
        return None, None
    stages: list[Any] = []
    for i, part in enumerate(parts):
        try:
            stages.append(_stage(part))
        except ValueError as e:
            raise ValueError(
                f"compressor spec={spec!r}: stage {i} {part!r}: {e}; expected "
                f"{GRAMMAR}."
            ) from None
    beta = None
    if isinstance(stages[-1], _Feedback):
        beta = stages.pop().beta
    for i, stage in enumerate(stages):
        if isinstance(stage, _Feedback):
            raise ValueError(
                f"compressor spec={spec!r}: stage {i} is ef, which must be the last "
                "stage."
            )
    if not stages:
        raise ValueError(
            f"compressor spec={spec!r} has no compressing stage before ef."
        )
    try:
        return chain(*stages), beta
    except ValueError as e:
        raise ValueError(f"compressor spec={spec!r}: {e}") from None


class _Feedback(NamedTuple):
    """A parsed `ef[:B]` stage."""

    beta: float


def _stage(part: str) -> Any:
    name, *options = part.split(":")
    if name in FORMATS:
        return quantizer(name, **_quantizer_options(options, "tensor"))
    if name in MIN_MAX:
        return min_max(MIN_MAX[name], **_quantizer_options(options, "row"))
    if name == "ef":
        beta = _number(_one(options, "beta", 1.0))
        if isinstance(beta, bool) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"ef beta={beta!r}; allowed: 0 <= beta <= 1")
        return _Feedback(beta)
    if name == "topk":
        value = str(_one(options, "fraction", None))
        if "/" in value:
            fraction, chunk = value.split("/", 1)
            return chunked_top_k(_number(fraction), chunk=_integer(chunk))
        return top_k(_number(value))
    if name in ("dare", "dropout"):
        rate = _number(_one(options, "rate", None))
        return dare(rate) if name == "dare" else fed_dropout(rate)
    raise ValueError(f"unknown stage {name!r}")


def _quantizer_options(options: list[str], granularity: str) -> dict[str, Any]:
    out: dict[str, Any] = {"granularity": granularity}
    for option in options:
        if option == "sr":
            out["rounding"] = "stochastic"
        elif option in GRANULARITIES[:2]:
            out["granularity"] = option
        elif option.startswith("block"):
            out["granularity"], out["block_size"] = "block", _integer(option[5:])
        else:
            raise ValueError(
                f"unknown option {option!r} (allowed: row, tensor, blockN, sr)"
            )
    return out


def _one(options: list[str], what: str, default: Any) -> Any:
    if len(options) > 1 or (not options and default is None):
        raise ValueError(f"expected one {what} after ':'")
    return options[0] if options else default


def _number(text: Any) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def _integer(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a positive integer")
    return int(text)
