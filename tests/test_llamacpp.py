"""moe_compile/models/llamacpp.py: the GGUF written for llama.cpp holds the HF model's own tensors, under
Qwen3-MoE's GGUF names, in llama.cpp's layouts (so llama.cpp runs the same model)."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from moe_compile.models import llamacpp  # noqa: E402


def test_gguf_holds_the_model(tmp_path):
    cfg = transformers.Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = str(tmp_path / "m.gguf")
    llamacpp.write_gguf(model, path)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    F = cfg.moe_intermediate_size
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    assert np.array_equal(tensors["blk.1.ffn_gate_exps.weight"], gate_up[:, :F])  # gate rows first
    assert np.array_equal(tensors["blk.1.ffn_up_exps.weight"], gate_up[:, F:])
    assert np.array_equal(tensors["blk.0.attn_k.weight"], model.model.layers[0].self_attn.k_proj.weight.detach().numpy())
    assert np.array_equal(tensors["output.weight"], model.lm_head.weight.detach().numpy())
    assert len(tensors) == 2 + 2 * 12 + 1  # embeddings, 12 per layer, final norm and lm_head
    fields = {f.name: f for f in reader.fields.values()}
    assert "qwen3moe.expert_used_count" in fields and "tokenizer.ggml.tokens" in fields


def test_gguf_refuses_another_model(tmp_path):
    """llama.cpp's qwen3moe renormalises the top-k weights: a model that does not would be written
    as a different model, so it is refused with the reason."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="norm_topk_prob"):
        llamacpp.write_gguf(model, str(tmp_path / "m.gguf"))
