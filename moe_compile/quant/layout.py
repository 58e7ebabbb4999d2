"""The model's expert weights -> the canonical [E, N, K] roles a QuantWeight packs.

Shapes:  E experts, H hidden, F expert FFN width.

FC1 becomes [E, 2F, H] with gate rows 0..F-1 then up rows F..2F-1, whatever the model's layout
("separate", "concat", "interleaved"; stored [out, in] or transposed [in, out]); FC2 becomes
[E, H, F].  Packing goes expert by expert, so the only full-precision temporary is one expert's
role, never a second copy of all experts.
"""

from __future__ import annotations

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.quant.common import QuantWeight
from moe_compile.quant.formats import concat, pack


def refusal(w: ExpertWeights, attrs: FFNAttrs) -> str | None:
    """Why these experts cannot be quantized, or None: only SwiGLU experts without biases are."""
    if w.fc1_bias or w.fc1_up_bias or w.fc2_bias:
        return "the experts have biases (quantized variants cover SwiGLU experts without biases)"
    if attrs.gate_up == "none" or attrs.activation != "silu":
        return (f"the experts' activation is {attrs.activation!r} with gate_up={attrs.gate_up!r} "
                f"(quantized variants cover SwiGLU: silu(gate) * up)")
    if attrs.weight_on == "input":
        return "the routing weight multiplies the input (weight_on='input'); quantized variants take 'output' or 'between'"
    return None


def _out_in(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    return t.t() if transposed else t


def fc1_rows(w: ExpertWeights, attrs: FFNAttrs, e: int) -> torch.Tensor:
    """Expert e's FC1 as [2F, H]: gate rows then up rows."""
    first = _out_in(w.fc1_of(e), w.transposed)  # [2F, H] or [F, H] (separate)
    if attrs.gate_up == "separate":
        return torch.cat([first, _out_in(w.fc1_up_of(e), w.transposed)])
    if attrs.gate_up == "interleaved":
        return torch.cat([first[0::2], first[1::2]])
    return first


def fc2_rows(w: ExpertWeights, e: int) -> torch.Tensor:
    """Expert e's FC2 as [H, F]."""
    return _out_in(w.fc2_of(e), w.transposed)


def pack_experts(fmt: str, rows_of, num_experts: int, group: int | None = None) -> QuantWeight:
    """``rows_of(e)`` [N, K] for each expert -> one QuantWeight [E, N, K], packed expert by expert."""
    parts = [pack(fmt, rows_of(e).detach()[None], group) for e in range(num_experts)]
    return concat(parts)


def pack_moe(fmt: str, w: ExpertWeights, attrs: FFNAttrs, group: int | None = None):
    """(FC1 QuantWeight [E, 2F, H], FC2 QuantWeight [E, H, F]) of the model's experts."""
    reason = refusal(w, attrs)
    if reason:
        raise ValueError(f"{fmt}: {reason}")
    E = w.num_experts
    w1 = pack_experts(fmt, lambda e: fc1_rows(w, attrs, e), E, group)
    w2 = pack_experts(fmt, lambda e: fc2_rows(w, e), E, group)
    return w1, w2
