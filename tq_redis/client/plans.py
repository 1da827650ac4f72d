"""Every decision of running an operation, written once: each effect's plan as a generator of I/O requests.

An operation (:mod:`tq_redis.ops`) yields effects; :meth:`Plans.operation` turns it into a *plan*:
a generator that yields low-level I/O requests -- call a method of the Redis client (:class:`Call`),
send several commands in one round trip (:class:`Batch`), sleep (:class:`Sleep`), run blocking work
(:class:`Work`) -- and is sent each reply, or thrown its error. What to send, what to retry and how
long to wait is decided here: the function library loaded where a call runs and the call sent again
once when the server lost it (NOSCRIPT / "Function not found"), the pauses while the server answers
BUSY, durable mode's WAIT/WAITAOF after the writes it confirms and ``NotDurable`` when one fell short,
the typed errors an operation is handed, the call and wait timings. The drivers in
:mod:`tq_redis.client.driver` only carry the requests out, blocking or with asyncio (as psycopg 3's
``generators.py`` decides and its ``waiting.py`` only waits). A plan does no I/O and reads no global
state of the process: what it needs is the driver's state (:class:`Plans`).

**Retries, and why each is safe** (the one place this is written down; ``docs/operations/failover.md``,
"Lost replies", says it for users). A call may be sent more than once: redis-py sends a command again after a
``ConnectionError``/``TimeoutError`` with backoff (:func:`tq_redis.server.connections.connection_options`:
a reply lost to a dropped connection, a Redis restarting), and re-sends a whole pipeline; a blocking
client whose lane fails sends its command again the pool's way; this module sends a call again once
after the server lost the library, and again after ``BUSY`` (which did not run it). So that none of
these acts twice, :meth:`Plans.operation` gives every call of a script that writes one request id when
the operation yields it (:func:`with_record`): its record key ``<prefix>rq:<id>`` goes last in its KEYS
(:func:`tq_redis.server.library.record_key`), and the script records its reply there
(``lua/includes/requests.lua``, two minutes); every resend of that call, by redis-py or by a plan, carries
the same key and gets the recorded reply. A retried ``fetch`` claim returns the batch it claimed,
a retried ``commit_group`` its first reply. Each yield of an effect is a new logical call with a new id
(an operation that claims again after an empty batch asks anew). What is not recorded, and why it
may run twice: the scripts of :data:`tq_redis.server.library.UNRECORDED` only read; the plain commands
operations send are idempotent by nature (reads, ``ZADD NX``, ``SADD``/``SREM``/``ZREM``, ``HSETNX``, ``DEL``,
``HSET`` of the same values), except ``INCRBY`` of a channel's data-plane id counter, whose repeat only
skips ids (never reused), and ``reopen_partition``'s ``DEL``, whose repeat reports False for a partition it
did reopen. A wake token ``BLPOP`` whose reply is lost is not re-sent on a blocking client's lane (the
claim behind it goes out at once, :meth:`Plans._wait_then_call`); elsewhere redis-py's resend waits for
the next token or the wait's timeout, and the claim after it finds what is ready: a sample is never lost.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from typing import Any

import redis
from redis.exceptions import AskError, RedisClusterException

from tq_redis import instruments
from tq_redis.errors import ConnectionFailed, TQError
from tq_redis.ops.effects import Cmd, FCall, Offload, Operation, Pause, Pipe, Unconfirmed, Wait, WaitThenCall, WaitToken
from tq_redis.server import connections, durability
from tq_redis.server import library as scripts
from tq_redis.server import policy as server_policy

# ------------------------------------------------------------------ the I/O requests a plan yields


@dataclass(frozen=True, slots=True)
class Call:
    """Call ``method`` of the driver's Redis client with these arguments; the reply comes back."""

    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Batch:
    """Send ``commands`` in one round trip (a pipeline, not a transaction); the replies come back in
    order, an error among them as an exception object in its place."""

    commands: tuple[tuple, ...]


@dataclass(frozen=True, slots=True)
class Sleep:
    """Pause ``seconds``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Work:
    """Run blocking work (store I/O), ``fn(*args)``: inline by the blocking driver, in a worker thread
    by the asyncio one."""

    fn: Any
    args: tuple


Plan = Generator[Any, Any, Any]

# ------------------------------------------------------------------ what the decisions use

# Redis could not be reached (a cluster that lost slots or kept moving counts too); store I/O
# errors derive from these as well and are told apart by the effect (see _as_redis_failure)
_CONNECTION_ERRORS = (
    redis.ConnectionError, redis.TimeoutError, OSError,
    redis.exceptions.ClusterError, redis.exceptions.SlotNotCoveredError,
)


class RequestIds:
    """Request ids of one driver: 16 random hex digits drawn once (again in a forked child, whose
    driver copy must not repeat its parent's ids), then a counter: no system call per call. Two
    drivers share a prefix by a 1 in 2**64 chance."""

    def __init__(self) -> None:
        self._pid = 0
        self._prefix = ""
        self._counter: Any = None

    def __call__(self) -> str:
        if self._pid != os.getpid():
            self._prefix, self._counter, self._pid = os.urandom(8).hex(), itertools.count(), os.getpid()
        return f"{self._prefix}{next(self._counter):x}"


def _recorded(call: FCall, new_id: Any) -> FCall:
    # scripts.records / scripts.record_key, written out: this runs once per call of every operation
    if call.name in scripts.UNRECORDED or not call.keys:
        return call
    return replace(call, keys=(*call.keys, f"{call.keys[0][:-4]}rq:{new_id()}"))  # the same script, one key more


def with_record(effect: Any, new_id: Any) -> Any:
    """``effect`` with a request record key (its id from ``new_id()``) added to each of its calls of a
    script that writes (see the module docstring); every other effect as it is."""
    if isinstance(effect, FCall):
        return _recorded(effect, new_id)
    if isinstance(effect, Pipe):
        return Pipe(tuple(_recorded(c, new_id) if isinstance(c, FCall) else c for c in effect.calls))
    if isinstance(effect, WaitThenCall):
        return WaitThenCall(effect.wait, _recorded(effect.call, new_id))
    return effect


def _fcall_args(call: FCall) -> tuple:
    return ("FCALL", f"tq_{call.name}", len(call.keys), *call.keys, *call.args)


def _as_args(call: Cmd | FCall) -> tuple:
    return _fcall_args(call) if isinstance(call, FCall) else call.args


#: redis-py's "Too many connections" (a pool at its cap); a class of its own since redis-py 5.1
_POOL_FULL = getattr(redis.exceptions, "MaxConnectionsError", ())


def _connection_failed(url: str, exc: BaseException) -> ConnectionFailed:
    if isinstance(exc, _POOL_FULL) or str(exc) == "Too many connections":
        return ConnectionFailed(
            f"this client's connection pool to Redis at {server_policy.redact(url)} is full ({exc}): more "
            f"calls were in flight at once than its {connections.POOL_MAX_CONNECTIONS} connections (the server "
            f"is reachable); share fewer callers per client, or use one client per worker"
        )
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


def handed_over(url: str, effect: Any, exc: BaseException) -> BaseException:
    """The error an operation is handed for ``exc``, raised by ``effect``: a lost Redis connection as
    ``ConnectionFailed``, Redis's refusals -- ``NOPERM``, ``OOM``, a failed ``AUTH`` -- as the errors
    :func:`tq_redis.server.policy.typed_error` names, any other reply error as an unexpected reply."""
    typed = server_policy.typed_error(url, exc)  # the redis store's refusals too
    if typed is not None:
        typed.__cause__ = exc
        return typed
    if isinstance(exc, _CONNECTION_ERRORS):
        return _as_redis_failure(url, effect, exc)
    if isinstance(exc, RedisClusterException):  # an asyncio cluster client that could not start
        return connections.cluster_failure(url, exc)
    if isinstance(exc, redis.ResponseError):  # never raw out of the public API
        typed = server_policy.unexpected_reply(url, exc)
        typed.__cause__ = exc
        return typed
    return exc


def _busy_positions(results: list) -> list[int]:
    return [i for i, r in enumerate(results) if server_policy.is_busy(r)]


def _durable_wait(setting: durability.Durability, calls: tuple) -> tuple | None:
    """The WAIT/WAITAOF to send after ``calls`` on their connection, or None (nothing to wait for)."""
    if any(isinstance(c, FCall) and setting.waits_after(c.name) for c in calls):
        return setting.command()
    return None


def _durable_results(setting: durability.Durability, results: list, wait: tuple | None, notes: list[str]) -> list:
    """``results`` without the wait's reply; a shortfall is added to the operation's ``notes``."""
    if wait is None:
        return results
    reply = results.pop()
    if isinstance(reply, Exception):
        raise reply
    missing = setting.shortfall(reply)
    if missing is not None:
        notes.append(missing)
    return results


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


class Steps:
    """Steps through a generator that yields requests and is sent their replies (or thrown their errors):
    iterating gives the next request; :meth:`answer` hands in what it came to; once the generator
    returns, iteration stops and :attr:`result` holds its value. What each driver's loop runs on."""

    def __init__(self, plan: Generator[Any, Any, Any]) -> None:
        self._plan = plan
        self._reply: Any = None
        self._error: BaseException | None = None
        self.result: Any = None

    def __iter__(self) -> Steps:
        return self

    def __next__(self) -> Any:
        try:
            return self._plan.send(self._reply) if self._error is None else self._plan.throw(self._error)
        except StopIteration as stop:
            self.result = stop.value
            raise StopIteration from None

    def answer(self, reply: Any = None, error: BaseException | None = None) -> None:
        self._reply, self._error = reply, error


# ------------------------------------------------------------------ the decisions


class Plans:
    """A driver's state and the plans built from it; :mod:`tq_redis.client.driver` adds how requests are done.

    ``cluster``: True/False forces a cluster or single-server client; None decides as
    :mod:`tq_redis.server.connections` says. ``redis_kwargs`` are redis-py connection options.
    """

    _client: Any = staticmethod(connections.sync_client)
    # an asyncio cluster client learns its slot map at first use, before the first routing decision
    _connects_lazily = False

    def __init__(self, url: str, *, cluster: bool | None = None, durable: Any = None, **redis_kwargs: Any) -> None:
        self.url = url
        # durable mode: None takes what init declared for the URL, else TQ_REDIS_DURABLE
        self.durable = durability.for_url(url) if durable is None else durability.parse(durable)
        self.redis = self._client(url, cluster=cluster, **redis_kwargs)
        self._library = _Library(self.redis)
        self._request_id = RequestIds()  # one per call of a script that writes (module docstring)
        # a blocking single-server client can send a round trip on its lane (connections.SingleClient)
        self._lane = isinstance(self.redis, connections.SingleClient)
        self._durable_checked = not self.durable.enabled
        if self.durable.enabled and self._library.cluster:
            raise durability.on_cluster(server_policy.redact(url), self.durable)

    @property
    def cluster(self) -> bool:
        """Whether this driver talks to a Redis Cluster."""
        return self._library.cluster

    def _pipeline(self, commands: tuple[tuple, ...]) -> Any:
        """A pipeline of the driver's client with ``commands`` queued (nothing sent yet)."""
        pipe = self.redis.pipeline(transaction=False)
        for args in commands:
            pipe.execute_command(*args)
        return pipe

    def operation(self, op: Operation) -> Plan:
        """Drive ``op`` to its result: each effect's plan, its outcome sent in (or its error, typed by
        :func:`handed_over`, thrown in: the operation decides). Durable mode: ``NotDurable`` carrying
        the result if a wait found a write of the operation unconfirmed (:mod:`tq_redis.server.durability`)."""
        notes: list[str] = []  # durable mode: the writes of this operation not confirmed in time
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = op.throw(error) if error is not None else op.send(value)
            except StopIteration as stop:
                result = stop.value
                break
            except TQError as exc:  # what leaves the public API, counted by type
                instruments.ERRORS.labels(type(exc).__name__).inc()
                raise
            try:
                value, error = (yield from self._patiently(with_record(effect, self._request_id), notes)), None
            except Exception as exc:  # handed to the operation, which decides
                value, error = None, handed_over(self.url, effect, exc)
        if notes:
            raise self.durable.not_durable(server_policy.redact(self.url), notes[0], result)
        return result

    def _patiently(self, effect: Any, notes: list[str]) -> Plan:
        """:meth:`_attempt`, again while the server answers BUSY (the command did not run); a
        pipeline sends again only its calls that got BUSY (:meth:`_pipe`)."""
        busy = None
        while True:
            try:
                return (yield from self._attempt(effect, notes))
            except redis.ResponseError as exc:
                if not server_policy.is_busy(exc):
                    raise
                busy = busy or server_policy.BusyWait()
                yield Sleep(busy.next_pause(self.url, exc))

    def _attempt(self, effect: Any, notes: list[str]) -> Plan:
        """One try of ``effect``."""
        if isinstance(effect, FCall):
            started = time.perf_counter()
            result = yield from self._fcall(effect, notes)
            _observe_call(effect.name, time.perf_counter() - started)
            return result
        if isinstance(effect, Cmd):
            return (yield Call("execute_command", effect.args))
        if isinstance(effect, Pipe):
            return (yield from self._pipe(effect, notes))
        if isinstance(effect, Offload):
            return (yield Work(effect.fn, effect.args))
        if isinstance(effect, Pause):
            return (yield Sleep(effect.seconds))
        if isinstance(effect, Wait):
            with instruments.WAIT_SECONDS.time():
                streams = {effect.stream: effect.last_id}
                return (yield Call("xread", (streams,), {"count": 1, "block": _wait_ms(effect)}))
        if isinstance(effect, WaitToken):
            with instruments.WAIT_SECONDS.time():
                return (yield Call("blpop", ([effect.key],), {"timeout": _blpop_timeout(effect)})) is not None
        if isinstance(effect, WaitThenCall):
            return (yield from self._wait_then_call(effect, notes))
        if isinstance(effect, Unconfirmed):
            return list(notes)
        raise TypeError(f"unknown effect {effect!r}")

    def _check_durable(self) -> Plan:
        """Once: does the server take this durable mode's wait? (``DurabilityUnsupported`` if not.)"""
        if not self._durable_checked:
            try:
                yield Call("execute_command", durability.probe_command(self.durable))
            except redis.ResponseError as exc:
                raise durability.unsupported(server_policy.redact(self.url), self.durable, exc) from None
            self._durable_checked = True

    def _call(self, call: FCall, notes: list[str]) -> Plan:
        """One function call; in durable mode followed by its wait in the same round trip."""
        if not self.durable.waits_after(call.name):
            return (yield Call("execute_command", _fcall_args(call)))
        result = (yield from self._send((call,), notes))[0]
        if isinstance(result, Exception):
            raise result
        return result

    def _wait_then_call(self, effect: WaitThenCall, notes: list[str]) -> Plan:
        call = effect.call
        replies = None
        if self._lane and not self.durable.waits_after(call.name):
            yield from self._ensure_loaded(nodes=self._library.unchecked((call,)))
            with instruments.WAIT_SECONDS.time():
                replies = yield Call("pipeline_on_lane", ([_blpop_args(effect.wait), _fcall_args(call)],))
            if replies is connections.LANE_LOST:  # the wait may have taken its token: no second wait
                return False, (yield from self._patiently(call, notes))
        if replies is None:  # the lane is busy, or another kind of client: one after the other
            try:
                popped = yield from self._attempt(effect.wait, notes)
            except redis.ResponseError as exc:
                if not server_policy.is_busy(exc):
                    raise
                popped = False  # the wait ended at once; the call goes out as it would after it
            return popped, (yield from self._patiently(call, notes))
        popped, reply = replies
        if server_policy.is_busy(popped):
            popped = None  # the wait ended at once; the call's own reply says whether it ran
        elif isinstance(popped, Exception):
            raise popped
        if isinstance(reply, redis.ResponseError) and scripts.is_missing_function(reply):
            reply = yield from self._fcall(call, notes)  # the server lost the library meanwhile: load it, call again
        elif server_policy.is_busy(reply):
            reply = yield from self._patiently(call, notes)  # it did not run: send it again
        elif isinstance(reply, Exception):
            raise reply
        return popped is not None, reply

    def _unchecked(self, calls: list | tuple) -> Plan:
        if self._connects_lazily and self.cluster and not self._library.current:
            yield Call("initialize")  # the slot map, before the first routing decision
        return self._library.unchecked(calls)

    def _ensure_loaded(self, force: bool = False, nodes: list[Any] | None = None) -> Plan:
        """Check each of ``nodes`` (every primary by default) as :func:`tq_redis.server.policy.node_checks`
        says: its eviction policy, and that it runs exactly this library (loading it where allowed);
        ``force``: check again even nodes checked before."""
        if self._connects_lazily and self.cluster and nodes is None:
            yield Call("initialize")
        for node in self._library.to_check(nodes, force):
            checks = Steps(server_policy.node_checks(self.url, self._library.name(node)))
            for command in checks:
                try:
                    checks.answer((yield Call("execute_command", command, _on(node))))
                except redis.ResponseError as exc:
                    checks.answer(error=exc)
            self._library.current.add(self._library.name(node))

    def _fcall(self, call: FCall, notes: list[str]) -> Plan:
        unchecked = yield from self._unchecked((call,))
        if unchecked:  # nothing to check once every node it runs on was checked (the common case)
            yield from self._ensure_loaded(nodes=unchecked)
        try:
            return (yield from self._call(call, notes))
        except redis.ResponseError as exc:
            if not scripts.is_missing_function(exc):
                raise
            yield from self._ensure_loaded(force=True, nodes=self._library.serving((call,)))
            return (yield from self._call(call, notes))

    def _pipe(self, effect: Pipe, notes: list[str]) -> Plan:
        fcalls = [c for c in effect.calls if isinstance(c, FCall)]
        if fcalls and (unchecked := (yield from self._unchecked(fcalls))):
            yield from self._ensure_loaded(nodes=unchecked)
        results = yield from self._send(effect.calls, notes)
        missing = _missing_library(effect.calls, results)
        if missing:  # only the calls that found no library run again, after it is loaded where they ran
            again = tuple(effect.calls[i] for i in missing)
            yield from self._ensure_loaded(force=True, nodes=self._library.serving(again))
            for i, result in zip(missing, (yield from self._send(again, notes))):
                results[i] = result
        busy = None
        while refused := _busy_positions(results):  # only the calls that got BUSY, which did not run
            busy = busy or server_policy.BusyWait()
            yield Sleep(busy.next_pause(self.url, results[refused[0]]))
            for i, result in zip(refused, (yield from self._send(tuple(effect.calls[i] for i in refused), notes))):
                results[i] = result
        return _first_error(results, self.url, self.cluster)

    def _send(self, calls: tuple, notes: list[str]) -> Plan:
        """``calls`` in one round trip, their replies in order (errors included); in durable mode
        followed by the wait, on the same connection, right after the writes it confirms."""
        wait = _durable_wait(self.durable, calls)
        if wait is not None:
            yield from self._check_durable()
        elif self._lane:
            replies = yield Call("pipeline_on_lane", ([_as_args(call) for call in calls],))
            if replies is not None and replies is not connections.LANE_LOST:
                return replies
        commands = tuple(_as_args(call) for call in calls) + ((wait,) if wait is not None else ())
        return _durable_results(self.durable, list((yield Batch(commands))), wait, notes)
