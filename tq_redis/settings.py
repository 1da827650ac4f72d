"""Every ``TQ_*`` environment variable tq-redis reads, in one place: :data:`settings`.

=============================== ========================================================= ==============
variable                        what it sets                                              default
=============================== ========================================================= ==============
``TQ_REDIS_URL``                the Redis URL ``init()``, the facades and the CLI use     none: embedded
``TQ_NAMESPACE``                the namespace (key prefix) of the job                     ``tq``
``TQ_REDIS_CLUSTER``            ``1``/``0`` (``true``/``false``/``yes``/``no``): is the    detect
                                server a Redis Cluster; ``auto`` or empty: detect
``TQ_REDIS_DURABLE``            durable mode: ``none``, ``replicas[:N]``, ``aof``,         ``none``
                                ``aof+replicas[:N]``
``TQ_REDIS_DURABLE_TIMEOUT_MS`` how long a durable write waits for its copies             ``1000``
``TQ_REDIS_ON_EVICTION``        a shared server may evict keys: ``error`` or ``warn``     ``error``
``TQ_REDIS_LOAD_LIBRARY``       load the Lua library when missing: ``auto`` or ``never``  ``auto``
``TQ_STORAGE_TOKEN``            the token storage nodes ask clients for                   none
``TQ_STORAGE_DURABLE``          ``storage.durable``: the fsspec URL of the durable tier   none
``TQ_STORAGE_REPLICAS``         ``storage.replicas``: DRAM nodes holding each value       ``1``
``TQ_ACL_PASSWORD``             the password ``tq-redis acl`` gives a namespace's user    generated
``TQ_HEARTBEAT_S``              seconds between a client's liveness heartbeats            ``10``
``TQ_BUFFER_CACHE``             bytes of warm output buffers kept (``0``/``off``: none)   ``1GiB``
``TQ_COPY_THREADS``             threads per batched copy                                  up to 4 CPUs
``TQ_NATIVE_COPY``              ``0`` runs batched copies in Python, not C                ``1``
``TQ_NATIVE_SCAN``              ``0`` scans batches in Python, not C                      ``1``
``TQ_LOGGING_LEVEL``            the level of the loggers :func:`tq_redis.logs.get_logger`  ``WARNING``
                                makes (``DEBUG`` shows claims, waits and store calls)
=============================== ========================================================= ==============

Values are read when asked for, not at import, so a process (or a test) that sets a variable before
first use sees it; a few are read once where they size something process-wide (the buffer cache,
the copy threads, the heartbeat). Reading one that does not parse raises :class:`ConfigError`
naming the variable and what it takes. The URL, the namespace and the durable mode also come from
``init()``'s configuration, which wins over the environment (:mod:`tq_redis.api.config`).
"""

from __future__ import annotations

import os

from tq_redis.errors import ConfigError
from tq_redis.units import parse_size

__all__ = ["VARIABLES", "Settings", "parse_flag", "settings"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

VARIABLES = (
    "TQ_REDIS_URL", "TQ_NAMESPACE", "TQ_REDIS_CLUSTER", "TQ_REDIS_DURABLE", "TQ_REDIS_DURABLE_TIMEOUT_MS",
    "TQ_REDIS_ON_EVICTION", "TQ_REDIS_LOAD_LIBRARY", "TQ_STORAGE_TOKEN", "TQ_STORAGE_DURABLE",
    "TQ_STORAGE_REPLICAS", "TQ_ACL_PASSWORD", "TQ_HEARTBEAT_S",
    "TQ_BUFFER_CACHE", "TQ_COPY_THREADS", "TQ_NATIVE_COPY", "TQ_NATIVE_SCAN", "TQ_LOGGING_LEVEL",
)
"""The variables of the table above, in its order."""


def parse_flag(value: object, where: str, *, auto: bool = False) -> bool | None:
    """``True``/``False`` from a bool or ``1/0/true/false/yes/no/on/off``; with ``auto``, ``None``
    (decide later) from None, ``""`` or ``auto``. Raises :class:`ConfigError` naming ``where``."""
    if isinstance(value, bool):
        return value
    text = "" if value is None else str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    if auto and text in ("", "auto"):
        return None
    also = " (or leave it unset, or auto, to detect)" if auto else ""
    raise ConfigError(f"{where}={value!r} is not understood: use true or false{also}")


def _text(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


class Settings:
    """The ``TQ_*`` environment, one typed property per variable (see the module's table).

    Each property reads the environment when it is used; nothing is cached here.
    """

    @property
    def redis_url(self) -> str | None:
        """``TQ_REDIS_URL``: the Redis URL, or None (``init()`` then starts an embedded server)."""
        return _text("TQ_REDIS_URL")

    @property
    def namespace(self) -> str | None:
        """``TQ_NAMESPACE``: the job's namespace, or None (the caller's default, ``tq``)."""
        return _text("TQ_NAMESPACE")

    @property
    def redis_cluster(self) -> bool | None:
        """``TQ_REDIS_CLUSTER``: True/False, or None to detect whether the server is a cluster."""
        return parse_flag(os.environ.get("TQ_REDIS_CLUSTER"), "TQ_REDIS_CLUSTER", auto=True)

    @property
    def redis_durable(self) -> str | None:
        """``TQ_REDIS_DURABLE``: the durable mode as written (:mod:`tq_redis.server.durability` reads it)."""
        return _text("TQ_REDIS_DURABLE")

    @property
    def redis_durable_timeout_ms(self) -> str | None:
        """``TQ_REDIS_DURABLE_TIMEOUT_MS`` as written (:mod:`tq_redis.server.durability` reads it)."""
        return _text("TQ_REDIS_DURABLE_TIMEOUT_MS")

    @property
    def redis_on_eviction(self) -> str | None:
        """``TQ_REDIS_ON_EVICTION`` as written (:mod:`tq_redis.server.policy` checks the choice)."""
        return _text("TQ_REDIS_ON_EVICTION")

    @property
    def redis_load_library(self) -> str | None:
        """``TQ_REDIS_LOAD_LIBRARY`` as written (:mod:`tq_redis.server.policy` checks the choice)."""
        return _text("TQ_REDIS_LOAD_LIBRARY")

    @property
    def storage_token(self) -> str | None:
        """``TQ_STORAGE_TOKEN``: the storage nodes' token, or None."""
        return _text("TQ_STORAGE_TOKEN")

    @property
    def storage_durable(self) -> str | None:
        """``TQ_STORAGE_DURABLE``: ``storage.durable`` when ``init``'s config does not give it, or None."""
        return _text("TQ_STORAGE_DURABLE")

    @property
    def storage_replicas(self) -> int | None:
        """``TQ_STORAGE_REPLICAS``: ``storage.replicas`` when the config gives none, or None."""
        text = _text("TQ_STORAGE_REPLICAS")
        if text is None:
            return None
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"TQ_STORAGE_REPLICAS={text!r}: expected an integer >= 1 (copies of each value), e.g. 2")
        return int(text)

    @property
    def acl_password(self) -> str | None:
        """``TQ_ACL_PASSWORD``: the password for a namespace's ACL user, or None (one is generated)."""
        return _text("TQ_ACL_PASSWORD")

    @property
    def heartbeat_s(self) -> float:
        """``TQ_HEARTBEAT_S``: seconds between a client's liveness heartbeats (default 10)."""
        text = _text("TQ_HEARTBEAT_S")
        if text is None:
            return 10.0
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ConfigError(f"TQ_HEARTBEAT_S={text!r}: expected a positive number of seconds, e.g. 10")
        return value

    @property
    def buffer_cache(self) -> int:
        """``TQ_BUFFER_CACHE``: bytes of warm output buffers to keep; 0 turns the cache off (default 1 GiB)."""
        text = _text("TQ_BUFFER_CACHE")
        if text is None:
            return 1 << 30
        if text.lower() in ("0", "off", "none"):
            return 0
        try:
            return parse_size(text)
        except ConfigError as exc:
            raise ConfigError(f"TQ_BUFFER_CACHE: {exc}, or 0 to turn the buffer cache off") from None

    @property
    def copy_threads(self) -> int | None:
        """``TQ_COPY_THREADS``: threads per batched copy, or None (up to 4, by the CPUs this process may use)."""
        text = _text("TQ_COPY_THREADS")
        if text is None:
            return None
        try:
            threads = int(text)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ConfigError(f"TQ_COPY_THREADS={text!r}: expected a whole number of threads >= 1")
        return threads

    @property
    def native_copy(self) -> bool:
        """``TQ_NATIVE_COPY``: use the C copy module when it is built (default True)."""
        return bool(parse_flag(_text("TQ_NATIVE_COPY") or "1", "TQ_NATIVE_COPY"))

    @property
    def native_scan(self) -> bool:
        """``TQ_NATIVE_SCAN``: use the C scan module when it is built (default True)."""
        return bool(parse_flag(_text("TQ_NATIVE_SCAN") or "1", "TQ_NATIVE_SCAN"))

    @property
    def logging_level(self) -> str | None:
        """``TQ_LOGGING_LEVEL``: the level name or number for tq-redis's loggers, or None (the caller's default)."""
        return _text("TQ_LOGGING_LEVEL")


settings = Settings()
"""The one :class:`Settings` object: ``from tq_redis.settings import settings``."""
