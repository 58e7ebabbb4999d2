"""User surfaces: ``backend(config)``, ``@optimize``, ``explain``, ``last_report``."""

from __future__ import annotations

import dataclasses
import functools

import torch

from moe_compile.config import MoEConfig, split_options
from moe_compile.report import Note, Report, Skipped


def capture_flags(fn=None, /):
    """Dynamo settings that let per-expert loops (``where``/``nonzero``/``.item()``) stay in one graph.

    ``with capture_flags(): compiled(x)`` sets them around a call.  ``capture_flags(compiled)`` returns
    ``compiled`` wrapped so that each call runs under them and, where Dynamo raises under them what it
    would not raise without (``torch.bincount`` + ``for n in counts.tolist()``: an unbacked length it
    cannot iterate), the call runs again without them, as plain ``torch.compile`` would run it; the
    report names the line (``@optimize`` wraps its function this way).  A ``with`` block cannot run its
    body twice, so only the wrapped form falls back."""
    flags = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)
    return flags if fn is None else functools.wraps(fn)(_under_flags(fn, flags))


def _under_flags(fn, flags):
    def call_under_flags(*args, **kwargs):
        config = torch._dynamo.config
        if config.capture_dynamic_output_shape_ops and config.capture_scalar_outputs:
            return fn(*args, **kwargs)  # already on: moe_compile turned nothing on to fall back from
        try:
            with flags:
                return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 — only Dynamo's own tracing errors are retried
            if not _raised_while_tracing(exc):
                raise
            _record_fallback(exc)
        # Frames Dynamo compiled before the failure keep their cache entries (their guards pass
        # again); only the frame that raised is traced anew, now without the flags.  The graphs that
        # ran before the failure run once more: a forward with side effects outside its outputs
        # (a cache written in place) repeats them.
        return fn(*args, **kwargs)

    return call_under_flags


def _raised_while_tracing(exc: BaseException) -> bool:
    """Whether exc is Dynamo failing to trace (not the model's own error, not the backend's: an explicit
    ``quant=`` this device cannot run stays the user's error to see)."""
    from torch._dynamo import exc as dynamo_exc
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(exc, dynamo_exc.BackendCompilerFailed):
        return False
    return isinstance(exc, (GuardOnDataDependentSymNode, dynamo_exc.TorchDynamoException))


def _record_fallback(exc: Exception) -> None:
    from moe_compile.compiler import record

    refusal = _dynamo_refusal("Dynamo raised under the capture flags moe_compile set", exc)
    record(Report(skipped=[Skipped(refusal.reason + FELL_BACK)]))


FELL_BACK = ("; that frame was compiled again without capture_dynamic_output_shape_ops / capture_scalar_outputs "
             "(as plain torch.compile compiles it: split at that line)")


def empty_cache() -> dict:
    """Give back the CPU memory the fused op keeps between calls: expert weights packed for oneDNN
    (``kernels/cpu/prepack.py``), stacked weight gradients' buffers (``kernels/cpu/grad_cache.py``) and
    quantized packs with quant="auto"'s choices (``kernels/cpu/quant.py``) and dense linears' packs
    (``quant_dense``, ``kernels/cpu/dense.py``) with the calling thread's buffer for their prefill
    calls' dequantized weights.
    Returns the bytes each held before.  Nothing is lost: packs are rebuilt and buffers made
    afresh when later calls need them; a gradient still alive keeps its memory until freed."""
    from moe_compile.kernels.cpu import dense as cpu_dense, grad_cache as cpu_grad_cache, prepack as cpu_prepack
    from moe_compile.kernels.cpu import quant as cpu_quant

    dense = cpu_dense.stats()
    held = {"packed_weights": cpu_prepack.stats()["bytes"], "gradient_buffers": cpu_grad_cache.held_bytes(),
            "quantized_weights": cpu_quant.stats()["bytes"],
            "dense_weights": dense["dense_pack_bytes"] + dense["dense_panel_bytes"],
            "dense_prefill_scratch": dense["dense_prefill_scratch_bytes"]}
    cpu_dense.clear()
    cpu_prepack.clear()
    cpu_grad_cache.clear()
    cpu_quant.clear()
    return held


def backend(config: MoEConfig | dict | None = None, **options):
    """A backend callable for ``torch.compile(model, backend=moe_compile.backend(...))``; options that
    are not moe_compile's (``mode``, Inductor config entries) go to Inductor, as with ``backend="moe"``."""
    from moe_compile.compiler import compile_graph

    cfg, inductor = _config_and_inductor(config, options)

    def moe(gm, example_inputs):
        return compile_graph(gm, example_inputs, cfg, inductor)

    return moe


def _config_and_inductor(config, options: dict) -> tuple[MoEConfig, dict]:
    mode = options.pop("mode", None)
    if isinstance(config, MoEConfig):
        own, inductor = split_options(options, mode)
        return MoEConfig.from_options(config, **own), inductor
    own, inductor = split_options({**dict(config or {}), **options}, mode)
    return MoEConfig.from_options(own), inductor


def optimize(fn=None, /, *, dynamic=None, fullgraph=False, **options):
    """Decorator: ``@optimize`` or ``@optimize(verify=True, dump="dir")`` on ``forward`` or a function.
    Options are ``MoEConfig``'s, plus ``mode`` and Inductor config entries (passed to Inductor)."""
    moe = backend(None, **options)

    def decorate(f):
        compiled = torch.compile(f, backend=moe, dynamic=dynamic, fullgraph=fullgraph)
        wrapper = functools.wraps(f)(_under_flags(compiled, capture_flags()))  # falls back where they make Dynamo raise
        wrapper._moe_compiled = compiled
        return wrapper

    return decorate(fn) if fn is not None else decorate


def explain(module_or_fn, *example_inputs, **options) -> Report:
    """What ``backend="moe"`` would rewrite in ``module_or_fn(*example_inputs)``, and why not.

    Traces with Dynamo (with the capture flags ``@optimize`` sets) and runs the MoE pass
    (including its proof).  The traced function runs once, to let Dynamo see every graph: unmodified
    without ``quant``; with ``quant=`` set, its graphs run rewritten in that one run, so that each
    quantized layer measures what it costs (``"auto"``: every candidate and its choice; a format:
    the SQNR of the layer's output against the unquantized op) and the report shows it.  Where
    Dynamo split the function (a graph break, a skipped frame: the model came in several graphs),
    one more trace with ``fullgraph=True`` finds the first line that split it, and the report names
    that line and the change that fixes it.  An error the backend itself raises (an explicit
    ``quant=`` this device has no kernel for) is raised as ``torch.compile`` would raise it.
    Dynamo's caches are reset before and after (explain's traces must not linger in them), so
    functions compiled earlier recompile on their next call; ``last_report()`` does not count
    explain's graphs.
    """
    from moe_compile.compiler import collecting_reports, copy_module, record, rewrite_graph

    from torch._dynamo.exc import BackendCompilerFailed

    cfg = MoEConfig.from_options(options)
    needs_flags, split, sqnr = [], [], {}

    def explain_backend(gm, inputs):
        original = copy_module(gm)
        report = rewrite_graph(gm, inputs, cfg)
        if report.rewritten and (line := _data_dependent_line(original)) is not None:
            needs_flags.append(line)
        reason = getattr(gm, "compile_subgraph_reason", None)  # Dynamo's: why this graph ended where it did
        split.append(bool(getattr(reason, "graph_break", False)))
        record(report, last_report=False)  # explain's graphs are not the user's compile
        if any(r.variant == "auto" for r in report.rewritten):
            return gm.forward  # quant="auto" chooses on a real call: this run is the one it measures
        if any(r.quant_tag for r in report.rewritten):
            return _QuantMeter(gm, sqnr).run  # an explicit format: measure each layer's error on this run
        return original.forward

    with collecting_reports() as report, capture_flags(), torch.no_grad():
        torch._dynamo.reset()
        try:
            torch.compile(module_or_fn, backend=explain_backend)(*example_inputs)
        except BackendCompilerFailed as exc:  # the backend's own error (quant= this device cannot run)
            torch._dynamo.reset()
            raise exc.inner_exception from None  # what torch.compile would raise, without Dynamo's wrapping
        except Exception as exc:  # noqa: BLE001 — Dynamo could not trace it at all: that is the answer
            report.skipped.append(dataclasses.replace(_dynamo_refusal("Dynamo failed to trace this", exc), graph=None))
        else:
            if len(split) != 1 or any(split):  # a graph break, or frames skipped around sub-graphs
                report.skipped += _first_split(module_or_fn, example_inputs)
    torch._dynamo.reset()
    if needs_flags:
        report.notes.append(Note(NEEDS_FLAGS.format(line=needs_flags[0])))
    report.rewritten = [dataclasses.replace(r, quant_sqnr_db=sqnr[r.quant_tag]) if r.quant_tag in sqnr else r
                        for r in report.rewritten]
    return report


class _QuantMeter(torch.fx.Interpreter):
    """Runs a rewritten graph and, beside each call of an explicitly quantized op, the unquantized op
    on the same inputs: ``sqnr[tag]`` is the SQNR (dB) of that layer's output against it, the error a
    user buys with ``quant=FORMAT`` (the proof only checked the pattern against the unquantized op)."""

    def __init__(self, gm, sqnr: dict):
        super().__init__(gm)
        self.sqnr = sqnr

    def call_function(self, target, args, kwargs):
        out = super().call_function(target, args, kwargs)
        if target is torch.ops.moe_compile.fused_moe_quant.default and args[-3] != "auto":
            from moe_compile.quant.int8 import sqnr_db

            want = torch.ops.moe_compile.fused_moe_infer.default(*args[:-3])
            tag = args[-1]
            self.sqnr[tag] = min(self.sqnr.get(tag, float("inf")), sqnr_db(want, out))  # the worst call
        return out


NEEDS_FLAGS = ("the rewritten MoE code has data-dependent sizes ({line}): a plain torch.compile(model, backend='moe') "
               "splits it there unless torch._dynamo.config.capture_dynamic_output_shape_ops = True and "
               "capture_scalar_outputs = True are set; @moe_compile.optimize sets both (explain() did)")


def _data_dependent_line(gm) -> str | None:
    """The source line of the first node whose value has a size known only at run time
    (``nonzero``, ``where(mask)``, ``.item()``, ``.tolist()``), or None when there is none."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from moe_compile.passes.graph import source_line

    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op != "placeholder" and value is not None and free_unbacked_symbols(value):
            return source_line(node) or node.format_node()
    return None


def _first_split(fn, example_inputs) -> list[Skipped]:
    """The first line where Dynamo cannot keep ``fn`` in one graph, with the change that fixes it."""
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=lambda gm, inputs: gm.forward, fullgraph=True)(*example_inputs)
    except Exception as exc:  # noqa: BLE001 — Dynamo's refusal (Unsupported, UserError, ...) is the answer
        return [dataclasses.replace(_dynamo_refusal("Dynamo could not capture this in one graph", exc), graph=None)]
    return []


def _dynamo_refusal(what: str, exc: Exception) -> Skipped:
    """A skip naming the user's line Dynamo stopped at (its ``real_stack``), its reason and the fix."""
    frames = getattr(exc, "real_stack", None) or []
    frame = frames[-1] if frames else None
    where = f" at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}" if frame else ""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    line = (frame.line or "").strip() if frame else ""
    return Skipped(f"{what}{where} ({text}); an MoE cut there is not rewritten: {_fix_for(str(exc), line)}")


def _fix_for(message: str, line: str = "") -> str:
    """The change a user makes for Dynamo's most common reasons to split an MoE block (``line``:
    the user's code where Dynamo stopped)."""
    if line.startswith(("for ", "while ")) and "data-dependent" in message:
        return ("loop over range(num_experts) instead of a data-dependent set of experts (HF transformers' "
                "experts_implementation='eager' iterates `expert_hit`: load the model with experts_implementation="
                "'grouped_mm' or 'batched_mm')")
    if "bincount" in message:
        return ("Dynamo cannot trace torch.bincount: count with torch.histc(ids.float(), bins=E, min=0, max=E - 1), "
                "or drop the counts and the `if counts[i] == 0: continue` they serve (the fused op handles experts "
                "that receive no tokens)")
    if "data-dependent" in message or "Data-dependent" in message:
        return ("remove the data-dependent branch (e.g. `if tok.numel() == 0: continue`, `if counts[i] == 0: "
                "continue`): the fused op handles experts that receive no tokens")
    if "capture_dynamic_output_shape_ops" in message or "capture_scalar_outputs" in message:
        return ("set torch._dynamo.config.capture_dynamic_output_shape_ops = True and capture_scalar_outputs = True, "
                "or compile with @moe_compile.optimize (it sets both)")
    return "make this line traceable by Dynamo (torch.compile's graph-break documentation lists the usual changes)"
