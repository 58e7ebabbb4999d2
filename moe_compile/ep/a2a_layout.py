"""Where the rows of the 2D all-to-all land: torch's ``all_to_all_vdev_2d`` contract, as arithmetic.

Shapes:  R ranks, ne experts per rank (El), E = R*ne; a "split" is one (rank, expert) block of rows.

Dispatch (``all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group, major_align)``):
  * source s: ``input`` is rank-major — block (d, e) (rows for expert e of rank d) is
    ``in_splits[d*ne + e]`` rows, blocks back to back from row 0 (offsets = exclusive cumsum);
  * dest d: ``out`` is expert-major — expert e's tile holds the blocks of sources 0..R-1 in order;
    each tile's length is rounded up to ``major_align`` and is at least ``major_align`` even when
    empty (torch's NVSHMEM kernel does this for cutlass, which refuses empty groups; with the
    default ``major_align=None`` = 1 an empty expert still takes one row);
  * ``out_splits_offsets [2, ne*R]``: row 0 the received splits at ``e*R + s``, row 1 the offset of
    that block in ``out``.
Combine (``all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group)``):
  * expert rank p: ``input`` is expert-major, ``in_splits_offsets [2, ne*R]``: block (e, d) is
    ``[0][e*R + d]`` rows at row ``[1][e*R + d]`` (any offsets: padding is never sent);
  * dest d: ``out`` is rank-major, block (p, e) at ``p*ne + e``, packed back to back (no alignment);
    ``out_splits_offsets [2, R*ne]`` = its splits and offsets.
So combine(dispatch(x)) puts every row back where it was, and the two are each other's transpose.

Rows of ``out`` that no block covers are zero in this package's ops (torch leaves them as they
were); both the model (``a2a_reference``) and the transports write zeros there.

Everything here is vectorised integer arithmetic on [.., R*ne] arrays (no host read), written for
torch tensors and numpy arrays alike: the CPU transport runs it in numpy on the shared-memory
counts (microseconds, where torch's per-op cost would be tens), the CUDA transport in torch on the
device, the reference in torch.
"""

from __future__ import annotations

import numpy as np
import torch


def _permute(t, dims):
    return t.transpose(dims) if isinstance(t, np.ndarray) else t.permute(*dims)


def _clamp_min(t, a: int):
    return np.maximum(t, a) if isinstance(t, np.ndarray) else t.clamp_min(a)


def aligned_tiles(tile_rows: torch.Tensor, major_align: int | None) -> torch.Tensor:
    """[ne] rows per expert tile -> [ne] tile lengths in ``out`` (torch's rounding, empty tiles kept)."""
    a = 1 if major_align is None else int(major_align)
    if a == 0:  # the combine's "no alignment"
        return tile_rows
    return _clamp_min((tile_rows + a - 1) // a * a, a)


def exclusive_cumsum(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return t.cumsum(dim) - t


def dispatch_layout(splits: torch.Tensor, ne: int, major_align: int | None):
    """splits [R_src, R*ne] (row s = source s's ``in_splits``) -> for every dest d at once:
    out_splits [R_dst, ne*R] and out_offsets [R_dst, ne*R] (index e*R + s), both int64."""
    R = splits.shape[0]
    recv = _permute(splits.reshape(R, R, ne), (1, 2, 0))  # [R_dst, ne, R_src]
    tiles = aligned_tiles(recv.sum(2), major_align)  # [R_dst, ne]
    offs = exclusive_cumsum(tiles, 1)[:, :, None] + exclusive_cumsum(recv, 2)  # [R_dst, ne, R_src]
    return recv.reshape(R, ne * R), offs.reshape(R, ne * R)


def dispatch_rows_needed(splits: torch.Tensor, ne: int, major_align: int | None) -> torch.Tensor:
    """[R_dst] rows of ``out`` each dest's layout spans (the end of its last tile)."""
    R = splits.shape[0]
    recv = _permute(splits.reshape(R, R, ne), (1, 2, 0))
    return aligned_tiles(recv.sum(2), major_align).sum(1)


def combine_layout(splits_offsets: torch.Tensor, ne: int):
    """splits_offsets [R_src, 2, ne*R] (source p's ``in_splits_offsets``) -> for every dest d:
    out_splits [R_dst, R*ne], out_offsets [R_dst, R*ne] (index p*ne + e), and src_offsets
    [R_dst, R*ne] (where block (p, e) starts in p's ``input``)."""
    R = splits_offsets.shape[0]
    sp = _permute(splits_offsets[:, 0].reshape(R, ne, R), (2, 0, 1)).reshape(R, R * ne)  # [R_dst, p*ne+e]
    so = _permute(splits_offsets[:, 1].reshape(R, ne, R), (2, 0, 1)).reshape(R, R * ne)
    return sp, exclusive_cumsum(sp, 1), so


__all__ = ["aligned_tiles", "combine_layout", "dispatch_layout", "dispatch_rows_needed", "exclusive_cumsum"]
