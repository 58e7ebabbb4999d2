"""Memory of large stacked weight gradients, recycled from one training step to the next.

Shapes:  W [E, out, in] (or [E, in, out]) a stacked expert weight of one role; its gradient has
         W's shape and dtype.

Why: a stacked role's gradient is one 64-384 MiB block per step.  glibc serves blocks that large
with a fresh ``mmap`` every time (its reuse threshold stops at 32 MiB), so the backward's GEMMs
write into pages the kernel must fault in and zero one by one: ~52 ms per 256 MiB on the 2-core
CI VM against ~10 ms to write memory already mapped (fp32, 2 threads).  Per-expert weights do not
pay this: their 2-16 MiB gradients come back from glibc's heap.  So the cache keeps the memory of
each stacked gradient once the step is done with it and hands it out again the next step, as
torch's CUDA caching allocator does for device memory.

Safety: a buffer is handed out again only when the tensor it last backed has been freed (its
storage expired: ``zero_grad(set_to_none=True)`` or ``p.grad = None`` dropped it).  A gradient
still alive anywhere -- kept in ``.grad`` for accumulation, saved by the user -- is never written
over; the step gets the entry's second buffer, or a plain fresh tensor when both are in use.

Memory: at most ``SLOTS`` buffers per stacked weight, each the size of the gradient the step
returns; an entry goes when its weight is freed (noticed at the next ``take``).  ``clear()`` gives
everything back; ``MOE_COMPILE_GRAD_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from moe_compile.kernels.cpu import memory as cpu_memory

ENV = "MOE_COMPILE_GRAD_CACHE"
# Two: with gradient accumulation (``zero_grad(set_to_none=False)``) the first buffer stays in
# ``.grad`` for good and each later step's gradient, added into it and dropped, uses the second.
SLOTS = 2


@dataclasses.dataclass
class _Slot:
    memory: mmap.mmap
    handed: StorageWeakRef | None = None  # the storage of the tensor last made over ``memory``

    def free(self) -> bool:
        return self.handed is None or self.handed.expired()

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.frombuffer(self.memory, dtype=dtype, count=math.prod(shape)).view(shape)
        self.handed = StorageWeakRef(t.untyped_storage())
        return t


@dataclasses.dataclass
class _Entry:
    weight: StorageWeakRef  # the stacked weight the gradients are for
    slots: list = dataclasses.field(default_factory=list)


class GradCache:
    """Buffers for the gradients of stacked CPU weights of at least ``min_bytes``."""

    def __init__(self, min_bytes: int = cpu_memory.MIN_BYTES):
        self.min_bytes = min_bytes
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.Lock()

    def enabled_for(self, weight: torch.Tensor) -> bool:
        return (os.environ.get(ENV, "1") != "0" and weight.device.type == "cpu"
                and weight.nbytes >= max(self.min_bytes, 1))

    def take(self, weight: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of ``weight``'s shape and dtype for its gradient: recycled
        memory when there is some free, else fresh (and kept for the next step when there is room)."""
        kept = self._from_free_slot(weight) if self.enabled_for(weight) else None
        return kept if kept is not None else torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)

    def _from_free_slot(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The gradient over a slot of weight's entry that no gradient uses (a new slot while there
        is room), or None.  Made under the lock: a slot is marked taken before another thread looks."""
        key = (weight.data_ptr(), tuple(weight.shape), weight.dtype)
        with self._lock:
            self._drop_dead_weights()
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(StorageWeakRef(weight.untyped_storage()))
            slot = next((s for s in entry.slots if s.free()), None)
            if slot is None and len(entry.slots) < SLOTS:
                slot = _Slot(mmap.mmap(-1, weight.nbytes))
                entry.slots.append(slot)
            return slot.tensor(tuple(weight.shape), weight.dtype) if slot is not None else None

    def _drop_dead_weights(self) -> None:
        """Forget entries whose weight was freed (their buffers go once no gradient uses them)."""
        for key in [k for k, e in self._entries.items() if e.weight.expired()]:
            del self._entries[key]

    def held_bytes(self) -> int:
        """Bytes of memory the cache keeps (handed out or free)."""
        with self._lock:
            return sum(len(s.memory) for e in self._entries.values() for s in e.slots)

    def clear(self) -> None:
        """Give every buffer back; gradients still alive keep theirs until they are freed."""
        with self._lock:
            self._entries.clear()


GRADIENTS = GradCache()


def clear() -> None:
    """Give back the memory kept for stacked weight gradients (``GRADIENTS``)."""
    GRADIENTS.clear()


def held_bytes() -> int:
    return GRADIENTS.held_bytes()
