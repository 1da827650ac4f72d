"""Redis Sentinel: the URL form, the ``redis.sentinel`` config block, and clients that follow failovers.

The canonical form is a URL, so one string still says where every process attaches::

    redis+sentinel://[user:password@]host[:port][,host[:port]...]/service[/db][?sentinel_password=...]

* ``host:port`` pairs are the *Sentinels* (not the data servers), comma-separated; the port
  defaults to 26379; an IPv6 address is written in brackets (``[::1]:26379``).
* ``service`` is the name the Sentinels monitor (``sentinel monitor <service> ...``); ``db`` the
  database number on the primary (0 by default).
* ``user:password`` authenticate to the *primary* (the data server), as in ``redis://`` URLs.
  Sentinels that require a password of their own get it from the query parameters
  ``sentinel_username`` / ``sentinel_password``. Percent-encode reserved characters.

The config block ``redis: {sentinel: {hosts: [...], service: ..., ...}}`` is turned into this URL by
:func:`url_from_block` (``tq_redis.api.config`` does so in ``init``), so the URL other processes attach
with (``conf["redis"]["url"]``, ``TQ_REDIS_URL``) carries the Sentinel setup too.

A client built here asks the Sentinels for the current primary whenever it opens a connection
(redis-py's ``SentinelConnectionPool``). It asks every Sentinel and follows the answer with the
highest ``config-epoch`` (redis-py takes the first valid answer: a Sentinel that has not yet heard
of a failover names the old primary, which, restarted as a replica, refuses writes until that
Sentinel catches up -- seconds of ``READONLY`` errors). After a failover its connections to the dead primary fail,
the retry with backoff of :func:`tq_redis.server.connections.connection_options` reconnects, and the
reconnection asks the Sentinels again, which by then name the promoted replica. A primary that was
demoted answers writes with ``READONLY``; redis-py then drops the connection and asks again too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import MasterNotFoundError as AsyncMasterNotFound
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection

from tq_redis.errors import ConfigError
from tq_redis.redact import redact

SCHEME = "redis+sentinel"
DEFAULT_PORT = 26379
#: how long one question to one Sentinel may take (connect and reply), seconds
SENTINEL_TIMEOUT_S = 1.0

_QUERY = ("sentinel_username", "sentinel_password")
_BLOCK_KEYS = {"hosts", "service", "db", "username", "password", "sentinel_username", "sentinel_password"}
_HOST = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<name>[^:\[\]]+))(?::(?P<port>\d+))?$")
_FORM = "redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]"


@dataclass(frozen=True)
class SentinelTarget:
    """What a ``redis+sentinel://`` URL says: where the Sentinels are and which primary to ask for."""

    hosts: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    def primary_options(self) -> dict[str, Any]:
        """Connection options for the primary (database and credentials)."""
        found = {"db": self.db, "username": self.username, "password": self.password}
        return {k: v for k, v in found.items() if v is not None}

    def sentinel_options(self) -> dict[str, Any]:
        """Connection options for the Sentinels themselves: short timeouts, no retries of their own
        (discovery is retried by the primary's connection), their own credentials."""
        options: dict[str, Any] = {
            "socket_timeout": SENTINEL_TIMEOUT_S,
            "socket_connect_timeout": SENTINEL_TIMEOUT_S,
            "retry": Retry(NoBackoff(), 0),
        }
        if self.sentinel_username is not None:
            options["username"] = self.sentinel_username
        if self.sentinel_password is not None:
            options["password"] = self.sentinel_password
        return options


def is_sentinel_url(url: Any) -> bool:
    """Whether ``url`` is a ``redis+sentinel://`` URL."""
    return isinstance(url, str) and url.strip().lower().startswith(SCHEME + "://")


def _bad(url: str, why: str) -> ConfigError:
    return ConfigError(f"cannot read Sentinel URL {redact(url)!r}: {why}; write {_FORM}")


def _host(text: str, url: str) -> tuple[str, int]:
    m = _HOST.match(text.strip())
    if not m:
        raise _bad(url, f"{text!r} is not host or host:port")
    port = int(m.group("port") or DEFAULT_PORT)
    if not 0 < port < 65536:
        raise _bad(url, f"port {port} is out of range")
    return (m.group("v6") or m.group("name")), port


def parse_url(url: str) -> SentinelTarget:
    """Read a ``redis+sentinel://`` URL; :class:`ConfigError` saying what to fix if it is malformed."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() != SCHEME:
        raise _bad(url, f"the scheme must be {SCHEME}")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    if not hostlist:
        raise _bad(url, "no Sentinel host is given")
    hosts = tuple(_host(h, url) for h in hostlist.split(","))
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise _bad(url, "the path must be /service or /service/db")
    service = path[0]
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise _bad(url, f"the database {path[1]!r} is not a number") from None
    if db < 0:
        raise _bad(url, f"the database {db} is negative")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(_QUERY))
    if unknown:
        raise _bad(url, f"unknown parameter(s) {unknown}: only {list(_QUERY)} are understood")
    extra = {k: v[-1] for k, v in query.items()}
    return SentinelTarget(hosts, service, db, username, password, extra.get("sentinel_username"),
                          extra.get("sentinel_password"))


def _quote(text: Any) -> str:
    return quote(str(text), safe="")


def _netloc_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def build_url(target: SentinelTarget) -> str:
    """The canonical ``redis+sentinel://`` URL of ``target`` (inverse of :func:`parse_url`)."""
    auth = ""
    if target.username is not None or target.password is not None:
        auth = _quote(target.username or "")
        if target.password is not None:
            auth += ":" + _quote(target.password)
        auth += "@"
    hosts = ",".join(_netloc_host(h, p) for h, p in target.hosts)
    url = f"{SCHEME}://{auth}{hosts}/{_quote(target.service)}"
    if target.db:
        url += f"/{target.db}"
    query = [(k, getattr(target, k)) for k in _QUERY if getattr(target, k) is not None]
    if query:
        url += "?" + "&".join(f"{k}={_quote(v)}" for k, v in query)
    return url


def _block_host(item: Any) -> tuple[str, int]:
    if isinstance(item, str):
        return _host(item, "redis.sentinel.hosts")
    if isinstance(item, Sequence) and len(item) == 2:
        return str(item[0]), int(item[1])
    if isinstance(item, Mapping) and "host" in item:
        return str(item["host"]), int(item.get("port", DEFAULT_PORT))
    raise ConfigError(f"redis.sentinel.hosts: cannot read {item!r}; give 'host:port' strings")


def url_from_block(block: Any) -> str:
    """The canonical URL for a ``redis.sentinel`` config block.

    ``{hosts: ["h1:26379", "h2:26379"], service: mymaster, db: 0, username: ..., password: ...,
    sentinel_username: ..., sentinel_password: ...}``; ``hosts`` may also be one comma-separated
    string, and each host a ``[host, port]`` pair. ``password`` authenticates to the primary.
    """
    if not isinstance(block, Mapping):
        raise ConfigError(f"redis.sentinel must be a mapping like {{hosts: ['host:26379'], service: mymaster}}, "
                          f"got {block!r}")
    unknown = sorted(str(k) for k in set(block) - _BLOCK_KEYS)
    if unknown:
        raise ConfigError(f"redis.sentinel: unknown key(s) {unknown}; known: {sorted(_BLOCK_KEYS)}")
    hosts = block.get("hosts")
    if isinstance(hosts, str):
        hosts = hosts.split(",")
    if not hosts or not isinstance(hosts, Sequence):
        raise ConfigError("redis.sentinel.hosts must list the Sentinels, e.g. ['10.0.0.1:26379', '10.0.0.2:26379']")
    service = block.get("service")
    if not isinstance(service, str) or not service:
        raise ConfigError("redis.sentinel.service must name the monitored primary (the name in "
                          "'sentinel monitor <name> ...'), e.g. mymaster")
    try:
        db = int(block.get("db") or 0)
    except (TypeError, ValueError):
        raise ConfigError(f"redis.sentinel.db must be a database number, got {block.get('db')!r}") from None

    def text(key: str) -> str | None:
        value = block.get(key)
        return None if value is None else str(value)

    target = SentinelTarget(
        tuple(_block_host(h) for h in hosts), service, db, text("username"), text("password"),
        text("sentinel_username"), text("sentinel_password"),
    )
    return build_url(target)


# ---------------------------------------------------------------------------------------------
# Clients
# ---------------------------------------------------------------------------------------------


def _newest(service: str, states: list[dict], errors: list[str]) -> tuple[str, int]:
    """The primary named with the highest ``config-epoch`` (the latest failover's), or raise."""
    if not states:
        detail = f": {'; '.join(errors)}" if errors else ""
        raise MasterNotFoundError(f"No master found for {service!r}{detail}")
    best = max(states, key=lambda state: int(state.get("config-epoch", 0)))
    return best["ip"], int(best["port"])


class _PrimaryConnection(SentinelManagedConnection):
    """A connection that asks the Sentinels for the primary every time it opens its socket.

    redis-py asks only in ``connect()``; a command retried after a dropped connection reopens the
    socket through ``connect_check_health()``, to the address the connection used before -- the dead
    primary, or the old primary restarted as a replica (``READONLY`` until the retries run out).
    """

    def _connect(self) -> Any:
        if self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        return super()._connect()


class _AsyncPrimaryConnection(AsyncSentinelConnection):
    """As :class:`_PrimaryConnection`, for redis.asyncio."""

    async def _connect(self) -> Any:
        if self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        return await super()._connect()


class _Sentinels(Sentinel):
    """redis-py's Sentinel manager, asking every Sentinel and trusting the newest configuration."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        states, errors = [], []
        for node in self.sentinels:
            try:
                state = node.sentinel_masters().get(service_name)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                errors.append(f"{node.connection_pool.connection_kwargs.get('port')}: {exc}")
                continue
            if state and self.check_master_state(state, service_name):
                states.append(state)
        return _newest(service_name, states, errors)


class _AsyncSentinels(AsyncSentinel):
    """As :class:`_Sentinels`, for redis.asyncio."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        states, errors = [], []
        for node in self.sentinels:
            try:
                state = (await node.sentinel_masters()).get(service_name)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                errors.append(f"{node.connection_pool.connection_kwargs.get('port')}: {exc}")
                continue
            if state and self.check_master_state(state, service_name):
                states.append(state)
        try:
            return _newest(service_name, states, errors)
        except MasterNotFoundError as exc:
            raise AsyncMasterNotFound(str(exc)) from None


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Connection options for the pool, and ``single_connection_client`` (an option of the client)."""
    options = dict(options)
    single = bool(options.pop("single_connection_client", False))
    options.pop("connection_pool", None)
    return options, single


def sync_client(url: str, redis_class: type, options: dict[str, Any]) -> Any:
    """A blocking ``redis_class`` whose connections go to the primary the Sentinels name."""
    target = parse_url(url)
    manager = _Sentinels(list(target.hosts), sentinel_kwargs=target.sentinel_options())
    pool_options, single = _split({**target.primary_options(), **options})
    pool = SentinelConnectionPool(target.service, manager, is_master=True, connection_class=_PrimaryConnection,
                                  **pool_options)
    client = redis_class(connection_pool=pool, single_connection_client=single)
    client.auto_close_connection_pool = True
    client.tq_sentinel = manager
    return client


def async_client(url: str, redis_class: type, options: dict[str, Any], *, max_connections: int | None = None,
                 wait_for_connection: bool = False) -> Any:
    """An asyncio ``redis_class`` whose connections go to the primary the Sentinels name.

    ``max_connections`` bounds the pool; with ``wait_for_connection`` a caller waits for a free
    connection instead of failing (as :func:`tq_redis.server.connections.async_client` does).
    """
    target = parse_url(url)
    sentinel_options = target.sentinel_options()
    sentinel_options.pop("retry")  # a sync Retry is never applied by redis.asyncio; it fails fast anyway
    manager = _AsyncSentinels(list(target.hosts), sentinel_kwargs=sentinel_options)
    pool_options, single = _split({**target.primary_options(), **options})
    pool_class: type = AsyncSentinelPool
    if max_connections is not None:
        pool_options["max_connections"] = max_connections
        if wait_for_connection:
            pool_class = _BlockingSentinelPool
            pool_options["timeout"] = None
    pool = pool_class(target.service, manager, is_master=True, connection_class=_AsyncPrimaryConnection,
                      **pool_options)
    client = redis_class(connection_pool=pool, single_connection_client=single)
    client.auto_close_connection_pool = True
    client.tq_sentinel = manager
    return client


class _BlockingSentinelPool(AsyncSentinelPool, BlockingConnectionPool):
    """An asyncio Sentinel pool whose callers wait for a free connection (bounded pools)."""


def close_sync(client: Any) -> None:
    """Close the Sentinel connections a client built here holds (after the client itself)."""
    manager = getattr(client, "tq_sentinel", None)
    if manager is not None:
        for node in manager.sentinels:
            node.close()


async def close_async(client: Any) -> None:
    """As :func:`close_sync`, for an asyncio client."""
    manager = getattr(client, "tq_sentinel", None)
    if manager is not None:
        for node in manager.sentinels:
            await node.aclose()
