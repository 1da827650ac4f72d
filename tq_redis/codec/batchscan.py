"""One pass over the Python objects of a batch: its values' sizes, its keys' hashes, its rows joined.

A store's put is handed thousands of values (each a list of buffer segments) under string keys,
and decoding a claimed field means checking each value's header and joining the payloads.
From Python each of those steps costs a few hundred nanoseconds per object; the optional native
module :mod:`tq_redis.codec._scan` visits each object once in C. Without it (no C compiler at install
time, or ``TQ_NATIVE_SCAN=0``) :func:`plain_segments` and :func:`crc32_keys` run in Python with
identical results and the same error types, and the joins return ``None``: their callers' own
Python path does that work then.
"""

from __future__ import annotations

import itertools
import operator
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_redis.settings import settings

__all__ = ["NATIVE", "crc32_keys", "join_framed", "join_rows", "plain_segments"]


_NATIVE_FUNCTIONS = ("segments", "crc32_keys", "join_framed", "join_rows")


def _load_native() -> Any:
    if not settings.native_scan:
        return None
    try:
        from tq_redis.codec import _scan
    except ImportError:
        return None
    # a build older than this module (an editable checkout not rebuilt) lacks functions: use Python
    return _scan if all(hasattr(_scan, f) for f in _NATIVE_FUNCTIONS) else None


_native = _load_native()

#: whether batches are scanned by the native module (else in Python)
NATIVE: bool = _native is not None

_FORMAT = operator.attrgetter("format")
_NDIM = operator.attrgetter("ndim")
_CONTIGUOUS = operator.attrgetter("c_contiguous")


def plain_segments(values: Sequence[Any]) -> tuple[list[Any], np.ndarray, np.ndarray] | None:
    """Every value's segments, flattened, with their sizes: ``(flat, sizes, counts)``.

    ``values`` is a list of values, each a list or tuple of segments; ``sizes`` (int64) is each
    segment's byte size and ``counts`` (int64) each value's number of segments. Returns ``None``
    when a value is not a list or tuple, or a segment is not plain: plain is ``bytes`` or a
    one-dimensional C-contiguous memoryview of format ``"B"``, what the codec produces. The caller
    normalises anything else itself (and names what is wrong with it).
    """
    if _native is not None and type(values) is list:
        scanned = _native.segments(values)
        if scanned is None:
            return None
        flat, sizes, counts = scanned
        return flat, np.frombuffer(sizes, np.int64), np.frombuffer(counts, np.int64)
    if not set(map(type, values)) <= {list, tuple}:
        return None
    flat = list(itertools.chain.from_iterable(values))
    sizes = _plain_sizes(flat)
    if sizes is None:
        return None
    return flat, sizes, np.fromiter(map(len, values), np.int64, len(values))


def _plain_sizes(segments: list[Any]) -> np.ndarray | None:
    """Sizes of ``segments`` when every one is plain (see :func:`plain_segments`), else None."""
    kinds = set(map(type, segments))
    if not kinds <= {bytes, memoryview}:
        return None
    if kinds == {memoryview}:
        views = segments
    elif set(map(type, segments[1::2])) == {memoryview} and set(map(type, segments[::2])) == {bytes}:
        views = segments[1::2]  # the codec's usual [header, payload] pairs
    else:
        views = [x for x in segments if type(x) is memoryview]
    try:
        if views and (
            set(map(_FORMAT, views)) != {"B"} or set(map(_NDIM, views)) != {1} or not all(map(_CONTIGUOUS, views))
        ):
            return None
    except ValueError:  # a released view: the caller's normalising path names it
        return None
    return np.fromiter(map(len, segments), np.int64, len(segments))


def crc32_keys(keys: Sequence[str]) -> np.ndarray:
    """``zlib.crc32`` of each key's UTF-8 bytes, as uint64.

    Raises:
        TypeError: a key is not a ``str``.
        UnicodeEncodeError: a key holds a lone surrogate, which UTF-8 cannot encode.
    """
    if _native is not None and type(keys) in (list, tuple):
        return np.frombuffer(_native.crc32_keys(keys), np.uint64)
    return np.fromiter(map(zlib.crc32, map(str.encode, keys)), np.uint64, len(keys))


def join_framed(values: Sequence[Any], prefix: bytes, size: int) -> bytearray | None:
    """The parts after ``prefix`` of every value, one after the other, in a new ``bytearray``,
    when ``values`` is a list of ``bytes``, ``bytearray`` or memoryviews, each exactly ``size``
    bytes long and starting with ``prefix``; ``None`` otherwise, or without the native module."""
    if _native is None or type(values) is not list:
        return None
    return _native.join_framed(values, prefix, size)


def join_rows(
    values: Sequence[Any], prefix: bytes, itemsize: int, max_bytes: int
) -> tuple[bytearray, bytearray, int, int] | None:
    """``(payloads, offsets, shortest, longest)`` of one-dimensional rows: each value is ``prefix``,
    its length ``n`` (little-endian int64), then ``n * itemsize`` bytes. ``payloads`` joins them;
    ``offsets`` holds the ``len(values) + 1`` start offsets in items as native int64. ``None`` when
    a value is not like that, the payloads exceed ``max_bytes``, or without the native module."""
    if _native is None or type(values) is not list or not values:
        return None
    return _native.join_rows(values, prefix, itemsize, max_bytes)
