"""Dense linears on the decode kernels (kernels/cpu/dense.py, dense_op.cpp): every format against
its reference at decode and prefill sizes, the C++ path bit for bit against the Python one, and a
weight updated in place repacked.

Shapes: T rows, K input width, N output width (odd N: the kernels split output rows in pairs)."""

import pytest
import torch

import moe_compile.ops  # noqa: F401  registers moe_compile::dense_linear
from moe_compile import quant
from moe_compile.kernels.cpu import dense, qdecode
from tests.conftest import rel_err

pytestmark = pytest.mark.skipif(dense.unavailable_reason("w16") is not None,
                                reason=f"no qdecode kernel here: {dense.unavailable_reason('w16')}")

N, K = 97, 256
# Against the format's reference (the same dequantized weights), relative to the output's max:
# the loops sum in another order (fp32: ~1e-6); on AVX2 single rows of the 4/8-bit formats take
# int16 activation blocks (qdecode.c: quantize_i16, up to ~5e-5 of the output's scale).
TOL = 1.5e-4
ROWS = (1, 3, 16)  # decode: qdecode's loops (1: the single-row paths)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "none":
        return x @ w.t() + b
    qw = dense.packed(w, fmt).qweight
    if fmt.startswith("a8") and x.shape[0] <= dense.DECODE_ROWS:  # decode quantizes activations as the format says
        return quant.matmul(x, qw, 0) + b
    if x.shape[0] <= dense.DECODE_ROWS:
        return x @ quant.dequantize(qw)[0].t() + b
    # prefill: the dequantized weight times x; where the GEMM runs in bf16, x, the weight and the
    # product are each rounded to bf16 (torch's CPU bf16 GEMM returns bf16)
    dtype = dense.prefill_dtype(fmt)
    return (x.to(dtype).float() @ quant.dequantize(qw)[0].to(dtype).float().t()).to(dtype).float() + b


@pytest.mark.parametrize("fmt", ("none",) + dense.FORMATS)
@pytest.mark.parametrize("T", ROWS + (40,))
def test_format_matches_reference(fmt, T):
    w, b, x = torch.randn(N, K), torch.randn(N), torch.randn(T, K)
    got = dense.linear(x, w, b, fmt)
    assert got.shape == (T, N) and got.dtype == torch.float32
    bf16 = T > dense.DECODE_ROWS and dense.prefill_dtype(fmt) == torch.bfloat16
    # a bf16 product rounded once more or less than the reference's (other sum order): one bf16
    # step of the output, 2^-8 of it; a wrong weight or row is off by far more
    assert rel_err(got, _reference(x, w, b, fmt)) < (1e-5 if fmt == "none" else 8e-3 if bf16 else TOL)


@pytest.mark.parametrize("fmt", ("w8-int", "a8w4-int", "mxfp4", "w16"))
def test_prefill_weight_from_panels_equals_the_reference_dequantization(fmt):
    """qgemm's C dequantization (the prefill GEMM's operand) gives the reference's values, in fp32
    exactly and in bf16 as torch rounds them."""
    from moe_compile.kernels.cpu import qgemm

    if qgemm.unavailable_reason(fmt) is not None:
        pytest.skip(qgemm.unavailable_reason(fmt))
    qw = quant.pack(fmt, torch.randn(1, 48, 64))
    panels = qgemm.pack(qw)
    want = quant.dequantize(qw)[0]
    assert torch.equal(qgemm.dequantized_weight(panels, 0, torch.float32), want)
    assert torch.equal(qgemm.dequantized_weight(panels, 0, torch.bfloat16), want.bfloat16())


@pytest.mark.parametrize("fmt,group", (("w4-int", 32), ("w4-int", 512), ("w8-int", 64), ("mxfp4", 32), ("w16", None)))
@pytest.mark.parametrize("offset", (0, 1))
def test_prefill_weight_into_a_given_buffer(fmt, group, offset):
    """Into a caller's buffer (longer than the weight; offset 1: not 64-byte aligned, so the C pass
    stores without its whole-line non-temporal stores), with K = 1024 over several of the pass's
    k steps (group 512: a step longer than its usual 256), an odd panel count (48 rows: a panel
    pair and a lone panel): the reference's values in fp32 and bf16."""
    from moe_compile.kernels.cpu import qgemm

    if qgemm.unavailable_reason(fmt) is not None:
        pytest.skip(qgemm.unavailable_reason(fmt))
    qw = quant.pack(fmt, torch.randn(1, 48, 1024), group)
    panels = qgemm.pack(qw)
    want = quant.dequantize(qw)[0]
    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.full((48 * 1024 + 100,), float("nan"), dtype=dtype)
        got = qgemm.dequantized_weight(panels, 0, dtype, buf[offset:])
        assert got.shape == (48, 1024) and got.t().is_contiguous() and got.data_ptr() == buf[offset:].data_ptr()
        assert torch.equal(got, want.to(dtype))
    with pytest.raises(ValueError, match="at least 49152 elements"):
        qgemm.dequantized_weight(panels, 0, torch.float32, torch.empty(100))


def test_prefill_weight_buffer_kept_and_reused(monkeypatch):
    """Prefill calls on two weights share this thread's kept buffer: each result is its own weight's
    (the second call overwrites the buffer only after the first's GEMM read it); a weight over
    SCRATCH_BYTES gets a buffer of its own; empty_cache gives the kept one back."""
    import moe_compile

    moe_compile.empty_cache()
    w1, w2, x = torch.randn(96, K), torch.randn(48, K), torch.randn(40, K)
    y1 = dense.linear(x, w1, None, "w8-int")
    kept = dense.stats()["dense_prefill_scratch_bytes"]
    dtype = dense.prefill_dtype("w8-int")
    assert kept == 96 * K * dtype.itemsize
    y2 = dense.linear(x, w2, None, "w8-int")
    assert dense.stats()["dense_prefill_scratch_bytes"] == kept  # the smaller weight reuses it
    for y, w in ((y1, w1), (y2, w2)):
        assert rel_err(y, _reference(x, w, torch.zeros(w.shape[0]), "w8-int")) < (8e-3 if dtype == torch.bfloat16 else TOL)
    monkeypatch.setattr(dense, "SCRATCH_BYTES", 48 * K * dtype.itemsize)
    y3 = dense.linear(x, w1, None, "w8-int")  # over the limit now: made for the call
    assert torch.equal(y3, y1)
    assert moe_compile.empty_cache()["dense_prefill_scratch"] == kept
    assert dense.stats()["dense_prefill_scratch_bytes"] == 0


def test_prefill_recorded_by_autograd_keeps_its_own_weight():
    """A prefill GEMM autograd records saves its weight for the backward: that weight must not be
    the kept buffer a later call overwrites (the gradient would silently use another weight)."""
    import moe_compile

    moe_compile.empty_cache()
    w1, w2 = torch.randn(96, K), torch.randn(96, K)
    x = torch.randn(40, K, requires_grad=True)
    y = dense.linear(x, w1, None, "w8-int")
    assert dense.stats()["dense_prefill_scratch_bytes"] == 0
    with torch.no_grad():
        dense.linear(torch.randn(40, K), w2, None, "w8-int")  # fills the kept buffer with w2
    y.sum().backward()
    dtype = dense.prefill_dtype("w8-int")
    want = quant.dequantize(dense.packed(w1, "w8-int").qweight)[0].to(dtype).float().sum(0)
    # x's gradient is the column sums of w1's dequantized weight (bf16 GEMM: one rounding of its sum)
    assert rel_err(x.grad, want.expand(40, K)) < (8e-3 if dtype == torch.bfloat16 else 1e-5)


def test_prefill_in_fp32_when_asked(monkeypatch):
    """MOE_COMPILE_PREFILL_BF16=0: the prefill GEMM on the fp32 dequantized weight, to fp32 rounding."""
    monkeypatch.setenv(dense.PREFILL_BF16_ENV, "0")
    w, x = torch.randn(N, K), torch.randn(40, K)
    assert dense.prefill_dtype("w8-int") == torch.float32
    want = x @ quant.dequantize(dense.packed(w, "w8-int").qweight)[0].t()
    assert rel_err(dense.linear(x, w, None, "w8-int"), want) < 1e-5


def test_prefill_in_fp32_when_held_to_avx2(monkeypatch):
    """MOE_COMPILE_FUSED_ISA=avx2 runs what an AVX2-only CPU runs: no bf16 prefill GEMM (such a CPU
    has no bf16 multiply), whatever flags this CPU has; the result is the fp32 GEMM's."""
    monkeypatch.setenv("MOE_COMPILE_FUSED_ISA", "avx2")
    w, x = torch.randn(N, K), torch.randn(40, K)
    assert dense.prefill_dtype("w4-int") == torch.float32
    want = x @ quant.dequantize(dense.packed(w, "w4-int").qweight)[0].t()
    assert rel_err(dense.linear(x, w, None, "w4-int"), want) < 1e-5


@pytest.mark.parametrize("fmt", ("none", "w8-int", "w4-int", "a8w8-int"))
def test_op_cpp_path_equals_python_path(fmt):
    """The op's C++ kernel (when it builds) runs the same C loops: the same bits, any leading dims."""
    w, b, x = torch.randn(N, K), torch.randn(N), torch.randn(2, 3, K)
    want = dense.linear(x, w, b, fmt)
    torch.ops.moe_compile.dense_linear(x, w, b, fmt, 0)  # installs the C++ kernel, registers the pack
    before = dense.fast_calls()
    got = torch.ops.moe_compile.dense_linear(x, w, b, fmt, 0)
    assert torch.equal(got, want) and got.shape == (2, 3, N)
    if dense.install():
        assert dense.fast_calls() == before + 1  # served by C++, not by the Python kernel


def test_op_cpp_path_keeps_one_pack_per_group():
    """One weight called in a8w8-int per channel (group 0, the default) and group-wise (32): each
    C++ call runs on its own group's pack, the same bits as the Python path for that group."""
    dense.install()  # first: the packs made below are then registered with the C++ kernel
    w, x = torch.randn(N, K), torch.randn(1, K)
    want = {g: dense.linear(x, w, None, "a8w8-int", g or None) for g in (0, 32)}
    assert not torch.equal(want[0], want[32])  # the two forms round differently
    for g in (0, 32, 0, 32):  # alternating: the last registration must not serve the other group
        before = dense.fast_calls()
        assert torch.equal(torch.ops.moe_compile.dense_linear(x, w, None, "a8w8-int", g), want[g])
        if dense.install():
            assert dense.fast_calls() == before + 1


def test_inplace_update_repacks():
    """A weight changed in place (an optimizer step, load_state_dict) is packed again: the next
    call reads the new values, in C++ as in Python."""
    w, x = torch.randn(N, K), torch.randn(1, K)
    torch.ops.moe_compile.dense_linear(x, w, None, "w8-int", 0)
    with torch.no_grad():
        w.mul_(-2.0)
    got = torch.ops.moe_compile.dense_linear(x, w, None, "w8-int", 0)
    assert rel_err(got, x @ w.t()) < 2e-2  # w8-int per-group error, far below a sign flip's


def test_bf16_weight_own_dtype():
    """A bf16 model's weights run on qdecode's w16 loops as they are (no pack), fp32 sums."""
    w, x = torch.randn(N, K).bfloat16(), torch.randn(2, K).bfloat16()
    got = dense.linear(x, w, None, "none")
    assert got.dtype == torch.bfloat16
    assert rel_err(got, (x.float() @ w.float().t())) < 1e-2  # one bf16 rounding of the output


def test_unavailable_format_says_why():
    assert "a8w8-fp8" in dense.unavailable_reason("a8w8-fp8")
    assert dense.unavailable_reason("w4-int") is None or qdecode.unavailable_reason("w4-int") is not None


def test_stats_and_clear():
    w = torch.randn(N, K)
    dense.linear(torch.randn(1, K), w, None, "w4-int")
    assert dense.stats()["dense_pack_bytes"] >= N * K // 2
    dense.clear()
    assert dense.stats()["dense_packs"] == 0


def test_pack_goes_with_its_weight():
    """A dropped weight's pack is dropped with it: no memory kept for models that are gone."""
    import gc

    w = torch.randn(N, K)
    dense.linear(torch.randn(1, K), w, None, "w8-int")
    before = len(dense._PACKS)
    del w
    gc.collect()
    assert len(dense._PACKS) == before - 1


def test_one_pack_per_weight_and_format():
    """A weight read in two formats keeps both packs: alternating calls never repack."""
    w, x = torch.randn(N, K), torch.randn(1, K)
    first = dense.packed(w, "w8-int")
    dense.packed(w, "w4-int")
    assert dense.packed(w, "w8-int") is first


# ------------------------------------------- the rows16 panels (T = 1, AVX-512 VNNI or AVX2)
ROWS16_FORMATS = ("w4-int", "a8w4-int", "w8-int")  # a8w4-int: its group-wise form, dense's default


def _runs_rows16() -> bool:
    """Whether this CPU (and switches) read the rows16 panels: AVX2 or AVX-512, int16 blocks not off."""
    return qdecode.rows16_runs(quant.pack("w4-int", torch.randn(1, 16, 128)))


needs_rows16 = pytest.mark.skipif(not _runs_rows16(), reason="the rows16 loops need AVX2 (and MOE_COMPILE_QDECODE_I16 not 0)")


def _rows16_emulation(x: torch.Tensor, qw) -> torch.Tensor:
    """What the rows16 loops compute for one row x [K]: x as int16 per block of 32 for w4-int and
    w8-int (s = max|x| / 32767, q = round half even(x / s), as qdecode.c's quantize_i16), as the
    format's int8 blocks for a8w4-int (quantize_per_block_int8), each (row, block) sum of w q
    (4-bit: w = u - 8) exact in integers, rounded once to fp32, then per block
    t = fma((sum * s_x) * s_w, t) in fp32, in block order."""
    from moe_compile.quant.common import quantize_per_block_int8

    N, K = qw.shape[1:]
    if qw.fmt == "a8w4-int":
        q8, sx = quantize_per_block_int8(x.reshape(1, K))
        q, sx = q8.reshape(K // 32, 32).to(torch.int64), sx[0]
    else:
        xb = x.float().reshape(K // 32, 32)
        big = xb.abs().amax(dim=1)
        sx = torch.where(big == 0, torch.ones_like(big), big / 32767)
        q = torch.round(xb / sx[:, None]).clamp(-32767, 32767).to(torch.int64)  # round half to even
    packed = qw.data[0].to(torch.int64)
    if qw.fmt == "w8-int":
        codes = packed.reshape(N, K // 32, 32)
    else:
        codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(N, K // 32, 32) - 8
    sums = (codes * q[None]).sum(dim=2)  # [N, K/32], exact
    sw = qw.scale[0].float().repeat_interleave(qw.group // 32, dim=1)  # [N, K/32]
    t = torch.zeros(N, dtype=torch.float32)
    for g in range(K // 32):
        prod = sums[:, g].float() * sx[g]
        t = (prod.double() * sw[:, g].double() + t.double()).float()  # one rounding, as the FMA
    return t


@needs_rows16
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
def test_rows16_reads_the_panels_the_pack_holds(fmt):
    """T = 1 reads the weight's qgemm panels, made with the pack: the pack's bytes reordered, never
    changed (their inverse permutation is the canonical pack), and no other copy."""
    w = torch.randn(48, 256)
    pack = dense.packed(w, fmt)
    qw = pack.qweight
    data, scale = pack.rows16
    assert data.data_ptr() == pack.panels.data.data_ptr() and scale.data_ptr() == pack.panels.scale.data_ptr()
    row_bytes = qw.data.shape[-1]  # 128 4-bit, 256 w8-int
    assert torch.equal(data.reshape(3, row_bytes // 4, 16, 4).permute(0, 2, 1, 3).reshape(48, row_bytes),
                       qw.data[0].view(torch.uint8))
    assert torch.equal(scale.permute(0, 2, 1).reshape(48, 256 // qw.group), qw.scale[0])
    assert dense.stats()["dense_panel_bytes"] >= pack.panels.nbytes


@needs_rows16
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
@pytest.mark.parametrize("group", (32, 64, 128))
def test_rows16_matches_its_emulation_and_the_reference(fmt, group):
    """A T = 1 call runs the rows16 loop: its result is the loop's exact-integer emulation to fp32
    rounding (1e-6 of the output's scale: a wrong row, block or nibble is off by 1e-2 or more), the
    reference within the activations' error (w4-int's int16 blocks: TOL; a8w4-int's reference
    quantizes them as the loop does: fp32 order alone), and the C++ op's bits."""
    n, k = 80, 512
    w, x = torch.randn(n, k), torch.randn(1, k)
    pack = dense.packed(w, fmt, group)
    assert pack.rows16 is not None and pack.fields[4] == pack.rows16[0].data_ptr()
    got = dense.linear(x, w, None, fmt, group)
    assert rel_err(got[0], _rows16_emulation(x[0], pack.qweight)) < 1e-6
    if fmt == "a8w4-int":
        assert rel_err(got, quant.matmul(x, pack.qweight, 0)) < 1e-6
    else:
        assert rel_err(got, x @ quant.dequantize(pack.qweight)[0].t()) < TOL
    dense.install()
    assert torch.equal(torch.ops.moe_compile.dense_linear(x, w, None, fmt, group), got)
    pack.rows16[0][0].fill_(0 if fmt == "w8-int" else 0x88)  # rows 0-15 read as zeros (u = 8) in the panels alone, not the pack
    changed = dense.linear(x, w, None, fmt, group)
    assert changed[0, :16].abs().max() == 0 and torch.equal(changed[0, 16:], got[0, 16:])  # it read the copy
    dense.clear()


@needs_rows16
def test_rows16_and_the_row_loop_agree():
    """T = 1 on the rows16 copy and T = 3 on the canonical pack (the row loops, fp32 activations)
    give each row the same value up to T = 1's int16 activation blocks (~5e-5 of the output's
    scale, TOL); a row read from the wrong copy or offset would be off by the weights' scale."""
    w, x = torch.randn(64, K), torch.randn(3, K)
    many = dense.linear(x, w, None, "w4-int")
    for t in range(3):
        assert rel_err(dense.linear(x[t:t + 1], w, None, "w4-int")[0], many[t]) < TOL


@needs_rows16
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
def test_rows16_passes_nan_and_inf_on(fmt):
    """A NaN or inf in x reaches the output (its block's scale is not finite), as in the reference."""
    w = torch.randn(32, K)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, K)
        x[0, 7] = bad
        got = dense.linear(x, w, None, fmt)
        assert not torch.isfinite(got).any()


def test_rows16_only_where_its_loop_runs(monkeypatch):
    """No rows16 (and no panels before a prefill needs them) for other formats, a8w4-int's
    per-channel form, N not a multiple of 16, a CPU without the loops' ISA or (w4-int)
    MOE_COMPILE_QDECODE_I16=0; such calls run the row loops on the canonical pack.  The AVX2
    switch keeps them (the AVX2 loops, the same sums)."""
    from moe_compile.quant import a8w4_int

    assert not qdecode.rows16_runs(quant.pack("mxfp4", torch.randn(1, 32, 128)))
    per_channel = a8w4_int.pack(torch.randn(1, 32, 128), group_size=None)
    assert not qdecode.rows16_runs(per_channel)
    assert not qdecode.rows16_runs(quant.pack("w4-int", torch.randn(1, 40, 128)))
    monkeypatch.setenv(qdecode.I16_ENV, "0")
    assert not qdecode.rows16_runs(quant.pack("w4-int", torch.randn(1, 32, 128)))
    assert not qdecode.rows16_runs(quant.pack("w8-int", torch.randn(1, 32, 128)))
    monkeypatch.delenv(qdecode.I16_ENV)
    monkeypatch.setattr(qdecode, "best_isa", lambda: qdecode.ISA_AVX2)
    assert qdecode.rows16_runs(quant.pack("w4-int", torch.randn(1, 32, 128)))
    assert qdecode.rows16_runs(quant.pack("w8-int", torch.randn(1, 32, 128)))
    monkeypatch.setattr(qdecode, "best_isa", lambda: 0)  # no F16C / FMA: no kernel at all
    assert not qdecode.rows16_runs(quant.pack("w4-int", torch.randn(1, 32, 128)))
    monkeypatch.undo()
    w, x = torch.randn(40, K), torch.randn(1, K)
    assert dense.packed(w, "w4-int").rows16 is None and dense.packed(w, "w4-int").panels is None
    assert rel_err(dense.linear(x, w, None, "w4-int"), x @ quant.dequantize(dense.packed(w, "w4-int").qweight)[0].t()) < TOL
