"""Durable mode: every acknowledged transition waits until replicas (or the AOF) hold it.

Redis replicates asynchronously and, with ``appendfsync everysec``, fsyncs its AOF once a second:
a put, claim, ack or clear that Redis acknowledged can still vanish if the primary dies before a
replica (or the disk) has it -- a Sentinel failover then promotes a replica without it. Durable
mode closes that window at the cost of one wait per call:

``none`` (default)
    No wait: a call returns when the primary has applied it.
``replicas[:N]`` (N = 1 by default)
    After each writing function call, ``WAIT N timeout`` on the same connection, in the same round
    trip: the call returns once N replicas acknowledged everything this connection wrote.
``aof[:N]`` (N = 0 by default)
    ``WAITAOF 1 N timeout``: the primary fsynced it to its AOF (and N replicas to theirs). Needs
    ``appendonly yes`` and Redis >= 7.2 or Valkey >= 8.0; refused with :class:`DurabilityUnsupported`
    when the client starts otherwise (Redis 7.0 has no ``WAITAOF``).

Set with ``init({"redis": {"durable": "replicas:1", "durable_timeout_ms": 1000}})`` or the
environment ``TQ_REDIS_DURABLE`` / ``TQ_REDIS_DURABLE_TIMEOUT_MS`` (every process of a job should
use the same setting, like ``TQ_REDIS_CLUSTER``); a client built directly takes the setting
``init`` declared for its URL (:func:`declare`), else the environment.

When fewer replicas (or fsyncs) than asked confirm within the timeout, the operation still runs to
its end (the write happened on the primary and every later step of the operation happens too, so
nothing is left half-done) and then raises :class:`NotDurable`, whose ``result`` holds what the
call would have returned -- except a claim, which is handed back first so that a failover cannot
hand its samples out twice (``result`` None; see :func:`tq_redis.ops.claim.not_durable_claim`).
What a failover costs in each mode is tabled in the README ("High availability"). Durable mode is
not supported on a Redis Cluster (a wait must follow the write on the connection of the node that
took it; a cluster pipeline spreads over several).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tq_redis.errors import ConfigError, DurabilityUnsupported, NotDurable
from tq_redis.settings import settings

ENV = "TQ_REDIS_DURABLE"
TIMEOUT_ENV = "TQ_REDIS_DURABLE_TIMEOUT_MS"
MODES = ("none", "replicas", "aof")
DEFAULT_TIMEOUT_MS = 1000
_DEFAULT_REPLICAS = {"none": 0, "replicas": 1, "aof": 0}

#: function calls that are not followed by a wait: pure reads, and bookkeeping nobody is told about
#: (temporary keys of a status query, a waiter's registration, the ready list of a user sampler)
NOT_WAITED = frozenset({"version", "check_visible", "kv_list", "progress", "ready_ids", "wait"})

_lock = threading.Lock()
_declared: dict[str, Durability] = {}


@dataclass(frozen=True)
class Durability:
    """One durable-mode setting: ``mode``, how many ``replicas`` must confirm, ``timeout_ms``."""

    mode: str = "none"
    replicas: int = 0
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def __str__(self) -> str:
        return self.mode if not self.enabled else f"{self.mode}:{self.replicas}"

    def command(self) -> tuple:
        """The wait sent after a writing call."""
        if self.mode == "aof":
            return ("WAITAOF", 1, self.replicas, self.timeout_ms)
        return ("WAIT", self.replicas, self.timeout_ms)

    def shortfall(self, reply: Any) -> str | None:
        """None if ``reply`` (to :meth:`command`) confirms the write, else what is missing."""
        if self.mode == "aof":
            local, replicas = int(reply[0]), int(reply[1])
            if local >= 1 and replicas >= self.replicas:
                return None
            return (f"the primary {'fsynced' if local else 'did not fsync'} it to its AOF and "
                    f"{replicas} of {self.replicas} replica(s) fsynced it")
        acked = int(reply)
        return None if acked >= self.replicas else f"{acked} of {self.replicas} replica(s) acknowledged it"

    def waits_after(self, name: str) -> bool:
        """Whether a call of ``tq_<name>`` is followed by a wait."""
        return self.enabled and name not in NOT_WAITED

    def not_durable(self, url: str, missing: str, result: Any) -> NotDurable:
        """The error for a write that was applied but not confirmed."""
        return NotDurable(
            f"the write was applied by the Redis primary at {url} but is NOT durable: within "
            f"{self.timeout_ms} ms {missing} (durable mode {self}). A failover before the replicas catch "
            f"up can lose it. The call's result is on this error's .result; check the replicas "
            f"(INFO replication) or raise redis.durable_timeout_ms / {TIMEOUT_ENV}",
            result,
        )


def _count(text: str, where: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {text!r} is not a number of replicas") from None
    if value < 0:
        raise ConfigError(f"{where}: the number of replicas must be >= 0, got {value}")
    return value


def _timeout(value: Any, where: str) -> int:
    try:
        ms = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where} must be a whole number of milliseconds, got {value!r}") from None
    if ms <= 0:
        raise ConfigError(f"{where} must be positive (milliseconds a write waits for its replicas), got {ms}")
    return ms


def parse(value: Any, timeout_ms: Any = None, where: str = "redis.durable") -> Durability:
    """A :class:`Durability` from ``none``/``replicas[:N]``/``aof[:N]``, a mapping
    ``{mode, replicas, timeout_ms}``, a :class:`Durability` or None (``none``)."""
    if isinstance(value, Durability):
        return value if timeout_ms is None else Durability(value.mode, value.replicas, _timeout(timeout_ms, where))
    replicas: int | None = None
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"mode", "replicas", "timeout_ms"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; use mode, replicas, timeout_ms")
        if value.get("replicas") is not None:
            replicas = _count(value["replicas"], where)
        timeout_ms = value.get("timeout_ms", timeout_ms)
        value = value.get("mode")
    text = "none" if value is None or value is False else str(value).strip().lower()
    mode, colon, count = text.partition(":")
    mode = mode or "none"
    if mode in ("off", "false", "0", "no"):
        mode = "none"
    if mode not in MODES:
        raise ConfigError(f"{where}={value!r} is not understood: use none, replicas[:N] (WAIT for N replicas) "
                          f"or aof[:N] (WAITAOF: fsynced locally and on N replicas)")
    if colon:
        replicas = _count(count, where)
    if replicas is None:
        replicas = _DEFAULT_REPLICAS[mode]
    if mode == "replicas" and replicas == 0:
        raise ConfigError(f"{where}={value!r}: replicas:0 waits for nothing; use none, or replicas:1 or more")
    timeout = DEFAULT_TIMEOUT_MS if timeout_ms is None else _timeout(timeout_ms, f"{where} timeout")
    return Durability(mode, replicas if mode != "none" else 0, timeout)


def from_env() -> Durability:
    """The setting of ``TQ_REDIS_DURABLE`` / ``TQ_REDIS_DURABLE_TIMEOUT_MS`` (``none`` when unset)."""
    return parse(settings.redis_durable, settings.redis_durable_timeout_ms, ENV)


def declare(url: str, setting: Any, timeout_ms: Any = None) -> None:
    """Record the durable mode ``init`` was configured with for ``url`` (None: forget it), e.g.
    ``declare(url, cfg["redis"]["durable"], cfg["redis"]["durable_timeout_ms"])``."""
    parsed = None if setting is None else parse(setting, timeout_ms)
    with _lock:
        if parsed is None:
            _declared.pop(url, None)
        else:
            _declared[url] = parsed


def for_url(url: str) -> Durability:
    """The durable mode of clients of ``url``: what ``init`` declared for it, else the environment."""
    with _lock:
        declared = _declared.get(url)
    return declared if declared is not None else from_env()


def unsupported(url: str, setting: Durability, exc: BaseException) -> DurabilityUnsupported:
    """The error for a server that refused the probe of :meth:`Durability.command` (at client start)."""
    text = str(exc)
    if "unknown command" in text.lower():
        why = (f"the server has no {setting.command()[0]} command (WAITAOF needs Redis >= 7.2 or Valkey >= 8.0; "
               f"Redis 7.0 lacks it): use redis.durable=replicas[:N] / {ENV}=replicas, or upgrade the server")
    elif "appendonly" in text.lower():
        why = "the primary runs without an AOF: start it with appendonly yes, or use durable mode replicas[:N]"
    else:
        why = f"the server refused it ({text})"
    return DurabilityUnsupported(f"durable mode {setting} cannot be used with the Redis at {url}: {why}")


def probe_command(setting: Durability) -> tuple:
    """A wait that returns at once and fails the way real ones would on an unfit server."""
    return ("WAITAOF", 1, 0, 1) if setting.mode == "aof" else ("WAIT", 0, 1)


def on_cluster(url: str, setting: Durability) -> DurabilityUnsupported:
    """The error for durable mode on a Redis Cluster."""
    return DurabilityUnsupported(
        f"durable mode {setting} is not supported on a Redis Cluster ({url}): use a single primary with "
        f"replicas (behind Sentinel: redis+sentinel://...), or set redis.durable=none / {ENV}=none"
    )
