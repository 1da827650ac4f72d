"""Drivers that execute operations written once as generators, synchronously or with asyncio.

Every client operation in :mod:`tq_redis.ops` is a generator that *yields effects* (a Redis
command, a function call, a pipeline, blocking store I/O, a wait on an event stream, a pause) and receives
their results. :class:`SyncDriver` runs them with redis-py's blocking client; :class:`AsyncDriver`
runs the very same generators with ``redis.asyncio`` and moves blocking store I/O to a worker
thread. So ``TransferQueueClient`` and ``AsyncTransferQueueClient`` share one implementation.

Both get their Redis client from :mod:`tq_redis.server.connections`, so the same URL works for a single
server and for any node of a Redis Cluster. On a cluster a function call goes to the primary that
owns its first key (every key of a call shares that key's hash tag), a pipeline is split per node
by redis-py, and the function library is kept on every primary: loaded on all of them at first use,
its version checked once per node, and reloaded on the node that lost it (a restart without
persistence, ``FUNCTION FLUSH``, a new primary after a failover) when a call there fails with
"Function not found" -- that call is then retried once.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Generator
from functools import partial
from typing import Any

import redis
from redis.exceptions import AskError, RedisClusterException

from tq_redis import instruments
from tq_redis.errors import ConnectionFailed, TQError
from tq_redis.ops.effects import Cmd, FCall, Offload, Operation, Pause, Pipe, Unconfirmed, Wait, WaitThenCall, WaitToken
from tq_redis.server import connections, durability
from tq_redis.server import library as scripts
from tq_redis.server import policy as server_policy

# Redis could not be reached (a cluster that lost slots or kept moving counts too); store I/O
# errors derive from these as well and are told apart by the effect (see _as_redis_failure)
_CONNECTION_ERRORS = (
    redis.ConnectionError, redis.TimeoutError, OSError,
    redis.exceptions.ClusterError, redis.exceptions.SlotNotCoveredError,
)


def _fcall_args(call: FCall) -> tuple:
    return ("FCALL", f"tq_{call.name}", len(call.keys), *call.keys, *call.args)


def _as_args(call: Cmd | FCall) -> tuple:
    return _fcall_args(call) if isinstance(call, FCall) else call.args


def _connection_failed(url: str, exc: BaseException) -> ConnectionFailed:
    return ConnectionFailed(
        f"cannot reach Redis at {server_policy.redact(url)} ({exc}); check that the server is running and the "
        f"URL is right "
        f"(init() starts an embedded server only when no URL is configured)"
    )


def _as_redis_failure(url: str, effect: Any, exc: BaseException) -> BaseException:
    """A connection error of a Redis effect as ``ConnectionFailed``; store I/O errors pass unchanged.

    Store errors such as ``StorageUnavailable`` derive from ``ConnectionError`` (an ``OSError``) too;
    they name the store or node that failed and must not be reported as Redis being unreachable.
    """
    return exc if isinstance(effect, Offload) else _connection_failed(url, exc)


# A server busy in a long script answers BUSY to every other command, which then did not run: it is
# sent again after a pause (doubling from BUSY_PAUSE_S up to BUSY_PAUSE_MAX_S) for at most
# BUSY_WAIT_S, then ServerBusy is raised. Only what got BUSY is sent again (a pipeline's other calls ran).
BUSY_WAIT_S = 10.0
BUSY_PAUSE_S = 0.005
BUSY_PAUSE_MAX_S = 0.25


class _BusyWait:
    """The pauses of one effect's tries while the server answers BUSY, and when to give up."""

    __slots__ = ("started", "pause")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.pause = BUSY_PAUSE_S

    def next_pause(self, url: str, exc: BaseException) -> float:
        """Seconds to pause before the next try; raises ServerBusy once BUSY_WAIT_S are spent."""
        waited = time.monotonic() - self.started
        if waited >= BUSY_WAIT_S:
            raise server_policy.busy_error(url, exc, waited) from None
        pause = min(self.pause, BUSY_WAIT_S - waited)
        self.pause = min(self.pause * 2, BUSY_PAUSE_MAX_S)
        return pause


def _busy_positions(results: list) -> list[int]:
    return [i for i, r in enumerate(results) if server_policy.is_busy(r)]


# Durable mode (tq_redis.server.durability): what the waits of the operation being run in this thread or
# task found missing; run() raises NotDurable once the operation has finished.
_durable_shortfalls: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "tq_durable_shortfalls", default=None
)


def _durable_wait(setting: durability.Durability, calls: tuple) -> tuple | None:
    """The WAIT/WAITAOF to send after ``calls`` on their connection, or None (nothing to wait for)."""
    if any(isinstance(c, FCall) and setting.waits_after(c.name) for c in calls):
        return setting.command()
    return None


def _durable_results(setting: durability.Durability, results: list, wait: tuple | None) -> list:
    """``results`` without the wait's reply; a shortfall is noted for :func:`_durable_outcome`."""
    if wait is None:
        return results
    reply = results.pop()
    if isinstance(reply, Exception):
        raise reply
    missing = setting.shortfall(reply)
    notes = _durable_shortfalls.get()
    if missing is not None and notes is not None:
        notes.append(missing)
    return results


def _durable_outcome(driver: _Driver, notes: list[str], result: Any) -> Any:
    """The operation's result, or ``NotDurable`` carrying it if a wait found a write unconfirmed."""
    if notes:
        raise driver.durable.not_durable(server_policy.redact(driver.url), notes[0], result)
    return result


def _wait_ms(wait: Wait) -> int:
    return max(1, int(wait.timeout_s * 1000))


def _blpop_timeout(wait: WaitToken) -> float:
    # BLPOP takes seconds with decimals (Redis >= 6); 0 would mean "forever"
    return max(0.001, round(wait.timeout_s, 3))


def _blpop_args(wait: WaitToken) -> tuple:
    return ("BLPOP", wait.key, _blpop_timeout(wait))


def _missing_library(calls: tuple, results: list) -> list[int]:
    """Positions of the function calls whose reply says the library is not loaded where they ran."""
    return [
        i for i, (call, r) in enumerate(zip(calls, results))
        if isinstance(call, FCall) and isinstance(r, redis.ResponseError) and scripts.is_missing_function(r)
    ]


def _first_error(results: list, url: str, cluster: bool) -> list:
    """The pipeline's results, or raise the first error among them."""
    for r in results:
        if isinstance(r, AskError) and not cluster:
            raise connections.not_a_single_server(url, r) from r
        if isinstance(r, Exception):
            raise r
    return results


def _on(node: Any) -> dict[str, Any]:
    """Keyword arguments sending a command to ``node`` (None: the one server of a single-server client)."""
    return {} if node is None else {"target_nodes": node}


class _Library:
    """Which nodes are known to run this client's library version (a single server is one node, None)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.cluster = connections.is_cluster_client(client)
        self.current: set[str] = set()

    @staticmethod
    def name(node: Any) -> str:
        return "" if node is None else node.name

    def everywhere(self) -> list[Any]:
        """Every node that must hold the library: each primary of a cluster, or the one server."""
        return list(self.client.get_primaries()) if self.cluster else [None]

    def serving(self, calls: list | tuple) -> list[Any]:
        """The primaries that own the calls' first keys (every primary for a call without keys)."""
        if not self.cluster:
            return [None]
        nodes: dict[str, Any] = {}
        for call in calls:
            if not call.keys:
                return self.everywhere()
            node = self.client.get_node_from_key(call.keys[0])
            nodes[node.name] = node
        return list(nodes.values())

    def unchecked(self, calls: list | tuple) -> list[Any]:
        """Nodes to check before ``calls`` run: every node at first use, later only new ones."""
        nodes = self.serving(calls) if self.current else self.everywhere()
        return [n for n in nodes if self.name(n) not in self.current]

    def to_check(self, nodes: list[Any] | None, force: bool) -> list[Any]:
        nodes = self.everywhere() if nodes is None else nodes
        return [n for n in nodes if force or self.name(n) not in self.current]


_call_histograms: dict[str, Any] = {}


def _observe_call(name: str, seconds: float) -> None:
    hist = _call_histograms.get(name)
    if hist is None:
        hist = _call_histograms[name] = instruments.REDIS_CALL_SECONDS.labels(name)
    hist.observe(seconds)


class _Steps:
    """Drives one operation: each ``next`` sends in the last effect's result (or throws its error) and
    returns the next effect; when the operation returns, iteration stops and :attr:`result` holds it."""

    def __init__(self, op: Operation, url: str) -> None:
        self._op = op
        self._url = url
        self._value: Any = None
        self._error: BaseException | None = None
        self.result: Any = None
        self.notes: list[str] = []  # durable mode: the writes of this operation not confirmed in time
        self._token: contextvars.Token | None = None

    def __enter__(self) -> _Steps:
        self._token = _durable_shortfalls.set(self.notes)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _durable_shortfalls.reset(self._token)

    def __iter__(self) -> _Steps:
        return self

    def __next__(self) -> Any:
        try:
            return self._op.throw(self._error) if self._error is not None else self._op.send(self._value)
        except StopIteration as stop:
            self.result = stop.value
            raise StopIteration from None
        except TQError as exc:  # what leaves the public API, counted by type
            instruments.ERRORS.labels(type(exc).__name__).inc()
            raise

    def done(self, value: Any) -> None:
        self._value, self._error = value, None

    def failed(self, effect: Any, exc: BaseException) -> None:
        """Hand ``exc`` to the operation, which decides (a lost Redis connection as ``ConnectionFailed``,
        Redis's refusals -- ``NOPERM``, ``OOM``, a failed ``AUTH`` -- as the errors
        :func:`tq_redis.server.policy.typed_error` names)."""
        typed = server_policy.typed_error(self._url, exc)  # the redis store's refusals too
        if typed is not None:
            typed.__cause__ = exc
            exc = typed
        elif isinstance(exc, _CONNECTION_ERRORS):
            exc = _as_redis_failure(self._url, effect, exc)
        elif isinstance(exc, RedisClusterException):  # an asyncio cluster client that could not start
            exc = connections.cluster_failure(self._url, exc)
        elif isinstance(exc, redis.ResponseError):  # never raw out of the public API
            typed = server_policy.unexpected_reply(self._url, exc)
            typed.__cause__ = exc
            exc = typed
        self._value, self._error = None, exc


class _Driver:
    """What both drivers share: the URL, a client from :mod:`tq_redis.server.connections`, the library state.

    ``cluster``: True/False forces a cluster or single-server client; None decides as
    :mod:`tq_redis.server.connections` says. ``redis_kwargs`` are redis-py connection options.
    """

    _client: Callable[..., Any] = staticmethod(connections.sync_client)

    def __init__(self, url: str, *, cluster: bool | None = None, durable: Any = None, **redis_kwargs: Any) -> None:
        self.url = url
        # durable mode: None takes what init declared for the URL, else TQ_REDIS_DURABLE
        self.durable = durability.for_url(url) if durable is None else durability.parse(durable)
        self.redis = self._client(url, cluster=cluster, **redis_kwargs)
        self._library = _Library(self.redis)
        self._durable_checked = not self.durable.enabled
        if self.durable.enabled and self._library.cluster:
            raise durability.on_cluster(server_policy.redact(url), self.durable)

    @property
    def cluster(self) -> bool:
        """Whether this driver talks to a Redis Cluster."""
        return self._library.cluster


class _Checks:
    """Steps through a server-check generator (:func:`tq_redis.server.policy.node_checks`): it
    yields commands and is sent their replies, or thrown their errors; written once for both drivers."""

    def __init__(self, checks: Generator[Any, Any, Any]) -> None:
        self.checks = checks
        self.reply: Any = None
        self.error: BaseException | None = None

    def next_command(self) -> Any:
        try:
            return self.checks.send(self.reply) if self.error is None else self.checks.throw(self.error)
        except StopIteration:
            return None

    def answer(self, reply: Any = None, error: BaseException | None = None) -> None:
        self.reply, self.error = reply, error


class SyncDriver(_Driver):
    """Runs operations with a blocking redis-py client (one connection pool per driver)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        if self.durable.enabled:  # refuse an unfit server now (a server that is down is asked at first use)
            try:
                self._check_durable()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                pass

    def run(self, op: Operation) -> Any:
        """Drive ``op`` to completion and return its result (durable mode: see :mod:`tq_redis.server.durability`)."""
        with _Steps(op, self.url) as steps:
            for effect in steps:
                try:
                    steps.done(self._execute_patiently(effect))
                except Exception as exc:  # handed to the operation, which decides
                    steps.failed(effect, exc)
        return _durable_outcome(self, steps.notes, steps.result)

    def _execute_patiently(self, effect: Any) -> Any:
        """:meth:`_execute`, again while the server answers BUSY (the command did not run); a
        pipeline sends again only its calls that got BUSY (:meth:`_pipe`)."""
        busy = None
        while True:
            try:
                return self._execute(effect)
            except redis.ResponseError as exc:
                if not server_policy.is_busy(exc):
                    raise
                busy = busy or _BusyWait()
                time.sleep(busy.next_pause(self.url, exc))

    def _check_durable(self) -> None:
        """Once: does the server take this durable mode's wait? (``DurabilityUnsupported`` if not.)"""
        if not self._durable_checked:
            try:
                self.redis.execute_command(*durability.probe_command(self.durable))
            except redis.ResponseError as exc:
                raise durability.unsupported(server_policy.redact(self.url), self.durable, exc) from None
            self._durable_checked = True

    def _call(self, call: FCall) -> Any:
        """One function call; in durable mode followed by its wait in the same round trip."""
        if not self.durable.waits_after(call.name):
            return self.redis.execute_command(*_fcall_args(call))
        result = self._send((call,))[0]
        if isinstance(result, Exception):
            raise result
        return result

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
        if isinstance(effect, Pause):
            return time.sleep(effect.seconds)
        if isinstance(effect, Wait):
            with instruments.WAIT_SECONDS.time():
                return self.redis.xread({effect.stream: effect.last_id}, count=1, block=_wait_ms(effect))
        if isinstance(effect, WaitToken):
            with instruments.WAIT_SECONDS.time():
                return self.redis.blpop([effect.key], timeout=_blpop_timeout(effect)) is not None
        if isinstance(effect, WaitThenCall):
            return self._wait_then_call(effect)
        if isinstance(effect, Unconfirmed):
            return list(_durable_shortfalls.get() or ())
        raise TypeError(f"unknown effect {effect!r}")

    def _wait_then_call(self, effect: WaitThenCall) -> tuple[bool, Any]:
        call = effect.call
        replies = None
        if isinstance(self.redis, connections.SingleClient) and not self.durable.waits_after(call.name):
            self.ensure_loaded(nodes=self._library.unchecked((call,)))
            with instruments.WAIT_SECONDS.time():
                replies = self.redis.pipeline_on_lane([_blpop_args(effect.wait), _fcall_args(call)])
        if replies is None:  # the lane is busy or failed, or another kind of client: one after the other
            try:
                popped = self._execute(effect.wait)
            except redis.ResponseError as exc:
                if not server_policy.is_busy(exc):
                    raise
                popped = False  # the wait ended at once; the call goes out as it would after it
            return popped, self._execute_patiently(call)
        popped, reply = replies
        if server_policy.is_busy(popped):
            popped = None  # the wait ended at once; the call's own reply says whether it ran
        elif isinstance(popped, Exception):
            raise popped
        if isinstance(reply, redis.ResponseError) and scripts.is_missing_function(reply):
            reply = self._fcall(call)  # the server lost the library meanwhile: load it, call again
        elif server_policy.is_busy(reply):
            reply = self._execute_patiently(call)  # it did not run: send it again
        elif isinstance(reply, Exception):
            raise reply
        return popped is not None, reply

    def ensure_loaded(self, force: bool = False, nodes: list[Any] | None = None) -> None:
        """Check each of ``nodes`` (every primary by default) as :func:`tq_redis.server.policy.node_checks`
        says: its eviction policy, and that it runs exactly this library (loading it where allowed);
        ``force``: check again even nodes checked before."""
        for node in self._library.to_check(nodes, force):
            checks = _Checks(server_policy.node_checks(self.url, self._library.name(node)))
            while (command := checks.next_command()) is not None:
                try:
                    checks.answer(self.redis.execute_command(*command, **_on(node)))
                except redis.ResponseError as exc:
                    checks.answer(error=exc)
            self._library.current.add(self._library.name(node))

    def _fcall(self, call: FCall) -> Any:
        self.ensure_loaded(nodes=self._library.unchecked((call,)))
        try:
            return self._call(call)
        except redis.ResponseError as exc:
            if not scripts.is_missing_function(exc):
                raise
            self.ensure_loaded(force=True, nodes=self._library.serving((call,)))
            return self._call(call)

    def _pipe(self, effect: Pipe) -> list:
        fcalls = [c for c in effect.calls if isinstance(c, FCall)]
        if fcalls:
            self.ensure_loaded(nodes=self._library.unchecked(fcalls))
        results = self._send(effect.calls)
        missing = _missing_library(effect.calls, results)
        if missing:  # only the calls that found no library run again, after it is loaded where they ran
            again = tuple(effect.calls[i] for i in missing)
            self.ensure_loaded(force=True, nodes=self._library.serving(again))
            for i, result in zip(missing, self._send(again)):
                results[i] = result
        busy = None
        while refused := _busy_positions(results):  # only the calls that got BUSY, which did not run
            busy = busy or _BusyWait()
            time.sleep(busy.next_pause(self.url, results[refused[0]]))
            for i, result in zip(refused, self._send(tuple(effect.calls[i] for i in refused))):
                results[i] = result
        return _first_error(results, self.url, self.cluster)

    def _send(self, calls: tuple) -> list:
        wait = _durable_wait(self.durable, calls)
        if wait is not None:
            self._check_durable()
        elif isinstance(self.redis, connections.SingleClient):
            replies = self.redis.pipeline_on_lane([_as_args(call) for call in calls])
            if replies is not None:
                return replies
        pipe = self.redis.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*_as_args(call))
        if wait is not None:  # on the same connection, right after the writes it confirms
            pipe.execute_command(*wait)
        return _durable_results(self.durable, list(pipe.execute(raise_on_error=False)), wait)

    def close(self) -> None:
        self.redis.close()


class AsyncDriver(_Driver):
    """Runs the same operations with ``redis.asyncio``; store I/O goes to a worker thread.

    Takes the same arguments as :class:`SyncDriver`; the client connects on first use.
    """

    _client = staticmethod(connections.async_client)

    async def run(self, op: Operation) -> Any:
        """Drive ``op`` to completion and return its result (durable mode: see :mod:`tq_redis.server.durability`)."""
        with _Steps(op, self.url) as steps:
            for effect in steps:
                try:
                    steps.done(await self._execute_patiently(effect))
                except Exception as exc:  # handed to the operation, which decides
                    steps.failed(effect, exc)
        return _durable_outcome(self, steps.notes, steps.result)

    async def _execute_patiently(self, effect: Any, execute: Callable[[Any], Any] | None = None) -> Any:
        """As :meth:`SyncDriver._execute_patiently` (``execute``: what runs one try, ``_execute`` by default)."""
        execute = execute or self._execute
        busy = None
        while True:
            try:
                return await execute(effect)
            except redis.ResponseError as exc:
                if not server_policy.is_busy(exc):
                    raise
                busy = busy or _BusyWait()
                await asyncio.sleep(busy.next_pause(self.url, exc))

    async def _check_durable(self) -> None:
        """As :meth:`SyncDriver._check_durable` (asked at the first wait: this client connects lazily)."""
        if not self._durable_checked:
            try:
                await self.redis.execute_command(*durability.probe_command(self.durable))
            except redis.ResponseError as exc:
                raise durability.unsupported(server_policy.redact(self.url), self.durable, exc) from None
            self._durable_checked = True

    async def _call(self, call: FCall) -> Any:
        """As :meth:`SyncDriver._call`."""
        if not self.durable.waits_after(call.name):
            return await self.redis.execute_command(*_fcall_args(call))
        result = (await self._send((call,)))[0]
        if isinstance(result, Exception):
            raise result
        return result

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
        if isinstance(effect, Pause):
            return await asyncio.sleep(effect.seconds)
        if isinstance(effect, Wait):
            with instruments.WAIT_SECONDS.time():
                return await self.redis.xread({effect.stream: effect.last_id}, count=1, block=_wait_ms(effect))
        if isinstance(effect, WaitToken):
            with instruments.WAIT_SECONDS.time():
                return await self.redis.blpop([effect.key], timeout=_blpop_timeout(effect)) is not None
        if isinstance(effect, WaitThenCall):
            # one after the other; named, not dispatched, so a subclass's _execute (which may
            # hold a connection slot for this effect) is not entered twice
            try:
                popped = await AsyncDriver._execute(self, effect.wait)
            except redis.ResponseError as exc:
                if not server_policy.is_busy(exc):
                    raise
                popped = False  # the wait ended at once; the call goes out as it would after it
            return popped, await self._execute_patiently(effect.call, partial(AsyncDriver._execute, self))
        if isinstance(effect, Unconfirmed):
            return list(_durable_shortfalls.get() or ())
        raise TypeError(f"unknown effect {effect!r}")

    async def _unchecked(self, calls: list | tuple) -> list[Any]:
        if self.cluster and not self._library.current:
            await self.redis.initialize()  # the slot map, before the first routing decision
        return self._library.unchecked(calls)

    async def ensure_loaded(self, force: bool = False, nodes: list[Any] | None = None) -> None:
        """As :meth:`SyncDriver.ensure_loaded`."""
        if self.cluster and nodes is None:
            await self.redis.initialize()
        for node in self._library.to_check(nodes, force):
            checks = _Checks(server_policy.node_checks(self.url, self._library.name(node)))
            while (command := checks.next_command()) is not None:
                try:
                    checks.answer(await self.redis.execute_command(*command, **_on(node)))
                except redis.ResponseError as exc:
                    checks.answer(error=exc)
            self._library.current.add(self._library.name(node))

    async def _fcall(self, call: FCall) -> Any:
        await self.ensure_loaded(nodes=await self._unchecked((call,)))
        try:
            return await self._call(call)
        except redis.ResponseError as exc:
            if not scripts.is_missing_function(exc):
                raise
            await self.ensure_loaded(force=True, nodes=self._library.serving((call,)))
            return await self._call(call)

    async def _pipe(self, effect: Pipe) -> list:
        fcalls = [c for c in effect.calls if isinstance(c, FCall)]
        if fcalls:
            await self.ensure_loaded(nodes=await self._unchecked(fcalls))
        results = await self._send(effect.calls)
        missing = _missing_library(effect.calls, results)
        if missing:
            again = tuple(effect.calls[i] for i in missing)
            await self.ensure_loaded(force=True, nodes=self._library.serving(again))
            for i, result in zip(missing, await self._send(again)):
                results[i] = result
        busy = None
        while refused := _busy_positions(results):  # as SyncDriver._pipe
            busy = busy or _BusyWait()
            await asyncio.sleep(busy.next_pause(self.url, results[refused[0]]))
            for i, result in zip(refused, await self._send(tuple(effect.calls[i] for i in refused))):
                results[i] = result
        return _first_error(results, self.url, self.cluster)

    async def _send(self, calls: tuple) -> list:
        wait = _durable_wait(self.durable, calls)
        if wait is not None:
            await self._check_durable()
        pipe = self.redis.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*_as_args(call))
        if wait is not None:  # on the same connection, right after the writes it confirms
            pipe.execute_command(*wait)
        return _durable_results(self.durable, list(await pipe.execute(raise_on_error=False)), wait)

    async def close(self) -> None:
        await self.redis.aclose()
