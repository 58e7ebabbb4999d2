"""The ``moe`` torch.compile backend (module `compiler`, so that `moe_compile.backend` stays the function).

    torch.compile(model, backend="moe", options={"verify": True})

Registered once, through the ``torch_dynamo_backends`` entry point in pyproject.toml.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.fx as fx

from moe_compile.config import MoEConfig
from moe_compile.report import Report

_collectors: list[Report] = []  # explain() listens here while it runs


@contextlib.contextmanager
def collecting_reports():
    report = Report()
    _collectors.append(report)
    try:
        yield report
    finally:
        _collectors.remove(report)


def moe_backend(gm: fx.GraphModule, example_inputs, options=None, **kwargs):
    """Entry point of ``backend="moe"``; ``options`` come from ``torch.compile(..., options=...)``."""
    return compile_graph(gm, example_inputs, MoEConfig.from_options(options, **kwargs))


def rewrite_graph(gm: fx.GraphModule, example_inputs, config: MoEConfig) -> Report:
    """Rewrite gm in place; return the report (also given to explain() and the dump)."""
    import moe_compile.ops  # noqa: F401  registers torch.ops.moe_compile.fused_moe
    from moe_compile import dump
    from moe_compile.passes.pipeline import run_moe_pass

    before = copy_module(gm) if config.dump_dir() else None  # the dump draws the region as it was
    report = run_moe_pass(gm, example_inputs, config.min_experts, config.save_fc1)
    for collector in _collectors:
        collector.extend(report)
    if before is not None:
        dump.write_graph_dump(config.dump_dir(), before, gm, report)
    return report


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def compile_graph(gm: fx.GraphModule, example_inputs, config: MoEConfig):
    original = copy_module(gm) if config.verify else None
    report = rewrite_graph(gm, example_inputs, config)
    compiled = inner_compile(gm, example_inputs, config)
    if original is not None and report.rewritten:
        return VerifyFirstCall(compiled, original, example_inputs, config)
    return compiled


def inner_compile(gm: fx.GraphModule, example_inputs, config: MoEConfig):
    if config.inner == "eager":
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


class VerifyFirstCall:
    """Runs the original graph beside the rewritten one on the first real call and compares.

    A mismatch beyond the dtype's tolerance switches this graph back to the original (compiled
    by the inner compiler) for good and warns with the measured error.
    """

    def __init__(self, compiled, original: fx.GraphModule, example_inputs, config: MoEConfig):
        self.compiled, self.original, self.config = compiled, original, config
        self.example_inputs = example_inputs
        self.checked = False
        self.last_error: float | None = None

    def __call__(self, *args):
        if self.checked:
            return self.compiled(*args)
        from moe_compile.passes.prove import PROOF_TOLERANCE, relative_error

        with torch.no_grad():
            want = self.original(*args)
        got = self.compiled(*args)
        self.checked = True
        errors = [
            (relative_error(g, w), PROOF_TOLERANCE.get(w.dtype, 3e-2))
            for g, w in zip(_flat(got), _flat(want))
            if isinstance(w, torch.Tensor) and w.is_floating_point() and w.numel()
        ]
        self.last_error = max((e for e, _ in errors), default=0.0)
        if any(e > tol for e, tol in errors):
            warnings.warn(
                f"moe_compile verify: the fused graph differs from the original by {self.last_error:.2e} "
                f"(relative); falling back to the original graph", RuntimeWarning, stacklevel=2,
            )
            self.compiled = inner_compile(self.original, self.example_inputs, self.config)
            return self.compiled(*args)
        return got


def _flat(out):
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return [out]
