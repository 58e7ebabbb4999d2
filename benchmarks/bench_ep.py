"""Expert-parallel MoE layer on CPU: the fused op over the shared-memory heap vs an unfused gloo EP.

Question: at the foundation's prefill shapes, how does ``fused_moe_ep`` (symm heap) compare with
the torchtitan-style layer (counts all_to_all_single -> .tolist() -> tokens all_to_all_single ->
per-expert FFN -> all_to_all_single back -> weighted sum; ``moe_compile/ep/reference.py``), and how
much of the communication does the chunked schedule hide?

Per world size (ranks = processes on this host, gloo, 1 torch thread each) and shape:
  eager_gloo      the unfused EP layer
  fused_symm      fused_moe_ep, transport="symm", chunks=auto
  fused_symm_cN   the same with N chunks (the sweep that chose ROWS_PER_CHUNK / auto_chunks)
  fused_coll_cN   fused_moe_ep, transport="collectives" (chunked async all_to_all), N chunks
  fused_int8      transport="symm-int8"
  fused_a2a       transport="a2a": one ep_dispatch / ep_combine each way (torch's all_to_all_vdev_2d
                  contract, fixed per-source slabs: one wait each way), the local experts on the
                  receive window, no torch scalar read
  fused_a2a_int8  transport="a2a-int8": int8 rows + scales dispatched into a8w8-int experts
  comm_a2a        that exchange alone: the dispatch by token index into the windows and the combine of
                  its rows back, summed into the tokens (the fused op's ``dispatch_rows`` / ``combine_sum``)
  comm_a2a_int8   the same with the int8 rows (H + 4 bytes) out, fp32 rows back
  comm_symm       the heap exchange with no expert work (rows out, rows back)
  comm_gloo       the gloo all_to_all_single exchange of the same rows, both ways (+ counts)
  compute         the local experts on the rows this rank receives, no exchange (``fused_moe_cpu`` with
                  K = 1 on a contiguous copy: its own sort, gather and combine included)
  kernel          the packed experts kernel alone on as many contiguous expert-sorted rows (a tighter
                  roof: nothing around the GEMMs)
Times: per call, the median over repeats of the slowest rank's time in that repeat (ranks start
each repeat after a barrier — gloo's, then a shared-memory flag barrier unless ``--barrier gloo`` —
and a layer is done when its slowest rank is).
Bytes: what the a2a exchange moves between ranks per call and rank (rows to / from the other
ranks; a rank's own rows never cross), dispatch + combine (the backward's: [dy | g] rows out now
that the forward keeps its received rows, against [x | dy | g] before; [dx | dg] back); "model" =
those bytes / the measured shared-memory copy bandwidth (``shm_bw``, one 64 MiB copy into
/dev/shm, one thread), "GB/s" = the bytes / comm_a2a.  Ratios: fused_a2a / (compute + comm_a2a),
fused_a2a / (compute + model), eager_gloo / fused_a2a, fused_a2a / (kernel + model).  The a2a
table's rows are timed interleaved (one repeat of each in turn).
Overlap figure: fused_symm / max(comm_symm, compute) (target: <= 1.15).
Every run records ``uptime``'s load beside its figures: the CI machine is shared.  ``--pin`` puts
rank r on core r: unpinned, gloo's wake-ups can leave both ranks on one core (the 2-core VM: a
decode exchange 0.49 ms unpinned, 0.23 ms pinned, load ~2).

Usage: python benchmarks/bench_ep.py [--worlds 2 4] [--tokens 512] [--quick]   (results/ep/<machine>-<date>.*)
       python benchmarks/bench_ep.py --out /dev/null --exchange-only --worlds 2 --tokens 8 --repeats 200
       python benchmarks/bench_ep.py --a2a-only --worlds 2 --tokens 8 512   (the a2a rows alone: ...-<date>-a2a.*)
       python benchmarks/bench_ep.py --out /dev/null --overlap --worlds 2 --tokens 8 512 --repeats 20
       python benchmarks/bench_ep.py --out /dev/null --backward-bytes --worlds 2 --tokens 64   (measured bytes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [  # name, H, F, E, K
    ("H1024_F512_E64_K8", 1024, 512, 64, 8),
    ("H1024_F2048_E8_K2", 1024, 2048, 8, 2),
]


_SYNC = []  # the shared-memory barrier heap of this rank (``--barrier shm``), made on first use


def _barrier():
    """gloo's barrier, then (``--barrier shm``) a flag barrier on a shared-memory heap: gloo releases
    the ranks tens of microseconds apart, which the first wait of a decode exchange would absorb;
    the flag barrier releases them within a few."""
    dist.barrier()
    if _SYNC:
        _SYNC[0].barrier(60.0)


def _timeit(fn, repeats, warmup):
    """This rank's time of each repeat (merged over ranks by ``run_world``: the slowest per repeat)."""
    for _ in range(warmup):
        _barrier()
        fn()
    out = []
    for _ in range(repeats):
        _barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _timeit_interleaved(fns: dict, repeats, warmup) -> dict:
    """``_timeit`` of several rows, one repeat of each in turn (A B C A B C ...): load that comes and
    goes on a shared machine then hits every row alike, so their ratios hold better than their times."""
    out = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for k, fn in fns.items():
            _barrier()
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                out[k].append(time.perf_counter() - t0)
    return out


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def shm_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes/s of one thread's copy into a /dev/shm mapping (the exchange's copies are of this kind)."""
    path = os.path.join("/dev/shm", f"moec_bench_bw_{os.getpid()}")
    try:
        dst = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst.copy_(src)  # fault the pages in
        best = min(_copy_time(dst, src) for _ in range(repeats))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return nbytes / best


def _copy_time(dst, src) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def _a2a_bytes(ids, E: int, world: int, rank: int, row_bytes: int, back_bytes: int) -> list:
    """[dispatch, combine] bytes this rank sends to the other ranks in one a2a layer."""
    el = E // world
    per_rank = torch.bincount((ids.reshape(-1) // el).clamp(0, world - 1), minlength=world)  # slots to each rank
    sent = int(per_rank.sum() - per_rank[rank])
    return [sent * row_bytes, sent * back_bytes]


def _rank_main(rank, world, store_path, cfg, queue):
    torch.set_num_threads(1)
    if cfg.get("pin"):  # rank r on core r % cores (how one would deploy ranks; off by default)
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    if cfg.get("barrier") == "shm":
        from moe_compile.symm import allocate

        _SYNC.append(allocate(store, rank, world, 64, 2 * world, "bench_ep/sync", 60.0))
    try:
        run = (_run_overlap if cfg.get("overlap") else _run_exchange if cfg.get("exchange_only")
               else _run_backward_bytes if cfg.get("backward_bytes") else _run_shapes)
        queue.put((rank, run(rank, world, cfg)))
    finally:
        dist.destroy_process_group()


def _layer_problem(rank, world, T, H, F, E, K):
    """(generator, this rank's experts, x [T, H], gates [T, K], ids [T, K]) of one bench layer."""
    from moe_compile.ir import ExpertWeights

    el = E // world
    gen = torch.Generator().manual_seed(1234 + rank)
    w = ExpertWeights((torch.randn(el, 2 * F, H, generator=gen) * H**-0.5,), (),
                      (torch.randn(el, H, F, generator=gen) * F**-0.5,))
    x = torch.randn(T, H, generator=gen)
    gw, ids = torch.rand(T, E, generator=gen).topk(K, dim=1)
    return gen, w, x, torch.softmax(gw, dim=1), ids


BWD_PATHS = ("fused_moe_ep", "train_op", "train_op_compiled")  # before / after, eager / AOTAutograd


def _run_backward_bytes(rank, world, cfg):
    """Bytes one backward's dispatch sends to the other ranks (rows x width, a rank's own rows never
    cross), per transport and path, from ``EPContext.sent``: ``fused_moe_ep`` under autograd (keeps
    nothing: [x | dy | g] / [x | dy] — what the compiled training path sent before), the training op
    eager (``call_fused_moe_ep``) and compiled by AOTAutograd (``aot_eager``, fullgraph)."""
    from moe_compile.ep.context import get_context
    from moe_compile.ep.op import call_fused_moe_ep
    from moe_compile.ir import FFNAttrs

    results, g, attrs = {}, dist.group.WORLD, FFNAttrs()
    ctx = get_context(g.group_name)
    for name, H, F, E, K in cfg["shapes"]:
        gen, w, x0, gw, ids = _layer_problem(rank, world, cfg["tokens"], H, F, E, K)
        row = {}
        for transport in ("a2a", "symm", "collectives"):
            def plain(x, transport=transport):
                return torch.ops.moe_compile.fused_moe_ep(
                    x, ids, gw, list(w.fc1), [], list(w.fc2), [], [], [], attrs.gate_up, attrs.transposed,
                    attrs.activation, attrs.limit, attrs.alpha, attrs.weight_on, g.group_name, E, 0, transport, 0, 60.0)

            def train(x, transport=transport):
                return call_fused_moe_ep(x, ids, gw, w, attrs, g, E, transport=transport)

            fns = {"fused_moe_ep": plain, "train_op": train,
                   "train_op_compiled": torch.compile(train, backend="aot_eager", fullgraph=True)}
            for path, fn in fns.items():
                x = x0.clone().requires_grad_()
                y = fn(x)
                ctx.sent.clear()
                y.sum().backward()
                width, rows = ctx.sent["a2a dispatch" if transport == "a2a" else "backward"][:2]
                row[f"bytes_bwd_{transport}_{path}"] = [width * rows]
                row[f"width_bwd_{transport}_{path}"] = width
        results[name] = row
    return results


def _backward_bytes_table(results: dict, loads: dict) -> list:
    lines = ["", "Backward dispatch bytes per call (the busiest rank's, to the other ranks; [dx | dg] rows come "
             "back either way): `fused_moe_ep` keeps nothing (what the compiled training path sent before), "
             "the training op eager and compiled (AOTAutograd).", "",
             "| world | T | shape | transport | " + " | ".join(BWD_PATHS) + " | after / before |", "|---" * 8 + "|"]
    for (world, T), res in results.items():
        for shape, row in res.items():
            for tr in ("a2a", "symm", "collectives"):
                b = [sum(row[f"bytes_bwd_{tr}_{p}"]) for p in BWD_PATHS]
                cells = " | ".join(f"{v / 1e6:.3f} MB ({row[f'width_bwd_{tr}_{p}']} B/row)" for v, p in zip(b, BWD_PATHS))
                lines.append(f"| {world} | {T} | {shape} | {tr} | {cells} | {b[2] / max(b[0], 1):.2f} |")
    lines.append("")
    lines.append("Load (uptime 1, 5, 15 min): " + "; ".join(f"world {w} T {T}: {ld}" for (w, T), ld in loads.items()))
    return lines


def _run_shapes(rank, world, cfg):
    from moe_compile.ep import dispatch, overlap
    from moe_compile.ep.context import get_context
    from moe_compile.ep.fused_a2a import backward_row_bytes
    from moe_compile.ep.op import call_fused_moe_ep
    from moe_compile.ep.plan import make_plan
    from moe_compile.ep.reference import eager_ep_layer
    from moe_compile.ir import ExpertWeights, FFNAttrs
    from moe_compile.kernels.cpu.ep import experts_on_rows

    results = {}
    g = dist.group.WORLD
    attrs = FFNAttrs()
    for name, H, F, E, K in cfg["shapes"]:
        T, el = cfg["tokens"], E // world
        gen, w, x, gw, ids = _layer_problem(rank, world, T, H, F, E, K)
        rep, wu = cfg["repeats"], cfg["warmup"]
        row = {}

        def fused(transport, chunks=0):
            return lambda: call_fused_moe_ep(x, ids, gw, w, attrs, g, E, transport=transport, chunks=chunks)

        a2a_rows = {"eager_gloo": lambda: eager_ep_layer(x, ids, gw, w, attrs, g, E), "fused_a2a": fused("a2a"),
                    "fused_a2a_int8": fused("a2a-int8"), "comm_a2a": _a2a_exchange(x, ids, gw, E, g.group_name),
                    "comm_a2a_int8": _a2a_exchange(x, ids, gw, E, g.group_name, int8=True),
                    "compute": _compute_only(rank, world, x, ids, gw, w, attrs, E, gen),
                    "kernel": _kernel_only(rank, world, x, ids, w, attrs, E, gen)}
        row.update(_timeit_interleaved(a2a_rows, rep, wu))
        row["bytes_a2a"] = _a2a_bytes(ids, E, world, rank, H * 4 + 4, H * 4)  # [x | g] out: FC2 into the windows
        row["bytes_a2a_int8"] = _a2a_bytes(ids, E, world, rank, H + 4, H * 4)
        # the backward: [dy | g] out when the forward kept its rows (now), [x | dy | g] (before); [dx | dg] back
        row["bytes_a2a_bwd"] = _a2a_bytes(ids, E, world, rank, *backward_row_bytes(H, 4, True))
        row["bytes_a2a_bwd_resend"] = _a2a_bytes(ids, E, world, rank, *backward_row_bytes(H, 4, False))
        if cfg.get("a2a_only"):
            results[name] = row
            continue
        row["fused_symm"] = _timeit(fused("symm"), rep, wu)
        for c in cfg["chunks"]:
            row[f"fused_symm_c{c}"] = _timeit(fused("symm", c), rep, wu)
            row[f"fused_coll_c{c}"] = _timeit(fused("collectives", c), rep, wu)
        row["fused_int8"] = _timeit(fused("symm-int8"), rep, wu)
        # communication only: the same exchanges with no expert work
        ctx = get_context(g.group_name)
        plan = make_plan(ids, E, world)
        gp = gw.reshape(-1)[plan.order].float()

        def copy_rows(rows, gg, counts, out, at):
            out.copy_(rows)

        row["comm_symm"] = _timeit(lambda: dispatch.exchange(ctx, plan, x, gp, copy_rows, H, x.dtype, chunks=1,
                                                             timeout_s=60), rep, wu)
        row["comm_gloo"] = _timeit(lambda: overlap.exchange(ctx, plan, x, gp, copy_rows, H, x.dtype, chunks=1,
                                                            timeout_s=60), rep, wu)
        results[name] = row
    return results


def _compute_only(rank, world, x, ids, gw, w, attrs, E, gen):
    """The local experts on the rows this rank receives (counts from a gather), no exchange."""
    from moe_compile.ep.plan import make_plan
    from moe_compile.kernels.cpu.ep import experts_on_rows

    plan = make_plan(ids, E, world)
    allc = [torch.empty_like(plan.counts) for _ in range(world)]
    dist.all_gather(allc, plan.counts, group=dist.group.WORLD)
    recv = torch.stack(allc)[:, rank]  # [R_src, El]
    n = int(recv.sum())
    rows, out = torch.randn(n, x.shape[1], generator=gen), torch.empty(n, x.shape[1])
    grow = torch.rand(n, generator=gen)
    counts = recv.tolist()
    return lambda: experts_on_rows(rows, grow, counts, w, attrs, out)


def _kernel_only(rank, world, x, ids, w, attrs, E, gen):
    """The packed experts kernel alone (``kernels/cpu/experts.run``) on as many contiguous rows as
    this rank receives, expert-sorted: the experts' arithmetic with no sort, gather or combine
    around it (falls back to ``_compute_only`` where the weights do not pack)."""
    from moe_compile.ep.plan import make_plan
    from moe_compile.kernels.cpu import experts as cpu_experts, prepack as cpu_prepack

    plan = make_plan(ids, E, world)
    allc = [torch.empty_like(plan.counts) for _ in range(world)]
    dist.all_gather(allc, plan.counts, group=dist.group.WORLD)
    per_expert = torch.stack(allc)[:, rank].sum(0)  # [El]
    n = int(per_expert.sum())
    rows = torch.randn(n, x.shape[1], generator=gen)
    bounds = [0] + per_expert.cumsum(0).tolist()
    packed = None
    for _ in range(3):  # the weights are packed once they have been seen unchanged
        packed = cpu_prepack.lookup(rows, w, attrs)
    if packed is None or not packed.fused:
        return _compute_only(rank, world, x, ids, torch.ones_like(ids, dtype=torch.float32), w, attrs, E, gen)
    tokens, ones = torch.arange(n), torch.ones(n)
    return lambda: cpu_experts.run(rows, tokens, ones, packed, w, attrs, bounds, torch.get_num_threads())


def _run_exchange(rank, world, cfg):
    """--exchange-only: the exchanges alone (a2a transport, symm heap transport), 64-expert shape."""
    from moe_compile.ep import dispatch
    from moe_compile.ep.context import get_context
    from moe_compile.ep.plan import make_plan

    name, H, F, E, K = cfg["shapes"][0]
    T, g = cfg["tokens"], dist.group.WORLD
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(T, H, generator=gen)
    gw, ids = torch.rand(T, E, generator=gen).topk(K, dim=1)
    gw = torch.softmax(gw, dim=1)
    plan = make_plan(ids, E, world)
    gp = gw.reshape(-1)[plan.order].float()

    def copy_rows(rows, gg, counts, out, at):
        out.copy_(rows)

    ctx, rep, wu = get_context(g.group_name), cfg["repeats"], cfg["warmup"]
    layers = cfg.get("layers", 1)
    if layers > 1:  # back to back, as a model's decode runs its layers: the barrier's skew amortized
        a2a, a2a8 = _a2a_exchange(x, ids, gw, E, g.group_name), _a2a_exchange(x, ids, gw, E, g.group_name, int8=True)
        per = {k: _timeit(lambda f=f: [f() for _ in range(layers)], rep, wu) for k, f in
               (("comm_a2a", a2a), ("comm_a2a_int8", a2a8))}
        return {name: {k: [t / layers for t in ts] for k, ts in per.items()}}
    return {name: {"comm_a2a": _timeit(_a2a_exchange(x, ids, gw, E, g.group_name), rep, wu),
                   "comm_symm": _timeit(lambda: dispatch.exchange(ctx, plan, x, gp, copy_rows, H, x.dtype, chunks=1,
                                                                  timeout_s=60), rep, wu)}}


def _run_overlap(rank, world, cfg):
    """--overlap: does independent work run while the a2a exchange is in flight help on CPU?  The
    work: a shared-expert-sized dense SwiGLU (F_s = 2F, torch GEMMs, this rank's one thread) on the
    T tokens, 64-expert shape.  Rows: the exchange alone (dispatch by token index + combine, as the
    fused op runs it), the shared expert alone, one after the other, the shared expert run between
    the dispatch's send and its wait (``dispatch_rows(between=...)``: the same thread), and in a
    second thread of this rank started before the exchange (the copies and the GEMM then share
    this rank's core with each other)."""
    import threading

    from moe_compile.ep import a2a_cpu, fused_a2a

    name, H, F, E, K = cfg["shapes"][0]
    T, group = cfg["tokens"], dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(T, H, generator=gen)
    gw, ids = torch.rand(T, E, generator=gen).topk(K, dim=1)
    route = fused_a2a._route(ids, torch.softmax(gw, dim=1), E, torch.float32)
    Fs = 2 * F
    wg, wu = (torch.randn(H, Fs, generator=gen) * H**-0.5 for _ in range(2))
    wd = torch.randn(Fs, H, generator=gen) * Fs**-0.5

    def shared():
        return (torch.nn.functional.silu(x @ wg) * (x @ wu)) @ wd

    def exchange(between=None):
        rcv = a2a_cpu.dispatch_rows(x, route.tokens, route.in_splits, group, 60.0, gates=route.gates, between=between)
        back = rcv.window[: rcv.handle[5]].view(torch.float32)  # the rows themselves go back
        a2a_cpu.combine_sum(back, rcv, route.tokens, route.gates, T, group, 60.0)

    def in_thread():
        torch.set_num_threads(1)  # OpenMP's thread count is per thread: a new one would take every core
        shared()

    def threaded():
        t = threading.Thread(target=in_thread)
        t.start()
        exchange()
        t.join()

    rows = {"comm": exchange, "shared": shared, "sequential": lambda: (exchange(), shared()),
            "between": lambda: exchange(between=shared), "thread": threaded}
    return {name: _timeit_interleaved(rows, cfg["repeats"], cfg["warmup"])}


def _a2a_exchange(x, ids, gw, E, group_name, int8=False):
    """The a2a transport's exchange with no expert work, as the fused op runs it: rows sent by token
    index into the receive windows, fp32 rows back and summed into the tokens (fp32: the packed
    experts' "FC2 into" form, whose rows back are stored by the kernel itself; ``int8``: the
    a2a-int8 rows out — quantized here, as the transport does — fp32 rows copied back)."""
    from moe_compile.ep import a2a_cpu, fused_a2a, fused_int8

    route = fused_a2a._route(ids, gw, E, torch.float32)
    T, H = x.shape

    def run():
        if not int8:  # fp32 as the packed experts run it: [x | g] rows out (own rows not copied), the rows'
            # addresses, flags back and the source's sum; the rows' stores are FC2's epilogue (not timed here)
            rcv = a2a_cpu.dispatch_rows(x, route.tokens, route.in_splits, group_name, 60.0, gates=route.gates,
                                        gate_rows=True, fc2_into=True)
            a2a_cpu.expert_rows(rcv, route.tokens, route.gates)
            a2a_cpu.combine_sum(torch.zeros(T, H), rcv, route.tokens, route.gates, T, group_name, 60.0)
            return
        rcv = a2a_cpu.dispatch_rows(fused_int8._rows(x), route.tokens, route.in_splits, group_name, 60.0,
                                    packed=True, gates=route.gates)
        a2a_cpu.combine_sum(torch.empty(rcv.handle[5], H), rcv, route.tokens, route.gates, T, group_name, 60.0)

    return run


def run_world(world, cfg):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, world, os.path.join(tmp, "s"), cfg, q)) for r in range(world)]
        for p in procs:
            p.start()
        per_rank = dict(q.get(timeout=3600) for _ in range(world))
        for p in procs:
            p.join()
    merged = {}
    for shape in per_rank[0]:
        merged[shape] = {}
        for k, v in per_rank[0][shape].items():
            if k.startswith("bytes"):  # [dispatch, combine] bytes: the busiest rank's
                merged[shape][k] = max((per_rank[r][shape][k] for r in range(world)), key=sum)
            elif isinstance(v, list):  # per-repeat times: the slowest rank of each repeat, then the median
                ranks = (per_rank[r][shape][k] for r in range(world))
                merged[shape][k] = statistics.median(max(ts) for ts in zip(*ranks))
            else:
                merged[shape][k] = max(per_rank[r][shape][k] for r in range(world))
    return merged


def _symm_table(all_results, cfg) -> list:
    lines = ["", "| world | T | shape | eager gloo EP | fused symm | speed-up | fused coll (best c) | fused int8 | "
             "comm symm | comm gloo | compute | overlap = fused / max(comm, compute) | best symm chunks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (world, T), res in all_results.items():
        for shape, r in res.items():
            best_c = min(cfg["chunks"], key=lambda c: r[f"fused_symm_c{c}"])
            best_coll = min(r[f"fused_coll_c{c}"] for c in cfg["chunks"])
            ov = r["fused_symm"] / max(r["comm_symm"], r["compute"])
            lines.append(
                f"| {world} | {T} | {shape} | {r['eager_gloo']*1e3:.1f} | {r['fused_symm']*1e3:.1f} | "
                f"{r['eager_gloo']/r['fused_symm']:.2f}x | {best_coll*1e3:.1f} | {r['fused_int8']*1e3:.1f} | "
                f"{r['comm_symm']*1e3:.1f} | {r['comm_gloo']*1e3:.1f} | {r['compute']*1e3:.1f} | {ov:.2f} | {best_c} |")
    lines += ["", "Chunk sweep (ms): " + "; ".join(
        f"w{w} T{T} {s}: " + ", ".join(f"symm c{c}={r[f'fused_symm_c{c}']*1e3:.1f} "
                                       f"coll c{c}={r[f'fused_coll_c{c}']*1e3:.1f}" for c in cfg["chunks"])
        for (w, T), res in all_results.items() for s, r in res.items())]
    return lines


def _a2a_table(all_results, bw: float) -> list:
    lines = ["", f"a2a transport (shared-memory copy bandwidth measured here: {bw / 1e9:.1f} GB/s, one thread):", "",
             "| world | T | shape | eager gloo | fused a2a | fused a2a-int8 | int8 / fp32 | compute | comm a2a | "
             "bytes/call (disp + comb) | GB/s | model = bytes/bw | fused / (compute + comm) | "
             "fused / (compute + model) | gloo / fused | int8 comm | int8 bytes | bwd bytes (dy only / x and dy) | "
             "kernel | fused / (kernel + model) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (world, T), res in all_results.items():
        for shape, r in res.items():
            b, b8 = sum(r["bytes_a2a"]), sum(r["bytes_a2a_int8"])
            model = b / bw
            lines.append(
                f"| {world} | {T} | {shape} | {r['eager_gloo']*1e3:.2f} | {r['fused_a2a']*1e3:.2f} | "
                f"{r['fused_a2a_int8']*1e3:.2f} | {r['fused_a2a_int8']/r['fused_a2a']:.2f}x | {r['compute']*1e3:.2f} | "
                f"{r['comm_a2a']*1e3:.3f} | {b / 1e6:.3f} MB | {b / r['comm_a2a'] / 1e9:.2f} | {model*1e3:.3f} | "
                f"{r['fused_a2a'] / (r['compute'] + r['comm_a2a']):.3f} | "
                f"{r['fused_a2a'] / (r['compute'] + model):.3f} | "
                f"{r['eager_gloo'] / r['fused_a2a']:.2f}x | {r['comm_a2a_int8']*1e3:.3f} | {b8 / 1e6:.3f} MB | "
                f"{sum(r['bytes_a2a_bwd']) / 1e6:.3f} / {sum(r['bytes_a2a_bwd_resend']) / 1e6:.3f} MB | "
                f"{r['kernel']*1e3:.2f} | {r['fused_a2a'] / (r['kernel'] + model):.3f} |")
    return lines


def _table(all_results, cfg, bw: float, loads: dict) -> str:
    lines = [
        f"# Expert-parallel MoE layer on CPU ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__})",
        "",
        f"T tokens per rank, fp32, 1 torch thread per rank, ranks = processes on this host (gloo for the "
        f"collectives). Times in ms per call: the median over {cfg['repeats']} repeats of the slowest rank's "
        f"time. Load (uptime: 1, 5, 15 min) at the start of each run: "
        + "; ".join(f"world {w} T {T}: {ld}" for (w, T), ld in loads.items()) + ".",
    ]
    if max(cfg["worlds"]) > (os.cpu_count() or 1):
        lines.append(f"**World sizes above {os.cpu_count()} oversubscribe this {os.cpu_count()}-core machine**: "
                     "ranks share cores, so their times include waiting for a core; ratios are still side by side.")
    lines += _a2a_table(all_results, bw)
    if not cfg.get("a2a_only"):
        lines += _symm_table(all_results, cfg)
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="path prefix: writes OUT.md and OUT.json (default: results/ep/<machine>-<date>, -a2a with "
                         "--a2a-only)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 512], help="T per rank: decode and prefill rows")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="T=64, 2 repeats (smoke run)")
    ap.add_argument("--a2a-only", action="store_true", help="only the a2a rows (no symm / collectives sweep)")
    ap.add_argument("--exchange-only", action="store_true",
                    help="only the exchanges (a2a and symm transports, 64-expert shape): prints the medians in ms")
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r %% cores")
    ap.add_argument("--barrier", choices=("shm", "gloo"), default="shm",
                    help="before each repeat: gloo's barrier then a shared-memory flag barrier (shm), or gloo's alone")
    ap.add_argument("--layers", type=int, default=1,
                    help="--exchange-only: a2a exchanges per timed repeat, back to back (a decode step's layers; "
                         "the time is per exchange)")
    ap.add_argument("--overlap", action="store_true",
                    help="the exchange with a shared-expert-sized dense GEMM alongside (64-expert shape): alone, "
                         "after, between send and wait, in a second thread; prints the medians in ms")
    ap.add_argument("--backward-bytes", action="store_true",
                    help="bytes one backward's dispatch sends, per transport: fused_moe_ep (keeps nothing) vs the "
                         "training op, eager and compiled (AOTAutograd); measured, no timing")
    args = ap.parse_args(argv)
    if args.out is None:
        import harness  # benchmarks/harness.py

        tag = "backward-bytes" if args.backward_bytes else "a2a" if args.a2a_only else None
        args.out = harness.result_stem("ep", tag)
    cfg = {"repeats": 2 if args.quick else args.repeats, "warmup": 1, "chunks": [1, 2, 4], "shapes": SHAPES,
           "worlds": args.worlds, "exchange_only": args.exchange_only, "a2a_only": args.a2a_only,
           "layers": args.layers, "pin": args.pin, "barrier": args.barrier, "overlap": args.overlap,
           "backward_bytes": args.backward_bytes}
    tokens = [64] if args.quick else args.tokens
    if args.backward_bytes:
        results, loads = {}, {}
        for world in args.worlds:
            for T in tokens:
                loads[(world, T)] = _load()
                results[(world, T)] = run_world(world, dict(cfg, tokens=T))
        md = "\n".join(_backward_bytes_table(results, loads)) + "\n"
        if args.out != "/dev/null":
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out + ".md", "w") as f:
                f.write(md)
        print(md)
        return
    if args.exchange_only or args.overlap:
        cfg["warmup"] = 20
        for world in args.worlds:
            for T in tokens:
                load = _load()
                res = run_world(world, dict(cfg, tokens=T))
                print(json.dumps({"world": world, "tokens": T, "repeats": cfg["repeats"], "load_before": load,
                                  "load_after": _load(),
                                  "ms": {s: {k: round(v * 1e3, 4) for k, v in r.items()} for s, r in res.items()}}))
        return
    bw = shm_bandwidth()
    results, loads = {}, {}
    for world in args.worlds:
        for T in tokens:
            t0, loads[(world, T)] = time.time(), _load()
            results[(world, T)] = run_world(world, dict(cfg, tokens=T))
            print(f"world {world} T {T}: {time.time() - t0:.0f}s (load {loads[(world, T)]} -> {_load()})", flush=True)
    md = _table(results, cfg, bw, loads)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    with open(args.out + ".json", "w") as f:
        json.dump({"config": cfg, "shm_bw": bw, "loads": {f"{w}/{T}": v for (w, T), v in loads.items()},
                   "results": {f"{w}/{T}": v for (w, T), v in results.items()}}, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
