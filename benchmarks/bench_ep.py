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
                  contract), the local experts on the receive window, no torch scalar read
  comm_a2a        that exchange alone: the dispatch into the window and the combine of its rows back
  comm_symm       the heap exchange with no expert work (rows out, rows back)
  comm_gloo       the gloo all_to_all_single exchange of the same rows, both ways (+ counts)
  compute         the local experts on the rows this rank receives, no exchange
Times: per call, max over ranks of each rank's median (ranks start each repeat after a barrier).
Overlap figure: fused_symm / max(comm_symm, compute) (the issue's target: <= 1.15).

Usage: python benchmarks/bench_ep.py --out benchmarks/results/ep_cpu [--worlds 2 4] [--tokens 512] [--quick]
       python benchmarks/bench_ep.py --out /dev/null --exchange-only --worlds 2 --tokens 8 --repeats 200
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


def _timeit(fn, repeats, warmup):
    for _ in range(warmup):
        dist.barrier()
        fn()
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _rank_main(rank, world, store_path, cfg, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        queue.put((rank, (_run_exchange if cfg.get("exchange_only") else _run_shapes)(rank, world, cfg)))
    finally:
        dist.destroy_process_group()


def _run_shapes(rank, world, cfg):
    from moe_compile.ep import dispatch, overlap
    from moe_compile.ep.context import get_context
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
        gen = torch.Generator().manual_seed(1234 + rank)
        w = ExpertWeights((torch.randn(el, 2 * F, H, generator=gen) * H**-0.5,), (),
                          (torch.randn(el, H, F, generator=gen) * F**-0.5,))
        x = torch.randn(T, H, generator=gen)
        gw, ids = torch.rand(T, E, generator=gen).topk(K, dim=1)
        gw = torch.softmax(gw, dim=1)
        rep, wu = cfg["repeats"], cfg["warmup"]
        row = {}

        def fused(transport, chunks=0):
            return lambda: call_fused_moe_ep(x, ids, gw, w, attrs, g, E, transport=transport, chunks=chunks)

        row["eager_gloo"] = _timeit(lambda: eager_ep_layer(x, ids, gw, w, attrs, g, E), rep, wu)
        row["fused_symm"] = _timeit(fused("symm"), rep, wu)
        for c in cfg["chunks"]:
            row[f"fused_symm_c{c}"] = _timeit(fused("symm", c), rep, wu)
            row[f"fused_coll_c{c}"] = _timeit(fused("collectives", c), rep, wu)
        row["fused_int8"] = _timeit(fused("symm-int8"), rep, wu)
        row["fused_a2a"] = _timeit(fused("a2a"), rep, wu)
        row["comm_a2a"] = _timeit(_a2a_exchange(x, ids, gw, E, g.group_name), rep, wu)
        # communication only: the same exchanges with no expert work
        ctx = get_context(g.group_name)
        plan = make_plan(ids, E, world)
        gp = gw.reshape(-1)[plan.order].float()

        def copy_rows(rows, gg, counts, out):
            out.copy_(rows)

        row["comm_symm"] = _timeit(lambda: dispatch.exchange(ctx, plan, x, gp, copy_rows, H, x.dtype, chunks=1,
                                                             timeout_s=60), rep, wu)
        row["comm_gloo"] = _timeit(lambda: overlap.exchange(ctx, plan, x, gp, copy_rows, H, x.dtype, chunks=1,
                                                            timeout_s=60), rep, wu)
        # compute only: the local experts on this rank's received rows (counts from a gather)
        allc = [torch.empty_like(plan.counts) for _ in range(world)]
        dist.all_gather(allc, plan.counts, group=g)
        recv = torch.stack(allc)[:, rank]  # [R_src, El]
        n = int(recv.sum())
        rows = torch.randn(n, H, generator=gen)
        grow = torch.rand(n, generator=gen)
        out = torch.empty(n, H)
        counts = recv.tolist()
        row["compute"] = _timeit(lambda: experts_on_rows(rows, grow, counts, w, attrs, out), rep, wu)
        row["recv_rows"] = n
        results[name] = row
    return results


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

    def copy_rows(rows, gg, counts, out):
        out.copy_(rows)

    ctx, rep, wu = get_context(g.group_name), cfg["repeats"], cfg["warmup"]
    return {name: {"comm_a2a": _timeit(_a2a_exchange(x, ids, gw, E, g.group_name), rep, wu),
                   "comm_symm": _timeit(lambda: dispatch.exchange(ctx, plan, x, gp, copy_rows, H, x.dtype, chunks=1,
                                                                  timeout_s=60), rep, wu)}}


def _a2a_exchange(x, ids, gw, E, group_name):
    """The a2a transport's exchange with no expert work: rows into the receive window and back."""
    from moe_compile.ep import a2a_cpu, fused_a2a

    route = fused_a2a._route(ids, gw, E, torch.float32)

    def run():
        win, oso, _, handle = a2a_cpu.exchange("dispatch", x.index_select(0, route.tokens), route.in_splits,
                                               group_name, 0, window=True)
        a2a_cpu.exchange("combine", win, oso, group_name, route.order.shape[0], after=handle)

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
        merged[shape] = {k: max(per_rank[r][shape][k] for r in range(world)) for k in per_rank[0][shape]}
    return merged


def _table(all_results, cfg):
    lines = [
        f"# Expert-parallel MoE layer on CPU ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__})",
        "",
        f"T = {cfg['tokens']} tokens per rank, fp32, 1 torch thread per rank, ranks = processes on this host "
        f"(gloo for the collectives). Times in ms per call: max over ranks of each rank's median of "
        f"{cfg['repeats']} repeats.",
    ]
    if max(cfg["worlds"]) > (os.cpu_count() or 1):
        lines.append(f"**World sizes above {os.cpu_count()} oversubscribe this {os.cpu_count()}-core machine**: "
                     "ranks share cores, so their times include waiting for a core; ratios are still side by side.")
    lines += ["", "| world | shape | eager gloo EP | fused symm | speed-up | fused coll (best c) | fused int8 | "
              "comm symm | comm gloo | compute | overlap = fused / max(comm, compute) | best symm chunks |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for world, res in all_results.items():
        for shape, r in res.items():
            best_c = min(cfg["chunks"], key=lambda c: r[f"fused_symm_c{c}"])
            best_coll = min(r[f"fused_coll_c{c}"] for c in cfg["chunks"])
            ov = r["fused_symm"] / max(r["comm_symm"], r["compute"])
            lines.append(
                f"| {world} | {shape} | {r['eager_gloo']*1e3:.1f} | {r['fused_symm']*1e3:.1f} | "
                f"{r['eager_gloo']/r['fused_symm']:.2f}x | {best_coll*1e3:.1f} | {r['fused_int8']*1e3:.1f} | "
                f"{r['comm_symm']*1e3:.1f} | {r['comm_gloo']*1e3:.1f} | {r['compute']*1e3:.1f} | {ov:.2f} | {best_c} |"
            )
    lines += ["", "a2a transport (ms): " + "; ".join(
        f"w{w} {s}: fused a2a {r['fused_a2a']*1e3:.2f}, its exchange alone {r['comm_a2a']*1e3:.3f}"
        for w, res in all_results.items() for s, r in res.items())]
    lines += ["", "Chunk sweep (ms): " + "; ".join(
        f"w{w} {s}: " + ", ".join(f"symm c{c}={r[f'fused_symm_c{c}']*1e3:.1f} coll c{c}={r[f'fused_coll_c{c}']*1e3:.1f}"
                                  for c in cfg["chunks"])
        for w, res in all_results.items() for s, r in res.items())]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="path prefix: writes OUT.md and OUT.json")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="T=64, 2 repeats (smoke run)")
    ap.add_argument("--exchange-only", action="store_true",
                    help="only the exchanges (a2a and symm transports, 64-expert shape): prints the medians in ms")
    args = ap.parse_args(argv)
    cfg = {"tokens": 64 if args.quick else args.tokens, "repeats": 2 if args.quick else args.repeats,
           "warmup": 1, "chunks": [1, 2, 4], "shapes": SHAPES, "worlds": args.worlds,
           "exchange_only": args.exchange_only}
    if args.exchange_only:
        cfg["warmup"] = 20
        for world in args.worlds:
            res = run_world(world, cfg)
            print(json.dumps({"world": world, "tokens": cfg["tokens"], "repeats": cfg["repeats"],
                              "ms": {s: {k: round(v * 1e3, 4) for k, v in r.items()} for s, r in res.items()}}))
        return
    results = {}
    for world in args.worlds:
        t0 = time.time()
        results[world] = run_world(world, cfg)
        print(f"world {world}: {time.time() - t0:.0f}s", flush=True)
    md = _table(results, cfg)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    with open(args.out + ".json", "w") as f:
        json.dump({"config": cfg, "results": {str(k): v for k, v in results.items()}}, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
