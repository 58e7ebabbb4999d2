"""Quantized formats of the experts' weights (and activations) — one module per format.

``common.py``  the packed weight ``QuantWeight``, ``quantize_per_token_int8``, nibble order
``w16.py``  ``wint.py`` (w8-int / w4-int)  ``mx.py`` (mxfp4 / mxfp8)  ``a8w8_int.py``
``a8w4_int.py`` (MSD)  ``fp8.py`` (a8w8-fp8): pack, dequantize, reference matmul, semantics
``formats.py`` by-name entry; ``layout.py`` model layouts -> canonical roles;
``reference.py`` the whole MoE in a format; ``int8.py`` the EP dispatch's row quantizer.
"""

from moe_compile.quant.common import FORMATS, QuantRefusal, QuantWeight, quantize_per_token_int8
from moe_compile.quant.formats import dequantize, matmul, pack
from moe_compile.quant.layout import pack_moe
from moe_compile.quant.reference import reference_moe

__all__ = [
    "FORMATS", "QuantRefusal", "QuantWeight", "quantize_per_token_int8",
    "pack", "dequantize", "matmul", "pack_moe", "reference_moe",
]
