"""The quantized decode kernel (kernels/cpu/qdecode.c) against each format's reference MoE.

The reference: the packed weight dequantized in float64 (every format's q * scale is exact there),
then ``kernels/reference.fused_moe_reference`` in float64.  The kernel dequantizes exactly too and
sums in fp32 in its own order, so the only difference is fp32 rounding of the sums (K <= 128 terms
of unit scale) and the kernels' e^x in the SwiGLU (simd.h, ~2e-7 relative): 1e-5 of the output's
scale per element.  A wrong nibble, scale, lane order or slot fails it by orders of magnitude.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels import reference
from moe_compile.kernels.cpu import qdecode

needs_kernel = pytest.mark.skipif(qdecode.unavailable_reason("w4-int") is not None,
                                  reason=f"no qdecode kernel: {qdecode.unavailable_reason('w4-int')}")
ISAS = [qdecode.ISA_AVX2] + ([qdecode.ISA_AVX512] if qdecode.unavailable_reason("w4-int") is None
                             and qdecode.best_isa() == qdecode.ISA_AVX512 else [])


@dataclasses.dataclass(frozen=True)
class Packed:
    """The canonical packed weight (the fields ``moe_compile.quant.QuantWeight`` has)."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    group: int
    shape: tuple


E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _nibbles(u: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0..15 -> [..., K/2] bytes, element 2j in the low nibble, 2j+1 in the high."""
    return (u[..., 0::2] | (u[..., 1::2] << 4)).to(torch.uint8)


def _unnibble(b: torch.Tensor) -> torch.Tensor:
    u = torch.stack([b & 15, b >> 4], dim=-1)
    return u.reshape(*b.shape[:-1], 2 * b.shape[-1]).long()


def _e8m0(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.float8_e8m0fnu).double()


def pack(fmt: str, w: torch.Tensor, group: int = 32, gen: torch.Generator | None = None,
         random_codes: bool = False) -> Packed:
    """A weight [E, N, K] in ``fmt``, quantized from w as the contract's table says (MX: the OCP
    shared exponent floor(log2 max|w|) - emax of the element type, elements rounded to nearest);
    ``random_codes``: MX data drawn uniformly over every code but NaN instead."""
    E, N, K = w.shape
    if fmt in ("w16-bf16", "w16-fp16"):
        return Packed("w16", w.to(torch.bfloat16 if fmt == "w16-bf16" else torch.float16), torch.empty(0), K, (E, N, K))
    if fmt in ("w8-int", "w4-int"):
        qmax, qmin = (127, -127) if fmt == "w8-int" else (7, -8)
        wg = w.reshape(E, N, K // group, group)
        s = (wg.abs().amax(-1) / qmax).to(torch.float16)  # [E, N, K/G]
        q = torch.round(wg / s.float()[..., None]).clamp(qmin, qmax).reshape(E, N, K)
        data = q.to(torch.int8) if fmt == "w8-int" else _nibbles((q + 8).to(torch.uint8))
        return Packed(fmt, data.contiguous(), s.contiguous(), group, (E, N, K))
    wg = w.double().reshape(E, N, K // 32, 32)
    exp = torch.floor(torch.log2(wg.abs().amax(-1))) - (2 if fmt == "mxfp4" else 8)  # [E, N, K/32]
    scale = (exp + 127).to(torch.uint8)
    v = wg / torch.exp2(exp)[..., None]
    if fmt == "mxfp4":
        codes = (v[..., None] - E2M1).abs().argmin(-1).reshape(E, N, K)  # nearest e2m1 value
        if random_codes:
            codes = torch.randint(0, 16, (E, N, K), generator=gen)
        return Packed(fmt, _nibbles(codes), scale, 32, (E, N, K))
    codes = v.clamp(-448, 448).float().to(torch.float8_e4m3fn).view(torch.uint8).reshape(E, N, K)
    if random_codes:
        codes = torch.randint(0, 254, (E, N, K), generator=gen)
        codes = torch.where(codes >= 127, codes + 1, codes).to(torch.uint8)  # skip 0x7F (NaN); 0xFF never drawn
        scale = (scale.long() - 6).to(torch.uint8)  # |e4m3| up to 448: keep the products near unit scale
    return Packed(fmt, codes.contiguous(), scale, 32, (E, N, K))


def dequantize(p: Packed) -> torch.Tensor:
    """[E, N, K] float64, exactly the element the table defines."""
    E, N, K = p.shape
    if p.fmt == "w16":
        return p.data.double()
    if p.fmt == "w8-int":
        return (p.data.double().reshape(E, N, K // p.group, p.group) * p.scale.double()[..., None]).reshape(E, N, K)
    if p.fmt == "w4-int":
        q = _unnibble(p.data).double() - 8
        return (q.reshape(E, N, K // p.group, p.group) * p.scale.double()[..., None]).reshape(E, N, K)
    elems = E2M1[_unnibble(p.data)] if p.fmt == "mxfp4" else p.data.view(torch.float8_e4m3fn).double()
    return (elems.reshape(E, N, K // 32, 32) * _e8m0(p.scale)[..., None]).reshape(E, N, K)


def reference_moe(x, ids, g, w1: Packed, w2: Packed, attrs: FFNAttrs) -> torch.Tensor:
    w = ExpertWeights((dequantize(w1),), (), (dequantize(w2),))
    return reference.fused_moe_reference(x.double(), ids, g.double(), w, attrs)


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


FORMATS = ["w16-bf16", "w16-fp16", "w8-int", "w4-int", "mxfp4", "mxfp8"]


def _check(x, ids, g, w1, w2, attrs, isa):
    got = qdecode.run(x, ids, g, w1, w2, attrs, None, isa=isa)
    want = reference_moe(x, ids, g, w1, w2, attrs)
    scale = max(want.abs().max().item(), 1e-30)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale)
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
        h = (x.double() @ dequantize(w1)[2].t())  # the clamp must bite for the test to mean anything
        assert h.abs().max() > limit


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
    # e4m3 0x7F and e8m0 255 are NaN (OCP): the rows they feed are NaN, as in the reference.
    x, ids, g, w1, w2 = _case("mxfp8", 2, H=64, F=32, E=2, K=1, seed=5)
    ids = torch.tensor([[0], [1]])
    w1.data[0, 0, 3] = 0x7F  # expert 0, gate feature 0
    w2.scale[1, 5, 0] = 255  # expert 1, output column 5
    got = qdecode.run(x, ids, g, w1, w2, FFNAttrs(), None, isa=isa)
    want = reference_moe(x, ids, g, w1, w2, FFNAttrs())
    assert torch.isnan(got[0]).all() and torch.isnan(got[1, 5]) and not torch.isnan(got[1, :5]).any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want[1, :5].abs().max().item(), equal_nan=True)


def test_unavailable_formats_say_why():
    for fmt in ("a8w8-int", "a8w4-int", "a8w8-fp8"):
        assert "qgemm" in qdecode.unavailable_reason(fmt)
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
    bad = dataclasses.replace(w1, group=48, scale=torch.zeros(2, 64, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 32"):
        qdecode.run(x, ids, g, bad, w2, FFNAttrs())
    with pytest.raises(ValueError, match="qgemm"):
        qdecode.run(x, ids, g, dataclasses.replace(w1, fmt="a8w8-int"), w2, FFNAttrs())
