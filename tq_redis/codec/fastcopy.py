"""Batched copies of many buffers, for the data plane's bulk paths.

A put or ``get_data`` of a big batch copies thousands of row-sized pieces (2048 values of 32 KiB
for 64 MiB). One Python-level copy per piece is slow twice over: the interpreter's per-piece
overhead, and a memory system that reads every destination cache line before overwriting it,
because each piece is too small for ``memcpy`` to switch to streaming stores. This module copies
a whole batch in one call to the optional native module :mod:`tq_redis.codec._copy`, which

* releases the interpreter lock and splits a large batch over a few threads;
* writes large batches with streaming (non-temporal) stores, so each byte crosses the memory bus
  twice instead of three times.

Without the native module (no C compiler at install time, or ``TQ_NATIVE_COPY=0``) the same
functions loop in Python, with identical results and the same error types.

Settings (environment, read at import): ``TQ_COPY_THREADS`` threads per batch (default: up to 4
of the CPUs this process may use; at most 16), ``TQ_NATIVE_COPY=0`` to force the Python loops.
"""

from __future__ import annotations

import operator
import os
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_redis.settings import settings

__all__ = ["NATIVE", "configure", "copy_table", "gather_rows"]

Buffer = Any  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol


def _threads_from_env() -> int:
    threads = settings.copy_threads
    if threads is not None:
        return threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _load_native() -> Any:
    if not settings.native_copy:
        return None
    try:
        from tq_redis.codec import _copy
    except ImportError:
        return None
    _copy.configure(threads=_threads_from_env())
    return _copy


_native = _load_native()

#: whether batches are copied by the native module (else by Python loops)
NATIVE: bool = _native is not None


def configure(*, threads: int | None = None, stream_min: int | None = None) -> dict[str, int] | None:
    """Tune the native copies: ``threads`` per batch, streaming stores from ``stream_min`` bytes.

    Returns the settings now in force, or None when the native module is not in use.
    """
    if _native is None:
        return None
    t, s, per = _native.configure(
        threads=-1 if threads is None else threads, stream_min=-1 if stream_min is None else stream_min
    )
    return {"threads": t, "stream_min": s, "bytes_per_thread": per}


def _writable(dst: Buffer) -> memoryview:
    """``dst`` as a flat byte view; raises ``BufferError`` (as the native module does) if read-only."""
    mv = memoryview(dst)
    if mv.readonly:
        raise BufferError("Object is not writable.")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _byte_view(buf: Buffer) -> memoryview:
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise BufferError("a source buffer is not C-contiguous")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _int64(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def copy_table(
    dst: Buffer,
    dst_offsets: np.ndarray,
    sources: Sequence[Buffer],
    index: np.ndarray,
    src_offsets: np.ndarray,
    lengths: np.ndarray,
) -> None:
    """For every entry i, copy ``lengths[i]`` bytes of ``sources[index[i]]`` from ``src_offsets[i]``
    into the writable buffer ``dst`` at ``dst_offsets[i]``.

    The four tables are integer arrays of one length; ``sources`` are C-contiguous buffers. Raises
    ``ValueError`` before copying anything when an entry falls outside its buffers, and
    ``BufferError`` when ``dst`` is read-only or a source is not contiguous.
    """
    tables = [_int64(dst_offsets), _int64(index), _int64(src_offsets), _int64(lengths)]
    if _native is not None:
        _native.copy_table(dst, tables[0], sources, *tables[1:])
        return
    doff, idx, soff, lens = tables
    out = _writable(dst)
    srcs = [_byte_view(s) for s in sources]
    n = len(doff)
    if any(len(t) != n for t in tables):
        raise ValueError(f"copy_table: the tables have different lengths {[len(t) for t in tables]}")
    if n == 0:
        return
    if int(idx.min()) < 0 or int(idx.max()) >= len(srcs):
        raise ValueError(f"copy_table: an entry names a source outside the {len(srcs)} given")
    src_len = np.fromiter(map(len, srcs), np.int64, len(srcs))[idx]
    if int(lens.min()) < 0 or int(soff.min()) < 0 or bool((soff + lens > src_len).any()):
        raise ValueError("copy_table: an entry reads past the end of its source")
    if int(doff.min()) < 0 or int((doff + lens).max()) > out.nbytes:
        raise ValueError(f"copy_table: an entry does not fit a {out.nbytes}-byte destination")
    pieces = map(
        operator.getitem, map(srcs.__getitem__, idx.tolist()), map(slice, soff.tolist(), (soff + lens).tolist())
    )
    deque(map(out.__setitem__, map(slice, doff.tolist(), (doff + lens).tolist()), pieces), maxlen=0)


#: up to this many rows and bytes, :func:`gather_rows` copies them one by one, holding the GIL
#: (a tiny get_data's case); larger copies go to the native copier, which releases it
_FEW_ROWS = 4
_FEW_BYTES = 64 << 10


def gather_rows(dst: Buffer, parts: Sequence[Buffer], skip: int, row: int) -> None:
    """Copy bytes ``[skip, skip + row)`` of each ``parts[i]`` to ``dst[i * row:(i + 1) * row]``.

    Raises ``ValueError`` before copying anything when a part is shorter than ``skip + row`` or
    ``dst`` cannot hold every row.
    """
    if skip < 0 or row < 0:
        raise ValueError("gather_rows: skip and row must be >= 0")
    n = len(parts)
    if n <= _FEW_ROWS and n * row <= _FEW_BYTES:  # slice assignments cost less than building the copy tables
        out = _writable(dst)
        srcs = [_byte_view(p) for p in parts]
        if any(len(s) < skip + row for s in srcs):
            raise ValueError(f"gather_rows: a source is shorter than {skip} + {row} bytes")
        if n * row > out.nbytes:
            raise ValueError(f"gather_rows: a row does not fit the {out.nbytes}-byte destination ({n} x {row} bytes)")
        for i, src in enumerate(srcs):
            out[i * row : (i + 1) * row] = src[skip : skip + row]
        return
    copy_table(dst, np.arange(n, dtype=np.int64) * row, parts, np.arange(n), np.full(n, skip), np.full(n, row))
