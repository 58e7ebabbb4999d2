"""w16: the weights in bf16 or fp16, read directly; activations and accumulation in fp32.

Shapes:  E experts, N output rows, K reduction width, T rows of x.

    pack        W [E, N, K] float  ->  data = W.to(fp16 | bf16)   (round to nearest even), scale empty
    dequantize  data.float()
    matmul      y [T, N] = x.float() @ data[e].float()^T          (fp32 accumulation)

Half the bytes of fp32: the decode win when the weights stream from memory.  Error: the rounding
of each weight, |dw| <= 2^-12 |w| (fp16, inside its range) or 2^-9 |w| (bf16).  Both cost the same
to read and the kernels take either, so a float weight packs as the one that holds it more
accurately (``pick_dtype``): fp16 for the weights of trained models (|w| well inside fp16's
6e-5..65504, ~18 dB more SQNR than bf16), bf16 where fp16 would overflow or flush small values.
"""

from __future__ import annotations

import torch

from moe_compile.quant.common import QuantWeight

DTYPES = (torch.bfloat16, torch.float16)
_CHUNK = 1 << 22  # elements per step of pick_dtype


def pick_dtype(w: torch.Tensor) -> torch.dtype:
    """fp16 or bf16, whichever rounds w with the smaller squared error (bf16 if fp16 overflows)."""
    err = dict.fromkeys(DTYPES, 0.0)
    for chunk in w.detach().reshape(-1).split(_CHUNK):  # bounded temporaries for a GB-sized stack
        chunk = chunk.float()
        if not torch.isfinite(chunk.to(torch.float16)).all():
            return torch.bfloat16
        for dt in DTYPES:
            err[dt] += float((chunk - chunk.to(dt).float()).square().sum())
    return torch.float16 if err[torch.float16] <= err[torch.bfloat16] else torch.bfloat16


def pack(w: torch.Tensor, dtype: torch.dtype | None = None) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight("w16") holding W in ``dtype`` (default: ``pick_dtype(w)``;
    a weight already in bf16 or fp16 stays in its own dtype, no rounding)."""
    if dtype is None:
        dtype = w.dtype if w.dtype in DTYPES else pick_dtype(w)
    if dtype not in DTYPES:
        raise ValueError(f"w16: dtype must be one of {DTYPES}, got {dtype}")
    E, N, K = w.shape
    data = w.detach().to(dtype).contiguous()
    return QuantWeight("w16", data, torch.empty(0), K, (E, N, K))


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """-> [E, N, K] fp32."""
    return qw.data.float()


def matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] -> [T, N] fp32: expert e's rows of the packed weight."""
    return x.float() @ qw.data[e].float().t()
