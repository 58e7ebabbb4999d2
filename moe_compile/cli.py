"""``moe-compile``: demo, dump, devices.

    moe-compile demo                  compile two small MoE blocks, check against eager, time them
    moe-compile demo --world-size N   the same for expert-parallel blocks on N gloo ranks (CPU)
    moe-compile dump SCRIPT [-- ARGS] run a script with MOE_COMPILE_DUMP set and list what was written
    moe-compile devices               which variants this machine runs
"""

from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import tempfile
import time


def _median_ms(fn, x, repeats: int) -> float:
    fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _ep_rank(rank: int, world: int, store_path: str, tokens: int, results) -> None:
    import torch
    import torch.distributed as dist

    from moe_compile import zoo_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        results.put((rank, zoo_ep.demo(tokens)))
    finally:
        dist.destroy_process_group()


def demo_ep(args) -> int:
    """``demo --world-size N``: N gloo ranks on this host run both EP blocks (moe_compile/zoo_ep.py)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_ep_rank, args=(r, args.world_size, store, args.tokens, results))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        for p in procs:
            if p.is_alive():  # a peer failed and left this rank waiting in a collective
                p.terminate()
                p.join()
    oks = [results.get() for p in procs if p.exitcode == 0]
    ok = len(oks) == args.world_size and all(v for _, v in oks)
    print(f"\n{args.world_size} ranks: {'all equal to eager' if ok else 'FAILED'}")
    return 0 if ok else 1


def demo(args) -> int:
    if args.world_size > 1:
        return demo_ep(args)
    import torch

    from moe_compile import zoo
    from moe_compile.api import capture_flags
    from moe_compile.compiler import collecting_reports

    torch.manual_seed(0)
    blocks = {
        "deepseek-style (E=64, K=6, shared expert)": zoo.DeepSeekStyleBlock(hidden=256, ffn=128),
        "mixtral-style (E=8, K=2)": zoo.ModuleListMoE(hidden=256, ffn=512, experts=8, top_k=2),
    }
    rows, ok = [], True
    for name, block in blocks.items():
        block.eval()
        x = torch.randn(1, args.tokens, 256)
        print(f"== {name}", flush=True)
        with torch.no_grad(), capture_flags():
            want = block(x)
            fused = torch.compile(block, backend="moe")
            with collecting_reports() as report:  # the report of the compile itself: no extra trace
                got = fused(x)
            print(report)
            err = ((got - want).abs().max() / want.abs().max()).item()
            ok &= err <= 1e-4 and len(report.rewritten) == 1
            print(f"max relative error vs eager: {err:.2e} ({'ok' if err <= 1e-4 else 'MISMATCH'})", flush=True)
            default = torch.compile(block)
            rows.append((name, _median_ms(block, x, args.repeats), _median_ms(default, x, args.repeats),
                         _median_ms(fused, x, args.repeats)))
    print(f"\nT={args.tokens} tokens, fp32, {torch.get_num_threads()} threads, median of {args.repeats} runs (ms):")
    print(f"{'block':45s} {'eager':>9s} {'inductor':>9s} {'moe':>9s} {'vs best peer':>13s}")
    for name, eager, default, fused in rows:
        print(f"{name:45s} {eager:9.2f} {default:9.2f} {fused:9.2f} {min(eager, default) / fused:12.2f}x")
    return 0 if ok else 1


def dump(args) -> int:
    folder = args.dir or tempfile.mkdtemp(prefix="moe_compile_dump_")
    os.environ["MOE_COMPILE_DUMP"] = folder
    sys.argv = [args.script, *args.script_args]
    try:
        runpy.run_path(args.script, run_name="__main__")
    finally:
        written = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        print(f"\nmoe_compile dump: {len(written)} graph(s) under {folder}")
        for name in written:
            print(f"  {os.path.join(folder, name)}: {', '.join(sorted(os.listdir(os.path.join(folder, name))))}")
    return 0


def devices(args) -> int:
    from moe_compile.devices import describe

    print(describe())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moe-compile", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="compile two small MoE blocks, check them against eager, time them")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world-size", type=int, default=1,
                   help="N > 1: spawn N gloo ranks on this host and compile the expert-parallel blocks")
    p.set_defaults(func=demo)
    p = sub.add_parser("dump", help="run SCRIPT with graph dumping on")
    p.add_argument("--dir", default=None, help="where to dump (default: a new temporary directory)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=dump)
    p = sub.add_parser("devices", help="which kernel variants this machine runs")
    p.set_defaults(func=devices)
    args = parser.parse_args(argv)
    if getattr(args, "script_args", None) and args.script_args[:1] == ["--"]:
        args.script_args = args.script_args[1:]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
