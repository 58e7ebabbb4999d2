"""Reports a user can act on: the line that kept an MoE out of one graph and the change that
fixes it, identical skips merged, T = 0 proved at the next call, last_report()."""

import pytest
import torch
import torch.nn.functional as F

import moe_compile
from moe_compile.models import zoo
from moe_compile.api import capture_flags
from moe_compile.compiler import collecting_reports
from moe_compile.passes.pipeline import NO_TOKENS
from moe_compile.report import Report, Skipped
from tests.conftest import TOL, rel_err


class SkipsEmptyExperts(zoo.ModuleListMoE):
    """HF v4's loop with the common guard ``if tok.numel() == 0: continue``."""

    def forward(self, hidden_states):
        x = hidden_states.view(-1, hidden_states.shape[-1])
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            top, tok = torch.where(mask[e])
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, top, None])
        return out.view(hidden_states.shape)


class SkipsByCounts(zoo.DeepSeekOfficialMoE):
    """DeepSeek's official loop: per-expert counts read to the host, ``if counts[i] == 0: continue``."""

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, shape[-1])
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.histc(indices.flatten().float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        counts = counts.int().tolist()
        for i in range(self.num_experts):
            if counts[i] == 0:
                continue
            idx, top = torch.where(indices == i)
            y[idx] += self.experts[i](x[idx]) * weights[idx, top, None]
        return (y + self.shared_experts(x)).view(shape)


class LoopsOverHitExperts(zoo.GatheredMoE):
    """HF transformers' ``experts_implementation="eager"``: a loop over the experts that got tokens."""

    def forward(self, hidden_states):
        x = hidden_states.view(-1, hidden_states.shape[-1])
        weights, ids = torch.topk(self.gate(x).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.w1.shape[0]).permute(2, 1, 0)  # [E, K, T]
        expert_hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            e = expert_idx[0]
            top, tok = torch.where(mask[e])
            h = F.silu(x[tok] @ self.w1[e].t()) * (x[tok] @ self.w3[e].t())
            out.index_add_(0, tok, (h @ self.w2[e].t()) * weights[tok, top, None])
        return out.view(hidden_states.shape)


def test_loop_over_hit_experts_named_with_its_fix():
    report = moe_compile.explain(LoopsOverHitExperts(), torch.randn(1, 5, 64))
    (split,) = [s.reason for s in report.skipped if "one graph at" in s.reason]
    assert "for expert_idx in expert_hit:" in split and "experts_implementation='grouped_mm'" in split, split


def test_data_dependent_branch_named_with_its_fix():
    for model, line in ((SkipsEmptyExperts(experts=4), "if tok.numel() == 0:"), (SkipsByCounts(), "if counts[i] == 0:")):
        report = moe_compile.explain(model, torch.randn(1, 5, 64))
        assert report.rewritten == []
        (split,) = [s.reason for s in report.skipped if "one graph at" in s.reason]
        assert "test_report.py:" in split and line in split, split
        assert "remove the data-dependent branch" in split and "experts that receive no tokens" in split


def test_compile_without_capture_flags_says_which_flags():
    torch._dynamo.reset()
    with collecting_reports() as report:
        torch.compile(zoo.ModuleListMoE(experts=4), backend="moe", options={"inner": "eager"})(torch.randn(1, 5, 64))
    assert report.rewritten == []
    (split,) = [s.reason for s in report.skipped if "ids leave this graph" in s.reason]
    assert "capture_dynamic_output_shape_ops = True" in split and "zoo.py" in split
    notes = moe_compile.explain(zoo.ModuleListMoE(experts=4), torch.randn(1, 5, 64)).notes
    note = next(n.text for n in notes if "data-dependent sizes" in n.text)
    assert "torch.where(mask[e])" in note and "capture_scalar_outputs = True" in note  # explain() rewrote it: says why


def test_identical_skips_are_one_line_with_a_count():
    reason = "could not prove the experts compute a supported FFN"
    report = Report(skipped=[Skipped(reason, "loop", g) for g in (0, 1, 3)] + [Skipped("other", "", 2)], graphs=4)
    text = str(report)
    assert f"  [graphs 0, 1, 3] (loop) {reason} (x3)" in text and "  [graph 2] other" in text
    assert text.count(reason) == 1 and len(report.skipped) == 4  # merged when printed, kept apart in the data


def test_no_tokens_is_said_and_proved_at_the_next_call():
    torch._dynamo.reset()
    block = zoo.ModuleListMoE(experts=4)
    compiled = torch.compile(block, backend="moe", options={"inner": "eager"})
    with capture_flags(), torch.no_grad(), collecting_reports() as first:
        assert compiled(torch.randn(1, 0, 64)).shape == (1, 0, 64)
    assert first.rewritten == [] and [s.reason for s in first.skipped] == [NO_TOKENS]
    x = torch.randn(1, 5, 64)
    with capture_flags(), torch.no_grad(), collecting_reports() as second:
        got = compiled(x)
    assert len(second.rewritten) == 1 and rel_err(got, block(x)) <= TOL[torch.float32]


def test_last_report_is_the_latest_compile():
    torch._dynamo.reset()
    moe_compile.last_report()  # forget earlier tests' graphs
    with torch.no_grad():
        moe_compile.optimize(zoo.GatheredMoE(), inner="eager")(torch.randn(1, 3, 64))
    first = moe_compile.last_report()
    assert first.graphs == 1 and first.rewritten[0].family == "gathered"
    assert moe_compile.last_report() is first  # nothing compiled since: the same answer


# ---- what the report says is true (explain -> compile -> last_report, quant, nothing found)


def test_last_report_after_explain_counts_only_the_compile():
    # explain() traces the model too; last_report() must not count its graph as a second compile.
    torch._dynamo.reset()
    moe_compile.last_report()
    block, x = zoo.GatheredMoE(), torch.randn(1, 3, 64)
    assert moe_compile.explain(block, x).graphs == 1
    with torch.no_grad():
        torch.compile(block, backend="moe", options={"inner": "eager"})(x)
    assert moe_compile.last_report().graphs == 1


def test_explain_raises_the_compile_error_for_a_quant_this_cpu_cannot_run():
    # torch.compile raises "no native kernel ... variants it runs: [...]"; explain() must say the same,
    # not "Dynamo failed to trace this" with an empty reason.
    with pytest.raises(ValueError, match="no native kernel.*variants it runs"):
        moe_compile.explain(zoo.GatheredMoE(), torch.randn(1, 3, 64), quant="a8w8-fp8")


def test_a_refusal_outside_any_graph_is_not_labelled_graph_0():
    def broken(x):
        return x.no_such_method()

    report = moe_compile.explain(broken, torch.randn(3))
    text = str(report)
    assert report.graphs == 0 and "[graph 0]" not in text and "[no graph] Dynamo failed to trace this" in text


def test_explicit_quant_reports_its_sqnr_not_only_the_proof():
    x = torch.randn(1, 16, 64)
    (entry,) = moe_compile.explain(zoo.GatheredMoE(), x, quant="w8-int").rewritten
    line = entry.line()
    assert "pattern proved on the unquantized op" in line and "(proved, rel. err" not in line
    # w8-int at G=32 on nn.Linear-like weights: ~40 dB (docs/quantization.md); far from exact, far from noise.
    assert 30 < entry.quant_sqnr_db < 60 and f"SQNR {entry.quant_sqnr_db:.1f} dB" in line
    torch._dynamo.reset()
    with torch.no_grad(), collecting_reports() as compiled:
        torch.compile(zoo.GatheredMoE(), backend="moe", options={"inner": "eager", "quant": "w8-int"})(x)
    assert "explain(model, x, quant='w8-int') measures its SQNR" in compiled.rewritten[0].line()


class SingleLinearExperts(torch.nn.Module):
    """Routed experts of one Linear each, in a ModuleList loop: a top-k picks experts, but nothing the
    matcher knows as an expert FFN reads its ids."""

    def __init__(self, hidden=64, experts=4, top_k=2):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):  # [T, H]
        g, ids = self.router(x).softmax(-1).topk(self.top_k, dim=-1)  # [T, K]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            g_e = (g * (ids == e)).sum(-1, keepdim=True)  # [T, 1]: 0 where e is not chosen
            out = out + g_e * expert(x)
        return out


def test_no_moe_and_an_unrecognised_moe_say_different_things():
    x = torch.randn(5, 64)
    plain = moe_compile.explain(torch.nn.Linear(64, 64), x)
    assert plain.summary().startswith("1 graph(s), 0 MoE region(s) rewritten, 0 skipped: no top-k found")
    assert plain.no_topk == [0]
    unrecognised = moe_compile.explain(SingleLinearExperts(), x)
    assert unrecognised.no_topk == [] and unrecognised.summary().startswith("1 graph(s), 0 MoE region(s) rewritten, 1 skipped")
    (skip,) = unrecognised.skipped
    assert "top-k at File" in skip.reason and "test_report.py" in skip.reason  # which top-k, and why not an MoE


def test_report_format_is_numbered_in_the_summary_and_the_json():
    from moe_compile.report import FORMAT

    report = Report(skipped=[Skipped("why", "", None)], graphs=0)
    assert report.summary().endswith(f"[report v{FORMAT}]") and report.to_dict()["version"] == FORMAT == 2
    combined = Report(graphs=2)
    combined.extend(report)
    assert combined.skipped[0].graph is None  # no graph to shift
