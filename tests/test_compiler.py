"""The backend works wherever backend="eager" works: the inner compiler's failure, options it does
not own, bad inputs, a matcher's exception, a failed rewrite, what a rewrite leaves dead."""

import warnings

import pytest
import torch
import torch.fx as fx

from moe_compile import compiler
from moe_compile.models import zoo
from moe_compile.api import capture_flags
from moe_compile.config import split_options
from moe_compile.passes import lift, pipeline
from moe_compile.passes.dead_code import live_before, remove_dead_splits
from tests.conftest import TOL, rel_err, run_compiled


def _failing_inductor(calls):
    def compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        calls.append(config_patches)
        raise RuntimeError("GuardOnDataDependentSymNode: u0 < 0 (Inductor, simulated)")

    return compile_fx


def test_inductor_failure_runs_the_rewritten_graph_warns_once_and_says_so(monkeypatch):
    import torch._inductor.compile_fx as inductor

    calls = []
    monkeypatch.setattr(inductor, "compile_fx", _failing_inductor(calls))
    monkeypatch.setattr(compiler, "_warned", set())
    block = zoo.ModuleListMoE(experts=4)
    x = torch.randn(1, 5, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, report = run_compiled(block, x, inner="inductor")
        again, _ = run_compiled(zoo.ModuleListMoE(experts=4), x, inner="inductor")  # same failure: no second warning
    assert len(calls) == 2 and len(report.rewritten) == 1
    assert rel_err(got, block(x)) <= TOL[torch.float32]
    ours = [w for w in caught if "Inductor failed" in str(w.message)]
    assert len(ours) == 1 and "GuardOnDataDependentSymNode" in str(ours[0].message)
    assert "runs without Inductor" in str(report) and "GuardOnDataDependentSymNode" in str(report)


@pytest.mark.parametrize("how, want", [
    ({"mode": "max-autotune"}, {"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": True}),
    ({"options": {"max_autotune": True, "verify": False}}, {"max_autotune": True}),
])
def test_mode_and_inductor_options_pass_through(monkeypatch, how, want):
    import torch._inductor.compile_fx as inductor

    calls = []
    monkeypatch.setattr(inductor, "compile_fx", _failing_inductor(calls))  # records what Inductor would get
    torch._dynamo.reset()
    with capture_flags(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.compile(zoo.GatheredMoE(), backend="moe", **how)(torch.randn(1, 3, 64))
    assert calls == [want]


def test_options_split_between_moe_compile_and_inductor():
    assert split_options({"verify": True, "epilogue_fusion": False}) == ({"verify": True}, {"epilogue_fusion": False})
    with pytest.raises(ValueError, match="did you mean moe_compile's 'verfy' -> 'verify'"):
        split_options({"verfy": True})
    with pytest.raises(ValueError, match="valid options are moe_compile's"):
        split_options({"no_such_thing": 1})
    with pytest.raises(ValueError, match="mode='fastest' is unknown"):
        split_options({}, mode="fastest")


def test_misspelt_option_is_an_error_naming_it():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="'inenr' -> 'inner'"):
        torch.compile(zoo.GatheredMoE(), backend="moe", options={"inenr": "eager"})(torch.randn(1, 3, 64))


def test_wrong_dtype_input_gives_the_eager_error():
    block = zoo.ModuleListMoE(experts=4)
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    with pytest.raises(RuntimeError) as eager:
        block(x)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError) as compiled, capture_flags():
        torch.compile(block, backend="moe", options={"inner": "eager"})(x)
    assert type(compiled.value) is type(eager.value) and str(compiled.value) == str(eager.value)


def test_a_matcher_exception_becomes_a_skip_with_its_name(monkeypatch, caplog):
    def broken(graph, deps, candidate, values):
        raise ZeroDivisionError("matcher bug")

    monkeypatch.setattr(pipeline, "FAMILIES", tuple((name, claims, broken) for name, claims, _ in pipeline.FAMILIES))
    block = zoo.ModuleListMoE(experts=4)
    x = torch.randn(1, 5, 64)
    with caplog.at_level("DEBUG", logger="moe_compile"):
        got, report = run_compiled(block, x)
    assert report.rewritten == [] and torch.equal(got, block(x))
    (skip,) = report.skipped
    assert "the loop matcher failed on this candidate (ZeroDivisionError: matcher bug)" in skip.reason
    assert any("ZeroDivisionError" in (r.exc_text or "") for r in caplog.records)  # the traceback at DEBUG


def test_a_failed_rewrite_leaves_the_graph_as_it_was(monkeypatch):
    def broken(self, graph, deps, save_fc1=True):
        with graph.inserting_after(self.region.output):  # half done (users rerouted to a wrong value), then fails
            wrong = graph.call_function(torch.neg, (self.region.output,))
        self.region.output.replace_all_uses_with(wrong, delete_user_cb=lambda user: user is not wrong)
        raise RuntimeError("rewrite bug")

    monkeypatch.setattr(lift.Match, "replace_with_fused_op", broken)
    block = zoo.GatheredMoE()
    x = torch.randn(1, 3, 64)
    got, report = run_compiled(block, x)
    assert report.rewritten == [] and "rewriting failed (RuntimeError: rewrite bug)" in report.skipped[0].reason
    assert torch.equal(got, block(x))


def test_dead_host_reads_and_their_checks_are_removed():
    graph = fx.Graph()
    x, counts = graph.placeholder("x"), graph.placeholder("counts")
    n = graph.call_method("item", (counts,))
    n.meta["example_value"] = 3
    graph.call_function(torch._check_is_size, (n,))
    nonneg = graph.call_function(__import__("operator").ge, (n, 0))
    nonneg.meta["example_value"] = True
    graph.call_function(torch._check, (nonneg,))
    region = graph.call_function(torch.split, (x, n))  # what a rewrite replaces: the only reader of n
    noise = graph.call_function(torch.rand, ((2,),))
    graph.call_method("add_", (x, noise))  # in place
    graph.call_function(torch._C._set_grad_enabled, (False,))  # never had a reader: not the rewrite's to remove
    graph.call_method("sum", (x,))  # a dead value the graph held already: left as it was
    graph.output(graph.call_function(torch.mul, (x, 2)))
    was_live = live_before(graph)
    graph.erase_node(region)  # the rewrite
    assert remove_dead_splits(graph, was_live) == 4  # item, _check_is_size, ge, _check
    assert [n.target for n in graph.nodes if n.op == "call_method"] == ["add_", "sum"]
    assert {torch.rand, torch._C._set_grad_enabled} <= {n.target for n in graph.nodes}


def test_flags_that_make_dynamo_raise_are_dropped_for_that_call():
    """bincount + ``for n in counts.tolist()`` raises under the capture flags (not without): @optimize
    and capture_flags(compiled) run it as plain torch.compile does, and the report names the line."""
    import moe_compile

    block = zoo.BincountSplitMoE(experts=4)
    x = torch.randn(1, 9, 64)
    with torch.no_grad():
        want = block(x)
        with pytest.raises(Exception, match="data-dependent"), capture_flags():
            torch.compile(block, backend="moe", options={"inner": "eager"})(x)
        torch._dynamo.reset()
        wrapped = (moe_compile.optimize(block.forward, inner="eager"),
                   capture_flags(torch.compile(block, backend="moe", options={"inner": "eager"})))
        for fn in wrapped:
            torch._dynamo.reset()
            with compiler.collecting_reports() as report:
                got = fn(x)
            assert rel_err(got, want) <= TOL[torch.float32]
            fell_back = [s.reason for s in report.skipped if "compiled again without" in s.reason]
            assert fell_back and "counts.tolist()" in fell_back[0], report
