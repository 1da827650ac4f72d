"""The storage-node registry in Redis: read with the server's clock, and rid of nodes that are gone.

Storage nodes register under :func:`~tq_redis.meta.keys.storage_nodes_key` (node id -> its
registration JSON) and heartbeat there. A store that places values on them reads that hash with
:class:`RegistryReader`: one ``FCALL tq_read_registry`` (``lua/read_registry.lua``, a function of the
library, since a namespace's ACL user may not ``EVAL``) returns Redis's ``TIME`` and every
registration, keyed by the registry key so a Redis Cluster runs it on the node that owns it.

This module sits in ``server``, below the client and the operations, so a store reads its
registry with a plain redis-py client from :mod:`tq_redis.server.connections` and never imports the
user-facing client. Before its first call on a server (on a cluster: on the primary that owns the
registry, and again on a new owner after a failover) it makes the checks a client driver makes
(:func:`tq_redis.server.policy.node_checks`: the eviction policy, and the library loaded where
``redis.load_library`` allows, else :class:`~tq_redis.errors.LibraryNotLoaded`); it loads the library
again and retries once when the call finds no function, waits out ``BUSY``, and raises the typed
errors a driver raises: :class:`~tq_redis.errors.ConnectionFailed` when Redis cannot be reached,
:class:`~tq_redis.errors.PermissionDenied` for an ACL refusal, and so on.

:func:`forgettable` and :func:`forget_nodes` judge and remove the registrations of nodes that are
gone; the DRAM store and ``tq-redis namespace gc`` share them.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import redis
from redis.exceptions import AskError, RedisClusterException

from tq_redis import instruments
from tq_redis.errors import ConnectionFailed, TQError
from tq_redis.meta.keys import pending_deletes_key, pending_nodes_key, storage_nodes_key
from tq_redis.redact import redact
from tq_redis.server import connections, policy
from tq_redis.server import library as scripts

__all__ = [
    "DEFAULT_FORGET_AFTER_S",
    "FUNCTION",
    "Registry",
    "RegistryReader",
    "decode_registry",
    "forget_nodes",
    "forgettable",
    "read_command",
]

#: a storage-node registration whose heartbeat is older than this is removed (its node is gone)
DEFAULT_FORGET_AFTER_S = 600.0
#: the library function that reads the registry (``lua/read_registry.lua``)
FUNCTION = "read_registry"

# Redis could not be reached (a cluster that lost slots or kept moving counts too)
_UNREACHABLE = (
    redis.ConnectionError, redis.TimeoutError, OSError,
    redis.exceptions.ClusterError, redis.exceptions.SlotNotCoveredError,
)  # fmt: skip
_HOST = socket.gethostname()


class Registry(NamedTuple):
    """Reply of ``lua/read_registry.lua``."""

    now: float  #: the server's clock, in seconds
    entries: list[tuple[str, bytes]]  #: (node id, registration JSON as the node wrote it), every node


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_registry(reply: Sequence[Any]) -> Registry:
    """``{seconds, microseconds, {node id, registration, ...}}`` as a :class:`Registry`."""
    sec, usec, flat = reply
    return Registry(int(sec) + int(usec) / 1e6, [(_text(k), v) for k, v in zip(flat[::2], flat[1::2])])


def read_command(namespace: str) -> tuple[Any, ...]:
    """The ``FCALL`` that reads ``namespace``'s registry (its only key is the registry's)."""
    return ("FCALL", f"tq_{FUNCTION}", 1, storage_nodes_key(namespace))


class RegistryReader:
    """Reads storage-node registries from the Redis at ``url`` (single server, Cluster or Sentinel).

    ``redis_options`` are redis-py connection options (``socket_timeout`` ...). ``reconnect=False``
    (the default here) fails a call at once when Redis is away, so a store can keep serving with
    the nodes it read last instead of waiting out a backoff. :attr:`redis` is the client; a store
    may send its own commands on it.
    """

    def __init__(self, url: str, *, reconnect: bool = False, **redis_options: Any) -> None:
        self.url = url
        self.redis: Any = connections.sync_client(url, reconnect=reconnect, **redis_options)
        self._router = self.redis  # which cluster node owns a key: asked of the client it was made with
        self.cluster = connections.is_cluster_client(self.redis)
        self._checked: set[str] = set()  # nodes ("" for a single server) that passed the server checks

    def read(self, namespace: str) -> Registry:
        """Redis's clock and every registration of ``namespace``, in one round trip.

        Raises :class:`ConnectionFailed` when Redis cannot be reached; an ACL refusal, a library
        that is not (and may not be) loaded, an evicting server or any other refusal raise their
        own typed errors (see :func:`tq_redis.server.policy.typed_error`).
        """
        command = read_command(namespace)
        started = time.perf_counter()
        try:
            reply = self._call(command)
        except TQError:
            raise
        except Exception as exc:  # noqa: BLE001 - every Redis failure leaves typed
            raise self._typed(exc) from exc
        instruments.REDIS_CALL_SECONDS.labels(FUNCTION).observe(time.perf_counter() - started)
        try:
            return decode_registry(reply)
        except (TypeError, ValueError) as exc:
            raise ConnectionFailed(
                f"unexpected reply reading the storage-node registry from Redis at {redact(self.url)} ({exc})"
            ) from exc

    def close(self) -> None:
        """Close the client's connections."""
        self.redis.close()

    def _call(self, command: tuple[Any, ...]) -> Any:
        node = self._router.get_node_from_key(command[3]) if self.cluster else None
        if self._name(node) not in self._checked:
            self._check(node)
        try:
            return self._patiently(command)
        except redis.ResponseError as exc:
            if not scripts.is_missing_function(exc):
                raise
        # the server lost the library (FUNCTION FLUSH, a restart without persistence): load it, once
        self._checked.discard(self._name(node))
        self._check(node)
        return self._patiently(command)

    def _patiently(self, command: tuple[Any, ...]) -> Any:
        """Send ``command``, again while the server answers BUSY (it did not run)."""
        busy = policy.BusyWait()
        while True:
            try:
                return self.redis.execute_command(*command)
            except redis.ResponseError as exc:
                if not policy.is_busy(exc):
                    raise
                time.sleep(busy.next_pause(self.url, exc))

    @staticmethod
    def _name(node: Any) -> str:
        return "" if node is None else node.name

    def _check(self, node: Any) -> None:
        """Run :func:`tq_redis.server.policy.node_checks` against ``node`` (None: the one server)."""
        checks = policy.node_checks(self.url, self._name(node))
        on = {} if node is None else {"target_nodes": node}
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                command = checks.send(reply) if error is None else checks.throw(error)
            except StopIteration:
                break
            reply, error = None, None
            try:
                reply = self.redis.execute_command(*command, **on)
            except redis.ResponseError as exc:
                error = exc
        self._checked.add(self._name(node))

    def _typed(self, exc: BaseException) -> TQError:
        """The typed error for a failed registry read (as a client driver would raise it)."""
        typed = policy.typed_error(self.url, exc)
        if typed is not None:
            return typed
        if isinstance(exc, AskError) and not self.cluster:
            return connections.not_a_single_server(self.url, exc)
        if isinstance(exc, _UNREACHABLE):
            return ConnectionFailed(
                f"cannot reach Redis at {redact(self.url)} to read the storage-node registry ({exc}); "
                f"check that the server is running and the URL is right"
            )
        if isinstance(exc, RedisClusterException):
            return connections.cluster_failure(self.url, exc)
        if isinstance(exc, redis.ResponseError):
            return policy.unexpected_reply(self.url, exc)
        return ConnectionFailed(
            f"unexpected failure reading the storage-node registry from Redis at {redact(self.url)} ({exc!r})"
        )


# ------------------------------------------------------------------ nodes that are gone


def forgettable(
    registrations: dict[str, Any], now_s: float, dead_after_s: float, forget_after_s: float
) -> list[str]:
    """The node ids whose registration belongs to a node that is gone: no heartbeat for
    ``forget_after_s``, or (on this host) no heartbeat for ``dead_after_s`` and no process with
    its pid. ``registrations``: node id -> its JSON (str, bytes or already read)."""
    gone = []
    for node_id, raw in registrations.items():
        try:
            info = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
            age = now_s - float(info.get("heartbeat", 0))
        except (TypeError, ValueError, AttributeError):
            continue  # not ours to judge; the reader logs it
        if age > forget_after_s or (age > dead_after_s and info.get("host") == _HOST and not _running(info.get("pid"))):
            gone.append(node_id)
    return gone


def _running(pid: Any) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return True  # cannot tell: keep it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not reaped yet) is not running either
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def forget_nodes(r: Any, namespace: str, node_ids: list[str]) -> None:
    """Remove the registrations of gone nodes, and the deletes recorded for them (their memory is gone)."""
    if not node_ids:
        return
    pipe = r.pipeline(transaction=False)
    pipe.hdel(storage_nodes_key(namespace), *node_ids)
    pipe.srem(pending_nodes_key(namespace), *node_ids)
    for node_id in node_ids:
        pipe.delete(pending_deletes_key(namespace, node_id))
    pipe.execute()
