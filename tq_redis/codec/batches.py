"""Batch containers that let a store see a batch's structure instead of one object per value.

Every store accepts plain lists: ``put`` takes a sequence of values, each a list of buffer
segments, and ``get`` returns a sequence of buffers. For a big dense batch (2048 rows of 32 KiB)
building one Python object per row costs more than moving the bytes. These containers *are*
such sequences, so a store that knows nothing of them works unchanged, but a store or decoder
that recognises them can skip the per-row objects:

* :class:`RowBlock`: ``n`` values that share one header, each followed by one row of a
  contiguous buffer (how the codec encodes a dense tensor field).
* :class:`ValueChain`: several value sequences back to back (a put's fields).
* :class:`ValueTable`: values that are slices of a few large buffers (what the DRAM store's
  ``get`` returns: views into node memory, or into one received payload).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

Buffer = bytes | bytearray | memoryview

__all__ = ["RowBlock", "ValueChain", "ValueTable", "total_bytes"]


class RowBlock(Sequence):
    """``n`` values; value ``i`` is ``header`` followed by row ``start + i`` of ``base``.

    ``base`` is a one-dimensional byte memoryview of at least ``(start + n) * row`` bytes. Items
    are ``[header, row view]`` segment lists, as any store expects.
    """

    __slots__ = ("header", "base", "row", "start", "n")

    def __init__(self, header: bytes, base: memoryview, row: int, n: int, start: int = 0) -> None:
        if len(base) < (start + n) * row:
            raise ValueError(f"RowBlock: {n} rows of {row} bytes from row {start} exceed a {len(base)}-byte buffer")
        self.header, self.base, self.row, self.n, self.start = header, base, row, n, start

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> list[Buffer]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[list[Buffer]]: ...
    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(self.n)
            if step == 1:
                return RowBlock(self.header, self.base, self.row, max(b - a, 0), self.start + a)
            return [self[j] for j in range(a, b, step)]
        j = range(self.n)[i]  # bounds and negative indexes
        at = (self.start + j) * self.row
        return [self.header, self.base[at : at + self.row]]

    def __iter__(self) -> Iterator[list[Buffer]]:
        return map(self.__getitem__, range(self.n))

    @property
    def value_size(self) -> int:
        return len(self.header) + self.row

    @property
    def nbytes(self) -> int:
        return self.n * self.value_size


class ValueChain(Sequence):
    """The values of several sequences back to back, without copying them into one list."""

    __slots__ = ("parts", "_ends")

    def __init__(self, parts: Sequence[Sequence[Any]]) -> None:
        self.parts = tuple(parts)
        self._ends = list(itertools.accumulate(map(len, self.parts)))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(itertools.islice(iter(self), *i.indices(len(self))))
        j = range(len(self))[i]
        k = bisect.bisect_right(self._ends, j)
        return self.parts[k][j - (self._ends[k - 1] if k else 0)]

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain.from_iterable(self.parts)

    @property
    def nbytes(self) -> int:
        return sum(map(total_bytes, self.parts))


class ValueTable(Sequence):
    """Values that are slices of a few large buffers.

    Value ``i`` is ``sources[index[i]][offsets[i] : offsets[i] + lengths[i]]``; items come back as
    memoryviews of their source (read-only when it is). Slicing with step 1 returns a table that
    shares the sources. The table keeps its sources alive, and with them anything their lifetime
    guards (e.g. a DRAM node's pin on shared memory).
    """

    __slots__ = ("sources", "index", "offsets", "lengths")

    def __init__(self, sources: Sequence[memoryview], index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray):
        self.sources = [s if isinstance(s, memoryview) else memoryview(s) for s in sources]
        self.index = np.asarray(index, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if not len(self.index) == len(self.offsets) == len(self.lengths):
            raise ValueError("ValueTable: index, offsets and lengths must have one length")

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step == 1:
                return ValueTable(self.sources, self.index[a:b], self.offsets[a:b], self.lengths[a:b])
            return [self[j] for j in range(a, b, step)]
        j = range(len(self))[i]
        at = int(self.offsets[j])
        return self.sources[int(self.index[j])][at : at + int(self.lengths[j])]

    def __iter__(self) -> Iterator[memoryview]:
        ends = (self.offsets + self.lengths).tolist()
        cuts = map(slice, self.offsets.tolist(), ends)
        return map(memoryview.__getitem__, map(self.sources.__getitem__, self.index.tolist()), cuts)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def total_bytes(values: Sequence[Any]) -> int:
    """Bytes in a batch: of stored values (buffers) or of encoded ones (lists of segments)."""
    nbytes = getattr(values, "nbytes", None)
    if isinstance(nbytes, int) and not isinstance(values, memoryview):
        return nbytes
    if not len(values):
        return 0
    if isinstance(values[0], (list, tuple)):
        return sum(map(len, itertools.chain.from_iterable(values)))
    return sum(memoryview(v).nbytes if not isinstance(v, (bytes, bytearray)) else len(v) for v in values)
