"""Chooses the Triton forward kernel for CUDA tensors, or None when Triton is not usable."""

from __future__ import annotations


def forward_kernel():
    """The Triton implementation of the fused op's forward, or None (the caller falls back)."""
    try:
        from moe_compile.kernels.triton.fused_moe import fused_moe_triton
    except ImportError:
        return None
    return fused_moe_triton
