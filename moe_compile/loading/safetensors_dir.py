"""A directory of safetensors shards (``config.json`` beside them) into an HF model, packed as it streams.

Shapes:  E experts, F expert width, H hidden.

    model = load_safetensors(directory, quant, quant_dense, dtype)

Each shard is read tensor by tensor with plain file reads (the format is an 8-byte header length,
a JSON header of dtype / shape / byte range per tensor, then the data), never mapped, so the
process holds what the model keeps plus one tensor in flight.  Keys are the model's parameter
names, or the per-expert names checkpoints on the Hub use, which are stacked as they arrive:

  ``<p>.experts.<e>.gate_proj.weight`` [F, H] / ``up_proj`` (or Mixtral's ``w1`` / ``w3``)
        -> ``<p>.experts.gate_up_proj`` [E, 2F, H], expert e's gate rows then its up rows
  ``<p>.experts.<e>.down_proj.weight`` [H, F] (or ``w2``) -> ``<p>.experts.down_proj`` [E, H, F]

each expert packed on arrival when ``quant`` names a format (packing is per row, so packing the
experts one by one gives the bytes packing the stack would).
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct

import torch

from moe_compile.loading.build import Target, _group, cat_rows

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}
PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
ROLE = {"gate_proj": ("gate_up_proj", "gate"), "w1": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
        "w3": ("gate_up_proj", "up"), "down_proj": ("down_proj", "down"), "w2": ("down_proj", "down")}
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # computed by the model, kept in old checkpoints


def load_safetensors(directory: str, quant, quant_dense, dtype: torch.dtype):
    from transformers import AutoConfig

    shards = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not shards or not os.path.exists(os.path.join(directory, "config.json")):
        raise ValueError(f"moe_compile.load: {directory} needs config.json and *.safetensors shards")
    target = Target(AutoConfig.from_pretrained(directory), dtype, quant, quant_dense, os.path.basename(directory))
    stacks: dict[str, dict] = {}
    for shard in shards:
        with open(shard, "rb") as f:
            for key, tensor, stored in _tensors(f, shard):
                if IGNORED.match(key):
                    continue
                m = PER_EXPERT.match(key)
                if m is None:
                    target.put(key, tensor, stored)
                else:
                    _expert(target, stacks, m, tensor, stored)
    if stacks:
        name, parts = next(iter(stacks.items()))
        raise ValueError(f"moe_compile.load: {directory}: {name} has {len(parts)} of its experts' tensors, the "
                         f"checkpoint lacks the others")
    return target.finish()


def _tensors(f, shard: str):
    """(key, tensor, stored dtype name) of one shard, in file order."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"moe_compile.load: {shard} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head)
    try:
        header = json.loads(f.read(n))
    except ValueError as exc:
        raise ValueError(f"moe_compile.load: {shard}: its header is not JSON ({exc})") from exc
    size = os.path.getsize(shard)
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
    for key, info in entries:
        begin, end = info["data_offsets"]
        if 8 + n + end > size:
            raise ValueError(f"moe_compile.load: {shard} is truncated: tensor {key!r} ends at byte {8 + n + end}, "
                             f"the file has {size}")
        if info["dtype"] not in DTYPES:
            raise ValueError(f"moe_compile.load: {shard}: tensor {key!r} has dtype {info['dtype']}, not one of {list(DTYPES)}")
        buf = torch.empty(end - begin, dtype=torch.uint8)
        f.seek(8 + n + begin)
        f.readinto(memoryview(buf.numpy()))
        yield key, buf.view(DTYPES[info["dtype"]]).reshape(info["shape"]), info["dtype"].lower()


def _expert(target: Target, stacks: dict, m: re.Match, tensor: torch.Tensor, stored: str) -> None:
    """One expert's gate / up / down weight, packed now when asked; the stack once all are in."""
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    leaf, part = ROLE[kind]
    name = f"{prefix}.{leaf}"
    E = target.expected_shape(name)[0]
    fmt = target.wanted(name)
    piece = tensor.detach().float()
    if fmt not in (None, "none"):
        from moe_compile import quant

        piece = quant.pack(fmt, piece[None], _group(fmt, piece.shape[-1]))
    parts = stacks.setdefault(name, {})
    parts[(e, part)] = piece
    if len(parts) < E * (2 if leaf == "gate_up_proj" else 1):
        return
    del stacks[name]
    if fmt in (None, "none"):
        rows = [torch.cat([parts[(i, p)] for p in ("gate", "up")]) if leaf == "gate_up_proj" else parts[(i, "down")]
                for i in range(E)]
        target.put(name, torch.stack(rows), stored)
        return
    from moe_compile.quant import formats as quant_formats

    experts = [cat_rows(parts[(i, "gate")], parts[(i, "up")]) if leaf == "gate_up_proj" else parts[(i, "down")]
               for i in range(E)]
    target.put_packed(name, quant_formats.concat(experts), stored)
