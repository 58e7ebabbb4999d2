"""Triton copy kernel of the CUDA 2D all-to-all without NVSHMEM: every block pulled from a peer's
symmetric buffer (``rendezvous(...).buffer_ptrs``) into this rank's ``out``.

Shapes:  B blocks, C elements per row; block b is ``n[b]`` rows starting at row ``src_row[b]`` of
         rank ``src_rank[b]``'s buffer, landing at row ``dst_row[b]`` of ``out`` [M, C].

The block table comes from ``a2a_layout`` on the device, so the launch needs no host read: the
grid is (B, column tiles) and each program loops over its block's rows, the trip count loaded
from ``n``.  Runs under ``TRITON_INTERPRET=1`` on CPU tensors (their ``data_ptr`` as the peers'
addresses), which is how it is tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16
BLOCK_C = 256


@triton.jit
def _pull_blocks(ptrs, n_ptr, src_rank_ptr, src_row_ptr, dst_row_ptr, out_ptr, row_elems, out_rows,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < row_elems
    n = tl.load(n_ptr + b)
    src = tl.load(ptrs + tl.load(src_rank_ptr + b)).to(tl.pointer_type(out_ptr.dtype.element_ty))
    r_src = tl.load(src_row_ptr + b)
    r_dst = tl.load(dst_row_ptr + b)
    for i in range(0, n, BLOCK_R):
        rows = i + tl.arange(0, BLOCK_R)
        m = ((rows < n) & (r_dst + rows < out_rows))[:, None] & cmask[None, :]  # never past out
        v = tl.load(src + (r_src + rows)[:, None] * row_elems + cols[None, :], mask=m)
        tl.store(out_ptr + (r_dst + rows)[:, None] * row_elems + cols[None, :], v, mask=m)


def pull_blocks(ptrs: torch.Tensor, n, src_rank, src_row, dst_row, out: torch.Tensor) -> None:
    """Copy every block of the table into ``out`` (rows no block covers are left as they are; rows
    past ``out``'s end are dropped, since a host check would be a device sync).
    ``ptrs`` [R] int64: each rank's buffer address (rows of the same width and dtype as ``out``)."""
    blocks = n.numel()
    row_elems = out[0].numel() if out.shape[0] else 1
    if blocks == 0 or out.numel() == 0:
        return
    grid = (blocks, triton.cdiv(row_elems, BLOCK_C))
    _pull_blocks[grid](ptrs, n, src_rank, src_row, dst_row, out, row_elems, out.shape[0],
                       BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)


__all__ = ["pull_blocks"]
