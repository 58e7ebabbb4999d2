"""CPU decode of one MoE layer on quantized weights: ``kernels/cpu/qdecode`` against llama.cpp's
expert path and against each format's weight-streaming roof, side by side in one process.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.
Expert FFN (SwiGLU, weight after FC2): y[t] = sum_k g[t,k] * W2_e (silu(W1g_e x_t) * W1u_e x_t).

Data: fp32 W1 [E, 2F, H] (gate rows, then up rows) and W2 [E, H, F] drawn from normal(0, 0.02),
x [T, H] ~ normal(0, 1), K distinct random experts per token, softmax routing weights.

  op <fmt>        ``torch.ops.moe_compile.fused_moe_quant`` with ``quant=fmt`` on the fp32 weights:
                  what the backend emits and users run (its first call packs and registers the
                  layer, later decode calls run qdecode from the op's C++ CPU kernel); the
                  ratios to llama.cpp and the roof are this side's.  Not for w16-fp16 (the op's
                  w16 packs these trained-scale weights as fp16 itself: ``quant/w16.py``).
  op <fmt> warm   the same call, but right after the flush (untimed) one call of the op on a small
                  layer of the same format (F 128, other weights): the weights still come from
                  DRAM, the code path (Python, dispatcher, kernel, their data) does not.  Inside a
                  model's decode step the op runs a moment after the previous layer's call, so
                  this is nearer what it costs there; after the flush alone the code path's cache
                  misses added 60-80 us a call (2-core Xeon VM: a8w4-int Mixtral-like T = 1
                  0.376 -> 0.309 ms, against 0.265 for a hand-written read of the same bytes).
                  Its roof fraction is printed beside the cold one; the llama.cpp ratios stay
                  cold against cold.
  qdecode <fmt>   ``qdecode.run`` on ``moe_compile.quant.pack(fmt, W)`` (w16: bf16, w16-fp16: fp16;
                  a8w4-int is group-wise, group 32; a8w4-int-g64 / -g128 its other groups,
                  a8w4-int-pc its per-channel MSD form, qdecode only),
                  the kernel's Python host call (checks, plan, ctypes); 2 torch threads.
  llama <type>    llama.cpp (ggml ``MUL_MAT_ID`` graph as llama.cpp's ``build_moe_ffn`` builds it)
                  through the peer library ``libmoe_peer.so`` (``--peer-lib``), weights converted by
                  ggml into f16 / q8_0 / q4_0; every variant timed (FC1 as two tensors or one merged
                  one; q4_0 also in the CPU_REPACK buffer), the fastest reported; 2 ggml threads.
  roof            bytes of the touched experts at the format (data + scales) / the read bandwidth
                  (``torch.sum`` over 256 MiB, timed in the same rounds, best sample).
  read <fmt>      ``torch.sum`` over one fp32 buffer of exactly those bytes, timed like the others
                  (after the same flush, median of the rounds): what merely streaming that
                  much memory from DRAM takes here at that size, no arithmetic.  On small cells it
                  is well above the roof (a few MiB do not reach the large read's speed), so
                  ``op / read`` says how far a kernel is from the memory it reads, ``op / roof``
                  how far from the machine's best large read.

Load: before each cell the script waits until other processes use at most ``--others-limit``
cores (all waiting stops after ``--max-wait-s``); each row reports what they used before and
during its timing.

Timing: rounds; each round times one call of every side (the starting side rotating), each call
after reading ``--flush-mib`` of unrelated memory (default: twice the last-level cache, at least
64 MiB: weights come from DRAM, as in a model larger than the L3).  ms = median of the rounds.  Errors: each qdecode side against ``quant.reference_moe``, each
llama.cpp side against the fp32 reference MoE (max |diff| / max |ref|).

    python benchmarks/bench_quant_decode.py --peer-lib PEER/libmoe_peer.so   # results/quant_decode/<machine>-<date>.jsonl
    MOE_COMPILE_FUSED_ISA=avx2 python benchmarks/bench_quant_decode.py --peer-lib PEER_AVX2_BUILD/libmoe_peer.so

Without ``--peer-lib`` (or ``$MOE_PEER_LIB``) the llama.cpp sides are skipped.  One JSON line per
(shape, T) with every side; a table on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import torch

SHAPES = {"mixtral-like": (1024, 2048, 8, 2), "fine-grained": (1024, 512, 64, 8)}  # (H, F, E, K)
FORMATS = ("w16", "w16-fp16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int", "a8w4-int-g64",
           "a8w4-int-g128", "a8w4-int-pc")  # a8w4-int: group 32; -g64 / -g128 its other groups; -pc per channel (MSD)
GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8, "q4_K": 12}
OP_FORMATS = ("w16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int")  # the op's quant= names among FORMATS
PEER_OF = {"w16": "f16", "w16-fp16": "f16", "w8-int": "q8_0", "w4-int": "q4_0", "mxfp4": "q4_0", "mxfp8": "q8_0",
           "a8w8-int": "q8_0", "a8w4-int": "q4_0", "a8w4-int-g64": "q4_0", "a8w4-int-g128": "q4_0", "a8w4-int-pc": "q4_0"}


def open_peer(path: str):
    lib = ctypes.CDLL(path)
    P, I, D = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    for name, res, args in (("peer_weights_new", P, [I, I, I, I, I, I, P, P]), ("peer_weights_free", None, [P]),
                            ("peer_new", P, [P, I, I, I, P, P, P]), ("peer_run", D, [P]), ("peer_output", None, [P, P]),
                            ("peer_free", None, [P]), ("peer_system_info", ctypes.c_char_p, [])):
        getattr(lib, name).restype, getattr(lib, name).argtypes = res, args
    return lib


def pack(fmt: str, w: torch.Tensor):
    from moe_compile import quant
    from moe_compile.quant import a8w4_int, w16

    if fmt.startswith("w16"):
        return w16.pack(w, torch.float16 if fmt == "w16-fp16" else torch.bfloat16)
    if fmt.startswith("a8w4-int-"):
        return a8w4_int.pack(w, None if fmt.endswith("-pc") else int(fmt.rsplit("-g", 1)[1]))
    return quant.pack(fmt, w)


def fp32_reference(x, ids, g, W1, W2):
    from moe_compile.ir import ExpertWeights, FFNAttrs
    from moe_compile.kernels import reference

    return reference.fused_moe_reference(x, ids, g, ExpertWeights((W1,), (), (W2,)), FFNAttrs())


def rel_err(y, ref) -> float:
    return float((y.double() - ref.double()).abs().max() / ref.double().abs().max())


def cpu_ticks() -> tuple[int, int]:
    """(busy ticks of the machine, ticks of this process)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/self/stat") as f:
        st = f.read().rsplit(")", 1)[1].split()
    return v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0), int(st[11]) + int(st[12])


def others_cores(seconds: float = 3.0) -> float:
    """Cores' worth of CPU other processes used over the next ``seconds`` (this one sleeping)."""
    a, t = cpu_ticks(), time.perf_counter()
    time.sleep(seconds)
    b = cpu_ticks()
    return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - t))


def wait_quiet(limit: float, deadline: float) -> float:
    """Wait (10 s steps) until other processes use at most ``limit`` cores, or the deadline."""
    used = others_cores()
    while used > limit and time.time() < deadline:
        print(f"# other processes use {used:.2f} cores: waiting", flush=True)
        time.sleep(10)
        used = others_cores()
    return used


def time_rounds(fns: dict, repeats: int, before, pre: dict | None = None) -> dict:
    """Samples of every side: before() ahead of each timed call, then the side's own untimed
    pre[k]() where it has one."""
    names, samples, pre = list(fns), {k: [] for k in fns}, pre or {}
    for r in range(repeats):
        for i in range(len(names)):
            k = names[(r + i) % len(names)]
            before()
            if k in pre:
                pre[k]()
            t0 = time.perf_counter()
            fns[k]()
            samples[k].append(time.perf_counter() - t0)
    return samples


def peer_sides(lib, H, F, E, K, T, W1, W2, x, ids, g, types, keep):
    """name -> callable for every llama.cpp variant; the weights / calls kept alive in ``keep``."""
    sides = {}
    ids32 = ids.to(torch.int32).contiguous()
    keep.append(ids32)
    for t in types:
        for layout in (0, 1):
            for repack in ((0, 1) if t in ("q4_0", "q4_K") else (0,)):
                key = (t, layout, repack)
                if key not in keep[0]:
                    keep[0][key] = lib.peer_weights_new(H, F, E, GGML_TYPES[t], layout, repack, W1.data_ptr(), W2.data_ptr())
                wh = keep[0][key]
                if not wh:
                    continue
                call = lib.peer_new(wh, K, T, torch.get_num_threads(), x.data_ptr(), ids32.data_ptr(), g.data_ptr())
                keep[1].append(call)
                sides[f"llama {t} {'merged' if layout else 'sep'}{' repack' if repack else ''}"] = (
                    lambda call=call: lib.peer_run(call), call)
    return sides


def peer_output(lib, call, T, H):
    y = torch.empty(T, H)
    lib.peer_output(call, y.data_ptr())
    return y


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--peer-lib", default=os.environ.get("MOE_PEER_LIB"), help="llama.cpp peer libmoe_peer.so")
    ap.add_argument("--peer-types", nargs="+", choices=list(GGML_TYPES), default=["f16", "q8_0", "q4_0"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--flush-mib", type=int, default=None,
                    help="MiB read before each timed call (default: twice the last-level cache, at least 64)")
    ap.add_argument("--bw-mib", type=int, default=256)
    ap.add_argument("--others-limit", type=float, default=0.3,
                    help="before each cell wait until other processes use at most this many cores")
    ap.add_argument("--max-wait-s", type=float, default=600, help="all waiting for quiet together stops after this")
    ap.add_argument("--out",
                    help="append the JSON lines to this file (default: "
                         "results/quant_decode/<machine>-<date>.jsonl, with -avx2-switch under "
                         "MOE_COMPILE_FUSED_ISA=avx2)")
    a = ap.parse_args(argv)
    if a.flush_mib is None:
        import harness  # benchmarks/harness.py

        a.flush_mib = harness.flush_mib()

    torch.set_num_threads(a.threads)
    from moe_compile import quant
    from moe_compile.ir import FFNAttrs
    from moe_compile.kernels.cpu import qdecode
    import moe_compile.ops  # noqa: F401  registers the op

    quant_op = torch.ops.moe_compile.fused_moe_quant

    lib = open_peer(a.peer_lib) if a.peer_lib and os.path.exists(a.peer_lib) else None  # after torch: one libgomp
    isa = {qdecode.ISA_AVX2: "avx2", qdecode.ISA_AVX512: "avx512"}[qdecode.best_isa()]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "").split()
    meta = {"meta": True, "cpu": cpu, "cores": os.cpu_count(), "threads": a.threads, "qdecode_isa": isa,
            "cpu_flags": [f for f in flags if f.startswith(("avx", "fma", "f16c"))],
            "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "peer": a.peer_lib if lib else None,
            "ggml": lib.peer_system_info().decode() if lib else None, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load": os.getloadavg(),
            "flush_mib": a.flush_mib}
    import harness  # benchmarks/harness.py

    out_f = open(a.out or harness.output_path(harness.result_stem("quant_decode"), "", ".jsonl"), "a")
    print(json.dumps(meta), flush=True)
    if out_f:
        out_f.write(json.dumps(meta) + "\n")
    flush_buf, bw_buf = torch.ones(a.flush_mib * 2**18), torch.ones(a.bw_mib * 2**18)
    deadline = time.time() + a.max_wait_s
    for shape in a.shapes:
        H, F, E, K = SHAPES[shape]
        gen = torch.Generator().manual_seed(0)
        W1 = (torch.randn(E, 2 * F, H, generator=gen) * 0.02).contiguous()
        W2 = (torch.randn(E, H, F, generator=gen) * 0.02).contiguous()
        packed = {f: (pack(f, W1), pack(f, W2)) for f in a.formats}
        # the small layer whose call warms the op's code path for the "warm" sides
        W1s, W2s = (torch.randn(E, 2 * 128, H, generator=gen) * 0.02).contiguous(), (torch.randn(E, H, 128, generator=gen) * 0.02).contiguous()
        peer_keep = [{}, []]
        for T in a.tokens:
            gen = torch.Generator().manual_seed(1000 + T)
            x = torch.randn(T, H, generator=gen)
            ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].contiguous()
            g = torch.softmax(torch.randn(T, K, generator=gen), dim=1).contiguous()
            fns, errs, attrs, pre = {}, {}, FFNAttrs(), {}
            touched = int(torch.unique(ids).numel())
            for f, (w1, w2) in packed.items():
                read_buf = torch.ones(int(touched * (w1.nbytes + w2.nbytes) / E) // 4)
                fns[f"read {f}"] = lambda read_buf=read_buf: read_buf.sum()
                fns[f"qdecode {f}"] = lambda w1=w1, w2=w2: qdecode.run(x, ids, g, w1, w2, attrs, None)
                ref_q = quant.reference_moe(x, ids, g, w1, w2, attrs)
                errs[f"qdecode {f}"] = rel_err(fns[f"qdecode {f}"](), ref_q)
                if f in OP_FORMATS:
                    args = (x, ids, g, [W1], [], [W2], [], [], [], "concat", False, "silu", 0.0, 1.702, "output", f,
                            30.0, f"bench {shape}")
                    fns[f"op {f}"] = fns[f"op {f} warm"] = lambda args=args: quant_op(*args)
                    small = (x, ids, g, [W1s], [], [W2s], *args[6:-1], f"bench {shape} small")
                    pre[f"op {f} warm"] = lambda small=small: quant_op(*small)
                    with torch.no_grad():
                        errs[f"op {f}"] = rel_err(fns[f"op {f}"](), ref_q)
            peers = peer_sides(lib, H, F, E, K, T, W1, W2, x, ids, g, a.peer_types, peer_keep) if lib else {}
            ref32 = fp32_reference(x, ids, g, W1, W2)
            for name, (fn, call) in peers.items():
                fns[name] = fn
                fn()
                errs[name] = rel_err(peer_output(lib, call, T, H), ref32)
            fns["bw"] = lambda: bw_buf.sum()  # noqa: E731
            with torch.no_grad():
                for _ in range(3):
                    for fn in fns.values():
                        fn()
                others = wait_quiet(a.others_limit, deadline)
                load0, ticks0, t0 = os.getloadavg(), cpu_ticks(), time.perf_counter()
                samples = time_rounds(fns, a.repeats, lambda: flush_buf.sum(), pre)
                ticks1, elapsed = cpu_ticks(), time.perf_counter() - t0
                during = ((ticks1[0] - ticks0[0]) - (ticks1[1] - ticks0[1])) / os.sysconf("SC_CLK_TCK") / elapsed
            med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
            bw = max(bw_buf.numel() * 4 / s for s in samples["bw"])
            row = {"shape": shape, "H": H, "F": F, "E": E, "K": K, "T": T, "touched_experts": touched, "isa": isa,
                   "read_GBps_best": round(bw / 1e9, 1), "load_before": load0,
                   "others_cores_before": round(others, 2), "others_cores_during": round(max(0.0, during), 2), "load_after": os.getloadavg(),
                   "ms": {k: round(v, 4) for k, v in med.items() if k != "bw"},
                   "rel_err": {k: float(f"{v:.2e}") for k, v in errs.items()}}
            roofs = {}
            for f, (w1, w2) in packed.items():
                per_expert = (w1.nbytes + w2.nbytes) / E  # data + scales of one expert, both roles
                roofs[f] = touched * per_expert / bw * 1e3
            row["roof_ms"] = {f: round(v, 4) for f, v in roofs.items()}
            best_peer = {}
            for t in a.peer_types:
                cands = {k: v for k, v in med.items() if k.startswith(f"llama {t} ")}
                if cands:
                    best = min(cands, key=cands.get)
                    best_peer[t] = (best, cands[best])
            row["llama_best"] = {t: [n, round(v, 4)] for t, (n, v) in best_peer.items()}
            row["roof_over_qdecode"] = {f: round(roofs[f] / med[f"qdecode {f}"], 3) for f in packed}
            row["llama_over_qdecode"] = {f: round(best_peer[PEER_OF[f]][1] / med[f"qdecode {f}"], 3)
                                         for f in packed if PEER_OF[f] in best_peer}
            ops_run = [f for f in packed if f in OP_FORMATS]
            row["roof_over_op"] = {f: round(roofs[f] / med[f"op {f}"], 3) for f in ops_run}
            row["roof_over_op_warm"] = {f: round(roofs[f] / med[f"op {f} warm"], 3) for f in ops_run}
            row["read_over_op"] = {f: round(med[f"read {f}"] / med[f"op {f}"], 3) for f in ops_run}
            row["llama_over_op"] = {f: round(best_peer[PEER_OF[f]][1] / med[f"op {f}"], 3)
                                    for f in ops_run if PEER_OF[f] in best_peer}
            line = json.dumps(row)
            print(line, flush=True)
            if out_f:
                out_f.write(line + "\n")
                out_f.flush()
            print(f"# {shape} T={T} ({touched} experts, {bw / 1e9:.0f} GB/s, isa {isa}, other processes "
                  f"{others:.2f} cores before, {max(0.0, during):.2f} during):", flush=True)
            for f in packed:
                side = f"op {f}" if f in OP_FORMATS else f"qdecode {f}"
                peer = best_peer.get(PEER_OF[f])
                vs = f"  llama {PEER_OF[f]} {peer[1]:.3f} ms -> {peer[1] / med[side]:.2f}x" if peer else ""
                warm = f"  warm {med[side + ' warm']:.3f} ({roofs[f] / med[side + ' warm']:.2f})" \
                    if side + " warm" in med else ""
                print(f"#   {side:12s} {med[side]:.3f} ms (qdecode.run {med[f'qdecode {f}']:.3f})  roof {roofs[f]:.3f} "
                      f"({roofs[f] / med[side]:.2f}){warm}  read {med[f'read {f}']:.3f} ({med[f'read {f}'] / med[side]:.2f})"
                      f"{vs}  err {errs[side]:.1e}", flush=True)
            for call in peer_keep[1]:
                lib.peer_free(call)
            peer_keep[1].clear()
        for wh in peer_keep[0].values():
            if wh:
                lib.peer_weights_free(wh)
    if out_f:
        out_f.close()


if __name__ == "__main__":
    main()
