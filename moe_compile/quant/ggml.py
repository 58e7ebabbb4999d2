"""llama.cpp's q4_0 weights x q8_0 activations in plain torch: a yardstick for a8w4-int's error on
the same weights (docs/quantization.md), never a format the op runs.

Shapes:  N output rows, K reduction width (a multiple of 32), B = K / 32 blocks, T rows of x.

As ggml's ``quantize_row_q4_0_ref`` / ``quantize_row_q8_0_ref`` and ``ggml_vec_dot_q4_0_q8_0``:

    q4_0  per block of 32: m = the element of largest |w| (the first such, with its sign),
          d = m / -8, q = min(15, trunc(w / d + 8.5)) (``(int8_t)`` truncation; d = 0 gives q = 8),
          element = (q - 8) * fp16(d)          (q computed with the fp32 d, stored d in fp16)
    q8_0  per block of 32: d = max|x| / 127, q = roundf(x / d) (half away from zero), fp16(d)
    dot   y = sum_b fp16(d_w) * fp16(d_x) * sumi_b,  sumi_b = sum over block b of (q_w - 8) q_x
"""

from __future__ import annotations

import torch

BLOCK = 32


def _blocks(t: torch.Tensor) -> torch.Tensor:
    return t.float().reshape(*t.shape[:-1], t.shape[-1] // BLOCK, BLOCK)


def q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., K] -> (q int32 [..., K] in [-8, 7] (q4_0's code less 8), d fp32 [..., B] = fp16(d))."""
    wb = _blocks(w)  # [..., B, 32]
    m = wb.gather(-1, wb.abs().argmax(dim=-1, keepdim=True))  # signed element of largest |w|
    d = m / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(wb * inv + 8.5), max=15.0)  # trunc toward zero, as (int8_t)
    return (q.to(torch.int32) - 8).reshape(w.shape), d[..., 0].half().float()


def q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int32 [..., K] in [-127, 127], d fp32 [..., B] = fp16(d))."""
    xb = _blocks(x)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    v = xb * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # roundf: half away from zero
    return q.to(torch.int32).reshape(x.shape), d[..., 0].half().float()


def dequantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """W [..., K] -> its q4_0 values, fp32 [..., K]."""
    q, d = q4_0(w)
    return (_blocks(q) * d[..., None]).reshape(w.shape)


def matmul_q4_0_q8_0(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] fp32, W [N, K] -> y [T, N] as llama.cpp's CPU q4_0 matmul computes it."""
    qw, dw = q4_0(w)  # [N, K], [N, B]
    qx, dx = q8_0(x)  # [T, K], [T, B]
    sumi = torch.einsum("tbk,nbk->tnb", _blocks(qx), _blocks(qw))  # exact: |sumi| < 2^24
    return (sumi * (dx[:, None, :] * dw[None])).sum(-1)


def moe_q4_0(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
             limit: float = 0.0) -> torch.Tensor:
    """The SwiGLU MoE (routing weight on the output) as llama.cpp computes it in q4_0 weights with
    q8_0 activations: x [T, H], ids / weights [T, K], fp32 W1 [E, 2F, H] (gate rows, then up rows),
    W2 [E, H, F] -> y [T, H] fp32 (``quant.reference_moe``'s meaning in llama.cpp's numerics)."""
    from moe_compile.quant.reference import swiglu

    y = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(w1.shape[0]):
        tok, k = torch.where(ids == e)
        if tok.numel():
            a = swiglu(matmul_q4_0_q8_0(x[tok].float(), w1[e]), limit)
            y.index_add_(0, tok, matmul_q4_0_q8_0(a, w2[e]) * weights[tok, k].float()[:, None])
    return y
