"""Dense linears on CPU: moe_compile's dense_linear in each format beside torch's own CPU paths and
torchao's (if installed), on a Qwen3-30B-A3B-shaped model's non-expert weights, at T = 1, 4, 512.

    python benchmarks/bench_dense_cpu.py [--threads 2] [--repeats 15] [--out PREFIX]

The question it answers (dense layers at the roof): is a well-kept library within 5% of
our kernels, so that we should compose it rather than route dense linears to our own?  Rows:
  torch fp32          F.linear (MKL / oneDNN)
  torch int8 / int4   aten._weight_int8pack_mm / _weight_int4pack_mm_for_cpu (what torchao's
                      Int8WeightOnlyConfig / Int4WeightOnlyConfig compose on CPU)
  torchao <config>    quantize_(nn.Linear, config), its module called (only if torchao imports)
  moe <fmt>           torch.ops.moe_compile.dense_linear in that format
Every call reads its weights from memory (a buffer larger than the last-level cache is read
between calls); median of --repeats, calls of all rows interleaved.  Decode figures are
memory-bound: each row also gets its weight bytes / time as GB/s, beside the machine's read
bandwidth (torch.sum over 1 GiB, best of 5), so the roof fraction is weight GB/s / that.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import harness  # benchmarks/harness.py (scripts run from benchmarks/ or by path)

SHAPES = {"lm_head": (32000, 2048), "q_proj": (4096, 2048), "o_proj": (2048, 4096), "kv_proj": (512, 2048)}
FORMATS = ("w16", "w8-int", "w4-int", "a8w8-int", "a8w4-int")
BITS = {"fp32": 32, "w16": 16, "w8-int": 8, "a8w8-int": 8, "w4-int": 4, "a8w4-int": 4, "int8": 8, "int4": 4}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def torch_rows(w: torch.Tensor) -> dict:
    """torch's CPU weight-only paths on w [N, K] (symmetric, per channel for int8, groups of 32 for int4)."""
    N, K = w.shape
    rows = {"torch fp32": lambda x: F.linear(x, w)}
    s8 = w.abs().amax(1) / 127
    q8 = torch.round(w / s8[:, None]).to(torch.int8)
    rows["torch int8"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8)
    g = 32
    sg = (w.view(N, K // g, g).abs().amax(-1) / 7).clamp_min(1e-8)
    q4 = (torch.round(w.view(N, K // g, g) / sg[..., None]) + 8).clamp(0, 15).to(torch.int32).view(N, K)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        scales_zeros = torch.stack([sg.t(), torch.zeros_like(sg.t())], -1).contiguous()
        rows["torch int4"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, scales_zeros)
    except RuntimeError as err:
        print(f"torch int4: {err}")
    return rows


def torchao_rows(w: torch.Tensor) -> dict:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.quantization as tq
    except ImportError:
        return {}
    configs = {"torchao int8wo": lambda: tq.Int8WeightOnlyConfig()}
    if hasattr(tq, "Int8DynamicActivationIntxWeightConfig"):
        from torchao.quantization.granularity import PerGroup

        configs["torchao 8da4w"] = lambda: tq.Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    configs["torchao int4wo"] = lambda: tq.Int4WeightOnlyConfig(group_size=32)
    rows = {}
    base = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    base.weight.data.copy_(w)
    for name, make in configs.items():
        m = copy.deepcopy(base)
        try:
            tq.quantize_(m, make())
            m(torch.randn(1, w.shape[1]))
            rows[name] = m
        except Exception as err:  # noqa: BLE001 — record what the library refuses on this CPU
            print(f"{name}: {type(err).__name__}: {str(err)[:160]}")
    return rows


def moe_rows(w: torch.Tensor) -> dict:
    """dense_linear in each format with the group the backend packs a dense linear with
    (``passes/linears.dense_group``: a8w8-int group-wise, the others their own default)."""
    import moe_compile.ops  # noqa: F401  registers the op
    from moe_compile.kernels.cpu import dense
    from moe_compile.passes.linears import dense_group

    rows = {"moe fp32": lambda x: torch.ops.moe_compile.dense_linear(x, w, None, "none", 0)}
    for fmt in FORMATS:
        if dense.unavailable_reason(fmt) is None:
            group = dense_group(fmt, w.shape[1])
            rows[f"moe {fmt}"] = (lambda f, g: lambda x: torch.ops.moe_compile.dense_linear(x, w, None, f, g))(fmt, group)
    return rows


def bits_of(name: str) -> int:
    for key, bits in BITS.items():
        if name.endswith(key) or f" {key}" in name:
            return bits
    return {"torchao int8wo": 8, "torchao 8da4w": 4, "torchao int4wo": 4}.get(name, 32)


def bench_shape(name: str, N: int, K: int, tokens: list[int], repeats: int, flush: torch.Tensor) -> list[dict]:
    w = torch.randn(N, K) / K**0.5
    rows = {**torch_rows(w), **torchao_rows(w), **moe_rows(w)}
    out = []
    for T in tokens:
        x = torch.randn(T, K)
        with torch.no_grad():
            for fn in rows.values():
                fn(x)  # packs, builds, warms
            times = {r: [] for r in rows}
            for _ in range(repeats):
                for r, fn in rows.items():
                    flush.add_(1.0)  # evict the weights from the last-level cache
                    times[r].append(_timed(lambda: fn(x)))
        for r, ts in times.items():
            ms = 1e3 * statistics.median(ts)
            out.append(dict(shape=name, N=N, K=K, T=T, row=r, ms=ms, weight_GBps=N * K * bits_of(r) / 8 / ms / 1e6))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 512])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--out", default=None,
                   help="path prefix of the .json (default: results/dense_cpu/<machine>-<date>; an existing "
                        "directory gets dense_cpu.json)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(harness.machine_line(harness.machine_info()))
    bw = harness.best_read_bandwidth()
    print(f"read bandwidth {bw / 1e9:.1f} GB/s (torch.sum over 1 GiB, best of 5); load {os.getloadavg()[0]:.2f}")
    flush = torch.empty(2**28)  # 1 GiB: larger than any last-level cache here
    results = []
    for name in a.shapes:
        results += bench_shape(name, *SHAPES[name], a.tokens, a.repeats, flush)
    print(f"{'shape':8s} {'T':>4s} {'row':18s} {'ms':>9s} {'GB/s':>6s} {'roof':>5s} {'x fp32':>7s}")
    for r in results:
        fp32 = next(q["ms"] for q in results if (q["shape"], q["T"], q["row"]) == (r["shape"], r["T"], "torch fp32"))
        print(f"{r['shape']:8s} {r['T']:4d} {r['row']:18s} {r['ms']:9.3f} {r['weight_GBps']:6.1f} "
              f"{r['weight_GBps'] * 1e9 / bw:5.2f} {fp32 / r['ms']:7.2f}")
    with open(harness.output_path(a.out or harness.result_stem("dense_cpu"), "dense_cpu", ".json"), "w") as f:
        json.dump(dict(bandwidth_GBps=bw / 1e9, load1=os.getloadavg()[0], results=results), f, indent=1)


if __name__ == "__main__":
    main()
