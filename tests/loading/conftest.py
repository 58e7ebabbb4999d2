"""Tiny Qwen3-MoE checkpoints for the loaders: shapes the packed kernels take whole (H and F
multiples of 128, so the rows16 panels serve decode), several layers, every layer MoE."""

import pytest
import torch

transformers = pytest.importorskip("transformers")


def tiny_config(**over):
    cfg = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2,
               norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=128)
    return transformers.Qwen3MoeConfig(**{**cfg, **over})


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config()).eval()
    with torch.no_grad():  # routers with real scores (from_config's are near zero: ties pick experts at random)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


@pytest.fixture(autouse=True)
def _exact_prefill(monkeypatch):
    # fp32 prefill GEMMs, so a compiled model is compared with eager at fp32's tolerance (the bf16
    # prefill policy is dense.prefill_dtype's, tested with the kernels)
    monkeypatch.setenv("MOE_COMPILE_PREFILL_BF16", "0")
