"""HF Mixtral / Qwen3-MoE / DeepSeek-V3 tiny blocks through backend="moe" with each CPU variant.

The real kernels (kernels/cpu/qdecode.py for T <= 16 rows, qgemm.py above): a variant this
checkout's kernels run natively is rewritten, runs, stays within its floor and is named by
explain(); one they cannot run raises the documented error.  Floors: the block output's SQNR
against its eager fp32 output.  HF initialises the experts N(0, 0.02) (Gaussian), so the floors
are the Gaussian-weight MoE numbers of docs/quantization.md less 2-3 dB (tiny H = 64 rows).
"""

import pytest
import torch

import moe_compile
from moe_compile.kernels.cpu import quant as cpu_quant
from moe_compile.quant import FORMATS, selection
from moe_compile.quant.int8 import sqnr_db

transformers = pytest.importorskip("transformers")

H = 64
FLOOR_DB = {"w16": 45, "w8-int": 36, "a8w8-int": 28, "mxfp8": 23, "a8w8-fp8": 21, "w4-int": 13, "a8w4-int": 11,
            "mxfp4": 10}


def configs():
    return {
        "mixtral": transformers.MixtralConfig(
            hidden_size=H, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=8, num_experts_per_tok=2, vocab_size=128),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            hidden_size=H, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=128, head_dim=16),
        "deepseek_v3": transformers.DeepseekV3Config(
            hidden_size=H, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
            first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
            num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, vocab_size=128, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    }


def block_of(name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs()[name]).eval()
    block = model.model.layers[0].mlp
    if name == "deepseek_v3":  # from_config leaves the router at zeros: give it real scores
        torch.nn.init.normal_(block.gate.weight, std=0.2)
    return block


def out(o):
    return o[0] if isinstance(o, tuple) else o


def native_everywhere(fmt, block_name):
    cfg = configs()[block_name]
    F = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    E = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None) or cfg.num_local_experts
    return all(cpu_quant.kernel_for(fmt, reg, E, H, F)[0] is not None for reg in ("decode", "prefill"))


@pytest.fixture(autouse=True)
def fresh():
    cpu_quant.clear()
    torch._dynamo.reset()
    yield
    cpu_quant.clear()


# In the default run: one integer, one 4-bit and the variant no CPU kernel runs (its error), on
# Mixtral; every other (model, variant) pair is slow (~10-16 s each on the 2-core VM).
DEFAULT_CASES = {("mixtral", "a8w8-int"), ("mixtral", "w4-int"), ("mixtral", "a8w8-fp8"), ("qwen3_moe", "mxfp4")}
CASES = [pytest.param(n, f, marks=() if (n, f) in DEFAULT_CASES else pytest.mark.slow)
         for n in ("mixtral", "qwen3_moe", "deepseek_v3") for f in FORMATS]


@pytest.mark.parametrize("name,fmt", CASES)
def test_each_cpu_variant(name, fmt):
    block = block_of(name)
    if not native_everywhere(fmt, name):
        with pytest.raises(Exception, match=rf"quant='{fmt}'.*no native kernel.*variants it runs"), torch.no_grad():
            torch.compile(block, backend="moe", options={"quant": fmt, "inner": "eager"})(torch.randn(1, 3, H))
        return
    compiled = torch.compile(block, backend="moe", options={"quant": fmt, "inner": "eager"})
    with torch.no_grad():
        for T in (5, 40):  # 5 tokens: decode (qdecode or qgemm), 40: prefill (qgemm)
            x = torch.randn(1, T, H)
            assert sqnr_db(out(block(x)), out(compiled(x))) >= FLOOR_DB[fmt], T
    report = moe_compile.explain(block, torch.randn(1, 5, H), quant=fmt)
    assert [r.variant for r in report.rewritten] == [fmt] and f"variant={fmt}" in str(report)


@pytest.mark.parametrize("name", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow),
                                  pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_auto_picks_one_and_explains_it(name):
    block = block_of(name)
    report = moe_compile.explain(block, torch.randn(1, 5, H), quant="auto", accuracy_db=20)
    (r,) = report.rewritten
    sel = selection.recorded(r.quant_tag)["decode"]
    assert sel.chosen in ("none", *FORMATS)
    assert f"chose {sel.chosen}" in str(report)
    chosen = next(c for c in sel.candidates if c.fmt == sel.chosen)
    # the fastest inside the budget, or a more accurate one within selection.TIE_MARGIN of its time
    inside = [c for c in sel.candidates if c.time_ms is not None and c.sqnr_db >= 20]
    fastest = min(c.time_ms for c in inside) if inside else None
    assert chosen.sqnr_db >= 20 and (fastest is None or chosen.time_ms is None
                                     or chosen.time_ms <= fastest * (1 + selection.TIE_MARGIN) + 1e-9)
