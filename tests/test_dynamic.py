"""Dynamic token counts run without recompiling after the first dynamic compile."""

import pytest
import torch

from moe_compile.models import zoo
from moe_compile.api import capture_flags
from tests.conftest import TOL, rel_err


@pytest.mark.parametrize("cls", [zoo.ModuleListMoE, zoo.GatheredMoE])
def test_token_counts_share_one_graph(cls):
    from torch._dynamo.testing import CompileCounterWithBackend

    import moe_compile

    model = cls()
    counter = CompileCounterWithBackend(moe_compile.backend(inner="eager"))
    compiled = torch.compile(model, backend=counter, dynamic=True)
    with capture_flags():
        for T in (1, 7, 64, 513):
            x = torch.randn(1, T, 64)
            assert rel_err(compiled(x), model(x)) <= TOL[torch.float32]
    # Dynamo specialises a size of 1 (its 0/1 rule), so T=1 gets its own graph; the dynamic graph
    # compiled at T=7 then serves 64 and 513 without another compile.
    assert counter.frame_count == 2
    assert any("fused_moe" in str(n.target) for g in counter.graphs for n in g.graph.nodes)


def _rewritten_at_two_shapes(model, make_input, tol):
    """Compiled once and called at T = 5, then T = 11 (Dynamo's automatic-dynamic recompile): both
    compiles rewrite the block, and both calls equal eager."""
    import moe_compile
    from moe_compile.compiler import collecting_reports

    torch._dynamo.reset()
    compiled = capture_flags(torch.compile(model, backend=moe_compile.backend(inner="eager")))
    for T in (5, 11):
        x = make_input(T)
        with torch.no_grad(), collecting_reports() as report:
            got, want = compiled(x), model(x)
        assert rel_err(got, want) <= tol, f"T={T}\n{report}"
        assert report.graphs and report.rewritten and not report.skipped, f"T={T}: the rewrite is lost\n{report}"


# Three families by default (the suite stays fast), every covered one under -m slow.
FAST = ("loop_stacked", "split", "dense_out")
FAMILIES = [pytest.param(f, marks=() if f in FAST else pytest.mark.slow)
            for f in ("loop_list", "loop_stacked", "loop_cast", "split", "sort_scatter", "gathered", "dense_in",
                      "dense_out", "titan")]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_keeps_its_rewrite_at_two_shapes(family):
    from tests.passes import spellings

    case = spellings.Case(family, "softmax_renorm", 4, 2, False,
                          torch.bfloat16 if family == "sort_scatter" else torch.float32, 1, "silu_mul", 5)
    model, x = spellings.build(case)
    tol = 3e-2 if spellings.computes_in_bf16(case) else TOL[torch.float32]
    _rewritten_at_two_shapes(model, lambda T: torch.randn(1, T, case.hidden, dtype=x.dtype), tol)


@pytest.mark.parametrize("name", ["onehot_scatter", "sorted_gather_k1", "jetmoe",
                                  *(pytest.param(n, marks=pytest.mark.slow) for n in (
                                      "top1_max", "top1_argmax", "dropout_eval", "all_gather", "all_mask_loop",
                                      "bsk_where", "fused_views", "dbrx_chunk", "dbrx_index"))])
def test_other_spellings_keep_their_rewrite_at_two_shapes(name):
    from tests.passes import other_spellings

    model, _ = other_spellings.build(name)
    _rewritten_at_two_shapes(model, lambda T: torch.randn(1, T, 32), TOL[torch.float32])
