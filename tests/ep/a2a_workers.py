"""What each rank runs in the ep_dispatch / ep_combine tests (importable by spawned processes).

Every rank draws every rank's tensors from one seed, runs its own part of the collective op, and
checks it against the pure-torch model of all ranks (``ep/a2a_reference``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import moe_compile.ep.a2a  # noqa: F401  (registers the ops)
from moe_compile.ep.a2a import dispatch_rows
from moe_compile.ep.a2a_reference import combine_reference, dispatch_reference


def random_dispatch(gen, world, ne, H, dtype=torch.float32):
    """Every rank's (input, in_splits) and an ``out_rows``, with empty ranks / experts / skewed blocks."""
    inputs, splits = [], []
    for _ in range(world):
        mode = int(torch.randint(0, 4, (1,), generator=gen))
        if mode == 0:  # T = 0 on this rank
            s = torch.zeros(world * ne, dtype=torch.long)
        elif mode == 1:  # everything to rank 0's experts
            s = torch.zeros(world * ne, dtype=torch.long)
            s[:ne] = torch.randint(0, 9, (ne,), generator=gen)
        else:
            s = torch.randint(0, 6, (world * ne,), generator=gen) * (torch.rand(world * ne, generator=gen) < 0.7)
        spare = int(torch.randint(0, 3, (1,), generator=gen))  # input rows the splits do not use
        inputs.append(torch.randn(int(s.sum()) + spare, H, generator=gen).to(dtype))
        splits.append(s.long())
    align = [None, 1, 4][int(torch.randint(0, 3, (1,), generator=gen))]
    return inputs, splits, align


def _rows_needed(splits, world, ne, align):
    from moe_compile.ep.a2a_layout import dispatch_rows_needed

    return int(dispatch_rows_needed(torch.stack(splits), ne, align).max())


def random_rounds(rank, world, seeds, ne, H):
    """Dispatch, then combine of its output (and of randomly padded offsets): bit-identical to the model."""
    from moe_compile.ep.a2a import ep_combine, ep_dispatch

    group = dist.group.WORLD.group_name
    bad = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        inputs, splits, align = random_dispatch(gen, world, ne, H)
        out_rows = _rows_needed(splits, world, ne, align) + int(torch.randint(0, 3, (1,), generator=gen))
        ref = dispatch_reference(inputs, splits, ne, out_rows, align)
        out, oso = ep_dispatch(inputs[rank], splits[rank], group, out_rows, align)
        if not (torch.equal(out, ref[rank][0]) and torch.equal(oso, ref[rank][1])):
            bad.append(("dispatch", seed))
        # combine the dispatched rows back: out equals the dispatch's input rows, zero beyond
        rows_in = [t.shape[0] for t in inputs]
        back, boso = ep_combine(out, oso, group, rows_in[rank])
        cref = combine_reference([r[0] for r in ref], [r[1] for r in ref], ne, rows_in)
        want = inputs[rank].clone()
        want[int(splits[rank].sum()) :] = 0
        if not (torch.equal(back, cref[rank][0]) and torch.equal(back, want) and torch.equal(boso, cref[rank][1])):
            bad.append(("combine", seed))
        # combine from arbitrary offsets (gaps between blocks)
        cin, ciso = [], []
        for p in range(world):
            sp = torch.randint(0, 5, (ne * world,), generator=gen)
            gaps = torch.randint(0, 3, (ne * world,), generator=gen)
            off = torch.cumsum(sp + gaps, 0) - sp
            cin.append(torch.randn(int((off + sp).max()) + 1, H, generator=gen))
            ciso.append(torch.stack([sp, off]).long())
        n_out = max(int(ciso[p][0].reshape(ne, world)[:, d].sum()) for p in range(world) for d in range(world)) * world
        cref = combine_reference(cin, ciso, ne, n_out)
        got, goso = ep_combine(cin[rank], ciso[rank], group, n_out)
        if not (torch.equal(got, cref[rank][0]) and torch.equal(goso, cref[rank][1])):
            bad.append(("combine_offsets", seed))
    return bad


def gradients(rank, world, seed, ne, H):
    """d/d input of sum_r <dispatch / combine outputs of r, w_r>: the op's backward vs autograd through the model."""
    from moe_compile.ep.a2a import ep_combine, ep_dispatch

    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed)
    inputs, splits, align = random_dispatch(gen, world, ne, H, torch.float64)
    out_rows = _rows_needed(splits, world, ne, align) + 1
    ws = [torch.randn(out_rows, H, generator=gen, dtype=torch.float64) for _ in range(world)]
    # the model, differentiable (slicing)
    leaves = [t.clone().requires_grad_() for t in inputs]
    ref = dispatch_reference(leaves, splits, ne, out_rows, align)
    sum((o * w).sum() for (o, _), w in zip(ref, ws)).backward()
    x = inputs[rank].clone().requires_grad_()
    out, oso = ep_dispatch(x, splits[rank], group, out_rows, align)
    (out * ws[rank]).sum().backward()
    ok_d = torch.equal(x.grad, leaves[rank].grad)
    # combine of arbitrary offsets, then its transpose in the backward
    cin, ciso = [], []
    for p in range(world):
        sp = torch.randint(0, 5, (ne * world,), generator=gen)
        off = torch.cumsum(sp + torch.randint(0, 3, (ne * world,), generator=gen), 0) - sp
        cin.append(torch.randn(int((off + sp).max()) + 2, H, generator=gen, dtype=torch.float64))
        ciso.append(torch.stack([sp, off]).long())
    n_out = int(torch.stack(ciso)[:, 0].sum()) + 1
    wc = [torch.randn(n_out, H, generator=gen, dtype=torch.float64) for _ in range(world)]
    leaves = [t.clone().requires_grad_() for t in cin]
    cref = combine_reference(leaves, ciso, ne, n_out)
    sum((o * w).sum() for (o, _), w in zip(cref, wc)).backward()
    xc = cin[rank].clone().requires_grad_()
    got, _ = ep_combine(xc, ciso[rank], group, n_out)
    (got * wc[rank]).sum().backward()
    ok_c = torch.equal(xc.grad, leaves[rank].grad)
    return ok_d, ok_c


def errors(rank, world):
    """Sizes that do not fit raise the same ValueError on every rank (no hang)."""
    from moe_compile.ep.a2a import ep_dispatch

    group = dist.group.WORLD.group_name
    msgs = []
    splits = torch.full((world * 2,), 3, dtype=torch.long)
    try:  # out too small
        ep_dispatch(torch.randn(6 * world, 4), splits, group, 2)
    except ValueError as exc:
        msgs.append(str(exc))
    try:  # rank 0's splits exceed its input
        n = 1 if rank == 0 else 6 * world
        ep_dispatch(torch.randn(n, 4), splits, group, dispatch_rows(world, 6 * world, 1, 2) * 2)
    except ValueError as exc:
        msgs.append(str(exc))
    # still in step afterwards
    out, _ = ep_dispatch(torch.ones(6 * world, 4), splits, group, dispatch_rows(world, 6 * world, 2, 2))
    msgs.append(float(out.sum()))
    return msgs


def torch_signatures(rank, world, ne=2, H=4):
    """``all_to_all_vdev_2d`` / ``_offset`` with torch's arguments write what the functional ops return."""
    from moe_compile.ep.a2a import all_to_all_vdev_2d, all_to_all_vdev_2d_offset, ep_combine, ep_dispatch

    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(99)
    inputs, splits, align = random_dispatch(gen, world, ne, H)
    rows = _rows_needed(splits, world, ne, 8) + 3
    out, oso = torch.full((rows, H), 7.0), torch.empty(2, world * ne, dtype=torch.long)
    all_to_all_vdev_2d(inputs[rank], out, splits[rank], oso, group, 8)
    want, want_oso = ep_dispatch(inputs[rank], splits[rank], group, rows, 8)
    back, boso = torch.empty_like(inputs[rank]), torch.empty(2, world * ne, dtype=torch.long)
    all_to_all_vdev_2d_offset(out, back, oso, boso, group)
    cwant, cwant_oso = ep_combine(out, oso, group, inputs[rank].shape[0])
    return (torch.equal(out, want) and torch.equal(oso, want_oso) and torch.equal(back, cwant)
            and torch.equal(boso, cwant_oso))


def all_checks(rank, world, seeds, ne, H):
    """One spawn for every check of a world size (spawning ranks costs more than the checks)."""
    return {"rounds": random_rounds(rank, world, seeds, ne, H), "grads": gradients(rank, world, 7, 2, 4),
            "errors": errors(rank, world), "torch_signatures": torch_signatures(rank, world)}


# -- the fused op on the a2a transport ----------------------------------------------------------
def _problem(world, Ts, H, F, E, K, routing, seed, dtype=torch.float32):
    """Every rank's (x, ids, gates) with T_r = Ts[r], stacked weights of all E experts."""
    gen = torch.Generator().manual_seed(seed)
    fc1 = (torch.randn(E, 2 * F, H, generator=gen) * H**-0.5).to(dtype)  # [E, 2F, H]
    fc2 = (torch.randn(E, H, F, generator=gen) * F**-0.5).to(dtype)  # [E, H, F]
    xs, ids, gws, dys = [], [], [], []
    for r in range(world):
        scores = torch.rand(Ts[r], E, generator=gen)
        if routing == "rank0":  # every token to rank 0's experts: the other ranks' experts get nothing
            scores[:, E // world :] = -1.0
        if routing == "rank1_empty":  # no token to rank 1's experts: that rank only serves the others' rows
            scores[:, E // world : 2 * E // world] = -1.0
        g, i = scores.topk(K, dim=1)
        xs.append(torch.randn(Ts[r], H, generator=gen).to(dtype))
        ids.append(i)
        gws.append(torch.softmax(g, dim=1).to(dtype))
        dys.append(torch.randn(Ts[r], H, generator=gen).to(dtype))
    return fc1, fc2, xs, ids, gws, dys


class _Scalars:
    """Counts torch scalar reads: ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``)
    through a TorchDispatchMode, and ``Tensor.tolist`` (which dispatches nothing) by wrapping it."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = {"_local_scalar_dense": 0, "tolist": 0}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    counts["_local_scalar_dense"] += 1
                return func(*args, **(kwargs or {}))

        self._tolist = torch.Tensor.tolist

        def tolist(t):
            counts["tolist"] += 1
            return self._tolist(t)

        torch.Tensor.tolist = tolist  # test instrumentation only, restored on exit
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist


class _DispatchBytes:
    """Row bytes of every dispatch the a2a transports start (``a2a_cpu.dispatch_rows`` and
    ``a2a_cpu.exchange("dispatch", ...)``), by wrapping them (test instrumentation, restored on exit)."""

    def __enter__(self):
        from moe_compile.ep import a2a_cpu

        self.rows, self._saved = [], (a2a_cpu.dispatch_rows, a2a_cpu.exchange)
        rows_fn, exchange_fn = self._saved

        def dispatch_rows(x, tokens, in_splits, group_name, timeout_s, extra=None, packed=False):
            width = x.shape[1] * x.element_size() + (0 if extra is None else extra.shape[1] * extra.element_size())
            self.rows.append(width)
            return rows_fn(x, tokens, in_splits, group_name, timeout_s, extra, packed)

        def exchange(kind, input, *args, **kwargs):
            if kind == "dispatch":
                self.rows.append(input.shape[1] * input.element_size())
            return exchange_fn(kind, input, *args, **kwargs)

        a2a_cpu.dispatch_rows, a2a_cpu.exchange = dispatch_rows, exchange
        return self

    def __exit__(self, *exc):
        from moe_compile.ep import a2a_cpu

        a2a_cpu.dispatch_rows, a2a_cpu.exchange = self._saved


def fused_scenarios(rank, world, scenarios, transport="a2a", chunks=0, max_tokens=0):
    """For each (name, Ts, routing, dtype): the fused op's y and every gradient vs the reference on
    the whole problem; torch scalar reads counted on the forward and the backward; what the
    dispatches sent (a2a: row widths; symm / collectives: ``EPContext.sent``)."""
    from moe_compile.ep.context import get_context
    from moe_compile.ep.op import call_fused_moe_ep
    from moe_compile.ir import ExpertWeights, FFNAttrs
    from moe_compile.kernels.reference import fused_moe_reference

    H, F, E, K = 32, 16, 8, 2
    el = E // world
    results = {}
    for name, Ts, routing, dtype in scenarios:
        fc1, fc2, xs, ids, gws, dys = _problem(world, Ts, H, F, E, K, routing, seed=len(results) + 11, dtype=dtype)
        # the reference on every rank's tokens, all experts (its gradients: autograd through it)
        rx = [t.clone().requires_grad_() for t in xs]
        rg = [t.clone().requires_grad_() for t in gws]
        rw1, rw2 = fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
        ys = [fused_moe_reference(a, i, g, ExpertWeights((rw1,), (), (rw2,)), FFNAttrs())
              for a, i, g in zip(rx, ids, rg)]
        sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys)).backward()
        # this rank's part
        x = xs[rank].clone().requires_grad_()
        g = gws[rank].clone().requires_grad_()
        w1 = fc1[rank * el : (rank + 1) * el].clone().requires_grad_()
        w2 = fc2[rank * el : (rank + 1) * el].clone().requires_grad_()
        with _Scalars() as fwd:
            y = call_fused_moe_ep(x, ids[rank], g, ExpertWeights((w1,), (), (w2,)), FFNAttrs(), dist.group.WORLD, E,
                                  transport=transport, chunks=chunks, max_tokens=max_tokens)
        kept = kept_flag(y)
        with _Scalars() as bwd, _DispatchBytes() as sent:
            (y.float() * dys[rank].float()).sum().backward()
        results[name] = {
            "kept": kept, "bwd_dispatch_row_bytes": sent.rows, "H": H, "itemsize": x.element_size(),
            "y": rel(y, ys[rank]), "dx": rel(x.grad, rx[rank].grad), "dg": rel(g.grad, rg[rank].grad),
            "dw1": rel(w1.grad, rw1.grad[rank * el : (rank + 1) * el]),
            "dw2": rel(w2.grad, rw2.grad[rank * el : (rank + 1) * el]),
            "scalar_reads": (fwd.counts, bwd.counts), "sent": dict(get_context(dist.group.WORLD.group_name).sent),
        }
    return results


def transports_scenarios(rank, world, scenarios, transports, chunks=0):
    """``fused_scenarios`` for each transport, in one spawn: {transport: its results}."""
    return {tr: fused_scenarios(rank, world, scenarios, tr, chunks) for tr in transports}


def kept_flag(y) -> bool:
    """Whether the forward that made y kept its received rows: the training op's kept meta, saved
    last on its autograd node (``ep/keep.py``: meta[0])."""
    saved = y.grad_fn.saved_tensors
    return bool(saved[-1].numel() and saved[-1][0] == 1)


def rel(a, b):
    """max |a - b| / max |b| (0 for empty tensors; |a| where b is all zero; None: no path, zero)."""
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    a, b = a.detach().double(), b.detach().double()
    if a.numel() == 0:
        return 0.0
    scale = b.abs().max()
    return float((a - b).abs().max() / scale) if scale > 0 else float(a.abs().max())


def fullgraph(rank, world):
    """A model calling the a2a fused op compiles with fullgraph=True (no capture_scalar_outputs) and
    gives eager's result and input gradient: (the error, the row widths of each backward dispatch)."""
    import torch._dynamo

    from moe_compile.ep.op import call_fused_moe_ep
    from moe_compile.ir import ExpertWeights, FFNAttrs

    H, F, E, K = 32, 16, 8, 2
    fc1, fc2, xs, ids, gws, _ = _problem(world, [6] * world, H, F, E, K, "uniform", seed=5)
    el = E // world
    w = ExpertWeights((fc1[rank * el : (rank + 1) * el],), (), (fc2[rank * el : (rank + 1) * el],))
    group = dist.group.WORLD.group_name

    def layer(x, scores):
        g, i = torch.softmax(scores, 1).topk(K, dim=1)
        return call_fused_moe_ep(x, i, g, w, FFNAttrs(), group, E, transport="a2a") + x

    scores = torch.randn(6, E, generator=torch.Generator().manual_seed(rank))
    assert not torch._dynamo.config.capture_scalar_outputs
    res, rows = [], []
    for fn in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
        x = xs[rank].clone().requires_grad_()  # both: the training op's forward keeps its rows
        y = fn(x, scores)
        with _DispatchBytes() as sent:
            y.sum().backward()
        res.append((y, x.grad))
        rows.append(sent.rows)
    return max(rel(got, want) for got, want in zip(res[1], res[0])), rows


def window_paths(rank, world, seeds, ne, H, big_rows):
    """The fused op's window dispatch + combine-after (the C path, or numpy's without the C kernel):
    the window equals the model's dispatch out, the combine brings every row back; then one
    dispatch whose blocks overflow the slabs (every rank grows them and sends again)."""
    from moe_compile.ep import a2a_cpu
    from moe_compile.ep.a2a_layout import dispatch_rows_needed

    group = dist.group.WORLD.group_name
    bad = []
    cases = [(seed, None) for seed in seeds] + [("big", big_rows)]
    for seed, big in cases:
        gen = torch.Generator().manual_seed(7 if big else seed)
        if big:  # every rank sends big rows to every rank's first expert: more than a slab holds
            splits = [torch.zeros(world * ne, dtype=torch.long) for _ in range(world)]
            for s in splits:
                s[::ne] = big
            inputs = [torch.randn(int(s.sum()), H, generator=gen) for s in splits]
        else:
            inputs, splits, _ = random_dispatch(gen, world, ne, H)
        need = dispatch_rows_needed(torch.stack(splits), ne, None).tolist()  # the window: exactly what arrives
        ref = dispatch_reference(inputs, splits, ne, need)[rank]
        win, oso, _, handle = a2a_cpu.exchange("dispatch", inputs[rank], splits[rank], group, 0, window=True)
        if not (torch.equal(win, ref[0]) and torch.equal(oso, ref[1])):
            bad.append(("window", seed))
        rows = int(splits[rank].sum())
        back = a2a_cpu.exchange("combine", win * 2, oso, group, rows, after=handle)[0]
        if not torch.equal(back, inputs[rank][:rows] * 2):
            bad.append(("combine_after", seed))
    return bad


def int8_scenarios(rank, world, scenarios):
    """transport="a2a-int8" for each (name, Ts, routing): y vs the single-device a8w8-int op on the
    whole problem (``kernels/cpu/quant.run``: the same quantizer, kernel and pack) and vs fp32
    (SQNR), torch scalar reads counted on the forward."""
    from moe_compile.ep.op import call_fused_moe_ep
    from moe_compile.ir import ExpertWeights, FFNAttrs
    from moe_compile.kernels.cpu import quant as cpu_quant
    from moe_compile.kernels.reference import fused_moe_reference

    H, F, E, K = 64, 32, 8, 2  # the integer kernel's multiples: H % 32, F % 16
    el = E // world
    results = {}
    for name, Ts, routing in scenarios:
        fc1, fc2, xs, ids, gws, _ = _problem(world, Ts, H, F, E, K, routing, seed=len(results) + 31)
        whole = ExpertWeights((fc1,), (), (fc2,))
        want = cpu_quant.run(xs[rank], ids[rank], gws[rank], whole, FFNAttrs(), "a8w8-int", 0.0, f"ep-test-{name}") \
            if Ts[rank] else xs[rank].new_zeros(0, H)
        fp32 = fused_moe_reference(xs[rank], ids[rank], gws[rank], whole, FFNAttrs())
        lo, hi = rank * el, (rank + 1) * el
        mine = ExpertWeights((fc1[lo:hi].clone(),), (), (fc2[lo:hi].clone(),))
        with _Scalars() as fwd:
            y = call_fused_moe_ep(xs[rank], ids[rank], gws[rank], mine, FFNAttrs(), dist.group.WORLD, E,
                                  transport="a2a-int8")
        err = (y - fp32).double().pow(2).sum()
        sqnr = float(10 * torch.log10(fp32.double().pow(2).sum() / err)) if err > 0 else 99.0
        results[name] = {"vs_a8w8": rel(y, want), "sqnr_db": sqnr if Ts[rank] else 99.0, "scalar_reads": fwd.counts}
    return results


@contextlib.contextmanager
def _fc2_into_calls():
    """A list that gets one entry per "FC2 into" call (``a2a_cpu.expert_rows``, wrapped: test
    instrumentation, restored on exit)."""
    from moe_compile.ep import a2a_cpu

    real, calls = a2a_cpu.expert_rows, []
    a2a_cpu.expert_rows = lambda *a: calls.append(1) or real(*a)
    try:
        yield calls
    finally:
        a2a_cpu.expert_rows = real


def packed_forward(rank, world, scenarios):
    """The in-place forward with prepacked fp32 panels (the packed kernel reading the receive window
    where the rows lie): for each (name, Ts, routing) the third call on unchanged weights (packed
    by then) vs the reference, and whether the in-place path and the packed kernel took it."""
    from moe_compile.ep import fused_a2a
    from moe_compile.ep.op import call_fused_moe_ep
    from moe_compile.ir import ExpertWeights, FFNAttrs
    from moe_compile.kernels.cpu import prepack
    from moe_compile.kernels.reference import fused_moe_reference

    H, F, E, K = 64, 32, 8, 2  # the packed kernel's multiples: H % 32, F % 16
    el = E // world
    results = {}
    for name, Ts, routing in scenarios:
        fc1, fc2, xs, ids, gws, _ = _problem(world, Ts, H, F, E, K, routing, seed=len(results) + 51)
        want = fused_moe_reference(xs[rank], ids[rank], gws[rank], ExpertWeights((fc1,), (), (fc2,)), FFNAttrs())
        lo, hi = rank * el, (rank + 1) * el
        mine = ExpertWeights((fc1[lo:hi].clone(),), (), (fc2[lo:hi].clone(),))
        with _fc2_into_calls() as calls:
            for _ in range(3):
                calls.clear()
                with _Scalars() as fwd:
                    y = call_fused_moe_ep(xs[rank], ids[rank], gws[rank], mine, FFNAttrs(), dist.group.WORLD, E,
                                          transport="a2a")
        p = prepack.lookup(xs[rank], mine, FFNAttrs())
        results[name] = {"y": rel(y, want), "in_place": fused_a2a.in_place(torch.float32),
                         "packed": bool(p is not None and p.fused), "fc2_into": calls == [1],
                         "scalar_reads": fwd.counts}
    return results


def index_paths(rank, world, seeds, ne, H, big_rows):
    """The fused op's exchange pair by token index (``a2a_cpu.dispatch_rows`` / ``combine_sum``):
    the rows at ``idx`` are the model's dispatch of the rows x[tokens] (expert-major, no padding),
    a per-slot extra field travels with them, and the combine adds every slot's returned row,
    weighted, into its token; then a dispatch whose blocks overflow the slabs (every rank grows
    them and sends again).  Integer-valued rows and power-of-two weights: every sum is exact, so
    the comparisons are bit for bit whatever the order of the additions."""
    from moe_compile.ep import a2a_cpu

    group = dist.group.WORLD.group_name
    bad = []
    for seed in list(seeds) + ["big_T", "big"]:  # big_T first: the slabs grow for x's rows sent by token
        gen = torch.Generator().manual_seed(7 if isinstance(seed, str) else seed)
        if seed == "big":  # big rows per (source, dest) of H fp32: more than the 1 MiB first slab
            splits = [torch.zeros(world * ne, dtype=torch.long) for _ in range(world)]
            for sp in splits:
                sp[::ne] = big_rows
        else:
            _, splits, _ = random_dispatch(gen, world, ne, 1)
        Ts = [int(torch.randint(1, 9, (1,), generator=gen)) for _ in range(world)]
        if seed == "big_T":  # big tokens: this rank's own region (x's T rows) outgrows the first slab
            Ts = [big_rows] * world
        xs = [torch.randint(-8, 8, (t, H), generator=gen).float() for t in Ts]
        toks = [torch.randint(0, t, (int(sp.sum()),), generator=gen) for t, sp in zip(Ts, splits)]
        gs = [2.0 ** torch.randint(-2, 2, (tk.shape[0],), generator=gen).float() for tk in toks]
        need = [int(n) for n in a2a_layout_rows(splits, ne)]
        ref_out, ref_oso = dispatch_reference([x[t] for x, t in zip(xs, toks)], splits, ne, need)[rank]
        want = torch.cat([ref_out[o : o + n] for n, o in zip(ref_oso[0].tolist(), ref_oso[1].tolist())])
        want_g = dispatch_reference([g[:, None] for g in gs], splits, ne, need)[rank]
        want_g = torch.cat([want_g[0][o : o + n] for n, o in zip(ref_oso[0].tolist(), ref_oso[1].tolist())])
        x, tk, g = xs[rank], toks[rank], gs[rank]
        rcv = a2a_cpu.dispatch_rows(x, tk, splits[rank], group, 60.0, extra=g[:, None])
        got = rcv.window.index_select(0, rcv.idx)  # [N, 4H + 4] bytes
        if not (torch.equal(got[:, : 4 * H].contiguous().view(torch.float32), want)
                and torch.equal(got[:, 4 * H :].contiguous().view(torch.float32), want_g)
                and torch.equal(torch.from_numpy(rcv.oso[0]), ref_oso[0])):
            bad.append(("dispatch_rows", seed))
        # the rows back, doubled: y = sum over slots of g * 2 x[token]
        rcv = a2a_cpu.dispatch_rows(x, tk, splits[rank], group, 60.0)
        out = rcv.window[: rcv.handle[5]].view(torch.float32) * 2
        y = a2a_cpu.combine_sum(out, rcv, tk, g, x.shape[0], group, 60.0)
        if not torch.equal(y, torch.zeros_like(x).index_add_(0, tk, 2 * g[:, None] * x[tk])):
            bad.append(("combine_sum", seed))
        # own rows by token: x's T rows once in this rank's region, the own slots' gates as scales; back,
        # the own region's rows are taken as the experts' weighted sums: y = 2 x + the peers' g * 2 x[token]
        rcv = a2a_cpu.dispatch_rows(x, tk, splits[rank], group, 60.0, gates=g)
        got = rcv.window.index_select(0, rcv.idx).view(torch.float32)
        scales = [torch.where(_dest(sp, world, ne) == rank, gg, 1.0) if r == rank else torch.ones_like(gg)
                  for r, (sp, gg) in enumerate(zip(splits, gs))]
        want_s = dispatch_reference([v[:, None] for v in scales], splits, ne, need)[rank][0]
        want_s = torch.cat([want_s[o : o + n] for n, o in zip(ref_oso[0].tolist(), ref_oso[1].tolist())])
        if not (torch.equal(got, want) and torch.equal(rcv.scale, want_s[:, 0])):
            bad.append(("dispatch_rows_by_token", seed))
        out = rcv.window[: rcv.handle[5]].view(torch.float32) * 2
        y = a2a_cpu.combine_sum(out, rcv, tk, g, x.shape[0], group, 60.0)
        peer = _dest(splits[rank], world, ne) != rank
        want_y = (2 * x).index_add_(0, tk[peer], 2 * g[peer, None] * x[tk[peer]])
        if not torch.equal(y, want_y):
            bad.append(("combine_sum_by_token", seed))
    return bad


def _dest(in_splits, world, ne):
    """[S] the rank each rank-major slot goes to."""
    return torch.repeat_interleave(torch.arange(world), in_splits.reshape(world, ne).sum(1))


def a2a_layout_rows(splits, ne):
    """[R] rows each rank's dispatch out spans (default alignment)."""
    from moe_compile.ep.a2a_layout import dispatch_rows_needed

    return dispatch_rows_needed(torch.stack(splits), ne, None).tolist()


def packed_training(rank, world, scenarios):
    """Training through the packed path: expert weights frozen (no gradient asked), x and the gates
    trained.  For each (name, Ts, routing) the third forward on unchanged weights (prepacked by then)
    and its backward: y, dx and dg against the reference, and which forward path ran."""
    from moe_compile.ep.op import call_fused_moe_ep
    from moe_compile.ir import ExpertWeights, FFNAttrs
    from moe_compile.kernels.cpu import prepack
    from moe_compile.kernels.reference import fused_moe_reference

    H, F, E, K = 64, 32, 8, 2  # the packed kernel's multiples: H % 32, F % 16
    el = E // world
    results = {}
    for name, Ts, routing in scenarios:
        fc1, fc2, xs, ids, gws, dys = _problem(world, Ts, H, F, E, K, routing, seed=len(results) + 71)
        rx, rg = xs[rank].clone().requires_grad_(), gws[rank].clone().requires_grad_()
        want = fused_moe_reference(rx, ids[rank], rg, ExpertWeights((fc1,), (), (fc2,)), FFNAttrs())
        if want.requires_grad:  # T = 0: the reference returns a fresh empty tensor, its gradients empty
            (want * dys[rank]).sum().backward()
        else:
            rx.grad, rg.grad = torch.zeros_like(rx), torch.zeros_like(rg)
        lo, hi = rank * el, (rank + 1) * el
        mine = ExpertWeights((fc1[lo:hi].clone(),), (), (fc2[lo:hi].clone(),))
        with _fc2_into_calls() as calls:
            for _ in range(3):
                calls.clear()
                x, g = xs[rank].clone().requires_grad_(), gws[rank].clone().requires_grad_()
                y = call_fused_moe_ep(x, ids[rank], g, mine, FFNAttrs(), dist.group.WORLD, E, transport="a2a")
                with _Scalars() as bwd:
                    (y * dys[rank]).sum().backward()
        p = prepack.lookup(xs[rank], mine, FFNAttrs())
        results[name] = {"y": rel(y, want), "dx": rel(x.grad, rx.grad), "dg": rel(g.grad, rg.grad),
                         "packed": bool(p is not None and p.fused), "fc2_into": calls == [1],
                         "dx_nonzero": bool(x.grad.abs().sum() > 0), "scalar_reads": bwd.counts}
    return results
