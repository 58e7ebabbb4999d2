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


def write_gguf(model, path: str) -> None:
    """The model as a qwen3moe GGUF, every tensor fp32 (llama.cpp's names and layouts: a [out, in]
    weight as it is, experts stacked [E, out, in]).  The vocab is a placeholder (byte tokens and
    numbered ones): llama-bench and the greedy checker take token ids, never text."""
    import gguf

    cfg = model.config
    if getattr(cfg, "model_type", None) != "qwen3_moe" or not cfg.norm_topk_prob or cfg.mlp_only_layers:
        raise ValueError("write_gguf writes Qwen3-MoE models whose every layer is MoE with renormalised top-k "
                         "weights (norm_topk_prob=True: llama.cpp's qwen3moe always renormalises); got "
                         f"{getattr(cfg, 'model_type', type(model).__name__)} with norm_topk_prob="
                         f"{getattr(cfg, 'norm_topk_prob', None)}, mlp_only_layers={getattr(cfg, 'mlp_only_layers', None)}")
    w = gguf.GGUFWriter(path, "qwen3moe")
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
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocab(w, cfg.vocab_size)
    for name, tensor in gguf_tensors(model):
        w.add_tensor(name, tensor.detach().float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
