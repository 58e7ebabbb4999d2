"""oneDNN GEMMs for the CPU path: y = x W^T on an expert's weight, plain or prepacked.

Shapes:  x [n, in] (rows may be strided), W [out, in] (any strides: a transposed [in, out] view
         works) or W prepacked by ``cpu_prepack.pack``; bias [out] or None -> y [n, out], fresh.

Why: for the small GEMMs of MoE experts, torch's own ``mkldnn::_linear_pointwise`` (oneDNN)
beats MKL's sgemm on the same plain fp32 weights, and writes row-major output directly.  Sum over
all experts, fp32, 2 threads, 2-core CI VM, MKL ``x @ W^T`` / oneDNN, ms:
  E=64 [1024, 1024]: 16 rows 33 / 23, 64 rows 66 / 53, 256 rows 207 / 174;
  E=64 [1024, 512]: 64 rows 51 / 33;  E=8 [4096, 1024]: 64 rows 36 / 26, 512 rows 202 / 165.
fp32 only: bf16 stays on torch's GEMMs (oneDNN's bf16 speed depends on the CPU's bf16 support).
``MOE_COMPILE_ONEDNN=0`` turns these GEMMs (and the packed weights built on them) off.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "MOE_COMPILE_ONEDNN"


def unavailable_reason() -> str | None:
    """Why oneDNN GEMMs are not used in this process, or None when they are."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    return _build_lacks()


@functools.cache
def _build_lacks() -> str | None:
    """What this torch build lacks for these GEMMs (looked up once: ``fits`` runs per expert GEMM)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch build lacks mkldnn::_linear_pointwise / _reorder_linear_weight"
    return None


def available() -> bool:
    return unavailable_reason() is None


def fits(x: torch.Tensor, w_out_in: torch.Tensor) -> bool:
    """Whether ``linear`` runs this GEMM: fp32 CPU operands and oneDNN available."""
    return (
        x.dtype == torch.float32 and w_out_in.dtype == torch.float32 and x.device.type == "cpu"
        and w_out_in.device.type == "cpu" and x.dim() == 2 and available()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] times weight [out, in] (plain or packed) -> a fresh [n, out], plus bias [out]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
