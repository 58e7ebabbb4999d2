"""Triton MoE kernels on a CUDA device, bf16/fp16/fp32, against the reference.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

Same odd cases as the interpreter tests (test_triton_kernels.py), compiled for the real GPU, plus
bf16 (which only the GPU can check) and one medium shape that goes through autotuning.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

from tests.conftest import routing_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode: see test_triton_kernels.py"),
]

# bf16: 8 mantissa bits; the kernel rounds the FC1 activation and each expert's output to bf16
# before the next step (the reference keeps fp32), a few bf16 ulps (2^-8) of the largest output.
# fp16 likewise with 2^-11 ulps.  fp32 runs with input_precision="ieee" (no TF32): reassociation only.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch, tmp_path):
    """Tiny shapes take the class's first config (tuning each would only cost compile time)."""
    monkeypatch.setenv("MOE_COMPILE_AUTOTUNE", "0")
    monkeypatch.setenv("MOE_COMPILE_CACHE_DIR", str(tmp_path))


def make_case(T, K, E, H, F, *, mode="random", dtype=torch.bfloat16, gate_up="concat", stacked=True,
              transposed=False, bias=False, seed=0):
    from moe_compile.ir import ExpertWeights

    gen = torch.Generator().manual_seed(seed)
    fc1_out = 2 * F if gate_up in ("concat", "interleaved") else F

    def weight(out_dim, in_dim):
        t = torch.randn(E, out_dim, in_dim, generator=gen) / in_dim**0.5
        t = t.transpose(1, 2).contiguous() if transposed else t
        t = t.to("cuda", dtype)
        return (t,) if stacked else tuple(t[e].clone() for e in range(E))

    def bias_role(n):
        b = (torch.randn(E, n, generator=gen) * 0.1).to("cuda", dtype)
        return (b,) if E == 1 else tuple(b[e].clone() for e in range(E))

    w = ExpertWeights(
        weight(fc1_out, H), weight(F, H) if gate_up == "separate" else (), weight(H, F),
        fc1_bias=bias_role(fc1_out) if bias else (),
        fc1_up_bias=bias_role(F) if bias and gate_up == "separate" else (),
        fc2_bias=bias_role(H) if bias else (),
        transposed=transposed,
    )
    x = torch.randn(T, H, generator=gen).to("cuda", dtype)
    ids = routing_ids(mode, T, K, E, gen)
    weights = (torch.rand(T, K, generator=gen) + 0.1).cuda()
    return x, ids.cuda(), weights, w


def check(T, K, E, H, F, attrs=None, config=None, **kw):
    from moe_compile.ir import FFNAttrs
    from moe_compile.kernels.reference import fused_moe_reference
    from moe_compile.kernels.triton.fused_moe import fused_moe_triton

    x, ids, weights, w = make_case(T, K, E, H, F, **kw)
    attrs = attrs or FFNAttrs(gate_up=kw.get("gate_up", "concat"), transposed=kw.get("transposed", False))
    y = fused_moe_triton(x, ids, weights, w, attrs, config=config)
    ref = fused_moe_reference(x, ids, weights, w, attrs)
    assert y.shape == (T, H) and y.dtype == x.dtype
    if T:
        scale = ref.float().abs().max().clamp_min(1e-6)
        err = (y.float() - ref.float()).abs().max() / scale
        assert err <= TOLERANCE[x.dtype], f"max error {err:.2e} relative to max |ref| {scale:.2e}"


@pytest.mark.parametrize("T", [0, 1, 7, 123])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_shapes_bf16(T, K, stacked):
    check(T, K, 4, 40, 24, stacked=stacked)


# Each dtype compiles its own kernels: fp16/fp32 get one odd shape each to bound compile time.
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_shapes_other_dtypes(dtype, stacked):
    check(123, 2, 4, 40, 24, dtype=dtype, stacked=stacked)


@pytest.mark.parametrize("mode", ["one_expert", "sparse", "invalid"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_routing_odd_cases(mode, stacked):
    check(123, 2, 6, 40, 24, mode=mode, stacked=stacked)


@pytest.mark.parametrize("gate_up", ["concat", "interleaved", "separate", "none"])
@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_layouts(gate_up, transposed):
    from moe_compile.ir import FFNAttrs

    check(77, 2, 4, 72, 40, gate_up=gate_up, transposed=transposed, stacked=gate_up != "separate",
          attrs=FFNAttrs(gate_up=gate_up, transposed=transposed))


@pytest.mark.parametrize("gate_up", ["concat", "separate"])
def test_biases(gate_up):
    from moe_compile.ir import FFNAttrs

    check(77, 2, 4, 72, 40, gate_up=gate_up, stacked=False, bias=True, attrs=FFNAttrs(gate_up=gate_up))


@pytest.mark.parametrize(
    "attrs_kw",
    [
        dict(activation="gelu"), dict(activation="gelu_tanh"), dict(activation="relu", weight_on="between"),
        dict(limit=0.5, weight_on="between"), dict(gate_up="interleaved", activation="gptoss", limit=0.7),
        dict(weight_on="input"),
    ],
    ids=lambda d: "-".join(f"{v}" for v in d.values()),
)
def test_activations_and_weight_placement(attrs_kw):
    from moe_compile.ir import FFNAttrs

    attrs = FFNAttrs(**attrs_kw)
    check(77, 2, 4, 72, 40, gate_up=attrs.gate_up, attrs=attrs)


@pytest.mark.parametrize("T", [1, 300])
def test_medium_shape_autotuned(monkeypatch, T):
    """A shape big enough for every candidate tile, through the autotuner and its disk cache."""
    from moe_compile.kernels.triton import autotune

    monkeypatch.setenv("MOE_COMPILE_AUTOTUNE", "1")
    check(T, 4, 16, 512, 256, stacked=T > 1)
    assert autotune.cache_path().exists()


def test_op_dispatches_to_triton_on_cuda():
    """torch.ops.moe_compile.fused_moe on CUDA tensors goes through the Triton kernel."""
    from moe_compile.ir import FFNAttrs
    from moe_compile.kernels.reference import fused_moe_reference
    from moe_compile.ops.fused_moe import call_fused_moe

    x, ids, weights, w = make_case(33, 2, 8, 128, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to the reference warns
        y = call_fused_moe(x, ids, weights, w, FFNAttrs())
    ref = fused_moe_reference(x, ids, weights, w, FFNAttrs())
    assert (y.float() - ref.float()).abs().max() <= 3e-2 * ref.float().abs().max()
