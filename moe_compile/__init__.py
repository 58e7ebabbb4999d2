"""moe_compile: a torch.compile backend that fuses unmodified Mixture-of-Experts layers.

    torch.compile(model, backend="moe")            # after `pip install moe-compile`
    @moe_compile.optimize(verify=True)             # decorator on forward or a function
    moe_compile.explain(model, x)                  # what would be rewritten, and why not
    moe_compile.empty_cache()                      # give back packed weights and gradient buffers
    moe_compile.last_report()                      # what the backend did in the graphs it compiled last

What the backend does is logged to ``logging.getLogger("moe_compile")``: INFO one line per compiled
graph, DEBUG every rewrite and skip with tracebacks (``TORCH_LOGS="+moe_compile"`` enables it too).

Importing this package registers nothing and never initialises CUDA; the fused op is registered
when the backend first runs.
"""

from moe_compile.api import backend, empty_cache, explain, optimize
from moe_compile.compiler import last_report
from moe_compile.config import MoEConfig

__all__ = ["MoEConfig", "backend", "empty_cache", "explain", "last_report", "optimize"]
__version__ = "0.1.0"
