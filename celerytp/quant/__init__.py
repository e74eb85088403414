"""Quantized weights: ggml type names, bit-exact block codecs (see gguf.quants), kernel layouts."""

from celerytp.quant.blocks import dequantize_blocks, quantize_blocks, unpack_blocks
from celerytp.quant.formats import ACCEPTED_NAMES, EXECUTABLE, QuantFormat, QuantPlan, parse_quant

__all__ = [
    "ACCEPTED_NAMES",
    "EXECUTABLE",
    "QuantFormat",
    "QuantPlan",
    "dequantize_blocks",
    "parse_quant",
    "quantize_blocks",
    "unpack_blocks",
]
