"""Reports a user can act on: the line that kept an MoE out of one graph and the change that
fixes it, identical skips merged, T = 0 proved at the next call, last_report()."""

import torch
import torch.nn.functional as F

import moe_compile
from moe_compile import zoo
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
    note = moe_compile.explain(zoo.ModuleListMoE(experts=4), torch.randn(1, 5, 64)).notes[0].text
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
