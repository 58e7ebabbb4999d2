"""Every MoE model type the installed transformers ships, as a tiny random model, and what
backend="moe" is expected to do with it (tests/test_hf_all_moe.py; docs/models.md is generated from
``OUTCOMES``: ``python -m tests.hf_moe_models > docs/models.md``).

The types are found in the installed package, not listed by hand: a config class with an experts
count (``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``, ...), or a
composite config (vision-language, omni) with such a sub-config.  A new release's new types are
therefore tested by themselves: one that is not in ``OUTCOMES`` gets the default tiny config and
either passes (every MoE layer rewritten, eager's logits) or fails with a message saying to add it.

Composite types run through their text stack (``via``); encoder-decoder types through both stacks.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts", "n_experts")

E, K = 4, 2  # experts and top-k of every tiny config
H = 64
LAYERS = 2

# Every config gets these (names a config does not use are ignored by it).
BASE = dict(hidden_size=H, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
            num_experts=E, num_local_experts=E, n_routed_experts=E, moe_num_experts=E, num_experts_per_tok=K,
            moe_topk=K, moe_k=K, top_k=K, n_group=2, topk_group=1, first_k_dense_replace=0, mlp_only_layers=[],
            decoder_sparse_step=1, moe_layer_start_index=0, moe_layer_freq=1, n_shared_experts=1,
            shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, sliding_window=16, tie_word_embeddings=False)
# Latent attention: as many kv heads as heads, the head dims its own (None: the BASE knob is not passed).
_MLA = dict(num_key_value_heads=4, head_dim=None)
# Encoder-decoder: one layer per stack (an MoE layer in each), the slowest of the table at two.
_SEQ2SEQ = dict(d_model=H, d_ff=64, d_kv=16, num_heads=4, num_layers=1, num_decoder_layers=1,
                encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                encoder_ffn_dim=64, decoder_ffn_dim=64, num_sparse_encoder_layers=1,
                num_sparse_decoder_layers=1, encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=64)

# Per type: its own names for the knobs above, and what its tiny config needs on top.
EXTRA: dict[str, dict] = {
    **{t: dict(layer_types=["linear_attention", "full_attention"])  # linear-attention hybrids: one attention layer
       for t in ("qwen3_next", "qwen3_5_moe_text", "granitemoehybrid", "bailing_hybrid")},
    **{t: dict(mlp_layer_types=["sparse", "sparse"]) for t in ("beam", "step3p5", "deepseek_ocr2_text")},
    "doge": dict(is_moe=True), "gemma4_text": dict(enable_moe_block=True, top_k_experts=K),
    "dots3_note_text": dict(num_key_value_heads=4),
    "ernie4_5_vl_moe_text": dict(moe_intermediate_size=[32, 32], moe_num_shared_experts=1,
                                 mlp_layer_types=["sparse", "sparse"],
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2])),
    "glm5_next_text": dict(num_key_value_heads=4, head_dim=None, qk_rope_head_dim=0, qk_nope_head_dim=16,
                           v_head_dim=16, index_topk=4, index_kpool=2, index_head_dim=16, index_n_heads=2,
                           linear_head_dim=16, linear_num_heads=4, hc_mult=2, hc_sinkhorn_iters=2,
                           mlp_layer_types=["sparse", "sparse"], layer_types=["linear_attention", "indexed_attention"]),
    "hy_v4_vl_text": dict(_MLA, index_topk=4, index_head_dim=16, index_n_heads=2, hc_mult=2,
                          mlp_layer_types=["sparse", "sparse"],
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])),
    "kimi_linear": dict(_MLA, linear_head_dim=16, linear_num_heads=4, mlp_layer_types=["sparse", "sparse"],
                        layer_types=["linear_attention", "full_attention"]),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention"], hc_count=2, hc_lowrank=16,
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4),
    "kolibri1_1": dict(layer_types=["sliding_attention", "indexed_attention"], index_num_heads=2, index_topk=8,
                       index_pool_size=16, index_compression=4, index_num_local_tokens=4, index_num_sink_tokens=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    # One layer of two attention sublayers (num_hidden_layers is twice num_layers).
    "longcat_flash": dict(_MLA, head_dim=8, ffn_hidden_size=64, expert_ffn_hidden_size=32,
                          moe_topk=K, zero_expert_num=2),
    "minimax_m3_vl_text": dict(moe_layer_freq=None, rotary_dim=8, index_n_heads=2, index_head_dim=16,
                               index_block_size=4, index_topk_blocks=2, dense_intermediate_size=64,
                               shared_intermediate_size=32),
    # One block: a graph break in its attention (a .tolist()) leaves the MoE in a resumed frame that
    # every block would share, one rewrite for all.
    "dots3_note_vision_encoder": dict(num_hidden_layers=1, pyramid_num_routed=[E], patch_size=2, adapter_in_dim=H,
                                      adapter_out_dim=H),
    "glm4v_moe_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                                mrope_section=[2, 1, 1])),
    "dbrx": dict(d_model=H, n_heads=4, n_layers=LAYERS, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=E, moe_top_k=K)),
    "zaya": dict(num_experts_per_tok=1), "sarvam_mla": _MLA,
    "diffusion_gemma_text": dict(enable_moe_block=True, top_k_experts=K),
    "axk1": _MLA, "axk2": _MLA, "bailing_hybrid": dict(_MLA, layer_types=["linear_attention", "full_attention"]),
    "switch_transformers": _SEQ2SEQ, "nllb-moe": _SEQ2SEQ, "mistral4": _MLA, "mistral_large4_text": _MLA,
    "deepseek_v2": _MLA, "deepseek_v3": _MLA, "deepseek_v32": _MLA, "glm4_moe_lite": _MLA, "glm_moe_dsa": _MLA,
    "jamba": dict(expert_layer_period=1, expert_layer_offset=0, attn_layer_period=1, attn_layer_offset=0,
                  mamba_d_state=4, mamba_dt_rank=8, use_mamba_kernels=False),
    "llama4_text": dict(intermediate_size=32, intermediate_size_mlp=64, moe_layers=[0, 1], num_experts_per_tok=1),
    "hunyuan_v1_moe": dict(num_shared_expert=1),
    "aria_text": dict(moe_num_shared_experts=1),
    "ernie4_5_moe": dict(moe_num_shared_experts=1),
    "deepseek_v4": dict(num_key_value_heads=1, head_dim=32, q_lora_rank=32, mlp_layer_types=["hash_moe", "moe"],
                        hc_mult=2, hc_sinkhorn_iters=2, o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16,
                        index_topk=8, sliding_window=8, swiglu_limit=0.5,
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}),
}

REWRITTEN = "rewritten"


@dataclasses.dataclass(frozen=True)
class Refused:
    """A type whose MoE layers are left unfused: ``match`` is part of the report's skip reason,
    ``why`` says it for docs/models.md."""

    match: str
    why: str


@dataclasses.dataclass(frozen=True)
class NoTinyModel:
    """A type this table has no working tiny config for yet (the test is an expected failure)."""

    why: str


# type -> REWRITTEN, "via <text type>" (a composite type: its text stack is the tested type),
# Refused(...) or NoTinyModel(...).
OUTCOMES: dict[str, object] = {
    "afmoe": REWRITTEN, "aria_text": REWRITTEN, "cohere2_moe": REWRITTEN, "deepseek_v2": REWRITTEN,
    "deepseek_v3": REWRITTEN, "deepseek_v32": REWRITTEN, "deepseek_v4": REWRITTEN, "dots1": REWRITTEN,
    "ernie4_5_moe": REWRITTEN, "exaone_moe": REWRITTEN, "flex_olmo": REWRITTEN, "flint": REWRITTEN,
    "glm4_moe": REWRITTEN, "glm4_moe_lite": REWRITTEN, "glm_moe_dsa": REWRITTEN, "gpt_oss": REWRITTEN,
    "granitemoe": REWRITTEN, "granitemoe_swa": REWRITTEN, "granitemoehybrid": REWRITTEN,
    "granitemoeshared": REWRITTEN, "hunyuan_v1_moe": REWRITTEN, "hy_v3": REWRITTEN, "jamba": REWRITTEN,
    "kolibri1": REWRITTEN, "laguna": REWRITTEN, "lara_mini": REWRITTEN, "llama4_text": REWRITTEN,
    "mellum": REWRITTEN, "mimo_v2_flash": REWRITTEN, "minicpm5_moe": REWRITTEN, "minimax": REWRITTEN,
    "minimax_m2": REWRITTEN, "mixtral": REWRITTEN, "olmoe": REWRITTEN, "param2moe": REWRITTEN, "phimoe": REWRITTEN,
    "qwen2_moe": REWRITTEN, "qwen3_moe": REWRITTEN,
    "axk1": REWRITTEN, "axk2": REWRITTEN, "bailing_hybrid": REWRITTEN, "dots3_note_text": REWRITTEN,
    "glm4v_moe_text": REWRITTEN, "hy_v4": REWRITTEN, "mistral4": REWRITTEN, "mistral_large4_text": REWRITTEN,
    "qwen3_5_moe_text": REWRITTEN, "qwen3_next": REWRITTEN, "qwen3_vl_moe_text": REWRITTEN, "sarvam_moe": REWRITTEN,
    "sarvam_mla": REWRITTEN, "solar_open": REWRITTEN, "zaya": REWRITTEN,
    # Refused, with the reason the report gives.
    "dbrx": Refused("leave this graph with no experts", "DBRX ships only the per-expert loop over a nonzero() "
                    "result: Dynamo splits the block between the router and the experts"),
    "doge": Refused("routes no MoE this pass recognised", "Doge's cross-domain MoE picks expert vectors by a top-k "
                    "over retrieval scores and adds them to a dense MLP: not token -> experts FFNs"),
    "nllb-moe": Refused("routes no MoE this pass recognised", "top-2 routing with an expert capacity (tokens over "
                        "it dropped), experts applied per boolean mask"),
    "gemma4_text": Refused("read tensors other than one [T, H] token input", "the experts read their own, separately "
                           "normalised copy of the hidden states besides the router's"),
    "diffusion_gemma_text": Refused("read tensors other than one [T, H] token input", "the experts read their own, "
                                    "separately normalised copy of the hidden states besides the router's"),
    "ergo": Refused("no expert FFN", "its experts' FFN is not FC1 -> activation -> FC2 as the op computes it"),
    "nemotron_h": Refused("no expert FFN", "non-gated experts (up -> relu² -> down, no gate projection): the op "
                          "computes gated (SwiGLU-style) experts"),
    "inkling_text": Refused("expected one stacked expert FFN", "two stacked expert FFNs under one top-k"),
    "inkling2_text": Refused("could not prove", "its experts compute an FFN none of the op's hypotheses reproduce"),
    "inkling2_loop_text": Refused("could not prove",
                                  "its experts compute an FFN none of the op's hypotheses reproduce"),
    "jetmoe": Refused("running the region on synthetic routing failed",
                      "its grouped experts assert the split sizes sum to this batch's T*K, which synthetic routing "
                      "cannot keep"),
    "muse_spark_text": Refused("read tensors other than one [T, H] token input",
                               "norms inside the experts module (pre/post expert norms) read other tensors"),
    "openai_privacy_filter": Refused("leave this graph with no experts",
                                     "Dynamo splits the block between the router and the experts"),
    "beam": REWRITTEN, "step3p5": REWRITTEN, "deepseek_ocr2_text": REWRITTEN, "unlimited_ocr_text": REWRITTEN,
    "qwen3_omni_moe_text": REWRITTEN, "qwen3_omni_moe_talker_text": REWRITTEN, "glm5_next_text": REWRITTEN,
    "hy_v4_vl_text": REWRITTEN, "kimi_linear": REWRITTEN, "qwen4_exp_text": REWRITTEN, "kolibri1_1": REWRITTEN,
    "lfm2_moe": REWRITTEN, "minimax_m3_vl_text": REWRITTEN,
    "dots3_note_vision_encoder": REWRITTEN,  # the vision tower's own MoE blocks, on image patches
    "longcat_flash": Refused("zero-compute / identity experts", "its router also picks zero-compute experts, "
                             "whose slots add weight * x (an identity): the op computes routed experts only"),
    "ernie4_5_vl_moe_text": Refused("read tensors other than one [T, H] token input",
                                    "text and image tokens go to separate experts through boolean-mask gathers "
                                    "whose token count the graph reads from the gathered flat tensor (a batch "
                                    "of text tokens only is rewritten)"),
    "switch_transformers": Refused("routes no MoE this pass recognised",
                                   "top-1 experts with an expert capacity, applied per boolean mask"),
    "aria": "via aria_text",
    "deepseek_ocr2": "via deepseek_ocr2_text",
    "diffusion_gemma": "via diffusion_gemma_text",
    "dots3_note": "via dots3_note_text",
    "ernie4_5_vl_moe": "via ernie4_5_vl_moe_text",
    "gemma4": "via gemma4_text",
    "glm4v_moe": "via glm4v_moe_text",
    "glm5_next": "via glm5_next_text",
    "hy_v4_vl": "via hy_v4_vl_text",
    "inkling2": "via inkling2_text",
    "inkling2_loop": "via inkling2_loop_text",
    "inkling_mm_model": "via inkling_text",
    "llama4": "via llama4_text",
    "minimax_m3_vl": "via minimax_m3_vl_text",
    "mistral_large4": "via mistral_large4_text",
    "muse_spark": "via muse_spark_text",
    "qwen3_5_moe": "via qwen3_5_moe_text",
    "qwen3_omni_moe": "via qwen3_omni_moe_text",
    "qwen3_omni_moe_thinker": "via qwen3_omni_moe_text",
    "qwen3_vl_moe": "via qwen3_vl_moe_text",
    "qwen4_exp": "via qwen4_exp_text",
    "step3p7": "via step3p5",
    "unlimited_ocr": "via unlimited_ocr_text",
}


def reason_of(expected) -> str:
    return expected.match if isinstance(expected, Refused) else str(expected)


def _experts_attr(cls) -> str | None:
    for name in ATTRS:
        if name in getattr(cls, "attribute_map", {}) or hasattr(cls, name):
            return name
    return None


def _module_has_experts_class(model_type: str) -> bool:
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except Exception:  # noqa: BLE001 — a type whose module does not import has no experts to test
        return False
    return any(re.fullmatch(r"\w+Experts", attr) for attr in vars(module))


def _own_experts(model_type: str, cls) -> bool:
    attr = _experts_attr(cls)
    if attr is None:  # DBRX: the count in an unnamed sub-config of the same model (``ffn_config``)
        return any(not getattr(sub, "model_type", "") and _experts_attr(sub)
                   for sub in (getattr(cls, "sub_configs", None) or {}).values())
    values = (getattr(cls, attr, None), getattr(cls, getattr(cls, "attribute_map", {}).get(attr, attr), None))
    if any(isinstance(v, int) and not isinstance(v, bool) and v > 1 for v in values):
        return True
    return _module_has_experts_class(model_type)  # a default of None / 1 experts (dots1, hunyuan_v1_moe)


def _sub_types(cls) -> dict[str, str]:
    out = {}
    for key, sub in (getattr(cls, "sub_configs", None) or {}).items():
        model_type = getattr(sub, "model_type", "")
        if model_type:
            out[key] = model_type
    return out


@functools.cache
def discover() -> dict[str, str | None]:
    """{MoE model type: None for a type with its own experts, or the sub-type (text stack) of a
    composite type that holds them}, from the installed transformers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    classes = {}
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            classes[model_type] = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 — a type whose config does not import is not testable here
            continue
    own = {t for t, cls in classes.items() if _own_experts(t, cls)}
    found: dict[str, str | None] = {t: None for t in own}

    def holder(model_type, depth=0):
        if model_type in own:
            return model_type
        if depth > 2 or model_type not in classes:
            return None
        for key, sub in _sub_types(classes[model_type]).items():
            if key.startswith(("text", "thinker", "decoder", "llm", "language")) and holder(sub, depth + 1):
                return holder(sub, depth + 1)
        return None

    for model_type in classes:
        if model_type not in own and (sub := holder(model_type)) is not None:
            found[model_type] = sub
    return dict(sorted(found.items()))


def target_type(model_type: str) -> str:
    """The model type whose model is built: the type itself, or a composite's text stack."""
    return discover().get(model_type) or model_type


def tiny_config(model_type: str):
    import transformers

    target = target_type(model_type)
    knobs = {k: v for k, v in {**BASE, **EXTRA.get(target, {})}.items() if v is not None}
    return transformers.AutoConfig.for_model(target, **knobs)


def model_kind(model_type: str) -> str:
    """"causal", "seq2seq" or "base": which head the tiny model gets."""
    from transformers.models.auto import modeling_auto as auto

    target = target_type(model_type)
    if target in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal"
    if target in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq"
    return "base"


def tiny_model(model_type: str):
    """(model in eval mode, number of MoE layers) for a tiny random config of the type; every weight
    but the norms drawn at std 0.1 (from_config zeroes some routers and biases: every token would
    tie) and hash-routing tables filled with random expert ids."""
    import transformers

    torch.manual_seed(0)
    cfg = tiny_config(model_type)
    auto = {"causal": transformers.AutoModelForCausalLM, "seq2seq": transformers.AutoModelForSeq2SeqLM,
            "base": transformers.AutoModel}[model_kind(model_type)]
    try:
        model = auto.from_config(cfg).eval()
    except ValueError:  # a text stack no auto class maps (omni models' thinker text): its own model class
        model = _model_class(cfg)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(std=0.1)
        for name, b in model.named_buffers():
            if not b.dtype.is_floating_point and b.dim() == 2 and ("eid" in name or "hash" in name):
                b.copy_(torch.randint(0, E, b.shape))
    return model, len(moe_layers(model))


def _model_class(cfg):
    """The modeling module's ``...ForCausalLM`` (else ``...Model``) class for this config class."""
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(cfg.model_type)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    classes = [c for c in vars(module).values() if isinstance(c, type) and getattr(c, "config_class", None) is type(cfg)]
    for suffix in ("ForCausalLM", "Model"):
        for cls in classes:
            if cls.__name__.endswith(suffix) and not cls.__name__.endswith("PreTrainedModel"):
                return cls
    raise LookupError(f"no model class for {type(cfg).__name__} in {module.__name__}")


def moe_layers(model) -> list[str]:
    """The modules holding experts (an ``experts`` submodule), outermost only."""
    names = [n for n, m in model.named_modules()
             if isinstance(getattr(m, "experts", None), torch.nn.Module) and not n.endswith("experts")]
    return [n for n in names if not any(n != o and n.startswith(o + ".") for o in names)]


# Types whose model takes other inputs than token ids: the talker of the omni model reads the
# thinker's hidden states (embeddings), a vision encoder flattened patches and their [t, h, w] grid;
# ERNIE-4.5-VL's text stack routes text and image tokens to separate experts (token types 0 / 1).
EMBEDS_INPUT = {"qwen3_omni_moe_talker_text"}
PATCHES_INPUT = {"dots3_note_vision_encoder"}
TOKEN_TYPES_INPUT = {"ernie4_5_vl_moe_text": "moe_mm_token_type_ids"}


def inputs(model, model_type: str, batch: int, seq: int) -> dict:
    target = target_type(model_type)
    if target in EMBEDS_INPUT:
        return dict(inputs_embeds=torch.randn(batch, seq, model.config.hidden_size))
    if target in PATCHES_INPUT:  # batch images of 2 x seq patches (spatial merge 2: an even grid)
        cfg = model.config
        width = 2 * ((seq + 1) // 2)
        grid = torch.tensor([[1, 2, width]] * batch)
        return dict(pixel_values=torch.randn(2 * width * batch, cfg.num_channels * cfg.patch_size ** 2), grid_thw=grid)
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else 128
    ids = torch.randint(3, min(vocab, 128), (batch, seq))
    if target in TOKEN_TYPES_INPUT:  # the second half of each row image tokens
        return {"input_ids": ids, TOKEN_TYPES_INPUT[target]: (torch.arange(seq) >= seq // 2).int().expand(batch, seq)}
    if model_kind(model_type) == "seq2seq":
        return dict(input_ids=ids, decoder_input_ids=torch.randint(3, min(vocab, 128), (batch, max(seq - 2, 1))))
    return dict(input_ids=ids)


def main_output(out) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def outcome_row(model_type: str) -> tuple[str, str]:
    """(outcome, reason) of a type as docs/models.md shows it."""
    expected = OUTCOMES.get(model_type)
    if expected == REWRITTEN:
        return "rewritten", "every MoE layer"
    if isinstance(expected, str) and expected.startswith("via "):
        return "rewritten" if OUTCOMES.get(expected[4:]) == REWRITTEN else "see " + expected[4:], \
            f"through its text stack `{expected[4:]}`"
    if isinstance(expected, Refused):
        return "left unfused", expected.why
    if isinstance(expected, NoTinyModel):
        return "not tested", expected.why
    return "unknown", "not in the table"


def models_markdown() -> str:
    lines = ["# MoE models of HF transformers", "",
             "Every MoE model type that the installed transformers ships, what "
             '`model.compile(backend="moe")` does with it, and why where it leaves a layer unfused. Each row is a '
             "test (`tests/test_hf_all_moe.py`): a tiny random model of the type, eager's logits, and the outcome "
             "below. Generated from `tests/hf_moe_models.py` (`python -m tests.hf_moe_models > docs/models.md`).", "",
             "| model type | outcome | reason |", "| --- | --- | --- |"]
    for model_type in discover():
        outcome, why = outcome_row(model_type)
        lines.append(f"| `{model_type}` | {outcome} | {why} |")
    return "\n".join(lines) + "\n"


def readme_lines() -> str:
    """The README's tested-models list: the types whose MoE layers are rewritten."""
    import textwrap

    done = [t for t in discover() if outcome_row(t)[0] == "rewritten"]
    text = (f"Tested HF model types ({len(done)} of the {len(discover())} MoE types of the installed transformers, "
            f"`tests/test_hf_all_moe.py`: every MoE layer rewritten, logits equal to eager; the others, and "
            f"why, in [docs/models.md](docs/models.md)): " + ", ".join(f"`{t}`" for t in done) + ".")
    return textwrap.fill(text, width=100, break_on_hyphens=False, break_long_words=False) + "\n"


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    print(models_markdown(), end="")
