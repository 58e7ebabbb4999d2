"""The operators the passes emit, each registered with ``torch.library`` when this package is first
imported (by the backend, not by ``import moe_compile``; importing it never touches CUDA):

    fused_moe.py         torch.ops.moe_compile.fused_moe / _train / _infer / _quant: the MoE layer
    autograd.py          fused_moe's backward (CPU kernels or Triton, per role)
    dense_linear.py      torch.ops.moe_compile.dense_linear: a packed dense linear layer
    decode_attention.py  torch.ops.moe_compile.decode_attention: one decode step's attention
    packed.py            the ops that take ``PackedWeight`` parameters without repacking them

The names below are the fused op's Python entry points, kept here so that
``from moe_compile.ops.fused_moe import call_fused_moe`` reads as it always has.
"""

from moe_compile.ops import autograd, decode_attention, dense_linear, fused_moe  # noqa: F401  registers them
from moe_compile.ops.fused_moe import OP_NAME, TRAIN_OP_NAME, call_fused_moe  # noqa: F401
