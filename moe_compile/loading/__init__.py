"""Load a checkpoint straight into packed weights: the full-precision model is never held.

    model = moe_compile.load(path, quant=None, quant_dense=None, dtype=torch.float32)
    model.compile(backend="moe")          # the packed weights run on the packed kernels
    print(model.moe_compile_load)         # what each tensor was stored as and is kept as

``path``: a ``.gguf`` file (``gguf_reader.py``: llama.cpp's q4_0 / q8_0 blocks kept as w4-int /
w8-int with group 32, other block types converted once with their SQNR reported) or a directory of
safetensors shards with its ``config.json`` (``safetensors_dir.py``: any dtype, streamed tensor by
tensor).  ``quant``: the experts' format (None: as stored; a format name packs them, see
``docs/loading.md``), ``quant_dense``: the dense linears' (attention, lm_head, shared experts).
Embeddings, norms and routers keep their stored values in ``dtype``.  The model is an ordinary
transformers model whose packed weights are ``PackedWeight`` parameters (``quant/packed.py``).
"""

from __future__ import annotations

import os

import torch


def load(path: str, quant: str | None = None, quant_dense: str | None = None, dtype: torch.dtype = torch.float32):
    """The model of ``path`` with its weights packed as they are read; see the module docstring."""
    from moe_compile.quant.common import FORMATS

    for what, fmt in (("quant", quant), ("quant_dense", quant_dense)):
        if fmt not in (None, "none") and fmt not in FORMATS:
            raise ValueError(f"moe_compile.load: {what}={fmt!r} is not a format; use one of {FORMATS} or None")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"moe_compile.load: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    if os.path.isdir(path):
        from moe_compile.loading.safetensors_dir import load_safetensors

        return load_safetensors(path, quant, quant_dense, dtype)
    if path.endswith(".gguf") or (os.path.isfile(path) and _is_gguf(path)):
        from moe_compile.loading.gguf_reader import load_gguf

        return load_gguf(path, quant, quant_dense, dtype)
    raise ValueError(f"moe_compile.load: {path!r} is neither a .gguf file nor a directory with config.json and "
                     f"*.safetensors shards")


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
