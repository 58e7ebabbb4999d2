"""passes/attention.py: SDPA on K/V heads repeated in the graph runs with enable_gqa=True on the
K/V as they are — equal to eager — and other repeats (another head order) are left alone; few-row
(decode) SDPA calls run on moe_compile::decode_attention, equal to SDPA within fp32 rounding."""

import pytest
import torch
import torch.nn.functional as F

from moe_compile.passes.attention import MAX_ROWS
from tests.conftest import run_compiled, tiny_qwen3_moe_lm

B, G, R, S, D = 1, 2, 3, 7, 16


def repeat_kv(x, n):  # HF's spelling
    b, g, s, d = x.shape
    return x[:, :, None, :, :].expand(b, g, n, s, d).reshape(b, g * n, s, d)


def tiled(x, n):  # head h reads K/V head h % G: NOT grouped-query attention's h // R
    b, g, s, d = x.shape
    return x[:, None].expand(b, n, g, s, d).reshape(b, n * g, s, d)


SPELLINGS = {
    "repeat_kv": lambda q, k, v, m: F.scaled_dot_product_attention(q, repeat_kv(k, R), repeat_kv(v, R), attn_mask=m),
    "repeat_interleave": lambda q, k, v, m: F.scaled_dot_product_attention(
        q, k.repeat_interleave(R, dim=1), torch.repeat_interleave(v, R, dim=1), attn_mask=m),
    "unsqueeze": lambda q, k, v, m: F.scaled_dot_product_attention(
        q, k.unsqueeze(2).expand(B, G, R, S, D).reshape(B, G * R, S, D),
        v.unsqueeze(2).expand(B, G, R, S, D).reshape(B, G * R, S, D), attn_mask=m),
}


def _inputs(T=1):
    mask = torch.zeros(1, 1, T, S)
    mask[..., S - 2:] = float("-inf")  # a static cache's unused positions
    return torch.randn(B, G * R, T, D), torch.randn(B, G, S, D), torch.randn(B, G, S, D), mask


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_repeated_kv_runs_grouped(spelling):
    fn, args = SPELLINGS[spelling], _inputs(MAX_ROWS + 1)  # more rows than decode: SDPA stays
    want = fn(*args)
    with torch.no_grad():
        got, report = run_compiled(fn, *args)
    assert torch.equal(got, want)  # the same kernel and order of sums on CPU
    assert any("1 SDPA call(s) on repeated K/V heads" in n.line() for n in report.notes)


def _reference(q, k, v, m):
    """SDPA in float64 with the K/V heads repeated: what both kernels approximate."""
    m = m if m is None or m.dtype == torch.bool else m.double()
    r = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(r, 1),
                                          v.double().repeat_interleave(r, 1), attn_mask=m).float()


@pytest.mark.parametrize("mask", ["none", "float", "bool"])
@pytest.mark.parametrize("spelling", ["repeat_kv", "enable_gqa"])
def test_decode_sdpa_runs_on_decode_attention(spelling, mask):
    from moe_compile.kernels.cpu import attention

    q, k, v, m = _inputs(1)
    m = {"none": None, "float": m, "bool": m == 0}[mask]
    fn = SPELLINGS["repeat_kv"] if spelling == "repeat_kv" else (
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True))
    assert attention.install()  # as the op's first call in a process would (that call runs SDPA)
    before = attention.fast_calls()
    with torch.no_grad():
        got, report = run_compiled(fn, q, k, v, m)
    # fp32 with another order of sums than SDPA's (D = 16, S = 7): ~1e-7; a wrong head or mask is O(1)
    torch.testing.assert_close(got, _reference(q, k, v, m), atol=1e-5, rtol=1e-5)
    assert any("1 decode SDPA call(s)" in n.line() for n in report.notes)
    assert attention.fast_calls() > before  # attention.c served it, not the SDPA fallback


def test_causal_and_long_sdpa_are_left_alone():
    q, k, v, _ = _inputs(1)
    with torch.no_grad():
        got, report = run_compiled(lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), q, k, v)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert not any("decode SDPA" in n.line() for n in report.notes)


def test_other_head_orders_are_left_alone():
    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, tiled(k, R), tiled(v, R), attn_mask=m)

    args = _inputs(2)
    with torch.no_grad():
        got, report = run_compiled(fn, *args)
    assert torch.allclose(got, fn(*args), atol=1e-6)  # decode_attention on the repeated heads
    assert not any("repeated K/V" in n.line() for n in report.notes)


def test_training_graphs_keep_their_repeats():
    args = _inputs()
    _, report = run_compiled(SPELLINGS["repeat_kv"], *args)
    assert not any("SDPA" in n.line() for n in report.notes)


def test_hf_static_cache_generate_equal_to_eager():
    """A whole HF model with a static KV cache (its mask is never None, so HF repeats K/V): the
    cache's in-place writes survive the rewrite and greedy tokens equal eager's."""
    pytest.importorskip("transformers")
    import moe_compile

    model = tiny_qwen3_moe_lm()
    ids = torch.randint(1, 128, (1, 5))
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="moe", options={"inner": "eager"})
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    assert any("SDPA call(s) on repeated K/V heads" in n.line() for n in moe_compile.last_report().notes)


def test_decode_attention_with_a_symbolic_cache_length():
    """The next generate call's cache of another length recompiles with S dynamic: still rewritten."""
    from moe_compile.kernels.cpu import attention

    q, k, v, m = _inputs(1)
    for t in (k, v, m):
        torch._dynamo.mark_dynamic(t, 2 if t.dim() == 4 and t is not m else 3)
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)  # noqa: E731
    assert attention.install()
    with torch.no_grad():
        got, report = run_compiled(fn, q, k, v, m)
    torch.testing.assert_close(got, _reference(q, k, v, m), atol=1e-5, rtol=1e-5)  # fp32 rounding, as above
    assert any("1 decode SDPA call(s)" in n.line() for n in report.notes)


def test_decode_attention_output_is_contiguous_as_its_fake_says():
    """torch's CPU SDPA returns a permuted layout for several query rows (32 heads of 128, L = 16);
    a compiled graph checks the op's strides against the fake's contiguous ones."""
    import moe_compile.ops.decode_attention  # noqa: F401  (registers the op)

    q, k, v = torch.randn(1, 32, 16, 128), torch.randn(1, 4, 40, 128), torch.randn(1, 4, 40, 128)
    out = torch.ops.moe_compile.decode_attention(q, k, v, None, 128 ** -0.5)
    assert out.is_contiguous()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5, enable_gqa=True)
    assert torch.allclose(out, want, atol=1e-6)
