"""CPU fp32 inference of one HF Mixtral-architecture MoE block: ``backend="moe"`` against its peers.

Shapes:  T tokens (batch 1), H hidden, F expert FFN width, E experts, K experts per token.

Model: ``transformers``' ``MixtralSparseMoeBlock`` (stacked expert weights, softmax->top-k->renorm
router), built from a ``MixtralConfig`` with the shape's E/K/F, every weight drawn from
normal(0, 0.02).  Side by side in one process, for each (shape, T):

  eager     the block with ``_experts_implementation="eager"`` (HF's per-expert loop), eager mode
  hf_gmm    the block with ``_experts_implementation="grouped_mm"`` (HF's own grouped-GEMM path), eager
  inductor  ``torch.compile(hf_gmm block, dynamic=False)`` (default backend)
  moe       ``torch.compile(hf_gmm block, backend="moe", dynamic=False)``
  roof      prefill: one dense fp32 ``torch.mm`` [T*K, H] x [H, 3F] (the expert GEMMs' FLOPs,
            2*T*K*3*H*F), timed round-robin with the variants;  decode (T < 64): bytes of the
            experts actually touched (+ router) divided by the measured read bandwidth
            (``torch.sum`` over exactly those weights, timed round-robin with the variants like the
            prefill roof: the VM's read bandwidth drifts 15-40% within a run, so a bandwidth measured
            once at the start made the decode ratio follow the drift).  The 512 MiB read bandwidth
            measured at the start is still reported.

All blocks share the same parameter tensors.  Every output is checked against ``eager``
(max |y - ref| / max |ref|).  Ratios: ``moe vs best peer`` = best peer time / moe time (> 1: moe
faster); ``roof/moe`` = roof time / moe time (1.0 = at the roof).

    python benchmarks/bench_cpu_moe.py            # full run (< 10 min, 2 cores): results/cpu_moe/<machine>-<date>.*
    python benchmarks/bench_cpu_moe.py --quick --out /tmp/cpu_moe     # smoke run
    python benchmarks/bench_cpu_moe.py --shapes fine-grained --tokens 512  # one cell
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SHAPES = {  # name: (H, F, E, K)
    "mixtral-like": (1024, 2048, 8, 2),
    "fine-grained": (1024, 512, 64, 8),
}
TOKENS = (4, 512, 2048)
QUICK_TOKENS = (4, 512)
DECODE_MAX_T = 64
PEERS = ("eager", "hf_gmm", "inductor")


def build_blocks(H, Fw, E, K, seed=0):
    """The HF Mixtral block twice (grouped_mm and eager experts), sharing one set of weights."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    blocks = {}
    for impl in ("grouped_mm", "eager"):
        cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=Fw, num_local_experts=E,
                                         num_experts_per_tok=K)
        cfg._experts_implementation = impl
        blocks[impl] = MixtralSparseMoeBlock(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in blocks["grouped_mm"].parameters():
            p.normal_(0.0, 0.02, generator=g)
    blocks["eager"].load_state_dict(blocks["grouped_mm"].state_dict(), assign=True)
    return blocks["grouped_mm"], blocks["eager"]


def check_rewritten(block, H):
    """Whether ``backend="moe"`` rewrites the block (one region), as ``moe_compile.explain`` says."""
    import moe_compile

    report = moe_compile.explain(block, torch.randn(1, 64, H))
    rewritten = list(report.rewritten)
    return len(rewritten), [str(r) for r in rewritten], [str(s)[:200] for s in report.skipped]


def touched_weights(block, x, H):
    """The tensors a decode step must read: the touched experts' weights (3*H*F fp32 each; views of
    HF's stacked tensors) and the router's."""
    with torch.no_grad():
        _, _, ids = block.gate(x.reshape(-1, H))
    experts = block.experts
    touched = torch.unique(ids).tolist()
    return touched, [experts.gate_up_proj[e] for e in touched] + [experts.down_proj[e] for e in touched] + [
        block.gate.weight]


def weight_stream(tensors):
    """``fn()`` reading every tensor once (``torch.sum`` each): the decode roof."""
    return lambda: [t.sum() for t in tensors]


def repeats_for(T, quick):
    if T < DECODE_MAX_T:
        return dict(warmup=3, repeats=10 if quick else 20, min_time_s=0.2 if quick else 0.5)
    if T <= 512:
        return dict(warmup=1, repeats=3 if quick else 7)
    return dict(warmup=1, repeats=3 if quick else 5)


def run(quick: bool, shapes=None, tokens=None) -> dict:
    import moe_compile

    threads = harness.setup_threads(2)
    info = harness.machine_info()
    load0 = harness.load_average()
    bw, bw_t = harness.read_bandwidth(512, repeats=5 if quick else 9)
    print(f"# threads={threads} torch={torch.__version__} read bandwidth {bw / 1e9:.1f} GB/s "
          f"(spread {bw_t.spread} ms per 512 MiB)", file=sys.stderr)
    results = []
    tokens = tokens or (QUICK_TOKENS if quick else TOKENS)
    for name in shapes or SHAPES:
        H, Fw, E, K = SHAPES[name]
        torch._dynamo.reset()
        gmm, eager = build_blocks(H, Fw, E, K)
        n_rewritten, rewritten, skipped = check_rewritten(gmm, H)
        print(f"# {name}: explain -> {n_rewritten} region(s) rewritten {rewritten} skipped {skipped}",
              file=sys.stderr)
        # Each backend compiles its own copy of the block (same weights, copied): two backends on
        # one module would share its forward's Dynamo cache, each call checking the other's guards.
        compiled = {
            "inductor": torch.compile(copy.deepcopy(gmm), dynamic=False),
            "moe": torch.compile(copy.deepcopy(gmm), backend="moe", dynamic=False),
        }
        for T in tokens:
            g = torch.Generator().manual_seed(1)
            x = torch.randn(1, T, H, generator=g)
            row = dict(shape=name, H=H, F=Fw, E=E, K=K, T=T, rewritten_regions=n_rewritten)
            fns = {
                "eager": lambda: eager(x),
                "hf_gmm": lambda: gmm(x),
                "inductor": lambda: compiled["inductor"](x),
                "moe": lambda: compiled["moe"](x),
            }
            flops = 2.0 * T * K * 3 * H * Fw
            if T >= DECODE_MAX_T:
                fns["roof"] = harness.dense_gemm(T * K, H, 3 * Fw)
            else:
                touched, weights = touched_weights(gmm, x, H)
                fns["roof"] = weight_stream(weights)
            with torch.no_grad(), moe_compile.api.capture_flags():
                ref = eager(x)
                for key in ("inductor", "moe"):  # compile (and first run) outside the timing
                    t0 = time.perf_counter()
                    fns[key]()
                    row[f"{key}_first_call_s"] = time.perf_counter() - t0
                errs = {k: harness.max_rel_err(fns[k](), ref) for k in ("hf_gmm", "inductor", "moe")}
                row["load_before"] = harness.load_average()
                flush = harness.cache_flush() if T < DECODE_MAX_T else None  # decode: weights from memory
                times = harness.time_interleaved(fns, **repeats_for(T, quick), before=flush)
                row["load_after"] = harness.load_average()
            row["times"] = {k: v.to_dict() for k, v in times.items()}
            row["rel_err_vs_eager"] = errs
            row["expert_flops"] = flops
            roof_s = times.pop("roof").median_s
            if T < DECODE_MAX_T:
                nbytes = sum(t.numel() * t.element_size() for t in weights)
                row["roof"] = dict(kind="weight-stream", touched_experts=len(touched), bytes=nbytes,
                                   read_bw_Bps=nbytes / roof_s, time_s=roof_s, timing=row["times"].pop("roof"))
            else:
                row["roof"] = dict(kind="dense-gemm", shape=[T * K, H, 3 * Fw], time_s=roof_s,
                                   timing=row["times"].pop("roof"), flops_per_s=flops / roof_s)
            best_peer = min(PEERS, key=lambda k: times[k].median_s)
            moe_s = times["moe"].median_s
            row["best_peer"] = best_peer
            row["moe_vs_best_peer"] = times[best_peer].median_s / moe_s
            row["roof_over_moe"] = roof_s / moe_s
            row["moe_gflops"] = flops / moe_s / 1e9
            results.append(row)
            print(f"# {name} T={T}: " + " ".join(f"{k}={v.median_s * 1e3:.2f}ms" for k, v in times.items())
                  + f" roof={roof_s * 1e3:.2f}ms errs={errs}", file=sys.stderr)
        compiled = gmm = eager = None  # free this shape's blocks before the next one is built
    return dict(machine=info, load_at_start=load0, load_at_end=harness.load_average(), read_bandwidth_Bps=bw,
                read_bandwidth_timing=bw_t.to_dict(), results=results, quick=quick)


def to_markdown(data: dict) -> str:
    m = data["machine"]
    head = (f"CPU fp32, {harness.machine_line(m)}. Read bandwidth at the start (torch.sum, 512 MiB) "
            f"{data['read_bandwidth_Bps'] / 1e9:.1f} GB/s; the decode roof is timed with the variants. Times: median ms (min..max) of repeats; "
            f"moe vs best peer = best peer / moe (>1: moe faster); roof/moe = roof time / moe time. "
            f"Variants timed round-robin. Load average at start {data['load_at_start']}, at end "
            f"{data['load_at_end']} (on {m['cores_visible']} cores; > {m['cores_visible']} means other "
            f"processes shared the cores).\n\n")
    headers = ["shape (H,F,E,K)", "T", "eager (HF loop)", "HF grouped_mm", "inductor", "moe", "roof",
               "moe vs best peer", "roof/moe", "moe GFLOP/s", "rel err hf_gmm / inductor / moe", "rewritten"]
    rows = []
    for r in data["results"]:
        t = r["times"]
        cell = lambda k: f"{t[k]['median_s'] * 1e3:.2f} ({t[k]['min_s'] * 1e3:.2f}..{t[k]['max_s'] * 1e3:.2f})"
        roof = r["roof"]
        roof_cell = (f"{roof['time_s'] * 1e3:.2f} (dense mm {roof['flops_per_s'] / 1e9:.0f} GFLOP/s)"
                     if roof["kind"] == "dense-gemm" else
                     f"{roof['time_s'] * 1e3:.2f} ({roof['touched_experts']} experts, {roof['bytes'] / 2**20:.0f} MiB "
                     f"at {roof['read_bw_Bps'] / 1e9:.1f} GB/s)")
        e = r["rel_err_vs_eager"]
        rows.append([f"{r['shape']} ({r['H']},{r['F']},{r['E']},{r['K']})", r["T"], cell("eager"), cell("hf_gmm"),
                     cell("inductor"), cell("moe"), roof_cell,
                     f"{r['moe_vs_best_peer']:.2f}x vs {r['best_peer']}", f"{r['roof_over_moe']:.2f}",
                     f"{r['moe_gflops']:.0f}",
                     f"{e['hf_gmm']:.1e} / {e['inductor']:.1e} / {e['moe']:.1e}",
                     "yes" if r["rewritten_regions"] >= 1 else "NO (moe = fallback)"])
    body = harness.markdown_table(headers, rows)
    notes = ["", "Targets: prefill moe >= 1.0x best peer and roof/moe >= 0.85; "
             "decode moe >= 1.2x best peer and moe within 1.3x of the weight-streaming roof (roof/moe >= 0.77).", ""]
    for r in data["results"]:
        decode = r["roof"]["kind"] == "weight-stream"
        need_peer, need_roof = (1.2, 1 / 1.3) if decode else (1.0, 0.85)
        misses = []
        if r["moe_vs_best_peer"] < need_peer:
            misses.append(f"{r['moe_vs_best_peer']:.2f}x vs best peer ({r['best_peer']}), target {need_peer:.1f}x")
        if r["roof_over_moe"] < need_roof:
            misses.append(f"roof/moe {r['roof_over_moe']:.2f}, target {need_roof:.2f}"
                          + (f" (moe = {1 / r['roof_over_moe']:.2f}x the roof time)" if decode else ""))
        status = "MISS: " + "; ".join(misses) if misses else "meets targets"
        notes.append(f"- {r['shape']} T={r['T']}: {status}")
    return head + body + "\n".join(notes) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, T in {4, 512}")
    ap.add_argument("--out", default=None,
                    help="path prefix of the .md / .json / .png (default: results/cpu_moe/<machine>-<date>; an "
                         "existing directory gets cpu_moe.*)")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="only these shapes")
    ap.add_argument("--tokens", nargs="+", type=int, help="only these token counts")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    data = run(args.quick, args.shapes, args.tokens)
    data["wall_s"] = time.perf_counter() - t0
    md = to_markdown(data)
    print(md)
    print(f"# total {data['wall_s']:.0f} s", file=sys.stderr)
    harness.write_outputs(args.out or harness.result_stem("cpu_moe"), "cpu_moe", md, data)


if __name__ == "__main__":
    main()
