"""Run a few blocking socket transfers at once: one per storage node of a large request.

A put or get that spans several nodes moves each node's share over its own socket. Done one
after the other, the nodes idle while the client feeds one of them; done at once, the kernel
copies run side by side (socket calls release the GIL). :func:`concurrently` runs the first
job in the calling thread and the others on a small process-wide pool, which is rebuilt in a
forked child (threads do not survive ``fork``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["PARALLEL_MIN_BYTES", "concurrently"]

T = TypeVar("T")

#: a transfer at least this large is worth a thread of its own (below it the hand-off costs more)
PARALLEL_MIN_BYTES = 1 << 20
_MAX_THREADS = 16

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    global _pool
    _pool = None  # the parent's threads do not exist in a forked child


os.register_at_fork(after_in_child=_forget_pool)


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_MAX_THREADS, thread_name_prefix="tq-dram-io")
        return _pool


def concurrently(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Every job's result, in order; the jobs run at the same time (the first in this thread).

    Jobs are expected to catch their own errors and return them; one that raises anyway has its
    exception re-raised here, after every job has finished (none is left running).
    """
    if len(jobs) <= 1:
        return [job() for job in jobs]
    futures = [_shared_pool().submit(job) for job in jobs[1:]]
    first: list[T] = []
    error: BaseException | None = None
    try:
        first.append(jobs[0]())
    except BaseException as exc:  # noqa: BLE001 - re-raised below, once the others are done
        error = exc
    rest: list[T] = []
    for future in futures:
        try:
            rest.append(future.result())
        except BaseException as exc:  # noqa: BLE001 - the first one is re-raised below
            error = error or exc
    if error is not None:
        raise error
    return first + rest
