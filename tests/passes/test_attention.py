"""passes/attention.py: SDPA on K/V heads repeated in the graph runs with enable_gqa=True on the
K/V as they are — equal to eager — and other repeats (another head order) are left alone."""

import pytest
import torch
import torch.nn.functional as F

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
    fn, args = SPELLINGS[spelling], _inputs()
    want = fn(*args)
    with torch.no_grad():
        got, report = run_compiled(fn, *args)
    assert torch.equal(got, want)  # the same kernel and order of sums on CPU
    assert any("1 SDPA call(s) on repeated K/V heads" in n.line() for n in report.notes)


def test_other_head_orders_are_left_alone():
    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, tiled(k, R), tiled(v, R), attn_mask=m)

    args = _inputs(2)
    with torch.no_grad():
        got, report = run_compiled(fn, *args)
    assert torch.allclose(got, fn(*args))
    assert not any("SDPA" in n.line() for n in report.notes)


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
