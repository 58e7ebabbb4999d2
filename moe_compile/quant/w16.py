"""w16: the weights in bf16 or fp16, read directly; activations and accumulation in fp32.

Shapes:  E experts, N output rows, K reduction width, T rows of x.

    pack        W [E, N, K] float  ->  data = W.to(bf16 | fp16)   (round to nearest even), scale empty
    dequantize  data.float()
    matmul      y [T, N] = x.float() @ data[e].float()^T          (fp32 accumulation)

Half the bytes of fp32: the decode win when the weights stream from memory.  Error: the bf16
rounding of each weight, |dw| <= 2^-9 |w| (bf16) or 2^-12 |w| (fp16, inside its range).
"""

from __future__ import annotations

import torch

from moe_compile.quant.common import QuantWeight

DTYPES = (torch.bfloat16, torch.float16)


def pack(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight("w16") holding W in ``dtype``."""
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
