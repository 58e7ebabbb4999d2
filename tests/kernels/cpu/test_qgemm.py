"""The quantized prefill kernel (qgemm.c): the integer tiles' int32 sums exactly against an int64
matmul, the panel dequantization exactly against the format's meaning, the per-token quantizer bit
for bit, and whole MoE calls against a plain-torch reference of the quantized MoE, on both ISAs
(AVX2 always, AVX-512 where the CPU has it), T in {17, 64, 513}, odd expert loads, empty experts
and dropped ids."""

import functools
from types import SimpleNamespace

import pytest
import torch

from moe_compile import quant
from moe_compile.ir import FFNAttrs
from moe_compile.kernels.cpu import qgemm
from moe_compile.quant import a8w4_int, w16
from moe_compile.quant.common import dequantized_blocks, quantize_per_token_int8, unpack_nibbles

pytestmark = pytest.mark.skipif(not qgemm.available(), reason=f"{qgemm.unavailable_reason('a8w8-int')}")


def _isas(fmt):
    name = {"a8w4-int-pc": "a8w4-int", "a8w4-int": "a8w4-int-grouped",
            "a8w4-int-float": "a8w4-int-grouped"}.get(fmt, fmt.split("-fp16")[0])
    best = qgemm.best_isa(name) if qgemm.available() else qgemm.ISA_AVX2
    return [qgemm.ISA_AVX2] + ([qgemm.ISA_AVX512] if best == qgemm.ISA_AVX512 else [])


INT_FORMATS = ["a8w8-int", "a8w4-int-pc"]  # a8w4-int-pc: a8w4-int's per-channel (MSD) form
FLOAT_FORMATS = ["w4-int", "mxfp4", "w8-int", "mxfp8", "w16"]
# a8w4-int (group-wise, the default form): the integer block tiles; "a8w4-int-float": the same
# weights on w4-int's float panels with block-quantized activations (block=False, as a8w8-int
# group-wise runs)
CASES = [(f, isa) for f in INT_FORMATS + ["a8w4-int", "a8w4-int-float"] + FLOAT_FORMATS for isa in _isas(f)]


def form(fmt):
    """qgemm.run's keywords for a test format: the float panels for "a8w4-int-float"."""
    return {"block": False} if fmt == "a8w4-int-float" else {}


# ---- weights in each format (moe_compile.quant: the contract's canonical tensors) ----

def make_weight(fmt, E, N, K, gen):
    """W ~ N(0, 0.05) packed by ``moe_compile.quant`` (default groups: 32 for w-int, MX and a8w4-int;
    "a8w4-int-pc" is a8w4-int per channel)."""
    w = torch.randn(E, N, K, generator=gen) * 0.05
    if fmt == "a8w4-int-pc":
        return a8w4_int.pack(w, group_size=None)
    return quant.pack(fmt.removesuffix("-float"), w)


def integers(w):
    """Signed integer q [E, N, K] (int32) of an a8 weight."""
    if w.data.dtype == torch.int8:
        return w.data.to(torch.int32)
    return unpack_nibbles(w.data).to(torch.int32) - 8


# ---- the pieces ----

@pytest.mark.parametrize("fmt,isa", [(f, i) for f in INT_FORMATS for i in _isas(f)])
@pytest.mark.parametrize("M", [1, 7, 13])
def test_integer_tiles_are_exact(fmt, isa, M):
    # Extreme codes included: activations -127 / 127 / 0 and weights at both ends of their range
    # (a pair of products 2 * 127 * 127 sits just under vpmaddubsw's int16 saturation).
    gen = torch.Generator().manual_seed(M)
    K, N = 136, 64  # K: 17 groups of 8 (the 4-bit tile's step); N: two AVX-512 32-column units
    w = make_weight(fmt, 2, N, K, gen)
    qa = torch.randint(-127, 128, (M, K), generator=gen, dtype=torch.int8)
    qa[0, :8] = torch.tensor([-127, 127, 0, -127, 127, 127, -127, -127], dtype=torch.int8)
    if fmt == "a8w8-int":
        w.data[1, 0, :] = 127
        w.data[1, 1, :] = -127
    p = qgemm.pack(w)
    want = qa.long() @ integers(w)[1].long().t()
    got = qgemm.int_matmul(qa, p, 1, isa)
    assert torch.equal(got.long(), want)


@pytest.mark.parametrize("fmt,isa", [(f, i) for f in FLOAT_FORMATS + ["w16-fp16"] for i in _isas(f)])
def test_panel_dequantization_is_exact(fmt, isa):
    # The kernel's fp32 panel equals quant.dequantize bit for bit (q * s of exactly representable
    # factors; e2m1 * 2^k; bf16 widened), every code and mxfp4's e8m0 ends (0: 2^-127) included.
    gen = torch.Generator().manual_seed(1)
    w = (make_weight(fmt, 2, 32, 64, gen) if fmt != "w16-fp16"
         else w16.pack(torch.randn(2, 32, 64, generator=gen), torch.float16))
    if fmt in ("w4-int", "mxfp4"):
        w.data[1, :8] = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # every pair of nibbles
    if fmt == "mxfp8":  # every e4m3 code, NaN (0x7F, 0xFF) and subnormals included
        w.data[1, :8] = torch.arange(256, dtype=torch.uint8).reshape(8, 32).repeat(1, 2)
    if fmt in ("mxfp4", "mxfp8"):
        w.scale[1, 0, 0], w.scale[1, 0, 1], w.scale[1, 1, 0] = 0, 254, 1
    got = qgemm.dequantized_rows(qgemm.pack(w), 1, isa)
    torch.testing.assert_close(got, quant.dequantize(w)[1], rtol=0, atol=0, equal_nan=True)


def test_quantizer_matches_per_token_int8_bit_for_bit():
    # A zero row (scale 1), halves that round to even, tails past the 32-wide vector loop.
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 77, generator=gen) * 3
    x[3] = 0
    x[4, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # s = 1: exact halves
    q, s, total = qgemm.quantize_rows(x)
    q_ref, s_ref = quantize_per_token_int8(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref[:, 0])
    assert torch.equal(total, q_ref.sum(-1, dtype=torch.int32))


# ---- whole calls ----

H, F = 64, 96  # two 32-column FC2 units; six 16-feature panels, three 32-wide scale groups along F


@functools.cache
def layer_weights(fmt, E):
    """(FC1, FC2) of E experts in ``fmt``, packed once per module (packing is most of a case's time;
    the whole-call tests never write into them)."""
    gen = torch.Generator().manual_seed(E)
    return make_weight(fmt, E, 2 * F, H, gen), make_weight(fmt, E, H, F, gen)


def make_case(T, E, K, fmt, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K].contiguous() if K <= E else torch.randint(0, E, (T, K))
    g = torch.softmax(torch.randn(T, K, generator=gen), 1)
    return (x, ids, g, *layer_weights(fmt, E))


def assert_matches(fmt, y, ref):
    """fp32 formats: the tiles sum in another order and the SiLU's e^x is a polynomial (~2e-7
    relative): ~1e-6 relative.  a8 formats: the int32 sums are exact (test_integer_tiles_are_exact)
    and the fp32 epilogues match to ~1e-7, but where a SwiGLU value sits within an ulp of a
    rounding boundary of FC2's per-row re-quantization its code can move by 1: rare (none in these
    cases when written), and such an element moves by about one step of one FC2 product.
    Group-wise a8w4-int on the block tiles sums each block exactly and scales it as the reference
    does, only the blocks' fp32 sum runs in another order (~1e-7): as the integer formats.  On the
    float panels ("a8w4-int-float") it multiplies dequantized codes (q_x s_x)(q_w s_w): FC1's
    output is the reference's to ~1e-7 only, so its per-block re-quantization moves a code more
    often (a token's whole output row each time): up to 1% of the elements, each by at most about
    one step of one FC2 product."""
    scale = float(ref.abs().max())
    if not fmt.startswith("a8"):
        torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * scale)
        return
    off = (y - ref).abs() > 1e-5 * scale
    share = 1e-2 if fmt == "a8w4-int-float" else 1e-3
    assert off.float().mean() <= share, f"{int(off.sum())} of {off.numel()} elements off by more than 1e-5"
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-3 * scale)


# The whole-call tests below hold the fp32 tiles (bf16=False) to the reference's fp32 rounding;
# test_bf16_tiles_* hold the bf16 tiles (the default on CPUs with AVX-512 BF16) to the same MoE on
# bf16-rounded operands.
# T = 513 for every format in the default run would double its time: the integer formats and
# w4-int there, the other float formats (the same tile behind another panel decoder) marked slow.
WIDE_T = [(T, fmt, isa) for T in (17, 64, 513) for fmt, isa in CASES]
WIDE_T = [pytest.param(*c, marks=pytest.mark.slow)
          if c[0] == 513 and c[1] in ("mxfp4", "w8-int", "mxfp8", "w16", "a8w4-int-float") else c
          for c in WIDE_T]


@pytest.mark.parametrize("T,fmt,isa", WIDE_T)
def test_matches_reference(fmt, isa, T):
    E, K = 6, 3
    x, ids, g, w1, w2 = make_case(T, E, K, fmt, seed=T)
    attrs = FFNAttrs()
    ref = quant.reference_moe(x, ids, g, w1, w2, attrs)
    y = qgemm.run(x, ids, g, w1, w2, attrs, {}, isa=isa, threads=2, bf16=False, **form(fmt))
    assert_matches(fmt, y, ref)


@pytest.mark.parametrize("fmt,isa", CASES)
@pytest.mark.parametrize("threads", [1, 3])
def test_odd_routes_between_and_clamp(fmt, isa, threads):
    # Expert 0 and E-1 get no rows, one token goes twice to one expert, ids outside [0, E) are
    # dropped, the routing weight sits between the SwiGLU and FC2, the SwiGLU is clamped; three
    # threads split the units unevenly.
    T, E, K = 37, 6, 3
    x, _, g, w1, w2 = make_case(T, E, K, fmt, seed=7)
    ids = torch.randint(1, E - 1, (T, K))
    ids[0] = torch.tensor([2, 2, -1])
    ids[1, 0], ids[2, 2] = E, 4
    attrs = FFNAttrs(limit=0.7, weight_on="between")
    ref = quant.reference_moe(x, ids, g, w1, w2, attrs)
    y = qgemm.run(x, ids, g, w1, w2, attrs, {}, isa=isa, threads=threads, bf16=False, **form(fmt))
    assert_matches(fmt, y, ref)


@pytest.mark.parametrize("fmt,isa", [(f, i) for f in ("a8w8-int", "w4-int") for i in _isas(f)])
def test_experts_in_chunks_of_rows(fmt, isa, monkeypatch):
    # Rows of one expert run CHUNK_ROWS at a time (5 here): each chunk adds into y on its own.
    monkeypatch.setattr(qgemm, "CHUNK_ROWS", 5)
    x, ids, g, w1, w2 = make_case(29, 4, 2, fmt, seed=3)
    attrs = FFNAttrs()
    ref = quant.reference_moe(x, ids, g, w1, w2, attrs)
    assert_matches(fmt, qgemm.run(x, ids, g, w1, w2, attrs, {}, isa=isa, bf16=False), ref)


def test_pack_cache_holds_one_pack_per_weight():
    x, ids, g, w1, w2 = make_case(20, 4, 2, "a8w4-int-pc")
    cache = {}
    y1 = qgemm.run(x, ids, g, w1, w2, FFNAttrs(), cache)
    y2 = qgemm.run(x, ids, g, w1, w2, FFNAttrs(), cache)
    assert torch.equal(y1, y2) and len(cache) == 2
    # a8w4: the panels hold the canonical bytes (two codes a byte) and the fp32 scales, nothing more.
    assert sum(p.nbytes for p in cache.values()) == sum(w.data.nbytes + w.scale.nbytes for w in (w1, w2))


def test_grouped_a8w4_packs_as_w4_panels():
    # Group-wise a8w4-int holds w4-int's bytes: its panels are w4-int's, bit for bit, and nothing more.
    x, ids, g, w1, w2 = make_case(20, 4, 2, "a8w4-int")
    p = qgemm.pack(w1)
    as_w4 = qgemm.pack(quant.QuantWeight("w4-int", w1.data, w1.scale, w1.group, w1.shape))
    assert p.code == as_w4.code and torch.equal(p.data, as_w4.data) and torch.equal(p.scale, as_w4.scale)
    assert p.nbytes == w1.data.nbytes + w1.scale.nbytes


def test_refuses_what_it_does_not_compute():
    x, ids, g, w1, w2 = make_case(20, 4, 2, "a8w8-int")
    with pytest.raises(ValueError, match="SwiGLU"):
        qgemm.run(x, ids, g, w1, w2, FFNAttrs(weight_on="input"), {})
    with pytest.raises(ValueError, match="fp32"):
        qgemm.run(x.double(), ids, g, w1, w2, FFNAttrs(), {})
    assert qgemm.unavailable_reason("a8w8-fp8") is not None and qgemm.unavailable_reason("a8w8-int") is None


@pytest.mark.parametrize("fmt,H_,F_,group,match", [
    ("a8w8-int", 48, 64, 48, "H=48 must be a multiple of 32"),  # FC2's 32-column units
    ("w4-int", 64, 40, 8, "F=40 of 16"),  # FC1's 16-row panels
    ("w4-int", 64, 64, 1, "even for 4 bits"),  # a group must hold whole bytes of two codes
    ("a8w4-int", 64, 48, 32, "F=48 must be a multiple of 32"),  # FC2's input quantized per 32
])
def test_refuses_shapes_the_tiles_do_not_divide(fmt, H_, F_, group, match):
    # What kernels/cpu/quant.py asks before choosing this kernel: a clear reason, never a wrong y.
    w1 = SimpleNamespace(fmt=fmt, shape=(2, 2 * F_, H_), group=group)
    w2 = SimpleNamespace(fmt=fmt, shape=(2, H_, F_), group=group)
    with pytest.raises(ValueError, match=match):
        qgemm.check_call(torch.empty(0, H_), w1, w2, FFNAttrs())


def test_isa_switch(monkeypatch):
    # qgemm reads the switch on every call (kernels/cpu/isa.py), so no cache to clear between settings.
    monkeypatch.setenv("MOE_COMPILE_FUSED_ISA", "avx2")
    assert qgemm.best_isa("a8w8-int") == qgemm.ISA_AVX2
    monkeypatch.setenv("MOE_COMPILE_FUSED_ISA", "sse")
    with pytest.raises(ValueError, match="use one of"):
        qgemm.best_isa("a8w8-int")


# ---- the bf16 tiles (AVX-512 BF16): float formats but w16, group-wise a8w4-int ----

BF16_FORMATS = ["w4-int", "mxfp4", "w8-int", "mxfp8", "a8w4-int"]
needs_bf16 = pytest.mark.skipif(not qgemm.available() or not qgemm._features() & 4,
                                reason="no AVX-512 BF16 on this CPU")


def dense_bf16():
    from moe_compile.kernels.cpu import dense

    return dense.prefill_dtype("w4-int") == torch.bfloat16


def bf16_reference(x, ids, g, w1, w2, attrs, grouped):
    """quant.reference_moe with each GEMM on bf16-rounded operands (the activations and the dequantized
    weight, each rounded to nearest even once), summed in fp32: what the bf16 tiles compute.  Group-wise
    a8w4-int quantizes x and FC2's input per block first, as its float panels do."""
    from moe_compile.quant.reference import swiglu

    bf = lambda t: t.bfloat16().float()  # noqa: E731
    d1, d2 = quant.dequantize(w1), quant.dequantize(w2)
    x = dequantized_blocks(x) if grouped else x
    y = torch.zeros_like(x)
    for e in range(d1.shape[0]):
        tok, k = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gk = g[tok, k][:, None]
        a = swiglu(bf(x[tok]) @ bf(d1[e]).t(), attrs.limit)
        a = a * gk if attrs.weight_on == "between" else a
        a = dequantized_blocks(a) if grouped else a
        out = bf(a) @ bf(d2[e]).t()
        y.index_add_(0, tok, out * gk if attrs.weight_on == "output" else out)
    return y


@needs_bf16
@pytest.mark.parametrize("fmt", BF16_FORMATS)
@pytest.mark.parametrize("T,weight_on", [(17, "output"), (64, "between"), (513, "output")])
def test_bf16_tiles_match_a_bf16_reference(fmt, T, weight_on):
    # Against the same MoE on bf16-rounded operands the tiles differ by fp32 sum order and the
    # SiLU's polynomial (~1e-6), and where those move an FC2 input across a bf16 rounding boundary,
    # by one bf16 step of that element times its weights: 2e-4 of the output's scale bounds it here,
    # where a wrong pair, lane or panel costs ~1e-1.  a8w4-int's per-block re-quantization of FC2's
    # input can move a code as well (as assert_matches allows the fp32 tiles).  Against the fp32
    # reference the bf16 rounding shows (2^-8 of a product): the tiles are what ran.
    E, K = 6, 3
    x, ids, g, w1, w2 = make_case(T, E, K, fmt, seed=T + 1)
    attrs = FFNAttrs(weight_on=weight_on, limit=0.0 if T != 64 else 0.7)
    p1 = qgemm.pack(w1)  # the tiles are what the default runs where their dot product pays (not with AMX)
    assert qgemm.bf16_tiles(p1, qgemm.ISA_AVX512) == (qgemm._bf16_dot_pays() and dense_bf16())
    y = qgemm.run(x, ids, g, w1, w2, attrs, {}, isa=qgemm.ISA_AVX512, threads=2, bf16=True, block=False)
    want = bf16_reference(x, ids, g, w1, w2, attrs, fmt == "a8w4-int")
    scale = float(want.abs().max())
    if fmt == "a8w4-int":
        off = (y - want).abs() > 2e-4 * scale
        assert off.float().mean() <= 1e-2, f"{int(off.sum())} of {off.numel()} elements off by more than 2e-4"
        torch.testing.assert_close(y, want, rtol=0, atol=1e-3 * scale)
    else:
        torch.testing.assert_close(y, want, rtol=0, atol=2e-4 * scale)
    fp32 = quant.reference_moe(x, ids, g, w1, w2, attrs)
    assert float((y - fp32).abs().max()) > 1e-5 * scale


def test_bf16_tiles_policy(monkeypatch):
    # On by default where the CPU has AVX-512 BF16, for the float formats but w16 (its 16-bit
    # weights hold more than bf16) and not for the integer tiles; off with MOE_COMPILE_PREFILL_BF16=0
    # and under the AVX2 switch (as dense.prefill_dtype); the kernel refuses bf16 where it has none.
    from moe_compile.kernels.cpu import dense

    gen = torch.Generator().manual_seed(0)
    packs = {f: qgemm.pack(make_weight(f, 1, 32, 64, gen)) for f in ("w4-int", "w16", "a8w8-int", "a8w4-int-pc")}
    native = bool(qgemm.available() and qgemm._features() & 4) and dense.prefill_dtype("w4-int") == torch.bfloat16 \
        and qgemm._bf16_dot_pays()
    assert qgemm.bf16_tiles(packs["w4-int"], qgemm.ISA_AVX512) == native
    assert not qgemm.bf16_tiles(packs["w4-int"], qgemm.ISA_AVX2)
    assert not any(qgemm.bf16_tiles(packs[f], qgemm.ISA_AVX512) for f in ("w16", "a8w8-int", "a8w4-int-pc"))
    monkeypatch.setenv(dense.PREFILL_BF16_ENV, "0")
    assert not qgemm.bf16_tiles(packs["w4-int"], qgemm.ISA_AVX512)
    x, ids, g, w1, w2 = make_case(20, 4, 2, "w16")
    with pytest.raises(RuntimeError, match="refused"):
        qgemm.run(x, ids, g, w1, w2, FFNAttrs(), {}, isa=qgemm.ISA_AVX512 if native else qgemm.ISA_AVX2, bf16=True)


def test_bf16_tiles_not_where_the_cpu_has_amx(monkeypatch):
    # An AMX CPU (Intel Sapphire Rapids and later) issues vdpbf16ps on one port, at the fp32 FMA's
    # product rate: the bf16 tiles would only add rounding (measured 1.2-1.4x slower there), so the
    # float formats keep fp32 tiles; AVX-512 BF16 without AMX (Zen 4) takes them.
    from moe_compile.kernels.cpu import isa

    monkeypatch.setattr(isa, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert not qgemm._bf16_dot_pays.__wrapped__()
    monkeypatch.setattr(isa, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert qgemm._bf16_dot_pays.__wrapped__()
    monkeypatch.setattr(qgemm, "_bf16_dot_pays", lambda: False)
    assert not qgemm.bf16_tiles(qgemm.pack(make_weight("w4-int", 1, 32, 64, torch.Generator().manual_seed(0))),
                                qgemm.ISA_AVX512)
