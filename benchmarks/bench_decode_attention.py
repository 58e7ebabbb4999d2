"""Decode attention on CPU against a static KV cache: ``moe_compile::decode_attention`` (kernels/cpu/
attention.c) beside torch's SDPA, the cache exactly as long as its written keys and longer, its
unwritten tail masked (what HF's static cache, sized prompt + max_new_tokens, and a reused
``moe_compile.generate`` cache look like).

    python benchmarks/bench_decode_attention.py [--threads 2] [--written 512 2048] [--cache 4096] [--out PREFIX]

Shapes: one query row, H query heads sharing G key/value heads of dim D (default the Qwen3-MoE
model of bench_e2e_cpu.py: 32 / 4 heads of 128), fp32.  Rows, for each written length W:
  op exact / sdpa exact    a cache of exactly W keys, no mask
  op padded / sdpa padded  a cache of --cache keys, keys W.. masked (a float mask, as HF builds it)
  read                     torch.sum over the W keys' K and V (what reading them costs here)
Calls of all rows interleaved in shuffled order, median of --repeats; the cache stays in cache
between calls (a decode step reads the same layer's cache once per step: warm figures, the
arithmetic and the split over threads are what they measure).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import harness  # benchmarks/harness.py


def rows(H: int, G: int, D: int, written: int, cache: int) -> dict:
    q = torch.randn(1, H, 1, D)
    k, v = torch.randn(1, G, cache, D), torch.randn(1, G, cache, D)
    ke, ve = k[:, :, :written].contiguous(), v[:, :, :written].contiguous()
    mask = torch.zeros(1, 1, 1, cache)
    mask[..., written:] = float("-inf")
    scale = D ** -0.5
    op = torch.ops.moe_compile.decode_attention
    return {"op exact": lambda: op(q, ke, ve, None, scale),
            "op padded": lambda: op(q, k, v, mask, scale),
            "sdpa exact": lambda: F.scaled_dot_product_attention(q, ke, ve, scale=scale, enable_gqa=True),
            "sdpa padded": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True),
            "read": lambda: (ke.sum(), ve.sum())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--written", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--cache", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", help="path prefix of the .md / .json (default: results/decode_attention/<machine>-<date>)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import moe_compile.ops  # noqa: F401  registers moe_compile::decode_attention
    from moe_compile.kernels.cpu import attention

    if attention.unavailable_reason() is not None:
        raise SystemExit(f"no decode attention kernel here: {attention.unavailable_reason()}")
    machine = harness.machine_info()
    print(harness.machine_line(machine), f"load {harness.load_average()}")
    table, data = [], {"machine": machine, "args": vars(a), "rows": []}
    for written in a.written:
        fns = rows(a.heads, a.kv_heads, a.head_dim, written, a.cache)
        samples = harness.time_shuffled(fns, a.repeats)
        med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
        data["rows"].append({"written": written, "cache": a.cache, "us": med})
        table.append([written, a.cache] + [f"{med[k]:.0f}" for k in fns])
        names = list(fns)
    md = harness.markdown_table(["written keys", "cache keys"] + [f"{k} us" for k in names], table)
    print(md)
    harness.write_outputs(a.out or harness.result_stem("decode_attention"), "decode_attention", md, data)


if __name__ == "__main__":
    main()
