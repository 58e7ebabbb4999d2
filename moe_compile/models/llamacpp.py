"""llama.cpp beside moe_compile: a Qwen3-MoE model written as a GGUF, and llama-bench run on it.

Used by ``moe-compile demo --llama-bench PATH`` and ``benchmarks/bench_e2e_cpu.py`` to time the
same model in llama.cpp (its CPU backend is the peer users compare CPU decode speed with).
Needs the ``gguf`` package (``pip install gguf``; the ``bench`` extra) and a llama.cpp build given
by path; nothing here runs at import.
"""

from __future__ import annotations

import json
import os
import subprocess

import torch


def write_gguf(model, path: str, weights: str = "F32") -> None:
    """The model as a qwen3moe GGUF (llama.cpp's names and layouts: a [out, in] weight as it is,
    experts stacked [E, out, in]), every tensor fp32, or with ``weights`` a ggml type name ("Q4_0",
    "Q8_0", "Q5_0", ...: what the ``gguf`` package quantizes) the matrices in that type, norms and
    routers fp32 as llama-quantize keeps them.  The vocab is a placeholder (byte tokens and
    numbered ones): llama-bench and the greedy checker take token ids, never text."""
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    if getattr(cfg, "model_type", None) != "qwen3_moe" or not cfg.norm_topk_prob or cfg.mlp_only_layers:
        raise ValueError("write_gguf writes Qwen3-MoE models whose every layer is MoE with renormalised top-k "
                         "weights (norm_topk_prob=True: llama.cpp's qwen3moe always renormalises); got "
                         f"{getattr(cfg, 'model_type', type(model).__name__)} with norm_topk_prob="
                         f"{getattr(cfg, 'norm_topk_prob', None)}, mlp_only_layers={getattr(cfg, 'mlp_only_layers', None)}")
    w = gguf.GGUFWriter(path, "qwen3moe")
    qtype = gguf.GGMLQuantizationType[weights]
    _add_header(w, cfg, gguf.LlamaFileType.ALL_F32 if weights == "F32" else gguf.LlamaFileType.GUESSED)
    for name, tensor in gguf_tensors(model):
        array = tensor.detach().float().contiguous().numpy()
        if weights == "F32" or array.ndim == 1 or "ffn_gate_inp" in name:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_header(w, cfg, file_type) -> None:
    """Qwen3-MoE's hyperparameters and the placeholder vocab, as llama.cpp's qwen3moe reads them."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type(file_type)
    _add_vocab(w, cfg.vocab_size)


def random_q4_0_shapes(cfg) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy-order shape, "q4_0" or "f32") of a qwen3moe GGUF as llama-quantize's q4_0
    writes it: the weights in q4_0, the norms and the routers (``ffn_gate_inp``) in f32."""
    H, F, E, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = [("token_embd.weight", (V, H), "q4_0")]
    for i in range(cfg.num_hidden_layers):
        out += [(f"blk.{i}.{k}", shape, kind) for k, shape, kind in (
            ("attn_norm.weight", (H,), "f32"), ("attn_q.weight", (q, H), "q4_0"), ("attn_k.weight", (kv, H), "q4_0"),
            ("attn_v.weight", (kv, H), "q4_0"), ("attn_output.weight", (H, q), "q4_0"),
            ("attn_q_norm.weight", (cfg.head_dim,), "f32"), ("attn_k_norm.weight", (cfg.head_dim,), "f32"),
            ("ffn_norm.weight", (H,), "f32"), ("ffn_gate_inp.weight", (E, H), "f32"),
            ("ffn_gate_exps.weight", (E, F, H), "q4_0"), ("ffn_up_exps.weight", (E, F, H), "q4_0"),
            ("ffn_down_exps.weight", (E, H, F), "q4_0"))]
    return out + [("output_norm.weight", (H,), "f32"), ("output.weight", (V, H), "q4_0")]


def write_random_q4_0(cfg, path: str, seed: int = 0, std: float = 0.02) -> int:
    """A qwen3moe GGUF of ``cfg``'s shapes with random weights written directly as q4_0 blocks, one
    tensor at a time (no full-precision weight is ever made: a 30B-parameter file needs only its
    largest tensor in memory).  Blocks: uniform 4-bit codes and fp16 scales d around std / 4.6 (the
    codes' spread), so every weight has about ``std``; norms are 1, routers N(0, std) in f32.
    Returns the file's size in bytes."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = random_q4_0_shapes(cfg)
    w = gguf.GGUFWriter(path, "qwen3moe")
    _add_header(w, cfg, gguf.LlamaFileType.MOSTLY_Q4_0)
    q4 = gguf.GGMLQuantizationType.Q4_0
    for name, shape, kind in shapes:
        n = int(np.prod(shape))
        if kind == "q4_0":
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // 32 * 18), np.dtype(np.uint8), n // 32 * 18, q4)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), n * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in shapes:
        n = int(np.prod(shape))
        if kind == "f32":
            norm = "norm" in name
            w.write_tensor_data(np.ones(shape, np.float32) if norm else
                                rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
            continue
        blocks = rng.integers(0, 256, size=(n // 32, 18), dtype=np.uint8)
        d = (rng.uniform(0.5, 1.5, size=n // 32) * (std / 4.6)).astype(np.float16)
        blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
        w.write_tensor_data(blocks)
    w.close()
    return os.path.getsize(path)


def qwen3_30b_a3b_config():
    """Qwen3-30B-A3B's shapes (48 layers, 128 experts of width 768, top-8, hidden 2048, 32 / 4 heads
    of 128, vocab 151 936) as a transformers config."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=4096,
                          rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1, pad_token_id=0)


def _add_vocab(w, vocab: int) -> None:
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(vocab - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def gguf_tensors(model):
    """(GGUF name, the model's tensor or a view of it) for every tensor the GGUF holds."""
    m = model.model
    yield "token_embd.weight", m.embed_tokens.weight
    for i, layer in enumerate(m.layers):
        att, moe = layer.self_attn, layer.mlp
        F = moe.experts.down_proj.shape[2]
        gate_up = moe.experts.gate_up_proj  # [E, 2F, H]: gate rows, then up rows
        yield from ((f"blk.{i}.{k}", v) for k, v in (
            ("attn_norm.weight", layer.input_layernorm.weight), ("attn_q.weight", att.q_proj.weight),
            ("attn_k.weight", att.k_proj.weight), ("attn_v.weight", att.v_proj.weight),
            ("attn_output.weight", att.o_proj.weight), ("attn_q_norm.weight", att.q_norm.weight),
            ("attn_k_norm.weight", att.k_norm.weight), ("ffn_norm.weight", layer.post_attention_layernorm.weight),
            ("ffn_gate_inp.weight", moe.gate.weight), ("ffn_gate_exps.weight", gate_up[:, :F]),
            ("ffn_up_exps.weight", gate_up[:, F:]), ("ffn_down_exps.weight", moe.experts.down_proj)))
    yield "output_norm.weight", m.norm.weight
    yield "output.weight", model.lm_head.weight


def bench(llama_bench: str, path: str, threads: int, prompt: int, gen: int, reps: int, decode_depth: int = 0) -> dict:
    """llama-bench's prefill (``-p prompt``) and decode (``-n gen``) tokens/s on a GGUF, the decode
    after ``decode_depth`` tokens of context (``-d``; give the prompt's length to time the decode a
    user's prompt-then-generate runs: its attention reads that many cached positions, where
    llama-bench's own default decodes from an empty context).  Its default (CPU_REPACK weight
    layouts) first; where that run crashes — seen on a 2-core Intel Xeon with AMX for q8_0 / q4_0
    prefill, llama.cpp 0.3.36's vendored tree — again with ``--repack 0``, and the row says so
    (``repack``)."""
    tests = [["-p", str(prompt), "-n", "0"], ["-p", "0", "-n", str(gen), "-d", str(decode_depth)]] if decode_depth \
        else [["-p", str(prompt), "-n", str(gen)]]
    rows = []
    for test in tests:
        for repack in ("1", "0"):
            done = subprocess.run([llama_bench, "-m", path, "-t", str(threads), *test, "-r", str(reps), "--repack",
                                   repack, "-o", "json"], capture_output=True, text=True)
            if done.returncode == 0:
                break
        done.check_returncode()
        rows += [r | {"repack": int(repack)} for r in json.loads(done.stdout)]
    pre = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    dec = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return dict(prefill_tok_s=pre["avg_ts"], decode_tok_s=dec["avg_ts"], decode_ms_tok=1e3 / dec["avg_ts"],
                decode_depth=decode_depth, load1=os.getloadavg()[0], repack=min(pre["repack"], dec["repack"]))
