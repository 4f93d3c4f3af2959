"""Outer-gradient compressors: low-precision quantizers and value-dropping baselines."""

from .quantizers import (
    FORMATS as FORMATS,
    GRANULARITIES as GRANULARITIES,
    ROUNDINGS as ROUNDINGS,
    Compressor as Compressor,
    Quantized as Quantized,
    Quantizer as Quantizer,
    dare as dare,
    fed_dropout as fed_dropout,
    quantizer as quantizer,
    top_k as top_k,
)
