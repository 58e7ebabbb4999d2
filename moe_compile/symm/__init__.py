"""Symmetric heap: same-sized buffers on every rank of a group that peers address directly.

One interface, two backends:

* ``cpu_shm.CpuShmHeap`` — POSIX shared memory (``/dev/shm`` files, ``mmap``) among the ranks of one
  host; names are exchanged through the process group's store; flags are int64 words that the
  waiting rank polls (x86 stores are seen in program order, so "write rows, then write the flag"
  publishes the rows).
* ``cuda.CudaSymmHeap`` — ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous``,
  ``get_buffer`` for peers, signal pads via ``put_signal`` / ``wait_signal``, ``barrier``).

Interface (``SymmetricHeap``):
    rank, world, nbytes
    tensor(rank, offset, shape, dtype) -> a view of ``rank``'s buffer (own or peer)
    signal(rank, slot, value)          -> set flag ``slot`` in ``rank``'s flag pad to ``value``
    wait(slots, value, timeout_s, who) -> block until own flags[slots] >= value, else TimeoutError
                                          naming ``who(slot)`` — the ranks that never signalled
    ready(slots, value) -> bool array  (non-blocking poll; CPU backend)
    barrier(timeout_s), close()
"""

from __future__ import annotations

from moe_compile.symm.heap import SymmetricHeap


def allocate(store, rank: int, world: int, nbytes: int, nflags: int, tag: str, timeout_s: float,
             device: str = "cpu", group_name: str | None = None) -> SymmetricHeap:
    """Collective: every rank of the group calls it with the same sizes and tag."""
    if device == "cpu":
        from moe_compile.symm.cpu_shm import CpuShmHeap

        return CpuShmHeap(store, rank, world, nbytes, nflags, tag, timeout_s)
    from moe_compile.symm.cuda import CudaSymmHeap

    return CudaSymmHeap(group_name, nbytes, nflags, device)


__all__ = ["SymmetricHeap", "allocate"]
