"""Triton quantized grouped GEMMs (kernels/triton/quant_gemm.py) under TRITON_INTERPRET=1, against
``quant.reference_moe``.  UNVERIFIED on a GPU: this interpreter run is all the testing they have.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.  H = 64 and
F = 96 are whole groups of 32 (what the formats need) and whole BLOCK_N tiles; T = 1, 7, 23 leave
most BLOCK_M = 16 tiles partly padding rows, and one id lies outside [0, E).

fp32 activations only (the formats' meaning; bf16 is wrong in the interpreter).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: these kernels are interpreter-tested only", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from moe_compile.ir import FFNAttrs  # noqa: E402
from moe_compile.kernels.triton.quant_gemm import FORMAT_CODES, quant_moe_triton  # noqa: E402
from moe_compile.quant import pack, reference_moe  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Weight-only formats: the same dequantized fp32 values, summed in BLOCK_K chunks: reassociation
# only, ~sqrt(H) 2^-24 relative (measured <= 4e-7).  Integer formats: the int32 sums are exact and
# the scales multiply in the reference's order ((acc * s_x) * s_w); only the SwiGLU's exp and the
# combine's order differ (measured 0 to 1.3e-8).  A one-ulp difference in FC1's output could move
# an element of FC2's re-quantized input by one int8 step; the tolerance would then have to be
# ~1e-3, and a failure here says that happened.
TOL = {"w8-int": 2e-6, "w4-int": 2e-6, "mxfp4": 2e-6, "a8w8-int": 1e-6, "a8w4-int": 1e-6}


@pytest.mark.parametrize("fmt", list(FORMAT_CODES))
@pytest.mark.parametrize("T,weight_on,limit", [pytest.param(1, "output", 0.0, marks=pytest.mark.slow),
                                                (7, "between", 0.0),
                                                pytest.param(23, "output", 0.5, marks=pytest.mark.slow)])
def test_quant_moe_triton_matches_the_reference(fmt, T, weight_on, limit):
    g = torch.Generator().manual_seed(T)
    E, H, F, K = 4, 64, 96, 2
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[0, -1] = E  # an id outside [0, E): contributes nothing
    weights = torch.rand(T, K, generator=g)
    w1 = _pack(fmt, torch.randn(E, 2 * F, H, generator=g) / 8)
    w2 = _pack(fmt, torch.randn(E, H, F, generator=g) / 8)
    attrs = FFNAttrs(weight_on=weight_on, limit=limit)
    want = reference_moe(x, ids, weights, w1, w2, attrs)
    got = quant_moe_triton(x, ids, weights, w1, w2, attrs)
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= TOL[fmt], err


def _pack(fmt, w):
    """The Triton GEMMs run a8w4-int's per-channel (MSD) form; the group-wise CPU default is refused."""
    from moe_compile.quant import a8w4_int

    return a8w4_int.pack(w, group_size=None) if fmt == "a8w4-int" else pack(fmt, w)
