"""CPU fp32 training step (forward + backward) of one MoE block: the fused op against its peers.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

Variants (all built in one subprocess per shape and timed round-robin, so that the VM's drift hits
them alike; peak memory measured per variant in a subprocess of its own):
  op        torch.ops.moe_compile.fused_moe_train (the training form the passes emit) + its backward
  loop      a plain per-expert loop block in eager (HF v4 / Mixtral style: where -> gather ->
            3 matmuls -> weight multiply -> index_add_)
  compiled  torch.compile (default options) of that loop
  hf_gmm    HF transformers' ``MixtralExperts`` with ``grouped_mm`` experts (stacked [E, 2F, H] /
            [E, H, F] weights), eager, with softmax -> top-k routing from router logits in front
  moe       ``torch.compile(that routed HF block, backend="moe")``: the product end to end (the
            pass emits ``fused_moe_train`` and AOTAutograd/Inductor compile the step)
  moe_recompute  the same with ``options={"save_fc1": False}``: FC1 recomputed in the backward
  roof      dense GEMMs of the same FLOPs: 3 x forward FLOPs (forward + dgrad + wgrad), each one
            [T*K, H] x [H, 3F]-shaped so it does 6*T*K*H*F FLOPs like the forward.

Time: median (and min..max spread) of repeated rounds after warm-up.  Peak memory: the rise of
VmHWM over VmRSS across one step, in a worker whose VmHWM was reset (``clear_refs`` 5) just
before; before that step glibc is told to mmap every block >= 64 KiB (``mallopt``) and to trim
its heap, so freed tensors leave RSS and the baseline is honest (timed steps run without this);
the stacked gradients' memory that ``kernels/cpu_grad_cache`` keeps between steps is added to the peak.
Weights are per-expert tensors (HF v4 ``ModuleList`` of Linears) for op / loop / compiled and stacked
3-D tensors for hf_gmm / moe.  Gradients (x and weights) are part of the peak.

    python benchmarks/bench_cpu_train.py [--quick]      # results/cpu_train/<machine>-<date>.{json,md}
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

CONFIGS = [  # (H, F, E, K)
    (1024, 2048, 8, 2),
    (1024, 512, 64, 8),
]
TOKENS = (512, 2048)
VARIANTS = ("op", "moe", "moe_recompute", "loop", "compiled", "hf_gmm", "roof")
PEERS = ("loop", "compiled", "hf_gmm")
OURS = ("op", "moe", "moe_recompute")


def loop_block(x, topk_ids, topk_weights, w13, w2):
    """The eager peer: per expert, gather its tokens, SwiGLU FFN, weight, index_add_."""
    y = torch.zeros_like(x)
    num_experts = len(w13)
    for e in range(num_experts):
        tok, k = torch.where(topk_ids == e)  # [n], [n]
        if tok.numel() == 0:
            continue
        xe = x[tok]  # [n, H]
        gate, up = F.linear(xe, w13[e]).chunk(2, dim=-1)  # [n, F] each
        out = F.linear(F.silu(gate) * up, w2[e])  # [n, H]
        y.index_add_(0, tok, out * topk_weights[tok, k, None])
    return y


def op_block(x, topk_ids, topk_weights, w13, w2):
    from moe_compile import ops  # noqa: F401  registers the op and its backward

    # fused_moe_train: the form the backend emits for a graph that will be differentiated (saves FC1)
    return torch.ops.moe_compile.fused_moe_train(
        x, topk_ids, topk_weights, list(w13), [], list(w2), [], [], [], "concat", False, "silu", 0.0, 1.702, "output"
    )[0]


def make_inputs(T, H, Fw, E, K):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).requires_grad_(True)
    logits = torch.randn(T, E, generator=g)
    topk_weights, topk_ids = torch.topk(logits.softmax(-1), K, dim=-1)  # [T, K]
    topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).requires_grad_(True)
    # Per-expert nn.Linear-style weights (HF v4 ModuleList): the op takes the same E tensors.
    w13 = [(torch.randn(2 * Fw, H, generator=g) / H**0.5).requires_grad_(True) for _ in range(E)]
    w2 = [(torch.randn(H, Fw, generator=g) / Fw**0.5).requires_grad_(True) for _ in range(E)]
    dy = torch.randn(T, H, generator=g)
    return x, topk_ids, topk_weights, w13, w2, dy


def routed_hf_experts(H, Fw, E, K, w13, w2):
    """(fn(x, logits) -> y, experts module): softmax -> top-k -> HF's grouped_mm experts, weights
    stacked from the same per-expert tensors."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=Fw, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "grouped_mm"
    experts = MixtralExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack(w13))  # [E, 2F, H]
        experts.down_proj.copy_(torch.stack(w2))  # [E, H, F]

    def fn(x, logits):
        tw, ids = torch.topk(logits.softmax(-1), K, dim=-1)  # [T, K]
        return experts(x, ids, tw / tw.sum(-1, keepdim=True))

    return fn, experts


def make_hf_step(variant, T, H, Fw, E, K):
    x, _, _, w13, w2, dy = make_inputs(T, H, Fw, E, K)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    fn, experts = routed_hf_experts(H, Fw, E, K, w13, w2)
    if variant == "moe":
        fn = torch.compile(fn, backend="moe")
    elif variant == "moe_recompute":
        fn = torch.compile(fn, backend="moe", options={"save_fc1": False})
    leaves = [x, logits, *experts.parameters()]

    def step():
        for t in leaves:
            t.grad = None
        fn(x, logits).backward(dy)

    return step, leaves


def make_step(variant, T, H, Fw, E, K):
    if variant in ("hf_gmm", "moe", "moe_recompute"):
        return make_hf_step(variant, T, H, Fw, E, K)
    if variant == "roof":
        g = torch.Generator().manual_seed(0)
        a = torch.randn(T * K, H, generator=g)
        b = torch.randn(H, 3 * Fw, generator=g)
        c = torch.randn(T * K, 3 * Fw, generator=g)

        def roof():
            torch.mm(a, b)  # forward-shaped
            torch.mm(c, b.t())  # dgrad-shaped
            torch.mm(a.t(), c)  # wgrad-shaped

        return roof, []
    x, ids, tw, w13, w2, dy = make_inputs(T, H, Fw, E, K)
    fn = {"op": op_block, "loop": loop_block, "compiled": torch.compile(loop_block)}[variant]
    leaves = [x, tw, *w13, *w2]

    def step():
        for t in leaves:
            t.grad = None
        fn(x, ids, tw, w13, w2).backward(dy)

    return step, leaves


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _peak_of_one_step(step, leaves) -> int:
    """VmHWM rise over VmRSS across one step, from an honest baseline (see the module docstring),
    plus the gradient memory moe_compile keeps from the step before (it is in the baseline's RSS)."""
    from moe_compile.kernels.cpu import grad_cache as cpu_grad_cache

    for t in leaves:
        t.grad = None
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD: blocks >= 64 KiB are mmapped and unmapped on free
    libc.malloc_trim(0)  # give back what earlier steps left in the heap
    rss0 = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    kept = cpu_grad_cache.held_bytes()
    step()
    return _status("VmHWM") - rss0 + kept


def memory_worker(variant, T, H, Fw, E, K) -> dict:
    """Peak memory of one step of one variant, alone in this process (after one warm-up step)."""
    torch.manual_seed(0)
    step, leaves = make_step(variant, T, H, Fw, E, K)
    step()  # compiles where the variant compiles
    return {"variant": variant, "peak_mib": _peak_of_one_step(step, leaves) / 2**20}


def timing_worker(variants, T, H, Fw, E, K, warmup, repeats) -> list:
    """Every variant built in this one process and timed round-robin, so that the machine's drift
    (±20% between processes on the CI VM) hits all of them alike."""
    steps, first = {}, {}
    for v in variants:
        torch.manual_seed(0)
        steps[v], _ = make_step(v, T, H, Fw, E, K)
        t0 = time.perf_counter()
        steps[v]()  # includes compilation for "compiled" and "moe"
        first[v] = time.perf_counter() - t0
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {v: [] for v in variants}
    for _ in range(repeats):
        for v, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[v].append(time.perf_counter() - t0)
    flops = 3 * 6 * T * K * H * Fw  # forward 2*T*K*(H*2F + F*H), times 3 for dgrad + wgrad
    rows = []
    for v in variants:
        med = statistics.median(times[v])
        rows.append({
            "variant": v, "T": T, "H": H, "F": Fw, "E": E, "K": K, "median_s": med, "min_s": min(times[v]),
            "max_s": max(times[v]), "first_call_s": first[v], "gflops": flops / med / 1e9, "repeats": repeats,
        })
    return rows


def _run_worker(args, timeout):
    cmd = [sys.executable, __file__, *map(str, args)]
    out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cell(variants, T, cfg, warmup, repeats, timeout) -> list:
    """Timing of all variants in one subprocess, then each variant's peak memory in its own."""
    H, Fw, E, K = cfg
    base = {"T": T, "H": H, "F": Fw, "E": E, "K": K}
    try:
        rows = _run_worker(["--time", ",".join(variants), T, H, Fw, E, K, warmup, repeats], timeout)
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
        tail = (getattr(err, "stderr", "") or str(err)).strip().splitlines()[-1:] or ["?"]
        return [{"variant": v, **base, "error": tail[0][:200]} for v in variants]
    for row in rows:
        try:
            row.update(_run_worker(["--memory", row["variant"], T, H, Fw, E, K], timeout))
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError):
            row["peak_mib"] = float("nan")
    return rows


def to_markdown(rows, meta) -> str:
    lines = [
        "# CPU fp32 training step (forward + backward) of one MoE block",
        "",
        f"torch {meta['torch']}, {meta['threads']} threads, warmup {meta['warmup']}, "
        f"repeats {meta['repeats']}; time = median (min..max); vs best peer = (fastest of "
        f"{', '.join(PEERS)}) / this variant's time (>1: faster than every peer); "
        "roof = dense GEMMs of 3x forward FLOPs; peak = VmHWM rise over one step.",
        "",
        "| H | F | E | K | T | variant | median ms (spread) | GFLOP/s | vs best peer | % of roof | peak MiB | first call s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_cell = {}
    for r in rows:
        by_cell.setdefault((r["H"], r["F"], r["E"], r["K"], r["T"]), {})[r["variant"]] = r
    for (H, Fw, E, K, T), cell in by_cell.items():
        roof = cell.get("roof", {})
        peer_times = [cell[v]["median_s"] for v in PEERS if "median_s" in cell.get(v, {})]
        best = min(peer_times) if peer_times else None
        for v in VARIANTS:
            r = cell.get(v)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {H} | {Fw} | {E} | {K} | {T} | {v} | error: {r['error']} | | | | | |")
                continue
            ms = r["median_s"] * 1e3
            spread = f"{r['min_s'] * 1e3:.0f}..{r['max_s'] * 1e3:.0f}"
            speed = f"{best / r['median_s']:.2f}" if best is not None else "-"
            of_roof = f"{100 * roof['median_s'] / r['median_s']:.0f}%" if "median_s" in roof else "-"
            lines.append(
                f"| {H} | {Fw} | {E} | {K} | {T} | {v} | {ms:.0f} ({spread}) | {r['gflops']:.1f} | "
                f"{speed} | {of_roof} | {r['peak_mib']:.0f} | {r['first_call_s']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--time":
        variants, *nums = sys.argv[2:]
        print(json.dumps(timing_worker(variants.split(","), *map(int, nums))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--memory":
        variant, *nums = sys.argv[2:]
        print(json.dumps(memory_worker(variant, *map(int, nums))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None,
                   help="path prefix of the .json / .md (default: results/cpu_train/<machine>-<date>)")
    p.add_argument("--quick", action="store_true", help="one warm-up step, 5 timed steps")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--timeout", type=int, default=900, help="seconds per worker process")
    args = p.parse_args()
    warmup, repeats = (1, 5) if args.quick else (2, 10)
    rows = []
    for cfg in CONFIGS:
        for T in map(int, args.tokens.split(",")):
            for r in run_cell(args.variants.split(","), T, cfg, warmup, repeats, args.timeout):
                print(json.dumps(r), flush=True)
                rows.append(r)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "warmup": warmup, "repeats": repeats}
    import harness  # benchmarks/harness.py

    args.out = args.out or harness.result_stem("cpu_train")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    md = to_markdown(rows, meta)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
