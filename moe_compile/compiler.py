"""The ``moe`` torch.compile backend (module `compiler`, so that `moe_compile.backend` stays the function).

    torch.compile(model, backend="moe", options={"verify": True})
    torch.compile(model, backend="moe", mode="max-autotune")     # mode and Inductor options pass through

Registered once, through the ``torch_dynamo_backends`` entry point in pyproject.toml.

What it did goes to ``logging.getLogger("moe_compile")`` (INFO: one line per compiled graph;
DEBUG: every rewrite and skip, and tracebacks) and to ``last_report()``.  Nothing is printed at
the default log level; the one warning is for a graph the inner compiler failed on, which then
runs without it (once per distinct failure).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import warnings

import torch
import torch.fx as fx

from moe_compile.config import MoEConfig, split_options
from moe_compile.report import Note, Report, Skipped

log = logging.getLogger("moe_compile")

_collectors: list[Report] = []  # explain() listens here while it runs
_since_asked = Report()  # graphs compiled since last_report() was last called
_last_answer = Report()
_graph_ids = itertools.count()  # the process-wide number of each compiled graph, for the log
_warned: set[str] = set()


@contextlib.contextmanager
def collecting_reports():
    report = Report()
    _collectors.append(report)
    try:
        yield report
    finally:
        _collectors.remove(report)


def last_report() -> Report:
    """What the backend did in the graphs it compiled since the previous ``last_report()`` call
    (the previous answer again when it compiled nothing since): after ``compiled(x)``, the
    report of that call's compile, every graph of it."""
    global _since_asked, _last_answer
    if _since_asked.graphs:
        _last_answer, _since_asked = _since_asked, Report()
    return _last_answer


def moe_backend(gm: fx.GraphModule, example_inputs, options=None, mode=None, **kwargs):
    """Entry point of ``backend="moe"``; ``options`` and ``mode`` come from ``torch.compile``.
    moe_compile's own options configure the pass; Inductor's (and ``mode``'s) go to Inductor."""
    own, inductor = split_options({**dict(options or {}), **kwargs}, mode)
    return compile_graph(gm, example_inputs, MoEConfig.from_options(own), inductor)


def rewrite_graph(gm: fx.GraphModule, example_inputs, config: MoEConfig) -> Report:
    """Rewrite gm in place; return the report (also given to explain(), last_report() and the dump)."""
    import moe_compile.ops  # noqa: F401  registers torch.ops.moe_compile.fused_moe
    from moe_compile import dump
    from moe_compile.passes.pipeline import run_moe_pass

    before = copy_module(gm) if config.dump_dir() else None  # the dump draws the region as it was
    report = run_moe_pass(gm, example_inputs, config.min_experts, config.save_fc1, config.quant,
                          config.quant_budget_db())
    moe_only = copy_module(gm) if before is not None else None  # the dump finds regions against this graph
    _rewrite_dense_layers(gm, example_inputs, config, report)
    if not report.rewritten and not report.skipped:
        _say_why_nothing(gm, report)
    _log_graph(next(_graph_ids), report)
    if before is not None:
        folder = dump.write_graph_dump(config.dump_dir(), before, gm, report, moe_only)
        from moe_compile.quant import selection

        for r in report.rewritten:  # quant="auto" writes its measurements there when it makes them
            if r.quant_tag:
                selection.watch_dump(r.quant_tag, folder)
    return report


def _rewrite_dense_layers(gm: fx.GraphModule, example_inputs, config: MoEConfig, report: Report) -> None:
    """After the MoE pass: the graph's other linears onto the dense kernels (passes/linears.py) and
    its grouped-query attention without K/V copies (passes/attention.py)."""
    from moe_compile.passes.attention import run_attention_pass
    from moe_compile.passes.linears import run_linear_pass

    for line in (run_linear_pass(gm, example_inputs, config.dense_format()), run_attention_pass(gm)):
        if line:
            report.notes.append(Note(line))


def _say_why_nothing(gm: fx.GraphModule, report: Report) -> None:
    """A graph with nothing rewritten and nothing refused says which it was: no top-k at all (no
    MoE here), or a top-k whose experts nothing recognised (an MoE left unfused: a skip)."""
    from moe_compile.passes.clusters import is_id_source
    from moe_compile.passes.graph import source_line

    routing = next((n for n in gm.graph.nodes if is_id_source(n)), None)
    if routing is None:
        report.no_topk.append(0)
        return
    where = source_line(routing)
    report.skipped.append(Skipped(
        (f"a top-k at {where}" if where else "a top-k") + ", but nothing after it was recognised as MoE experts "
        "(no expert FFN, FC1 GEMM -> activation -> FC2 GEMM on per-expert weights, reads its ids or weights): if it "
        "routes an MoE, that MoE is left unfused to the inner compiler"))


def record(report: Report, last_report: bool = True) -> None:
    """Hand a finished graph's report to explain()'s collectors and (unless ``last_report`` is False:
    explain()'s own traces, which compile nothing the user runs) to last_report()."""
    for collector in _collectors:
        collector.extend(report)
    if last_report:
        _since_asked.extend(report)


def _log_graph(graph_id: int, report: Report) -> None:
    log.info("graph %d: %d MoE region(s) rewritten, %d skipped", graph_id, len(report.rewritten),
             len(report.skipped))
    if log.isEnabledFor(logging.DEBUG):
        for kind, entries in (("rewritten", report.rewritten), ("skipped", report.skipped)):
            for entry in entries:
                log.debug("graph %d: %s:%s", graph_id, kind, entry.line().split("]", 1)[-1])


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def compile_graph(gm: fx.GraphModule, example_inputs, config: MoEConfig, inductor_options: dict | None = None):
    original = copy_module(gm) if config.verify else None
    report = rewrite_graph(gm, example_inputs, config)
    compiled = _compile_rewritten(gm, example_inputs, config, inductor_options, report)
    record(report)
    if original is not None and report.rewritten:
        return VerifyFirstCall(compiled, original, example_inputs, config)
    return compiled


def _compile_rewritten(gm: fx.GraphModule, example_inputs, config: MoEConfig, inductor_options: dict | None,
                       report: Report):
    """inner_compile, with Inductor's C++ wrapper for a decode step (decoding/step.py); where that
    wrapper fails to build, the same graph again with the Python wrapper."""
    from moe_compile.decoding import step as decode_step

    patches, line = (decode_step.inductor_patches(gm, example_inputs, inductor_options) if config.inner == "inductor"
                     else (inductor_options, None))
    if line is None:
        return inner_compile(gm, example_inputs, config, inductor_options, report)
    from torch._dynamo.exc import RestartAnalysis, SkipFrame

    try:
        compiled = inner_compile(gm, example_inputs, config, patches, report=None, strict=True)
    except (RestartAnalysis, SkipFrame):  # Dynamo's retrace signals, not failures
        raise
    except Exception as exc:  # noqa: BLE001 — the C++ wrapper did not build: the Python wrapper instead
        from moe_compile.passes.pipeline import describe

        log.debug("Inductor's C++ wrapper failed on the graph; Python wrapper instead", exc_info=True)
        report.notes.append(Note(f"decode step: Inductor's C++ wrapper failed ({describe(exc)}); compiled with "
                                 f"its Python wrapper"))
        return inner_compile(gm, example_inputs, config, inductor_options, report)
    report.notes.append(Note(line))
    return compiled


def inner_compile(gm: fx.GraphModule, example_inputs, config: MoEConfig, inductor_options: dict | None = None,
                  report: Report | None = None, strict: bool = False):
    """The inner compiler's callable for gm; where Inductor fails, gm itself (eager), with a
    warning once per distinct failure and a note in the report: the backend runs wherever
    ``backend="eager"`` does.  ``strict``: raise Inductor's failure instead (the caller retries)."""
    if config.inner == "eager":
        return gm.forward
    from torch._dynamo.exc import RestartAnalysis, SkipFrame
    from torch._inductor.compile_fx import compile_fx

    try:
        return compile_fx(gm, example_inputs, config_patches=inductor_options or None)
    except (RestartAnalysis, SkipFrame):  # raised inside Inductor to make Dynamo retrace: signals, not failures
        raise
    except Exception as exc:  # noqa: BLE001 — any Inductor failure: run the graph as it is
        if strict:
            raise
        from moe_compile.passes.pipeline import describe

        reason = describe(exc)
        log.debug("Inductor failed on the graph; it runs without Inductor", exc_info=True)
        if report is not None:
            report.notes.append(Note(f"Inductor failed on this graph ({reason}); it runs without Inductor "
                                     f"(as backend='eager' would)"))
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"moe_compile: Inductor failed on a graph ({reason}); that graph runs without Inductor. "
                          f"Details: logging.getLogger('moe_compile') at DEBUG", RuntimeWarning, stacklevel=2)
        return gm.forward


class VerifyFirstCall:
    """Runs the original graph beside the rewritten one on the first real call and compares.

    A match within the dtype's tolerance is logged at INFO with the measured error; a mismatch
    switches this graph back to the original (compiled by the inner compiler) for good and warns
    with the measured error.
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
        tolerance = min((tol for _, tol in errors), default=0.0)
        if any(e > tol for e, tol in errors):
            warnings.warn(
                f"moe_compile verify: the fused graph differs from the original by {self.last_error:.2e} "
                f"(relative); falling back to the original graph", RuntimeWarning, stacklevel=2,
            )
            self.compiled = inner_compile(self.original, self.example_inputs, self.config)
            return self.compiled(*args)
        log.info("verify: the fused graph equals the original on the first call (max relative error "
                 "%.2e, tolerance %.0e)", self.last_error, tolerance)
        return got


def _flat(out):
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return [out]
