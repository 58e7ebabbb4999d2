"""CPU kernels of the expert-parallel op: the local experts on received rows, and the row moves of
the 2D all-to-all (``ep_copy.c``).

Shapes:  H hidden, F expert FFN width, El local experts, n received rows of one chunk, src-major
         and sorted by local expert inside each source block; ``counts [r, El]`` gives the blocks.

Reuses the single-device kernels: ``kernels/cpu.fused_moe_cpu`` with K = 1 (its result copied into
``out``, which on the heap transport is a view of the source rank's return window) and ``kernels/cpu_backward.fused_moe_backward_cpu`` (with K = 1 and
the local expert ids of the rows).

``Send`` / ``Wait`` / ``Gather`` (the slab transport of ``ep/a2a_cpu``) and ``push`` / ``poll`` /
``unpack`` are ``ep_copy.c``'s functions (one C call per exchange step, whatever the number of
blocks); without a C compiler or AVX2 (or ``MOE_COMPILE_EP_COPY=0``)
they run as a loop of ``ctypes.memmove`` per block — the same bytes, slower.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu import cc as cpu_cc
from moe_compile.kernels.cpu.forward import fused_moe_cpu
from moe_compile.kernels.cpu.backward import ROLES, Needs, fused_moe_backward_cpu

COPY_ENV = "MOE_COMPILE_EP_COPY"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_COPY = cpu_cc.Kernel(
    "ep_copy", COPY_ENV,
    {"moe_ep_push": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64],
     "moe_ep_poll": ([_PTR, _PTR, _I64, _I64, _I64], _I64),
     "moe_ep_unpack": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64],
     "moe_ep_send": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64],
     "moe_ep_wait": ([_PTR, _PTR, _I64, _I64, _I64, _I64], _I64),
     "moe_ep_gather": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64],
     "moe_ep_dispatch_send": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64], _I64),
     "moe_ep_dispatch_recv": ([_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR], _I64),
     "moe_ep_combine_after": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64],
     "moe_ep_dispatch_send_idx": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR,
                                   _I64, _I64, _I64], _I64),
     "moe_ep_dispatch_index": ([_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR,
                                _PTR, _PTR], _I64),
     "moe_ep_combine_sum": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR],
     "moe_ep_expert_rows": ([_PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR,
                             _PTR], _I64),
     "moe_ep_gather_rows": [_PTR, _I64, _I64, _PTR, _PTR, _PTR]},
    "the exchange copies block by block from Python")


def fast_lib():
    """``ep_copy.c`` loaded (its ``moe_ep_dispatch_send`` / ``_recv`` / ``moe_ep_combine_after``: the
    window exchanges whole in C; ``moe_ep_dispatch_send_idx`` / ``_index`` / ``moe_ep_combine_sum``:
    the fused op's rows sent by token index and read in place; ``moe_ep_expert_rows``: the packed
    experts' rows by address, FC2 into the sources' return windows), or None (then ``ep/a2a_cpu`` takes
    its numpy path and the fused op its copying one)."""
    return _COPY.lib()


def copy_kernel_reason() -> str | None:
    """Why ``ep_copy.c`` is not in use (None when it is)."""
    return _COPY.error()


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def push(src_ptr: int, dst_ptrs, row_bytes: int, nblk, src_row, dst_row, rows, flag_ptrs, value: int) -> None:
    """For each destination j: its ``nblk[j]`` blocks (next entries of the three block arrays) from
    ``src_ptr`` into ``dst_ptrs[j]``, then the int64 at ``flag_ptrs[j]`` = ``value`` (release).
    Arrays: numpy (int64 / uint64 for the addresses; the hot path passes them ready-made)."""
    dst, flags = np.asarray(dst_ptrs, dtype=np.uint64), np.asarray(flag_ptrs, dtype=np.uint64)
    nblk, src_row, dst_row, rows = _i64(nblk), _i64(src_row), _i64(dst_row), _i64(rows)
    lib = _COPY.lib()
    if lib is not None:
        lib.moe_ep_push(src_ptr, dst.ctypes.data, row_bytes, dst.size, nblk.ctypes.data, src_row.ctypes.data,
                        dst_row.ctypes.data, rows.ctypes.data, flags.ctypes.data, value)
        return
    at = 0
    for j in range(dst.size):
        for i in range(at, at + int(nblk[j])):
            if rows[i] > 0:
                ctypes.memmove(int(dst[j]) + int(dst_row[i]) * row_bytes, src_ptr + int(src_row[i]) * row_bytes,
                               int(rows[i]) * row_bytes)
        at += int(nblk[j])
        ctypes.c_int64.from_address(int(flags[j])).value = value  # x86: stores land in program order


def poll(flags: np.ndarray, slots: np.ndarray, value: int, spins: int) -> int:
    """How many of ``flags[slots]`` are still below ``value`` after up to ``spins`` polls."""
    lib = _COPY.lib()
    if lib is not None:
        return int(lib.moe_ep_poll(flags.ctypes.data, slots.ctypes.data, slots.size, value, spins))
    return int((flags[slots] < value).sum())


def unpack(src_ptr: int, out: torch.Tensor, row_bytes: int, off, rows) -> None:
    """``out`` [M, ...] rows of each block [off, off + rows) copied from ``src_ptr`` at the same
    rows; every row no block covers zeroed."""
    off, rows = _i64(off), _i64(rows)
    total = out.shape[0]
    lib = _COPY.lib()
    if lib is not None:
        if total:
            lib.moe_ep_unpack(src_ptr, out.data_ptr(), row_bytes, off.size, off.ctypes.data, rows.ctypes.data, total)
        return
    out.zero_()
    for o, n in zip(off.tolist(), rows.tolist()):
        if n > 0:
            ctypes.memmove(out.data_ptr() + o * row_bytes, src_ptr + o * row_bytes, n * row_bytes)


class Push:
    """The argument arrays of one ``push`` of ``ndst`` destinations and ``nblk`` blocks, made once
    with their addresses (numpy's ``.ctypes`` costs microseconds a call): the caller fills them in
    place and calls; the hot path is one C call with no conversion."""

    def __init__(self, ndst: int, nblk: int):
        self.dst, self.flags = np.zeros(ndst, dtype=np.uint64), np.zeros(ndst, dtype=np.uint64)
        self.nblk = np.zeros(ndst, dtype=np.int64)
        self.blk = np.zeros((3, nblk), dtype=np.int64)  # src_row, dst_row, rows
        self._at = [a.ctypes.data for a in (self.dst, self.nblk, self.blk[0], self.blk[1], self.blk[2], self.flags)]

    def __call__(self, src_ptr: int, row_bytes: int, value: int) -> None:
        lib = _COPY.lib()
        if lib is None:
            push(src_ptr, self.dst, row_bytes, self.nblk, self.blk[0], self.blk[1], self.blk[2], self.flags, value)
            return
        d, n, sr, dr, r, f = self._at
        lib.moe_ep_push(src_ptr, d, row_bytes, self.dst.size, n, sr, dr, r, f, value)


class Poll:
    """``poll`` of fixed ``slots`` of one flag array, addresses taken once."""

    def __init__(self, flags: np.ndarray, slots: np.ndarray):
        self.flags, self.slots = flags, np.ascontiguousarray(slots, dtype=np.int64)
        self._at = (self.flags.ctypes.data, self.slots.ctypes.data)

    def __call__(self, value: int, spins: int) -> int:
        lib = _COPY.lib()
        if lib is None:
            return poll(self.flags, self.slots, value, spins)
        return int(lib.moe_ep_poll(self._at[0], self._at[1], self.slots.size, value, spins))


class Unpack:
    """``unpack`` of ``n`` blocks: the caller fills ``off`` / ``rows`` in place."""

    def __init__(self, n: int):
        self.off, self.rows = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        self._at = (self.off.ctypes.data, self.rows.ctypes.data)

    def __call__(self, src_ptr: int, out: torch.Tensor, row_bytes: int) -> None:
        lib = _COPY.lib()
        if lib is None or out.shape[0] == 0:
            unpack(src_ptr, out, row_bytes, self.off, self.rows)
            return
        lib.moe_ep_unpack(src_ptr, out.data_ptr(), row_bytes, self.off.size, self._at[0], self._at[1], out.shape[0])


class Send:
    """One source's exchange step to ``ndst`` destinations (``moe_ep_send``): per destination a
    header copy and its blocks, then every flag.  Arrays made once with their addresses; the caller
    fills ``dst`` / ``hdr_dst`` / ``flags`` / ``nblk`` / ``blk`` (src_row, dst_row, rows) in place."""

    def __init__(self, ndst: int, nblk: int, sleep_off: int = 0):
        self.sleep_off = sleep_off  # int64s from each flag to its waiter's "sleeping" word (0: none)
        self.dst, self.hdr_dst = np.zeros(ndst, dtype=np.uint64), np.zeros(ndst, dtype=np.uint64)
        self.flags = np.zeros(ndst, dtype=np.uint64)
        self.nblk = np.zeros(ndst, dtype=np.int64)
        self.blk = np.zeros((3, nblk), dtype=np.int64)
        self._at = [a.ctypes.data for a in (self.dst, self.nblk, self.blk[0], self.blk[1], self.blk[2],
                                            self.hdr_dst, self.flags)]

    def __call__(self, src_ptr: int, row_bytes: int, hdr_ptr: int, hdr_bytes: int, value: int) -> None:
        lib = _COPY.lib()
        if lib is not None:
            d, n, sr, dr, r, h, f = self._at
            lib.moe_ep_send(src_ptr, d, row_bytes, self.dst.size, n, sr, dr, r, hdr_ptr, hdr_bytes, h, f, value,
                            self.sleep_off)
            return
        at = 0
        for j in range(self.dst.size):
            if hdr_bytes:
                ctypes.memmove(int(self.hdr_dst[j]), hdr_ptr, hdr_bytes)
            for i in range(at, at + int(self.nblk[j])):
                n = int(self.blk[2, i])
                if n > 0:
                    ctypes.memmove(int(self.dst[j]) + int(self.blk[1, i]) * row_bytes,
                                   src_ptr + int(self.blk[0, i]) * row_bytes, n * row_bytes)
            at += int(self.nblk[j])
        for j in range(self.dst.size):  # x86: stores land in program order
            ctypes.c_int64.from_address(int(self.flags[j])).value = value


class Wait:
    """``moe_ep_wait`` on fixed ``slots`` of one flag array until every flag reaches ``value`` or
    ``timeout_s``: spin, then sleep in a futex that the sender wakes (with ``sleep_off``, the
    distance to the "sleeping" words; else yield, then nap); returns how many are still below."""

    def __init__(self, flags: np.ndarray, slots: np.ndarray, sleep_off: int = 0):
        self.flags, self.slots = flags, np.ascontiguousarray(slots, dtype=np.int64)
        self.sleep_off = sleep_off
        self._at = (self.flags.ctypes.data, self.slots.ctypes.data)

    def __call__(self, value: int, timeout_s: float) -> int:
        lib = _COPY.lib()
        if lib is not None:
            return int(lib.moe_ep_wait(self._at[0], self._at[1], self.slots.size, value, int(timeout_s * 1e9),
                                       self.sleep_off))
        import time

        from moe_compile.symm.cpu_shm import backoff

        deadline, spins = time.monotonic() + timeout_s, 0
        while (pending := int((self.flags[self.slots] < value).sum())) and time.monotonic() < deadline:
            spins += 1
            backoff(spins)
        return pending


class Gather:
    """``moe_ep_gather`` of up to ``n`` blocks into ``out`` rows [0, total), rows no block covers
    zeroed: the caller fills ``src_at`` (each block's source address), ``dst_row``, ``rows`` in place."""

    def __init__(self, n: int):
        self.src_at = np.zeros(n, dtype=np.uint64)
        self.dst_row, self.rows = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        self._at = tuple(a.ctypes.data for a in (self.src_at, self.dst_row, self.rows))

    def __call__(self, out: torch.Tensor, row_bytes: int) -> None:
        total = out.shape[0]
        if total == 0:
            return
        lib = _COPY.lib()
        if lib is not None:
            lib.moe_ep_gather(out.data_ptr(), row_bytes, self.rows.size, *self._at, total)
            return
        out.zero_()
        for sa, dr, n in zip(self.src_at.tolist(), self.dst_row.tolist(), self.rows.tolist()):
            if n > 0:
                ctypes.memmove(out.data_ptr() + dr * row_bytes, sa, n * row_bytes)


def _local_ids(counts, n_rows: int, device) -> torch.Tensor:
    """[n, 1] local expert of each received row, from counts [R, El] (src-major blocks)."""
    el = len(counts[0]) if len(counts) else 0
    return torch.repeat_interleave(
        torch.arange(el, dtype=torch.long, device=device).repeat(len(counts)),
        torch.as_tensor(counts, dtype=torch.long, device=device).reshape(-1),
    )[:n_rows, None]


def experts_on_rows(rows, g, counts, w: ExpertWeights, attrs: FFNAttrs, out) -> None:
    """rows [n, H] (x dtype), g [n] fp32, counts [r, El] host list/tensor -> out [n, H] (weighted).

    The rows come src-major, so one expert's rows lie in r blocks; the single-device path with
    K = 1 regroups them by expert (one sort) so that each expert runs one GEMM on all its rows,
    and picks the decode / packed / grouped GEMM / chunked path like any other call."""
    n = int(torch.as_tensor(counts).sum()) if len(counts) else 0
    if n == 0:
        return
    ids = _local_ids(counts, n, rows.device)  # [n, 1]
    out[:n].copy_(fused_moe_cpu(rows[:n], ids, g[:n, None].to(rows.dtype), w, attrs))


def experts_backward_on_rows(x_rows, dy_rows, g, counts, w: ExpertWeights, attrs: FFNAttrs, need_roles: dict):
    """Backward of the local experts on all received rows at once.

    x_rows, dy_rows [n, H], g [n] fp32, counts [R, El] -> (dx rows [n, H], dg [n], {role: grads}).
    The weight gradients sum over every received row: they are this rank's experts' gradients.
    """
    ids = _local_ids(counts, x_rows.shape[0], x_rows.device)  # [n, 1]
    gw = g.to(x_rows.dtype)[:, None]  # [n, 1]
    dx, dg, roles = fused_moe_backward_cpu(dy_rows, x_rows, ids, gw, w, attrs, Needs(True, True, need_roles))
    return dx, dg.reshape(-1), roles


__all__ = ["experts_on_rows", "experts_backward_on_rows", "push", "poll", "unpack", "Push", "Poll", "Unpack",
           "Send", "Wait", "Gather", "fast_lib",
           "copy_kernel_reason", "ROLES"]
