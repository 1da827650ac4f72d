"""Start child processes that live as long as this process, whichever thread asks.

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``, set in the child before it runs the
server) is sent when the *thread* that forked the child exits, not when its process does. A
server started by ``init()`` in a worker thread (a Ray actor's method, a thread pool) would be
stopped the moment that thread ended, while the process went on using it. So every such child is
forked by one thread that lives until the process exits: a daemon thread that does nothing but
wait for the next start. When the process dies -- by exit or by SIGKILL -- that thread dies with
it and the signal reaches every child, as before.

The thread is started at the first request of each process (a forked child starts its own).
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from collections.abc import Callable
from typing import Any

_Request = tuple[Callable[[], Any], "queue.SimpleQueue[tuple[bool, Any]]"]

_lock = threading.Lock()
_requests: queue.SimpleQueue[_Request] | None = None


def _serve(requests: queue.SimpleQueue[_Request]) -> None:
    while True:
        start, reply = requests.get()
        try:
            reply.put((True, start()))
        except BaseException as exc:  # handed to the caller, who raises it
            reply.put((False, exc))


def _spawner() -> queue.SimpleQueue[_Request]:
    global _requests
    with _lock:
        if _requests is None:
            _requests = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_requests,), name="tq-redis-spawner", daemon=True).start()
        return _requests


def _forget_after_fork() -> None:
    """In a forked child: the parent's spawner thread does not exist here."""
    global _lock, _requests
    _lock = threading.Lock()
    _requests = None


os.register_at_fork(after_in_child=_forget_after_fork)


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)``, forked by this process's spawner thread, so a
    parent-death signal set in ``preexec_fn`` fires when the process ends, not when the calling
    thread does. Errors of the start are raised here, in the caller's thread."""
    reply: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
    _spawner().put((lambda: subprocess.Popen(args, **kwargs), reply))
    ok, result = reply.get()
    if not ok:
        raise result
    return result
