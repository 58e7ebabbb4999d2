"""moe_compile.generate: the same greedy tokens as HF generate with a static cache."""

import pytest
import torch

import moe_compile
from tests.conftest import tiny_qwen3_moe_lm

pytest.importorskip("transformers")


def _model(eos: int | None = None):
    return tiny_qwen3_moe_lm(eos_token_id=eos, pad_token_id=0)


def _hf(model, ids, n, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static", **kw)


def test_eager_tokens_equal_hf_generate_batch_of_two():
    model = _model()
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(moe_compile.generate(model, ids, 6), _hf(model, ids, 6))


def test_stops_and_pads_like_hf_generate_at_eos():
    model = _model()
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    free = moe_compile.generate(model, ids, 6, stop_at_eos=False)
    eos = int(free[0, 7])  # row 0's third new token: row 0 stops there, row 1 goes on (or stops too)
    got = moe_compile.generate(model, ids, 6, eos_token_id=eos, pad_token_id=0)
    want = _hf(model, ids, 6, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want)
    assert got[0, 7] == eos and (got.shape[1] == 8 or (got[0, 8:] == 0).all())


def test_compiled_with_moe_backend_equal_to_eager_tokens():
    # 18 tokens: the warm-up steps with every guard, steps that skip guard evaluation and a
    # checking step (decoding.CHECK_EVERY) all run; every one must give eager's token
    model = _model()
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    n = moe_compile.decoding.greedy.CHECK_EVERY + 2
    want = moe_compile.generate(model, ids, n, stop_at_eos=False)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="moe", options={"inner": "eager"})
    got = moe_compile.generate(model, ids, n, stop_at_eos=False)
    assert torch.equal(got, want)
    assert moe_compile.last_report().rewritten  # the experts ran fused
    assert torch.equal(moe_compile.generate(model, ids, n, stop_at_eos=False, check_guards=True), want)


def test_a_second_call_compiles_no_new_graph():
    # the cache is allocated before the first prefill: allocated lazily inside it, the prefill's
    # graph guarded on is_initialized == False and the next call (the cache reset, still
    # allocated) compiled the prefill a second time
    model = _model()
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(5))
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=counting)
    first = moe_compile.generate(model, ids, 4, stop_at_eos=False)
    compiled = len(graphs)
    assert compiled >= 2  # a prefill and a decode graph
    assert torch.equal(moe_compile.generate(model, ids, 4, stop_at_eos=False), first)
    assert len(graphs) == compiled
    # another length within the same cache (decoding.cache_length): the same graphs, and the
    # longer run's first tokens are the shorter one's
    longer = moe_compile.generate(model, ids, 9, stop_at_eos=False)
    assert len(graphs) == compiled and torch.equal(longer[:, :first.shape[1]], first)


def test_cache_length_is_rounded_up_and_held_to_the_models_positions():
    step = moe_compile.decoding.greedy.CACHE_STEP
    assert moe_compile.decoding.greedy.cache_length(9) == step
    assert moe_compile.decoding.greedy.cache_length(step + 1) == 2 * step
    assert moe_compile.decoding.greedy.cache_length(9, positions=64) == 64  # a model of 64 positions
    assert moe_compile.decoding.greedy.cache_length(100, positions=64) == step  # past them: the model decides


class _Drifting(torch.nn.Module):
    """An LM whose Python state changes during generation: after `turn` calls its logits flip, a
    branch Dynamo guards on (a graph compiled before the turn no longer fits after it)."""

    def __init__(self, lm, turn: int):
        super().__init__()
        self.lm, self.config, self.turn, self.calls = lm, lm.config, turn, 0

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=None):
        self.calls += 1
        out = self.lm(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache,
                      logits_to_keep=logits_to_keep)
        if self.calls > self.turn:
            out.logits = out.logits.flip(-1)
        return out


def test_python_state_changing_during_generation_is_refused_not_decoded_on():
    # the flip comes after the warm-up steps: steps that skip guard evaluation would run the
    # unflipped graph, so the next checking step must raise and say what to pass instead
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    model = _Drifting(_model(), turn=moe_compile.decoding.greedy.WARMUP_STEPS + 3)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager")
    with pytest.raises(RuntimeError, match="check_guards=True"):
        moe_compile.generate(model, ids, moe_compile.decoding.greedy.CHECK_EVERY + 1, stop_at_eos=False)
    model.calls = 0  # with every guard checked the same model decodes, flipping where eager does
    got = moe_compile.generate(model, ids, moe_compile.decoding.greedy.CHECK_EVERY + 1, stop_at_eos=False, check_guards=True)
    eager = _Drifting(model.lm, model.turn)
    assert torch.equal(got, moe_compile.generate(eager, ids, moe_compile.decoding.greedy.CHECK_EVERY + 1, stop_at_eos=False))


def test_bad_input_says_what_to_change():
    model = _model()
    with pytest.raises(ValueError, match=r"\[batch, seq\] integer"):
        moe_compile.generate(model, torch.ones(5), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        moe_compile.generate(model, torch.ones(1, 5, dtype=torch.int64), 0)
