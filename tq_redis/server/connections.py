"""Every Redis connection of tq-redis is built here: blocking or asyncio, one server or a Redis Cluster.

A URL is all a client needs: ``redis://host:port`` of a single server, or of *any* node of a Redis
Cluster (``rediss://`` for TLS, ``unix:///path.sock`` for a local single server). TLS options go in
the URL's query as redis-py reads them: ``rediss://host:6380/0?ssl_ca_certs=/etc/tq/ca.pem`` (the CA
that signed the server's certificate; the host name is checked against it), plus ``ssl_certfile``
and ``ssl_keyfile`` for a server that asks clients for certificates (``tls-auth-clients yes``);
credentials go in the URL too: ``rediss://USER:PASSWORD@host:6380/0``. Whether the URL
names a cluster is decided per URL, by the first of these that says so:

1. ``cluster=True|False`` passed to :func:`sync_client` / :func:`async_client`;
2. what ``tq_redis.init`` recorded for the URL from its config ``redis.cluster`` (:func:`declare_cluster`);
3. the environment: ``TQ_REDIS_CLUSTER=1|0|true|false|yes|no`` (``auto`` or empty: detect);
4. detection: ``INFO cluster`` answers ``cluster_enabled:1``. The answer is cached per URL for the
   life of the process. A server that cannot be reached at that moment counts as a single server
   for that client (it fails on first use as before) and the next client asks again.

On a cluster the clients are redis-py's ``RedisCluster`` (``redis.cluster`` / ``redis.asyncio.cluster``),
with one change: ``FCALL``/``FCALL_RO`` and ``XREAD`` are routed by the keys in the call itself, as
redis-py already does for ``EVAL``, instead of asking a server (``COMMAND GETKEYS``) on every call.
A single-server client that meets a cluster anyway (``cluster=False`` forced against a cluster node)
raises :class:`~tq_redis.errors.ConfigError` saying so, instead of redis-py's ``MovedError``.

Behind Redis Sentinel the URL is ``redis+sentinel://sentinel:26379[,sentinel:port...]/service[/db]``
(see :mod:`tq_redis.server.sentinel`): the client is a single-server client whose connections go to the
primary the Sentinels name at the moment each connection opens, so it follows a failover.

Every client reconnects with backoff across a server restart (:func:`connection_options`); a
cluster client also refreshes its slot map and retries when a node moves or fails over.
"""

from __future__ import annotations

import inspect
import os
import ssl
import threading
from collections.abc import Awaitable, Callable
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import AskError, AuthenticationError
from redis.retry import Retry

from tq_redis.server import sentinel
from tq_redis.settings import parse_flag, settings

try:  # a dependency (redis[hiredis]); without it every command takes redis-py's packer
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover
    _pack_command = None
from tq_redis.errors import ConfigError, ConnectionFailed, TQError
from tq_redis.redact import redact

CLUSTER_ENV = "TQ_REDIS_CLUSTER"
SCHEMES = ("redis", "rediss", "unix")
PROBE_TIMEOUT_S = 2.0


_lock = threading.Lock()
_declared: dict[str, bool] = {}
_detected: dict[str, bool] = {}


# ---------------------------------------------------------------------------------------------
# URL and cluster settings
# ---------------------------------------------------------------------------------------------


def check_url(url: Any) -> str:
    """Return ``url`` if redis-py can connect with it, else raise :class:`ConfigError` saying how to fix it."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"the Redis URL must be a non-empty string like redis://127.0.0.1:6379, got {url!r}")
    if sentinel.is_sentinel_url(url):  # redis+sentinel://sentinels/service (see tq_redis.server.sentinel)
        sentinel.parse_url(url)
        return url
    scheme = urlsplit(url).scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError(
            f"Redis URL {redact(url)!r} has scheme {scheme or 'none'!r}: write redis://host:port (rediss:// for TLS, "
            f"unix:///path/to/redis.sock for a local socket); for a Redis Cluster any node's redis://host:port; "
            f"behind Redis Sentinel redis+sentinel://sentinel-host:26379[,host:port...]/service"
        )
    try:
        redis.connection.parse_url(url)
    except ValueError as exc:
        raise ConfigError(
            f"cannot read Redis URL {redact(url)!r} ({exc}); write redis://[user:password@]host:port[/db]"
        ) from None
    return url


def parse_cluster_flag(value: Any, where: str = "redis.cluster") -> bool | None:
    """``True``/``False``, or ``None`` (detect), from a bool, None, or ``1/0/true/false/yes/no/auto``."""
    if isinstance(value, str) and value.strip().lower() in ("none", "null"):  # a YAML/JSON null written out
        return None
    return parse_flag(value, where, auto=True)


def declare_cluster(url: str, cluster: Any) -> None:
    """Record the ``redis.cluster`` setting ``init`` was given for ``url`` (``None``: forget it, detect)."""
    flag = parse_cluster_flag(cluster)
    with _lock:
        if flag is None:
            _declared.pop(url, None)
        else:
            _declared[url] = flag


def forget(url: str | None = None) -> None:
    """Drop what was declared or detected for ``url`` (every URL when None), so the next client asks again."""
    with _lock:
        for table in (_declared, _detected):
            if url is None:
                table.clear()
            else:
                table.pop(url, None)


def detect_cluster(url: str) -> bool | None:
    """Ask the server at ``url`` whether it runs in cluster mode; ``None`` when it cannot be reached.

    Cached per URL (only answers, not failures to connect).
    """
    with _lock:
        if url in _detected:
            return _detected[url]
    probe = redis.Redis.from_url(
        url, socket_connect_timeout=PROBE_TIMEOUT_S, socket_timeout=PROBE_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
        **_driver_info(),
    )
    try:
        enabled = str(probe.info("cluster").get("cluster_enabled", 0)) == "1"
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return None  # down or refusing us: the real client reports it on first use
    except redis.ResponseError:  # a server without cluster support (INFO cluster unknown)
        enabled = False
    finally:
        probe.close()
    with _lock:
        _detected[url] = enabled
    return enabled


def cluster_mode(url: str, cluster: Any = None) -> bool:
    """Whether clients of ``url`` are cluster clients (see the module docstring for the order of rules)."""
    flag = parse_cluster_flag(cluster, "cluster")
    if sentinel.is_sentinel_url(url):  # Sentinel watches single servers, never a cluster
        if flag:
            raise ConfigError(f"{redact(url)!r} names Redis Sentinel, which serves a single primary, not a cluster: "
                              f"drop redis.cluster: true / TQ_REDIS_CLUSTER=1, or give a cluster node's redis:// URL")
        return False
    if flag is not None:
        return flag
    with _lock:
        declared = _declared.get(url)
    if declared is not None:
        return declared
    flag = settings.redis_cluster
    if flag is not None:
        return flag
    return bool(detect_cluster(url))


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


def is_unix_url(url: str) -> bool:
    """Whether ``url`` names a local socket (``unix:///path.sock``) rather than a TCP server."""
    return urlsplit(url).scheme.lower() == "unix"


def unfixable_by_reconnecting(error: BaseException) -> bool:
    """Whether a connection error is one no reconnect can fix: credentials the server refuses
    (redis-py's ``AuthenticationError`` is a ``ConnectionError``), or a server certificate that fails
    verification (a ``ConnectionError`` raised while handling the ``ssl`` error)."""
    if isinstance(error, AuthenticationError):
        return True
    seen: BaseException | None = error
    for _ in range(4):  # the ssl error sits one or two links down the chain
        seen = seen.__cause__ or seen.__context__
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
    return False


class _Reconnect(Retry):
    """redis-py's retry with backoff, which gives up at once on an error no reconnect can fix:
    a wrong password or an unverifiable certificate fails in milliseconds, not after the backoff."""

    def call_with_retry(self, do: Callable[[], Any], fail: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def fail_or_give_up(error: Exception, *rest: Any) -> None:
            fail(error, *rest)
            if unfixable_by_reconnecting(error):
                raise error

        return super().call_with_retry(do, fail_or_give_up, *args, **kwargs)


class _AsyncReconnect(AsyncRetry):
    """:class:`_Reconnect` for redis.asyncio, whose retry awaits its failure handler."""

    async def call_with_retry(
        self, do: Callable[[], Awaitable[Any]], fail: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> Any:
        async def fail_or_give_up(error: Exception, *rest: Any) -> None:
            await fail(error, *rest)
            if unfixable_by_reconnecting(error):
                raise error

        return await super().call_with_retry(do, fail_or_give_up, *args, **kwargs)


#: The most connections one client's pool opens (per node on a cluster). redis-py 8 caps a pool at
#: 100 by default, and a client shared by more callers than that -- a dock in a Ray actor with
#: max_concurrency=100, each waiting call holding a connection on its blocking read, the lane one
#: more; or as many coroutines of one asyncio client -- then failed with "Too many connections".
#: Pools open connections only as callers need them; this is the number a server admits by default.
POOL_MAX_CONNECTIONS = 10_000


def connection_options(*, asyncio: bool = False, reconnect: bool = True, unix: bool = False) -> dict[str, Any]:
    """Options every client gets: reconnect with backoff across a Redis restart (~6 s in all) before
    giving up, at once where no reconnect can help (:func:`unfixable_by_reconnecting`);
    ``reconnect=False``: fail at once (readiness probes). redis.asyncio needs its own
    ``Retry`` class: it awaits its retries, a sync ``Retry`` is never applied. ``unix``: the
    client talks over a local socket, which has no TCP keepalive (redis-py refuses the option)."""
    if not reconnect:
        return {"retry": (AsyncRetry if asyncio else Retry)(NoBackoff(), 0), **_driver_info()}
    retry_class = _AsyncReconnect if asyncio else _Reconnect
    options: dict[str, Any] = {
        "retry": retry_class(ExponentialBackoff(cap=1.0, base=0.05), retries=12),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "health_check_interval": 30,
        # redis-py 8 reads with a 5 s timeout by default, which cuts every longer blocking wait
        # (get_meta's BLPOP, the streams' XREAD BLOCK) and retries it into a ConnectionFailed;
        # waits are bounded by their own BLOCK/timeout arguments instead, as before redis-py 8.
        "socket_timeout": None,
        **_driver_info(),
    }
    if not unix:
        options["socket_keepalive"] = True
    return options


@lru_cache(maxsize=1)
def _driver_info() -> dict[str, Any]:
    """The ``driver_info`` option, made once per process.

    Without it redis-py 8 looks its own version up in the installed packages' metadata for every
    client and every new connection (about 14 ms each here: most of a rank's attach, and a pool
    that grows by 100 connections pays 1.4 s). redis-py before 8 has no such option and reads its
    version once, at import.
    """
    try:
        from redis.driver_info import DriverInfo
    except ImportError:
        return {}
    return {"driver_info": DriverInfo(lib_version=redis.__version__)}


@lru_cache(maxsize=1)
def _async_cluster_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(AsyncRedisCluster.__init__).parameters) - {"self"}


def _cluster_url(url: str) -> str:
    parts = redis.connection.parse_url(url)
    if "path" in parts:
        raise ConfigError(f"{redact(url)!r} is a unix socket, which a Redis Cluster cannot use: give a node's redis://host:port")
    if parts.get("db"):
        raise ConfigError(f"a Redis Cluster has only database 0: drop '/{parts['db']}' from {redact(url)!r}")
    return url


# ---------------------------------------------------------------------------------------------
# Key routing on a cluster
# ---------------------------------------------------------------------------------------------


def _text(arg: Any) -> str:
    return arg.decode() if isinstance(arg, bytes) else str(arg)


def keys_of_call(args: tuple) -> list | None:
    """The keys of ``FCALL``/``FCALL_RO``/``XREAD`` read from the arguments; None for other commands.

    ``FCALL fn numkeys key... arg...``; ``XREAD [COUNT n] [BLOCK ms] STREAMS key... id...``.
    """
    if not args:
        return None
    name = _text(args[0]).upper()
    if name in ("FCALL", "FCALL_RO") and len(args) >= 3:
        return list(args[3 : 3 + int(args[2])])
    if name == "XREAD":
        words = [_text(a).upper() for a in args]
        if "STREAMS" in words:
            rest = args[words.index("STREAMS") + 1 :]
            return list(rest[: len(rest) // 2])
    return None


class _SyncKeys:
    """redis-py's command parser, with the keys of :func:`keys_of_call`'s commands read from the call."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        keys = keys_of_call(args)
        return keys if keys is not None else self._inner.get_keys(redis_conn, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _AsyncKeys(_SyncKeys):
    async def get_keys(self, *args: Any) -> Any:  # type: ignore[override]
        keys = keys_of_call(args)
        return keys if keys is not None else await self._inner.get_keys(*args)


class ClusterClient(RedisCluster):
    """``redis.cluster.RedisCluster`` routing ``FCALL``/``XREAD`` by their own keys (pipelines too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser = _SyncKeys(self.commands_parser)


class AsyncClusterClient(AsyncRedisCluster):
    """``redis.asyncio.cluster.RedisCluster`` routing ``FCALL``/``XREAD`` by their own keys (pipelines too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser = _AsyncKeys(self.commands_parser)


# ---------------------------------------------------------------------------------------------
# A single-server client that meets a cluster
# ---------------------------------------------------------------------------------------------


def not_a_single_server(url: str, exc: BaseException) -> ConfigError:
    """The error for a ``MOVED``/``ASK`` reply to a single-server client: the URL is a cluster node."""
    return ConfigError(
        f"the Redis at {redact(url)} is a cluster node (it answered {exc}) but this client was told it is a single "
        f"server: remove TQ_REDIS_CLUSTER=0 / redis.cluster: false (or set them to true) so tq-redis uses "
        f"a cluster client"
    )


def cluster_failure(url: str, exc: BaseException) -> TQError:
    """What a cluster client's failure to start means: the URL names no cluster node
    (:class:`ConfigError`), or the cluster cannot be reached (:class:`ConnectionFailed`)."""
    if detect_cluster(url) is False:
        return ConfigError(
            f"the Redis at {redact(url)} is a single server, not a cluster node, but a cluster client was asked for: "
            f"remove TQ_REDIS_CLUSTER=1 / redis.cluster: true (or set them to false)"
        )
    return ConnectionFailed(
        f"cannot reach the Redis Cluster at {redact(url)} ({exc}); check that its nodes are running and the URL "
        f"names one"
    )


#: commands a :class:`SingleClient` sends on its lane (see there): our scripts' calls
LANE_COMMANDS = frozenset({"FCALL", "FCALL_RO"})
#: what :meth:`SingleClient.pipeline_on_lane` returns when the lane's connection failed after its write:
#: the commands may have run (the caller resends only what is safe to resend)
LANE_LOST: Any = object()


def _packed(args: tuple[Any, ...]) -> bytes | None:
    """``args`` as one RESP command, or None for the connection's own packer. hiredis packs str,
    bytes, memoryview, int and float itself, as redis-py's hiredis packer ends up doing after
    copying every memoryview and testing each argument's type in Python (~10 µs of a tiny claim).
    Anything else (a bytearray) is left to redis-py."""
    if _pack_command is None:
        return None
    try:
        return _pack_command(args)
    except TypeError:
        return None


def _packed_all(commands: list[tuple[Any, ...]]) -> bytes | None:
    """``commands`` as one write (see :func:`_packed`), or None if one of them needs redis-py's packer."""
    parts = [_packed(args) for args in commands]
    return None if None in parts else b"".join(parts)  # type: ignore[arg-type]


class SingleClient(redis.Redis):
    """``redis.Redis`` that reports a ``MOVED``/``ASK`` reply as :class:`ConfigError`
    (see :func:`not_a_single_server`). Behind Sentinel it follows the primary (:mod:`tq_redis.server.sentinel`).

    Function calls (:data:`LANE_COMMANDS`) go out on a *lane*: one connection the client keeps
    out of its pool and writes to and reads from directly, skipping the pool's per-command
    checkout (fork check, locks, a readiness ``poll``, observability hooks), and packed by hiredis
    directly (:func:`_packed`). That is most of the client CPU of a tiny claim. One thread at a
    time uses the lane; another thread meanwhile, a forked child, and every other command take
    the pool's path. A lane whose connection fails is closed, and the command is sent again the
    pool's way, with its reconnect and retries.
    """

    tq_url = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lane_lock = threading.Lock()
        self._lane: Any = None  # the lane's connection, checked out of the pool
        self._lane_pid = 0

    def close(self) -> None:
        if self._lane is not None and self._lane_pid == os.getpid():
            self._leave_lane(self._lane)
        self._lane = None
        super().close()
        sentinel.close_sync(self)

    def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            if not options and args[0] in LANE_COMMANDS and self.connection is None \
                    and self._lane_lock.acquire(blocking=False):
                try:
                    return self._on_lane(args)
                finally:
                    self._lane_lock.release()
            return super().execute_command(*args, **options)
        except AskError as exc:
            raise not_a_single_server(self.tq_url, exc) from exc

    def _on_lane(self, args: tuple[Any, ...]) -> Any:
        conn = self._lane_connection()
        try:
            packed = _packed(args)
            if packed is None:
                conn.send_command(*args)
            else:
                conn.send_packed_command([packed])
            return conn.read_response()
        except redis.ResponseError:  # an error reply: the connection is still in step
            raise
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._leave_lane(conn)
            return super().execute_command(*args)
        except BaseException:  # interrupted between request and reply: its reply may still come
            self._leave_lane(conn)
            raise

    def pipeline_on_lane(self, commands: list[tuple[Any, ...]]) -> list[Any] | None:
        """Send ``commands`` on the lane in one write and read every reply: a pipeline without
        redis-py's pipeline object (its pool checkout and per-command bookkeeping). An error
        reply takes its command's place in the list, as ``execute(raise_on_error=False)`` puts it.
        Replies go through redis-py's response callbacks, as its pipeline's do. None when the
        lane is taken by another thread, :data:`LANE_LOST` when its connection fails: the caller
        then sends the pipeline the pool's way (resending it whole, as redis-py's own retry does,
        which request records make safe for our scripts' calls)."""
        if self.connection is not None or not self._lane_lock.acquire(blocking=False):
            return None
        try:
            conn = self._lane_connection()
            try:
                packed = _packed_all(commands)
                conn.send_packed_command([packed] if packed is not None else conn.pack_commands(commands))
                replies: list[Any] = []
                for _ in commands:
                    try:
                        replies.append(conn.read_response())
                    except redis.ResponseError as exc:  # in step still: the next reply follows
                        replies.append(exc)
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self._leave_lane(conn)
                return LANE_LOST
            except BaseException:  # interrupted mid-way: replies may still be on their way
                self._leave_lane(conn)
                raise
            return [self._parsed(args[0], reply) for args, reply in zip(commands, replies)]
        finally:
            self._lane_lock.release()

    def _parsed(self, command: Any, reply: Any) -> Any:
        """``reply`` as redis-py's pipeline returns it: through the command's response callback
        (``SMEMBERS`` gives a set, ``SET`` a bool); error replies as they are."""
        if command in LANE_COMMANDS:  # our scripts' replies have no callback
            return reply
        callback = self.response_callbacks.get(command)
        return reply if callback is None or isinstance(reply, Exception) else callback(reply)

    def _lane_connection(self) -> Any:
        """The lane's connection (the lane's lock held): checked out of the pool on first use,
        and again in a forked child, whose inherited one belongs to the parent."""
        if self._lane is None or self._lane_pid != os.getpid():
            self._lane = self.connection_pool.get_connection()
            self._lane_pid = os.getpid()
        return self._lane

    def _leave_lane(self, conn: Any) -> None:
        self._lane = None
        try:
            conn.disconnect()
        finally:
            self.connection_pool.release(conn)


class AsyncSingleClient(aioredis.Redis):
    """``redis.asyncio.Redis`` that reports a ``MOVED``/``ASK`` reply as :class:`ConfigError`."""

    tq_url = ""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await sentinel.close_async(self)

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            return await super().execute_command(*args, **options)
        except AskError as exc:
            raise not_a_single_server(self.tq_url, exc) from exc


# ---------------------------------------------------------------------------------------------
# The factory
# ---------------------------------------------------------------------------------------------


def _after_handshake(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """redis-py's ``redis_connect_func`` for a single server: the usual handshake, then ``check``."""

    def connect(connection: Any) -> None:
        connection.on_connect()
        check(connection)

    return connect


def _after_handshake_async(check: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """:func:`_after_handshake` for ``redis.asyncio`` connections."""

    async def connect(connection: Any) -> None:
        await connection.on_connect()
        await check(connection)

    return connect


def sync_client(
    url: str, *, cluster: Any = None, reconnect: bool = True, on_connect: Callable[[Any], None] | None = None,
    **options: Any,
) -> redis.Redis | RedisCluster:
    """A blocking client of ``url``: :class:`SingleClient` or, on a cluster, :class:`ClusterClient`.

    ``options`` are redis-py connection options (``socket_timeout``, ``client_name`` ...); they
    override :func:`connection_options`. ``on_connect(connection)`` runs on every new connection
    after its handshake, before its first command (the namespace's epoch check,
    :mod:`tq_redis.server.identity`). Raises :class:`ConfigError` for a URL redis-py cannot use.
    """
    check_url(url)
    base = connection_options(reconnect=reconnect, unix=is_unix_url(url))
    in_cluster = cluster_mode(url, cluster)  # once: a server that refuses the probe is asked again each time
    if on_connect is not None:  # a cluster client runs its handshake itself before the function it is given
        options["redis_connect_func"] = on_connect if in_cluster else _after_handshake(on_connect)
    options.setdefault("max_connections", POOL_MAX_CONNECTIONS)
    if in_cluster:
        retry = options.pop("retry", base["retry"])
        options.setdefault("socket_timeout", None)  # see connection_options
        options.setdefault("socket_keepalive", True)
        for name in ("single_connection_client", "connection_pool", "health_check_interval", "retry_on_error"):
            options.pop(name, None)
        try:
            return ClusterClient.from_url(_cluster_url(url), retry=retry, **options)
        except (redis.exceptions.RedisClusterException, redis.RedisError) as exc:  # it connects at once
            raise cluster_failure(url, exc) from exc
    if sentinel.is_sentinel_url(url):
        client = sentinel.sync_client(url, SingleClient, {**base, **options})
    else:
        client = SingleClient.from_url(url, **{**base, **options})
    client.tq_url = url
    return client


def async_client(
    url: str, *, cluster: Any = None, reconnect: bool = True, max_connections: int | None = None,
    wait_for_connection: bool = False, on_connect: Callable[[Any], Awaitable[None]] | None = None, **options: Any,
) -> aioredis.Redis | AsyncRedisCluster:
    """An asyncio client of ``url``: :class:`AsyncSingleClient` or, on a cluster, :class:`AsyncClusterClient`.

    ``max_connections`` bounds the pool (per node on a cluster); with ``wait_for_connection`` a
    single-server client waits for a free connection instead of failing (a cluster client always
    fails fast: callers that need a bound there hold a semaphore). The client connects on first use.
    ``on_connect``: as :func:`sync_client`'s, a coroutine function; redis.asyncio's cluster client has
    no such hook, so it runs none there.
    """
    check_url(url)
    base = connection_options(asyncio=True, reconnect=reconnect, unix=is_unix_url(url))
    in_cluster = cluster_mode(url, cluster)  # once, as in sync_client
    if on_connect is not None and not in_cluster:
        options["redis_connect_func"] = _after_handshake_async(on_connect)
    if in_cluster:
        merged = {**base, **options}
        merged["max_connections"] = POOL_MAX_CONNECTIONS if max_connections is None else max_connections
        allowed = _async_cluster_parameters()
        kept = {k: v for k, v in merged.items() if k in allowed and k != "health_check_interval"}
        try:
            return AsyncClusterClient.from_url(_cluster_url(url), **kept)
        except redis.exceptions.RedisClusterException as exc:  # bad arguments: it connects on first use
            raise ConfigError(f"cannot use {redact(url)!r} as a Redis Cluster: {exc}") from exc
    merged = {**base, **options}
    if sentinel.is_sentinel_url(url):
        bound = POOL_MAX_CONNECTIONS if max_connections is None else max_connections
        client = sentinel.async_client(url, AsyncSingleClient, merged, max_connections=bound,
                                       wait_for_connection=wait_for_connection and max_connections is not None)
    elif max_connections is not None:
        pool_class = aioredis.BlockingConnectionPool if wait_for_connection else aioredis.ConnectionPool
        extra = {"timeout": None} if wait_for_connection else {}
        pool = pool_class.from_url(url, max_connections=max_connections, **extra, **merged)
        client = AsyncSingleClient(connection_pool=pool)
        client.auto_close_connection_pool = True
    else:
        client = AsyncSingleClient.from_url(url, max_connections=POOL_MAX_CONNECTIONS, **merged)
    client.tq_url = url
    return client


def is_cluster_client(client: Any) -> bool:
    """Whether ``client`` (sync or asyncio) is a Redis Cluster client."""
    return isinstance(client, RedisCluster | AsyncRedisCluster)
