"""DeepSeek-V4 (HF transformers' ``deepseek_v4``) through backend="moe": a 3-layer tiny model with
hash-routed layers (expert ids read from a token-id table, ``tid2eid[input_ids]``, weights the
router's sqrt-softplus scores at those ids) and a top-k routed layer, each with a shared expert and
clamped SwiGLU experts; every MoE layer rewritten, eager's logits, and an 8-step training run equal
to eager's."""


import pytest
import torch

transformers = pytest.importorskip("transformers")
if "deepseek_v4" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)

from tests.conftest import rel_err, run_compiled  # noqa: E402
from tests.test_hf_causal_lm import train  # noqa: E402  (the same SGD run, lr 0.02, as the causal-LM test)

E = 8
LAYERS = ("hash_moe", "hash_moe", "moe")
# A small clamp limit so that the clamped SwiGLU matters on these activations; each attention kind
# of V4 once: sliding window, compressed sparse (with its indexer) and heavily compressed.
CONFIG = dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(LAYERS), num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, q_lora_rank=32, vocab_size=128, n_routed_experts=E,
              num_experts_per_tok=2, mlp_layer_types=list(LAYERS), hc_mult=2, hc_sinkhorn_iters=3, o_groups=2,
              o_lora_rank=32, index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8,
              max_position_embeddings=64, swiglu_limit=0.5,
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
              compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4})


def tiny_v4():
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("deepseek_v4", **CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # from_config leaves the hash tables at expert 0 and the score bias at zeros
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.randint(0, E, buf.shape))
            elif name.endswith("e_score_correction_bias"):
                buf.normal_(std=0.05)
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(std=0.2)  # routers at from_config's scale give nearly equal scores
    return model


def assert_every_layer_rewritten(report):
    assert sorted(r.source for r in report.rewritten) == [f"model.layers.{i}.mlp.experts" for i in range(len(LAYERS))], \
        report
    assert all(r.limit == 0.5 for r in report.rewritten), report  # the clamp was proven, not dropped


# fp32 logits after 3 layers: the fused op sums the K contributions in another order than HF's
# experts (~1 ulp per MoE layer), which the hyper-connections' Sinkhorn mixing, attention and the
# LM head carry a few-fold (measured 4e-7); a wrong expert or weight moves the logits by ~1e-1.
LOGIT_TOL = 1e-5


def test_deepseek_v4_every_moe_layer_rewritten_hash_layers_included():
    model = tiny_v4()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        got, report = run_compiled(model, ids)
    assert_every_layer_rewritten(report)
    assert rel_err(got.logits, want) <= LOGIT_TOL


STEPS = 8
# Plain SGD at a small rate (see tests/test_hf_causal_lm.py): each step moves a parameter by lr times
# its gradient, so the final weights differ from eager's by what the gradients differ (fp32
# summation order, ~1e-7 relative per step); Adam would divide near-zero gradients by their own
# magnitude and turn rounding noise into lr-sized steps.
LOSS_TOL = 1e-5  # relative, per step (measured 0: the losses agree to the last bit here)
# Relative to each parameter's max magnitude.  The hyper-connections' bases start at zeros, so their
# magnitude after 8 steps is the size of their updates alone and summation-order noise in the
# gradients shows there at ~2e-5 (measured); every other parameter agrees to < 1e-5.
PARAM_TOL = 1e-4


def test_deepseek_v4_training_run_equals_eager():
    model = tiny_v4()
    batches = [torch.randint(0, 128, (2, 9)) for _ in range(STEPS)]
    want_losses, want_params, _ = train(model, batches, compiled=False)
    got_losses, got_params, reports = train(model, batches, compiled=True)
    assert_every_layer_rewritten(reports[0])  # the first call compiles the training graph
    assert all(r.graphs == 0 for r in reports[1:]), "a later step recompiled"
    start = dict(model.named_parameters())
    experts = [n for n in want_params if ".experts." in n]
    routers = [n for n in want_params if n.endswith("mlp.gate.weight")]
    assert len(experts) == 2 * len(LAYERS) and len(routers) == len(LAYERS)
    assert all(rel_err(want_params[n].detach(), start[n].detach()) > 1e-3 for n in experts), \
        "the run must move the experts' weights"
    assert all(rel_err(want_params[n].detach(), start[n].detach()) > 1e-5 for n in routers), \
        "the routers (hash layers' scores included) must get gradients"
    for step, (got, want) in enumerate(zip(got_losses, want_losses)):
        assert abs(got - want) <= LOSS_TOL * abs(want), f"step {step}: {got} vs {want}"
    for name, want in want_params.items():
        assert rel_err(got_params[name].detach(), want.detach()) <= PARAM_TOL, name
