"""The quantized decode kernel (kernels/cpu/qdecode.c) against each format's reference MoE.

The reference: ``moe_compile.quant.reference_moe`` (the packed weight dequantized, q * scale exact
in fp32, then the MoE in fp32).  The kernel dequantizes exactly too and sums in fp32 in its own
order, so the only differences are fp32 rounding of the sums (K <= 256 terms of unit scale, on
both sides) and the kernels' e^x in the SwiGLU (simd.h, ~2e-7 relative): 1e-5 of the output's
scale per element.  A wrong nibble, scale, lane order or slot fails it by orders of magnitude.

On AVX2 the 4- and 8-bit integer formats (on AVX-512 w8-int, and w4-int where the CPU has VNNI
and the row is whole 128-element chunks) take an expert's single row (T = 1's steps) as int16
blocks of 32 (qdecode.c: quantize_i16): each activation within 2^-16 of its
block's largest, which across FC1, the SwiGLU and FC2 measures up to 5.3e-5 of the output's scale
here (small H and F, Gaussian data): those cases are held to 1.5e-4 of it, still 1000x below
what a wrong nibble costs.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from moe_compile import devices, quant
from moe_compile.ir import FFNAttrs
from moe_compile.kernels.cpu import qdecode
from moe_compile.quant import QuantWeight, a8w4_int, reference_moe, w16 as quant_w16
from moe_compile.quant.common import pack_nibbles

needs_kernel = pytest.mark.skipif(qdecode.unavailable_reason("w4-int") is not None,
                                  reason=f"no qdecode kernel: {qdecode.unavailable_reason('w4-int')}")
ISAS = [qdecode.ISA_AVX2] + ([qdecode.ISA_AVX512] if qdecode.unavailable_reason("w4-int") is None
                             and qdecode.best_isa() == qdecode.ISA_AVX512 else [])
# AVX-512 w4-int takes int16 rows (w4_dot16_vnni) only with VNNI's vpdpwssd
VNNI = qdecode.ISA_AVX512 in ISAS and {"avx512f", "avx512bw", "avx512_vnni"} <= devices.cpu_flags()


def pack(fmt: str, w: torch.Tensor, group: int = 32, gen: torch.Generator | None = None,
         random_codes: bool = False) -> QuantWeight:
    """W [E, N, K] in ``fmt`` (``w16-bf16`` / ``w16-fp16`` name w16's two dtypes) by the format's own
    pack; ``random_codes``: MX data drawn uniformly over every code but NaN instead (scales kept)."""
    if fmt.startswith("w16"):
        return quant_w16.pack(w, torch.bfloat16 if fmt == "w16-bf16" else torch.float16)
    if fmt == "a8w4-int-pc":  # a8w4-int's per-channel (MSD) form
        return a8w4_int.pack(w, group_size=None)
    qw = quant.pack(fmt, w, group if fmt in ("w8-int", "w4-int", "a8w4-int") else None)
    if not random_codes:
        return qw
    E, N, K = qw.shape
    if fmt == "mxfp4":
        data = pack_nibbles(torch.randint(0, 16, (E, N, K), generator=gen))
        return QuantWeight(fmt, data, qw.scale, qw.group, qw.shape)
    codes = torch.randint(0, 254, (E, N, K), generator=gen)
    codes = torch.where(codes >= 127, codes + 1, codes).to(torch.uint8)  # skip 0x7F (NaN); 0xFF never drawn
    return QuantWeight(fmt, codes, qw.scale, qw.group, qw.shape)


def _case(fmt, T, H, F, E, K, seed=0, ids_mode="random", group=32, random_codes=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w1 = pack(fmt, torch.randn(E, 2 * F, H, generator=gen) / H**0.5, group, gen, random_codes)
    w2 = pack(fmt, torch.randn(E, H, F, generator=gen) / F**0.5, group, gen, random_codes)
    if ids_mode == "random":
        ids = torch.randint(0, E, (T, K), generator=gen)
    else:  # dropped slots: ids -1 and E (outside [0, E)) mixed in
        ids = torch.randint(-1, E + 1, (T, K), generator=gen)
    g = torch.rand(T, K, generator=gen)
    return x, ids, g, w1, w2


FORMATS = ["w16-bf16", "w16-fp16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int", "a8w4-int-pc"]


def tolerance(fmt: str, isa: int) -> float:
    """Allowed error, relative to the output's scale (the module docstring says why)."""
    if fmt.startswith("a8"):
        return 1e-3  # see _check
    int16_rows = (fmt == "w8-int" or (isa == qdecode.ISA_AVX2 and fmt in ("w4-int", "mxfp4"))
                  or (fmt == "w4-int" and VNNI))
    return 1.5e-4 if int16_rows else 1e-5


def _check(x, ids, g, w1, w2, attrs, isa):
    got = qdecode.run(x, ids, g, w1, w2, attrs, None, isa=isa)
    want = reference_moe(x, ids, g, w1, w2, attrs)
    scale = max(want.abs().max().item(), 1e-30)
    if w1.fmt.startswith("a8"):
        # The a8 formats' int32 sums are exact and scale in the reference's order; only where a
        # SwiGLU value sits within an ulp of a rounding boundary of FC2's per-row re-quantization
        # (the kernel's e^x is not torch's) can its code move by 1, moving that slot's output by one
        # step of one FC2 product (as test_qgemm.assert_matches).
        off = (got - want).abs() > 1e-5 * scale
        assert off.float().mean() <= 2e-2, f"{int(off.sum())} of {off.numel()} elements off by more than 1e-5"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=tolerance(w1.fmt, isa) * scale)
    return got, want


# Odd E and K, T in {1, 3, 8, 16}: with 7 experts and T = 1 most experts are empty; T = 16 passes
# 16 rows through one expert for the MX formats' seed (two passes of the 8- or 4-row kernels).
@needs_kernel
@pytest.mark.parametrize("fmt,T,isa", list(itertools.product(FORMATS, [1, 3, 8, 16], ISAS)))
def test_matches_reference(fmt, T, isa):
    x, ids, g, w1, w2 = _case(fmt, T, H=96, F=64, E=7, K=3, seed=T)
    _check(x, ids, g, w1, w2, FFNAttrs(), isa)


# Every e2m1 / e4m3 code (NaN aside: test_nan_codes_propagate), subnormals and -0 included.
@needs_kernel
@pytest.mark.parametrize("fmt,isa", list(itertools.product(["mxfp4", "mxfp8"], ISAS)))
def test_every_mx_code(fmt, isa):
    x, ids, g, w1, w2 = _case(fmt, 8, H=256, F=64, E=2, K=2, seed=7, random_codes=True)
    assert len(torch.unique(w1.data)) == (256 if fmt == "mxfp4" else 254)
    _check(x, ids, g, w1, w2, FFNAttrs(), isa)


# The clamped SwiGLU (limit) and the routing weight between activation and FC2, dropped ids, one
# token routed to one expert twice, and group 64.
@needs_kernel
@pytest.mark.parametrize("fmt,isa", list(itertools.product(FORMATS, ISAS)))
@pytest.mark.parametrize("limit,weight_on", [(0.7, "output"), (0.0, "between")])
def test_limit_weight_on_and_dropped_ids(fmt, isa, limit, weight_on):
    group = 64 if fmt in ("w8-int", "w4-int") else 32
    x, ids, g, w1, w2 = _case(fmt, 5, H=128, F=64, E=5, K=3, seed=1, ids_mode="dropped", group=group)
    ids[0] = torch.tensor([-1, 5, 2])  # two dropped slots beside a kept one
    ids[1] = torch.tensor([4, 4, 0])   # one token, one expert, twice: both slots add
    got, want = _check(x, ids, g, w1, w2, FFNAttrs(limit=limit, weight_on=weight_on), isa)
    if limit:
        h = quant.matmul(x, w1, 2)  # the clamp must bite for the test to mean anything
        assert h.abs().max() > limit


# Group sizes: 32 (one flat loop), 64 / 128 / 256 (a loop per group); on AVX-512 the 4-bit loops
# read 128-element blocks with one scale per lane, the last K mod 128 elements 32 at a time.
@needs_kernel
@pytest.mark.parametrize("fmt,isa", list(itertools.product(["w8-int", "w4-int"], ISAS)))
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_group_sizes(fmt, isa, group):
    x, ids, g, w1, w2 = _case(fmt, 2, H=512, F=256, E=3, K=2, seed=group, group=group)
    _check(x, ids, g, w1, w2, FFNAttrs(), isa)
    x, ids, g, w1, w2 = _case(fmt, 2, H=416, F=160, E=3, K=2, seed=group, group=32)  # 416 = 3 * 128 + 32
    _check(x, ids, g, w1, w2, FFNAttrs(), isa)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_all_slots_dropped_and_w16_tails(isa):
    # H and F not multiples of the 32-element blocks (w16 only: its group is the whole row).
    x, ids, g, w1, w2 = _case("w16-bf16", 4, H=40, F=21, E=3, K=2, seed=3)
    _check(x, ids, g, w1, w2, FFNAttrs(), isa)
    got = qdecode.run(x, torch.full_like(ids, 3), g, w1, w2, FFNAttrs(), None, isa=isa)
    assert torch.equal(got, torch.zeros_like(x))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts(threads):
    # The feature / column split with one thread and with more threads than the rows divide into.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, ids, g, w1, w2 = _case("w4-int", 3, H=64, F=96, E=4, K=2, seed=4)
        _check(x, ids, g, w1, w2, FFNAttrs(), qdecode.best_isa())
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_nan_codes_propagate(isa):
    # e4m3 0x7F is NaN: the rows it feeds are NaN, as in the reference.  e8m0 255 is NaN too (OCP
    # MX v1.0; quant packs never write it): the column it scales is NaN, nothing else.
    x, ids, g, w1, w2 = _case("mxfp8", 2, H=64, F=32, E=2, K=1, seed=5)
    ids = torch.tensor([[0], [1]])
    w1.data[0, 0, 3] = 0x7F  # expert 0, gate feature 0: all of token 0's output
    got = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa=isa)
    want = reference_moe(x, ids, g, w1, w2, FFNAttrs())
    assert torch.isnan(got[0]).all() and not torch.isnan(got[1]).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want[1].abs().max().item(), equal_nan=True)
    w2.scale[1, 5, 0] = 255  # expert 1, output column 5
    got = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa=isa)
    assert torch.isnan(got[1, 5]) and not torch.isnan(got[1, :5]).any() and not torch.isnan(got[1, 6:]).any()


@needs_kernel
@pytest.mark.parametrize("fmt", ["w4-int", "mxfp4", "w8-int"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H,F", [(64, 32), (256, 128)])
def test_non_finite_activations_propagate_and_zero_rows_stay_zero(fmt, isa, H, F):
    # The 4- and 8-bit loops hold a single row's activations as int16 blocks (256 x 128: AVX-512
    # w4-int's chunks of 128 too): a NaN or inf in x must still make that token's output non-finite
    # (as in the reference), and an all-zero x row (its block scale would be 0 / 32767) must give
    # exactly zero, not NaN.
    x, _, g, w1, w2 = _case(fmt, 3, H=H, F=F, E=2, K=1, seed=6)
    ids = torch.tensor([[0], [1], [0]])
    x[0, 5], x[1, H - 24], x[2] = float("nan"), float("inf"), 0.0
    got = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa=isa)
    want = reference_moe(x, ids, g, w1, w2, FFNAttrs())
    assert not torch.isfinite(want[0]).any() and not torch.isfinite(got[0]).any()
    assert torch.isfinite(got[1]).sum() == torch.isfinite(want[1]).sum() == 0
    assert torch.equal(got[2], torch.zeros_like(got[2])) and torch.equal(want[2], torch.zeros_like(want[2]))


def test_check_call_reads_shapes_only():
    # The dispatcher asks before packing: roles given as (fmt, shape, group) only, no tensors.
    Role = dataclasses.make_dataclass("Role", ["fmt", "shape", "group"])
    x = torch.empty(0, 64)
    assert qdecode.check_call(x, Role("w4-int", (4, 64, 64), 32), Role("w4-int", (4, 64, 32), 32), FFNAttrs()) is None
    with pytest.raises(ValueError, match="multiple of 32"):
        qdecode.check_call(x, Role("w8-int", (4, 64, 64), 16), Role("w8-int", (4, 64, 32), 32), FFNAttrs())
    with pytest.raises(ValueError, match="at most 16"):
        qdecode.check_call(torch.empty(17, 64), Role("w16", (4, 64, 64), 64), Role("w16", (4, 64, 32), 32), FFNAttrs())


def test_unavailable_formats_say_why():
    assert "no CPU kernel" in qdecode.unavailable_reason("a8w8-fp8")
    assert "unknown format" in qdecode.unavailable_reason("w3")


@needs_kernel
def test_bad_input_has_clear_error():
    x, ids, g, w1, w2 = _case("w4-int", 2, H=64, F=32, E=2, K=2)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        qdecode.run(torch.randn(17, 64), ids, g, w1, w2, FFNAttrs())
    with pytest.raises(ValueError, match="int64"):
        qdecode.run(x, ids.int(), g, w1, w2, FFNAttrs())
    with pytest.raises(ValueError, match="weight_on"):
        qdecode.run(x, ids, g, w1, w2, FFNAttrs(weight_on="input"))
    bad = dataclasses.replace(w1, group=16, scale=torch.zeros(2, 64, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 32"):
        qdecode.run(x, ids, g, bad, w2, FFNAttrs())
    fp8 = quant.pack("a8w8-fp8", torch.randn(2, 64, 64))
    with pytest.raises(ValueError, match="no CPU kernel"):
        qdecode.run(x, ids, g, fp8, w2, FFNAttrs())


@needs_kernel
@pytest.mark.parametrize("isa", [qdecode.ISA_AVX2] + ([qdecode.ISA_AVX512] if VNNI else []))
def test_int16_switch_keeps_fp32_activations(isa):
    # MOE_COMPILE_QDECODE_I16=0 runs the 4-bit loops on fp32 activations: back to the reference's
    # 1e-5; with the default, the int16 blocks show as a larger (still tiny) error.
    from tests.conftest import run_python

    code = ("import torch; from tests.kernels.cpu.test_qdecode import _case; from moe_compile.kernels.cpu import qdecode;"
            "from moe_compile.quant import reference_moe; from moe_compile.ir import FFNAttrs;"
            "x, ids, g, w1, w2 = _case('w4-int', 1, H=256, F=128, E=4, K=2, seed=9);"
            f"got = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa={isa});"
            "want = reference_moe(x, ids, g, w1, w2, FFNAttrs());"
            "print(float((got - want).abs().max() / want.abs().max()))")
    exact = float(run_python(code, MOE_COMPILE_QDECODE_I16="0").stdout.split()[-1])
    blocks = float(run_python(code).stdout.split()[-1])
    assert exact <= 1e-5 < blocks <= tolerance("w4-int", isa), (exact, blocks)


# AVX-512 VNNI w4-int on int16 rows (w4_dot16_vnni): T = 1 sends every expert a single row, so FC1
# and FC2 both run it, at the group sizes its lanes take (32 and 64 per lane, 128 and 256 per chunk)
# and a real model's widths.  MOE_COMPILE_QDECODE_I16=0 (read per call) gives the fp32 loop on the
# same weights: exact to the reference's rounding, and not equal to the int16 loop's output (so
# the int16 loop is what ran).
@needs_kernel
@pytest.mark.skipif(not VNNI, reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("H,F,group", [(256, 128, 32), (2048, 768, 32), (512, 256, 64), (512, 256, 128),
                                       (512, 256, 256)])
def test_w4_int16_vnni_loop_matches_reference(H, F, group, monkeypatch):
    x, ids, g, w1, w2 = _case("w4-int", 1, H=H, F=F, E=6, K=4, seed=H + group, group=group)
    got, want = _check(x, ids, g, w1, w2, FFNAttrs(), qdecode.ISA_AVX512)
    monkeypatch.setenv("MOE_COMPILE_QDECODE_I16", "0")
    fp32_loop = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa=qdecode.ISA_AVX512)
    torch.testing.assert_close(fp32_loop, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.equal(got, fp32_loop)


@needs_kernel
@pytest.mark.skipif(not VNNI, reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("code", [0, 15])
def test_w4_int16_lane_sums_at_their_bounds(code):
    # Every code at 0 (q_w = -8) or 15 (q_w = 7) and every activation at +-32767: each int32 lane
    # reaches its largest |8 products + offset| (2.1e6 for code 0); an overflow, a lost offset or
    # a wrong lane's scale shows as a wrong sign or size.  Token 1 alternates signs, so its
    # offsets cancel to 0 within a lane (its 8 elements).
    x, ids, g, w1, w2 = _case("w4-int", 2, H=1024, F=256, E=2, K=1, seed=3)
    ids = torch.tensor([[0], [1]])
    x[0], x[1] = 1.0, torch.where(torch.arange(1024) % 2 == 0, 1.0, -1.0)
    for w in (w1, w2):
        w.data.fill_(code | code << 4)
    _check(x, ids, g, w1, w2, FFNAttrs(), qdecode.ISA_AVX512)


@needs_kernel
@pytest.mark.parametrize("fmt", ["a8w4-int", "a8w4-int-pc", "a8w8-int"])
@pytest.mark.parametrize("isa", ISAS)
def test_a8_sums_at_their_bounds_are_exact(fmt, isa):
    # Every weight at the format's largest magnitude and every activation quantized to +-127: the
    # int16 partial sums of vpmaddubsw reach their bound (8 x 2 x 15 x 127 for a8w4), over K = 1024
    # (two 512-element windows): an overflow anywhere shows as a wrong sign or size.
    x, ids, g, w1, w2 = _case(fmt, 2, H=1024, F=64, E=2, K=1, seed=7)
    ids = torch.tensor([[0], [1]])
    x[0], x[1] = 1.0, torch.where(torch.arange(1024) % 2 == 0, 1.0, -1.0)
    for w in (w1, w2):
        w.data.fill_(0xFF if fmt.startswith("a8w4") else 127)  # a8w4: u = 15 (q = 7); a8w8: q = 127
    _check(x, ids, g, w1, w2, FFNAttrs(), isa)


@needs_kernel
@pytest.mark.skipif(qdecode.ISA_AVX512 not in ISAS, reason="no AVX-512 on this CPU")
@pytest.mark.parametrize("H,F", [(96, 64), (160, 96), (2048, 768)])
def test_per_channel_a8w8_vnni_loop_equals_the_avx2_loop(H, F):
    # Per-channel a8w8's int32 sums are exact in both loops (AVX-512 VNNI: vpdpbusd on q_w + 128,
    # less 128 sum(q_x), masked loads for a last piece under 64; AVX2: the sign trick), and both
    # scale them in the same order: the outputs must be equal bit for bit.  H = 96 / 160 leave a
    # piece of 32 after whole steps of 128 (FC1) and F = 96 one of 32 after 64 (FC2).
    x, ids, g, w1, w2 = _case("a8w8-int", 4, H=H, F=F, E=5, K=2, seed=H)
    got = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa=qdecode.ISA_AVX512)
    want = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa=qdecode.ISA_AVX2)
    assert torch.equal(got, want), (got - want).abs().max()


# ---- group-wise a8w4-int: the loops alone (qdecode.grouped_matmul), then whole steps ----
# K = 416 = 3 x 128 + 32: the AVX-512 VNNI loop needs K % 128 == 0, so it runs the AVX2 loop with
# its 32-element tail; 512 / 1024 / 384 take the VNNI loop where the CPU has it.
A8G_SHAPES = [(512, 32), (1024, 32), (416, 32), (512, 64), (384, 128), (512, 256)]


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K,group", A8G_SHAPES)
def test_grouped_a8w4_loops_are_exact_on_exact_scales(isa, K, group):
    # Power-of-two scales: x's blocks have max 127 * 2^-3 (so s_x = 2^-3 exactly, q = 8 x) and the
    # weight scales are +-2^j: every product and sum the kernel forms is exact in fp32, so any
    # difference from the reference is a wrong integer sum, lane, block or scale.
    gen = torch.Generator().manual_seed(K + group)
    T, N = 5, 6
    qx = torch.randint(-127, 128, (T, K), generator=gen)
    qx[:, ::32] = 127  # each block's max |q| is 127
    qx[1, :64] = -127  # both signs at the extremes
    x = qx.float() / 8
    w = quant.pack("a8w4-int", torch.randn(2, N, K, generator=gen), group)
    w.scale.copy_(2.0 ** torch.randint(-4, 3, w.scale.shape, generator=gen) * torch.where(
        torch.rand(w.scale.shape, generator=gen) < 0.5, -1.0, 1.0))
    w.data[1, 0] = 0xFF  # a row of q = 7 and a row of q = -8: the int16 pair sums at their bounds
    w.data[1, 1] = 0x00
    want = a8w4_int.grouped_matmul(x, w, 1)
    got = qdecode.grouped_matmul(x, w, 1, isa)
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K,group", A8G_SHAPES)
def test_grouped_a8w4_loops_differ_by_fp32_scaling_alone(isa, K, group):
    # Any scales: the int32 block sums are exact on both sides; the kernel scales each block's 4
    # int32 partials (acc_i * s_x) * s_w and sums all lanes in its own order, the reference the
    # block's total, so they differ by the rounding of ~2 B + 4 fp32 operations on terms no larger
    # than |acc_b s_x s_w|: bounded by 2^-21 (B + 4) times the sum of those magnitudes.
    gen = torch.Generator().manual_seed(K * group)
    T, N = 7, 10
    x = torch.randn(T, K, generator=gen) * torch.rand(T, 1, generator=gen) * 10
    w = quant.pack("a8w4-int", torch.randn(3, N, K, generator=gen), group)
    got = qdecode.grouped_matmul(x, w, 2, isa)
    want = a8w4_int.grouped_matmul(x, w, 2)
    qx, sx = quant.common.quantize_per_block_int8(x)
    terms = (a8w4_int.block_sums(qx, a8w4_int.integers(w)[2]) * sx[:, None, :] * a8w4_int.block_scales(w, 2)[None])
    bound = 2.0**-21 * (K // 32 + 4) * terms.abs().sum(-1)
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_grouped_a8w4_steps(isa, group):
    # Whole decode steps at each group, T = 1 and 4, and a K with the AVX2 loop's 32-element tail.
    for T, H, F in ((1, 512, 256),) + (((4, 512, 256), (2, 416, 160)) if group == 32 else ()):
        x, ids, g, w1, w2 = _case("a8w4-int", T, H=H, F=F, E=3, K=2, seed=group + T, group=group)
        _check(x, ids, g, w1, w2, FFNAttrs(), isa)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_grouped_a8w4_non_finite_activations_propagate(isa):
    # A NaN or inf makes its block's scale non-finite: that token's output is non-finite, as in the
    # reference; an all-zero row gives exactly zero.
    x, _, g, w1, w2 = _case("a8w4-int", 3, H=128, F=64, E=2, K=1, seed=6)
    ids = torch.tensor([[0], [1], [0]])
    x[0, 5], x[1, 40], x[2] = float("nan"), float("inf"), 0.0
    got = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa=isa)
    want = reference_moe(x, ids, g, w1, w2, FFNAttrs())
    assert not torch.isfinite(want[0:2]).any() and not torch.isfinite(got[0:2]).any()
    assert torch.equal(got[2], torch.zeros_like(got[2])) and torch.equal(want[2], torch.zeros_like(want[2]))


def test_grouped_a8w4_groups_the_loops_do_not_tile_are_refused():
    Role = dataclasses.make_dataclass("Role", ["fmt", "shape", "group"])
    x = torch.empty(0, 384)
    with pytest.raises(ValueError, match="32, 64 or a multiple of 128"):
        qdecode.check_call(x, Role("a8w4-int", (2, 192, 384), 96), Role("a8w4-int", (2, 384, 96), 96), FFNAttrs())


# ---- a slot alone in its expert reads the role's 16-row panels (rows16: AVX-512 VNNI or AVX2) ----

ROWS16 = qdecode.rows16_runs(quant.pack("w4-int", torch.randn(1, 16, 128)))
needs_rows16 = pytest.mark.skipif(not ROWS16, reason="the rows16 loops need AVX2 (and MOE_COMPILE_QDECODE_I16 not 0)")
ROWS16_ATTRS = [FFNAttrs(), FFNAttrs(weight_on="between", limit=1.5)]
ROWS16_FORMATS = ["w4-int", "a8w4-int", "w8-int"]


def _assert_close_a8(got, want, atol):
    """As _check for the a8 formats: within atol but where one FC2 input code moved by one step
    (a SwiGLU value an ulp from a rounding boundary of its re-quantization), at most 2% of the
    elements off by more than 1e-5 of the output's scale."""
    scale = want.abs().max().item()
    off = (got - want).abs() > 1e-5 * scale
    assert off.float().mean() <= 2e-2, f"{int(off.sum())} of {off.numel()} elements off by more than 1e-5"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol * scale)


# T = 1 puts every slot alone in its expert (K distinct ids); T = 4 and 16 with 5 experts mix lone
# slots (rows16) with experts of several (the row loops), in one call.
@needs_rows16
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("attrs", ROWS16_ATTRS, ids=["output", "between-clamped"])
def test_rows16_steps_match_the_reference_and_the_row_loops(fmt, group, T, attrs):
    x, ids, g, w1, w2 = _case(fmt, T, H=256, F=128, E=8 if T == 1 else 5, K=3, seed=T + group, group=group)
    if T == 1:
        ids = torch.randperm(8)[:3][None]
    cache = {}
    got = qdecode.run(x, ids, g, w1, w2, attrs, cache)
    assert len(cache) == 2  # both roles' panels, made on first use
    want = reference_moe(x, ids, g, w1, w2, attrs)
    rows = qdecode.run(x, ids, g, w1, w2, attrs, None)  # the row loops on the canonical pack alone
    if fmt in ("w4-int", "w8-int"):
        # the int16 activation blocks (tolerance()), and the same blocks as the row loops': the
        # two differ by the order of fp32 sums alone
        torch.testing.assert_close(got, want, rtol=1e-5, atol=tolerance(fmt, qdecode.best_isa()) * want.abs().max())
        # (chunks of 2-4 slots take int16 blocks too, where the row loops keep fp32 activations:
        # the blocks' error, not just the order of sums)
        rows_tol = tolerance(fmt, qdecode.best_isa()) if T > 1 else 1e-5
        torch.testing.assert_close(got, rows, rtol=1e-5, atol=rows_tol * want.abs().max())
    else:
        _assert_close_a8(got, want, tolerance(fmt, qdecode.best_isa()))
        _assert_close_a8(got, rows, tolerance(fmt, qdecode.best_isa()))


@needs_rows16
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
@pytest.mark.parametrize("role", ["fc1", "fc2"])
def test_rows16_reads_the_panels_for_chunks_of_up_to_four(fmt, role):
    """With one role's panels zeroed (every code u = 8, i.e. 0, in the panels alone), a T = 1 step,
    all of whose slots are alone, gives exactly 0, and so does a step whose two tokens share their
    experts (chunks of two); a step of five tokens on the same experts (chunks of five) runs the
    row loops on the canonical pack and gives the reference."""
    from moe_compile.kernels.cpu import qgemm

    x, _, g, w1, w2 = _case(fmt, 5, H=256, F=128, E=8, K=3, seed=11)
    ids = torch.tensor([[1, 4, 6], [6, 1, 4]] + [[4, 6, 1]] * 3)
    cache = {}
    qdecode.run(x[:1], ids[:1], g[:1], w1, w2, FFNAttrs(), cache)
    qgemm.packed(w1 if role == "fc1" else w2, cache).data.fill_(0 if fmt == "w8-int" else 0x88)
    for T in (1, 2):
        step = qdecode.run(x[:T], ids[:T], g[:T], w1, w2, FFNAttrs(), cache)
        assert torch.equal(step, torch.zeros_like(step)), f"T = {T}"
    five = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), cache)
    want = reference_moe(x, ids, g, w1, w2, FFNAttrs())
    if qdecode.best_isa() != qdecode.ISA_AVX512:  # the AVX2 chunk is 4 slots: 4 + 1, both on the panels
        assert torch.equal(five, torch.zeros_like(five))
        return
    assert five.abs().max() > 0.1 * want.abs().max()
    _assert_close_a8(five, want, tolerance(fmt, qdecode.best_isa()))


@needs_rows16
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
@pytest.mark.parametrize("T", [2, 3, 4])
def test_rows16_chunks_equal_their_slots_alone(fmt, T):
    """T tokens routed to the same experts (chunks of T slots, one panel pass for
    all of them) give each token exactly what it gets alone (a T = 1 step, every slot lone): the
    same integer sums and fp32 order per row, bit for bit; a row mixed up with another, or a
    wrong offset or scale for the chunk's later rows, would differ by far more than one ulp."""
    x, _, g, w1, w2 = _case(fmt, T, H=256, F=128, E=8, K=3, seed=40 + T)
    ids = torch.tensor([[2, 5, 7]] * T)
    g = torch.rand(T, 3)
    cache = {}
    together = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), cache)
    for t in range(T):
        alone = qdecode.run(x[t:t + 1].contiguous(), ids[t:t + 1].contiguous(), g[t:t + 1].contiguous(), w1, w2,
                            FFNAttrs(), cache)
        assert torch.equal(together[t:t + 1], alone), f"token {t}"


@needs_rows16
@pytest.mark.skipif(not VNNI, reason="the VNNI loops need AVX-512 VNNI")
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
@pytest.mark.parametrize("T", [1, 4])
def test_rows16_loops_give_the_same_bits_on_both_isas(fmt, T):
    """The AVX2 loops sum each row's blocks to the same integers as the VNNI ones (w8-int: int16
    products there, two byte products here) and scale them alike, so a step is the same bits on
    either ISA; an AVX2 loop that mixed up a row's lanes or a block's vectors would not be."""
    x, ids, g, w1, w2 = _case(fmt, T, H=256, F=128, E=8, K=3, seed=60 + T)
    if T == 1:
        ids = torch.randperm(8)[:3][None]
    cache = {}
    vnni = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), cache, isa=qdecode.ISA_AVX512)
    avx2 = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), cache, isa=qdecode.ISA_AVX2)
    assert torch.equal(vnni, avx2)
