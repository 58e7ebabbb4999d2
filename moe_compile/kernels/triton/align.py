"""Align (token, k) slots by expert, padded to the GEMM's BLOCK_M — on the device, no host sync.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots.

A slot s = t*K + k stands for "token t goes to expert topk_ids[t, k]".  The grouped GEMMs want
the slots of each expert contiguous and every expert's segment padded to a multiple of BLOCK_M,
so that one BLOCK_M-row tile of A never mixes two experts:

    counts[e]          number of slots routed to expert e (ids outside [0, E) are ignored)
    padded[e]          counts[e] rounded up to BLOCK_M (0 for an expert with no token)
    sorted_slots[P]    slot ids, expert by expert; padding rows hold the sentinel S
    block_expert[P/BM] the expert of each BLOCK_M-row block
    total[1]           sum(padded): GEMM programs whose block starts past it exit at once

P is only known on the device; the host sizes the buffers with the bound
    P <= S + min(E, S) * (BLOCK_M - 1)
(at most min(E, S) experts are non-empty, each wastes at most BLOCK_M - 1 rows), so the GEMM grid
is fixed by shapes alone (CUDA-graph friendly, no ``.item()``).

One program per expert.  Each program scans all S ids twice: once to build the full histogram
(one-hot compare of a CHUNK of ids against all E_PAD experts, summed over the chunk) from which it
takes its own segment start, and once to place its own slots (a prefix sum of ``ids == e`` over
each chunk gives each slot its rank).  That is E * S compares of work, all from L2 — a few
microseconds even at S = 16k, E = 256, and a single launch, which is what decode cares about.
Slots keep their original order inside a segment (the placement is a stable sort).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _align_kernel(
    ids_ptr,  # [S] int32/int64 expert id of each slot
    sorted_ptr,  # [P_max] int32 out: slot ids grouped by expert, sentinel S in padding
    block_expert_ptr,  # [P_max / BLOCK_M] int32 out: expert of each block
    total_ptr,  # [1] int32 out: P, the padded number of rows actually used
    segments_ptr,  # [2E] int32 out (when STORE_SEGMENTS): segment start, then padded rows, per expert
    S,
    E,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,  # next power of two >= E
    CHUNK: tl.constexpr,  # ids read per step; CHUNK * E_PAD one-hot compares live at once
    STORE_SEGMENTS: tl.constexpr = False,  # the backward's weight-gradient GEMMs walk segments
):
    e = tl.program_id(0)
    experts = tl.arange(0, E_PAD)  # [E_PAD]

    # Pass 1: histogram of all experts -> this expert's segment start and size.
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, S, CHUNK):
        offs = start + tl.arange(0, CHUNK)  # [CHUNK]
        ids = tl.load(ids_ptr + offs, mask=offs < S, other=-1)  # int32 or int64, compared as is
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)  # [E_PAD]
    counts = tl.where(experts < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    seg_start = tl.sum(tl.where(experts < e, padded, 0))
    seg_rows = tl.sum(tl.where(experts == e, padded, 0))
    seg_count = tl.sum(tl.where(experts == e, counts, 0))
    if e == 0:
        tl.store(total_ptr, tl.sum(padded))
    if STORE_SEGMENTS:
        tl.store(segments_ptr + e, seg_start)
        tl.store(segments_ptr + E + e, seg_rows)

    # Pass 2: place this expert's slots in order.
    seen = seg_start
    for start in range(0, S, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < S, other=-1)  # int32 or int64, compared as is
        hit = (ids == e).to(tl.int32)  # [CHUNK]
        rank = tl.cumsum(hit, axis=0) - hit  # exclusive prefix sum
        tl.store(sorted_ptr + seen + rank, offs, mask=hit != 0)
        seen += tl.sum(hit)

    # Padding rows of the last block get the sentinel S (masked out by the GEMMs).
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + seg_start + seg_count + pad, S + pad * 0, mask=seg_count + pad < seg_rows)

    # Every block of this segment belongs to expert e.
    first_block = seg_start // BLOCK_M
    for b in range(0, seg_rows // BLOCK_M, CHUNK):
        blocks = b + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + first_block + blocks, e + blocks * 0, mask=blocks < seg_rows // BLOCK_M)


def max_padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded row count P (see the module docstring)."""
    return num_slots + min(num_experts, num_slots) * (block_m - 1)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, with_segments: bool = False):
    """topk_ids [T, K] -> (sorted_slots [P_max], block_expert [P_max/BM], total [1]), all int32;
    with_segments adds segments [2E] int32: each expert's segment start, then its padded rows."""
    ids = topk_ids.reshape(-1)  # [S]
    if not ids.is_contiguous():
        ids = ids.contiguous()
    S = ids.numel()
    p_max = max_padded_rows(S, num_experts, block_m)
    p_max = triton.cdiv(p_max, block_m) * block_m
    sorted_slots = torch.empty(p_max, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(p_max // block_m, dtype=torch.int32, device=ids.device)
    total = torch.empty(1, dtype=torch.int32, device=ids.device)
    e_pad = triton.next_power_of_2(max(num_experts, 2))
    chunk = max(16, min(triton.next_power_of_2(max(S, 1)), 8192 // e_pad, 1024))
    segments = torch.empty(2 * num_experts if with_segments else 1, dtype=torch.int32, device=ids.device)
    _align_kernel[(num_experts,)](
        ids, sorted_slots, block_expert, total, segments, S, num_experts,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, STORE_SEGMENTS=with_segments,
    )
    if with_segments:
        return sorted_slots, block_expert, total, segments
    return sorted_slots, block_expert, total
