"""Routing plan of the expert-parallel op: which slot goes to which rank, in which order.

Shapes:  T tokens, H hidden, E global experts, K experts per token, R ranks, El = E // R local
         experts per rank, S = T*K slots, S' the slots whose id lies in [0, E).

Rank r owns experts [r*El, (r+1)*El).  One stable sort of the flat global ids groups the slots by
owning rank and, inside a rank, by local expert — the order in which rows are sent, received,
computed and returned.  Ids outside [0, E) fall outside every segment and contribute nothing
(the sentinel convention of ``kernels/reference.py``).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class RoutePlan:
    order: torch.Tensor  # [S'] flat slot index (t*K + k), sorted by global expert id
    tokens: torch.Tensor  # [S'] token of each sorted slot
    counts: torch.Tensor  # [R, El] int64: rows this rank sends to (dest rank, local expert)
    world: int
    local_experts: int

    @property
    def rows(self) -> int:
        return self.order.numel()


def make_plan(topk_ids: torch.Tensor, num_experts: int, world: int) -> RoutePlan:
    """Stable sort of the flat ids -> slot order grouped by (dest rank, local expert), and counts."""
    if num_experts % world:
        raise ValueError(f"fused_moe_ep: num_experts={num_experts} is not divisible by world size {world}")
    el = num_experts // world
    K = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    flat = topk_ids.reshape(-1).long()  # [S]
    sorted_ids, order = torch.sort(flat, stable=True)  # [S], [S]
    bounds = torch.searchsorted(sorted_ids, torch.tensor([0, num_experts], dtype=torch.long, device=flat.device))
    lo, hi = int(bounds[0]), int(bounds[1])  # host read of two ints (CPU path)
    order = order[lo:hi]  # [S']
    counts = torch.bincount(sorted_ids[lo:hi], minlength=num_experts).view(world, el)  # [R, El]
    return RoutePlan(order, order // max(K, 1), counts, world, el)


def local_ids_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """[R_src, El] received counts -> [N] local expert id of each received row (src-major)."""
    el = counts.shape[1]
    ids = torch.arange(el, dtype=torch.long).repeat(counts.shape[0])  # [R*El]
    return torch.repeat_interleave(ids, counts.reshape(-1))  # [N]


def receive_bound(max_tokens: int, tokens: int, top_k: int, world: int) -> int:
    """Rows one rank may receive per call.

    ``max_tokens > 0`` is the user's bound.  ``0`` derives it from the shapes: every source rank
    sends at most T_src*K rows, so a rank receives at most T_max*K*R rows, where T_max is the
    largest T among the ranks of this call (exchanged with the counts).  That bound can never be
    exceeded, so only an explicit ``max_tokens`` can overflow — and then the op raises, naming it.
    """
    return max_tokens if max_tokens > 0 else tokens * top_k * world


def check_bound(matrix: torch.Tensor, max_tokens: int, top_k: int, rank: int) -> None:
    """matrix [R_src, R_dst, El] of every rank's counts: raise on every rank if a dest overflows.

    Only an explicit ``max_tokens`` can be exceeded (the derived bound T_max*K*R always holds).
    """
    if max_tokens <= 0:
        return
    recv = matrix.sum(dim=(0, 2))  # [R_dst] rows each rank receives
    over = [(d, int(n)) for d, n in enumerate(recv.tolist()) if n > max_tokens]
    if over:
        d, n = max(over, key=lambda p: p[1])
        raise ValueError(
            f"fused_moe_ep: rank {d} would receive {n} rows, more than its receive bound max_tokens={max_tokens} "
            f"(rows = tokens routed to its experts, T*K per source rank at most); raise max_tokens to at least {n} "
            f"(or 0 to derive T_max*K*world) — no token is dropped (raised on rank {rank})"
        )


# Auto chunking: a piece (one source's rows to one dest, 1/C of them) should keep >= ROWS_PER_PIECE
# rows, else per-expert GEMMs get too small to pay for the finer overlap.  Sweep (bench_ep.py on a
# 16-core x86 host, fp32, 1 thread per rank, T=512, H=1024): E=64/K=8 world 2 (4096 rows per rank)
# c1/c2/c4 = 204/184/157 ms, world 4 188/221/250 ms; E=8/K=2 world 2 (1024 rows) 147/147/176 ms.
# per_rank // (R * 1024) picks 2, 1 and 1 there (near the best of each, with the run's noise).
ROWS_PER_PIECE = 1024


def auto_chunks(matrix: torch.Tensor) -> int:
    """Chunks per block from the whole counts matrix (the same on every rank, so no exchange)."""
    R = matrix.shape[0]
    per_rank = int(matrix.sum()) // max(R, 1)
    return max(1, min(4, per_rank // (R * ROWS_PER_PIECE)))


def piece_bounds(n: int, chunks: int) -> list[int]:
    """Row boundaries of C near-equal pieces of a block of n rows."""
    return [n * j // chunks for j in range(chunks + 1)]


def piece_counts(block_counts, a: int, b: int) -> list[int]:
    """Per-local-expert rows of rows [a, b) of a block whose experts have ``block_counts`` rows."""
    out, lo = [], 0
    for c in block_counts:
        hi = lo + c
        out.append(max(0, min(b, hi) - max(a, lo)))
        lo = hi
    return out
