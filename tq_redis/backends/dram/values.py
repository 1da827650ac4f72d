"""The ``dram`` store client's value tables: a put batch as segments, a get's values as they arrive.

:class:`PutValues` reads the values handed to ``put`` (each a sequence of buffer segments, or the
codec's :class:`~tq_redis.codec.batches.RowBlock` of dense rows) into numpy arrays once, so the
client can send any node's share of the batch as a scatter/gather list or copy it into a node's
memory slab in one call, without a Python object per value. :class:`Gathered` collects the values
a ``get`` receives from several nodes into one :class:`~tq_redis.codec.batches.ValueTable`.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_redis.codec import batchscan, buffers, fastcopy
from tq_redis.codec.batches import RowBlock, ValueChain, ValueTable
from tq_redis.errors import InvalidArgument
from tq_redis.storage.base import Buffer, Segments

__all__ = ["Gathered", "PutValues", "private_copy"]

_NOT_CONTIGUOUS = "a value segment is not C-contiguous; pass contiguous buffers (e.g. tensor.contiguous())"


def _as_bytes_view(seg: Any) -> Buffer:
    """A buffer whose ``len`` is its byte length (bytes pass through; others become 'B' views)."""
    if isinstance(seg, (bytes, bytearray)):
        return seg
    mv = seg if isinstance(seg, memoryview) else memoryview(seg)
    if mv.format == "B" and mv.ndim == 1:
        return mv
    try:
        return mv.cast("B")
    except TypeError:
        raise InvalidArgument(_NOT_CONTIGUOUS) from None


_NBYTES = operator.attrgetter("nbytes")
_CONTIGUOUS = operator.attrgetter("c_contiguous")


class PutValues:
    """A put batch as a segment table, plus per-value numpy bookkeeping.

    Segment ``j`` is ``seg_len[j]`` bytes of ``bufs[seg_buf[j]]`` from byte ``seg_src[j]``; value
    ``v`` is segments ``first[v] .. first[v] + nseg[v]``. A :class:`RowBlock` (the codec's dense
    fields) becomes two buffers and arithmetic, with no per-row Python objects at all.
    """

    __slots__ = ("bufs", "seg_buf", "seg_src", "seg_len", "seg_whole", "first", "nseg", "sizes", "seg_off", "_views")

    def __init__(self, values: Sequence[Segments]) -> None:
        parts = values.parts if isinstance(values, ValueChain) else (values,)
        self.bufs: list[Buffer] = []
        cols: list[tuple[np.ndarray, ...]] = []
        for part in parts:
            if isinstance(part, RowBlock):
                cols.append(self._block(part))
            elif len(part):
                cols.append(self._listed(part))
        if cols:
            self.seg_buf, self.seg_src, self.seg_len, self.nseg, self.seg_whole = map(np.concatenate, zip(*cols))
        else:
            self.seg_buf, self.seg_src, self.seg_len, self.nseg = (np.empty(0, np.int64) for _ in range(4))
            self.seg_whole = np.empty(0, bool)
        ends = np.cumsum(self.nseg)
        self.first = ends - self.nseg
        cum = np.concatenate(([0], np.cumsum(self.seg_len)))
        self.sizes = cum[ends] - cum[self.first]
        self.seg_off = cum[:-1] - np.repeat(cum[self.first], self.nseg)  # offset within its value
        self._views: list[memoryview] | None = None

    def _block(self, block: RowBlock) -> tuple[np.ndarray, ...]:
        k, n = len(self.bufs), block.n
        self.bufs += [block.header, block.base]
        seg_src = np.zeros(2 * n, np.int64)
        seg_src[1::2] = (block.start + np.arange(n, dtype=np.int64)) * block.row
        return (
            np.tile(np.array([k, k + 1], np.int64), n),
            seg_src,
            np.tile(np.array([len(block.header), block.row], np.int64), n),
            np.full(n, 2, np.int64),
            np.tile(np.array([True, False]), n),  # the header is a whole buffer, a row a slice of the base
        )

    def _listed(self, values: Sequence[Segments]) -> tuple[np.ndarray, ...]:
        # per-segment work stays in C (batchscan, or map/fromiter/set): it runs for every segment of every put
        scanned = batchscan.plain_segments(values)
        if scanned is None:
            vals = [(v,) if isinstance(v, (bytes, bytearray, memoryview)) else v for v in values]
            scanned = batchscan.plain_segments(vals)
            if scanned is None:
                flat = list(itertools.chain.from_iterable(vals))
                scanned = (*self._normalised(flat), np.fromiter(map(len, vals), np.int64, len(vals)))
        flat, nbytes, nseg = scanned
        k = len(self.bufs)
        self.bufs += flat
        whole = np.ones(len(flat), bool)  # every segment is a buffer of its own
        return np.arange(k, k + len(flat), dtype=np.int64), np.zeros(len(flat), np.int64), nbytes, nseg, whole

    @staticmethod
    def _normalised(segments: list) -> tuple[list[Buffer], np.ndarray]:
        """Any buffers as contiguous byte views, and their sizes (raises if one is not contiguous)."""
        flat = list(map(memoryview, segments))
        nbytes = np.fromiter(map(_NBYTES, flat), np.int64, len(flat))
        try:
            lens = np.fromiter(map(len, flat), np.int64, len(flat))
        except TypeError:  # a 0-d view
            lens = np.full(len(flat), -1, dtype=np.int64)
        for i in np.flatnonzero(lens != nbytes).tolist():  # multi-byte formats, n-d views
            flat[i] = _as_bytes_view(flat[i])
        if not all(map(_CONTIGUOUS, flat)):
            raise InvalidArgument(_NOT_CONTIGUOUS)
        return flat, nbytes

    def segments_of(self, vidx: np.ndarray) -> np.ndarray:
        """Indexes (into the segment table) of the segments of values ``vidx``, in that order."""
        ns = self.nseg[vidx]
        ends = np.cumsum(ns)
        return np.repeat(self.first[vidx] - (ends - ns), ns) + np.arange(int(ends[-1]) if len(ends) else 0)

    def payload(self, vidx: np.ndarray) -> list[Buffer]:
        """The segments of values ``vidx`` as buffers, in order (for a socket's scatter/gather send)."""
        seg = self.segments_of(vidx)
        if self.seg_whole[seg].all():  # no slicing: hand over the buffers themselves (no view per segment)
            return list(map(self.bufs.__getitem__, self.seg_buf[seg].tolist()))
        if self._views is None:
            self._views = [memoryview(b) for b in self.bufs]
        src = self.seg_src[seg]
        cuts = map(slice, src.tolist(), (src + self.seg_len[seg]).tolist())
        return list(map(memoryview.__getitem__, map(self._views.__getitem__, self.seg_buf[seg].tolist()), cuts))

    def copy_into(self, dst: memoryview, vidx: np.ndarray, offsets: np.ndarray) -> None:
        """Write values ``vidx`` at byte ``offsets`` of ``dst``, the whole batch in one copy call."""
        seg = self.segments_of(vidx)
        dst_off = np.repeat(offsets, self.nseg[vidx]) + self.seg_off[seg]
        fastcopy.copy_table(dst, dst_off, self.bufs, self.seg_buf[seg], self.seg_src[seg], self.seg_len[seg])


class Gathered:
    """A get's values as they arrive from the nodes: source buffers and, per key, where its value is."""

    __slots__ = ("sources", "index", "offsets", "lengths", "_lock")

    def __init__(self, n: int) -> None:
        self.sources: list[memoryview] = []
        self.index = np.full(n, -1, np.int64)
        self.offsets = np.zeros(n, np.int64)
        self.lengths = np.zeros(n, np.int64)
        self._lock = threading.Lock()  # the nodes' replies are read by several threads at once

    def add(self, source: memoryview, positions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Values ``positions`` of the get are ``lengths`` bytes of ``source`` from ``offsets``."""
        with self._lock:
            self.index[positions] = len(self.sources)
            self.offsets[positions] = offsets
            self.lengths[positions] = lengths
            self.sources.append(source)

    def table(self) -> ValueTable:
        """Every value, in the get's key order."""
        return ValueTable(self.sources, self.index, self.offsets, self.lengths)


def private_copy(table: ValueTable) -> ValueTable:
    """The values copied into one buffer of this process (releasing any pins on node memory)."""
    ends = np.cumsum(table.lengths)
    starts = ends - table.lengths
    total = int(ends[-1]) if len(ends) else 0
    own = memoryview(buffers.take(total))
    fastcopy.copy_table(own, starts, table.sources, table.index, table.offsets, table.lengths)
    return ValueTable([own], np.zeros(len(table), np.int64), starts, table.lengths)

