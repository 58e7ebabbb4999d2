"""The MoE in a quantized format, in plain torch: what every quantized kernel must equal.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

Mirrors ``kernels/reference.py`` on canonical packed weights (``layout.py``):

    h   = matmul(x_rows, w1, e)            [n, 2F]  (a8 formats quantize x_rows per token inside)
    a   = silu(clamp(gate)) * clamp(up)    [n, F]   fp32; clamps only where attrs.limit > 0
    a   = a * g                                     weight_on="between"
    out = matmul(a, w2, e)                 [n, H]   (a8 formats re-quantize a per row)
    y  += g * out                                   weight_on="output"

Ids outside [0, E) contribute nothing; the result is fp32 [T, H].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_compile.ir import FFNAttrs
from moe_compile.quant.common import QuantWeight
from moe_compile.quant.formats import matmul


def swiglu(h: torch.Tensor, limit: float) -> torch.Tensor:
    """[n, 2F] canonical FC1 output (gate | up) -> [n, F] fp32."""
    gate, up = h.chunk(2, dim=-1)
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def reference_moe(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    w1: QuantWeight,  # [E, 2F, H]
    w2: QuantWeight,  # [E, H, F]
    attrs: FFNAttrs,
) -> torch.Tensor:
    if attrs.weight_on not in ("output", "between"):
        raise ValueError(f"quantized MoE: weight_on must be 'output' or 'between', got {attrs.weight_on!r}")
    T, H = x.shape
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(w1.num_experts):
        tok, k = torch.where(topk_ids == e)  # [n], [n]
        if tok.numel() == 0:
            continue
        g = topk_weights[tok, k].float()[:, None]  # [n, 1]
        a = swiglu(matmul(x[tok].float(), w1, e), attrs.limit)  # [n, F]
        if attrs.weight_on == "between":
            a = a * g
        out = matmul(a, w2, e)  # [n, H]
        if attrs.weight_on == "output":
            out = out * g
        y.index_add_(0, tok, out)
    return y
