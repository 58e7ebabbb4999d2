"""Triton quantized grouped GEMMs (kernels/triton/quant_gemm.py) on a real GPU, against
``quant.reference_moe``: the GPU lane's check of what tests/kernels/test_triton_quant.py runs in
the interpreter.  Until this passes on a device the variants stay "unverified" in
``moe_compile/devices.py`` and ``quant="auto"`` never picks them.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token; H = 256, F = 384
are whole groups of 32 and whole tiles; T = 1, 16, 300 cover decode, a partly padded tile and
several tiles per expert; one id lies outside [0, E).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Tolerances as in the interpreter test (tests/kernels/test_triton_quant.py), which says why;
# the GPU's fp32 FMA order differs again from the reference's, so the float formats get 4x room.
TOL = {"w8-int": 8e-6, "w4-int": 8e-6, "mxfp4": 8e-6, "a8w8-int": 1e-6, "a8w4-int": 1e-6}


def _on(w, device):
    return dataclasses.replace(w, data=w.data.to(device), scale=w.scale.to(device),
                               bias=None if w.bias is None else w.bias.to(device))


@pytest.mark.parametrize("fmt", list(TOL))
@pytest.mark.parametrize("T,weight_on,limit", [(1, "output", 0.0), (16, "between", 0.0), (300, "output", 0.5)])
def test_quant_moe_triton_on_gpu_matches_the_reference(fmt, T, weight_on, limit):
    pytest.importorskip("triton")
    from moe_compile.ir import FFNAttrs
    from moe_compile.kernels.triton.quant_gemm import quant_moe_triton
    from moe_compile.quant import pack, reference_moe

    g = torch.Generator().manual_seed(T)
    E, H, F, K = 8, 256, 384, 2
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[0, -1] = E  # contributes nothing
    weights = torch.rand(T, K, generator=g)
    w1 = _pack(fmt, torch.randn(E, 2 * F, H, generator=g) / 16)
    w2 = _pack(fmt, torch.randn(E, H, F, generator=g) / 16)
    attrs = FFNAttrs(weight_on=weight_on, limit=limit)
    want = reference_moe(x, ids, weights, w1, w2, attrs)
    got = quant_moe_triton(x.cuda(), ids.cuda(), weights.cuda(), _on(w1, "cuda"), _on(w2, "cuda"), attrs).cpu()
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= TOL[fmt], err


def _pack(fmt, w):
    """The Triton GEMMs run a8w4-int's per-channel (MSD) form; the group-wise CPU default is refused."""
    from moe_compile.quant import a8w4_int

    return a8w4_int.pack(w, group_size=None) if fmt == "a8w4-int" else pack(fmt, w)
