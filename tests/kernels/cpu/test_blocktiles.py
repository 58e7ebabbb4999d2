"""The integer block tiles of group-wise a8w4-int (AVX-512 VNNI and AVX2) and a8w8-int (AVX-512 VNNI)
(blocktiles.h, qgemm.c's ACT_INT): the block quantizer bit for bit against quant/common.py, whole
MoE calls against quant.reference_moe at every group size, the same bits on both ISAs, any team
size and any chunking, non-finite rows kept to their own token, and the policy that picks them."""

import pytest
import torch

from moe_compile import quant
from moe_compile.ir import FFNAttrs
from moe_compile.kernels.cpu import qgemm
from moe_compile.quant import a8w4_int, a8w8_int
from moe_compile.quant.common import quantize_per_block_int8

pytestmark = pytest.mark.skipif(not qgemm.available(), reason=f"{qgemm.unavailable_reason('w4-int')}")

H, F = 96, 64  # H: 3 blocks of 32 (odd); F: 2 blocks, 4 FC1 panels, H / 32 = 3 FC2 units


def _vnni() -> bool:
    return qgemm.available() and qgemm.best_isa("a8w4-int") == qgemm.ISA_AVX512


def _isas(fmt="a8w4-int"):
    """The tiles a format's block tiles run on here: a8w4-int AVX2 and VNNI, a8w8-int VNNI only."""
    vnni = [qgemm.ISA_AVX512] if _vnni() else []
    return vnni if fmt == "a8w8-int" else [qgemm.ISA_AVX2] + vnni


CASES = [(f, i) for f in ("a8w4-int", "a8w8-int") for i in _isas(f)]
PACK = {"a8w4-int": a8w4_int.pack, "a8w8-int": a8w8_int.pack}


def make_case(T, E, K, group, seed=0, h=H, f=F, fmt="a8w4-int"):
    gen = torch.Generator().manual_seed(seed)
    w1 = PACK[fmt](torch.randn(E, 2 * f, h, generator=gen) * 0.05, group_size=group)
    w2 = PACK[fmt](torch.randn(E, h, f, generator=gen) * 0.05, group_size=group)
    x = torch.randn(T, h, generator=gen)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K].contiguous()
    g = torch.softmax(torch.randn(T, K, generator=gen), 1)
    return x, ids, g, w1, w2


def test_quantizer_matches_per_block_int8_bit_for_bit():
    # Ties at .5 (round half to even), a zero block (scale 1), a block whose largest value is
    # negative, and a NaN block (scale NaN, codes 0), beside random rows.
    x = torch.randn(5, 128) * 3
    x[0, :32] = torch.arange(32) * 0.5 - 8  # amax 8: s = 8/127, x / s hits exact halves
    x[1, 32:64] = 0
    x[2, 64:96] = -torch.rand(32) * 100
    x[3, 96:] = float("nan")
    q, s, off = qgemm.block_quantized_rows(x)
    q_ref, s_ref = quantize_per_block_int8(x)
    assert torch.equal(q, q_ref)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(off, -8 * q_ref.reshape(5, 4, 32).sum(-1, dtype=torch.int32))
    q8, s8, off8 = qgemm.block_quantized_rows(x, bits8=True)  # 8-bit weights' quads: in order, + 128
    assert torch.equal(q8, q_ref) and not off8.any()
    torch.testing.assert_close(s8, s_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt,isa", CASES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("T,weight_on", [(1, "output"), (7, "between"), (45, "output")])
def test_matches_reference(fmt, isa, group, T, weight_on):
    # Each block's int32 sum is exact and scaled as the reference scales it, (acc * s_x) * s_w; only
    # the fp32 sum over blocks runs in another order (~1e-7 of the output).  Where that moves a
    # SwiGLU value across a rounding boundary of FC2's per-block re-quantization one code moves by
    # 1, about one step of one FC2 product: rare, so 0.1% of the elements may be off by more than
    # 1e-5 of the scale and none by more than 1e-3 (a wrong nibble, lane, block scale or row costs
    # ~1e-1).  Groups of 64 / 128 share a weight scale over 2 / 4 activation blocks.
    h, f = (H, F) if group == 32 else (256, 256)
    x, ids, g, w1, w2 = make_case(T, 5, 3, group, seed=T, h=h, f=f, fmt=fmt)
    attrs = FFNAttrs(weight_on=weight_on, limit=0.7 if weight_on == "between" else 0.0)
    assert qgemm.block_tiles(qgemm.pack(w1), isa)
    y = qgemm.run(x, ids, g, w1, w2, attrs, {}, isa=isa, threads=2)
    ref = quant.reference_moe(x, ids, g, w1, w2, attrs)
    scale = float(ref.abs().max())
    off = (y - ref).abs() > 1e-5 * scale
    assert off.float().mean() <= 1e-3, f"{int(off.sum())} of {off.numel()} elements off by more than 1e-5"
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-3 * scale)


@pytest.mark.parametrize("fmt", [f for f in ("a8w4-int", "a8w8-int") if _isas(f)])
def test_same_bits_on_every_isa_team_and_chunking(fmt, monkeypatch):
    # The AVX2 tile (4 rows, 8 columns a pass, int16 partial sums) and the VNNI one (8 rows, 16
    # columns, int32) give the same exact block sums and scale them in the same order; a row's
    # result does not depend on which rows share its tile, which thread holds its columns, or how
    # an expert's rows are cut into chunks (CHUNK_ROWS 5: several chunks an expert).
    x, ids, g, w1, w2 = make_case(61, 4, 2, 32, seed=5, fmt=fmt)
    attrs = FFNAttrs()
    want = qgemm.run(x, ids, g, w1, w2, attrs, {}, isa=_isas(fmt)[0], threads=1)
    for isa in _isas(fmt):
        for threads in (1, 2, 3):
            assert torch.equal(qgemm.run(x, ids, g, w1, w2, attrs, {}, isa=isa, threads=threads), want)
    monkeypatch.setattr(qgemm, "CHUNK_ROWS", 5)
    assert torch.equal(qgemm.run(x, ids, g, w1, w2, attrs, {}, isa=_isas(fmt)[-1], threads=2), want)


@pytest.mark.parametrize("fmt", [f for f in ("a8w4-int", "a8w8-int") if _isas(f)])
def test_non_finite_rows_stay_in_their_token(fmt):
    # A NaN or inf in a token's x makes its block scale non-finite, so the token's output row is
    # NaN, as in the reference; every other token's row is what it is without that token.
    x, ids, g, w1, w2 = make_case(12, 4, 2, 32, seed=9, fmt=fmt)
    bad = x.clone()
    bad[3, 5], bad[8, 70] = float("nan"), float("inf")
    attrs = FFNAttrs()
    y = qgemm.run(bad, ids, g, w1, w2, attrs, {}, threads=2)
    ref = quant.reference_moe(bad, ids, g, w1, w2, attrs)
    assert torch.equal(y.isnan(), ref.isnan()) and bool(y[[3, 8]].isnan().all())
    keep = [t for t in range(12) if t not in (3, 8)]
    clean = qgemm.run(x[keep], ids[keep], g[keep], w1, w2, attrs, {}, threads=2)
    assert torch.equal(y[keep], clean)


def test_policy(monkeypatch):
    # On for group-wise a8w4-int (both ISAs) and a8w8-int (AVX-512 VNNI: on AVX2 its float panels
    # are as fast); not for the per-channel forms, the other formats, nor with
    # MOE_COMPILE_QGEMM_BLOCK_TILES=0 (then the float panels run them); asked for where they do
    # not apply, an error naming what they run.
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2, 32, 64, generator=gen)
    grouped, per_channel = a8w4_int.pack(w), a8w4_int.pack(w, group_size=None)
    grouped8 = a8w8_int.pack(w, group_size=32)
    avx2, avx512 = qgemm.ISA_AVX2, qgemm.ISA_AVX512
    assert qgemm.block_tiles(qgemm.pack(grouped), avx2)
    # asked for the AVX-512 tile by name, the CPU's VNNI decides (not the AVX2 switch, which _vnni follows)
    assert qgemm.block_tiles(qgemm.pack(grouped8), avx512) == bool(qgemm._features() & 2)
    assert not qgemm.block_tiles(qgemm.pack(grouped8), avx2)
    assert not qgemm.block_tiles(qgemm.pack(per_channel), avx512)
    assert not any(qgemm.block_tiles(qgemm.pack(quant.pack(f, w)), avx512) for f in ("w4-int", "a8w8-int"))
    x8, ids8, g8, w81, w82 = make_case(9, 4, 2, 32, fmt="a8w8-int")
    with pytest.raises(ValueError, match="a8w8-int on AVX-512 VNNI"):
        qgemm.run(x8, ids8, g8, w81, w82, FFNAttrs(), {}, isa=avx2, block=True)
    monkeypatch.setenv(qgemm.BLOCK_TILES_ENV, "0")
    assert not qgemm.block_tiles(qgemm.pack(grouped), avx2)
    x, ids, g, w1, w2 = make_case(9, 4, 2, 32)
    y_float = qgemm.run(x, ids, g, w1, w2, FFNAttrs(), {}, bf16=False)
    assert torch.equal(y_float, qgemm.run(x, ids, g, w1, w2, FFNAttrs(), {}, block=False, bf16=False))
    w4 = quant.pack("w4-int", torch.randn(4, 2 * F, H, generator=gen))
    w4_2 = quant.pack("w4-int", torch.randn(4, H, F, generator=gen))
    with pytest.raises(ValueError, match="block tiles run group-wise a8w4-int"):
        qgemm.run(x, ids, g, w4, w4_2, FFNAttrs(), {}, block=True)
