"""Decode steps (graphs that write a static KV cache in place) compile with Inductor's C++
wrapper (moe_compile/decoding/step.py), unless MOE_COMPILE_CPP_WRAPPER=0 or the user's own
``cpp_wrapper`` option says otherwise."""

import pytest
import torch
import torch.fx as fx

from moe_compile.decoding import step as decode_step
from tests.conftest import tiny_qwen3_moe_lm


class _IndexCopyCache(torch.nn.Module):  # HF StaticLayer.update
    def forward(self, cache, pos, k):
        cache.index_copy_(2, pos, k)
        return cache.sum()


class _SetitemCache(torch.nn.Module):  # gpt-fast's KVCache.update
    def forward(self, cache, pos, k):
        cache[:, :, pos] = k
        return cache.sum()


class _NarrowCopyCache(torch.nn.Module):  # k_cache.narrow(2, start, n).copy_(k)
    def forward(self, cache, k):
        cache.narrow(2, 3, 1).copy_(k)
        return cache.sum()


class _LocalBuffer(torch.nn.Module):  # an index_put_ into a tensor the graph made: no cache
    def forward(self, x, idx):
        out = torch.zeros_like(x)
        out.index_put_((idx,), x[idx], accumulate=True)
        return out


class _WholeCopy(torch.nn.Module):  # a whole-tensor copy_ into an input: not an indexed write
    def forward(self, buf, x):
        buf.copy_(x)
        return buf


_INPUTS = {_IndexCopyCache: lambda: (torch.zeros(1, 2, 8, 4), torch.tensor([3]), torch.ones(1, 2, 1, 4)),
           _SetitemCache: lambda: (torch.zeros(1, 2, 8, 4), torch.tensor([3]), torch.ones(1, 2, 1, 4)),
           _NarrowCopyCache: lambda: (torch.zeros(1, 2, 8, 4), torch.ones(1, 2, 1, 4)),
           _LocalBuffer: lambda: (torch.randn(6, 4), torch.tensor([0, 2, 2])),
           _WholeCopy: lambda: (torch.zeros(3), torch.ones(3))}


def _dynamo_graph(module) -> fx.GraphModule:
    """module's graph as Dynamo gives it to a backend (tensor methods as call_method nodes)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module(), backend=capture, fullgraph=True)(*_INPUTS[module]())
    return graphs[0]


@pytest.mark.parametrize("module", [_IndexCopyCache, _SetitemCache, _NarrowCopyCache])
def test_cache_writes_are_found(module):
    assert decode_step.cache_write(_dynamo_graph(module)) is not None


@pytest.mark.parametrize("module", [_LocalBuffer, _WholeCopy])
def test_other_writes_are_not_cache_writes(module):
    assert decode_step.cache_write(_dynamo_graph(module)) is None


def _patches(module, **env):
    return decode_step.inductor_patches(_dynamo_graph(module), [torch.zeros(2)], dict(env) or None)


CHUNK = {decode_step.MIN_CHUNK_KEY: decode_step.DECODE_MIN_CHUNK}


def test_cpp_wrapper_on_for_inference_cache_writes_only(monkeypatch):
    monkeypatch.delenv(decode_step.MIN_CHUNK_ENV, raising=False)
    with torch.no_grad():
        patches, line = _patches(_IndexCopyCache)
        assert patches == {"cpp_wrapper": True, **CHUNK} and "C++ wrapper" in line and "one thread" in line
        assert _patches(_LocalBuffer) == (None, None)
        # the user's own choice wins, both ways, for each setting
        patches, line = _patches(_IndexCopyCache, cpp_wrapper=False)
        assert patches == {"cpp_wrapper": False, **CHUNK} and "C++ wrapper" not in line
        assert _patches(_IndexCopyCache, cpp_wrapper=False, **{decode_step.MIN_CHUNK_KEY: 64}) == (
            {"cpp_wrapper": False, decode_step.MIN_CHUNK_KEY: 64}, None)
    assert _patches(_IndexCopyCache) == (None, None)  # grad enabled: a training graph


def test_cpp_wrapper_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(decode_step.ENV, "0")
    monkeypatch.setenv(decode_step.MIN_CHUNK_ENV, "512")  # Inductor's own switch: the user's choice
    with torch.no_grad():
        assert _patches(_IndexCopyCache) == (None, None)
    monkeypatch.delenv(decode_step.MIN_CHUNK_ENV)
    with torch.no_grad():
        assert _patches(_IndexCopyCache)[0] == CHUNK


def test_hf_static_cache_decode_with_cpp_wrapper_equal_to_eager():
    """HF generate with a static cache, backend="moe" with Inductor: the decode graph gets the C++
    wrapper (the default) and greedy tokens equal eager's."""
    pytest.importorskip("transformers")
    import moe_compile

    model = tiny_qwen3_moe_lm()
    ids = torch.randint(1, 128, (1, 5))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="moe")
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    notes = [n.line() for n in moe_compile.last_report().notes]
    assert any("C++ wrapper, no Python between kernels" in line for line in notes), notes


def test_cpp_wrapper_left_off_for_a_graph_of_many_cache_writes(monkeypatch):
    """A deep model's step (more cache writes than CPP_WRAPPER_MAX_WRITES) keeps the Python wrapper,
    whose build is seconds where the C++ one's is minutes; the report says why."""
    monkeypatch.delenv(decode_step.MIN_CHUNK_ENV, raising=False)
    monkeypatch.setattr(decode_step, "CPP_WRAPPER_MAX_WRITES", 0)  # the one write of _IndexCopyCache is "many"
    with torch.no_grad():
        patches, line = _patches(_IndexCopyCache)
        assert patches == CHUNK and "Python wrapper: 1 cache writes" in line
        assert _patches(_IndexCopyCache, cpp_wrapper=True)[0]["cpp_wrapper"] is True  # asked for: built anyway
    monkeypatch.setattr(decode_step, "CPP_WRAPPER_MAX_WRITES", 1)
    with torch.no_grad():
        assert _patches(_IndexCopyCache)[0] == {"cpp_wrapper": True, **CHUNK}
