"""User surfaces: ``backend(config)``, ``@optimize``, ``explain``."""

from __future__ import annotations

import contextlib
import functools

import torch

from moe_compile.config import MoEConfig
from moe_compile.report import Report, Skipped


def capture_flags():
    """Dynamo settings that let per-expert loops (``where``/``nonzero``/``.item()``) stay in one graph."""
    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)


def empty_cache() -> dict:
    """Give back the CPU memory the fused op keeps between calls: expert weights packed for oneDNN
    (``kernels/cpu_prepack``), stacked weight gradients' buffers (``kernels/cpu_grad_cache``) and
    quantized packs with quant="auto"'s choices (``kernels/cpu/quant.py``).
    Returns the bytes each held before.  Nothing is lost: packs are rebuilt and buffers made
    afresh when later calls need them; a gradient still alive keeps its memory until freed."""
    from moe_compile.kernels.cpu import grad_cache as cpu_grad_cache, prepack as cpu_prepack

    from moe_compile.kernels.cpu import quant as cpu_quant

    held = {"packed_weights": cpu_prepack.stats()["bytes"], "gradient_buffers": cpu_grad_cache.held_bytes(),
            "quantized_weights": cpu_quant.stats()["bytes"]}
    cpu_prepack.clear()
    cpu_grad_cache.clear()
    cpu_quant.clear()
    return held


def backend(config: MoEConfig | dict | None = None, **options):
    """A backend callable for ``torch.compile(model, backend=moe_compile.backend(...))``."""
    from moe_compile.compiler import compile_graph

    cfg = MoEConfig.from_options(config, **options)

    def moe(gm, example_inputs):
        return compile_graph(gm, example_inputs, cfg)

    return moe


def optimize(fn=None, /, *, dynamic=None, fullgraph=False, **options):
    """Decorator: ``@optimize`` or ``@optimize(verify=True, dump="dir")`` on ``forward`` or a function."""
    cfg = MoEConfig.from_options(options)

    def decorate(f):
        compiled = torch.compile(f, backend=backend(cfg), dynamic=dynamic, fullgraph=fullgraph)

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            with capture_flags():
                return compiled(*args, **kwargs)

        wrapper._moe_compiled = compiled
        return wrapper

    return decorate(fn) if fn is not None else decorate


def explain(module_or_fn, *example_inputs, **options) -> Report:
    """What ``backend="moe"`` would rewrite in ``module_or_fn(*example_inputs)``, and why not.

    Traces with Dynamo and runs the MoE pass (including its proof); the rewritten graphs are never
    executed — the traced function runs once, unmodified, to let Dynamo see every graph — except
    with ``quant="auto"``, whose graphs run rewritten in that one run so that each layer measures
    its candidates and the report shows what it chose.  Dynamo's
    caches are reset before and after (explain's traces must not linger in them), so functions
    compiled earlier recompile on their next call.
    """
    from moe_compile.compiler import collecting_reports, rewrite_graph

    cfg = MoEConfig.from_options(options)

    def explain_backend(gm, inputs):
        from moe_compile.compiler import copy_module

        original = copy_module(gm)
        report = rewrite_graph(gm, inputs, cfg)
        if any(r.variant == "auto" for r in report.rewritten):
            return gm.forward  # quant="auto" chooses on a real call: this run is the one it measures
        return original.forward

    with collecting_reports() as report, capture_flags(), torch.no_grad():
        torch._dynamo.reset()
        torch.compile(module_or_fn, backend=explain_backend)(*example_inputs)
        breaks = _graph_breaks(module_or_fn, example_inputs)
    torch._dynamo.reset()
    report.skipped += breaks
    return report


def _graph_breaks(fn, example_inputs) -> list[Skipped]:
    """Where Dynamo had to split the graph: an MoE cut there cannot be rewritten as one region."""
    with contextlib.suppress(Exception):
        out = torch._dynamo.explain(fn)(*example_inputs)
        result = []
        for reason in out.break_reasons:
            frame = reason.user_stack[-1] if reason.user_stack else None
            where = f" at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}" if frame else ""
            text = str(reason.reason).strip().splitlines()[0][:300]
            result.append(Skipped(f"Dynamo could not capture this in one graph ({text}){where}; an MoE cut here "
                                  f"is not rewritten"))
        return result
    return []
