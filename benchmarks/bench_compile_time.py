"""Compile time: ``backend="moe"`` against default ``torch.compile`` (inductor) on a 4-layer MoE model.

Model: 4 x [RMSNorm -> ``moe_compile.models.zoo.ModuleListMoE(hidden=256, ffn=128, experts=64, top_k=6)``
-> residual add] (family A: HF v4 per-expert loop with ``torch.where`` / ``index_add_``), input
[1, 128, 256] fp32, inference (``torch.no_grad``), 2 threads.

Each measurement runs in a fresh subprocess with a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` and
``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` / ``TORCHINDUCTOR_AUTOGRAD_CACHE=0`` (``torch._dynamo.reset()``
does not clear inductor's on-disk caches).  Measured: the first call (Dynamo trace + backend
compile + one run) inside ``moe_compile.api.capture_flags()``, the steady-state call time after it,
and, for ``moe``, how many MoE regions the backend rewrote.  Variants alternate across repeats.

    python benchmarks/bench_compile_time.py            # results/compile_time/<machine>-<date>.{md,json,png}
    python benchmarks/bench_compile_time.py --quick --out /tmp/ct      # one subprocess per variant
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYERS, HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 4, 256, 128, 64, 6, 128
VARIANTS = ("default", "moe")


def build_model():
    import torch
    import torch.nn as nn

    from moe_compile.models.zoo import ModuleListMoE

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(HIDDEN, eps=1e-6)
            self.moe = ModuleListMoE(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K)

        def forward(self, x):
            return x + self.moe(self.norm(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[Layer() for _ in range(LAYERS)])

        def forward(self, x):
            return self.layers(x)

    torch.manual_seed(0)
    return Model().eval()


def worker(variant: str) -> dict:
    import torch

    import harness
    import moe_compile

    harness.setup_threads(2)
    model = build_model()
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    kwargs = {"backend": "moe"} if variant == "moe" else {}
    compiled = torch.compile(model, **kwargs)
    try:
        from moe_compile.compiler import collecting_reports
    except ImportError:  # older layout
        from moe_compile.backend import collecting_reports
    with torch.no_grad(), moe_compile.api.capture_flags(), collecting_reports() as report:
        ref = model(x)
        t0 = time.perf_counter()
        y = compiled(x)
        first = time.perf_counter() - t0
        steady = harness.time_fn(lambda: compiled(x), warmup=1, repeats=5)
        eager = harness.time_fn(lambda: model(x), warmup=1, repeats=3)
    return dict(variant=variant, first_call_s=first, steady_call_s=steady.median_s, eager_call_s=eager.median_s,
                rel_err_vs_eager=harness.max_rel_err(y, ref), rewritten_regions=len(report.rewritten),
                skipped=[str(s)[:200] for s in report.skipped], load_after=harness.load_average())


def run_subprocess(variant: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="inductor_cache_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0", TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", variant], env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} worker failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one subprocess per variant")
    ap.add_argument("--repeats", type=int, default=3, help="subprocesses per variant (full run)")
    ap.add_argument("--out", default=None,
                    help="path prefix of the .md / .json / .png (default: results/compile_time/<machine>-<date>; "
                         "an existing directory gets compile_time.*)")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return

    import harness
    import torch

    repeats = 1 if args.quick else args.repeats
    load0 = harness.load_average()
    runs = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            res = run_subprocess(v)
            runs[v].append(res)
            print(f"# {v} run {r}: first call {res['first_call_s']:.1f} s, steady {res['steady_call_s'] * 1e3:.1f} ms, "
                  f"rewritten {res['rewritten_regions']}, err {res['rel_err_vs_eager']:.1e}", file=sys.stderr)
    summary = {}
    for v, rs in runs.items():
        firsts = [r["first_call_s"] for r in rs]
        summary[v] = dict(first_call_median_s=statistics.median(firsts), first_call_min_s=min(firsts),
                          first_call_max_s=max(firsts),
                          steady_call_median_s=statistics.median(r["steady_call_s"] for r in rs),
                          eager_call_median_s=statistics.median(r["eager_call_s"] for r in rs),
                          rel_err_vs_eager=max(r["rel_err_vs_eager"] for r in rs),
                          rewritten_regions=rs[0]["rewritten_regions"])
    ratio = summary["moe"]["first_call_median_s"] / summary["default"]["first_call_median_s"]
    info = harness.machine_info()
    info["torch_threads"] = 2
    data = dict(machine=info, model=dict(layers=LAYERS, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K,
                                         tokens=TOKENS, block="moe_compile.models.zoo.ModuleListMoE"),
                repeats=repeats, runs=runs, summary=summary, moe_over_default=ratio,
                load_at_start=load0, load_at_end=harness.load_average())
    headers = ["backend", "first call (compile + run) s, median (min..max)", "steady call ms", "eager call ms",
               "rel err vs eager", "MoE regions rewritten"]
    rows = []
    for v, name in (("default", "default (inductor)"), ("moe", 'backend="moe"')):
        s = summary[v]
        rows.append([name, f"{s['first_call_median_s']:.1f} ({s['first_call_min_s']:.1f}..{s['first_call_max_s']:.1f})",
                     f"{s['steady_call_median_s'] * 1e3:.1f}", f"{s['eager_call_median_s'] * 1e3:.1f}",
                     f"{s['rel_err_vs_eager']:.1e}", s["rewritten_regions"] if v == "moe" else "-"])
    md = (f"Compile time, {LAYERS} x [RMSNorm -> ModuleListMoE(H={HIDDEN}, F={FFN}, E={EXPERTS}, K={TOP_K}) -> "
          f"residual], x [1, {TOKENS}, {HIDDEN}] fp32, 2 threads, torch {torch.__version__}, {info['date']}; "
          f"{repeats} fresh subprocess(es) per backend, fresh inductor cache dir each. Load average at start "
          f"{load0}, at end {data['load_at_end']} (on {info['cores_visible']} cores).\n\n"
          + harness.markdown_table(headers, rows)
          + f"\nmoe / default first-call time: **{ratio:.2f}x** (target <= 0.5x: "
          + ("met" if ratio <= 0.5 else f"MISSED by {ratio / 0.5:.2f}x") + ")\n")
    print(md)
    harness.write_outputs(args.out or harness.result_stem("compile_time"), "compile_time", md, data)


if __name__ == "__main__":
    main()
