"""Triton MoE backward kernels (kernels/triton/backward.py) against autograd through the reference.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

Interpreter tests (TRITON_INTERPRET=1, CPU tensors, fp32 / fp16: the interpreter's bf16 is broken)
run on tiny odd shapes with the interpreter's 16 x 32 x 32 tiles, so H = 40, F = 24 are never block
multiples.  GPU tests (marker ``gpu``) run bf16 on CUDA, plus the op's autograd dispatch.

The reference gradients come from ``torch.autograd`` through ``kernels/reference.py`` on fp32
copies of the inputs.  fp32: reassociation only (1e-4 relative to the largest gradient entry);
fp16 / bf16: the kernels round dH, g*a and the dx rows to the input dtype (like the forward's
activation), a few ulps -> 1e-2 / 3e-2.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.conftest import routing_ids

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are defined: set before importing them

from moe_compile.ir import ExpertWeights, FFNAttrs  # noqa: E402
from moe_compile.kernels.cpu.backward import ROLES, Needs  # noqa: E402
from moe_compile.kernels.reference import fused_moe_reference  # noqa: E402
from moe_compile.kernels.triton.autotune import TileConfig  # noqa: E402
from moe_compile.kernels.triton.backward import fused_moe_backward_triton, unsupported_reason  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
interp = pytest.mark.skipif(ON_GPU, reason="CUDA present: the gpu-marked tests of this file cover the kernels")

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def make_case(T, K, E, H, F, *, mode="random", dtype=torch.float32, gate_up="concat", stacked=True,
              transposed=False, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    fc1_out = 2 * F if gate_up in ("concat", "interleaved") else F

    def weight(out_dim, in_dim):
        t = torch.randn(E, out_dim, in_dim, generator=gen) / in_dim**0.5
        t = (t.transpose(1, 2).contiguous() if transposed else t).to(device, dtype)
        return (t,) if stacked else tuple(t[e].clone() for e in range(E))

    w = ExpertWeights(weight(fc1_out, H), weight(F, H) if gate_up == "separate" else (), weight(H, F),
                      transposed=transposed)
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    ids = routing_ids(mode, T, K, E, gen)
    weights = (torch.rand(T, K, generator=gen) + 0.1).to(device)
    dy = torch.randn(T, H, generator=gen).to(device, dtype)
    return x, ids.to(device), weights, w, dy


def reference_grads(x, ids, weights, w: ExpertWeights, attrs, dy):
    """Autograd through the reference on fp32 leaf copies -> flat [dx, dg, *role tensors' grads]."""
    leaves = [x.float().requires_grad_(), weights.float().requires_grad_()]
    roles = {}
    for r in ROLES:
        roles[r] = tuple(t.detach().float().requires_grad_() for t in getattr(w, r))
        leaves += roles[r]
    w32 = ExpertWeights(*(roles[r] for r in ROLES), transposed=w.transposed)
    y = fused_moe_reference(leaves[0], ids, leaves[1], w32, attrs)
    if y.grad_fn is None:  # T = 0: nothing flows
        return [torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad(y, leaves, dy.float(), allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


def check(T, K, E, H, F, *, attrs=None, config=None, needs_mask=None, **kw):
    x, ids, weights, w, dy = make_case(T, K, E, H, F, **kw)
    attrs = attrs or FFNAttrs(gate_up=kw.get("gate_up", "concat"), transposed=kw.get("transposed", False))
    role_needs = {r: [True] * len(getattr(w, r)) for r in ROLES}
    needs = Needs(True, True, role_needs)
    if needs_mask is not None:
        needs = needs_mask(needs)
    dx, dg, roles = fused_moe_backward_triton(dy, x, ids, weights, w, attrs, needs, configs=config)
    got = [dx, dg, *[g for r in ROLES for g in roles[r]]]
    want = reference_grads(x, ids, weights, w, attrs, dy)
    flags = [needs.x, needs.topk_weights, *[n for r in ROLES for n in needs.roles[r]]]
    names = ["dx", "dg", *[f"{r}[{i}]" for r in ROLES for i in range(len(getattr(w, r)))]]
    tol = TOLERANCE[x.dtype]
    scale_w = max([float(g.abs().max()) for g in want[2:] if g.numel()] + [1e-6])
    for name, g, ref, need in zip(names, got, want, flags):
        if not need:
            assert g is None, f"{name} was not asked for"
            continue
        assert g is not None and g.shape == ref.shape, name
        # Per-expert weight gradients are compared against the largest weight gradient (an expert
        # with 1 token has tiny gradients); dx and dg against their own largest entry.
        scale = scale_w if name not in ("dx", "dg") else max(float(ref.abs().max()) if ref.numel() else 0.0, 1e-6)
        err = float((g.float() - ref).abs().max()) / scale if g.numel() else 0.0
        assert err <= tol, f"{name}: max error {err:.2e} relative to {scale:.2e}"


# -- interpreter ---------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("T,K", [(0, 2), (1, 1), (7, 2), (57, 3)])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_shapes_fp32(T, K, stacked):
    check(T, K, 4, 40, 24, stacked=stacked)


@interp
@pytest.mark.parametrize("gate_up", ["concat", "interleaved", "separate"])
@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_layouts(gate_up, transposed):
    attrs = FFNAttrs(gate_up=gate_up, transposed=transposed)
    check(9, 2, 3, 40, 24, gate_up=gate_up, transposed=transposed, stacked=gate_up != "interleaved", attrs=attrs)


@interp
@pytest.mark.parametrize("mode", ["one_expert", "sparse", "invalid"])
def test_routing_odd_cases(mode):
    check(9, 2, 6, 40, 24, mode=mode, stacked=mode != "sparse")


@interp
def test_weight_between_fp16_and_tiles():
    check(11, 2, 4, 40, 24, dtype=torch.float16, attrs=FFNAttrs(weight_on="between"))
    cfg = TileConfig(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
    check(23, 2, 3, 40, 40, config=(cfg, cfg, cfg), gate_up="separate", attrs=FFNAttrs(gate_up="separate"))


@interp
def test_frozen_roles_and_fewer_tokens_than_experts():
    def frozen(needs):
        needs.roles["fc2"] = [False] * len(needs.roles["fc2"])
        needs.roles["fc1"] = [e != 1 for e in range(len(needs.roles["fc1"]))]  # one frozen expert
        needs.topk_weights = False
        return needs

    check(3, 2, 5, 40, 24, stacked=False, needs_mask=frozen)
    check(5, 1, 4, 40, 24, needs_mask=lambda n: Needs(False, True, {r: [False] * len(v) for r, v in n.roles.items()}))


@interp
def test_unsupported_cases_are_named():
    x, ids, weights, w, dy = make_case(3, 1, 2, 8, 4)
    assert unsupported_reason(dy, x, ids, weights, w, FFNAttrs()) is None
    assert "gelu" in unsupported_reason(dy, x, ids, weights, w, FFNAttrs(activation="gelu"))
    assert "weight_on" in unsupported_reason(dy, x, ids, weights, w, FFNAttrs(weight_on="input"))
    assert "limit" in unsupported_reason(dy, x, ids, weights, w, FFNAttrs(limit=1.0))


# -- GPU -----------------------------------------------------------------------------------------


@pytest.fixture
def _no_autotune(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_COMPILE_AUTOTUNE", "0")
    monkeypatch.setenv("MOE_COMPILE_CACHE_DIR", str(tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.usefixtures("_no_autotune")
@pytest.mark.parametrize(
    "T,gate_up,stacked",
    [(1, "concat", True), (123, "concat", True), (123, "concat", False), (123, "interleaved", True),
     (57, "separate", False), (57, "separate", True)],
)
def test_gpu_bf16(T, gate_up, stacked):
    check(T, 2, 6, 72, 40, gate_up=gate_up, stacked=stacked, dtype=torch.bfloat16, device="cuda",
          attrs=FFNAttrs(gate_up=gate_up))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.usefixtures("_no_autotune")
@pytest.mark.parametrize("kw", [dict(dtype=torch.float32, transposed=True, mode="invalid"),
                                dict(dtype=torch.float16, mode="one_expert"),
                                dict(dtype=torch.bfloat16, mode="sparse")], ids=["fp32-T-invalid", "fp16-one", "bf16-sparse"])
def test_gpu_other_cases(kw):
    check(77, 2, 4, 72, 40, device="cuda", attrs=FFNAttrs(transposed=kw.get("transposed", False)), **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_autotuned_medium_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_COMPILE_CACHE_DIR", str(tmp_path))
    check(300, 4, 16, 512, 256, dtype=torch.bfloat16, device="cuda", attrs=FFNAttrs(weight_on="between"))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_op_backward_uses_triton(monkeypatch, tmp_path):
    """The op's autograd on CUDA runs the Triton backward (no fallback warning) and matches."""
    import warnings

    from moe_compile.kernels.cpu import backward as cpu_backward
    from moe_compile.ops.fused_moe import call_fused_moe

    def no_torch_backward(*args, **kwargs):
        raise AssertionError("the torch segment backward ran instead of the Triton backward")

    monkeypatch.setattr(cpu_backward, "fused_moe_backward_cpu", no_torch_backward)
    monkeypatch.setenv("MOE_COMPILE_CACHE_DIR", str(tmp_path))
    x, ids, weights, w, dy = make_case(65, 2, 8, 128, 64, dtype=torch.bfloat16, device="cuda", stacked=False)
    xs = x.clone().requires_grad_()
    ws = weights.clone().requires_grad_()
    fc1 = [t.clone().requires_grad_() for t in w.fc1]
    fc2 = [t.clone().requires_grad_() for t in w.fc2]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y = call_fused_moe(xs, ids, ws, ExpertWeights(tuple(fc1), (), tuple(fc2)), FFNAttrs())
        y.backward(dy)
    want = reference_grads(x, ids, weights, w, FFNAttrs(), dy)
    for got, ref in zip([xs.grad, ws.grad, *[t.grad for t in fc1], *[t.grad for t in fc2]], want):
        assert float((got.float() - ref).abs().max()) <= 3e-2 * float(ref.abs().max()) + 1e-6
