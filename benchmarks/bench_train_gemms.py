"""The expert GEMMs of one CPU fp32 MoE training step, alone, against the training roof.

Shapes:  E experts, n rows each (T*K/E: the average expert's share), H hidden, F expert FFN width;
         FC1 [2F, H] (gate | up), FC2 [H, F], as ``bench_cpu_train.py``'s stacked weights.

What a step's GEMMs cost with nothing else around them (no routing, gather, activation, combine or
Python of the op), each pass over all experts timed round-robin with the roof in one process:

  forward     x_e @ W1_e^T, a_e @ W2_e^T on oneDNN, weights as the model holds them
  dgrad       dy_e @ W2_e, dh_e @ W1_e on oneDNN (the same weights, transposed views)
  wgrad       dh_e^T @ x_e, dy_e^T @ a_e on MKL (``torch.mm`` into the gradient buffers)
  forward_packed  the forward on weights prepacked for oneDNN (what inference uses)
  pack        prepacking every expert's FC1 and FC2 once (one orientation)
  roof        ``bench_cpu_train.py``'s roof: three dense ``torch.mm`` of the step's FLOPs

The sum forward + dgrad + wgrad against the roof bounds what the training step can reach.

    python benchmarks/bench_train_gemms.py       # results/train_gemms/<machine>-<date>.{md,json,png}
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def passes(E: int, n: int, H: int, F: int) -> dict:
    """name -> fn() running one pass of that GEMM kind over every expert."""
    from moe_compile.kernels.cpu import onednn as cpu_onednn, prepack as cpu_prepack

    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(E, 2 * F, H, generator=g), torch.randn(E, H, F, generator=g)
    x, a = torch.randn(E, n, H, generator=g), torch.randn(E, n, F, generator=g)
    dy, dh = torch.randn(E, n, H, generator=g), torch.randn(E, n, 2 * F, generator=g)
    gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)
    packed = [(cpu_prepack.pack(w1[e]), cpu_prepack.pack(w2[e])) for e in range(E)]
    linear = cpu_onednn.linear
    m = E * n
    roof_a, roof_b, roof_c = torch.randn(m, H, generator=g), torch.randn(H, 3 * F, generator=g), torch.randn(m, 3 * F, generator=g)

    def roof():
        torch.mm(roof_a, roof_b), torch.mm(roof_c, roof_b.t()), torch.mm(roof_a.t(), roof_c)

    return {
        "forward": lambda: [(linear(x[e], w1[e]), linear(a[e], w2[e])) for e in range(E)],
        "dgrad": lambda: [(linear(dy[e], w2[e].t()), linear(dh[e], w1[e].t())) for e in range(E)],
        "wgrad": lambda: [(torch.mm(dh[e].t(), x[e], out=gw1[e]), torch.mm(dy[e].t(), a[e], out=gw2[e]))
                          for e in range(E)],
        "forward_packed": lambda: [(linear(x[e], p1), linear(a[e], p2)) for e, (p1, p2) in enumerate(packed)],
        "pack": lambda: [(cpu_prepack.pack(w1[e]), cpu_prepack.pack(w2[e])) for e in range(E)],
        "roof": roof,
    }


def run(E: int, n: int, H: int, F: int, repeats: int) -> dict:
    threads = harness.setup_threads(2)
    times = harness.time_interleaved(passes(E, n, H, F), warmup=1, repeats=repeats)
    flops = 2 * E * n * H * 3 * F  # one GEMM kind (FC1 + FC2) over every expert
    rows = {k: dict(ms=t.median_s * 1e3, gflops=flops / t.median_s / 1e9, timing=t.to_dict()) for k, t in times.items()}
    rows["roof"]["gflops"] *= 3  # three kinds
    step = sum(rows[k]["ms"] for k in ("forward", "dgrad", "wgrad"))
    return dict(machine=harness.machine_info(), threads=threads, shape=dict(E=E, n=n, H=H, F=F), passes=rows,
                gemms_ms=step, roof_over_gemms=rows["roof"]["ms"] / step)


def to_markdown(data: dict) -> str:
    m, s = data["machine"], data["shape"]
    head = (f"Expert GEMMs of one training step alone, E={s['E']} experts x n={s['n']} rows, H={s['H']}, "
            f"F={s['F']}, fp32, {data['threads']} threads, {m['cpu']}, torch {m['torch']}, {m['date']}; "
            f"median ms of passes timed round-robin.\n\n")
    rows = [[k, f"{v['ms']:.1f}", "-" if k == "pack" else f"{v['gflops']:.0f}"] for k, v in data["passes"].items()]
    body = harness.markdown_table(["pass", "ms", "GFLOP/s"], rows)
    tail = (f"\nforward + dgrad + wgrad = {data['gemms_ms']:.1f} ms; roof / that = "
            f"{data['roof_over_gemms']:.2f} (the most a training step on these GEMMs can reach).\n")
    return head + body + tail


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rows", type=int, default=64, help="rows per expert (T*K/E: 512*8/64 = 64)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None,
                    help="path prefix of the .md / .json / .png (default: results/train_gemms/<machine>-<date>; an "
                         "existing directory gets train_gemms.*)")
    args = ap.parse_args(argv)
    data = run(args.experts, args.rows, args.hidden, args.ffn, args.repeats)
    md = to_markdown(data)
    print(md)
    harness.write_outputs(args.out or harness.result_stem("train_gemms"), "train_gemms", md, data)


if __name__ == "__main__":
    main()
