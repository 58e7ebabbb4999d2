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
    model = _model()
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    want = moe_compile.generate(model, ids, 5)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="moe", options={"inner": "eager"})
    got = moe_compile.generate(model, ids, 5)
    assert torch.equal(got, want)
    assert moe_compile.last_report().rewritten  # the experts ran fused


def test_bad_input_says_what_to_change():
    model = _model()
    with pytest.raises(ValueError, match=r"\[batch, seq\] integer"):
        moe_compile.generate(model, torch.ones(5), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        moe_compile.generate(model, torch.ones(1, 5, dtype=torch.int64), 0)
