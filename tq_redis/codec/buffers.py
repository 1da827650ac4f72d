"""A process-wide cache of large, warm byte buffers for data coming *out* of the stores.

Every ``get_data`` of a big batch needs fresh memory for its output tensors. Fresh memory is
expensive: the kernel zero-fills and maps it one 4 KiB page fault at a time, which costs about as
much as copying the data itself. Training loops read batches of the same shapes step after step,
so this cache keeps the memory of batches the caller has dropped and hands it out again (warm, no
faults), the way PyTorch's CUDA caching allocator recycles device memory.

* A buffer goes back to the cache when the last object viewing it (tensor, array, memoryview)
  is garbage-collected; a buffer the caller keeps is simply never reused.
* Buffers are anonymous mappings advised to use transparent huge pages, so even a first use
  faults 2 MiB at a time where the kernel allows it.
* Idle bytes are bounded (``TQ_BUFFER_CACHE``, default 1 GiB; ``0`` turns caching off).
  :func:`trim` releases every idle buffer now.
* A buffer is returned by a finaliser, which may run in any thread or inside the garbage
  collector: it only appends to an existing free list, under a re-entrant lock of its own, so
  it can never deadlock with, or resize the table under, a ``take`` in progress.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref

import numpy as np

from tq_redis.settings import settings

__all__ = ["BufferCache", "cache", "take", "trim"]

#: buffers smaller than this come from the normal allocator (malloc keeps small blocks warm)
MIN_BYTES = 1 << 20
#: sizes are rounded up to this granule (a transparent huge page), so near-equal batches share
GRANULE = 2 << 20
#: a cached buffer up to this factor larger than the request may serve it
SLACK = 1.25


def _fresh(size: int) -> mmap.mmap:
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # THP disabled or unsupported here: 4 KiB pages it is
            pass
    return region


class BufferCache:
    """Recycles large byte buffers once the caller lets go of them.

    Args:
        limit: most idle bytes kept for reuse; 0 disables caching (every take is fresh).
    """

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        # One free list per size class. Classes are only added by take() under the lock; the
        # finaliser that returns a buffer only appends to an existing list, so it never changes
        # the dict while another thread (or the collector, mid-take) iterates over the classes.
        self._free: dict[int, list[mmap.mmap]] = {}
        self._sizes: tuple[int, ...] = ()  # the classes, sorted; replaced whole, read lock-free
        self._lock = threading.Lock()
        # Re-entrant: the collector may run another buffer's finaliser inside this one.
        self._give_lock = threading.RLock()

    @property
    def idle(self) -> int:
        """Bytes of the buffers waiting in the cache (each free list holds one size class)."""
        return sum(size * len(self._free[size]) for size in self._sizes)

    def take(self, nbytes: int) -> np.ndarray:
        """A writable, uninitialised, page-aligned ``uint8`` array of ``nbytes`` bytes.

        Its memory returns to the cache when the array and every view derived from it (e.g. a
        tensor made with ``torch.from_numpy``) are gone.
        """
        if nbytes < MIN_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        size = -(-nbytes // GRANULE) * GRANULE
        region = self._reuse(size) if self.limit > 0 else None
        if region is None:
            region = _fresh(size)
            with self._lock:
                if size not in self._free:
                    self._free[size] = []
                    self._sizes = tuple(sorted((*self._sizes, size)))
        arr = np.frombuffer(region, dtype=np.uint8, count=nbytes)
        weakref.finalize(arr, self._give, region)
        return arr

    def _reuse(self, size: int) -> mmap.mmap | None:
        for have in self._sizes:
            if have < size or have > size * SLACK:
                continue
            try:
                region = self._free[have].pop()
            except IndexError:  # none idle (or taken by another thread meanwhile)
                continue
            return region
        return None

    def _give(self, region: mmap.mmap) -> None:
        size = len(region)
        # Runs while the dying array still exports the region: it cannot be closed here. A
        # region not kept is unmapped when this last reference to it goes.
        with self._give_lock:  # check and append as one step, or two returns could pass the limit
            if self.idle + size <= self.limit:
                self._free[size].append(region)

    def trim(self) -> int:
        """Release every idle buffer to the operating system; returns the bytes released."""
        released = 0
        for size in self._sizes:
            lst = self._free[size]
            while True:
                try:
                    region = lst.pop()
                except IndexError:
                    break
                released += len(region)
                with contextlib.suppress(BufferError):  # its last array is still being freed
                    region.close()
        return released


cache = BufferCache(settings.buffer_cache)


def take(nbytes: int) -> np.ndarray:
    """:meth:`BufferCache.take` on the process-wide cache."""
    return cache.take(nbytes)


def trim() -> int:
    """Release the process-wide cache's idle buffers; returns the bytes released."""
    return cache.trim()
