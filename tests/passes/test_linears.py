"""passes/linears.py: a whole HF MoE causal LM's other linears (attention, lm_head) on
moe_compile::dense_linear, equal to eager at fp32, in the format asked for with quant_dense, and
never in a graph that will be differentiated."""

import pytest
import torch

from moe_compile import MoEConfig
from moe_compile.kernels.cpu import dense
from moe_compile.passes import linears
from moe_compile.quant.int8 import sqnr_db
from tests.conftest import rel_err, run_compiled

transformers = pytest.importorskip("transformers")

LAYERS = 2
# q, k, v, o and the router per layer, then lm_head: the linears of a Qwen3-MoE graph
LINEARS = 5 * LAYERS + 1


def _model():
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _logits(model, ids, **options):
    with torch.no_grad():
        out, report = run_compiled(lambda i: model(i).logits, ids, **options)
    return out, report


def _dense_note(report) -> str:
    notes = [n.line() for n in report.notes if "dense linears" in n.line()]
    assert len(notes) == 1, [n.line() for n in report.notes]
    return notes[0]


def test_fp32_model_equal_to_eager():
    """fp32 weights in their own dtype: the same products summed in another order."""
    model, ids = _model(), torch.randint(0, 128, (1, 3))
    with torch.no_grad():
        want = model(ids).logits
    got, report = _logits(model, ids)
    assert rel_err(got, want) < 2e-5
    assert f"dense linears: {LINEARS} on moe_compile's kernels ({LINEARS} in their own dtype" in _dense_note(report)


@pytest.mark.skipif(dense.unavailable_reason("w8-int") is not None, reason="no w8-int kernel here")
def test_quant_dense_reads_the_format_and_keeps_routers():
    model, ids = _model(), torch.randint(0, 128, (1, 3))
    with torch.no_grad():
        want = model(ids).logits
    got, report = _logits(model, ids, quant_dense="w8-int")
    note = _dense_note(report)
    assert f"{LINEARS - LAYERS} in w8-int" in note and f"{LAYERS} router(s) among them kept" in note
    # 8-bit weights with a scale per 32: ~40 dB a matmul; through 2 layers and lm_head, > 25 dB.
    # Not equal either: a pass that ignored quant_dense would give the fp32 logits exactly.
    assert 25 < sqnr_db(want, got) < 80


@pytest.mark.skipif(dense.unavailable_reason("a8w8-int") is not None, reason="no a8w8-int kernel here")
@pytest.mark.parametrize("env, group", [(None, 32), ("none", None), ("64", 64)])
def test_a8w8_dense_linears_pack_group_wise_unless_told(monkeypatch, env, group):
    """Dense a8w8-int weights pack q8_0's group-wise form by default (the experts stay per channel);
    MOE_COMPILE_A8W8_GROUP, when set, decides for both."""
    from moe_compile.quant import a8w8_int

    if env is None:
        monkeypatch.delenv(a8w8_int.GROUP_ENV, raising=False)
    else:
        monkeypatch.setenv(a8w8_int.GROUP_ENV, env)
    dense.clear()
    model, ids = _model(), torch.randint(0, 128, (1, 3))
    with torch.no_grad():
        want = model(ids).logits
    got, report = _logits(model, ids, quant_dense="a8w8-int")
    weights = {id(p) for name, p in model.named_parameters() if "proj" in name and "experts" not in name
               and "gate" not in name or name.startswith("lm_head")}
    packs = [p.qweight for key, p in dense._PACKS.items() if key[0] in weights]
    assert len(packs) == LINEARS - LAYERS  # q, k, v, o per layer and lm_head; routers keep fp32
    assert all(q.fmt == "a8w8-int" and q.grouped_activations == (group is not None) for q in packs)
    if group is not None:
        # one fp16 scale per group of `group` along K (64 here)
        assert all(q.scale.dtype == torch.float16 and q.scale.shape[-1] == 64 // group for q in packs)
        assert f"{LINEARS - LAYERS} in a8w8-int group-wise ({group})" in _dense_note(report)
    # int8 activations and weights: ~35-40 dB a matmul; through 2 layers and lm_head, > 20 dB,
    # and never the fp32 logits exactly (the format is read)
    assert 20 < sqnr_db(want, got) < 80


def test_training_graphs_keep_their_linears():
    model, ids = _model(), torch.randint(0, 128, (1, 3))
    _, report = run_compiled(lambda i: model(i).logits, ids)  # grad mode on: a graph to differentiate
    assert not [n for n in report.notes if "dense linears" in n.line()]


def test_switch_off(monkeypatch):
    monkeypatch.setenv(linears.ENV, "0")
    model, ids = _model(), torch.randint(0, 128, (1, 3))
    _, report = _logits(model, ids)
    assert not [n for n in report.notes if "dense linears" in n.line()]


def test_config_quant_dense():
    assert MoEConfig().dense_format() == "none"  # never quantized unless asked
    assert MoEConfig(quant="w4-int", quant_dense="same").dense_format() == "w4-int"
    assert MoEConfig(quant="w4-int", quant_dense="w8-int").dense_format() == "w8-int"
    with pytest.raises(ValueError, match="quant_dense='q4'.*choose one of"):
        MoEConfig(quant_dense="q4")
    with pytest.raises(ValueError, match="name the dense format"):
        MoEConfig(quant="auto", quant_dense="same")
