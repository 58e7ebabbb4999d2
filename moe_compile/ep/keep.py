"""What an expert-parallel forward keeps for its backward, as tensors of the training op's schema.

Shapes:  T tokens (this rank), H hidden, K top-k, R ranks, ne = E // R local experts,
         CAP rows the kept buffer holds, N rows this rank received in the forward.

``moe_compile::fused_moe_ep_train`` returns (y, rows [CAP, H], meta [M] int64) — static shapes a
fake kernel computes from the arguments alone — so that AOTAutograd saves rows and meta for the
backward like any forward output (a Python-side stash does not survive functionalization and
partitioning).  The backward op takes them back and, when every rank kept its rows, each rank
sends its peers only [dy | g] instead of [x | dy | g].

* ``CAP = max_tokens`` when given, else ``R * T * min(K, ne)``: what a rank receives when every
  rank has this rank's T (a source sends a token at most min(K, ne) times to one rank).  With
  unequal T per rank a rank can receive more; then the forward keeps nothing (the verdict is the
  same on every rank, see below) and the backward sends x again — correct, only not cheaper.
  Why a rank with T = 0 (or fewer tokens than its peers) cannot keep without ``max_tokens``: CAP
  is an output shape, fixed when the fake kernel runs, and the fake kernel (like the traced
  graph) sees only this rank's T; the peers' T is known only once their headers arrive, inside
  the forward, after the shapes are fixed.  A larger static bound would need either the user's
  ``max_tokens`` (the receive bound, rows per rank: then every rank's CAP covers what it may
  receive, T = 0 included) or a host sync of every rank's T before tracing.  What is left to do
  without either: a per-rank verdict (only the overfull rank's sources send it x again, the
  others [dy | g]), which needs two row widths in one backward exchange.
* ``rows[:N]``: the rows this rank received, in the transport's receive order (a2a: expert-major,
  the window's tiles; symm / collectives: source-major, each source's rows by local expert), in
  x's dtype.  Rows past N are never written.
* ``meta``: [0] 1 when kept; [1] N; [2 : 3 + ne] the experts' row bounds in ``rows`` (a2a only);
  [3 + ne :] the receive splits, ne * R of them (a2a: ``out_splits_offsets[0]``, index e*R + s;
  symm / collectives: rows from (source s, local expert e) at s*ne + e).  The backward checks its
  own layout against them: a row never meets another row's x.
* Agreement: a backward's row width must be the same on every rank.  "a2a" decides it in the
  forward, from every rank's header (each rank's N and T are in them): kept on every rank or on
  none.  symm / collectives decide it in the backward's counts exchange (each rank adds its
  flag to its counts).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

FIXED = 2  # flag, N


def capacity(T: int, K: int, R: int, ne: int, max_tokens: int) -> int:
    """CAP: rows the kept buffer holds (see the module docstring)."""
    return max_tokens if max_tokens > 0 else R * T * min(K, ne)


def meta_len(R: int, ne: int) -> int:
    return FIXED + (ne + 1) + ne * R


def buffers(x: torch.Tensor, topk_ids: torch.Tensor, R: int, ne: int, max_tokens: int):
    """(rows [CAP, H] in x's dtype on x's device, unwritten; meta [M] int64 on the CPU (read and
    written as host numbers, also beside CUDA rows), zero: nothing kept) — the same shapes in the op
    and in its fake kernel."""
    cap = capacity(x.shape[0], topk_ids.shape[1], R, ne, max_tokens)
    return x.new_empty(cap, x.shape[1]), torch.zeros(meta_len(R, ne), dtype=torch.int64)


@dataclasses.dataclass(frozen=True)
class Buffers:
    """The training op's kept outputs while its forward fills them."""

    rows: torch.Tensor  # [CAP, H]
    meta: torch.Tensor  # [M] int64
    ne: int
    top_k: int
    max_tokens: int

    @property
    def cap(self) -> int:
        return self.rows.shape[0]

    def fits_everywhere(self, received: np.ndarray, tokens: np.ndarray) -> bool:
        """Whether every rank's buffer holds what it received: ``received`` [R] rows and ``tokens``
        [R] T of every rank (from the headers every rank holds: the same verdict on all)."""
        R = received.shape[0]
        caps = [capacity(int(t), self.top_k, R, self.ne, self.max_tokens) for t in tokens]
        return bool((received <= np.asarray(caps)).all())

    def record(self, n: int, splits, bounds=None) -> None:
        """Mark rows[:n] kept, with the layout they came in."""
        m = self.meta.numpy()  # this host's memory: no torch scalar read
        m[0], m[1] = 1, n
        if bounds is not None:
            m[FIXED : FIXED + self.ne + 1] = bounds
        m[FIXED + self.ne + 1 :] = np.asarray(splits, dtype=np.int64).reshape(-1)


@dataclasses.dataclass(frozen=True)
class KeptRows:
    """What the backward reads back: the forward's received rows and their layout."""

    rows: torch.Tensor  # [N, H] x's dtype
    bounds: list  # ne + 1 host ints (a2a)
    splits: np.ndarray  # [ne * R]

    @staticmethod
    def from_tensors(rows: torch.Tensor | None, meta: torch.Tensor | None, ne: int) -> "KeptRows | None":
        """None when the forward kept nothing (or the caller passed no buffers)."""
        if rows is None or meta is None or meta.numel() == 0:
            return None
        m = meta.numpy()
        if m[0] != 1:
            return None
        n = int(m[1])
        return KeptRows(rows[:n], m[FIXED : FIXED + ne + 1].tolist(), m[FIXED + ne + 1 :].copy())


def backward_rows(dy: torch.Tensor, kept: KeptRows | None, x: torch.Tensor, every_rank_kept: bool,
                  recv_counts, me: int) -> tuple[torch.Tensor, KeptRows | None]:
    """(rows a symm / collectives backward sends, the kept rows it reads x from or None): dy [T, H]
    alone when every rank's forward kept its received rows (``every_rank_kept``: the flags beside
    the counts; this rank's layout checked), else [x | dy] [T, 2H] and nothing kept."""
    if not every_rank_kept:
        return torch.cat([x.to(dy.dtype), dy], dim=1), None
    check_layout(kept, recv_counts, me)
    return dy, kept


def check_layout(kept: KeptRows, recv_counts, me: int) -> None:
    """The backward receives its rows in the forward's layout (the same routing): else a row
    would meet another row's x.  ``recv_counts``: [R_src][El] rows from (source, local expert)."""
    got = np.asarray(recv_counts, dtype=np.int64).reshape(-1)
    if kept.rows.shape[0] != got.sum() or not np.array_equal(kept.splits, got):
        raise RuntimeError(f"fused_moe_ep backward: the rows arrive in another layout than the forward's "
                           f"(rank {me}; {got.tolist()} vs {kept.splits.tolist()})")


__all__ = ["Buffers", "KeptRows", "backward_rows", "buffers", "capacity", "check_layout", "meta_len"]
