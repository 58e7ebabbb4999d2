"""moe_compile: a torch.compile backend that fuses unmodified Mixture-of-Experts layers.

    torch.compile(model, backend="moe")            # after `pip install moe-compile`
    @moe_compile.optimize(verify=True)             # decorator on forward or a function
    moe_compile.explain(model, x)                  # what would be rewritten, and why not
    moe_compile.empty_cache()                      # give back packed weights and gradient buffers
    moe_compile.last_report()                      # what the backend did in the graphs it compiled last
    moe_compile.generate(model, ids, 64)           # greedy HF decoding, static cache, no per-step Python
    moe_compile.load("model.gguf")                 # a GGUF / safetensors checkpoint, packed as it is read

What the backend does is logged to ``logging.getLogger("moe_compile")``: INFO one line per compiled
graph, DEBUG every rewrite and skip with tracebacks (``TORCH_LOGS="+moe_compile"`` enables it too).

Importing this package registers nothing and never initialises CUDA; the fused op is registered
when the backend first runs.
"""

import importlib
import warnings

__all__ = ["MoEConfig", "backend", "empty_cache", "explain", "generate", "last_report", "load", "optimize"]
__version__ = "0.1.0"

# Loaded on first use (PEP 562), so that ``import moe_compile.cli`` (``moe-compile --help``) does not
# import torch, which takes seconds on a cold disk.
_HOME = {"backend": "api", "empty_cache": "api", "explain": "api", "optimize": "api", "last_report": "compiler",
         "MoEConfig": "config", "generate": "decoding", "load": "loading"}


# Modules that moved into subpackages: ``from moe_compile import zoo`` keeps working, with a
# DeprecationWarning naming the new home (``import moe_compile.zoo`` does not: import the new path).
_MOVED = {"zoo": "models.zoo", "zoo_ep": "models.zoo_ep", "llamacpp": "models.llamacpp", "decode_step": "decoding.step",
          "autograd": "ops.autograd", "dense_ops": "ops.dense_linear", "attention_ops": "ops.decode_attention",
          "packed_ops": "ops.packed"}


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(f"moe_compile.{name} moved to moe_compile.{_MOVED[name]}; import it from there",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(f"moe_compile.{_MOVED[name]}")
    if name in _HOME:
        value = getattr(importlib.import_module(f"moe_compile.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    try:  # a submodule not imported yet (``moe_compile.api.capture_flags()`` after ``import moe_compile``)
        return importlib.import_module(f"moe_compile.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"moe_compile.{name}":
            raise
        raise AttributeError(f"module 'moe_compile' has no attribute {name!r}") from None


def __dir__():
    return sorted({*globals(), *__all__})
