"""GPU: the Triton quantized grouped GEMMs (``kernels/triton/quant_gemm.py``, UNVERIFIED until the
GPU lane passes) against the bf16 fused op, side by side in one process.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token; the GPU
benchmark's DeepSeek-V3 EP8 and Mixtral 8x7B shapes (``bench_gpu_moe.py``), decode T = 1 / 16
and prefill T = 512.

  bf16       ``fused_moe_triton`` on bf16 x and weights (what ``backend="moe"`` runs on CUDA)
  <fmt>      ``quant_moe_triton`` on ``quant.pack(fmt, W)`` with fp32 x (the formats' meaning)
  roof       decode: the touched experts' bytes at the format / the measured copy bandwidth

Every cell is the median of ``triton.testing.do_bench``; "x bf16" is bf16 time / the variant's.
The targets: 4-bit decode >= 2.5x bf16, a8w8-fp8 prefill >= 1.6x (a8w8-fp8 has no Triton
kernel yet: absent from the table).

    python benchmarks/bench_gpu_quant.py [--out PREFIX]   (on a CUDA machine; gpu_check.sh runs it)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import harness
from bench_gpu_moe import bench as do_bench_stats, hbm_bandwidth

SHAPES = [  # (name, T, H, F, E, K)
    ("deepseek_v3_ep8_decode", 1, 7168, 2048, 32, 8),
    ("deepseek_v3_ep8_decode", 16, 7168, 2048, 32, 8),
    ("mixtral_8x7b_decode", 1, 4096, 14336, 8, 2),
    ("deepseek_v3_ep8_prefill", 512, 7168, 2048, 32, 8),
]
FORMATS = ("w8-int", "w4-int", "mxfp4", "a8w8-int", "a8w4-int")


def bench(fn) -> float:
    """Median ms of ``triton.testing.do_bench`` (as bench_gpu_moe.py times its cells)."""
    return float(do_bench_stats(fn)["ms"])


def run_shape(name, T, H, F, E, K, bandwidth, budget_end) -> dict:
    from moe_compile.ir import ExpertWeights, FFNAttrs
    from moe_compile.kernels.triton.fused_moe import fused_moe_triton
    from moe_compile.kernels.triton.quant_gemm import quant_moe_triton
    from moe_compile.quant import pack

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=gen)
    W1 = torch.randn(E, 2 * F, H, device="cuda", generator=gen) * H**-0.5
    W2 = torch.randn(E, H, F, device="cuda", generator=gen) * F**-0.5
    weights, ids = torch.softmax(torch.randn(T, E, device="cuda", generator=gen), -1).topk(K, -1)
    attrs = FFNAttrs()
    b1, b2 = W1.bfloat16(), W2.bfloat16()
    w = ExpertWeights((b1,), (), (b2,), (), (), (), False)
    ms = {"bf16": bench(lambda: fused_moe_triton(x.bfloat16(), ids, weights, w, attrs))}
    touched = int(torch.unique(ids).numel())
    roof = {"bf16": touched * 3 * H * F * 2 / bandwidth * 1e3}
    for fmt in FORMATS:
        if time.time() > budget_end:
            break
        from moe_compile.quant import a8w4_int

        packer = (lambda w: a8w4_int.pack(w, group_size=None)) if fmt == "a8w4-int" else (lambda w: pack(fmt, w))
        q1, q2 = packer(W1), packer(W2)  # packed on the GPU (the pack functions are torch ops); a8w4: per channel
        ms[fmt] = bench(lambda q1=q1, q2=q2: quant_moe_triton(x, ids, weights, q1, q2, attrs))
        roof[fmt] = touched * (q1.nbytes + q2.nbytes) / E / bandwidth * 1e3
    return {"shape": name, "T": T, "H": H, "F": F, "E": E, "K": K, "touched": touched, "ms": ms,
            "roof_ms": roof, "x_bf16": {k: ms["bf16"] / v for k, v in ms.items()}}


def markdown(rows, meta) -> str:
    fmts = ["bf16", *FORMATS]
    lines = [f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; copy bandwidth "
             f"{meta['bandwidth_GBps']:.0f} GB/s. Median ms of do_bench; (x bf16); [roof ms at that bandwidth].", "",
             "| shape | T | " + " | ".join(fmts) + " |", "|---|---|" + "---|" * len(fmts)]
    for r in rows:
        cells = [f"{r['ms'][f]:.3f} ({r['x_bf16'][f]:.2f}x) [{r['roof_ms'][f]:.3f}]" if f in r["ms"] else "-"
                 for f in fmts]
        lines.append(f"| {r['shape']} | {r['T']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None,
                    help="path prefix of the .md / .json (default: results/gpu_quant/<gpu>-<date>; an existing "
                         "directory gets bench_gpu_quant.*)")
    ap.add_argument("--budget-s", type=float, default=80, help="stop starting new cells after this long")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("# no CUDA device: nothing to measure", file=sys.stderr)
        return 0
    import triton

    end = time.time() + a.budget_s
    bandwidth = hbm_bandwidth()
    rows = []
    for shape in SHAPES:
        if time.time() > end:
            break
        rows.append(run_shape(*shape, bandwidth, end))
        print(f"# {shape[0]} T={shape[1]}: " + " ".join(f"{k}={v:.3f}" for k, v in rows[-1]["ms"].items()),
              file=sys.stderr, flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "bandwidth_GBps": bandwidth / 1e9}
    md = markdown(rows, meta)
    print(md)
    out = a.out or harness.result_stem("gpu_quant", gpu=True)
    harness.write_outputs(out, "bench_gpu_quant", md, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
