"""Fixed cost of one CPU call of the inference op on a tiny MoE, warm and with the caches cold.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

On a tiny shape (default H=64, F=128, E=8, K=2, T=1: 200 KiB of expert weights) a call is all
fixed cost: the torch dispatcher, the op's Python, the allocation of y and the C kernel's start.
Side by side, timed round-robin in one process (fp32, 2 threads, under ``torch.no_grad()``):

  op          ``torch.ops.moe_compile.fused_moe_infer`` (what the moe backend emits for inference)
  op_python   the op's Python body called directly (the op less the dispatcher)
  noop_op     an op of the same schema whose body returns x (the dispatcher's own floor)
  llama.cpp   one ggml graph compute of llama.cpp's MoE FFN (``--llama-lib``: libmoe_peer.so,
              built by the llama.cpp peer tool; left out when not given or not found)

"warm": calls back to back.  "cold": 64 MiB of unrelated memory read before each call, as in a
model whose layers' weights stream through the caches between two calls of this op.  The target
is <= 40 us for one warm op call at H=64, E=8.

    python benchmarks/bench_cpu_fixed_cost.py [--llama-lib /path/libmoe_peer.so] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

TARGET_WARM_US = 40.0


def make_args(H, F, E, K, T, seed=0):
    """The op's 15 arguments on stacked fp32 weights (gate|up concatenated, weight on the output)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * F, H, generator=g) * 0.02
    w2 = torch.randn(E, H, F, generator=g) * 0.02
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()
    gates = torch.softmax(torch.randn(T, K, generator=g), 1).contiguous()
    return (x, ids, gates, [w1], [], [w2], [], [], [], "concat", False, "silu", 0.0, 1.702, "output")


def noop_op():
    """An op with fused_moe_infer's schema whose CPU body returns x: the dispatcher's floor."""
    from moe_compile.ops import fused_moe as ops

    lib = torch.library.Library("moe_compile_bench", "FRAGMENT")
    lib.define("noop" + ops.op_args_schema() + " -> Tensor")
    lib.impl("noop", lambda *args: args[0], "CPU")
    return lib, torch.ops.moe_compile_bench.noop


def llama_call(path, args):
    """``fn()`` running llama.cpp's MoE FFN graph once on the same weights and routing, or None."""
    if not path or not os.path.exists(path):
        return None
    x, ids, gates, (w1,), _, (w2,) = args[:6]
    lib = ctypes.CDLL(path)
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.peer_weights_new.restype, lib.peer_weights_new.argtypes = P, [I, I, I, I, I, I, P, P]
    lib.peer_new.restype, lib.peer_new.argtypes = P, [P, I, I, I, P, P, P]
    lib.peer_run.restype, lib.peer_run.argtypes = ctypes.c_double, [P]
    E, F2, H = w1.shape
    weights = lib.peer_weights_new(H, F2 // 2, E, 0, 1, 0, w1.data_ptr(), w2.data_ptr())  # f32, merged gate|up
    ids32 = ids.to(torch.int32).contiguous()
    call = lib.peer_new(weights, ids.shape[1], x.shape[0], torch.get_num_threads(), x.data_ptr(), ids32.data_ptr(),
                        gates.data_ptr())
    keep = (lib, weights, ids32)
    return lambda: (lib.peer_run(call), keep)


def time_rounds(fns: dict, rounds: int, before=None) -> dict:
    """Median, min and max microseconds per variant over shuffled rounds (``harness.time_shuffled``)."""
    samples = harness.time_shuffled(fns, rounds, before=before, warmup=20)
    return {k: dict(median_us=statistics.median(v) * 1e6, min_us=min(v) * 1e6, max_us=max(v) * 1e6, n=len(v))
            for k, v in samples.items()}


def run(H, F, E, K, T, rounds, llama_lib) -> dict:
    from moe_compile.ops import fused_moe as ops

    harness.setup_threads(2)
    args = make_args(H, F, E, K, T)
    _lib, noop = noop_op()
    op = torch.ops.moe_compile.fused_moe_infer
    fns = {"op": lambda: op(*args), "op_python": lambda: ops._fused_moe_infer(*args), "noop_op": lambda: noop(*args)}
    llama = llama_call(llama_lib, args)
    if llama is not None:
        fns["llama.cpp"] = llama
    with torch.no_grad():
        from moe_compile.kernels.cpu import decode as cpu_decode

        fast_path = getattr(cpu_decode, "decode_args", None)  # absent in older trees (A/B against older code)
        fast = fast_path is not None and fast_path(args, torch.get_num_threads()) is not None
    flush = harness.cache_flush(64)
    return dict(machine=harness.machine_info(), shape=dict(H=H, F=F, E=E, K=K, T=T), fast_path=fast,
                load_before=harness.load_average(), warm=time_rounds(fns, rounds),
                cold=time_rounds(fns, max(rounds // 10, 50), before=flush), load_after=harness.load_average())


def to_markdown(data: dict) -> str:
    m, s = data["machine"], data["shape"]
    head = (f"Fixed cost of one call, fp32, {harness.machine_line(m)}; H={s['H']} F={s['F']} E={s['E']} K={s['K']} "
            f"T={s['T']}; the op's decode fast path taken: {data['fast_path']}. Median us (min..max) of rounds in "
            f"shuffled order; cold = 64 MiB read before each call. Load {data['load_before']} -> {data['load_after']}.\n\n")
    rows = []
    for k in data["warm"]:
        w, c = data["warm"][k], data["cold"][k]
        rows.append([k, f"{w['median_us']:.1f} ({w['min_us']:.1f}..{w['max_us']:.1f})",
                     f"{c['median_us']:.1f} ({c['min_us']:.1f}..{c['max_us']:.1f})"])
    body = harness.markdown_table(["variant", "warm us", "cold us"], rows)
    warm = data["warm"]["op"]["median_us"]
    verdict = "meets" if warm <= TARGET_WARM_US else "MISSES"
    return head + body + f"\nop warm {warm:.1f} us: {verdict} the target of <= {TARGET_WARM_US:.0f} us.\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=5, type=int, default=[64, 128, 8, 2, 1], metavar=("H", "F", "E", "K", "T"))
    ap.add_argument("--rounds", type=int, default=2000, help="warm rounds (cold: a tenth, at least 50)")
    ap.add_argument("--llama-lib", default=os.environ.get("MOE_COMPILE_LLAMACPP_PEER"),
                    help="libmoe_peer.so of the llama.cpp peer tool (default $MOE_COMPILE_LLAMACPP_PEER)")
    ap.add_argument("--out", default=None,
                    help="path prefix of the .md / .json (default: results/cpu_fixed_cost/<machine>-<date>; an "
                         "existing directory gets cpu_fixed_cost.*)")
    a = ap.parse_args(argv)
    data = run(*a.shape, a.rounds, a.llama_lib)
    md = to_markdown(data)
    print(md)
    harness.write_outputs(a.out or harness.result_stem("cpu_fixed_cost"), "cpu_fixed_cost", md, data)


if __name__ == "__main__":
    main()
