"""Outer-gradient compressors: low-precision quantizers and value-dropping baselines.

One concept per module:

- `base`: the `Compressor` contract (round trip and exact wire bits), `Quantized`, the
  bit costs of metadata;
- `formats`: the value tables of the low-precision formats (E3M0, E2M1, ..., FP8) and
  rounding onto them;
- `quantizers`: `Quantizer` (per-group amax scaling) and its factory `quantizer`;
- `sparsifiers`: FedDropout, DARE and Top-K with their factories;
- `stages`: `chain` (compression as stages), `chunked_top_k` and `min_max`;
- `spec`: `parse`, a readable spec of a compressor ("topk:0.02/64,int2,ef:0.9").
"""

from .base import (
    Compressor as Compressor,
    Quantized as Quantized,
    message_bits as message_bits,
)
from .formats import FORMATS as FORMATS, ROUNDINGS as ROUNDINGS
from .quantizers import (
    GRANULARITIES as GRANULARITIES,
    Quantizer as Quantizer,
    quantizer as quantizer,
)
from .sparsifiers import (
    Dare as Dare,
    FedDropout as FedDropout,
    TopK as TopK,
    dare as dare,
    fed_dropout as fed_dropout,
    top_k as top_k,
)
from .spec import parse as parse, parse_with_feedback as parse_with_feedback
from .stages import (
    Chain as Chain,
    ChunkedTopK as ChunkedTopK,
    MinMax as MinMax,
    chain as chain,
    chunked_top_k as chunked_top_k,
    min_max as min_max,
)
