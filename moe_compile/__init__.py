"""moe_compile: a torch.compile backend that fuses unmodified Mixture-of-Experts layers.

    torch.compile(model, backend="moe")            # after `pip install moe-compile`
    @moe_compile.optimize(verify=True)             # decorator on forward or a function
    moe_compile.explain(model, x)                  # what would be rewritten, and why not
    moe_compile.empty_cache()                      # give back packed weights and gradient buffers

Importing this package registers nothing and never initialises CUDA; the fused op is registered
when the backend first runs.
"""

from moe_compile.api import backend, empty_cache, explain, optimize
from moe_compile.config import MoEConfig

__all__ = ["MoEConfig", "backend", "empty_cache", "explain", "optimize"]
__version__ = "0.1.0"
