"""HF transformers MoE blocks (tiny random configs, built offline) through backend="moe"."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moe_compile  # noqa: E402
from tests.conftest import TOL, rel_err, run_compiled  # noqa: E402

H = 64


def configs():
    return {
        "mixtral": transformers.MixtralConfig(
            hidden_size=H, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=8, num_experts_per_tok=2, vocab_size=128),
        "qwen2_moe": transformers.Qwen2MoeConfig(
            hidden_size=H, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=96,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            vocab_size=128),
        "deepseek_v3": transformers.DeepseekV3Config(
            hidden_size=H, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
            first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
            num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, vocab_size=128, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
        # PhiMoE: sparsemixer routing, no top-k: the top expert by max(), then the top of the rest,
        # ids concatenated into [T, 2].
        "phimoe": transformers.PhimoeConfig(
            hidden_size=H, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=8, num_experts_per_tok=2, vocab_size=128),
        # GPT-OSS: [E, H, 2F] (transposed) interleaved gate/up with biases, clamped (up + 1) * g *
        # sigmoid(alpha g), router top-k on logits then softmax.  A small clamp limit and a
        # non-default alpha, so that the proof must find both.
        "gpt_oss": transformers.GptOssConfig(
            hidden_size=H, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=8, num_experts_per_tok=2, vocab_size=128, swiglu_limit=0.5,
            swiglu_alpha=1.25),
    }


def hf_block(name, impl, dtype):
    cfg = configs()[name]
    cfg._experts_implementation = impl
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    block = model.model.layers[0].mlp
    if name == "deepseek_v3":  # from_config leaves the router at zeros: give it real scores
        torch.nn.init.normal_(block.gate.weight, std=0.2)
        torch.nn.init.normal_(block.gate.e_score_correction_bias, std=0.01)
    if name == "phimoe":  # a router at from_config's scale sends nearly every token to the same pair
        torch.nn.init.normal_(block.router.weight, std=0.2)
    if name == "gpt_oss":  # router and biases start at zeros: make routing and every bias matter
        with torch.no_grad():
            for p in (block.router.weight, block.experts.gate_up_proj_bias, block.experts.down_proj_bias):
                p.normal_(std=0.2)
    return block


def first(out):
    """The hidden states of a block's output (GPT-OSS's block also returns its router scores)."""
    return out[0] if isinstance(out, tuple) else out


FAMILY = {"grouped_mm": "sorted", "batched_mm": "gathered"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "phimoe"])
def test_hf_block_matches_eager(name, impl, dtype):
    block = hf_block(name, impl, dtype)
    x = torch.randn(2, 7, H, dtype=dtype)
    with torch.no_grad():
        want = first(block(x))
        got, report = run_compiled(block, x)
    assert [r.family for r in report.rewritten] == [FAMILY[impl]]
    assert report.rewritten[0].source.endswith("experts")
    assert rel_err(first(got), want) <= TOL[dtype]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_hf_prefill_runs_on_the_fused_experts_kernel(name, monkeypatch):
    # An inference graph's fp32 prefill of these SwiGLU blocks runs in one call of
    # kernels/cpu/experts.c from its first call on (fused_moe_infer packs the weights at first
    # sight); every call matches the block's own eager output.
    from moe_compile.kernels.cpu import decode as cpu_decode, experts as cpu_experts, prepack as cpu_prepack

    if not cpu_experts.available():
        pytest.skip(f"no fused experts kernel: {cpu_experts.unavailable_reason()}")
    monkeypatch.setattr(cpu_decode, "SMALL_EXPERT_FLOPS", 0)  # experts this tiny would take the skinny kernel
    runs, real = [], cpu_experts.run
    monkeypatch.setattr(cpu_experts, "run", lambda *args, **kw: (runs.append(1), real(*args, **kw))[1])
    cpu_prepack.clear()
    block = hf_block(name, "grouped_mm", torch.float32)
    compiled = torch.compile(block, backend="moe")
    x = torch.randn(2, 40, H)
    with torch.no_grad():
        want = first(block(x))
        for call in range(3):
            assert rel_err(first(compiled(x)), want) <= TOL[torch.float32], f"call {call}"
    cpu_prepack.clear()
    assert len(runs) == 3


def test_gpt_oss_lifted_with_its_biases_clamp_and_alpha():
    report = moe_compile.explain(hf_block("gpt_oss", "grouped_mm", torch.float32), torch.randn(1, 9, H))
    (r,) = report.rewritten
    assert (r.gate_up, r.transposed, r.activation, r.limit, r.alpha) == ("interleaved", True, "gptoss", 0.5, 1.25)
    assert r.biases == ("fc1", "fc2")
    assert "interleaved/gptoss(limit=0.5, alpha=1.25) transposed biases=fc1+fc2" in str(report)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_hf_eager_experts_explained(name):
    # HF's eager experts iterate over a nonzero() result: Dynamo cannot keep that in one graph.
    block = hf_block(name, "eager", torch.float32)
    report = moe_compile.explain(block, torch.randn(1, 5, H))
    assert report.rewritten == []
    assert any("one graph" in s.reason for s in report.skipped)


def test_hf_mixtral_full_model_inductor():
    cfg = configs()["mixtral"]
    cfg._experts_implementation = "grouped_mm"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        got, report = run_compiled(model, ids, inner="inductor")
    assert len(report.rewritten) == 1
    assert rel_err(got.logits, want) <= 1e-4  # fp32 through attention + norm: a few ulps amplify


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_hf_experts_called_with_outside_routing(impl):
    # The experts module alone, routed from logits the caller hands in: the tokens are a graph input
    # the router never reads, and still the one [T, H] input of the region.
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = configs()["mixtral"]
    cfg._experts_implementation = impl
    experts = MixtralExperts(cfg)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)

    def routed(x, logits):
        tw, ids = torch.topk(logits.softmax(-1), 2, dim=-1)  # [T, 2]
        return experts(x, ids, tw)

    x, logits = torch.randn(11, H), torch.randn(11, 8)
    with torch.no_grad():
        want = routed(x, logits)
        got, report = run_compiled(routed, x, logits)
    assert [r.family for r in report.rewritten] == [FAMILY[impl]]
    assert rel_err(got, want) <= TOL[torch.float32]


def test_report_names_each_layers_experts():
    cfg = configs()["mixtral"]
    cfg._experts_implementation = "grouped_mm"
    cfg.num_hidden_layers = 2
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    report = moe_compile.explain(model, torch.randint(0, 128, (1, 6)))
    assert [r.source for r in report.rewritten] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


# More HF MoE architectures, each shrunk from its default config by the same overrides; explain()
# runs the proof (the region against kernels/reference.py on the block's real weights).
SHRINK = dict(hidden_size=H, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16, num_experts=8,
              num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              first_k_dense_replace=0, shared_expert_intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)


# Per-architecture names for the same knobs (and Jamba's layer pattern: experts and attention in
# every layer, no Mamba CUDA kernels).
EXTRA = {
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_layer_start_index=0, moe_num_shared_experts=1),
    "dots1": dict(n_shared_experts=1),
    "jamba": dict(num_experts=8, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=1,
                  attn_layer_offset=0, mamba_d_state=4, mamba_dt_rank=8, use_mamba_kernels=False),
}


@pytest.mark.parametrize("model_type,family", [
    ("qwen3_moe", "sorted"), ("qwen3_next", "sorted"), ("olmoe", "sorted"), ("flex_olmo", "sorted"),
    ("granitemoe", "sorted"), ("deepseek_v2", "sorted"), ("glm4_moe", "sorted"), ("hunyuan_v1_moe", "sorted"),
    ("minimax", "sorted"), ("aria_text", "sorted"), ("ernie4_5_moe", "sorted"), ("dots1", "sorted"),
    ("jamba", "sorted"), ("llama4_text", "dense")])
def test_more_hf_architectures_are_found(model_type, family):
    cfg = transformers.AutoConfig.for_model(model_type, **{**SHRINK, **EXTRA.get(model_type, {})})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    block = next(m for n, m in model.named_modules() if hasattr(m, "experts") and not n.endswith("experts"))
    with torch.no_grad():
        for p in block.parameters():  # some routers start at zeros: every token would tie
            p.normal_(std=0.1)
    x = torch.randn(1, 7, H)
    with torch.no_grad():
        want = first(block(x))
        got, report = run_compiled(block, x)
    assert [r.family for r in report.rewritten] == [family], report
    assert rel_err(first(got), want) <= TOL[torch.float32]
