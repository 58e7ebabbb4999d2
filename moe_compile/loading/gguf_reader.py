"""A GGUF file (llama.cpp's format) into an HF model, llama.cpp's blocks kept as they are stored.

Shapes:  E experts, F expert width, H hidden, N rows, K reduction width (GGUF's ne0, its innermost
dimension), B = K / 32 blocks a row.

    model = load_gguf(path, quant=None, quant_dense=None, dtype=torch.float32)

What a stored type becomes (no round trip through fp32 where the meaning is the same):

  GGUF type   block (bytes)                          kept as
  q4_0        fp16 d, 16 bytes: element j low        w4-int, group 32: the same codes and scales,
              nibble of byte j, j + 16 high;         the nibbles re-paired (element 2j low, 2j+1
              element (q - 8) d                      high); a8w4-int when ``quant`` asks for it
  q8_0        fp16 d, 32 int8: element q d           w8-int, group 32 (a8w8-int when asked)
  f32/f16/bf16                                       the model's dtype, or packed in ``quant`` /
                                                     ``quant_dense`` when they name a format
  any other   (q4_K, q6_K, ...)                      dequantized by the ``gguf`` package and packed
                                                     once (``quant``, else w4-int g32 for <= 5 bits,
                                                     w8-int g32 above): the SQNR in the report

The header is read by ``gguf_file.py``; tensor data with plain file reads into fresh buffers, one
tensor at a time, never through a mapping of the file, so the process holds only what the model
keeps plus the tensor being packed and the next one, read by a second thread meanwhile (the read
waits on the disk with the GIL released while the packing runs).  The ``gguf`` package is needed only for the converted types.
Architectures: qwen3moe (Qwen3-MoE), whose GGUF names map one to one onto transformers' Qwen3-MoE
(llama.cpp's converter does not permute its q / k rows for this architecture).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from moe_compile.loading.build import Target, _group, cat_rows
from moe_compile.loading.gguf_file import read_header

BLOCK = 32
# ggml type -> (our format, bytes a block) where the block is one of ours
EXACT = {"Q4_0": ("w4-int", 18), "Q8_0": ("w8-int", 34)}
TWINS = {"w4-int": ("w4-int", "a8w4-int"), "w8-int": ("w8-int", "a8w8-int")}
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
LOW_BIT = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS")
ARCHS = ("qwen3moe",)


def load_gguf(path: str, quant: str | None = None, quant_dense: str | None = None,
              dtype: torch.dtype = torch.float32):
    header = read_header(path)
    target = Target(config_of(header), dtype, quant, quant_dense, os.path.basename(path))
    halves: dict[str, dict] = {}
    with open(path, "rb") as f:
        for t, raw in _read_ahead(f, header.tensors):
            name, part = param_name(t.name, path)
            try:
                _put(target, name, part, raw, t.ggml_type, t.shape, halves)
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{exc.args[0] if exc.args else exc} (GGUF tensor {t.name!r})") from exc
    return target.finish()


def config_of(header):
    """The transformers config of the file's hyperparameters (``ARCHS``)."""
    from transformers import Qwen3MoeConfig

    path = header.path
    arch = _field(header, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"moe_compile.load: {path} is a {arch!r} GGUF; this loader reads {ARCHS} (convert the model "
                         f"from its safetensors checkpoint instead: moe_compile.load(directory, ...))")

    def get(key, default=None):
        return _field(header, f"{arch}.{key}", default)

    shapes = {t.name: t.shape for t in header.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError(f"moe_compile.load: {path} has no token_embd.weight")
    vocab, tied = shapes["token_embd.weight"][0], "output.weight" not in shapes
    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=get("embedding_length"), intermediate_size=get("feed_forward_length", 1),
        moe_intermediate_size=get("expert_feed_forward_length"), num_hidden_layers=get("block_count"),
        num_attention_heads=get("attention.head_count"), num_key_value_heads=get("attention.head_count_kv"),
        head_dim=get("attention.key_length"), num_experts=get("expert_count"),
        num_experts_per_tok=get("expert_used_count"), norm_topk_prob=True,  # llama.cpp's qwen3moe renormalises
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=tied,
        max_position_embeddings=get("context_length", 4096), rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1e6))})


def _field(header, key: str, default=None):
    value = header.fields.get(key, default)
    if value is None:
        raise ValueError(f"moe_compile.load: {header.path} lacks the metadata key {key!r}")
    return value


_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
          "ffn_down_exps": "mlp.experts.down_proj"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def param_name(gguf_name: str, path: str) -> tuple[str, str]:
    """(the model's parameter, "" or the half of it: "gate" / "up" of ``gate_up_proj``)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name], ""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight":
        i, kind = parts[1], parts[2]
        if kind in ("ffn_gate_exps", "ffn_up_exps"):
            return f"model.layers.{i}.mlp.experts.gate_up_proj", kind.split("_")[1]
        if kind in _LAYER:
            leaf = "" if kind == "ffn_down_exps" else ".weight"
            return f"model.layers.{i}.{_LAYER[kind]}{leaf}", ""
    raise ValueError(f"moe_compile.load: {path}: tensor {gguf_name!r} has no place in a Qwen3-MoE model")


def _read_ahead(f, tensors):
    """(tensor info, its bytes) in file order, the next tensor read by a second thread while the
    caller packs this one."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe_compile-gguf-read") as reader:
        pending = reader.submit(_read, f, tensors[0].offset, tensors[0].nbytes) if tensors else None
        for i, t in enumerate(tensors):
            raw = pending.result()
            if i + 1 < len(tensors):
                pending = reader.submit(_read, f, tensors[i + 1].offset, tensors[i + 1].nbytes)
            yield t, raw


def _read(f, offset: int, nbytes: int) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    f.seek(offset)
    got = f.readinto(memoryview(buf.numpy()))
    if got != nbytes:
        raise ValueError(f"moe_compile.load: short read at byte {offset} ({got} of {nbytes})")
    return buf


def _put(target: Target, name: str, part: str, raw: torch.Tensor, kind: str, shape: tuple, halves: dict) -> None:
    """One GGUF tensor into the model (a gate_up_proj half waits for the other half)."""
    if kind in PLAIN:
        value = raw.view(PLAIN[kind]).reshape(shape)
        if part:
            done = _half(halves, name, part, value)
            if done:
                target.put(name, torch.cat([done["gate"], done["up"]], dim=1), kind.lower())
            return
        target.put(name, value, kind.lower())
        return
    qw, stored, sqnr = _as_quant(raw, kind, shape, target.wanted(name), name)
    if part:
        done = _half(halves, name, part, (qw, stored, sqnr))
        if not done:
            return
        (gate, s1, e1), (up, s2, e2) = done["gate"], done["up"]
        qw, stored = cat_rows(gate, up), s1 if s1 == s2 else f"{s1}+{s2}"
        sqnr = min((e for e in (e1, e2) if e is not None), default=None)
    target.put_packed(name, qw, stored, sqnr)


def _half(halves: dict, name: str, part: str, value):
    """Keep one half of gate_up_proj; both halves ({"gate": .., "up": ..}) once the second arrives."""
    halves.setdefault(name, {})[part] = value
    return halves.pop(name) if len(halves[name]) == 2 else None


def _as_quant(raw, kind: str, shape: tuple, wanted: str | None, name: str):
    """(canonical QuantWeight [E, N, K] ([1, N, K] for 2-D), stored type, SQNR of a conversion or None)."""
    from moe_compile import quant
    from moe_compile.quant import formats as quant_formats

    *lead, N, K = shape
    E = lead[0] if lead else 1
    if kind in EXACT and (wanted in (None, "none") or wanted in TWINS[EXACT[kind][0]]):
        fmt = EXACT[kind][0] if wanted in (None, "none") else wanted
        data, scale = (_q4_0 if kind == "Q4_0" else _q8_0)(raw.reshape(E * N, K // BLOCK, EXACT[kind][1]))
        kb = data.shape[-1]
        return quant.QuantWeight(fmt, data.reshape(E, N, kb), scale.reshape(E, N, K // BLOCK), BLOCK, (E, N, K)), \
            kind.lower(), None
    fmt = wanted if wanted not in (None, "none") else "w4-int" if kind in LOW_BIT else "w8-int"
    parts, worst = [], None
    for e, w in enumerate(_dequantized(raw, kind, E, N, K, name)):  # one expert at a time
        qw = quant.pack(fmt, w[None], _group(fmt, K))
        parts.append(qw)
        err = _sqnr_db(w, quant.dequantize(qw)[0])
        worst = err if worst is None else min(worst, err)
    return quant_formats.concat(parts), kind.lower(), worst


def _dequantized(raw, kind: str, E: int, N: int, K: int, name: str):
    """Each expert's [N, K] fp32 of a quantized type we do not keep as it is (the gguf package's
    own dequantization)."""
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError as exc:
        raise ValueError(f"moe_compile.load: tensor {name!r} is stored as {kind}: converting it needs the gguf package "
                         f"(pip install gguf)") from exc
    qtype = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.numpy().reshape(E, N, K // block * nbytes)
    for e in range(E):
        try:
            yield torch.from_numpy(dequantize(rows[e], qtype).reshape(N, K).copy())
        except NotImplementedError as exc:
            raise ValueError(f"moe_compile.load: tensor {name!r} is stored as {kind}, which the gguf package cannot "
                             f"dequantize here ({exc}); requantize the file to q4_0 / q8_0 / f16") from exc


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, B, 18] q4_0 blocks -> (w4-int codes uint8 [R, B * 16], fp16 scales [R, B]): byte j of
    a block holds elements j (low nibble) and j + 16 (high); ours holds 2j and 2j + 1.  So our
    byte i < 8 is the low nibbles of their bytes 2i and 2i + 1, byte 8 + i their high nibbles:
    two byte-wise expressions on the even and odd bytes, written straight into the codes."""
    R, B = blocks.shape[:2]
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    even, odd = blocks[..., 2::2], blocks[..., 3::2]  # [R, B, 8] each: their bytes 2i, 2i + 1
    codes = torch.empty(R, B, 16, dtype=torch.uint8)
    torch.bitwise_or(even & 0x0F, (odd & 0x0F) << 4, out=codes[..., :8])
    torch.bitwise_or(even >> 4, odd & 0xF0, out=codes[..., 8:])
    return codes.reshape(R, -1), d.contiguous()


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, B, 34] q8_0 blocks -> (w8-int int8 [R, B * 32], fp16 scales [R, B])."""
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(blocks.shape[0], -1), d.contiguous()


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    noise = (ref - got).double().pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))
