"""CPU quantized prefill: the qgemm kernel's formats against the fp32 fused op and llama.cpp.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

Side by side in one process, timed round-robin (``harness.time_interleaved``), per (shape, T):

  fp32      ``torch.ops.moe_compile.fused_moe_infer`` on the stacked fp32 weights (the fused
            experts kernel on its panels; packed on its 2nd call, before timing)
  <fmt>     ``kernels/cpu/qgemm.run`` on the same weights quantized by ``moe_compile.quant.pack`` to
            a8w8-int, a8w4-int, w4-int, mxfp4, w8-int, w16 (bf16) (the kernel's pack made before
            timing, as the op keeps it); a8w4-int-float: a8w4-int on w4-int's float panels
            (``block=False``), the form it ran on before its integer block tiles
  llama_*   llama.cpp's MoE expert path (ggml MUL_MAT_ID: FC1 -> swiglu -> FC2 -> weighted sum)
            through the llama.cpp peer tool's ``libmoe_peer.so`` (``--peer-lib``, or
            ``$MOE_COMPILE_LLAMACPP_PEER`` as bench_cpu_llamacpp.py reads it; build it AVX2-only to
            compare with MOE_COMPILE_FUSED_ISA=avx2), weights converted by ggml into q8_0 / q4_0 /
            q4_K (plain and CPU_REPACK buffers) and f16; skipped when the library is absent.
  roof      one dense fp32 ``torch.mm`` [T*K, H] x [H, 3F] (the experts' FLOPs).

Clock: wall time (default), or with ``--clock cpu`` this process's CPU time per call (on a machine
other processes load, with ``--threads 1``: each variant's cost on one core, free of time slicing).

Inputs as the llama.cpp peer's driver draws them: W ~ normal(0, 0.02), x ~ normal(0, 1), K
distinct random experts per token, softmax weights.  Each variant's error is reported against the
fp32 op (max |y - ref| / max |ref|).  Ratios: ``x fp32`` = fp32 time / variant time (> 1: faster).

    python benchmarks/bench_quant_prefill.py --peer-lib PEER/libmoe_peer.so   # results/quant_prefill/<machine>-<date>.*
    MOE_COMPILE_FUSED_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_quant_prefill.py \\
        --peer-lib PEER_AVX2/libmoe_peer.so                                # AVX2 emulated
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SHAPES = {"mixtral-like": (1024, 2048, 8, 2), "fine-grained": (1024, 512, 64, 8)}  # (H, F, E, K)
FORMATS = ("a8w8-int", "a8w4-int", "a8w4-int-float", "w4-int", "mxfp4", "w8-int", "mxfp8", "w16")
# a8w4-int-float: group-wise a8w4-int on w4-int's float panels (qgemm.run(block=False)), the form it
# ran on before its integer block tiles: their A/B in one process
PEER_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8, "q4_K": 12}  # ggml type ids
PEER_REPACKABLE = ("q4_0", "q4_K")


# ---- the llama.cpp peer (ctypes, the C API of the peer tool's libmoe_peer.so) ----

def peer_lib(path: str | None):
    if not path or not os.path.exists(path):
        return None, f"{path!r} absent (--peer-lib / $MOE_COMPILE_LLAMACPP_PEER)"
    lib = ctypes.CDLL(path)  # after torch: ggml's libgomp.so.1 resolves to torch's
    P, I, D = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    for name, res, args in (("peer_weights_new", P, [I, I, I, I, I, I, P, P]), ("peer_weights_free", None, [P]),
                            ("peer_new", P, [P, I, I, I, P, P, P]), ("peer_run", D, [P]),
                            ("peer_output", None, [P, P]), ("peer_free", None, [P]),
                            ("peer_system_info", ctypes.c_char_p, [])):
        getattr(lib, name).restype, getattr(lib, name).argtypes = res, args
    return lib, path


def peer_calls(lib, W1, W2, x, ids, g, K):
    """name -> (fn, output fn, handles to free) for each llama.cpp type and buffer."""
    E, F2, H = W1.shape
    T = x.shape[0]
    ids32 = ids.to(torch.int32).contiguous()
    calls, handles = {}, []
    for dt, code in PEER_TYPES.items():
        for repack in ((0, 1) if dt in PEER_REPACKABLE else (0,)):
            wh = lib.peer_weights_new(H, F2 // 2, E, code, 1, repack, W1.data_ptr(), W2.data_ptr())
            if not wh:
                continue
            h = lib.peer_new(wh, K, T, torch.get_num_threads(), x.data_ptr(), ids32.data_ptr(), g.data_ptr())
            handles.append((wh, h, (x, ids32, g)))

            def out(h=h):
                y = torch.empty(T, H)
                lib.peer_output(h, y.data_ptr())
                return y

            calls[f"llama_{dt}{'_repack' if repack else ''}"] = (lambda h=h: lib.peer_run(h), out)
    return calls, handles


def simd_flags() -> str:
    """The CPU's SIMD feature flags (/proc/cpuinfo), the ones these kernels care about."""
    with open("/proc/cpuinfo") as f:
        line = next((l for l in f if l.startswith("flags")), "")
    return " ".join(f for f in line.split() if f.startswith(("avx", "fma", "f16c", "amx")))


# ---- one cell ----

def time_rounds(fns: dict, repeats: int, clock) -> dict:
    """``harness.time_interleaved`` on ``clock``: round-robin rounds, the first variant rotating."""
    names, samples = list(fns), {k: [] for k in fns}
    with torch.no_grad():
        for k in names:
            fns[k](), fns[k]()
        for r in range(repeats):
            for i in range(len(names)):
                k = names[(r + i) % len(names)]
                t0 = clock()
                fns[k]()
                samples[k].append(clock() - t0)
    return {k: harness.Timing(statistics.median(v), min(v), max(v), len(v), v) for k, v in samples.items()}


def cell(shape: str, T: int, repeats: int, lib, formats, clock) -> list[dict]:
    from moe_compile import quant
    from moe_compile.ir import FFNAttrs
    from moe_compile.kernels.cpu import qgemm

    H, F, E, K = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    W1 = (torch.randn(E, 2 * F, H, generator=gen) * 0.02).contiguous()
    W2 = (torch.randn(E, H, F, generator=gen) * 0.02).contiguous()
    x = torch.randn(T, H, generator=gen)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K].contiguous()
    g = torch.softmax(torch.randn(T, K, generator=gen), 1).contiguous()
    op = torch.ops.moe_compile.fused_moe_infer
    fns = {"fp32": lambda: op(x, ids, g, [W1], [], [W2], [], [], [], "concat", False, "silu", 0.0, 1.702, "output")}
    outputs = {"fp32": fns["fp32"]}
    attrs, packed_bytes = FFNAttrs(), {}
    for fmt in formats:
        base, kw = fmt.removesuffix("-float"), ({"block": False} if fmt.endswith("-float") else {})
        w1, w2, cache = quant.pack(base, W1), quant.pack(base, W2), {}  # default groups (32 for w-int and MX)
        qgemm.packed(w1, cache), qgemm.packed(w2, cache)
        packed_bytes[fmt] = sum(p.nbytes for p in cache.values())
        fns[fmt] = outputs[fmt] = (lambda w1=w1, w2=w2, cache=cache, kw=kw: qgemm.run(x, ids, g, w1, w2, attrs, cache, **kw))
    handles = []
    if lib is not None:
        calls, handles = peer_calls(lib, W1, W2, x, ids, g, K)
        for name, (fn, out) in calls.items():
            fns[name], outputs[name] = fn, (lambda fn=fn, out=out: (fn(), out())[1])
    fns["roof"] = harness.dense_gemm(T * K, H, 3 * F)
    with torch.no_grad():
        for _ in range(3):
            fns["fp32"]()  # the fused op packs its panels on the 2nd call
        ref = outputs["fp32"]()
        errs = {k: harness.max_rel_err(f(), ref) for k, f in outputs.items()}
    load_before = harness.load_average()
    times = time_rounds(fns, repeats, clock)
    for wh, h, _ in handles:
        lib.peer_free(h)
        lib.peer_weights_free(wh)
    base = times["fp32"].median_s
    llama = {k: t.median_s for k, t in times.items() if k.startswith("llama_")}
    best_llama = min(llama, key=llama.get) if llama else None
    rows = []
    for k, t in times.items():
        rows.append(dict(shape=shape, H=H, F=F, E=E, K=K, T=T, variant=k, ms=round(t.median_s * 1e3, 3), spread_ms=t.spread,
                         x_fp32=round(base / t.median_s, 3),
                         x_best_llama=round(llama[best_llama] / t.median_s, 3) if best_llama else None,
                         best_llama=best_llama, rel_err_vs_fp32=float(f"{errs.get(k, 0.0):.2e}"),
                         packed_MiB=round(packed_bytes[k] / 2**20, 1) if k in packed_bytes else None,
                         load_before=load_before, load_after=harness.load_average(), repeats=t.repeats))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[512])
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-lib", default=os.environ.get("MOE_COMPILE_LLAMACPP_PEER"),
                    help="the llama.cpp peer tool's libmoe_peer.so (an AVX2-only build for MOE_COMPILE_FUSED_ISA=avx2)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time per call (time.process_time, all its threads): on a "
                         "loaded machine, with --threads 1, what each variant costs a core, free of time slicing")
    ap.add_argument("--out",
                    help="path prefix of the .md / .json / .png (default: results/quant_prefill/<machine>-<date>, "
                         "with -avx2-switch under MOE_COMPILE_FUSED_ISA=avx2 and the clock and threads when not "
                         "wall and 2)")
    a = ap.parse_args(argv)
    harness.setup_threads(a.threads)
    import moe_compile.ops  # noqa: F401  registers torch.ops.moe_compile.*
    from moe_compile.kernels.cpu import qgemm

    avx2 = os.environ.get("MOE_COMPILE_FUSED_ISA", "").lower() == "avx2"
    lib, peer = (None, "--no-peer") if a.no_peer else peer_lib(a.peer_lib)
    info = harness.machine_info()
    info.update(flags=simd_flags(), isa={f: qgemm.best_isa(f) for f in a.formats}, emulated_avx2=avx2, peer=peer, clock=a.clock,
                peer_ggml=lib.peer_system_info().decode() if lib is not None else None,
                env={k: os.environ[k] for k in ("MOE_COMPILE_FUSED_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                               "ATEN_CPU_CAPABILITY") if k in os.environ})
    print(info, flush=True)
    rows = []
    for shape in a.shapes:
        for T in a.tokens:
            got = cell(shape, T, a.repeats, lib, a.formats, time.process_time if a.clock == "cpu" else time.perf_counter)
            for r in got:
                print(r, flush=True)
            rows += got
    headers = ["shape", "T", "variant", "ms (median)", "min..max", "x fp32", "x best llama.cpp", "err vs fp32", "pack MiB"]
    table = harness.markdown_table(headers, [[r["shape"], r["T"], r["variant"], r["ms"], r["spread_ms"], r["x_fp32"],
                                              r["x_best_llama"], r["rel_err_vs_fp32"], r["packed_MiB"]] for r in rows])
    print(table)
    tag = None if (a.clock, a.threads) == ("wall", 2) else f"{a.clock}{a.threads}t"
    default = harness.result_stem("quant_prefill", tag)
    harness.write_outputs(a.out or default, f"quant_prefill_{info['date']}{'_avx2' if avx2 else ''}_{a.clock}{a.threads}t",
                          f"{info}\n\n{table}", {"machine": info, "rows": rows})


if __name__ == "__main__":
    main()
