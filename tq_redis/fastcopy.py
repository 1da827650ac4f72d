"""Batched copies of many buffers, for the data plane's bulk paths.

A put or ``get_data`` of a big batch copies thousands of row-sized pieces (2048 values of 32 KiB
for 64 MiB). One Python-level copy per piece is slow twice over: the interpreter's per-piece
overhead, and a memory system that reads every destination cache line before overwriting it,
because each piece is too small for ``memcpy`` to switch to streaming stores. This module copies
a whole batch in one call to the optional native module :mod:`tq_redis._copy`, which

* releases the interpreter lock and splits a large batch over a few threads;
* writes large batches with streaming (non-temporal) stores, so each byte crosses the memory bus
  twice instead of three times.

Without the native module (no C compiler at install time, or ``TQ_NATIVE_COPY=0``) the same
functions loop in Python, with identical results and errors.

Settings (environment, read at import): ``TQ_COPY_THREADS`` threads per batch (default: up to 4
of the CPUs this process may use), ``TQ_NATIVE_COPY=0`` to force the Python loops.
"""

from __future__ import annotations

import operator
import os
from collections import deque
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import numpy as np

from tq_redis.errors import ConfigError

__all__ = ["NATIVE", "configure", "gather_rows", "scatter"]

Buffer = Any  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol


def _threads_from_env() -> int:
    text = os.environ.get("TQ_COPY_THREADS", "").strip()
    if not text:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        return max(1, min(4, cpus))
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ConfigError(f"TQ_COPY_THREADS={text!r}: expected a whole number of threads >= 1")
    return threads


def _load_native() -> Any:
    if os.environ.get("TQ_NATIVE_COPY", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    try:
        from tq_redis import _copy
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


def _check_contiguous(parts: Sequence[Buffer]) -> None:
    if not all(p.c_contiguous for p in parts if type(p) is memoryview):
        raise BufferError("a part is not C-contiguous")


def scatter(dst: Buffer, offsets: np.ndarray, parts: Sequence[Buffer]) -> None:
    """Copy each ``parts[i]`` into the writable buffer ``dst`` at byte ``offsets[i]``.

    ``parts`` are C-contiguous buffers whose ``len`` is their byte length (``bytes`` or byte
    memoryviews). Raises ``ValueError`` before copying anything when a part would not fit, and
    ``BufferError`` when ``dst`` is read-only or a part is not contiguous.
    """
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if _native is not None:
        _native.scatter(dst, offsets, parts)
        return
    mv = _writable(dst)
    _check_contiguous(parts)
    lens = np.fromiter(map(len, parts), np.int64, len(parts))
    if len(offsets) != len(parts):
        raise ValueError(f"scatter: {len(parts)} parts but {len(offsets)} offsets")
    ends = offsets + lens
    if len(parts) and (int(offsets.min()) < 0 or int(ends.max()) > mv.nbytes):
        raise ValueError(f"scatter: a part does not fit a {mv.nbytes}-byte destination")
    deque(map(mv.__setitem__, map(slice, offsets.tolist(), ends.tolist()), parts), maxlen=0)


def gather_rows(dst: Buffer, parts: Sequence[Buffer], skip: int, row: int) -> None:
    """Copy bytes ``[skip, skip + row)`` of each ``parts[i]`` to ``dst[i * row:(i + 1) * row]``.

    Raises ``ValueError`` before copying anything when a part is shorter than ``skip + row`` or
    ``dst`` cannot hold every row.
    """
    if _native is not None:
        _native.gather_rows(dst, parts, skip, row)
        return
    if skip < 0 or row < 0:
        raise ValueError("gather_rows: skip and row must be >= 0")
    mv = _writable(dst)
    _check_contiguous(parts)
    n = len(parts)
    if n * row > mv.nbytes:
        raise ValueError(f"gather_rows: {n} rows of {row} bytes do not fit a {mv.nbytes}-byte destination")
    if n and min(map(len, parts)) < skip + row:
        raise ValueError(f"gather_rows: a part has fewer than {skip} + {row} bytes")
    if not row:
        return
    rows = map(slice, range(0, n * row, row), range(row, (n + 1) * row, row))
    pieces = map(operator.getitem, parts, repeat(slice(skip, skip + row)))
    deque(map(mv.__setitem__, rows, pieces), maxlen=0)
