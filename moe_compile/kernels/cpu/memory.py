"""Large CPU buffers of the fused op backed by transparent huge pages.

A fresh allocation of many MiB (glibc serves it with a new ``mmap``) costs one page fault per 4 KiB
page on first touch.  On the 2-core CI VM that is ~0.3 ms per MiB — writing a fresh 128 MiB
[E, 2F, H] weight gradient cost 38 ms more than writing into reused memory (torch 2.13, fp32).
The op's large buffers are fresh every call: the training forward's FC1 output, the sorted token
rows, the chunk workspaces.  Not the weight gradients: they outlive the call, and finding huge
pages for hundreds of MiB every step stalled on memory compaction (cpu_backward._RoleGrad).
``madvise(MADV_HUGEPAGE)`` on the aligned inside of such a buffer, before anything touches it,
lets the kernel fault it in 2 MiB at a time (10 ms instead of 40 ms for 128 MiB on that VM) where
THP is set to ``madvise`` or ``always``; elsewhere (THP ``never``, not Linux, no libc) the advice
is skipped or ignored and the buffer is an ordinary ``torch.empty``.
Small buffers come from glibc's reused heap and are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

MADV_HUGEPAGE = 14  # linux/mman-common.h
HUGE_PAGE = 2 << 20
# glibc raises its mmap threshold up to 32 MiB as mmapped blocks are freed, so smaller buffers are
# soon served from its reused heap; only larger ones are faulted in afresh on every call.  Advising
# those only also keeps the kernel's huge-page compaction stalls (seen as 50-100 ms outliers when
# every buffer >= 8 MiB was advised) to the few allocations where faults cost the most.
MIN_BYTES = 32 << 20


@functools.cache
def _madvise():
    """libc's madvise, or None where there is none to call (looked up on first use)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages on the 2 MiB-aligned inside of t's memory; True when the advice was taken.
    Must run before t is first written (pages already faulted in stay small)."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu" or t.nbytes < MIN_BYTES:
        return False
    start = t.data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + t.nbytes) // HUGE_PAGE * HUGE_PAGE
    return hi > lo and madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` whose pages, when it is large and on CPU, are faulted in as huge pages."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t


class Workspace:
    """Named scratch buffers of one op call, ``rows`` rows each, that every chunk of the call
    carves its temporaries from (``take``).

    Chunks have different row counts, so fresh temporaries would be new glibc heap blocks of new
    sizes each chunk, and glibc keeps every heap page a chunk touched resident until its heap is
    trimmed: over a Mixtral-shaped backward (E=8, T=2048, fp32) the heap held 271 MiB resident
    with 16 MiB of live tensors in it.  Reused buffers touch the same pages every chunk.
    """

    def __init__(self, rows: int, dtype: torch.dtype, device):
        self.rows, self.dtype, self.device = rows, dtype, device
        self._bufs: dict[tuple[str, int], torch.Tensor] = {}

    def take(self, name: str, n: int, width: int) -> torch.Tensor:
        """The first n rows of buffer ``name`` [rows, width] (allocated on first use), uninitialised."""
        if n > self.rows:
            raise ValueError(f"workspace {name!r}: {n} rows asked, built for {self.rows}")
        key = (name, width)
        if key not in self._bufs:
            self._bufs[key] = empty((self.rows, width), self.dtype, self.device)
        return self._bufs[key][:n]
