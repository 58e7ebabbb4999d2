"""What each rank runs in the EP tests (importable by spawned processes).

Every rank builds the WHOLE problem from one seed (all ranks' tokens, all E experts) so that it
can check its own slice against the single-device reference and the unfused eager EP layer.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from moe_compile.ep.op import call_fused_moe_ep
from moe_compile.ep.reference import eager_ep_layer
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.reference import fused_moe_reference


def make_problem(world, T, H, F, E, K, routing, seed=0, zero_rank=None):
    gen = torch.Generator().manual_seed(seed)
    fc1 = torch.randn(E, 2 * F, H, generator=gen) * H**-0.5  # [E, 2F, H] concat gate/up
    fc2 = torch.randn(E, H, F, generator=gen) * F**-0.5  # [E, H, F]
    xs, ids, gws = [], [], []
    for r in range(world):
        t = 0 if r == zero_rank else T
        x = torch.randn(t, H, generator=gen)
        scores = torch.rand(t, E, generator=gen)
        if routing == "uneven":  # experts of low index (rank 0) are far more popular
            scores = scores + torch.linspace(1.0, 0.0, E) ** 2
        elif routing == "one_rank":  # every token to rank 0's experts
            scores[:, E // world :] = -1.0
        g, i = scores.topk(K, dim=1)
        xs.append(x)
        ids.append(i)
        gws.append(torch.softmax(g, dim=1))
    return fc1, fc2, xs, ids, gws


def local_weights(fc1, fc2, rank, world):
    el = fc1.shape[0] // world
    return fc1[rank * el : (rank + 1) * el].contiguous(), fc2[rank * el : (rank + 1) * el].contiguous()


def rel(a, b):
    if b is None:  # a reference input with no path to the loss (a rank with T = 0)
        b = torch.zeros_like(a)
    if a.numel() and not b.abs().max() > 0:
        return a.double().abs().max().item()
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


SCENARIOS = {
    # name: (T, H, F, E, K, routing, zero_rank)
    "uneven_k2": (23, 32, 16, 8, 2, "uneven", None),
    "one_rank": (17, 32, 16, 8, 2, "one_rank", None),
    "zero_tokens": (19, 32, 16, 8, 2, "uneven", -1),
    "k1": (31, 32, 16, 8, 1, "uniform", None),
    "k8": (13, 32, 16, 16, 8, "uneven", None),
}


def equality(rank, world, transports, scenarios=tuple(SCENARIOS), chunks=(0, 3)):
    """Forward vs the reference and the eager EP layer; backward vs autograd of the reference."""
    out = {}
    attrs = FFNAttrs()
    for name in scenarios:
        T, H, F, E, K, routing, zero = SCENARIOS[name]
        zero = world - 1 if zero == -1 else zero
        fc1, fc2, xs, ids, gws = make_problem(world, T, H, F, E, K, routing, zero_rank=zero)
        l1, l2 = local_weights(fc1, fc2, rank, world)
        want = fused_moe_reference(xs[rank], ids[rank], gws[rank], ExpertWeights((fc1,), (), (fc2,)), attrs)
        eager = eager_ep_layer(xs[rank], ids[rank], gws[rank], ExpertWeights((l1,), (), (l2,)), attrs, dist.group.WORLD, E)
        out[(name, "eager")] = rel(eager, want)
        for tr in transports:
            for c in chunks:
                y = call_fused_moe_ep(xs[rank], ids[rank], gws[rank], ExpertWeights((l1,), (), (l2,)), attrs,
                                      dist.group.WORLD, E, transport=tr, chunks=c, timeout_s=20)
                out[(name, tr, c)] = rel(y, want)
            out[(name, tr, "grad")] = _grads(rank, world, tr, fc1, fc2, xs, ids, gws, l1, l2, E, attrs)
    return out


def _grads(rank, world, tr, fc1, fc2, xs, ids, gws, l1, l2, E, attrs):
    # Reference: the sum over ranks of every rank's loss, on the full weights.
    f1, f2 = fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
    cot = [torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + r)) for r, x in enumerate(xs)]
    xr = [x.clone().requires_grad_() for x in xs]
    gr = [g.clone().requires_grad_() for g in gws]
    loss = sum((fused_moe_reference(xr[r], ids[r], gr[r], ExpertWeights((f1,), (), (f2,)), attrs) * cot[r]).sum()
               for r in range(world))
    loss.backward()
    a1, a2 = l1.clone().requires_grad_(), l2.clone().requires_grad_()
    x = xs[rank].clone().requires_grad_()
    g = gws[rank].clone().requires_grad_()
    y = call_fused_moe_ep(x, ids[rank], g, ExpertWeights((a1,), (), (a2,)), attrs, dist.group.WORLD, E,
                          transport=tr, timeout_s=20)
    (y * cot[rank]).sum().backward()
    el = E // world
    sl = slice(rank * el, (rank + 1) * el)
    return max(rel(x.grad, xr[rank].grad), rel(g.grad, gr[rank].grad),
               rel(a1.grad, f1.grad[sl]), rel(a2.grad, f2.grad[sl]))


def overflow(rank, world, transport):
    T, H, F, E, K = 16, 16, 8, 4 * world, 2
    fc1, fc2, xs, ids, gws = make_problem(world, T, H, F, E, K, "one_rank")
    l1, l2 = local_weights(fc1, fc2, rank, world)
    try:
        call_fused_moe_ep(xs[rank], ids[rank], gws[rank], ExpertWeights((l1,), (), (l2,)), FFNAttrs(),
                          dist.group.WORLD, E, transport=transport, max_tokens=T * K, timeout_s=20)
    except ValueError as exc:
        return str(exc)
    return "no error"


def mismatch(rank, world, transport):
    T, H, F, K = 8, 16, 8, 2
    E = 4 * world if rank == 0 else 8 * world  # rank 0 disagrees on E
    fc1, fc2, xs, ids, gws = make_problem(world, T, H, F, E, K, "uniform")
    l1, l2 = local_weights(fc1, fc2, rank, world)
    try:
        call_fused_moe_ep(xs[rank], ids[rank], gws[rank], ExpertWeights((l1,), (), (l2,)), FFNAttrs(),
                          dist.group.WORLD, E, transport=transport, timeout_s=10)
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def dead_rank(rank, world, transport, timeout_s):
    """The last rank leaves after the first call; the others must raise within timeout_s."""
    T, H, F, E, K = 8, 16, 8, 2 * world, 2
    fc1, fc2, xs, ids, gws = make_problem(world, T, H, F, E, K, "uniform")
    l1, l2 = local_weights(fc1, fc2, rank, world)
    w = ExpertWeights((l1,), (), (l2,))

    def call():
        return call_fused_moe_ep(xs[rank], ids[rank], gws[rank], w, FFNAttrs(), dist.group.WORLD, E,
                                 transport=transport, timeout_s=timeout_s)

    call()
    if rank == world - 1:
        return "left"
    t0 = time.monotonic()
    try:
        call()
    except TimeoutError as exc:
        return (time.monotonic() - t0, str(exc))
    return (time.monotonic() - t0, "no error")


def int8_sqnr(rank, world):
    T, H, F, E, K = 64, 64, 32, 4 * world, 2
    fc1, fc2, xs, ids, gws = make_problem(world, T, H, F, E, K, "uniform")
    l1, l2 = local_weights(fc1, fc2, rank, world)
    w = ExpertWeights((l1,), (), (l2,))
    want = fused_moe_reference(xs[rank], ids[rank], gws[rank], ExpertWeights((fc1,), (), (fc2,)), FFNAttrs())
    y = call_fused_moe_ep(xs[rank], ids[rank], gws[rank], w, FFNAttrs(), dist.group.WORLD, E,
                          transport="symm-int8", timeout_s=20)
    err = (y.double() - want.double()).pow(2).sum()
    return 10 * torch.log10(want.double().pow(2).sum() / err).item()


def misc(rank, world):
    """Overflow (both transports), config mismatch, int8 SQNR, then a normal call still works."""
    out = {"overflow_symm": overflow(rank, world, "symm"), "overflow_coll": overflow(rank, world, "collectives"),
           "mismatch": mismatch(rank, world, "symm"), "sqnr": int8_sqnr(rank, world)}
    T, H, F, E, K = 9, 16, 8, 2 * world, 2
    fc1, fc2, xs, ids, gws = make_problem(world, T, H, F, E, K, "uniform")
    l1, l2 = local_weights(fc1, fc2, rank, world)
    want = fused_moe_reference(xs[rank], ids[rank], gws[rank], ExpertWeights((fc1,), (), (fc2,)), FFNAttrs())
    y = call_fused_moe_ep(xs[rank], ids[rank], gws[rank], ExpertWeights((l1,), (), (l2,)), FFNAttrs(),
                          dist.group.WORLD, E, transport="symm", timeout_s=20)
    out["after"] = rel(y, want)
    return out


def heap_roundtrip(rank, world, timeout_s):
    """Each rank writes a row into the next rank's buffer, signals it, waits for its own."""
    from moe_compile.ep.context import get_context
    from moe_compile.symm import allocate

    ctx = get_context(dist.group.WORLD.group_name)
    heap = allocate(ctx.store, rank, world, 1024, 2 + world, "test_rt", timeout_s)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    heap.tensor(nxt, 64, (4,), torch.float32).copy_(torch.full((4,), float(rank)))
    heap.signal(nxt, 0, 7)
    heap.wait([0], 7, timeout_s, who=lambda s: prv, what="roundtrip")
    got = heap.tensor(rank, 64, (4,), torch.float32).tolist()
    heap.barrier(timeout_s)
    out = {"got": got, "expect": [float(prv)] * 4}
    # a flag nobody sets: the wait must time out and name the rank it waited for
    t0 = time.monotonic()
    try:
        heap.wait([1], 1, 0.5, who=lambda s: prv, what="a flag nobody sets")
        out["timeout"] = "no error"
    except TimeoutError as exc:
        out["timeout"] = str(exc)
    out["elapsed"] = time.monotonic() - t0
    heap.barrier(timeout_s)
    heap.close()
    return out


def heap_missing_rank(rank, world, timeout_s):
    """The last rank never allocates: the others' rendezvous raises, naming it."""
    from moe_compile.ep.context import get_context
    from moe_compile.symm import allocate

    if rank == world - 1:
        return "absent"
    ctx = get_context(dist.group.WORLD.group_name)
    t0 = time.monotonic()
    try:
        allocate(ctx.store, rank, world, 1024, 4, "test_missing", timeout_s)
    except TimeoutError as exc:
        return (time.monotonic() - t0, str(exc))
    return (time.monotonic() - t0, "no error")
