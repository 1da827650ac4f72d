"""The ordered executor behind every channel handle, and the handles of ``async_op=True`` calls.

One :class:`Executor` per :class:`tq_redis.Channel` object (per local channel, in
:mod:`tq_redis.channel.local`) runs that object's calls on its own background thread (one asyncio
loop), in the order they were made: each call gets its turn, one that has to wait (:func:`waiting`)
steps aside so later calls proceed, and calls of one lane (same kind, same key) run strictly one
after another so they stay FIFO. A call is a :data:`Start`: a coroutine function given the resource
the executor opened (a Redis driver, or a local channel's state). :class:`ChannelWork` is the handle
an ``async_op=True`` call returns.

Exit flushing: ``close()``, garbage collection of the handle (``close_soon``) and the process's exit
hooks (``atexit`` and multiprocessing's) land every put issued before them; gets still pending fail
with :class:`~tq_redis.errors.ChannelClosed`. A put's error that no handle reported is raised by
``close()`` and logged when nobody can see it any more (on the ``tq_redis.channel.channel`` logger).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import logging
import multiprocessing.util
import os
import threading
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from tq_redis.errors import ChannelClosed

Start = Callable[[Any], Awaitable[Any]]  # one call: given the executor's resource, returns the result

_EXIT_WARN_S = 10.0

logger = logging.getLogger(__name__)


class _Job:
    """One call on a channel handle, run by the handle's executor."""

    __slots__ = ("start", "lane", "is_put", "future", "settled", "waiting", "task", "handle", "reported", "logged",
                 "owner")

    def __init__(self, start: Start, lane: Any, is_put: bool) -> None:
        self.start = start
        self.lane = lane  # (kind, key): calls of one lane run one after another; None: never waits
        self.is_put = is_put
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.future.set_running_or_notify_cancel()  # a waiter giving up cannot cancel the operation
        self.settled: asyncio.Future | None = None  # done once the job finished or started waiting
        self.waiting = False
        self.task: asyncio.Task | None = None
        self.handle: weakref.ref | None = None
        self.reported = False  # its error reached the caller (wait(), or raised by close())
        self.logged = False
        self.owner: Executor | None = None


class ChannelWork:
    """Handle of a call made with ``async_op=True`` (RLinf's ``AsyncWork``).

    ``wait()`` blocks until the operation is done and returns its result (or raises its error);
    ``await async_wait()`` does the same without blocking the event loop. Dropping the handle does
    not cancel the operation.
    """

    def __init__(self, job: _Job, channel: Any) -> None:
        self._job = job
        self._channel = channel  # keeps the handle (and its executor) alive while this is awaited

    def done(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._job.future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the operation's error."""
        try:
            return self._job.future.result(timeout)
        finally:
            if self._job.future.done():
                self._job.reported = True

    async def async_wait(self) -> Any:
        """Await the result without blocking the event loop."""
        try:
            return await asyncio.wrap_future(self._job.future)
        finally:
            if self._job.future.done():
                self._job.reported = True


# ------------------------------------------------------------------ the executor

_CURRENT_JOB: contextvars.ContextVar[_Job] = contextvars.ContextVar("tq_channel_job")


@contextlib.contextmanager
def waiting():
    """Mark the running job as waiting: the executor moves on to the calls issued after it."""
    job = _CURRENT_JOB.get()
    job.owner.before_wait(job)
    try:
        yield
    finally:
        job.waiting = False


class Executor:
    """Runs one channel handle's calls in issue order on one background thread (an asyncio loop).

    The pump takes the calls in the order they were made and runs each until it finishes or has to
    wait; a waiting call continues as its own task while the pump moves on. Calls of one lane
    (same kind, same key) run strictly one after another, so they stay FIFO. ``close`` lands every
    put issued before it; gets not yet started or still waiting fail with :class:`ChannelClosed`.
    """

    def __init__(self, label: str, open_resource: Callable[[], Any], flush_at_exit: bool) -> None:
        self.label = label
        self.pid = os.getpid()
        self._open_resource = open_resource
        self._flush_at_exit = flush_at_exit
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False  # caller side: no new calls
        self._closing = False  # loop side: gets fail instead of starting or waiting
        self._log_failures = True
        self._inbox: asyncio.Queue | None = None
        self._lanes: dict[Any, deque[_Job]] = {}
        self._running: set[_Job] = set()
        self._failed_puts: list[_Job] = []
        self._pending_puts = 0
        self._mp_hook: multiprocessing.util.Finalize | None = None

    # -- caller side

    def call(self, start: Start, lane: Any, is_put: bool, async_op: bool, channel: Any) -> Any:
        """Run ``start`` in its turn: its result (or error), or at once a :class:`ChannelWork` with
        ``async_op``, which keeps ``channel`` alive while it is awaited. ``lane`` is ``(kind, key)``
        for a call that may wait, None for one that never does."""
        job = _Job(start, lane, is_put)
        work = None
        if async_op:
            work = ChannelWork(job, channel)
            job.handle = weakref.ref(work)
        self.submit(job)
        if work is not None:
            return work
        job.reported = True
        return job.future.result()

    def submit(self, job: _Job) -> None:
        job.owner = self
        with self._lock:
            if self._stopping:
                raise ChannelClosed(f"channel handle {self.label!r} is closed; Channel.connect(name) gives a new one")
            if self._thread is None:
                self._start()
            if job.is_put:
                self._pending_puts += 1
            self._loop.call_soon_threadsafe(self._inbox.put_nowait, job)

    def _start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._thread_main, name=f"tq-channel-{self.label}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:  # nothing started: the next call tries again
            error, self._start_error = self._start_error, None
            self._thread.join()
            self._thread, self._loop, self._ready = None, None, threading.Event()
            raise error
        if self._flush_at_exit:
            atexit.register(self.flush_at_exit)
            # multiprocessing children leave through os._exit: only its own exit hook runs there
            self._mp_hook = multiprocessing.util.Finalize(None, self.flush_at_exit, exitpriority=10)

    def close(self, timeout: float | None = None, *, raise_errors: bool = True) -> None:
        """Land every put issued so far, fail the gets still pending, release the thread."""
        thread = self._request_close(log_failures=not raise_errors)
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(
                f"channel handle {self.label!r}: {self._pending_puts} put(s) still not landed after {timeout} s "
                f"(is the queue full with nobody getting?)"
            )
        if raise_errors:
            errors = self._take_unreported()
            if errors:
                raise errors[0]

    def close_soon(self) -> None:
        """Start closing without waiting (the handle was garbage-collected)."""
        self._request_close(log_failures=True)

    def flush_at_exit(self) -> None:
        """Exit hook: land the puts issued through this handle before the process ends."""
        if os.getpid() != self.pid:
            return
        thread = self._request_close(log_failures=True)
        if thread is None or thread is threading.current_thread():
            return
        thread.join(_EXIT_WARN_S)
        if thread.is_alive():
            logger.warning("waiting for %d put(s) to land in channel %r before exiting (its queue is full)",
                           self._pending_puts, self.label)
            thread.join()

    def _request_close(self, log_failures: bool) -> threading.Thread | None:
        with self._lock:
            first = not self._stopping
            self._stopping = True
            thread, loop = self._thread, self._loop
        if thread is None:
            return None
        if first:
            self._log_failures = log_failures
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(self._begin_close)
        return thread

    def _take_unreported(self) -> list[BaseException]:
        errors = [j.future.exception() for j in self._failed_puts if not j.reported]
        for j in self._failed_puts:
            j.reported = True
        return errors

    def _unregister_exit_hooks(self) -> None:
        if self._flush_at_exit:
            atexit.unregister(self.flush_at_exit)
        if self._mp_hook is not None:
            self._mp_hook.cancel()

    # -- loop side

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            if self._start_error is None:
                with self._lock:
                    self._stopping = True
                self._loop.run_until_complete(asyncio.sleep(0))  # take in calls submitted meanwhile
                while not self._inbox.empty():
                    job = self._inbox.get_nowait()
                    if job is not None:
                        self._fail(job, self._closed_error())
                self._unregister_exit_hooks()
            self._loop.close()

    async def _main(self) -> None:
        try:
            self._inbox = asyncio.Queue()
            resource = self._open_resource()
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._pump(resource)
            await self._drain()
        finally:
            await resource.close()
            if self._log_failures:
                for job in self._failed_puts:
                    if not job.reported and not job.logged:
                        self._log_failure(job)

    def _begin_close(self) -> None:
        self._closing = True
        self._inbox.put_nowait(None)

    def _closed_error(self) -> ChannelClosed:
        return ChannelClosed(f"channel handle {self.label!r} was closed before this get could finish")

    async def _pump(self, resource: Any) -> None:
        while True:
            job = await self._inbox.get()
            if job is None:
                return
            if self._closing and not job.is_put:
                self._fail(job, self._closed_error())
                continue
            if job.lane is not None:
                if job.lane in self._lanes:
                    self._lanes[job.lane].append(job)
                    continue
                self._lanes[job.lane] = deque()
            await self._spawn(job, resource)

    async def _drain(self) -> None:
        for lane, queue in self._lanes.items():
            for job in [j for j in queue if not j.is_put]:
                self._fail(job, self._closed_error())
            self._lanes[lane] = deque(j for j in queue if j.is_put)
        for job in list(self._running):
            if job.waiting and not job.is_put:
                job.task.cancel()
        while self._running:
            await asyncio.wait([j.task for j in self._running])

    def _spawn(self, job: _Job, resource: Any) -> asyncio.Future:
        job.settled = self._loop.create_future()
        self._running.add(job)
        job.task = self._loop.create_task(self._run(job, resource))
        return job.settled

    async def _run(self, job: _Job, resource: Any) -> None:
        _CURRENT_JOB.set(job)
        try:
            result = await job.start(resource)
        except asyncio.CancelledError:
            self._finish(job, None, self._closed_error(), resource)
        except BaseException as exc:  # handed to whoever waits on the call
            self._finish(job, None, exc, resource)
        else:
            self._finish(job, result, None, resource)

    def before_wait(self, job: _Job) -> None:
        if self._closing and not job.is_put:
            raise self._closed_error()
        job.waiting = True
        if not job.settled.done():
            job.settled.set_result(None)

    def _finish(self, job: _Job, result: Any, error: BaseException | None, resource: Any) -> None:
        self._running.discard(job)
        if not job.settled.done():
            job.settled.set_result(None)
        if error is None:
            job.future.set_result(result)
        else:
            self._fail(job, error)
        if job.is_put:
            with self._lock:
                self._pending_puts -= 1
        self._next_in_lane(job.lane, resource)

    def _fail(self, job: _Job, error: BaseException) -> None:
        job.future.set_exception(error)
        if job.is_put and job.handle is not None:
            self._failed_puts.append(job)
            if job.handle() is None:  # nobody can wait for it any more: say so now (close() raises it too)
                self._log_failure(job)
        if job.is_put and job.task is None:  # failed before it started
            with self._lock:
                self._pending_puts -= 1

    def _log_failure(self, job: _Job) -> None:
        job.logged = True
        logger.error("channel %r: a put issued with async_op=True failed and nobody waited for it: %r",
                     self.label, job.future.exception())

    def _next_in_lane(self, lane: Any, resource: Any) -> None:
        if lane is None:
            return
        queue = self._lanes.get(lane)
        while queue:
            job = queue.popleft()
            if self._closing and not job.is_put:
                self._fail(job, self._closed_error())
                continue
            self._spawn(job, resource)
            return
        self._lanes.pop(lane, None)

