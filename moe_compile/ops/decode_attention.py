"""The decode attention operator: ``torch.ops.moe_compile.decode_attention``.

Shapes:  B batch, H query heads, G key/value heads (H = G R), L query rows, S keys, D head dim.

    decode_attention(q [B, H, L, D], k [B, G, S, D], v [B, G, S, D], mask, scale) -> out [B, H, L, D]

It is ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
enable_gqa=H != G)`` with no dropout and no causal flag: query head h reads key/value head h // R;
``mask`` is None, bool (True attends) or float (added to the scores), broadcastable to
[B, H, L, S].  ``passes/attention.py`` emits it for the few-row (decode) SDPA calls of CPU
inference graphs (no backward).  On the CPU a fp32 call runs ``kernels/cpu/attention.c`` through
the C++ kernel ``kernels/cpu/attention_op.cpp``; everything else, and any call that kernel
declines, is torch's SDPA (``decode_attention_general``).  Registered when ``moe_compile.ops`` is
imported (by the backend, not by ``import moe_compile``).
"""

from __future__ import annotations

import torch

OP_NAME = "moe_compile::decode_attention"
_LIB = torch.library.Library("moe_compile", "FRAGMENT")
_LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor")
_LIB.define("decode_attention_general(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor")


def _decode_attention(q, k, v, mask, scale):
    """The Python kernel, registered for every backend.  Its first CPU call installs the C++ CPU
    kernel (``kernels/cpu/attention.py: install``), which serves later CPU calls ahead of this one."""
    if q.device.type == "cpu":
        from moe_compile.kernels.cpu import attention

        attention.install()
    return _decode_attention_general(q, k, v, mask, scale)


def _decode_attention_general(q, k, v, mask, scale):
    # contiguous, as the fake says: torch's CPU flash kernel returns [B, L, H, D] memory permuted to
    # [B, H, L, D] once L > 1 (seen at 32 heads of 128, L = 16), which a compiled graph's stride
    # checks reject
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]).contiguous()


def _decode_attention_fake(q, k, v, mask, scale):
    return q.new_empty(q.shape)


_LIB.impl("decode_attention", _decode_attention, "CompositeExplicitAutograd")
for _key in ("CPU", "CUDA"):
    _LIB.impl("decode_attention_general", _decode_attention_general, _key)
torch.library.register_fake(OP_NAME, lib=_LIB)(_decode_attention_fake)
torch.library.register_fake("moe_compile::decode_attention_general", lib=_LIB)(_decode_attention_fake)
