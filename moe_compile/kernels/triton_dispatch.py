"""Chooses the Triton forward kernel for CUDA tensors, or None when Triton is not usable.

The kernel returned never gives a wrong result: inputs the Triton path does not handle
(``fused_moe.unsupported_reason``: fp64, weights of another dtype than x, per-expert tensors with
different strides, ...) and any launch failure (e.g. a tile that does not fit a smaller GPU's
shared memory) go to ``kernels.reference`` instead, with one warning per reason.
``MOE_COMPILE_TRITON=0`` turns the Triton path off.
"""

from __future__ import annotations

import os
import warnings

_warned: set[str] = set()


def forward_kernel():
    """The Triton implementation of the fused op's forward, or None (the caller falls back)."""
    if os.environ.get("MOE_COMPILE_TRITON", "1") == "0":
        return None
    try:
        from moe_compile.kernels.triton.fused_moe import fused_moe_triton  # noqa: F401
    except ImportError:
        return None
    return triton_or_reference


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def triton_or_reference(x, topk_ids, topk_weights, w, attrs):
    """Triton when it supports the inputs, the reference otherwise (same result either way)."""
    from moe_compile.kernels.reference import fused_moe_reference
    from moe_compile.kernels.triton.fused_moe import fused_moe_triton, unsupported_reason

    reason = unsupported_reason(x, topk_ids, w, attrs)
    if reason is not None:
        _warn_once(f"moe_compile: Triton MoE kernel not used ({reason}); running the reference")
        return fused_moe_reference(x, topk_ids, topk_weights, w, attrs)
    try:
        return fused_moe_triton(x, topk_ids, topk_weights, w, attrs)
    except Exception as exc:  # noqa: BLE001 - compile/launch failure: the reference is always right
        _warn_once(f"moe_compile: Triton MoE kernel failed ({type(exc).__name__}: {exc}); running the reference")
        return fused_moe_reference(x, topk_ids, topk_weights, w, attrs)


def backward(grad_y, x, topk_ids, topk_weights, w, attrs, needs, fc1_out=None):
    """Gradients of the fused op (``cpu_backward.fused_moe_backward_cpu``'s contract): the Triton
    backward for CUDA tensors it supports (``triton.backward.unsupported_reason``: gated silu without
    clamp, weight_on output/between, no biases), the plain-torch segment backward otherwise."""
    from moe_compile.kernels.cpu.backward import fused_moe_backward_cpu

    if x.is_cuda and os.environ.get("MOE_COMPILE_TRITON", "1") != "0":
        try:
            from moe_compile.kernels.triton.backward import fused_moe_backward_triton, unsupported_reason
        except ImportError:
            unsupported_reason = None
        if unsupported_reason is not None:
            reason = unsupported_reason(grad_y, x, topk_ids, topk_weights, w, attrs)
            if reason is None:
                try:
                    return fused_moe_backward_triton(grad_y, x, topk_ids, topk_weights, w, attrs, needs)
                except Exception as exc:  # noqa: BLE001 - the torch backward is always right
                    _warn_once(f"moe_compile: Triton MoE backward failed ({type(exc).__name__}: {exc}); "
                               "running the torch backward")
    return fused_moe_backward_cpu(grad_y, x, topk_ids, topk_weights, w, attrs, needs, fc1_out)
