"""CUDA transport of ``ep_dispatch`` / ``ep_combine`` — UNVERIFIED: written on a machine without a
GPU; its layout table and copy kernel are tested on CPU (``TRITON_INTERPRET=1``), the rest only
when a device is lent (``benchmarks/ep_gpu_check.py``).

Shapes:  R ranks, ne experts per rank, N input rows, M = ``out_rows``, C elements per row,
         P payload words (R*ne splits, or 2*ne*R splits + offsets), B = R*ne blocks.

Two forms behind the same contract, neither reading anything on the host:
  * NVSHMEM (``symm_mem.is_nvshmem_available()``), dispatch and combine: the rows, splits and
    offsets are staged in symmetric buffers and ``torch.ops.symm_mem.all_to_all_vdev_2d`` /
    ``all_to_all_vdev_2d_offset`` move them (``out`` zeroed first: uncovered rows are zero, as on CPU);
  * otherwise (and for ``combine_t``, which torch has no op for): ``rendezvous(...)`` buffers — each
    rank writes its payload into row ``me`` of every peer's payload buffer and its rows into its own
    row buffer, one device barrier, then ``pull_table`` (``a2a_layout`` in torch ops on the device)
    gives the B blocks this rank pulls and ``a2a_triton.pull_blocks`` copies them from the peers'
    buffers; a second barrier keeps a fast rank from overwriting its buffer while a peer still reads.

Static shapes: the symmetric buffers are sized max(N, M) rows and allocated collectively, so every
rank must call with the same N and M (a MoE layer pads its dispatch input to T_max*K rows; the
splits say which rows count).  Without a host read a too-small ``out`` cannot raise here: the
kernel drops rows past ``out`` (the CPU transport raises).
"""

from __future__ import annotations

import math
import os

import torch

from moe_compile.ep.a2a_layout import combine_layout, dispatch_layout, exclusive_cumsum

TIMEOUT_MS = 60_000
NVSHMEM_ENV = "MOE_COMPILE_EP_NVSHMEM"  # =0: the rendezvous + Triton form even where NVSHMEM is


def pull_table(kind: str, pay: torch.Tensor, me: int, R: int, ne: int, major_align=None):
    """pay [R, P] every rank's payload -> the blocks rank ``me`` pulls, (n, src_rank, src_row,
    dst_row) [B] int64, and its out_splits_offsets [2, R*ne] (None for ``combine_t``)."""
    ranks = torch.arange(R, device=pay.device)
    if kind == "dispatch":
        splits = pay[:, : R * ne]  # [R_src, R*ne]
        o_splits, o_offs = dispatch_layout(splits, ne, major_align)  # [R_dst, ne*R]
        src_off = exclusive_cumsum(splits, 1).reshape(R, R, ne)[:, me, :]  # [R_src, ne]
        table = (o_splits[me], ranks.repeat(ne), src_off.t().reshape(-1), o_offs[me])  # block e*R + s
        return table, torch.stack([o_splits[me], o_offs[me]])
    so = pay[:, : 2 * ne * R].reshape(R, 2, ne * R)  # [R_p, 2, ne*R]
    sp, offs, src = combine_layout(so, ne)  # [R_dst, R*ne]
    if kind == "combine":  # block p*ne + e from rank p
        table = (sp[me], ranks.repeat_interleave(ne), src[me], offs[me])
        return table, torch.stack([sp[me], offs[me]])
    # combine_t: block e*R + d from rank d's forward combine output back to my forward input rows
    table = (so[me, 0], ranks.repeat(ne), offs[:, me * ne : (me + 1) * ne].t().reshape(-1), so[me, 1])
    return table, None


class _Buffers:
    """One (group, dtype, row width, rows) set of symmetric buffers and their handles."""

    def __init__(self, group_name: str, rows: int, row_elems: int, dtype, pay_words: int, device):
        import torch.distributed._symmetric_memory as symm_mem

        self.rows_buf = symm_mem.empty(rows, row_elems, dtype=dtype, device=device)
        self.rows_hdl = symm_mem.rendezvous(self.rows_buf, group_name)
        self.R, self.me = self.rows_hdl.world_size, self.rows_hdl.rank
        self.pay_buf = symm_mem.empty(self.R, pay_words, dtype=torch.int64, device=device)
        self.pay_hdl = symm_mem.rendezvous(self.pay_buf, group_name)
        self.ptrs = torch.tensor(list(self.rows_hdl.buffer_ptrs), dtype=torch.int64, device=device)


_BUFFERS: dict = {}


def _buffers(group_name, rows, row_elems, dtype, pay_words, device) -> _Buffers:
    key = (group_name, rows, row_elems, dtype, pay_words, str(device))
    if key not in _BUFFERS:
        _BUFFERS[key] = _Buffers(group_name, rows, row_elems, dtype, pay_words, device)
    return _BUFFERS[key]


def _nvshmem_ok(kind: str) -> bool:
    if kind == "combine_t" or os.environ.get(NVSHMEM_ENV, "1") == "0":
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem

        return bool(symm_mem.is_nvshmem_available())
    except (ImportError, RuntimeError):
        return False


def exchange(kind: str, input: torch.Tensor, payload: torch.Tensor, group_name: str, out_rows: int,
             major_align=None):
    x = input.contiguous()
    N, C = x.shape[0], math.prod(x.shape[1:])
    if _nvshmem_ok(kind):
        return _exchange_nvshmem(kind, x, payload, group_name, out_rows, major_align)
    P = payload.numel()
    b = _buffers(group_name, max(N, out_rows, 1), C, x.dtype, P, x.device)
    R, me = b.R, b.me
    ne = P // (R if kind == "dispatch" else 2 * R)
    flat = payload.reshape(-1).to(torch.int64)
    for r in range(R):  # my payload into row ``me`` of every peer's payload buffer (P2P stores)
        b.pay_hdl.get_buffer(r, (P,), torch.int64, me * P).copy_(flat)
    b.rows_buf[:N].copy_(x.reshape(N, C))
    b.rows_hdl.barrier(0, TIMEOUT_MS)
    (n, src_rank, src_row, dst_row), oso = pull_table(kind, b.pay_buf, me, R, ne, major_align)
    out = torch.zeros((out_rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    from moe_compile.ep.a2a_triton import pull_blocks

    pull_blocks(b.ptrs, n, src_rank, src_row, dst_row, out.view(out_rows, C))
    b.rows_hdl.barrier(1, TIMEOUT_MS)
    return out, oso


def _exchange_nvshmem(kind, x, payload, group_name, out_rows, major_align):
    import torch.distributed._symmetric_memory as symm_mem

    N, C = x.shape[0], math.prod(x.shape[1:])
    key = ("nvshmem", group_name, kind, N, out_rows, C, x.dtype, payload.shape, str(x.device))
    if key not in _BUFFERS:
        bufs = (symm_mem.empty(max(N, 1), C, dtype=x.dtype, device=x.device),
                symm_mem.empty(max(out_rows, 1), C, dtype=x.dtype, device=x.device),
                symm_mem.empty(*payload.shape, dtype=torch.int64, device=x.device),
                symm_mem.empty(2, payload.numel() // (1 if kind == "dispatch" else 2), dtype=torch.int64,
                               device=x.device))
        for t in bufs:
            symm_mem.rendezvous(t, group_name)
        _BUFFERS[key] = bufs
    inp, out, pay, oso = _BUFFERS[key]
    inp[:N].copy_(x.reshape(N, C))
    out.zero_()
    pay.copy_(payload)
    if kind == "dispatch":
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, pay, oso, group_name, major_align)
    else:
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(inp, out, pay, oso, group_name)
    return out[:out_rows].clone().view(out_rows, *x.shape[1:]), oso.clone()


__all__ = ["exchange", "pull_table"]
