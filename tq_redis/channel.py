"""``Channel``: RLinf's named producer/consumer queue, kept in Redis so any process can use it.

Each ``key`` of a channel is its own FIFO queue: a Redis LIST ``<ns>:chan:{name}:q:<key>`` whose
entries are ``"<weight>|<payload>"``. ``lua/channel_put.lua`` appends unless the queue holds
``maxsize`` entries; ``lua/channel_pop.lua`` pops one entry and ``lua/channel_pop_fit.lua`` the
head entries that fit a target weight (RLinf's ``get_batch`` rule), atomically, so ordering is FIFO
per key across every process. A blocked ``get`` waits on the channel's ``puts`` event stream and a
blocked ``put`` on its ``gets`` stream; nothing polls or sleeps.

**Ordering and async operations.** Every call made through one ``Channel`` object, with or without
``async_op=True``, is run by that object's own background thread (one asyncio loop), in the order
the calls were made, as RLinf's channel actor runs one caller's requests: each operation gets its
turn at the queue in issue order, and one that has to wait (an empty queue for a get, a full one
for a put) steps aside so later operations proceed, except those on the same key and of the same
kind (put, or get/get_batch), which queue behind it so they stay FIFO. Waiting operations share one
blocked ``XREAD``, so a handle uses at most ``_MAX_CONNECTIONS`` + 1 connections however many
operations are in flight. A put issued with ``async_op=True`` and never waited on still lands: on
``close()``, when the object is garbage-collected, and when the process exits (``atexit`` and
multiprocessing's exit hook), the handle first finishes every put issued through it. An operation's
error is raised by ``ChannelWork.wait()`` / ``await ChannelWork.async_wait()``; a put's error that
no handle reported is raised by ``close()`` (and logged when nobody can see it any more).

**Keys** may be any value whose equality means the same in every process: ``str`` (used as is, any
characters), numbers, ``None``, ``bytes`` and tuples/frozensets of these (``1``, ``1.0`` and ``True``
are one key, as in a dict; see :func:`key_token`). Without a key, calls use RLinf's default queue
``"default_queue"``. **Local channels** (``Channel.create(name, local=True)``) keep their queues in
this process's memory and take any hashable key; see :meth:`Channel.create`.

Items may be any value the safe object encoding (:func:`tq_redis.objects.encode_object`) holds;
pickle is used only with ``allow_pickle=True`` (it is not safe on a network). Items are encoded
when the call is made, so changing an object after an async put does not change what lands. A
``torch.Tensor`` or ``TensorDict`` item goes through the data plane instead: its bytes are stored
as samples of the hidden partition ``__chan__.<name>`` (in whatever store the namespace uses) and
the queue entry holds only the reference; the getter reads and deletes them. A getter that dies
between popping and reading leaks that item's bytes.

Differences from RLinf on purpose: ``put``/``get``/``get_batch`` take a ``timeout`` (``TimeoutError``
when it expires); ``get_batch`` takes its items atomically (RLinf pops them one by one as they
arrive) and ``allow_exceed=True`` selects "the fewest head items that reach the target";
``create`` of an existing name with another ``maxsize`` raises (RLinf logs and connects);
weights must be finite and >= 0; tensors come back on the CPU, TensorDicts as plain ``TensorDict``;
``distributed``/``node_rank``/``disable_distributed_log`` are accepted and ignored (a channel in
Redis is reachable from every node); local channels also take ``async_op=True`` and block without
spinning, and a local channel sent to another process arrives there empty (RLinf copies its items).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import json
import logging
import math
import multiprocessing.util
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import redis
import redis.asyncio as aioredis
import torch
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from tensordict import TensorDict, TensorDictBase, is_leaf_nontensor

from tq_redis import codec, objects, ops, transitions
from tq_redis.driver import AsyncDriver, Cmd, Offload, Pipe, Wait
from tq_redis.errors import ChannelClosed, ChannelNotFound, ConfigError, DataMissing, InvalidArgument
from tq_redis.keys import ChannelKeys

Op = ops.Op

DEFAULT_KEY = "default_queue"  # RLinf's name for the queue used when no key is given
_WAIT_SLICE_S = 5.0  # a waiting operation re-runs its script at least this often
_OBJECT, _REF = b"o", b"r"
_MAX_CONNECTIONS = 8  # command connections per handle; waiting operations share one more
_WATCH_BLOCK_MS = 5000
_WATCH_COUNT = 128
_EXIT_WARN_S = 10.0
_ONE, _FIT, _EXCEED = "one", "fit", "exceed"  # how a pop chooses its items
_KEY_MARK = "#"

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WeightedItem:
    """A queued item and its weight, as ``str(channel)`` and :meth:`Channel.peek_all` list them."""

    weight: float
    item: Any


# ------------------------------------------------------------------ async handles


class _Job:
    """One call on a channel handle, run by the handle's executor."""

    __slots__ = ("start", "lane", "is_put", "future", "settled", "waiting", "task", "handle", "reported", "logged",
                 "owner")

    def __init__(self, start: Callable[[Any], Awaitable[Any]], lane: Any, is_put: bool) -> None:
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
        self.owner: _Executor | None = None


class ChannelWork:
    """Handle of a call made with ``async_op=True`` (RLinf's ``AsyncWork``).

    ``wait()`` blocks until the operation is done and returns its result (or raises its error);
    ``await async_wait()`` does the same without blocking the event loop. Dropping the handle does
    not cancel the operation.
    """

    def __init__(self, job: _Job, channel: Channel) -> None:
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
def _waiting():
    """Mark the running job as waiting: the executor moves on to the calls issued after it."""
    job = _CURRENT_JOB.get()
    job.owner.before_wait(job)
    try:
        yield
    finally:
        job.waiting = False


class _Executor:
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


_EXEC_LOCK = threading.Lock()


def _reset_exec_lock() -> None:
    global _EXEC_LOCK
    _EXEC_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_exec_lock)


# ------------------------------------------------------------------ waiting on the event streams


def _async_retry() -> AsyncRetry:
    # Reconnect with backoff across a Redis restart (~6 s in all), as the drivers do. redis.asyncio
    # needs its own Retry class: the sync one never retries an awaited command.
    return AsyncRetry(ExponentialBackoff(cap=1.0, base=0.05), retries=12)


def _stream_id(value: Any) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else str(value)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _xread_entries(reply: Any) -> Iterable[tuple[Any, list]]:
    if not reply:
        return []
    return reply.items() if isinstance(reply, dict) else [(r[0], r[1]) for r in reply]


class _StreamWatch:
    """Wakes a handle's waiting operations when its channel's ``puts``/``gets`` stream grows.

    One dedicated connection blocks in a single ``XREAD`` over both streams on behalf of every
    waiting operation. An operation waits from the stream id its script returned; any newer entry
    wakes it to run its script again (the script, not the wake-up, decides).
    """

    def __init__(self, url: str, streams: tuple[str, str], commands: aioredis.Redis, name: str) -> None:
        self._url = url
        self._streams = streams
        self._commands = commands
        self._name = name
        self._conn: aioredis.Redis | None = None
        self._latest: dict[str, tuple[int, int]] = {}
        self._waiters: dict[str, list[tuple[tuple[int, int], asyncio.Future]]] = {s: [] for s in streams}
        self._task: asyncio.Task | None = None
        self._positions_lock = asyncio.Lock()

    async def wait(self, stream: str, last_id: str, timeout_s: float) -> None:
        seen = _stream_id(last_id)
        await self._know_positions()
        if seen < self._latest[stream]:
            return  # something newer is there already
        self._advance(stream, seen)
        entry = (seen, asyncio.get_running_loop().create_future())
        self._waiters[stream].append(entry)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())
        try:
            await asyncio.wait_for(entry[1], timeout_s)
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError):
                self._waiters[stream].remove(entry)

    async def _know_positions(self) -> None:
        if len(self._latest) == len(self._streams):
            return
        async with self._positions_lock:
            if len(self._latest) == len(self._streams):
                return
            pipe = self._commands.pipeline(transaction=False)
            for stream in self._streams:
                pipe.xrevrange(stream, count=1)
            for stream, last in zip(self._streams, await pipe.execute()):
                self._latest[stream] = max(self._latest.get(stream, (0, 0)), _stream_id(last[0][0]) if last else (0, 0))

    def _advance(self, stream: str, newest: tuple[int, int]) -> None:
        if newest <= self._latest[stream]:
            return
        self._latest[stream] = newest
        keep = []
        for seen, fut in self._waiters[stream]:
            if seen < newest:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((seen, fut))
        self._waiters[stream] = keep

    async def _watch(self) -> None:
        try:
            while any(self._waiters.values()):
                if self._conn is None:
                    self._conn = aioredis.Redis.from_url(
                        self._url, single_connection_client=True, retry=_async_retry(),
                        retry_on_error=[redis.ConnectionError, redis.TimeoutError], client_name=self._name,
                    )
                positions = {s: "{}-{}".format(*self._latest[s]) for s in self._streams}
                reply = await self._conn.xread(positions, count=_WATCH_COUNT, block=_WATCH_BLOCK_MS)
                for stream, entries in _xread_entries(reply):
                    if entries:
                        name = stream.decode() if isinstance(stream, bytes) else stream
                        self._advance(name, _stream_id(entries[-1][0]))
        except Exception as exc:  # the waiters re-run their scripts when their slice ends
            logger.warning("channel %r: watching its event streams failed (%r); waiting operations retry "
                           "every %.0f s until it recovers", self._name, exc, _WAIT_SLICE_S)
            if self._conn is not None:
                await self._conn.aclose()
                self._conn = None

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None:
            await self._conn.aclose()


class _RedisDriver(AsyncDriver):
    """``AsyncDriver`` for one channel handle: a bounded pool, waits through :class:`_StreamWatch`,
    store I/O run inline on the handle's thread (in issue order)."""

    def __init__(self, url: str, namespace: str, keys: ChannelKeys, allow_pickle: bool) -> None:
        super().__init__(url)
        name = f"tq-channel:{namespace}:{keys.name}"
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=_MAX_CONNECTIONS, timeout=None, retry=_async_retry(),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError], health_check_interval=30,
            client_name=name,
        )
        self.redis = aioredis.Redis(connection_pool=pool)
        # items come back as they were put: a field whose rows share a shape as a dense tensor
        self.ctx = ops.Context(namespace=namespace, redis_url=url, allow_pickle=allow_pickle, nested_output=False)
        self.watch = _StreamWatch(url, (keys.puts, keys.gets), self.redis, name)

    async def _execute(self, effect: Any) -> Any:
        if isinstance(effect, Wait):
            with _waiting():
                await self.watch.wait(effect.stream, effect.last_id, effect.timeout_s)
            return None
        if isinstance(effect, Offload):
            return effect.fn(*effect.args)
        return await super()._execute(effect)

    async def close(self) -> None:
        await self.watch.aclose()
        await self.redis.aclose()
        await self.redis.connection_pool.aclose()
        if self.ctx.storage is not None:
            self.ctx.storage.close()


def _open_driver(url: str, namespace: str, keys: ChannelKeys, allow_pickle: bool) -> _RedisDriver:
    try:
        return _RedisDriver(url, namespace, keys, allow_pickle)
    except ValueError as exc:  # redis-py's complaint about the URL
        raise ConfigError(f"cannot use Redis URL {url!r} for channel {keys.name!r}: {exc}") from exc


# ------------------------------------------------------------------ keys and weights


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


def _local_key(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise InvalidArgument(f"channel key must be hashable, got {type(key).__name__} {key!r}") from None
    return key


def _check_weight(weight: Any) -> None:
    if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight) or weight < 0:
        raise InvalidArgument(f"weight must be a finite number >= 0, got {weight!r}")


def _entry(weight: Any, payload: bytes) -> bytes:
    return repr(int(weight) if isinstance(weight, Integral) else float(weight)).encode() + b"|" + payload


def _entry_weight(entry: bytes) -> int | float:
    text = entry[: entry.index(b"|")].decode()
    try:
        return int(text)
    except ValueError:
        return float(text)


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, Real) or timeout < 0:
        raise InvalidArgument(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    return time.monotonic() + timeout


def _check_target(target_weight: Any, allow_exceed: bool) -> float:
    bad = isinstance(target_weight, bool) or not isinstance(target_weight, Real)
    if bad or not math.isfinite(target_weight) or target_weight < 0 or (allow_exceed and target_weight == 0):
        need = "> 0" if allow_exceed else ">= 0"
        raise InvalidArgument(f"target_weight must be a finite number {need}, got {target_weight!r}")
    return float(target_weight)


def _take_count(weights: Iterable[float], mode: str, target: float) -> int | None:
    """How many head items a pop takes (the Lua scripts' rules), or None: wait for more."""
    taken, total = 0, 0.0
    for weight in weights:
        if mode == _ONE:
            return 1
        if mode == _FIT and total + weight > target:
            return taken
        taken += 1
        total += weight
        if total >= target:
            return taken
    return None


# ------------------------------------------------------------------ item encoding


@dataclass(frozen=True, slots=True)
class _Encoded:
    """An item encoded when the call was made: the whole payload, or a data-plane reference whose
    sample ids are assigned when it is stored, with its encoded fields."""

    payload: bytes | None
    ref: dict | None = None
    rows: int = 0
    fields: dict | None = None


def _tensor_like(item: Any) -> bool:
    if isinstance(item, TensorDictBase):
        return True
    return isinstance(item, torch.Tensor) and item.layout == torch.strided and not item.is_nested


def _leaves(td: TensorDictBase) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for path, value in td.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor):
        out.append(((path,) if isinstance(path, str) else tuple(path), value))
    return out


def encode_item(item: Any, allow_pickle: bool) -> _Encoded:
    """Encode ``item`` now (objects inline, tensors as fields for the data plane)."""
    if not _tensor_like(item):
        return _Encoded(_OBJECT + objects.encode_object(item, allow_pickle=allow_pickle))
    if isinstance(item, torch.Tensor):
        ref: dict[str, Any] = {"kind": "tensor", "bs": [], "paths": [["t"]]}
        rows, leaves = 1, [(("t",), item.unsqueeze(0))]
    else:
        bs = list(item.batch_size)
        batched = item if bs else item.unsqueeze(0)
        rows, leaves = int(batched.batch_size[0]), _leaves(batched)
        ref = {"kind": "td", "bs": bs, "paths": [list(p) for p, _ in leaves]}
        if rows == 0 or not leaves:  # nothing per sample: keep the (empty) leaves inline
            ref["kind"] = "td-inline"
            ref["values"] = [v for _, v in leaves]
            return _Encoded(_REF + objects.encode_object(ref, allow_pickle=allow_pickle))
    fields = {
        f"f{j}": codec.encode_field(f"f{j}", value, rows, allow_pickle=allow_pickle)[1]
        for j, (_, value) in enumerate(leaves)
    }
    return _Encoded(None, ref, rows, fields)


def _storage(ctx: ops.Context) -> Op:
    """``ops.storage``, safe when two operations of one handle resolve it at once."""
    if ctx.storage is None:
        probe = ops.Context(namespace=ctx.namespace, redis_url=ctx.redis_url)
        manager = yield from ops.storage(probe)
        if ctx.storage is None:  # else another operation won; the unused manager holds nothing
            ctx.storage = manager
    return ctx.storage


def store_item(ctx: ops.Context, ck: ChannelKeys, enc: _Encoded) -> Op:
    """The queue payload of an encoded item; tensors go to the data plane first (data before entry)."""
    if enc.payload is not None:
        return enc.payload
    first = (yield Cmd(("INCRBY", ck.seq, enc.rows))) - enc.rows
    ref = dict(enc.ref, ids=list(range(first, first + enc.rows)))
    store = yield from _storage(ctx)
    yield Offload(store.put, (_data_keys(ctx, ck), ref["ids"], enc.fields))
    return _REF + objects.encode_object(ref, allow_pickle=ctx.allow_pickle)


def _data_keys(ctx: ops.Context, ck: ChannelKeys):
    return ctx.keys(ck.data_partition)


def _payload(entry: bytes) -> tuple[bytes, bytes]:
    bar = entry.index(b"|")
    return entry[bar + 1 : bar + 2], entry[bar + 2 :]


def load_items(ctx: ops.Context, ck: ChannelKeys, entries: list[bytes], consume: bool = True) -> Op:
    """Decode entries; tensor items are read from the data plane (and deleted when ``consume``)."""
    items: list[Any] = []
    for entry in entries:
        tag, body = _payload(entry)
        if tag == _OBJECT:
            items.append(objects.decode_object(body, allow_pickle=ctx.allow_pickle))
            continue
        ref = objects.decode_object(body, allow_pickle=ctx.allow_pickle)
        if ref["kind"] == "td-inline":
            items.append(_tensordict(ref["bs"], ref["paths"], ref["values"]))
            continue
        store = yield from _storage(ctx)
        names = [f"f{j}" for j in range(len(ref["paths"]))]
        pk = _data_keys(ctx, ck)
        got = yield Offload(store.get, (pk, ref["ids"], names))
        if consume:
            yield Offload(store.delete, (pk, ref["ids"], names))
        values = [
            codec.decode_field(n, got[n], allow_pickle=ctx.allow_pickle, nested_output=ctx.nested_output)
            for n in names
        ]
        if ref["kind"] == "tensor":
            items.append(values[0][0])
        elif ref["bs"]:
            items.append(_tensordict(ref["bs"], ref["paths"], values))
        else:  # stored as one row
            items.append(_tensordict([1], ref["paths"], values)[0])
    return items


def _tensordict(batch_size: list[int], paths: list[list[str]], values: list[Any]) -> TensorDict:
    td = TensorDict({}, batch_size=batch_size)
    for path, value in zip(paths, values):
        td.set(tuple(path), value)
    return td


def drop_items(ctx: ops.Context, ck: ChannelKeys, entries: list[bytes]) -> Op:
    """Delete the data-plane bytes of entries that will never be read."""
    for entry in entries:
        tag, body = _payload(entry)
        if tag != _REF:
            continue
        ref = objects.decode_object(body, allow_pickle=ctx.allow_pickle)
        if ref.get("ids"):
            store = yield from _storage(ctx)
            names = [f"f{j}" for j in range(len(ref["paths"]))]
            yield Offload(store.delete, (_data_keys(ctx, ck), ref["ids"], names))


# ------------------------------------------------------------------ operations (Redis)


def create(ctx: ops.Context, ck: ChannelKeys, maxsize: int) -> Op:
    """Create the channel, or check an existing one has the same ``maxsize``."""
    _, _, current = yield Pipe(
        (
            Cmd(("HSETNX", ck.meta, "maxsize", maxsize)),
            Cmd(("HSETNX", ck.meta, "created_ms", int(time.time() * 1000))),
            Cmd(("HGET", ck.meta, "maxsize")),
        )
    )
    if int(current) != maxsize:
        raise InvalidArgument(
            f"channel {ck.name!r} exists with maxsize={int(current)}, not {maxsize}; "
            f"use Channel.connect({ck.name!r}) or another name"
        )
    return maxsize


def connect(ck: ChannelKeys) -> Op:
    """The existing channel's ``maxsize``."""
    current = yield Cmd(("HGET", ck.meta, "maxsize"))
    if current is None:
        raise ChannelNotFound(
            f"channel {ck.name!r} does not exist; create it with Channel.create({ck.name!r})"
        )
    return int(current)


def _wait(stream: str, last_id: Any, deadline: float | None, what: str) -> Op:
    remaining = _WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(what)
    yield Wait(stream, last_id.decode() if isinstance(last_id, bytes) else str(last_id),
               min(remaining, _WAIT_SLICE_S))


def put(ctx: ops.Context, ck: ChannelKeys, enc: _Encoded, weight: Any, qkey: str, block: bool,
        deadline: float | None = None) -> Op:
    """Append an encoded item to queue ``qkey``; a full queue blocks (``block``) or raises
    ``asyncio.QueueFull``."""
    entry = _entry(weight, (yield from store_item(ctx, ck, enc)))
    try:
        while True:
            put = yield from transitions.channel_put(ck, qkey, entry).call()
            if put.appended:
                return
            if put.missing:
                raise ChannelNotFound(f"channel {ck.name!r} was deleted")
            if not block:
                raise asyncio.QueueFull(f"channel {ck.name!r} queue {qkey!r} is full")
            yield from _wait(ck.gets, put.last_gets_id, deadline, f"channel {ck.name!r} queue {qkey!r} stayed full")
    except Exception:
        yield from drop_items(ctx, ck, [entry])  # never queued: nobody will read its bytes
        raise


def pop(ctx: ops.Context, ck: ChannelKeys, qkey: str, mode: str, target: float, block: bool,
        deadline: float | None = None) -> Op:
    """Pop one item (``mode="one"``) or head items by weight (``"fit"``: RLinf's rule; ``"exceed"``:
    the fewest that reach ``target``); FIFO. Returns the items, oldest first."""
    while True:
        if mode == _FIT:
            got = yield from transitions.channel_pop_fit(ck, qkey, target).call()
        else:
            got = yield from transitions.channel_pop(ck, qkey, None if mode == _ONE else target).call()
        if got.popped:
            return (yield from load_items(ctx, ck, got.entries))
        if got.missing:
            raise ChannelNotFound(f"channel {ck.name!r} does not exist (deleted?)")
        if not block:
            raise asyncio.QueueEmpty(f"channel {ck.name!r} queue {qkey!r} is empty")
        what = f"not enough arrived in channel {ck.name!r} queue {qkey!r}"
        yield from _wait(ck.puts, got.last_puts_id, deadline, what)


def peek(ctx: ops.Context, ck: ChannelKeys, qkey: str) -> Op:
    """The queued items of ``qkey`` with their weights, oldest first; nothing is removed."""
    out = []
    for entry in (yield Cmd(("LRANGE", ck.queue(qkey), 0, -1))):
        try:
            (item,) = yield from load_items(ctx, ck, [entry], consume=False)
        except DataMissing:  # popped by another consumer meanwhile: no longer queued
            continue
        out.append(WeightedItem(_entry_weight(entry), item))
    return out


def qsize(ck: ChannelKeys, qkey: str) -> Op:
    """Number of entries in queue ``qkey``."""
    return int((yield Cmd(("LLEN", ck.queue(qkey)))))


def delete(ctx: ops.Context, ck: ChannelKeys) -> Op:
    """Remove the channel's keys and the bytes of items still queued."""
    queues: list[bytes] = []
    cursor = b"0"
    while True:
        cursor, found = yield Cmd(("SCAN", cursor, "MATCH", ck.queue("*"), "COUNT", 1000))
        queues += found
        if int(cursor) == 0:
            break
    for q in queues:
        yield from drop_items(ctx, ck, (yield Cmd(("LRANGE", q, 0, -1))))
    yield Cmd(("DEL", ck.meta, ck.seq, ck.puts, ck.gets, *queues))


Start = Callable[[Any], Awaitable[Any]]


class _RedisOps:
    """Builds the executor jobs of a channel kept in Redis (each runs an operation above)."""

    def __init__(self, keys: ChannelKeys, allow_pickle: bool) -> None:
        self.keys = keys
        self.allow_pickle = allow_pickle

    qkey = staticmethod(key_token)

    def create(self, maxsize: int) -> Start:
        return lambda drv: drv.run(create(drv.ctx, self.keys, maxsize))

    def connect(self) -> Start:
        return lambda drv: drv.run(connect(self.keys))

    def put(self, item: Any, weight: Any, qkey: str, block: bool, deadline: float | None) -> Start:
        enc = encode_item(item, self.allow_pickle)  # now: errors raise here, later changes do not count
        return lambda drv: drv.run(put(drv.ctx, self.keys, enc, weight, qkey, block, deadline))

    def pop(self, qkey: str, mode: str, target: float, block: bool, deadline: float | None) -> Start:
        return lambda drv: drv.run(pop(drv.ctx, self.keys, qkey, mode, target, block, deadline))

    def peek(self, qkey: str) -> Start:
        return lambda drv: drv.run(peek(drv.ctx, self.keys, qkey))

    def qsize(self, qkey: str) -> Start:
        return lambda drv: drv.run(qsize(self.keys, qkey))

    def delete(self) -> Start:
        return lambda drv: drv.run(delete(drv.ctx, self.keys))


# ------------------------------------------------------------------ local channels


class _LocalState:
    """A local channel's queues: items kept as they are; touched only on its executor's thread."""

    def __init__(self, name: str, maxsize: int) -> None:
        self.name = name
        self.maxsize = maxsize
        self.queues: dict[Any, deque[WeightedItem]] = {}
        self._changed: asyncio.Future | None = None

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def _wait(self, deadline: float | None, what: str) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(what)
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        with _waiting():
            try:
                await asyncio.wait_for(asyncio.shield(self._changed), remaining)
            except TimeoutError:
                raise TimeoutError(what) from None

    async def put(self, item: Any, weight: Any, key: Any, block: bool, deadline: float | None) -> None:
        while True:
            queue = self.queues.setdefault(key, deque())
            if self.maxsize <= 0 or len(queue) < self.maxsize:
                queue.append(WeightedItem(weight, item))
                self._notify()
                return
            if not block:
                raise asyncio.QueueFull(f"local channel {self.name!r} queue {key!r} is full")
            await self._wait(deadline, f"local channel {self.name!r} queue {key!r} stayed full")

    async def pop(self, key: Any, mode: str, target: float, block: bool, deadline: float | None) -> list[Any]:
        while True:
            queue = self.queues.get(key, ())
            count = _take_count((w.weight for w in queue), mode, target)
            if count is not None:
                items = [queue.popleft().item for _ in range(count)]
                if items:
                    self._notify()
                return items
            if not block:
                raise asyncio.QueueEmpty(f"local channel {self.name!r} queue {key!r} is empty")
            await self._wait(deadline, f"not enough arrived in local channel {self.name!r} queue {key!r}")

    async def peek(self, key: Any) -> list[WeightedItem]:
        return list(self.queues.get(key, ()))

    async def qsize(self, key: Any) -> int:
        return len(self.queues.get(key, ()))

    async def clear(self) -> None:
        self.queues.clear()
        self._notify()

    async def close(self) -> None:
        self._notify()


class _LocalCore:
    """A local channel in this process: its state and executor (a fresh, empty pair after a fork)."""

    def __init__(self, name: str, maxsize: int, token: str) -> None:
        self.name = name
        self.maxsize = maxsize
        self.token = token
        self._executor: _Executor | None = None

    def executor(self) -> _Executor:
        if self._executor is None or self._executor.pid != os.getpid():
            state = _LocalState(self.name, self.maxsize)
            self._executor = _Executor(f"local:{self.name}", lambda: state, flush_at_exit=False)
            weakref.finalize(self, self._executor.close_soon).atexit = False
        return self._executor


class _LocalOps:
    """Builds the executor jobs of a local channel."""

    qkey = staticmethod(_local_key)

    def put(self, item: Any, weight: Any, qkey: Any, block: bool, deadline: float | None) -> Start:
        return lambda st: st.put(item, weight, qkey, block, deadline)

    def pop(self, qkey: Any, mode: str, target: float, block: bool, deadline: float | None) -> Start:
        return lambda st: st.pop(qkey, mode, target, block, deadline)

    def peek(self, qkey: Any) -> Start:
        return lambda st: st.peek(qkey)

    def qsize(self, qkey: Any) -> Start:
        return lambda st: st.qsize(qkey)

    def delete(self) -> Start:
        return lambda st: st.clear()


_LOCAL_CORES: weakref.WeakValueDictionary[str, _LocalCore] = weakref.WeakValueDictionary()


def _first(start: Start) -> Start:
    async def first(resource: Any) -> Any:
        return (await start(resource))[0]

    return first


# ------------------------------------------------------------------ the class


def resolve_target(redis_url: str | None, namespace: str | None) -> tuple[str, str, bool]:
    """(url, namespace, allow_pickle) from the arguments, ``tq_redis.init()``, the environment
    or, inside a Ray job, the system the job published (see :mod:`tq_redis.ray_discovery`)."""
    from tq_redis import ray_discovery
    from tq_redis.runtime import NotInitialized, get_client

    try:
        client = get_client()
    except NotInitialized:
        client = None
    if redis_url is None and client is not None:
        return client.redis_url, namespace or client.namespace, client.context.allow_pickle
    url = redis_url or os.environ.get("TQ_REDIS_URL")
    if not url:
        found = ray_discovery.lookup()
        if found is not None:
            return found["url"], namespace or os.environ.get("TQ_NAMESPACE") or found["namespace"], False
        raise ConfigError(
            "Channel needs the Redis URL: pass redis_url=, export TQ_REDIS_URL, or call tq_redis.init() first"
        )
    return url, namespace or os.environ.get("TQ_NAMESPACE") or "tq", False


def _check_maxsize(maxsize: Any) -> int:
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
        raise InvalidArgument(f"maxsize must be an int >= 0 (0 = unbounded), got {maxsize!r}")
    return maxsize


class Channel:
    """A named set of FIFO queues (one per ``key``) shared by every process that knows the name.

    Build one with :meth:`create` or :meth:`connect`. Weights let ``get_batch`` pop as many
    items as fit a target (e.g. a number of tokens or samples). Calls through one object run in
    the order they were made, ``async_op=True`` ones included (see the module docstring). A
    ``Channel`` pickles to its name and address, so it can be handed to worker processes.
    """

    def __init__(self, name: str, redis_url: str | None, namespace: str | None, maxsize: int, *,
                 allow_pickle: bool = False, _local: _LocalCore | None = None) -> None:
        self.name = name
        self.redis_url = redis_url
        self.namespace = namespace
        self._maxsize = maxsize
        self._allow_pickle = allow_pickle
        self._local = _local
        self._closed = False
        self._exec: _Executor | None = None
        if _local is None:
            self._keys = ChannelKeys(namespace, name)
            self._ops: _RedisOps | _LocalOps = _RedisOps(self._keys, allow_pickle)
        else:
            self._ops = _LocalOps()

    @classmethod
    def create(cls, name: str, maxsize: int = 0, distributed: bool = False, node_rank: int = 0,
               local: bool = False, disable_distributed_log: bool = True, *, redis_url: str | None = None,
               namespace: str | None = None, allow_pickle: bool | None = None) -> Channel:
        """Create the channel ``name`` (or join an existing one with the same ``maxsize``).

        ``maxsize`` bounds each key's queue (0: unbounded). Without ``redis_url`` the channel
        lives where ``tq_redis.init()`` attached (or ``TQ_REDIS_URL``/``TQ_NAMESPACE``).
        ``distributed``, ``node_rank`` and ``disable_distributed_log`` are RLinf's placement
        options and have no effect: the channel is in Redis, reachable from every node.

        ``local=True`` makes a channel of this process only, as in RLinf: its queues live in this
        process's memory (no Redis needed), items are kept as the objects themselves (tensors stay
        on their device), ``connect`` cannot reach it, and a copy sent to another process (pickled,
        or inherited through ``fork``) is a separate, empty channel there. Within the process every
        copy shares the queues. Everything else (keys, weights, ``maxsize``, blocking, timeouts,
        ``async_op``) works as for a shared channel.
        """
        _check_maxsize(maxsize)
        if isinstance(distributed, str):  # the earlier signature took redis_url third
            redis_url, distributed = distributed, False
        if local:
            if not isinstance(name, str):
                raise InvalidArgument(f"channel name must be a str, got {name!r}")
            core = _LocalCore(name, maxsize, uuid.uuid4().hex)
            _LOCAL_CORES[core.token] = core
            return cls(name, None, None, maxsize, _local=core)
        url, ns, pickle_default = resolve_target(redis_url, namespace)
        chan = cls(name, url, ns, maxsize, allow_pickle=pickle_default if allow_pickle is None else allow_pickle)
        chan._call(chan._ops.create(maxsize), None, False, False)
        return chan

    @classmethod
    def connect(cls, name: str, current_worker: Any = None, *, redis_url: str | None = None,
                namespace: str | None = None, allow_pickle: bool | None = None) -> Channel:
        """Attach to an existing channel; raises :class:`ChannelNotFound` if nobody created it.

        ``current_worker`` is RLinf's worker argument and is not needed here (a ``str`` in its
        place is taken as ``redis_url``, the earlier signature).
        """
        if isinstance(current_worker, str):
            redis_url = current_worker
        url, ns, pickle_default = resolve_target(redis_url, namespace)
        chan = cls(name, url, ns, 0, allow_pickle=pickle_default if allow_pickle is None else allow_pickle)
        chan._maxsize = chan._call(chan._ops.connect(), None, False, False)
        return chan

    def __reduce__(self):
        if self._local is not None:
            return (_attach_local, (self._local.token, self.name, self._maxsize))
        return (_attach, (self.name, self.redis_url, self.namespace, self._maxsize, self._allow_pickle))

    def __repr__(self) -> str:
        if self._local is not None:
            return f"Channel({self.name!r}, maxsize={self._maxsize}, local=True)"
        return f"Channel({self.name!r}, maxsize={self._maxsize}, namespace={self.namespace!r})"

    def __str__(self) -> str:
        """The items of the default queue with their weights, as RLinf prints a channel:
        ``[WeightedItem(weight=1, item='a'), ...]``."""
        return str(self.peek_all())

    @property
    def maxsize(self) -> int:
        """Most entries each key's queue holds (0: unbounded)."""
        return self._maxsize

    @property
    def is_local(self) -> bool:
        """True for a channel made with ``local=True``."""
        return self._local is not None

    # -- running calls

    def _executor(self) -> _Executor:
        if self._local is not None:
            return self._local.executor()
        ex = self._exec
        if ex is not None and ex.pid == os.getpid():
            return ex
        with _EXEC_LOCK:
            if self._closed:
                raise ChannelClosed(
                    f"channel handle {self.name!r} is closed; Channel.connect({self.name!r}) gives a new one"
                )
            if self._exec is None or self._exec.pid != os.getpid():  # first call, or a forked child
                url, ns, keys, pickle = self.redis_url, self.namespace, self._keys, self._allow_pickle
                self._exec = _Executor(f"{ns}:{self.name}", lambda: _open_driver(url, ns, keys, pickle),
                                       flush_at_exit=True)
                weakref.finalize(self, self._exec.close_soon).atexit = False
            return self._exec

    def _call(self, start: Start, lane: Any, is_put: bool, async_op: bool) -> Any:
        job = _Job(start, lane, is_put)
        work = None
        if async_op:
            work = ChannelWork(job, self)
            job.handle = weakref.ref(work)
        self._executor().submit(job)
        if work is not None:
            return work
        job.reported = True
        return job.future.result()

    # -- the queue API

    def put(self, item: Any, weight: float = 0, key: Any = DEFAULT_KEY, async_op: bool = False,
            timeout: float | None = None) -> ChannelWork | None:
        """Append ``item`` to queue ``key``, blocking while it is full (``TimeoutError`` after
        ``timeout`` seconds, if given). ``async_op=True`` returns a :class:`ChannelWork` at once;
        the put lands even if nobody waits on it."""
        _check_weight(weight)
        deadline, qkey = _deadline(timeout), self._ops.qkey(key)
        return self._call(self._ops.put(item, weight, qkey, True, deadline), ("put", qkey), True, async_op)

    def put_nowait(self, item: Any, weight: float = 0, key: Any = DEFAULT_KEY) -> None:
        """Append ``item``; raises ``asyncio.QueueFull`` if the queue holds ``maxsize`` items."""
        _check_weight(weight)
        qkey = self._ops.qkey(key)
        self._call(self._ops.put(item, weight, qkey, False, None), None, True, False)

    def get(self, key: Any = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None) -> Any:
        """Pop the oldest item of queue ``key``, waiting for one (``TimeoutError`` after ``timeout``
        seconds, if given). ``async_op=True`` returns a :class:`ChannelWork` of the item."""
        deadline, qkey = _deadline(timeout), self._ops.qkey(key)
        return self._call(_first(self._ops.pop(qkey, _ONE, 0.0, True, deadline)), ("get", qkey), False, async_op)

    def get_nowait(self, key: Any = DEFAULT_KEY) -> Any:
        """Pop the oldest item; raises ``asyncio.QueueEmpty`` if there is none."""
        qkey = self._ops.qkey(key)
        return self._call(_first(self._ops.pop(qkey, _ONE, 0.0, False, None)), None, False, False)

    def get_batch(self, target_weight: float = 0, key: Any = DEFAULT_KEY, async_op: bool = False,
                  timeout: float | None = None, *, allow_exceed: bool = False) -> list[Any] | ChannelWork:
        """Pop the oldest items of queue ``key`` by weight, all at once, oldest first.

        RLinf's rule: take head items while the next one still fits (taken weight + its weight <=
        ``target_weight``), stopping once the taken weight reaches the target. It waits while every
        queued item fits and together they weigh less than the target; it returns ``[]`` (taking
        nothing) when the head item alone is heavier than the target. With the default target 0
        it returns the head item if it weighs 0. ``allow_exceed=True`` instead takes the fewest
        head items whose weights reach the target (the last may overshoot it; target > 0).
        """
        target = _check_target(target_weight, allow_exceed)
        deadline, qkey = _deadline(timeout), self._ops.qkey(key)
        start = self._ops.pop(qkey, _EXCEED if allow_exceed else _FIT, target, True, deadline)
        return self._call(start, ("get", qkey), False, async_op)

    def peek_all(self, key: Any = DEFAULT_KEY) -> list[WeightedItem]:
        """The items queued under ``key`` with their weights, oldest first, without taking them."""
        return self._call(self._ops.peek(self._ops.qkey(key)), None, False, False)

    def qsize(self, key: Any = DEFAULT_KEY) -> int:
        """Number of items in queue ``key``."""
        return self._call(self._ops.qsize(self._ops.qkey(key)), None, False, False)

    def empty(self, key: Any = DEFAULT_KEY) -> bool:
        """True if queue ``key`` holds no item."""
        return self.qsize(key) == 0

    def full(self, key: Any = DEFAULT_KEY) -> bool:
        """True if queue ``key`` holds ``maxsize`` items (never for an unbounded channel)."""
        return self._maxsize > 0 and self.qsize(key) >= self._maxsize

    def delete(self) -> None:
        """Remove the channel and its queued items (call once nobody uses it)."""
        self._call(self._ops.delete(), None, False, False)

    def close(self, timeout: float | None = None) -> None:
        """Land every put issued through this object, then release its thread and connections.

        Gets still waiting fail with :class:`ChannelClosed`; calls made afterwards raise it. Raises
        ``TimeoutError`` if the puts have not landed within ``timeout`` seconds (they keep trying),
        and the error of an ``async_op=True`` put that failed with nobody calling ``wait()`` on it.
        The channel itself stays. A local channel has nothing to release: ``close`` does nothing.
        """
        if self._local is not None:
            return
        with _EXEC_LOCK:
            self._closed = True
            ex = self._exec
        if ex is not None and ex.pid == os.getpid():
            ex.close(timeout)


def _attach(name: str, redis_url: str, namespace: str, maxsize: int, allow_pickle: bool) -> Channel:
    return Channel(name, redis_url, namespace, maxsize, allow_pickle=allow_pickle)


def _attach_local(token: str, name: str, maxsize: int) -> Channel:
    core = _LOCAL_CORES.get(token)
    if core is None:  # another process: its own, empty local channel
        core = _LocalCore(name, maxsize, token)
        _LOCAL_CORES[token] = core
    return Channel(name, None, None, maxsize, _local=core)
