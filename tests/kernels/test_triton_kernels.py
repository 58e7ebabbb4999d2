"""Triton MoE kernels under the interpreter (TRITON_INTERPRET=1, CPU tensors), against the reference.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

fp16 and fp32 only: the interpreter's bf16 arithmetic and bf16 tl.dot are wrong (bf16 is stored as
uint16), so bf16 is tested on the GPU lane (test_triton_gpu.py).  The tiles are the interpreter's
16 x 32 x 32 (autotune.INTERPRETER_CONFIG), so H = 40 and F = 24 / 40 are never multiples of a block.

On a machine with CUDA this module is skipped unless TRITON_INTERPRET=1 is already set: the
interpreter flag is read when a kernel is defined, so setting it here would turn the GPU tests of
the same pytest run into interpreter runs.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: the GPU lane tests these kernels (tests/kernels/test_triton_gpu.py)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from moe_compile.ir import ExpertWeights, FFNAttrs  # noqa: E402
from moe_compile.kernels import triton_dispatch  # noqa: E402
from moe_compile.kernels.reference import fused_moe_reference  # noqa: E402
from moe_compile.kernels.triton.align import align_by_expert  # noqa: E402
from moe_compile.kernels.triton.autotune import TileConfig  # noqa: E402
from moe_compile.kernels.triton.fused_moe import fused_moe_triton  # noqa: E402

# The interpreter's numpy emits a DeprecationWarning per scalar index: noise, not a finding.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# fp32: the kernel sums H and F in BLOCK_K chunks and the K experts in another order than the
# reference, so results differ by reassociation only: ~sqrt(H) * 2^-24 relative, far below 1e-4.
# fp16: the kernel rounds the FC1 activation [S, F] and each expert's output to fp16 before the
# next step (the reference keeps fp32 throughout): a few fp16 ulps (2^-11) -> 1e-2.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}


def make_routing(T, K, E, mode, gen):
    """ids [T, K], weights [T, K]; mode picks the odd case."""
    if mode == "random":
        ids = torch.randint(0, E, (T, K), generator=gen)
    elif mode == "one_expert":  # every slot on expert E-1, the others get no token
        ids = torch.full((T, K), E - 1, dtype=torch.long)
    elif mode == "sparse":  # experts 1..E-2 get no token
        ids = torch.randint(0, 2, (T, K), generator=gen) * (E - 1)
    elif mode == "invalid":  # ids outside [0, E) contribute nothing
        ids = torch.randint(-1, E + 1, (T, K), generator=gen)
    else:
        raise ValueError(mode)
    weights = torch.rand(T, K, generator=gen) + 0.1
    return ids, weights


def make_weights(E, H, F, *, gate_up="concat", stacked=True, transposed=False, bias=False, dtype=torch.float32, gen=None):
    """ExpertWeights in the requested layout; values scaled so activations stay O(1)."""
    fc1_out = 2 * F if gate_up in ("concat", "interleaved") else F

    def weight(out_dim, in_dim):
        t = torch.randn(E, out_dim, in_dim, generator=gen) / in_dim**0.5  # [E, out, in]
        return t.transpose(1, 2).contiguous() if transposed else t

    def role(t):
        return (t.to(dtype),) if stacked else tuple(t[e].to(dtype).clone() for e in range(E))

    def bias_role(n):
        # ir.ExpertWeights counts a stacked [E, n] bias as one expert, so stacked biases only
        # validate for E = 1; otherwise biases are E x [n] (which also covers the pointer table).
        b = torch.randn(E, n, generator=gen) * 0.1
        return (b.to(dtype),) if E == 1 else tuple(b[e].to(dtype).clone() for e in range(E))

    fc1 = role(weight(fc1_out, H))
    fc1_up = role(weight(F, H)) if gate_up == "separate" else ()
    fc2 = role(weight(H, F))
    return ExpertWeights(
        fc1, fc1_up, fc2,
        fc1_bias=bias_role(fc1_out) if bias else (),
        fc1_up_bias=bias_role(F) if bias and gate_up == "separate" else (),
        fc2_bias=bias_role(H) if bias else (),
        transposed=transposed,
    )


def check(T, K, E, H, F, *, mode="random", dtype=torch.float32, attrs=None, config=None, seed=0, **wkw):
    gen = torch.Generator().manual_seed(seed)
    attrs = attrs or FFNAttrs(gate_up=wkw.get("gate_up", "concat"), transposed=wkw.get("transposed", False))
    w = make_weights(E, H, F, dtype=dtype, gen=gen, **wkw)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids, weights = make_routing(T, K, E, mode, gen)
    y = fused_moe_triton(x, ids, weights, w, attrs, config=config)
    ref = fused_moe_reference(x, ids, weights, w, attrs)
    assert y.shape == (T, H) and y.dtype == dtype
    if T:
        scale = ref.float().abs().max().clamp_min(1e-6)
        err = (y.float() - ref.float()).abs().max() / scale
        assert err <= TOLERANCE[dtype], f"max error {err:.2e} relative to max |ref| {scale:.2e}"


# -- align -------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,K,E,block_m", [(1, 1, 4, 16), (7, 2, 5, 4), (123, 2, 8, 16), (9, 3, 3, 2)])
def test_align_segments(T, K, E, block_m):
    gen = torch.Generator().manual_seed(T)
    ids = torch.randint(-1, E + 1, (T, K), generator=gen)
    sorted_slots, block_expert, total = align_by_expert(ids, E, block_m)
    flat = ids.reshape(-1)
    counts = torch.stack([(flat == e).sum() for e in range(E)])
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(total) == int(padded.sum())
    start = 0
    for e in range(E):
        seg = sorted_slots[start : start + int(padded[e])]
        real = seg[: int(counts[e])]
        assert torch.equal(real.long(), torch.nonzero(flat == e).reshape(-1)), "slots of e, in order"
        assert bool((seg[int(counts[e]) :] == flat.numel()).all()), "padding holds the sentinel S"
        blocks = block_expert[start // block_m : (start + int(padded[e])) // block_m]
        assert bool((blocks == e).all())
        start += int(padded[e])


# -- the fused forward -------------------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 7, 123])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_shapes_fp32(T, K, stacked):
    check(T, K, 4, 40, 24, stacked=stacked)


@pytest.mark.parametrize("T", [1, 7, 123])
def test_shapes_fp16(T):
    check(T, 2, 4, 40, 24, dtype=torch.float16)
    check(T, 1, 4, 40, 24, dtype=torch.float16, stacked=False)


@pytest.mark.parametrize("mode", ["one_expert", "sparse", "invalid"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_routing_odd_cases(mode, stacked):
    check(7, 2, 6, 40, 24, mode=mode, stacked=stacked)


def test_fewer_tokens_than_experts():
    check(3, 2, 16, 40, 24)
    check(1, 1, 16, 40, 24, stacked=False)


@pytest.mark.parametrize("gate_up", ["concat", "interleaved", "separate", "none"])
@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_layouts(gate_up, transposed):
    attrs = FFNAttrs(gate_up=gate_up, transposed=transposed)
    check(7, 2, 4, 40, 40, gate_up=gate_up, transposed=transposed, stacked=gate_up != "separate", attrs=attrs)


@pytest.mark.parametrize("gate_up", ["concat", "separate"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_biases(gate_up, stacked):
    check(7, 2, 4, 40, 24, gate_up=gate_up, stacked=stacked, bias=True, attrs=FFNAttrs(gate_up=gate_up))


def test_single_expert_stacked_biases():
    check(7, 1, 1, 40, 24, bias=True)


@pytest.mark.parametrize(
    "attrs",
    [
        FFNAttrs(activation="gelu"),
        FFNAttrs(activation="gelu_tanh"),
        FFNAttrs(activation="relu", weight_on="between"),
        FFNAttrs(activation="silu", limit=0.5, weight_on="between"),
        FFNAttrs(gate_up="interleaved", activation="gptoss", limit=0.7, alpha=1.702),
        FFNAttrs(weight_on="input"),
        FFNAttrs(gate_up="none", activation="gelu", weight_on="input"),
    ],
    ids=lambda a: f"{a.gate_up}-{a.activation}-{a.limit}-{a.weight_on}",
)
def test_activations_and_weight_placement(attrs):
    check(7, 2, 4, 40, 24, gate_up=attrs.gate_up, bias=attrs.activation == "gptoss", attrs=attrs)


def test_other_tiles_and_strided_weights():
    """Several M/N/K tiles per GEMM with GROUP_M swizzling, and weights that are strided views."""
    cfg = TileConfig(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
    check(123, 2, 5, 40, 40, config=cfg)
    gen = torch.Generator().manual_seed(1)
    E, H, F, T, K = 3, 24, 20, 9, 2
    fc1 = torch.randn(E, H, 2 * F, generator=gen).transpose(1, 2)  # [E, 2F, H] view, not contiguous
    fc2 = torch.randn(E, F, H, generator=gen).transpose(1, 2)  # [E, H, F] view
    w = ExpertWeights((fc1,), (), (fc2,))
    x = torch.randn(T, H, generator=gen)
    ids, weights = make_routing(T, K, E, "random", gen)
    y = fused_moe_triton(x, ids, weights, w, FFNAttrs(), config=cfg)
    ref = fused_moe_reference(x, ids, weights, w, FFNAttrs())
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_dispatch_falls_back_on_unsupported_inputs():
    """fp64 is not a Triton dtype here: the dispatcher must give the reference's answer."""
    gen = torch.Generator().manual_seed(2)
    w = make_weights(3, 16, 8, dtype=torch.float64, gen=gen)
    x = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    ids, weights = make_routing(5, 2, 3, "random", gen)
    kernel = triton_dispatch.forward_kernel()
    assert kernel is not None
    with pytest.warns(RuntimeWarning, match="not used"):
        y = kernel(x, ids, weights, w, FFNAttrs())
    torch.testing.assert_close(y, fused_moe_reference(x, ids, weights, w, FFNAttrs()))
