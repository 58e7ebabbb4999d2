"""The meaning of the fused MoE op in plain torch: the oracle every other path is tested against.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

    y_t = sum_k  g_{t,k} * FFN_{e_{t,k}}(x_t)                     weight_on="output"
    y_t = sum_k  down_e( g_{t,k} * act(gate_e(x_t), up_e(x_t)) )   weight_on="between"
    y_t = sum_k  FFN_{e_{t,k}}(g_{t,k} * x_t)                     weight_on="input"

Ids outside [0, E) contribute nothing (the sentinel convention of HF and expert-parallel code).
Accumulation is fp32 (fp64 when x is fp64, so gradcheck can use this); the output has x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_compile.ir import ExpertWeights, FFNAttrs


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gated_activation(h: torch.Tensor, attrs: FFNAttrs) -> torch.Tensor:
    """[n, 2F] or ([n, F], [n, F]) FC1 output -> [n, F] activation, as the IR describes it."""
    if attrs.gate_up == "none":
        return _act(h, attrs.activation)
    if attrs.gate_up == "interleaved":
        gate, up = h[..., 0::2], h[..., 1::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    if attrs.activation == "gptoss":
        # GPT-OSS: clamp, gate * sigmoid(alpha * gate), (up + 1) as the linear part.
        gate = gate.clamp(max=attrs.limit)
        up = up.clamp(-attrs.limit, attrs.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * attrs.alpha))
    if attrs.limit > 0:
        gate = gate.clamp(max=attrs.limit)
        up = up.clamp(-attrs.limit, attrs.limit)
    return _act(gate, attrs.activation) * up


def _act(h: torch.Tensor, name: str) -> torch.Tensor:
    if name == "silu":
        return F.silu(h)
    if name == "gelu":
        return F.gelu(h)
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if name == "relu":
        return F.relu(h)
    raise ValueError(f"unknown activation {name!r}")


def expert_fc1(w: ExpertWeights, e: int, xe: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FC1 of expert e on rows xe [n, H] -> [n, 2F] (fused gate/up) or [n, F] ('none')."""
    h = _linear(xe, w.fc1_of(e), w.fc1_bias_of(e), w.transposed, dtype)
    if w.fc1_up:
        up = _linear(xe, w.fc1_up_of(e), w.fc1_up_bias_of(e), w.transposed, dtype)
        h = torch.cat([h, up], dim=-1)
    return h


def _linear(x, weight, bias, transposed, dtype):
    weight = weight.to(dtype)
    out = x @ weight if transposed else x @ weight.t()
    if bias is not None:
        out = out + bias.to(dtype)
    return out


def fused_moe_reference(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    w: ExpertWeights,
    attrs: FFNAttrs,
) -> torch.Tensor:
    dtype = compute_dtype(x.dtype)
    T, H = x.shape
    y = torch.zeros(T, H, dtype=dtype, device=x.device)
    for e in range(w.num_experts):
        tok, k = torch.where(topk_ids == e)  # [n], [n]
        if tok.numel() == 0:
            continue
        xe = x[tok].to(dtype)  # [n, H]
        g = topk_weights[tok, k].to(dtype)[:, None]  # [n, 1]
        if attrs.weight_on == "input":
            xe = xe * g
        h = gated_activation(expert_fc1(w, e, xe, dtype), attrs)  # [n, F]
        if attrs.weight_on == "between":
            h = h * g
        out = _linear(h, w.fc2_of(e), w.fc2_bias_of(e), w.transposed, dtype)  # [n, H]
        if attrs.weight_on == "output":
            out = out * g
        y.index_add_(0, tok, out)
    return y.to(x.dtype)
