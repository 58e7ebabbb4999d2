"""fp32 MoE expert FFN on CPU: the inference op against llama.cpp's MoE path, with the measured roofs.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.
Expert FFN (SwiGLU, weight after FC2): y[t] = sum_k g[t,k] * W2_e (silu(W1g_e x_t) * W1u_e x_t).

Side by side in one process, on the same fp32 weights W1 [E, 2F, H] (gate rows, then up rows),
W2 [E, H, F] ~ normal(0, 0.02), x [T, H] ~ normal(0, 1), K distinct random experts per token and
softmax routing weights:

  moe        ``torch.ops.moe_compile.fused_moe_infer`` (what the moe backend emits for inference)
  llama_*    llama.cpp's MoE graph (mul_mat_id FC1 -> swiglu -> mul_mat_id FC2 -> weights -> sum),
             f32 weights, FC1 as one merged gate|up tensor or as two: ``libmoe_peer.so`` of the
             llama.cpp peer tool (``--llama-lib`` or ``$MOE_COMPILE_LLAMACPP_PEER``; the llama.cpp
             columns are left out when it is not built)
  roof       decode (T < 64): ``torch.sum`` over exactly the touched experts' weights (as in
             ``bench_cpu_moe.py``), and the touched bytes at the best read bandwidth of a 256 MiB
             ``torch.sum``; prefill: a dense fp32 ``torch.mm`` [T*K, H] x [H, 3F] of equal FLOPs

Every round calls each variant once, in an order shuffled every round: a call that always ran
right after the 256 MiB read was ~0.15 ms slower than the same call elsewhere in the round
(Mixtral T=1, 2-core EPYC), so a fixed order biases whichever variant follows it.  Decode cells
read --flush-mib MiB of unrelated memory before every timed call (default: twice the last-level
cache, at least 256): 64 MiB did not evict a 50 MB working set on a VM reporting a 480 MiB L3
(1.14 ms against 2.23 ms after 256 MiB for the same Mixtral-like T=1 call).  2 threads on both sides.

    python benchmarks/bench_cpu_llamacpp.py --llama-lib /path/libmoe_peer.so   # results/cpu_llamacpp/<machine>-<date>.*
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

SHAPES = {"mixtral-like": (1024, 2048, 8, 2), "fine-grained": (1024, 512, 64, 8)}  # (H, F, E, K)
TOKENS = (1, 4, 512)
DECODE_MAX_T = 64
GGML_F32 = 0


def open_peer(path):
    """The llama.cpp peer library (ctypes), or None when it is not there."""
    if not path or not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)  # after torch: its OpenMP calls resolve to torch's libgomp
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.peer_weights_new.restype, lib.peer_weights_new.argtypes = P, [I, I, I, I, I, I, P, P]
    lib.peer_new.restype, lib.peer_new.argtypes = P, [P, I, I, I, P, P, P]
    lib.peer_run.restype, lib.peer_run.argtypes = ctypes.c_double, [P]
    lib.peer_output.argtypes = [P, P]
    lib.peer_system_info.restype = ctypes.c_char_p
    return lib


def make_case(H, F, E, K, T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()  # K distinct experts per token
    gates = torch.softmax(torch.randn(T, K, generator=g), 1).contiguous()
    return x, ids, gates


def llama_variants(lib, weights: dict, x, ids, gates, threads):
    """name -> (fn, output fn) for each llama.cpp weight layout."""
    ids32 = ids.to(torch.int32).contiguous()
    out = {}
    for layout, wh in weights.items():
        call = lib.peer_new(wh, ids.shape[1], x.shape[0], threads, x.data_ptr(), ids32.data_ptr(), gates.data_ptr())

        def output(call=call):
            y = torch.empty_like(x)
            lib.peer_output(call, y.data_ptr())
            return y

        out[f"llama_{layout}"] = (lambda call=call, keep=ids32: lib.peer_run(call), output)
    return out


def run_cell(lib, weights, W1, W2, H, F, E, K, T, rounds, flush, bw_buf) -> dict:
    x, ids, gates = make_case(H, F, E, K, T, seed=1000 + T)
    op = torch.ops.moe_compile.fused_moe_infer
    fns = {"moe": lambda: op(x, ids, gates, [W1], [], [W2], [], [], [], "concat", False, "silu", 0.0, 1.702, "output")}
    peers = llama_variants(lib, weights, x, ids, gates, torch.get_num_threads()) if lib is not None else {}
    fns.update({k: v[0] for k, v in peers.items()})
    decode = T < DECODE_MAX_T
    touched = torch.unique(ids).tolist()
    if decode:
        tensors = [W1[e] for e in touched] + [W2[e] for e in touched]
        fns["roof_sum"] = lambda: [t.sum() for t in tensors]
        fns["bw_256mib"] = lambda: bw_buf.sum()
    else:
        a, b, c = torch.randn(T * K, H), torch.randn(H, 3 * F), torch.empty(T * K, 3 * F)
        fns["roof_mm"] = lambda: torch.mm(a, b, out=c)
    with torch.no_grad():
        ref = fns["moe"]()
        for fn, _ in peers.values():
            fn()  # the graph's output tensor holds a result only after a run
        errs = {k: harness.max_rel_err(v[1](), ref) for k, v in peers.items()}
    load = harness.load_average()
    samples = harness.time_shuffled(fns, rounds, before=flush if decode else None)
    med = {k: statistics.median(v) for k, v in samples.items()}
    row = dict(H=H, F=F, E=E, K=K, T=T, touched_experts=len(touched), load_before=load,
               load_after=harness.load_average(), ms={k: v * 1e3 for k, v in med.items()},
               ms_minmax={k: [min(v) * 1e3, max(v) * 1e3] for k, v in samples.items()}, rel_err_vs_moe=errs)
    if decode:
        nbytes = 3 * H * F * 4 * len(touched)
        best_bw = max(bw_buf.numel() * 4 / s for s in samples["bw_256mib"])
        row.update(roof_bytes=nbytes, bw_best_GBps=best_bw / 1e9, roof_ms=med["roof_sum"] * 1e3,
                   roof_bw_ms=nbytes / best_bw * 1e3)
    else:
        row.update(roof_ms=med["roof_mm"] * 1e3)
    if peers:
        best = min(peers, key=lambda k: med[k])
        row.update(llama_best=best, llama_over_moe=med[best] / med["moe"])
    row["roof_over_moe"] = row["roof_ms"] / row["ms"]["moe"]
    if decode:
        row["roof_bw_over_moe"] = row["roof_bw_ms"] / row["ms"]["moe"]
    return row


def run(shapes, tokens, lib, decode_rounds, prefill_rounds, flush_mib: int = 256) -> dict:
    harness.setup_threads(2)
    import moe_compile.ops  # noqa: F401  registers the ops

    flush, bw_buf = harness.cache_flush(flush_mib), torch.ones(256 * 2**20 // 4)
    rows = []
    for name in shapes:
        H, F, E, K = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        W1 = (torch.randn(E, 2 * F, H, generator=g) * 0.02).contiguous()
        W2 = (torch.randn(E, H, F, generator=g) * 0.02).contiguous()
        weights = {}
        if lib is not None:
            for layout, merged in (("merged", 1), ("sep", 0)):
                weights[layout] = lib.peer_weights_new(H, F, E, GGML_F32, merged, 0, W1.data_ptr(), W2.data_ptr())
        for T in tokens:
            row = run_cell(lib, weights, W1, W2, H, F, E, K, T, decode_rounds if T < DECODE_MAX_T else prefill_rounds,
                           flush, bw_buf)
            row["shape"] = name
            rows.append(row)
            print(f"# {name} T={T}: " + " ".join(f"{k}={v:.3f}" for k, v in row["ms"].items()), file=sys.stderr,
                  flush=True)
    info = harness.machine_info()
    info["ggml"] = lib.peer_system_info().decode() if lib is not None else None
    info["isa_env"] = {k: os.environ.get(k) for k in ("MOE_COMPILE_FUSED_ISA", "ONEDNN_MAX_CPU_ISA",
                                                       "MKL_ENABLE_INSTRUCTIONS")}
    return dict(machine=info, rows=rows, flush_mib=flush_mib)


def to_markdown(data: dict) -> str:
    m = data["machine"]
    head = (f"fp32, {harness.machine_line(m)}; ISA switches {m['isa_env']}; llama.cpp: {m['ggml']}. Median ms of rounds in "
            f"shuffled order (decode: {data.get('flush_mib', 64)} MiB read before each call). Roof: decode = torch.sum over the touched "
            f"experts' weights (and, in brackets, their bytes at the best 256 MiB read bandwidth); prefill = "
            f"dense torch.mm of equal FLOPs.\n\n")
    headers = ["shape", "T", "moe", "llama.cpp best", "roof", "llama/moe", "roof/moe", "rel err llama"]
    rows = []
    for r in data["rows"]:
        ms = r["ms"]
        llama = f"{ms[r['llama_best']]:.3f} ({r['llama_best']})" if "llama_best" in r else "-"
        roof = (f"{r['roof_ms']:.3f} [{r['roof_bw_ms']:.3f} at {r['bw_best_GBps']:.0f} GB/s]" if "roof_bw_ms" in r
                else f"{r['roof_ms']:.2f}")
        ratio = (f"{r['roof_over_moe']:.2f} [{r['roof_bw_over_moe']:.2f}]" if "roof_bw_over_moe" in r
                 else f"{r['roof_over_moe']:.2f}")
        err = ", ".join(f"{v:.1e}" for v in r["rel_err_vs_moe"].values()) or "-"
        rows.append([f"{r['shape']} ({r['H']},{r['F']},{r['E']},{r['K']})", r["T"], f"{ms['moe']:.3f}", llama, roof,
                     f"{r['llama_over_moe']:.2f}x" if "llama_over_moe" in r else "-", ratio, err])
    return head + harness.markdown_table(headers, rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-lib", default=os.environ.get("MOE_COMPILE_LLAMACPP_PEER"),
                    help="libmoe_peer.so (default $MOE_COMPILE_LLAMACPP_PEER; without it only moe and the roofs)")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--decode-rounds", type=int, default=40)
    ap.add_argument("--prefill-rounds", type=int, default=7)
    ap.add_argument("--flush-mib", type=int, default=None,
                    help="MiB read before each decode call (evicts the weights; default twice the last-level cache, "
                         "at least 256)")
    ap.add_argument("--out", default=None,
                    help="path prefix of the .md / .json / .png (default: results/cpu_llamacpp/<machine>-<date>; "
                         "an existing directory gets cpu_llamacpp.*)")
    a = ap.parse_args(argv)
    import moe_compile.ops  # noqa: F401  torch's libgomp first, then the peer library

    lib = open_peer(a.llama_lib)
    if lib is None:
        print(f"# llama.cpp peer not found ({a.llama_lib!r}): moe and the roofs only", file=sys.stderr)
    data = run(a.shapes, a.tokens, lib, a.decode_rounds, a.prefill_rounds, a.flush_mib or max(256, harness.flush_mib()))
    md = to_markdown(data)
    print(md)
    harness.write_outputs(a.out or harness.result_stem("cpu_llamacpp"), "cpu_llamacpp", md, data)


if __name__ == "__main__":
    main()
