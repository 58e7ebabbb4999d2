"""moe-compile: run the demo, dump what the moe backend does to a script's graphs, list devices.

    moe-compile demo                  a tiny random-weight MoE language model, compiled, checked, timed
    moe-compile demo --world-size N   expert-parallel blocks on N gloo ranks of this host (CPU)
    moe-compile dump SCRIPT [-- ARGS] run a script with graph dumping on and list what was written
    moe-compile devices [--verbose]   which kernel variants this machine runs

Nothing here imports torch until a command runs: ``--help`` and ``--version`` stay instant.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import sys
import tempfile

DESCRIPTION = (
    "A torch.compile backend (backend=\"moe\") that rewrites unfused Mixture-of-Experts layers into "
    "fused kernels. Docs: docs/architecture.md, docs/options.md in the repository."
)


def _ep_rank(rank: int, world: int, store_path: str, tokens: int, results) -> None:
    import torch
    import torch.distributed as dist

    from moe_compile.models import zoo_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        results.put((rank, zoo_ep.demo(tokens)))
    finally:
        dist.destroy_process_group()


def demo_ep(args) -> int:
    """``demo --world-size N``: N gloo ranks on this host run both EP blocks (moe_compile/models/zoo_ep.py)."""
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
    from moe_compile import demo as lm_demo

    models = lm_demo.MODELS if args.model == "all" else (args.model,)
    return lm_demo.main(models, args.layers, args.prompt, args.tokens, args.repeats, args.llama_bench)


def dump(args) -> int:
    if args.script is None:
        print("moe-compile dump: give the Python script to run: moe-compile dump SCRIPT [-- ARGS]", file=sys.stderr)
        return 2
    if not os.path.isfile(args.script):
        print(f"moe-compile dump: no such script: {args.script!r} (give the path of a Python file to run)",
              file=sys.stderr)
        return 2
    made = args.dir is None
    folder = args.dir or tempfile.mkdtemp(prefix="moe_compile_dump_")
    os.environ["MOE_COMPILE_DUMP"] = folder
    sys.argv = [args.script, *args.script_args]
    from moe_compile import dump as graph_dump

    graph_dump.GRAPHVIZ_HINT.said = True  # this command says it once, below the listing
    try:
        runpy.run_path(args.script, run_name="__main__")
    finally:
        written = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        if made and not written:  # nothing compiled: no empty temporary folder left behind
            shutil.rmtree(folder, ignore_errors=True)
        print(f"\nmoe_compile dump: {len(written)} graph(s)" + (f" under {folder}" if written else
              " (the script compiled nothing with backend=\"moe\")"))
        for name in written:
            print(f"  {os.path.join(folder, name)}: {', '.join(sorted(os.listdir(os.path.join(folder, name))))}")
        if any(f.endswith(".dot") for name in written for f in os.listdir(os.path.join(folder, name))):
            hint = graph_dump.GRAPHVIZ_HINT.text()
            if hint:
                print(hint)
    return 0


def devices(args) -> int:
    from moe_compile.devices import describe

    print(describe(verbose=args.verbose))
    return 0


def _version() -> str:
    from moe_compile import __version__  # the package's __init__ imports torch only when its API is touched

    return f"moe-compile {__version__}"




def build_parser() -> argparse.ArgumentParser:
    from moe_compile.models import DEMO_MODELS as MODELS  # no torch: --help stays instant

    parser = argparse.ArgumentParser(prog="moe-compile", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of:")
    p = sub.add_parser("demo", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="build a tiny random-weight MoE language model offline, generate with it eager, "
                            "under default torch.compile and under backend=\"moe\", check and time them",
                       description="Builds a tiny random-weight causal LM of a real MoE architecture (no "
                                   "download), generates greedily with it eager, under default torch.compile and "
                                   "under backend=\"moe\", checks tokens and logits against eager and prints "
                                   "prefill and decode tokens/s.")
    p.add_argument("--model", choices=(*MODELS, "all"), default=MODELS[0], help="architecture of the model")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate (with --world-size: tokens per rank)")
    p.add_argument("--prompt", type=int, default=64, help="prompt length in tokens (random ids)")
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per variant (median)")
    p.add_argument("--world-size", type=int, default=1,
                   help="N > 1: spawn N gloo ranks on this host and compile the expert-parallel blocks instead")
    p.add_argument("--llama-bench", metavar="PATH", default=None,
                   help="llama.cpp's llama-bench binary: also time the same model (qwen3-moe, written as an f32 "
                        "GGUF; needs the gguf package) in llama.cpp and print its tokens/s beside ours")
    p.set_defaults(func=demo)
    p = sub.add_parser("dump", help="run SCRIPT with graph dumping on (before/after code, report, region pictures)",
                       description="Runs SCRIPT with MOE_COMPILE_DUMP set: every graph compiled with "
                                   "backend=\"moe\" gets a folder with its code before and after the rewrite, "
                                   "the report, and a picture of each rewritten MoE region.")
    p.add_argument("--dir", default=None, help="where to dump (default: a new temporary directory)")
    p.add_argument("script", nargs="?", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    p.set_defaults(func=dump)
    p = sub.add_parser("devices", help="which kernel variants this machine runs",
                       description="A short table of the kernel variants this machine runs and on which kernels.")
    p.add_argument("--verbose", action="store_true",
                   help="also each kernel's build state and why, the capability table, and the GPU and Ascend rows")
    p.set_defaults(func=devices)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "script_args", None) and args.script_args[:1] == ["--"]:
        args.script_args = args.script_args[1:]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
