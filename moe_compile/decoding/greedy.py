"""``moe_compile.generate``: greedy decoding of a Hugging Face causal LM
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

Dynamo's guards (``check_guards``): before every call of a compiled function Dynamo checks that
the call still fits the graph it compiled — for a 4-layer HF model some 1,800 checks on the model's
modules, the cache's tensors and the inputs, 0.4-0.8 ms a step on a small CPU.  Within one
``generate`` call nothing they check changes from one decode step to the next: the same model,
the same cache object (only its tensors' contents change), token ids of the same shape.  So the
prefill and the first ``WARMUP_STEPS`` decode steps run with every guard (any graph the loop needs
is compiled there), the later steps with ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``
(only the guards that tell the compiled graphs apart, e.g. prefill from decode), and one step in
``CHECK_EVERY`` runs every guard again under ``set_stance("fail_on_recompile")``: a model whose
Python state does change during generation (a step counter, a branch on the length) is caught there
with an error instead of decoding on with a graph that no longer fits.  ``check_guards=True``
evaluates every guard on every step.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref

import torch

# model -> its StaticCache, reused (reset) by later calls as HF generate reuses its own: a fresh
# cache would mean fresh tensors, and the compiled step guards on the cache's tensors
_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
WARMUP_STEPS = 2  # decode steps with every guard evaluated: a graph the loop needs is compiled here
CACHE_STEP = 256  # the shortest static cache generate allocates (cache_length)
CHECK_EVERY = 16  # later, one step in CHECK_EVERY evaluates every guard (and refuses to recompile)


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, stop_at_eos: bool = True, check_guards: bool = False) -> torch.Tensor:
    """input_ids [B, S] (no padding: every row S tokens) -> [B, S + n] with n <= max_new_tokens greedy
    tokens.  ``eos_token_id`` / ``pad_token_id`` default to the model's generation config;
    ``stop_at_eos=False`` always generates ``max_new_tokens``; ``check_guards=True`` evaluates
    Dynamo's guards on every step (see the module docstring)."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"generate: input_ids must be a [batch, seq] integer tensor, got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = _eos_ids(model, eos_token_id, input_ids.device) if stop_at_eos else None
    pad = _pad_id(model, pad_token_id, eos)
    length = cache_length(input_ids.shape[1] + max_new_tokens, _positions(model))
    kwargs = _call_kwargs(model, _static_cache(model, input_ids, length))
    tokens, ids = [input_ids], input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    with torch.no_grad():
        for step in range(max_new_tokens):
            with _guards_for(step, check_guards):
                logits = model(input_ids=ids, **kwargs).logits
            # max's indices are argmax's (the first maximum; a NaN wins), in 24 us where argmax
            # takes 58 on a 32000-word vocabulary (torch 2.13 CPU): argmax's kernel is serial
            ids = logits[:, -1].max(-1, keepdim=True).indices.to(input_ids.dtype)
            if eos is not None:
                ids = ids.masked_fill(done[:, None], pad)
                done |= torch.isin(ids[:, 0], eos)
            tokens.append(ids)
            if eos is not None and bool(done.all()):
                break
    return torch.cat(tokens, dim=1)


def cache_length(tokens: int, positions: int | None = None) -> int:
    """The static cache's length for a call that ends at ``tokens``: CACHE_STEP, or the power-of-two
    multiple of it that holds them, but no more than the model's ``positions`` when they hold them.
    A cache of another length is another set of tensors, so the compiled steps compile again
    (minutes for a 48-layer model); rounded up, calls of other lengths reuse the cache and its
    graphs, and at most a few lengths are ever compiled.  The unused positions are masked, which
    costs the decode's attention, not its weights' reads."""
    length = CACHE_STEP
    while length < tokens:
        length *= 2
    return min(length, positions) if positions and tokens <= positions else length


def _positions(model) -> int | None:
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def _guards_for(step: int, check_guards: bool):
    """The compiler stance of a step (0: the prefill): every guard for the prefill, the warm-up
    steps and every CHECK_EVERY-th step (those refusing to recompile past the warm-up), only the
    differentiating guards otherwise (torch refuses to recompile there too)."""
    if check_guards or step <= WARMUP_STEPS:
        return contextlib.nullcontext()
    if step % CHECK_EVERY == 0:
        return _no_recompile(step, torch.compiler.set_stance("fail_on_recompile"))
    return _no_recompile(step, torch.compiler.set_stance(skip_guard_eval_unsafe=True))


# what torch raises where a stance forbids compiling (fail_on_recompile; skip_guard_eval_unsafe
# when a differentiating guard fails)
_RECOMPILE_REFUSED = ("fail_on_recompile", "skip_guard_eval_unsafe")


@contextlib.contextmanager
def _no_recompile(step: int, stance):
    try:
        with stance:
            yield
    except RuntimeError as exc:
        if not any(key in str(exc) for key in _RECOMPILE_REFUSED):
            raise
        raise RuntimeError(
            f"generate: the compiled model needed a new graph at decode step {step} although the first "
            f"{WARMUP_STEPS} decode steps did not: its Python state changes during generation, so steps "
            f"that skipped Dynamo's guards may have run a graph that no longer fits; call "
            f"moe_compile.generate(..., check_guards=True) for this model") from exc


def _static_cache(model, input_ids: torch.Tensor, max_cache_len: int):
    """The model's cache from an earlier call, reset, when it holds this batch and length (a longer
    one is fine: the mask hides its unused positions); else a new one, kept for the next call."""
    from transformers import StaticCache

    cache = _caches.get(model)
    if cache is not None and _fits(cache, input_ids.shape[0], max_cache_len):
        cache.reset()
        return cache
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    _allocate(model, cache, input_ids.shape[0])
    _caches[model] = cache
    return cache


def _allocate(model, cache, batch: int) -> None:
    """Allocate the cache's tensors before the first forward call, as HF generate does for a compiled
    prefill.  A lazily allocated cache is allocated inside the first compiled prefill, which then
    guards on ``is_initialized == False``: the next generate call (the cache reset, still allocated)
    compiled a second prefill graph, 15-60 s on a small CPU.  Left lazy where this transformers
    version cannot say the cache's shape (no ``_get_static_cache_init_shape``, or it returns None:
    layers on several devices, MLA heads)."""
    shape_of = getattr(model, "_get_static_cache_init_shape", None)
    shape = shape_of() if callable(shape_of) else None
    if shape is None:
        return
    num_heads, head_dim = shape
    cache.early_initialization(batch_size=batch, num_heads=num_heads, head_dim=head_dim, dtype=model.dtype,
                               device=model.device)


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
