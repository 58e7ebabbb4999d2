"""A whole MoE language model on CPU: llama.cpp beside HF eager, default torch.compile and
backend="moe" at each format, prefill and decode tokens/s, on the same random-weight model.

    python benchmarks/bench_e2e_cpu.py [--llama-bench PATH --llama-quantize PATH]
        [--llama-greedy PATH] [--recipes fp32 w16 w8 w4 a8w4] [--engines eager inductor] [--loop]
        [--hidden 2048 --experts 64 --ffn 768 --topk 8 --layers 4 ...] [--out PREFIX]

The model: a Qwen3-MoE causal LM (default: Qwen3-30B-A3B's layer shapes, 4 layers, vocab 32000,
untied lm_head; 1.4 B parameters, fixed seed), built from its config with random weights.  Its
GGUF is written here with the ``gguf`` package (every tensor fp32, Qwen3-MoE's GGUF names) and
quantized by llama.cpp's own ``llama-quantize`` to f16 / q8_0 / q4_0 / q4_K_M; ``llama-bench``
times it: prefill ``-p PROMPT -n 0``, decode ``-p 0 -n GEN -d PROMPT`` (after PROMPT tokens of
context, as ours decodes; ``--llama-empty-context``: llama-bench's default ``-n GEN`` from an empty
context, as before 2026-12-04), ``-t THREADS -r REPS``.  Both tools come from a llama.cpp build
given by path; without them only the PyTorch rows run.

PyTorch rows: one ``generate`` call = a PROMPT-token prefill + GEN greedy tokens; a logits
processor stamps the clock at each step (stamp 0 ends the prefill), medians of --reps calls
after a first (compiling) call.  backend="moe" recipes (``RECIPES``) put every weight the decode
step reads in the named format (experts: ``quant``, everything else: ``quant_dense``) with a
static KV cache (``cache_implementation="static"``: one decode graph, no cache growth); the
fp32 recipe is equal-tokens checked against HF eager.  ``--loop``: each such recipe also through
``moe_compile.generate`` (the same greedy tokens without HF generate's per-step Python; the
"moe-loop" rows).  ``--llama-greedy``: a program
``PATH MODEL.gguf THREADS IDS.txt N_GEN LOGITS.bin`` printing "gen: <ids>" (greedy from token ids
with llama.cpp's C API) checks that the GGUF is the same model (tokens and logits vs HF eager).

Roof (decode): bytes one decode step reads in its formats (attention, router, lm_head, the K
experts a token touches per layer, one embedding row) / the machine's read bandwidth (torch.sum
over 1 GiB, best of 5).  Memory-bound: the roof fraction is roof ms / measured ms.  The
alternating pairs (``--alternate``) also give each pair's fractions under a bandwidth reading taken
just before it.  Where the last-level cache (printed) holds the weights every step reads again, a
fraction can pass 1 (a 2-core Xeon VM with 300 MiB of L3 did: attention and lm_head at 4 bits
are ~80 MB).

Order: the baseline engines, then each recipe's rows followed at once by the llama.cpp type of
the same bits (``PEER_TYPE``: fp32 / f32, w16 / f16, w8 and a8w8 / q8_0, 4-bit / q4_0), the pair
under one bandwidth reading taken just before it ("GB/s"; the roof uses it), so that the memory's
drift on a shared VM does not enter a recipe's ratio ("vs llama": decode, "pf vs": prefill);
the types no recipe names (q4_K_M) run last.  ``--alternate N`` (with ``--loop``): after a
recipe's loop row, N pairs of one loop call and one single-repeat llama-bench run of its type,
alternating, and the median of the pairs' decode ratios with its range: on a VM whose memory speed
moves within minutes, a better reading of the ratio than one pair.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np
import torch

import harness  # benchmarks/harness.py
from moe_compile.models import llamacpp

# recipe -> (quant, quant_dense): every weight of the decode step in one format
RECIPES = {"fp32": ("none", "none"), "w16": ("w16", "w16"), "w8": ("w8-int", "w8-int"), "a8w8": ("a8w8-int", "a8w8-int"),
           "a8w8g": ("a8w8-int", "a8w8-int"), "w4": ("w4-int", "w4-int"), "a8w4": ("a8w4-int", "a8w4-int")}
# a recipe's environment while it compiles and runs: a8w8g is a8w8-int's group-wise form (q8_0's
# arithmetic) in the experts too (by default they are per channel, the dense linears group-wise),
# chosen at pack time by MOE_COMPILE_A8W8_GROUP
RECIPE_ENV = {"a8w8g": {"MOE_COMPILE_A8W8_GROUP": "grouped"}}
# (experts, dense) bytes per weight where they differ from the formats': group-wise a8w8 stores
# w8-int's bytes, and a8w8-int's dense linears are group-wise by default
RECIPE_BYTES = {"a8w8": ("a8w8-int", "w8-int"), "a8w8g": ("w8-int", "w8-int")}
LLAMA_FORMATS = ("f32", "f16", "q8_0", "q4_0", "q4_K_M")
# the llama.cpp type each recipe is timed beside (the same bits a weight)
PEER_TYPE = {"fp32": "f32", "w16": "f16", "w8": "q8_0", "a8w8": "q8_0", "a8w8g": "q8_0", "w4": "q4_0", "a8w4": "q4_0"}
# bytes per weight of each format (data + scales), for the roof
BYTES_PER_WEIGHT = {"none": 4.0, "w16": 2.0, "w8-int": 1 + 2 / 32, "a8w8-int": 1.0, "w4-int": 0.5 + 2 / 32,
                    "a8w4-int": 0.5 + 2 / 32, "mxfp4": 0.5 + 1 / 32, "mxfp8": 1 + 1 / 32}


def build_model(a):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(a.seed)
    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, moe_intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        num_experts=a.experts, num_experts_per_tok=a.topk, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-6,
        eos_token_id=0, bos_token_id=None, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def llama_formats(a, f32_path: str) -> dict:
    paths = {"f32": f32_path}
    for q in a.llama_formats:
        if q == "f32":
            continue
        out = f32_path.replace("-f32.gguf", f"-{q}.gguf")
        if not os.path.exists(out):
            subprocess.run([a.llama_quantize, f32_path, out, q.upper(), str(a.threads)], check=True,
                           capture_output=True)
        paths[q] = out
    return paths


def llama_bench(a, path: str, reps: int | None = None) -> dict:
    """llama-bench's prefill and, after the prompt's context as ours, decode (``--llama-depth``)."""
    return llamacpp.bench(a.llama_bench, path, a.threads, a.prompt, a.gen, reps or a.reps,
                          decode_depth=a.prompt if a.llama_depth else 0)


def llama_greedy(a, path: str, prompt: torch.Tensor, n: int) -> tuple[list[int], np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        ids, logits = os.path.join(tmp, "ids.txt"), os.path.join(tmp, "logits.bin")
        np.savetxt(ids, prompt.numpy(), fmt="%d")
        out = subprocess.run([a.llama_greedy, path, str(a.threads), ids, str(n), logits], check=True,
                             capture_output=True, text=True).stdout
        toks = [int(t) for t in next(ln for ln in out.splitlines() if ln.startswith("gen:")).split()[1:]]
        return toks, np.fromfile(logits, dtype=np.float32).reshape(n + 1, -1)


# ------------------------------------------------------------------------------------ PyTorch
class Clock:
    """A logits processor that stamps the time each step's logits arrive (and keeps the first)."""

    def __init__(self):
        self.stamps, self.first = [], None

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        if self.first is None:
            self.first = scores.detach().float().clone()
        return scores


def generate_timed(model, prompt: torch.Tensor, gen: int, **kwargs) -> dict:
    from transformers import LogitsProcessorList

    clock = Clock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=gen + 1, min_new_tokens=gen + 1, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]), **kwargs)
    s = clock.stamps
    return dict(prefill_s=s[0] - t0, decode_s=s[-1] - s[0], tokens=out[0, prompt.shape[1]:].tolist(),
                first_logits=clock.first, load1=os.getloadavg()[0])


def loop_timed(model, prompt: torch.Tensor, gen: int) -> dict:
    """moe_compile.generate (greedy, static cache, no HF generate loop) of gen + 1 tokens: the clock
    is stamped as each forward call returns (stamp 0 ends the prefill); the decode is stamp 0 to the
    end of the call (gen forward calls and their argmaxes, as HF's row counts them).  Not the
    difference of a long and a short call: the prefill's own run-to-run noise (~5% of 1.5 s) would
    be in the decode's 0.6 s."""
    import moe_compile

    stamps = []
    with _after_each_forward(model, lambda: stamps.append(time.perf_counter())):
        t0 = time.perf_counter()
        out = moe_compile.generate(model, prompt, gen + 1, stop_at_eos=False)
        t1 = time.perf_counter()
    return dict(prefill_s=stamps[0] - t0, decode_s=t1 - stamps[0], tokens=out[0, prompt.shape[1]:].tolist(),
                first_logits=None, load1=os.getloadavg()[0])


@contextlib.contextmanager
def _after_each_forward(model, after):
    """model.forward calls after() as each call returns, for the block's duration."""
    forward = model.forward

    @functools.wraps(forward)  # generate reads the forward's signature (cache / logits_to_keep)
    def wrapped(*args, **kwargs):
        out = forward(*args, **kwargs)
        after()
        return out

    model.forward = wrapped
    try:
        yield
    finally:
        model.forward = forward


def torch_row(model, a, prompt: torch.Tensor, engine: str, recipe: str | None, peer=None) -> dict:
    """One engine / recipe: a first (compiling) call, then --reps timed calls; with ``peer`` (a
    callable timing the llama.cpp type once) and --alternate N, then N (ours, peer) pairs."""
    import moe_compile

    torch._dynamo.reset()
    if engine != "moe-loop":  # the loop row right after its recipe's "moe" row reuses that row's packs
        moe_compile.empty_cache()
    forward = model.forward
    kwargs = {}
    if engine == "inductor":
        model.forward = torch.compile(forward)
    elif engine in ("moe", "moe-loop"):
        quant, dense = RECIPES[recipe]
        model.forward = torch.compile(forward, backend="moe", options={"quant": quant, "quant_dense": dense})
        kwargs["cache_implementation"] = "static"
    timed = (lambda: loop_timed(model, prompt, a.gen)) if engine == "moe-loop" else (
        lambda: generate_timed(model, prompt, a.gen, **kwargs))
    env = RECIPE_ENV.get(recipe, {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t = time.perf_counter()
        first = timed()
        first_s = time.perf_counter() - t
        runs = [timed() for _ in range(a.reps)]
        pairs = [_pair(a, timed, peer) for _ in range(a.alternate if peer else 0)]
        profile = None
        if recipe in a.profile and engine == "moe":
            profile = profile_decode(model, prompt, a.gen, **kwargs)
        elif recipe in a.profile and engine == "moe-loop":
            profile = profile_loop(model, prompt, a.gen)
    finally:
        model.forward = forward
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    pre, dec = statistics.median(r["prefill_s"] for r in runs), statistics.median(r["decode_s"] for r in runs)
    return dict(engine=engine, recipe=recipe, prefill_tok_s=a.prompt / pre, decode_tok_s=a.gen / dec,
                decode_ms_tok=1e3 * dec / a.gen, first_call_s=first_s, load1=statistics.median(r["load1"] for r in runs),
                tokens=first["tokens"], first_logits=first["first_logits"], profile=profile, pairs=pairs)


def _pair(a, timed, peer) -> tuple[float, float, float]:
    """One alternating pair: (ours, llama.cpp's) decode tok/s and the read bandwidth measured just
    before them, which the pair's roof fractions use (the VM's memory speed moves within minutes)."""
    bw = harness.best_read_bandwidth(repeats=3)
    return a.gen / timed()["decode_s"], peer()["decode_tok_s"], bw


# Profiler rows of a decode step, by what they are (first match wins); the rest of the step's wall
# time is Python between them (HF generate's loop, the compiled graph's wrappers).
PROFILE_GROUPS = (("dense linears (dense_linear)", ("moe_compile::dense_linear",)),
                  ("MoE experts (fused_moe)", ("moe_compile::fused_moe",)),
                  ("attention (decode_attention, SDPA)", ("moe_compile::decode_attention", "scaled_dot_product")),
                  ("Inductor's kernels (norms, rotary, softmax, ...)", ("Call CompiledFxGraph",)),
                  ("Dynamo guards", ("TorchDynamo Cache Lookup",)),
                  ("Dynamo's frame (compiled region, pregraph bytecode)", ("Torch-Compiled Region", "Pregraph bytecode")),
                  ("AOTAutograd wrapper", ("AOTDispatcher",)),
                  ("other aten ops", ("aten::",)))


def profile_decode(model, prompt: torch.Tensor, gen: int, **kwargs) -> dict:
    """ms per decode step by PROFILE_GROUPS (self CPU time of the main thread's ops), from one
    profiled generate of the timed length (the same graphs: no recompile); ops that start after the
    prefill's logits (a marker the logits processor records) count."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import LogitsProcessorList

    class Marker:
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 1:
                with record_function("decode starts"):
                    pass
            return scores

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model.generate(prompt, max_new_tokens=gen + 1, min_new_tokens=gen + 1, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([Marker()]), **kwargs)
    return _step_groups(prof.events(), gen)


def profile_loop(model, prompt: torch.Tensor, gen: int) -> dict:
    """profile_decode for moe_compile.generate: the marker is recorded as the prefill's forward
    call returns."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import moe_compile

    calls = []

    def mark_first():
        calls.append(1)
        if len(calls) == 1:
            with record_function("decode starts"):
                pass

    with _after_each_forward(model, mark_first), torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        moe_compile.generate(model, prompt, gen + 1, stop_at_eos=False)
    return _step_groups(prof.events(), gen)


def _step_groups(events, gen: int) -> dict:
    """ms per decode step by PROFILE_GROUPS from the events after the "decode starts" marker."""
    start = next(e.time_range.start for e in events if e.name == "decode starts")
    end = max(e.time_range.end for e in events)
    out = dict.fromkeys([g for g, _ in PROFILE_GROUPS], 0.0)
    for ev in events:
        if ev.time_range.start < start or ev.thread != events[0].thread:
            continue
        group = next((g for g, keys in PROFILE_GROUPS if any(k in ev.name for k in keys)), None)
        if group is not None:
            out[group] += ev.self_cpu_time_total / 1e3 / gen
    step_ms = (end - start) / 1e3 / gen
    out["Python and the rest (wall - the above)"] = step_ms - sum(out.values())
    return dict(step_ms=step_ms, groups=out)


# --------------------------------------------------------------------------------------- roof
def decode_bytes(model, quant: str, dense: str) -> float:
    """Bytes one decode step reads: dense weights in ``dense``, the touched experts in ``quant``."""
    cfg = model.config
    H, F, K, L, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_hidden_layers, cfg.vocab_size
    att = model.model.layers[0].self_attn
    attn = sum(p.numel() for p in att.parameters())
    router = cfg.num_experts * H
    norms = 2 * H
    dense_weights = L * attn + V * H  # attention and lm_head
    experts = L * K * 3 * H * F
    return (BYTES_PER_WEIGHT[dense] * dense_weights + 4.0 * (L * (router + norms) + H + H)
            + BYTES_PER_WEIGHT[quant] * experts)


def llama_decode_bytes(path: str, cfg) -> float:
    import gguf

    total = 0.0
    for t in gguf.GGUFReader(path).tensors:
        n = float(t.n_bytes)
        total += n * cfg.num_experts_per_tok / cfg.num_experts if "_exps" in t.name else \
            n / cfg.vocab_size if t.name == "token_embd.weight" else n
    return total


# --------------------------------------------------------------------------------------- main
def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 2048), ("experts", 64), ("ffn", 768), ("topk", 8), ("layers", 4), ("heads", 32),
                          ("kv-heads", 4), ("head-dim", 128), ("vocab", 32000), ("seed", 0), ("prompt", 512),
                          ("gen", 64), ("threads", 2), ("reps", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--engines", nargs="*", default=["eager", "inductor"], choices=["eager", "inductor"])
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench binary")
    p.add_argument("--llama-quantize", help="llama.cpp's llama-quantize binary (for the non-f32 GGUFs)")
    p.add_argument("--llama-greedy", help="greedy-from-ids checker (see the module docstring)")
    p.add_argument("--llama-formats", nargs="*", default=list(LLAMA_FORMATS))
    p.add_argument("--llama-empty-context", action="store_true",
                   help="time llama.cpp's decode from an empty context (llama-bench's default) instead of after "
                        "the prompt's --prompt tokens, where ours decodes")
    p.add_argument("--alternate", type=int, default=0,
                   help="with --loop: after each recipe's timed runs, N more pairs of one moe_compile.generate "
                        "and one llama-bench run of its type, alternating; the median of the pairs' decode ratios "
                        "(the VM's memory speed drifts by 10-30%% within minutes, which one pair folds in)")
    p.add_argument("--loop", action="store_true",
                   help="also time each backend='moe' recipe through moe_compile.generate (no HF generate loop)")
    p.add_argument("--profile", nargs="*", default=[], choices=list(RECIPES),
                   help="after timing these recipes, profile their decode steps (HF generate's and, with --loop, "
                        "moe_compile.generate's): where a step's time goes")
    p.add_argument("--from-gguf", default=None, metavar="GGUF",
                   help="the rows of a model loaded quantized instead: this GGUF through moe_compile.load (each "
                        "--load-recipes entry) and llama.cpp, each row a fresh process: peak resident memory and "
                        "time to first token beside tokens/s (needs --llama-bench and --llama-greedy)")
    p.add_argument("--random-30b", action="store_true",
                   help="with --from-gguf: first write there (if missing) a random-weight q4_0 GGUF of "
                        "Qwen3-30B-A3B's shapes, streamed block by block (~17 GB; no fp32 anywhere)")
    p.add_argument("--load-recipes", nargs="*", default=["stored", "a8w4"],
                   help="with --from-gguf: 'stored' (every tensor as the file stores it) and/or RECIPES names")
    p.add_argument("--work", default=None, help="where the GGUFs go (default: a temporary directory)")
    p.add_argument("--out", default=None,
                   help="path prefix of the .json (default: results/e2e_cpu/<machine>-<date>, with --from-gguf "
                        "results/e2e_load/<machine>-<date>; an existing directory gets e2e_cpu.json / "
                        "e2e_cpu_gguf.json)")
    a = p.parse_args()
    a.llama_depth = not a.llama_empty_context
    return a


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    print(harness.machine_line(harness.machine_info()))
    if a.from_gguf:
        return main_from_gguf(a)
    bw = harness.best_read_bandwidth()
    print(f"read bandwidth {bw / 1e9:.1f} GB/s (torch.sum over 1 GiB, best of 5); load {os.getloadavg()[0]:.2f}; "
          f"last-level cache {_llc_mib()} MiB")
    model = build_model(a)
    prompt = torch.randint(1, a.vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    paths = _gguf_paths(a, model) if a.llama_bench else {}
    rows, ran = [], set()
    for engine in a.engines:
        rows.append(torch_row(model, a, prompt, engine, None) | dict(bytes=decode_bytes(model, "none", "none"), bw=bw))
    for recipe in a.recipes:
        # each recipe beside its llama.cpp type, run right after it, under one bandwidth reading:
        # this VM's memory speed drifts by 10-20% within the run, which sequential blocks would fold
        # into the ratio
        pair_bw = harness.best_read_bandwidth()
        peer = PEER_TYPE.get(recipe)
        for engine in ("moe", "moe-loop") if a.loop else ("moe",):
            once = (lambda path=paths[peer]: llama_bench(a, path, reps=1)) if engine == "moe-loop" and peer in paths \
                else None
            rows.append(torch_row(model, a, prompt, engine, recipe, once)
                        | dict(bytes=decode_bytes(model, *RECIPE_BYTES.get(recipe, RECIPES[recipe])), bw=pair_bw))
        if peer in paths:
            rows.append(_llama_row(a, model, paths[peer], peer, pair_bw) | dict(pair=recipe))
            ran.add(peer)
    for fmt, path in paths.items():  # the types no recipe was paired with
        if fmt not in ran:
            rows.append(_llama_row(a, model, path, fmt, harness.best_read_bandwidth()))
    checks = _check_torch(rows)
    if paths:
        if a.llama_greedy:
            checks["llama_f32_vs_hf_eager"] = _check_llama(a, model, paths["f32"])
        eager = next((r for r in rows if r["engine"] == "eager"), None)
        for fmt, path in paths.items():  # the same context as the PyTorch rows' first-step logits
            if eager is not None and fmt != "f32":
                checks[f"llama.cpp:{fmt} weights"] = _gguf_weights_sqnr(model, path, prompt, eager["first_logits"])
    _print(rows, bw, checks)
    keep = [{k: v for k, v in r.items() if k not in ("tokens", "first_logits")} for r in rows]
    with open(harness.output_path(a.out or harness.result_stem("e2e_cpu"), "e2e_cpu", ".json"), "w") as f:
        json.dump(dict(machine=harness.machine_info(), bandwidth_GBps=bw / 1e9, args=vars(a), rows=keep,
                       checks=checks), f, indent=1)


def main_from_gguf(a) -> None:
    """The --from-gguf rows: see the module docstring of ``e2e_load.py``."""
    import e2e_load  # benchmarks/e2e_load.py

    if a.random_30b and not os.path.exists(a.from_gguf):
        t = time.time()
        size = llamacpp.write_random_q4_0(llamacpp.qwen3_30b_a3b_config(), a.from_gguf)
        print(f"wrote {a.from_gguf}: {size / 1e9:.2f} GB of random q4_0 in {time.time() - t:.0f} s")
    bw = harness.best_read_bandwidth()
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; load {os.getloadavg()[0]:.2f}; file {os.path.getsize(a.from_gguf) / 1e9:.2f} GB; "
          f"page cache dropped before each row: {_drop_caches()}")
    from moe_compile.loading.gguf_file import read_header

    vocab = next(t.shape[0] for t in read_header(a.from_gguf).tensors if t.name == "token_embd.weight")
    prompt = torch.randint(1, vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1))  # as the worker's
    _drop_caches()
    llama = e2e_load.llama_first_token(a.llama_greedy, a.from_gguf, prompt[0].numpy(), a.threads, 16)
    llama.update(llama_bench(a, a.from_gguf))
    rows = []
    for recipe in a.load_recipes:
        quant, dense = (None, None) if recipe == "stored" else RECIPES[recipe]
        _drop_caches()
        with tempfile.TemporaryDirectory() as tmp:
            logits = os.path.join(tmp, "first.npy")
            row = e2e_load.run_worker(a.from_gguf, quant, dense, a.prompt, a.gen, a.reps, a.threads, logits)
            row.update(recipe=recipe, logits_sqnr_db=e2e_load.sqnr_db(llama["first_logits"], np.load(logits)))
        row["same_tokens"] = next((i for i, (x, y) in enumerate(zip(row["tokens"], llama["tokens"])) if x != y),
                                  len(llama["tokens"]))
        rows.append(row)
        print(row.pop("load_report"))
    print(f"\n{'engine':10s} {'format':8s} {'peak GiB':>8s} {'1st tok s':>9s} {'load s':>6s} {'prefill':>8s} "
          f"{'decode':>7s} {'mem vs':>6s} {'dec vs':>6s} {'pf vs':>6s} {'tokens=':>7s} {'dB':>5s}")
    print(f"{'llama.cpp':10s} {'stored':8s} {llama['peak_GiB']:8.2f} {llama['first_token_s']:9.1f} {'':>6s} "
          f"{llama['prefill_tok_s']:8.1f} {llama['decode_tok_s']:7.2f}")
    for r in rows:
        print(f"{'moe-load':10s} {r['recipe']:8s} {r['peak_GiB']:8.2f} {r['first_token_s']:9.1f} {r['load_s']:6.1f} "
              f"{r['prefill_tok_s']:8.1f} {r['decode_tok_s']:7.2f} {r['peak_GiB'] / llama['peak_GiB']:6.2f} "
              f"{r['decode_tok_s'] / llama['decode_tok_s']:6.2f} {r['prefill_tok_s'] / llama['prefill_tok_s']:6.2f} "
              f"{r['same_tokens']:4d}/16 {r['logits_sqnr_db']:5.1f}")
    llama.pop("first_logits")
    with open(harness.output_path(a.out or harness.result_stem("e2e_load"), "e2e_cpu_gguf", ".json"), "w") as f:
        json.dump(dict(machine=harness.machine_info(), bandwidth_GBps=bw / 1e9, args=vars(a), llama=llama,
                       rows=rows), f, indent=1)


def _drop_caches() -> bool:
    """Empty the page cache (time to first token from a cold file), where this user may."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _llc_mib() -> str:
    """The last-level cache's MiB: where the weights every step reads again (attention, lm_head:
    ~80 MB at 4 bits here) fit in it, a step reads them from there and can beat the roof (a
    fraction above 1), ours and llama.cpp's alike."""
    llc = harness.last_level_cache_bytes()
    return "?" if llc is None else str(llc // (1024 * 1024))


def _gguf_paths(a, model) -> dict:
    """llama.cpp type -> GGUF path: the fp32 GGUF written once, the others quantized from it."""
    work = a.work or tempfile.mkdtemp(prefix="moe_e2e_")
    os.makedirs(work, exist_ok=True)
    f32 = os.path.join(work, "model-f32.gguf")
    if not os.path.exists(f32):
        llamacpp.write_gguf(model, f32)
    return llama_formats(a, f32) if a.llama_quantize else {"f32": f32}


def _llama_row(a, model, path: str, fmt: str, bw: float) -> dict:
    return dict(engine="llama.cpp", recipe=fmt, bytes=llama_decode_bytes(path, model.config), bw=bw,
                **llama_bench(a, path))


def _check_torch(rows: list[dict]) -> dict:
    """Greedy tokens of the fp32 rows against HF eager's; the quantized rows' first-step logits SQNR."""
    from moe_compile.quant.int8 import sqnr_db

    eager = next((r for r in rows if r["engine"] == "eager"), None)
    out = {}
    for r in rows:
        if eager is None or r is eager or r["engine"] == "llama.cpp":
            continue
        key = f"{r['engine']}:{r['recipe']}"
        if r["first_logits"] is None:  # moe_compile.generate keeps no logits: its tokens only
            out[key] = dict(same_tokens=r["tokens"] == eager["tokens"])
            continue
        finite = torch.isfinite(eager["first_logits"])  # generate masks EOS to -inf (min_new_tokens)
        out[key] = dict(same_tokens=r["tokens"] == eager["tokens"],
                        first_logits_sqnr_db=sqnr_db(eager["first_logits"][finite], r["first_logits"][finite]))
    return out


def _check_llama(a, model, path: str) -> dict:
    from moe_compile.quant.int8 import sqnr_db

    prompt = torch.randint(1, a.vocab, (1, 32), generator=torch.Generator().manual_seed(2))
    toks, logits = llama_greedy(a, path, prompt, 16)
    with torch.no_grad():
        hf = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)[0, 32:].tolist()
        ref = model(torch.cat([prompt, torch.tensor([toks[:-1]])], 1)).logits[0, 31:]
    lg = torch.from_numpy(logits[: ref.shape[0]])
    return dict(same_tokens=toks == hf, logits_sqnr_db=sqnr_db(ref, lg), hf=hf, llama=toks)


def _gguf_weights_sqnr(model, path: str, prompt: torch.Tensor, eager_logits: torch.Tensor) -> dict:
    """SQNR of the first-step logits against HF eager fp32's with the GGUF's own (quantized) weights
    dequantized into the model: llama.cpp's weight error at that format, with fp32 activations
    (llama.cpp itself also rounds its activations to 8 bits for q8_0 / q4_0, so its true figure is
    a little lower).  Its greedy checker cannot run quantized GGUFs on every CPU (llama.cpp's
    CPU_REPACK path crashed here on an AMX Xeon), this always can."""
    import copy

    import gguf
    from gguf.quants import dequantize

    from moe_compile.quant.int8 import sqnr_db

    tensors = {t.name: (t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in llamacpp.gguf_tensors(twin):
            data, kind = tensors[name]
            param.copy_(torch.from_numpy(dequantize(data, kind).reshape(param.shape).copy()))
        got = twin(prompt).logits[0, -1]
    want = eager_logits.reshape(-1)
    finite = torch.isfinite(want)
    del twin
    return dict(first_logits_sqnr_db=sqnr_db(want[finite], got[finite]))


def _print(rows: list[dict], bw: float, checks: dict) -> None:
    """The table: each recipe's rows, then the llama.cpp type timed beside it (its decode ratio in
    "vs llama", prefill ratio in "pf vs"); roof and GB/s from the pair's own bandwidth reading."""
    print(f"\n{'engine':10s} {'format':8s} {'prefill tok/s':>13s} {'decode tok/s':>12s} {'ms/token':>9s} "
          f"{'roof ms':>8s} {'of roof':>7s} {'GB/s':>5s} {'vs llama':>8s} {'pf vs':>6s} {'load':>5s}")
    peers = {r["pair"]: r for r in rows if r.get("pair")}
    for r in rows:
        rbw = r.get("bw", bw)
        roof_ms = 1e3 * r["bytes"] / rbw
        peer = peers.get(r["recipe"]) if r["engine"] != "llama.cpp" else None
        vs = f"{r['decode_tok_s'] / peer['decode_tok_s']:8.2f}" if peer else f"{'':8s}"
        pf = f"{r['prefill_tok_s'] / peer['prefill_tok_s']:6.2f}" if peer else f"{'':6s}"
        print(f"{r['engine']:10s} {str(r['recipe'] or 'fp32'):8s} {r['prefill_tok_s']:13.1f} {r['decode_tok_s']:12.2f} "
              f"{r['decode_ms_tok']:9.2f} {roof_ms:8.2f} {roof_ms / r['decode_ms_tok']:7.2f} {rbw / 1e9:5.1f} {vs} {pf} "
              f"{r['load1']:5.2f}")
    for r in rows:
        if r.get("pairs"):
            ratios = sorted(ours / peer for ours, peer, _ in r["pairs"])
            print(f"\n{r['recipe']}: {len(ratios)} alternating pairs (moe_compile.generate, llama-bench {PEER_TYPE[r['recipe']]}"
                  f"): decode ratio median {statistics.median(ratios):.2f} (min {ratios[0]:.2f}, max {ratios[-1]:.2f}); "
                  f"ours {statistics.median(o for o, _, _ in r['pairs']):.1f} tok/s, llama.cpp "
                  f"{statistics.median(p for _, p, _ in r['pairs']):.1f}")
            peer_row = peers.get(r["recipe"])
            if peer_row is not None:  # each pair's roof fractions under its own bandwidth reading
                ours_f = sorted(o * r["bytes"] / b for o, _, b in r["pairs"])
                peer_f = sorted(p * peer_row["bytes"] / b for _, p, b in r["pairs"])
                print(f"  of the decode roof, pair by pair: ours median {statistics.median(ours_f):.2f} "
                      f"({ours_f[0]:.2f}..{ours_f[-1]:.2f}), llama.cpp {statistics.median(peer_f):.2f} "
                      f"({peer_f[0]:.2f}..{peer_f[-1]:.2f}); bandwidth {min(b for *_, b in r['pairs']) / 1e9:.1f}-"
                      f"{max(b for *_, b in r['pairs']) / 1e9:.1f} GB/s")
    for r in rows:
        if r.get("profile"):
            print(f"\nprofile {r['engine']}:{r['recipe']}: {r['profile']['step_ms']:.2f} ms a decode step (profiled)")
            for group, ms in r["profile"]["groups"].items():
                print(f"  {group:50s} {ms:7.2f} ms")
    for key, c in checks.items():
        print(f"check {key}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()
                                            if k not in ("hf", "llama")))


if __name__ == "__main__":
    main()
