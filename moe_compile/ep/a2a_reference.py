"""Pure-torch model of ``ep_dispatch`` / ``ep_combine`` (torch's ``all_to_all_vdev_2d`` contract).

Shapes:  R ranks, ne experts per rank, H row width (any trailing shape), N_r rows of rank r's input,
         M rows of every rank's ``out``.

It sees every rank's tensors at once (lists indexed by rank) and moves the rows with plain slicing,
one block at a time — slow and obviously right; the transports are tested bit-identical to it.
The layout is ``a2a_layout``'s; rows no block covers are zero.
"""

from __future__ import annotations

import torch

from moe_compile.ep.a2a_layout import combine_layout, dispatch_layout, dispatch_rows_needed, exclusive_cumsum


def _rows_per_rank(out_rows, R: int) -> list:
    return list(out_rows) if isinstance(out_rows, (list, tuple)) else [int(out_rows)] * R


def _check_fits(need, out_rows: list, what: str) -> None:
    for d, n in enumerate(need.tolist()):
        if n > out_rows[d]:
            raise ValueError(f"{what}: rank {d} needs {n} rows of out, out has {out_rows[d]}")


def dispatch_reference(inputs: list, in_splits: list, ne: int, out_rows, major_align: int | None = None):
    """inputs[s] [N_s, *H], in_splits[s] [R*ne] -> [(out [M_d, *H], out_splits_offsets [2, ne*R])] per dest d
    (``out_rows``: M for every rank, or [M_d] by rank)."""
    R = len(inputs)
    out_rows = _rows_per_rank(out_rows, R)
    splits = torch.stack([s.long().cpu() for s in in_splits])  # [R_src, R*ne]
    _check_fits(dispatch_rows_needed(splits, ne, major_align), out_rows, "ep_dispatch")
    src_off = exclusive_cumsum(splits, 1)  # [R_src, R*ne]
    out_splits, out_offs = dispatch_layout(splits, ne, major_align)
    results = []
    for d in range(R):
        out = inputs[0].new_zeros((out_rows[d], *inputs[0].shape[1:]))
        for e in range(ne):
            for s in range(R):
                n, a = int(splits[s, d * ne + e]), int(src_off[s, d * ne + e])
                o = int(out_offs[d, e * R + s])
                out[o : o + n] = inputs[s][a : a + n]
        results.append((out, torch.stack([out_splits[d], out_offs[d]])))
    return results


def combine_reference(inputs: list, in_splits_offsets: list, ne: int, out_rows):
    """inputs[p] [N_p, *H], in_splits_offsets[p] [2, ne*R] -> [(out [M_d, *H], out_splits_offsets [2, R*ne])]."""
    R = len(inputs)
    out_rows = _rows_per_rank(out_rows, R)
    so = torch.stack([t.long().cpu() for t in in_splits_offsets])  # [R_src, 2, ne*R]
    out_splits, out_offs, src_offs = combine_layout(so, ne)
    _check_fits(out_splits.sum(1), out_rows, "ep_combine")
    results = []
    for d in range(R):
        out = inputs[0].new_zeros((out_rows[d], *inputs[0].shape[1:]))
        for p in range(R):
            for e in range(ne):
                i = p * ne + e
                n, a, o = int(out_splits[d, i]), int(src_offs[d, i]), int(out_offs[d, i])
                out[o : o + n] = inputs[p][a : a + n]
        results.append((out, torch.stack([out_splits[d], out_offs[d]])))
    return results


__all__ = ["combine_reference", "dispatch_reference"]
