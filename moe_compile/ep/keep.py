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
  unequal T per rank a rank can receive more; then that rank keeps nothing, and (a2a) its
  sources send it x again in a second exchange of the backward while every other rank gets only
  [dy | g] (symm / collectives: no rank keeps, x is sent again to all) — correct, only less cheap.
  Why a rank with T = 0 (or fewer tokens than its peers) cannot keep without ``max_tokens``: CAP
  is an output shape, fixed when the fake kernel runs, and the fake kernel (like the traced
  graph) sees only this rank's T; the peers' T is known only once their headers arrive, inside
  the forward, after the shapes are fixed.  A larger static bound would need either the user's
  ``max_tokens`` (the receive bound, rows per rank: then every rank's CAP covers what it may
  receive, T = 0 included) or a host sync of every rank's T before tracing.  Without either,
  "a2a" decides per rank (above): only the overfull rank's rows carry x again.
* ``rows[:N]``: the rows this rank received, in the transport's receive order (a2a: expert-major,
  the window's tiles; symm / collectives: source-major, each source's rows by local expert), in
  x's dtype.  Rows past N are never written.
* ``meta``: [0] 1 when kept; [1] N; [2 : 3 + ne] the experts' row bounds in ``rows`` (a2a only);
  [3 + ne : 3 + ne + ne * R] the receive splits (a2a: ``out_splits_offsets[0]``, index e*R + s;
  symm / collectives: rows from (source s, local expert e) at s*ne + e); the last R: every rank's
  verdict, 1 where that rank kept (a2a only, written even where this rank did not keep).  The
  backward checks its own layout against them: a row never meets another row's x.
* Agreement: every rank must know which of its destinations kept.  "a2a" decides it in the
  forward, from every rank's header (each rank's N and T are in them): the same verdicts on every
  rank.  symm / collectives decide it in the backward's counts exchange (each rank adds its flag
  to its counts): kept on every rank or on none.
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
    return FIXED + (ne + 1) + ne * R + R


def _ranks(meta_size: int, ne: int) -> int:
    """R from a meta's length (``meta_len`` inverted)."""
    return (meta_size - FIXED - ne - 1) // (ne + 1)


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

    def fits(self, received: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """[R] bool: whether each rank's buffer holds what it received: ``received`` [R] rows and
        ``tokens`` [R] T of every rank (from the headers every rank holds: the same verdicts on all)."""
        R = received.shape[0]
        caps = [capacity(int(t), self.top_k, R, self.ne, self.max_tokens) for t in tokens]
        return received <= np.asarray(caps)

    def record(self, n: int, splits, bounds=None) -> None:
        """Mark rows[:n] kept, with the layout they came in."""
        m = self.meta.numpy()  # this host's memory: no torch scalar read
        m[0], m[1] = 1, n
        if bounds is not None:
            m[FIXED : FIXED + self.ne + 1] = bounds
        splits = np.asarray(splits, dtype=np.int64).reshape(-1)
        m[FIXED + self.ne + 1 : FIXED + self.ne + 1 + splits.size] = splits

    def record_verdicts(self, verdicts: np.ndarray) -> None:
        """Every rank's verdict (a2a): [R] bool, 1 where that rank kept."""
        m = self.meta.numpy()
        m[m.size - verdicts.size :] = verdicts.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class KeptRows:
    """What the backward reads back: the forward's received rows and their layout."""

    rows: torch.Tensor | None  # [N, H] x's dtype; None: this rank kept nothing, another rank did (a2a)
    bounds: list  # ne + 1 host ints (a2a)
    splits: np.ndarray  # [ne * R]
    ranks_kept: np.ndarray | None = None  # [R] bool, every rank's verdict (a2a; None: symm / collectives)

    @staticmethod
    def from_tensors(rows: torch.Tensor | None, meta: torch.Tensor | None, ne: int) -> "KeptRows | None":
        """None when no rank's forward kept anything (or the caller passed no buffers); rows None
        where this rank kept nothing but another rank did (a2a's per-rank verdicts)."""
        if rows is None or meta is None or meta.numel() == 0:
            return None
        m = meta.numpy()
        R = _ranks(m.size, ne)
        verdicts = m[m.size - R :].astype(bool)
        ranks_kept = verdicts.copy() if verdicts.any() else None
        if m[0] != 1:
            return None if ranks_kept is None else KeptRows(None, [], np.zeros(0, np.int64), ranks_kept)
        n = int(m[1])
        return KeptRows(rows[:n], m[FIXED : FIXED + ne + 1].tolist(), m[FIXED + ne + 1 : m.size - R].copy(), ranks_kept)


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
