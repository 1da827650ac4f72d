"""What every channel, in Redis or local, takes and hands back.

The default queue's name (:data:`DEFAULT_KEY`), how a shared channel names the queue of a key
(:func:`key_token`), the checks on weights, timeouts, batch targets and ``maxsize`` (each raises
:class:`~tq_redis.errors.InvalidArgument` saying what is accepted), the pop modes, and
:class:`WeightedItem`, the ``(weight, item)`` pair that ``str(channel)`` and ``peek_all`` list.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from tq_redis.errors import InvalidArgument

DEFAULT_KEY = "default_queue"  # RLinf's name for the queue used when no key is given
ONE, FIT, EXCEED = "one", "fit", "exceed"  # how a pop chooses its items
_KEY_MARK = "#"


@dataclass(frozen=True, slots=True)
class WeightedItem:
    """A queued item and its weight, as ``str(channel)`` and :meth:`Channel.peek_all` list them."""

    weight: float
    item: Any


def _canonical(value: Any) -> str:
    if value is None:
        return "n"
    if isinstance(value, Integral):  # bool too: True == 1 as dict keys
        return f"i{int(value)}"
    if isinstance(value, Real):
        number = float(value)
        return f"i{int(number)}" if number.is_integer() else f"f{number!r}"
    if isinstance(value, str):
        return "s" + json.dumps(value)
    if isinstance(value, bytes):
        return "b" + value.hex()
    if isinstance(value, tuple):
        return "(" + ",".join(_canonical(v) for v in value) + ")"
    if isinstance(value, frozenset):
        return "fs(" + ",".join(sorted(_canonical(v) for v in value)) + ")"
    raise TypeError(type(value).__name__)


def key_token(key: Any) -> str:
    """The queue name of a channel ``key``: a ``str`` as itself, any other key in a canonical form
    (starting with ``#``) that is equal exactly when the keys are equal as dict keys."""
    if isinstance(key, str) and not key.startswith(_KEY_MARK):
        return key
    try:
        return _KEY_MARK + _canonical(key)
    except TypeError as exc:
        raise InvalidArgument(
            f"channel key {key!r} ({exc}) cannot name a shared queue: use a str, a number, None, bytes, "
            f"or a tuple/frozenset of these (local channels take any hashable key)"
        ) from None


def check_weight(weight: Any) -> None:
    """Raise unless ``weight`` is a finite number >= 0 (a bool is not a weight)."""
    if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight) or weight < 0:
        raise InvalidArgument(f"weight must be a finite number >= 0, got {weight!r}")


def deadline_after(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` at which a call given ``timeout`` seconds gives up (None: never)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, Real) or math.isnan(timeout) or timeout < 0:
        raise InvalidArgument(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    if math.isinf(timeout):  # waiting forever, as None says
        return None
    return time.monotonic() + timeout


def check_target(target_weight: Any, allow_exceed: bool) -> float:
    """``get_batch``'s target as a float: finite and >= 0, or > 0 with ``allow_exceed``."""
    bad = isinstance(target_weight, bool) or not isinstance(target_weight, Real)
    if bad or not math.isfinite(target_weight) or target_weight < 0 or (allow_exceed and target_weight == 0):
        need = "> 0" if allow_exceed else ">= 0"
        raise InvalidArgument(f"target_weight must be a finite number {need}, got {target_weight!r}")
    return float(target_weight)


def check_maxsize(maxsize: Any) -> int:
    """``maxsize`` as given, once it is an int >= 0 (0: unbounded)."""
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
        raise InvalidArgument(f"maxsize must be an int >= 0 (0 = unbounded), got {maxsize!r}")
    return maxsize

