"""kernels/cpu/attention.c through moe_compile::decode_attention: equal to SDPA in float64 within
fp32 rounding for grouped and plain heads, every mask kind, strided inputs, one and many key
chunks; the calls it must not serve (a fully masked row, a gradient) go to torch's SDPA."""

import pytest
import torch
import torch.nn.functional as F

import moe_compile.ops  # noqa: F401  registers the op
from moe_compile.kernels.cpu import attention
from moe_compile.kernels.cpu.isa import ISA_AVX2, ISA_AVX512
from tests.conftest import kernel_isa

op = torch.ops.moe_compile.decode_attention


def reference(q, k, v, mask, scale):
    """SDPA in float64, K/V heads repeated for grouped-query attention."""
    r = q.shape[1] // k.shape[1]
    mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(r, 1),
                                          v.double().repeat_interleave(r, 1), attn_mask=mask, scale=scale).float()


def make_mask(kind, B, H, L, S):
    if kind == "none":
        return None
    keep = torch.rand(B, H, L, S) > 0.3
    keep[..., 0] = True  # every row attends something
    if kind == "bool":
        return keep
    if kind == "bool-broadcast":
        return keep[:1, :1]
    return torch.where(keep, torch.randn(B, H, L, S), torch.tensor(float("-inf")))


def served(*args):
    """(op's output, whether attention.c served the call)."""
    assert attention.unavailable_reason() is None  # installs it: the op's first call would run SDPA
    before = attention.fast_calls()
    out = op(*args)
    return out, attention.fast_calls() > before


# (B, H, G, L, S, D): decode of a 32/4-head model; plain heads; 16 rows; keys below one chunk; D = 80
SHAPES = [(1, 32, 4, 1, 577, 128), (2, 8, 8, 3, 100, 64), (1, 6, 2, 16, 300, 80), (1, 4, 1, 5, 7, 16)]


@pytest.fixture(params=[ISA_AVX2, ISA_AVX512], ids=["avx2", "avx512"])
def isa(request):
    """The kernel held to AVX2, then (where the CPU has it) run with its AVX-512 blocks: the shapes
    whose padded rows come in eights (the first and the third) take them."""
    assert attention.unavailable_reason() is None
    with kernel_isa(attention.use_isa, request.param) as isa:
        yield isa


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mask", ["none", "bool", "bool-broadcast", "float"])
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_reference(shape, mask, threads, isa):
    B, H, G, L, S, D = shape
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, G, S, D), torch.randn(B, G, S, D)
    m, scale = make_mask(mask, B, H, L, S), D ** -0.5
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, fast = served(q, k, v, m, scale)
    finally:
        torch.set_num_threads(old)
    assert fast
    # fp32 dot products of D terms and softmax sums of S terms in another order than float64: ~1e-7
    torch.testing.assert_close(got, reference(q, k, v, m, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_static_cache_mask_only_its_attended_keys(kind, threads, isa):
    """A static KV cache's mask: each batch row left-padded (its first keys masked), each query row
    causal up to its own end, the long unwritten tail masked for every row.  Only the keys some
    row attends are chunked (attended_span); the answer is the reference's, the keys past the last
    attended one changing nothing (they hold inf here: read, they would make NaN)."""
    B, H, G, L, S, D = 2, 8, 2, 3, 1000, 32
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, G, S, D), torch.randn(B, G, S, D)
    keep = torch.zeros(B, 1, L, S, dtype=torch.bool)
    for b in range(B):
        for row in range(L):
            keep[b, 0, row, 7 * b + 3: 150 + row + 1] = True
    k[:, :, 160:] = float("inf")
    v[:, :, 160:] = float("inf")
    m = keep if kind == "bool" else torch.where(keep, torch.randn(B, 1, L, S), torch.tensor(float("-inf")))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, fast = served(q, k, v, m, D ** -0.5)
    finally:
        torch.set_num_threads(old)
    assert fast and torch.isfinite(got).all()
    # as test_equals_reference: fp32 sums in another order than float64
    want = reference(q, k[:, :, :160], v[:, :, :160], m[..., :160], D ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_every_key_masked_for_every_row_goes_to_sdpa():
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    m = torch.zeros(1, 1, 2, 8, dtype=torch.bool)
    got, fast = served(q, k, v, m, 0.25)
    assert not fast
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # SDPA's own answer there


def test_strided_inputs():
    """q from a transpose (HF's [B, L, H, D] -> [B, H, L, D]), K/V a slice of a longer cache."""
    B, H, G, L, S, D = 1, 8, 2, 2, 50, 32
    q = torch.randn(B, L, H, D).transpose(1, 2)
    cache = torch.randn(2, B, G, S + 9, D)
    k, v = cache[0, :, :, :S], cache[1, :, :, :S]
    m = make_mask("float", 1, 1, L, S)
    got, fast = served(q, k, v, m, 0.3)
    assert fast
    torch.testing.assert_close(got, reference(q, k, v, m, 0.3), atol=2e-6, rtol=1e-5)


def test_fully_masked_row_and_gradients_go_to_sdpa():
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    m = torch.ones(1, 1, 2, 8, dtype=torch.bool)
    m[0, 0, 1] = False  # row 1 attends nothing: SDPA's answer, not a softmax
    got, fast = served(q, k, v, m, 0.25)
    assert not fast
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.25, enable_gqa=True))
    qg = q.clone().requires_grad_()
    got, fast = served(qg, k, v, None, 0.25)
    assert not fast and got.requires_grad


def test_nan_reaches_the_output():
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    v[0, 1, 3, 5] = float("nan")
    got, fast = served(q, k, v, None, 0.25)
    assert fast
    assert torch.isnan(got[0, 1, 0, 5]) and not torch.isnan(got[0, 0]).any()
