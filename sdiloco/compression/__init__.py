"""Outer-gradient compressors: low-precision quantizers and value-dropping baselines.

One concept per module:

- `base`: the `Compressor` contract (round trip and exact wire bits), `Quantized`, the
  bit costs of metadata;
- `formats`: the value tables of the low-precision formats (E3M0, E2M1, ..., FP8) and
  rounding onto them;
- `quantizers`: `Quantizer` (per-group amax scaling) and its factory `quantizer`;
- `sparsifiers`: FedDropout, DARE and Top-K with their factories.
"""

from .base import Compressor as Compressor, Quantized as Quantized
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
