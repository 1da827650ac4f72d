"""The checks every public call shares for its non-name arguments: durations, counts, sample ids
and the metadata objects a call takes back. Names are checked in :mod:`tq_redis.names`.

Each check returns the value in the form the caller uses (a ``float``, an ``int``, a list of
``int``) or raises :class:`~tq_redis.errors.InvalidArgument` (a ``ValueError``) saying what the
argument must be. Nothing else escapes: a NaN, an infinity, a string or ``None`` where a number
belongs, or ``None`` where a ``BatchMeta`` belongs, never reaches ``int()``, a comparison, an
attribute lookup or Redis.

Limits:

* a duration is finite and at most :data:`MAX_SECONDS` (about 31 years): Redis keeps deadlines as
  milliseconds, and a blocking wait longer than that is a bug, not a wish;
* a sample id is an integer in ``[0, MAX_SAMPLE_ID]``: ids are bit offsets of Redis bitmaps,
  which end at 2**32 - 1;
* a batch size is an integer in ``[1, MAX_SAMPLE_ID + 1]``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from tq_redis.errors import InvalidArgument

__all__ = [
    "MAX_SAMPLE_ID",
    "MAX_SECONDS",
    "batch_meta",
    "count",
    "ids",
    "kv_batch_meta",
    "seconds",
]

MAX_SECONDS = 1e9
"""The longest duration (timeout, lease) a call accepts, in seconds (about 31.7 years)."""

MAX_SAMPLE_ID = 2**32 - 1
"""The largest sample id: ids are offsets into Redis bitmaps (at most 2**32 bits)."""


def _type(value: Any) -> str:
    return type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def seconds(value: Any, name: str, *, allow_zero: bool = True, allow_none: bool = False) -> float | None:
    """A duration in seconds: a finite real number, ``>= 0`` (``> 0`` unless ``allow_zero``), at
    most :data:`MAX_SECONDS`; ``None`` passes through where ``allow_none``.

    Raises:
        InvalidArgument: anything else (NaN, infinity, a string, a bool, a negative number ...).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        rule = _seconds_rule(allow_zero, allow_none)
        raise InvalidArgument(f"{name} must be {rule}, got {_type(value)} {value!r:.80}")
    number = float(value)
    if math.isnan(number) or math.isinf(number):
        raise InvalidArgument(f"{name} must be {_seconds_rule(allow_zero, allow_none)}, got {number!r}")
    if number < 0 or (number == 0 and not allow_zero) or number > MAX_SECONDS:
        raise InvalidArgument(f"{name} must be {_seconds_rule(allow_zero, allow_none)}, got {value!r}")
    return number


def _seconds_rule(allow_zero: bool, allow_none: bool) -> str:
    low = ">= 0" if allow_zero else "> 0"
    return f"a finite number of seconds {low} and at most {MAX_SECONDS:g}" + (" (or None)" if allow_none else "")


def count(value: Any, name: str, *, maximum: int = MAX_SAMPLE_ID + 1) -> int:
    """A positive integer (a batch size) of at most ``maximum``.

    Raises:
        InvalidArgument: a bool, a float, a string, zero, a negative number or one above ``maximum``.
    """
    if not _is_int(value) or not 0 < int(value) <= maximum:
        raise InvalidArgument(
            f"{name} must be a positive integer of at most {maximum}, got {_type(value)} {value!r:.80}"
        )
    return int(value)


def ids(value: Any, name: str = "global_indexes") -> list[int]:
    """Sample ids: one integer or an iterable of them (a list, tuple, numpy array or 1-D tensor),
    each in ``[0, MAX_SAMPLE_ID]``. An empty iterable gives an empty list.

    Raises:
        InvalidArgument: ``None``, a string, a non-integer element, or an id out of range.
    """
    if _is_int(value):
        value = [value]
    elif hasattr(value, "tolist") and getattr(value, "ndim", 1) in (0, 1):  # numpy array / tensor
        value = value.tolist()
        if not isinstance(value, list):
            value = [value]
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidArgument(f"{name} must be a sample id or a list of sample ids, got {_type(value)} {value!r:.80}")
    out: list[int] = []
    for item in value:
        if not _is_int(item) or not 0 <= int(item) <= MAX_SAMPLE_ID:
            raise InvalidArgument(
                f"{name} must hold integer sample ids in [0, {MAX_SAMPLE_ID}], got {_type(item)} {item!r:.80}"
            )
        out.append(int(item))
    return out


def batch_meta(value: Any, call: str) -> Any:
    """``value`` if it is a :class:`~tq_redis.meta.BatchMeta`, for public call ``call``.

    Raises:
        InvalidArgument: anything else (``None`` included).
    """
    from tq_redis.meta import BatchMeta  # metadata imports much; this module stays a leaf

    return _instance(value, BatchMeta, call, "get_meta/put")


def kv_batch_meta(value: Any, call: str) -> Any:
    """``value`` if it is a :class:`~tq_redis.meta.KVBatchMeta`, for public call ``call``.

    Raises:
        InvalidArgument: anything else (``None`` included).
    """
    from tq_redis.meta import KVBatchMeta

    return _instance(value, KVBatchMeta, call, "kv_put/kv_batch_put")


def _instance(value: Any, cls: type, call: str, made_by: str) -> Any:
    if not isinstance(value, cls):
        raise InvalidArgument(
            f"{call}() takes the {cls.__name__} that {made_by} returned, got {_type(value)} {value!r:.80}"
        )
    return value
