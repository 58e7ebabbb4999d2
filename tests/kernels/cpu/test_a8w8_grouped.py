"""Group-wise a8w8-int on CPU: qdecode's FMT_A8W8G loops (decode), qgemm's w8-int float panels on
block-quantized activations (prefill), the fused op and a dense linear, each against
``quant/a8w8_int.py``'s reference (``grouped_matmul`` / ``reference_moe``).

Why a tolerance and not bit equality: the int32 block sums are exact on both sides, but the loops
scale each block's 8 int32 lanes separately ((lane * s_x) * s_w) and sum them in their own order,
the reference each block's total — a few fp32 roundings per block (the bound below).  Whole MoE
steps add FC2's re-quantization of the SwiGLU output: a value within an ulp of a rounding boundary
may move its code by 1 (as tests/kernels/cpu/test_qdecode.py's _check says for the a8 formats).
"""

from __future__ import annotations

import pytest
import torch

from moe_compile import quant
from moe_compile.ir import FFNAttrs
from moe_compile.kernels.cpu import dense, qdecode, qgemm
from moe_compile.quant import a8w4_int, a8w8_int, reference_moe
from moe_compile.quant.common import quantize_per_block_int8

pytestmark = pytest.mark.skipif(qdecode.unavailable_reason("a8w8-int") is not None,
                                reason=f"no qdecode kernel: {qdecode.unavailable_reason('a8w8-int')}")
ISAS = [qdecode.ISA_AVX2] + ([qdecode.ISA_AVX512] if qdecode.unavailable_reason("a8w8-int") is None
                             and qdecode.best_isa() == qdecode.ISA_AVX512 else [])
# K = 1024 / 2048 take the VNNI loop where the CPU has it (K % 64 == 0); 416 = 6 x 64 + 32 runs the
# AVX2 loop there (the last block would not fill a 64-element step).
SHAPES = [(1024, 32), (1024, 64), (1024, 128), (2048, 32), (2048, 256), (416, 32)]


def _terms_bound(x, w, e):
    """2^-21 (B + 8) times the sum of |acc_b s_x s_w| over a row's blocks: the fp32 rounding of the
    lanes' scaling and of the sums in another order (B blocks, 8 lanes each)."""
    qx, sx = quantize_per_block_int8(x)
    terms = a8w4_int.block_sums(qx, w.data[e]) * sx[:, None, :] * a8w4_int.block_scales(w, e)[None]
    return 2.0**-21 * (x.shape[1] // 32 + 8) * terms.abs().sum(-1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K,group", SHAPES)
def test_decode_loops_match_the_reference(isa, K, group):
    gen = torch.Generator().manual_seed(K + group)
    w = quant.pack("a8w8-int", torch.randn(2, 10, K, generator=gen), group)
    w.data[1, 0] = 127  # a row at each end of the range: the sign trick's pairs at 2 * 127^2
    w.data[1, 1] = -127
    for T in (1, 4):
        x = torch.randn(T, K, generator=gen) * torch.rand(T, 1, generator=gen) * 10
        x[0, :32] = torch.where(torch.arange(32) % 2 == 0, 1.0, -1.0)  # a block of q = +-127
        got = qdecode.grouped_matmul(x, w, 1, isa)
        want = a8w8_int.grouped_matmul(x, w, 1)
        bound = _terms_bound(x, w, 1)
        assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())


@pytest.mark.parametrize("isa", ISAS)
def test_decode_loops_are_exact_on_exact_scales(isa):
    # Power-of-two scales (s_x = 2^-3, s_w = +-2^j) and small sums: every product and sum is exact in
    # fp32 on both sides, so any difference is a wrong integer sum, lane, block or scale.
    gen = torch.Generator().manual_seed(3)
    K, T = 1024, 4
    qx = torch.randint(-127, 128, (T, K), generator=gen)
    qx[:, ::32] = 127
    w = quant.pack("a8w8-int", torch.randn(1, 6, K, generator=gen), 32)
    w.scale.copy_(2.0 ** torch.randint(-4, 3, w.scale.shape, generator=gen))
    w.data.copy_(torch.randint(-127, 128, w.data.shape, generator=gen, dtype=torch.int8))
    x = qx.float() / 8
    assert torch.equal(qdecode.grouped_matmul(x, w, 0, isa), a8w8_int.grouped_matmul(x, w, 0))


def _layer(H, F, E, group, seed):
    gen = torch.Generator().manual_seed(seed)
    w1 = quant.pack("a8w8-int", torch.randn(E, 2 * F, H, generator=gen) / H**0.5, group)
    w2 = quant.pack("a8w8-int", torch.randn(E, H, F, generator=gen) / F**0.5, group)
    return gen, w1, w2


def _routing(gen, T, E, K):
    return torch.rand(T, E, generator=gen).argsort(1)[:, :K].contiguous(), torch.rand(T, K, generator=gen)


def _assert_moe_close(got, want, share):
    """Exact sums, fp32 scaling: 1e-5 of the output's scale but where FC2's re-quantization moved a
    code (at most ``share`` of the elements, each by about one FC2 step: 1e-3)."""
    scale = want.abs().max().item()
    off = (got - want).abs() > 1e-5 * scale
    assert off.float().mean() <= share, f"{int(off.sum())} of {off.numel()} elements off by more than 1e-5"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * scale)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [32, 128])
def test_decode_steps_match_the_reference(isa, group):
    for T, H, F in ((1, 1024, 256), (4, 2048, 128)):
        gen, w1, w2 = _layer(H, F, 4, group, seed=T + group)
        ids, g = _routing(gen, T, 4, 2)
        x = torch.randn(T, H, generator=gen)
        _assert_moe_close(qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa=isa),
                          reference_moe(x, ids, g, w1, w2, FFNAttrs()), 2e-2)


@pytest.mark.parametrize("isa", ISAS)
def test_prefill_matches_the_reference(isa):
    # w8-int's float panels on block-quantized x (FC2's input quantized per block in the kernel):
    # (q_x s_x)(q_w s_w) summed in fp32 instead of the block sums, ~1e-7 relative before FC2's
    # re-quantization (which moves a code more often than the exact integer tiles: 1%).
    gen, w1, w2 = _layer(1024, 256, 4, 32, seed=9)
    ids, g = _routing(gen, 64, 4, 2)
    x = torch.randn(64, 1024, generator=gen)
    assert qgemm.pack(w1).code == qgemm.FORMAT_CODES["w8-int"]
    _assert_moe_close(qgemm.run(x, ids, g, w1, w2, FFNAttrs(), {}, isa=isa, threads=2, bf16=False),
                      reference_moe(x, ids, g, w1, w2, FFNAttrs()), 1e-2)


def test_the_fused_op_runs_the_grouped_form_when_asked(monkeypatch):
    import moe_compile.ops  # noqa: F401  (registers the ops)
    from moe_compile.kernels.cpu import decode_op, quant as cpu_quant

    monkeypatch.setenv(a8w8_int.GROUP_ENV, "grouped")
    monkeypatch.setenv("MOE_COMPILE_PREFILL_BF16", "0")  # the fp32 tiles: the reference's rounding
    cpu_quant.clear()
    gen = torch.Generator().manual_seed(5)
    E, H, F = 4, 1024, 256
    W1, W2 = torch.randn(E, 2 * F, H, generator=gen) * 0.03, torch.randn(E, H, F, generator=gen) * 0.06
    for T in (3, 64):  # decode (qdecode) and prefill (qgemm)
        x = torch.randn(T, H, generator=gen)
        ids, g = _routing(gen, T, E, 2)
        args = (x, ids, g, [W1], [], [W2], [], [], [], "concat", False, "silu", 0.0, 1.702, "output", "a8w8-int",
                20.0, f"a8w8-grouped-{T}")
        with torch.no_grad():
            got = torch.ops.moe_compile.fused_moe_quant(*args)
            before = decode_op.fast_calls()
            again = torch.ops.moe_compile.fused_moe_quant(*args)  # decode: from decode_op.cpp once registered
        assert torch.equal(again, got)
        assert decode_op.fast_calls() - before == int(T == 3 and decode_op.unavailable_reason() is None)
        p = cpu_quant.layer_pack(cpu_quant.ExpertWeights((W1,), (), (W2,)), FFNAttrs(), "a8w8-int")
        assert p.w1.grouped_activations and p.w1.group == a8w8_int.GROUP
        _assert_moe_close(got, reference_moe(x, ids, g, quant.pack("a8w8-int", W1), quant.pack("a8w8-int", W2),
                                             FFNAttrs()), 2e-2)
    cpu_quant.clear()


def test_a_dense_linear_reads_the_grouped_form():
    import moe_compile.ops  # noqa: F401

    gen = torch.Generator().manual_seed(6)
    W = torch.randn(256, 2048, generator=gen) / 45
    qw = quant.pack("a8w8-int", W[None], 32)
    for T in (1, 4):  # the decode loops (moe_qdecode_linear); group 32 through the op's group argument
        x = torch.randn(T, 2048, generator=gen)
        got = torch.ops.moe_compile.dense_linear(x, W, None, "a8w8-int", 32)
        want = a8w8_int.grouped_matmul(x, qw, 0)
        assert bool(((got - want).abs() <= _terms_bound(x, qw, 0)).all())
    assert dense.packed(W, "a8w8-int", 32).qweight.grouped_activations
    dense.clear()
