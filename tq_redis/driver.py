"""Drivers that execute operations written once as generators, synchronously or with asyncio.

Every client operation in :mod:`tq_redis.ops` is a generator that *yields effects* (a Redis
command, a function call, a pipeline, blocking store I/O, a wait on an event stream) and receives
their results. :class:`SyncDriver` runs them with redis-py's blocking client; :class:`AsyncDriver`
runs the very same generators with ``redis.asyncio`` and moves blocking store I/O to a worker
thread. So ``TransferQueueClient`` and ``AsyncTransferQueueClient`` share one implementation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tq_redis import metrics, scripts
from tq_redis.errors import ConnectionFailed


@dataclass(frozen=True, slots=True)
class Cmd:
    """A plain Redis command."""

    args: tuple


@dataclass(frozen=True, slots=True)
class FCall:
    """Call a function of the tq_redis library (``FCALL tq_<name>``)."""

    name: str
    keys: tuple
    args: tuple


@dataclass(frozen=True, slots=True)
class Pipe:
    """Several commands / function calls in one round trip (not a transaction)."""

    calls: tuple


@dataclass(frozen=True, slots=True)
class Offload:
    """Blocking work (store I/O): run inline by the sync driver, in a thread by the async one."""

    fn: Callable[..., Any]
    args: tuple


@dataclass(frozen=True, slots=True)
class Wait:
    """Block until an entry newer than ``last_id`` is added to ``stream`` or ``timeout_s`` passes."""

    stream: str
    last_id: str
    timeout_s: float


@dataclass(frozen=True)
class WaitToken:
    """Block until a token can be popped from the list ``key`` (``BLPOP``) or ``timeout_s`` passes.

    Returns whether a token was taken.
    """

    key: str
    timeout_s: float


Operation = Generator[Any, Any, Any]

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


def connection_options(retry_class: type) -> dict[str, Any]:
    """Reconnect with backoff across a Redis restart (~6 s in all) before giving up. redis.asyncio
    needs its own Retry class: it awaits its retries, a sync ``Retry`` is never applied."""
    return {
        "retry": retry_class(ExponentialBackoff(cap=1.0, base=0.05), retries=12),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "health_check_interval": 30,
    }


def _fcall_args(call: FCall) -> tuple:
    return ("FCALL", f"tq_{call.name}", len(call.keys), *call.keys, *call.args)


def _as_args(call: Cmd | FCall) -> tuple:
    return _fcall_args(call) if isinstance(call, FCall) else call.args


def _connection_failed(url: str, exc: BaseException) -> ConnectionFailed:
    return ConnectionFailed(
        f"cannot reach Redis at {url} ({exc}); check that the server is running and the URL is right "
        f"(init() starts an embedded server only when no URL is configured)"
    )


def _as_redis_failure(url: str, effect: Any, exc: BaseException) -> BaseException:
    """A connection error of a Redis effect as ``ConnectionFailed``; store I/O errors pass unchanged.

    Store errors such as ``StorageUnavailable`` derive from ``ConnectionError`` (an ``OSError``) too;
    they name the store or node that failed and must not be reported as Redis being unreachable.
    """
    return exc if isinstance(effect, Offload) else _connection_failed(url, exc)


def _wait_ms(wait: Wait) -> int:
    return max(1, int(wait.timeout_s * 1000))


def _blpop_timeout(wait: WaitToken) -> float:
    # BLPOP takes seconds with decimals (Redis >= 6); 0 would mean "forever"
    return max(0.001, round(wait.timeout_s, 3))


def _library_is_current(reply: Any) -> bool:
    """Whether ``FCALL tq_version`` answered with this client's library version."""
    return reply is not None and reply.decode() == scripts.library()[1]


def _pipeline_results(results: list, first_attempt: bool) -> list | None:
    """The results, None when the library must be reloaded and the pipeline re-sent, or raise."""
    if first_attempt and any(
        isinstance(r, redis.ResponseError) and scripts.is_missing_function(r) for r in results
    ):
        return None
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


_call_histograms: dict[str, Any] = {}


def _observe_call(name: str, seconds: float) -> None:
    hist = _call_histograms.get(name)
    if hist is None:
        hist = _call_histograms[name] = metrics.REDIS_CALL_SECONDS.labels(name)
    hist.observe(seconds)


class SyncDriver:
    """Runs operations with a blocking redis-py client (one connection pool per driver)."""

    def __init__(self, url: str, **redis_kwargs: Any) -> None:
        self.url = url
        self.redis = redis.Redis.from_url(url, **{**connection_options(Retry), **redis_kwargs})
        self._loaded = False

    def run(self, op: Operation) -> Any:
        """Drive ``op`` to completion and return its result."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = op.throw(error) if error is not None else op.send(value)
            except StopIteration as stop:
                return stop.value
            try:
                value, error = self._execute(effect), None
            except _CONNECTION_ERRORS as exc:
                value, error = None, _as_redis_failure(self.url, effect, exc)
            except Exception as exc:  # handed to the operation, which decides
                value, error = None, exc

    def _execute(self, effect: Any) -> Any:
        if isinstance(effect, FCall):
            started = time.perf_counter()
            result = self._fcall(effect)
            _observe_call(effect.name, time.perf_counter() - started)
            return result
        if isinstance(effect, Cmd):
            return self.redis.execute_command(*effect.args)
        if isinstance(effect, Pipe):
            return self._pipe(effect)
        if isinstance(effect, Offload):
            return effect.fn(*effect.args)
        if isinstance(effect, Wait):
            with metrics.WAIT_SECONDS.time():
                return self.redis.xread({effect.stream: effect.last_id}, count=1, block=_wait_ms(effect))
        if isinstance(effect, WaitToken):
            with metrics.WAIT_SECONDS.time():
                return self.redis.blpop([effect.key], timeout=_blpop_timeout(effect)) is not None
        raise TypeError(f"unknown effect {effect!r}")

    def ensure_loaded(self, force: bool = False) -> None:
        """Load the Lua library unless the server already has this exact version."""
        if self._loaded and not force:
            return
        try:
            current = self.redis.execute_command("FCALL", "tq_version", 0)
        except redis.ResponseError:
            current = None
        if not _library_is_current(current):
            self.redis.execute_command("FUNCTION", "LOAD", "REPLACE", scripts.library()[0])
        self._loaded = True

    def _fcall(self, call: FCall) -> Any:
        self.ensure_loaded()
        try:
            return self.redis.execute_command(*_fcall_args(call))
        except redis.ResponseError as exc:
            if not scripts.is_missing_function(exc):
                raise
            self.ensure_loaded(force=True)
            return self.redis.execute_command(*_fcall_args(call))

    def _pipe(self, effect: Pipe) -> list:
        if any(isinstance(c, FCall) for c in effect.calls):
            self.ensure_loaded()
        for attempt in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for call in effect.calls:
                pipe.execute_command(*_as_args(call))
            results = _pipeline_results(pipe.execute(raise_on_error=False), attempt == 0)
            if results is not None:
                return results
            self.ensure_loaded(force=True)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.redis.close()


class AsyncDriver:
    """Runs the same operations with ``redis.asyncio``; store I/O goes to a worker thread."""

    def __init__(self, url: str, **redis_kwargs: Any) -> None:
        self.url = url
        self.redis = aioredis.Redis.from_url(url, **{**connection_options(AsyncRetry), **redis_kwargs})
        self._loaded = False

    async def run(self, op: Operation) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = op.throw(error) if error is not None else op.send(value)
            except StopIteration as stop:
                return stop.value
            try:
                value, error = await self._execute(effect), None
            except _CONNECTION_ERRORS as exc:
                value, error = None, _as_redis_failure(self.url, effect, exc)
            except Exception as exc:
                value, error = None, exc

    async def _execute(self, effect: Any) -> Any:
        if isinstance(effect, FCall):
            started = time.perf_counter()
            result = await self._fcall(effect)
            _observe_call(effect.name, time.perf_counter() - started)
            return result
        if isinstance(effect, Cmd):
            return await self.redis.execute_command(*effect.args)
        if isinstance(effect, Pipe):
            return await self._pipe(effect)
        if isinstance(effect, Offload):
            return await asyncio.to_thread(effect.fn, *effect.args)
        if isinstance(effect, Wait):
            with metrics.WAIT_SECONDS.time():
                return await self.redis.xread({effect.stream: effect.last_id}, count=1, block=_wait_ms(effect))
        if isinstance(effect, WaitToken):
            with metrics.WAIT_SECONDS.time():
                return await self.redis.blpop([effect.key], timeout=_blpop_timeout(effect)) is not None
        raise TypeError(f"unknown effect {effect!r}")

    async def ensure_loaded(self, force: bool = False) -> None:
        if self._loaded and not force:
            return
        try:
            current = await self.redis.execute_command("FCALL", "tq_version", 0)
        except redis.ResponseError:
            current = None
        if not _library_is_current(current):
            await self.redis.execute_command("FUNCTION", "LOAD", "REPLACE", scripts.library()[0])
        self._loaded = True

    async def _fcall(self, call: FCall) -> Any:
        await self.ensure_loaded()
        try:
            return await self.redis.execute_command(*_fcall_args(call))
        except redis.ResponseError as exc:
            if not scripts.is_missing_function(exc):
                raise
            await self.ensure_loaded(force=True)
            return await self.redis.execute_command(*_fcall_args(call))

    async def _pipe(self, effect: Pipe) -> list:
        if any(isinstance(c, FCall) for c in effect.calls):
            await self.ensure_loaded()
        for attempt in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for call in effect.calls:
                pipe.execute_command(*_as_args(call))
            results = _pipeline_results(await pipe.execute(raise_on_error=False), attempt == 0)
            if results is not None:
                return results
            await self.ensure_loaded(force=True)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.redis.aclose()
