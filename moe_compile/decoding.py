"""``moe_compile.generate`` (module ``decoding``): greedy decoding of a Hugging Face causal LM
with a static KV cache and nothing between two forward calls but an argmax.

    model.forward = torch.compile(model.forward, backend="moe", options={"quant": "a8w4-int",
                                                                        "quant_dense": "same"})
    ids = moe_compile.generate(model, prompt_ids, max_new_tokens=64)

The same tokens as ``model.generate(ids, do_sample=False, cache_implementation="static")`` (its
greedy path: argmax of the last position's logits, stopping when every row has produced an EOS
token, finished rows padded).  What it leaves out is HF ``generate``'s per-step Python (input
preparation, the 4-D mask built outside the model, logits processors, stopping criteria: 1-2 ms a
step on a small CPU, as much as a 4-bit decode step's whole memory time): the model builds its own
causal mask in the compiled graph, and a step is one compiled forward call.  Greedy only; for
sampling, beams or logits processors use ``model.generate``.
"""

from __future__ import annotations

import inspect
import weakref

import torch

# model -> its StaticCache, reused (reset) by later calls as HF generate reuses its own: a fresh
# cache would mean fresh tensors, and the compiled step guards on the cache's tensors
_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, stop_at_eos: bool = True) -> torch.Tensor:
    """input_ids [B, S] (no padding: every row S tokens) -> [B, S + n] with n <= max_new_tokens greedy
    tokens.  ``eos_token_id`` / ``pad_token_id`` default to the model's generation config;
    ``stop_at_eos=False`` always generates ``max_new_tokens``."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"generate: input_ids must be a [batch, seq] integer tensor, got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = _eos_ids(model, eos_token_id, input_ids.device) if stop_at_eos else None
    pad = _pad_id(model, pad_token_id, eos)
    kwargs = _call_kwargs(model, _static_cache(model, input_ids, input_ids.shape[1] + max_new_tokens))
    tokens, ids = [input_ids], input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, **kwargs).logits
            ids = logits[:, -1].argmax(-1, keepdim=True).to(input_ids.dtype)
            if eos is not None:
                ids = ids.masked_fill(done[:, None], pad)
                done |= torch.isin(ids[:, 0], eos)
            tokens.append(ids)
            if eos is not None and bool(done.all()):
                break
    return torch.cat(tokens, dim=1)


def _static_cache(model, input_ids: torch.Tensor, max_cache_len: int):
    """The model's cache from an earlier call, reset, when it holds this batch and length (a longer
    one is fine: the mask hides its unused positions); else a new one, kept for the next call."""
    from transformers import StaticCache

    cache = _caches.get(model)
    if cache is not None and _fits(cache, input_ids.shape[0], max_cache_len):
        cache.reset()
        return cache
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    _caches[model] = cache
    return cache


def _fits(cache, batch: int, max_cache_len: int) -> bool:
    layer = cache.layers[0]
    if getattr(layer, "max_cache_len", 0) < max_cache_len:
        return False
    return not getattr(layer, "is_initialized", False) or layer.keys.shape[0] == batch


def _call_kwargs(model, cache) -> dict:
    """The forward's keyword arguments for a cached, last-logits-only step, in this transformers
    version's names (``cache`` in transformers >= 5.24, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    name = "cache" if "cache" in params else "past_key_values"
    if name not in params and not has_var_kw:
        raise ValueError(f"generate: {type(model).__name__}.forward takes no KV cache argument")
    kwargs = {name: cache, "use_cache": True}
    keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    if keep is not None:  # lm_head on the last position only, as HF generate asks
        kwargs[keep] = 1
    return kwargs


def _eos_ids(model, eos_token_id, device) -> torch.Tensor | None:
    if eos_token_id is None:
        eos_token_id = _generation_setting(model, "eos_token_id")
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _pad_id(model, pad_token_id, eos) -> int:
    if pad_token_id is None:
        pad_token_id = _generation_setting(model, "pad_token_id")
    if pad_token_id is None:  # HF pads finished rows with the (first) EOS token then
        pad_token_id = int(eos[0]) if eos is not None else 0
    return int(pad_token_id)


def _generation_setting(model, name: str):
    """The model's generation config's ``name`` (its model config's where it has no generation config)."""
    config = getattr(model, "generation_config", None) or model.config
    return getattr(config, name, None)
