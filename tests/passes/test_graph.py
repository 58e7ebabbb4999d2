"""Mutation-aware dependencies: an in-place write is seen by every later reader of what it wrote."""

import operator

import torch
import torch.fx as fx

from moe_compile.passes.graph import Deps


def _graph_filling_a_buffer_through_views():
    # buf = a.new_empty(4, 8); buf[..., :4].copy_(a); buf[..., 4:].copy_(b); out = buf * 2
    # (DeepSeek-V3's attention builds its key states this way)
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    buf = g.call_method("new_empty", (a, 4, 8))
    left = g.call_function(operator.getitem, (buf, (Ellipsis, slice(None, 4))))
    first = g.call_method("copy_", (left, a))
    right = g.call_function(operator.getitem, (buf, (Ellipsis, slice(4, None))))
    second = g.call_method("copy_", (right, b))
    out = g.call_function(operator.mul, (buf, 2))
    g.output(out)
    return g, dict(buf=buf, first=first, second=second, out=out, right=right)


def test_a_write_through_a_view_mutates_the_viewed_buffer():
    g, n = _graph_filling_a_buffer_through_views()
    deps = Deps(g)
    assert deps.mutations_of(n["buf"]) == [n["first"], n["second"]]
    assert deps.version_of(n["buf"], n["out"]) is n["second"]
    assert {n["first"], n["second"]} <= deps.ancestors([n["out"]])
    gm = fx.GraphModule(torch.nn.Module(), g)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(gm(a, b), torch.cat([a, b], -1) * 2)  # the graph means what the test says


def test_a_write_to_an_advanced_index_copy_does_not_mutate_the_source():
    # buf[idx] makes a copy: copy_ into it leaves buf as it was
    g = fx.Graph()
    buf, idx, v = g.placeholder("buf"), g.placeholder("idx"), g.placeholder("v")
    picked = g.call_function(operator.getitem, (buf, idx))
    g.call_method("copy_", (picked, v))
    g.output(g.call_function(operator.mul, (buf, 2)))
    assert Deps(g).mutations_of(buf) == []
