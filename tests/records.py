"""Request records in tests that list a namespace's keys.

Every call of a script that writes leaves its reply in ``<prefix>rq:<request id>`` for two minutes
(``tq_redis/lua/includes/requests.lua``), so that a retry of a call whose reply was lost gets it;
no registry lists them and they expire by themselves. A test that checks what a clear left, or that
a refused call wrote nothing, looks past them with :func:`without_records`, which also checks that
each one it leaves out does expire.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

RECORD_MS = 120_000  # request_records.ms in lua/includes/requests.lua

K = TypeVar("K", str, bytes)


def is_record(key: str | bytes) -> bool:
    """Whether ``key`` is a call's request record."""
    return (b":rq:" in key) if isinstance(key, bytes) else (":rq:" in key)


def without_records(keys: Iterable[K], r: Any = None) -> list[K]:
    """``keys`` without the request records, in order; with a client ``r``, each left out must expire
    within :data:`RECORD_MS`."""
    kept: list[K] = []
    for key in keys:
        if not is_record(key):
            kept.append(key)
        elif r is not None:
            ttl = r.pttl(key)
            assert 0 < ttl <= RECORD_MS, f"request record {key!r} does not expire (pttl {ttl})"
    return kept
