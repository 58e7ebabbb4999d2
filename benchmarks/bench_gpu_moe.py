"""GPU bf16 forward of one MoE block: the Triton fused op against its peers and the roof.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K.

Methods, measured side by side in one run on the same inputs:
  triton       moe_compile.kernels.triton.fused_moe_triton, stacked weights (autotuned, capped)
  triton_list  the same kernel on E per-expert weight tensors (pointer-table path)
  grouped_mm   HF transformers' grouped_mm_experts_forward: sort, gather, histc offsets,
               torch._grouped_mm x2, SwiGLU, weight multiply, inverse permutation, sum over K
  loop         the eager per-expert loop (where -> gather -> 3 matmuls -> index_add_)
  compiled     torch.compile of that loop (decode shapes only, to bound compile time)
  roof         prefill: one cuBLAS bf16 GEMM of the same FLOPs ([S, H] x [H, 3F] = 6*S*H*F);
               decode: bytes of the touched experts' weights / measured HBM copy bandwidth.

Training (DeepSeek EP8 T=2048 only): forward + backward through the op's autograd (Triton forward
and backward kernels) vs autograd through the grouped_mm path; roof_train = 3 dense GEMMs of the
forward's FLOPs.  Its rows are labelled ``deepseek_v3_ep8_train`` ("triton" there is triton_train).

Time: ``triton.testing.do_bench`` (L2 flushed before every run) median and p20..p80 spread.

    python benchmarks/bench_gpu_moe.py          # writes results/gpu_moe/<gpu>-<date>.md and .json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [  # (name, T, H, F, E, K) — prefill first: the decode-only "compiled" peer is the slowest to set up
    ("deepseek_v3_ep8_prefill", 512, 7168, 2048, 32, 8),
    ("deepseek_v3_ep8_prefill", 2048, 7168, 2048, 32, 8),
    ("mixtral_8x7b_prefill", 4096, 4096, 14336, 8, 2),
    ("deepseek_v3_ep8_decode", 1, 7168, 2048, 32, 8),
    ("deepseek_v3_ep8_decode", 16, 7168, 2048, 32, 8),
    ("deepseek_v3_ep8_decode", 64, 7168, 2048, 32, 8),
]
METHODS = ("triton", "triton_list", "grouped_mm", "loop", "compiled", "roof")
# Training step of one block (forward + backward, bf16), run after the forward of the same shape.
TRAIN_SHAPES = {("deepseek_v3_ep8_prefill", 2048)}
TRAIN_METHODS = ("triton_train", "grouped_mm_train", "roof_train")


# -- peers -----------------------------------------------------------------------------------------


def grouped_mm_forward(x, ids, weights, w13, w2):
    """HF transformers >= 5 grouped_mm_experts_forward (no bias, no EP sentinels)."""
    T, K = ids.shape
    E = w13.shape[0]
    flat_w = weights.reshape(-1)
    ids_g, perm = torch.sort(ids.reshape(-1))
    xs = x[perm // K]  # [S, H]
    counts = torch.histc(ids_g.int() if x.is_cuda else ids_g.float(), bins=E, min=0, max=E - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)  # [S, 2F]
    gate, up = h.chunk(2, dim=-1)
    o = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)  # [S, H]
    o = o * flat_w[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=x.device)
    return o[inv].view(T, K, -1).sum(dim=1).to(x.dtype)


def loop_forward(x, ids, weights, w13, w2):
    """The eager per-expert loop of HF v4 / Mixtral."""
    y = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, k = torch.where(ids == e)  # [n], [n]
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, w2[e])
        y.index_add_(0, tok, (out * weights[tok, k, None]).to(y.dtype))
    return y


# -- measuring -------------------------------------------------------------------------------------


def bench(fn):
    from triton.testing import do_bench

    p50, p20, p80 = do_bench(fn, warmup=10, rep=50, quantiles=[0.5, 0.2, 0.8])
    return {"ms": p50, "p20": p20, "p80": p80}


def roof_gemm(m, k, n):
    """Timing of one bf16 cuBLAS GEMM [m, k] x [k, n]: the dense roof for equal FLOPs."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return bench(lambda: a @ b)


def hbm_bandwidth():
    """Measured device copy bandwidth (read + write bytes / time), bytes/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))["ms"]
    src = dst = None  # free them (not del: the timed lambdas name them)
    return 2 * (1 << 30) / (ms * 1e-3)


def make_inputs(T, H, F_, E, K, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(E, 2 * F_, H, device="cuda", dtype=torch.bfloat16, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, F_, device="cuda", dtype=torch.bfloat16, generator=gen) * F_**-0.5
    logits = torch.randn(T, E, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return x, ids, (weights / weights.sum(-1, keepdim=True)), w13, w2


def run_shape(name, T, H, F_, E, K, args, bandwidth, compiled_cache):
    from moe_compile.ir import ExpertWeights, FFNAttrs
    from moe_compile.kernels.triton.fused_moe import fused_moe_triton

    x, ids, weights, w13, w2 = make_inputs(T, H, F_, E, K)
    attrs = FFNAttrs()
    stacked = ExpertWeights((w13,), (), (w2,))
    listed = ExpertWeights(tuple(w13.unbind(0)), (), tuple(w2.unbind(0)))
    decode = name.endswith("decode")
    fns = {
        "triton": lambda: fused_moe_triton(x, ids, weights, stacked, attrs),
        "triton_list": lambda: fused_moe_triton(x, ids, weights, listed, attrs),
        "grouped_mm": lambda: grouped_mm_forward(x, ids, weights, w13, w2),
        "loop": lambda: loop_forward(x, ids, weights, w13, w2),
    }
    if decode and "compiled" in args.methods:
        if "fn" not in compiled_cache:
            torch._dynamo.config.capture_dynamic_output_shape_ops = True
            compiled_cache["fn"] = torch.compile(loop_forward, dynamic=True)
        fns["compiled"] = lambda: compiled_cache["fn"](x, ids, weights, w13, w2)
    row = {"shape": name, "T": T, "H": H, "F": F_, "E": E, "K": K, "results": {}}
    flops = 6 * T * K * H * F_
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * 3 * H * F_ * 2
    row["flops"], row["touched_experts"], row["touched_weight_bytes"] = flops, touched, weight_bytes

    reference = None
    for method in args.methods:
        if method == "roof" or method not in fns:
            continue
        t0 = time.time()
        try:
            out = fns[method]()  # first call: compiles / autotunes
            torch.cuda.synchronize()
            setup_s = time.time() - t0
            if reference is None:
                reference = grouped_mm_forward(x, ids, weights, w13, w2).float()
            err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
            res = bench(fns[method])
            res.update(setup_s=round(setup_s, 2), max_rel_err_vs_grouped_mm=err)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this shape is a finding
            res = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row["results"][method] = res
        print(f"  {name} T={T} {method}: {res}", flush=True)

    if "roof" in args.methods:
        if decode:
            row["results"]["roof"] = {"ms": weight_bytes / bandwidth * 1e3, "basis": "touched weight bytes / HBM bw"}
        else:
            res = roof_gemm(T * K, H, 3 * F_)
            res["basis"] = "cuBLAS GEMM of equal FLOPs"
            row["results"]["roof"] = res
    for res in row["results"].values():
        if "ms" in res:
            res["tflops"] = flops / (res["ms"] * 1e-3) / 1e12
            res["weight_gbps"] = weight_bytes / (res["ms"] * 1e-3) / 1e9
    x = ids = weights = w13 = w2 = stacked = listed = None  # free them (not del: the timed lambdas name them)
    torch.cuda.empty_cache()
    return row


def run_train(name, T, H, F_, E, K, args):
    """Forward + backward (bf16) of one block: the op's autograd (Triton forward and backward)
    against autograd through the grouped_mm path; gradients to x, routing weights and both weights.
    roof_train: three dense cuBLAS GEMMs of the forward's FLOPs (forward, dgrad, wgrad)."""
    from moe_compile.ir import ExpertWeights, FFNAttrs
    from moe_compile.ops.fused_moe import call_fused_moe

    x, ids, weights, w13, w2 = make_inputs(T, H, F_, E, K)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w13, w2)]
    dy = torch.randn_like(x)
    attrs = FFNAttrs()

    def step_triton():
        xl, wl, w13l, w2l = leaves
        y = call_fused_moe(xl, ids, wl, ExpertWeights((w13l,), (), (w2l,)), attrs)
        return torch.autograd.grad(y, leaves, dy)

    def step_grouped():
        xl, wl, w13l, w2l = leaves
        y = grouped_mm_forward(xl, ids, wl, w13l, w2l)
        return torch.autograd.grad(y, leaves, dy)

    row = {"shape": name.replace("prefill", "train"), "T": T, "H": H, "F": F_, "E": E, "K": K, "results": {}}
    flops = 3 * 6 * T * K * H * F_
    row["flops"], row["touched_experts"], row["touched_weight_bytes"] = flops, E, E * 3 * H * F_ * 2
    reference = None
    for method, fn in (("grouped_mm_train", step_grouped), ("triton_train", step_triton)):
        if method not in args.train_methods:
            continue
        t0 = time.time()
        try:
            grads = fn()
            torch.cuda.synchronize()
            setup_s = time.time() - t0
            if reference is None:
                reference = [g.float() for g in (grads if method == "grouped_mm_train" else step_grouped())]
            errs = [((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(grads, reference)]
            res = bench(fn)
            res.update(setup_s=round(setup_s, 2), max_rel_err_vs_grouped_mm=max(errs),
                       rel_err_dx_dg_dw13_dw2=[float(f"{e:.2e}") for e in errs])
        except Exception as exc:  # noqa: BLE001
            res = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row["results"][method] = res
        print(f"  {row['shape']} T={T} {method}: {res}", flush=True)
    if "roof_train" in args.train_methods:
        res = roof_gemm(T * K, H, 3 * F_)
        for key in ("ms", "p20", "p80"):
            res[key] *= 3
        res["basis"] = "3 x cuBLAS GEMM of the forward's FLOPs"
        row["results"]["roof_train"] = res
    for res in row["results"].values():
        if "ms" in res:
            res["tflops"] = flops / (res["ms"] * 1e-3) / 1e12
            res["weight_gbps"] = row["touched_weight_bytes"] / (res["ms"] * 1e-3) / 1e9
    # The table's "x triton" column divides by the row's "triton" entry: give it the Triton step.
    if "ms" in row["results"].get("triton_train", {}):
        row["results"] = {"triton": row["results"].pop("triton_train"), **row["results"]}
    x = ids = weights = w13 = w2 = leaves = dy = None  # free them (not del: the timed lambdas name them)
    torch.cuda.empty_cache()
    return row


# -- output ----------------------------------------------------------------------------------------


def markdown(rows, meta) -> str:
    lines = [
        f"# GPU MoE forward, bf16 — {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}; HBM copy bandwidth {meta['hbm_gbps']:.0f} GB/s. "
        "Median of do_bench runs (L2 flushed), [p20..p80]; x = time / triton time; "
        "roof: dense cuBLAS GEMM of equal FLOPs (prefill) or touched weight bytes / HBM bw (decode).",
        "",
        "| shape | T | method | ms [p20..p80] | x triton | TFLOP/s | weight GB/s | max rel err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        base = row["results"].get("triton", {}).get("ms")
        for method, res in row["results"].items():
            if "error" in res:
                lines.append(f"| {row['shape']} | {row['T']} | {method} | error: {res['error'][:80]} | | | | |")
                continue
            spread = f" [{res['p20']:.3f}..{res['p80']:.3f}]" if "p20" in res else ""
            ratio = f"{res['ms'] / base:.2f}" if base else ""
            err = res.get("max_rel_err_vs_grouped_mm")
            lines.append(
                f"| {row['shape']} | {row['T']} | {method} | {res['ms']:.3f}{spread} | {ratio} | "
                f"{res['tflops']:.1f} | {res['weight_gbps']:.0f} | {'' if err is None else f'{err:.1e}'} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="path prefix: writes OUT.md and OUT.json (default: results/gpu_moe/<gpu>-<date>)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {METHODS}")
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip the remaining shapes after this")
    parser.add_argument("--train-methods", default=",".join(TRAIN_METHODS), help=f"comma list of {TRAIN_METHODS}")
    parser.add_argument("--quick", action="store_true", help="one prefill and one decode shape")
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.train_methods = [m for m in args.train_methods.split(",") if m]
    if not torch.cuda.is_available():
        print("bench_gpu_moe: no CUDA device", file=sys.stderr)
        return 2
    import triton

    import harness  # benchmarks/harness.py

    args.out = args.out or harness.result_stem("gpu_moe", gpu=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    start = time.time()
    bandwidth = hbm_bandwidth()
    meta = {
        "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__, "triton": triton.__version__, "hbm_gbps": bandwidth / 1e9,
    }
    shapes = [SHAPES[0], SHAPES[4]] if args.quick else SHAPES
    rows, compiled_cache = [], {}
    for shape in shapes:
        if time.time() - start > args.budget_s:
            print(f"budget of {args.budget_s}s spent: skipping {shape}", flush=True)
            rows.append({"shape": shape[0], "T": shape[1], "skipped": "time budget", "results": {}})
            continue
        rows.append(run_shape(*shape, args, bandwidth, compiled_cache))
        if (shape[0], shape[1]) in TRAIN_SHAPES and args.train_methods:
            try:
                rows.append(run_train(*shape, args))
            except Exception as exc:  # noqa: BLE001 - keep the forward figures whatever happens
                rows.append({"shape": "train", "T": shape[1], "skipped": f"{type(exc).__name__}: {exc}"[:200], "results": {}})
        with open(args.out + ".json", "w") as f:  # rewritten after every shape: a timeout keeps results
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
