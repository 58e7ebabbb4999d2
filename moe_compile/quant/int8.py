"""int8 per-token (per-row) quantization: s = max|x| / 127, q = round(x / s) in [-127, 127].

Shapes: n rows, H hidden.  Used by the EP dispatch (``transport="symm-int8"``) to send 1 byte per
element + one fp32 scale per row instead of 2-4 bytes per element.  A zero row gets scale 1 (its
q is 0, so it dequantizes exactly).  Error: |x - s q| <= s / 2 per element, i.e. an SQNR of about
6.02 * 8 + 1.76 - 20 log10(crest factor) dB; for Gaussian rows of width >= 64 it stays above
~30 dB (the EP test's floor).
"""

from __future__ import annotations

import torch

from moe_compile.quant.common import INT8_QMAX as QMAX, quantize_per_token_int8  # noqa: F401  QMAX: callers' name


def quantize(x: torch.Tensor, q_out: torch.Tensor | None = None, s_out: torch.Tensor | None = None):
    """x [n, H] float -> (q [n, H] int8, s [n] fp32); writes into ``q_out`` / ``s_out`` when given.

    The numbers are ``common.quantize_per_token_int8``'s (the a8 formats' activation quantizer)."""
    q, s = quantize_per_token_int8(x)  # [n, H] int8, [n, 1]
    s = s[:, 0]
    if q_out is not None:
        q = q_out.copy_(q)
    if s_out is None:
        return q, s
    s_out.copy_(s)
    return q, s_out


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(q [n, H] int8, s [n]) -> [n, H] in ``dtype``."""
    return (q.float() * s.float()[:, None]).to(dtype)


def sqnr_db(x: torch.Tensor, approx: torch.Tensor) -> float:
    err = (x.double() - approx.double()).pow(2).sum()
    return float(10 * torch.log10(x.double().pow(2).sum() / err.clamp_min(1e-300)))
