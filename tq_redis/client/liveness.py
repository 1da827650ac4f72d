"""Which clients of a namespace are alive: a heartbeat per process, no round trip per operation.

Every client (``TransferQueueClient``, ``AsyncTransferQueueClient``, and the facades built on them)
registers with :func:`attach` once its first operation succeeded (a server it may not use gets
nothing written); a process runs one daemon thread per (Redis URL, namespace) that,
every :data:`BEAT_S` seconds, writes the process's entry in ``<ns>:clients`` (a ZSET: client id ->
the time, by Redis's clock, after which it counts as gone) and ``touched_ms`` in ``<ns>:config``
(the namespace's last sign of life; ``created_ms`` is set once). The ZSET expires by itself a while
after the last client stopped beating, and :func:`detach` of the last client removes the entry at
once. Nothing is added to the operations themselves.

The heartbeat also reads the namespace's ``epoch`` first (:mod:`tq_redis.server.identity`): a client
of this process whose epoch it no longer is -- Redis flushed or lost the namespace while the client
sat idle, where no reconnect would show it -- is marked lost, so its next call raises
``ServerStateLost``; and a beat writes nothing for a namespace none of its clients still belongs to
(it would bring back a ``<ns>:config`` without an epoch).

:mod:`tq_redis.monitor.namespaces` reads these records to list namespaces, to refuse dropping one that a
live client still uses, and to drop those whose ``namespace_ttl`` ran out.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Iterable
from typing import Any

import redis

from tq_redis.errors import ServerStateLost
from tq_redis.meta.keys import clients_key, config_key
from tq_redis.server import connections
from tq_redis.server.identity import FIELD, Identity, text
from tq_redis.settings import settings

log = logging.getLogger(__name__)

__all__ = ["BEAT_S", "GONE_AFTER_S", "attach", "beat", "detach", "live_clients"]

#: how often a process's entry is written (``TQ_HEARTBEAT_S``, default 10)
BEAT_S = settings.heartbeat_s
#: an entry not written again for this long counts as a client that is gone (SIGKILLed, cut off)
GONE_AFTER_S = 3 * BEAT_S


class _Heartbeat:
    """The heartbeat of one process for one (URL, namespace): a daemon thread and a refcount."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url, self.namespace = url, namespace
        self.client_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.users = 0
        self.identities: weakref.WeakSet[Identity] = weakref.WeakSet()  # of the clients counted in users
        self.identities_lock = threading.Lock()  # not _lock: attach holds that while the first beat runs
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._redis: Any = None

    def remember(self, identity: Identity | None) -> None:
        """Check ``identity`` (a client's, see :mod:`tq_redis.server.identity`) in every beat."""
        if identity is not None:
            with self.identities_lock:
                self.identities.add(identity)

    def start(self) -> None:
        """The first beat now (the client counts as live when its first operation returns), then
        one every :data:`BEAT_S` from a daemon thread."""
        self._beat()
        self.thread = threading.Thread(target=self._run, name="tq-liveness", daemon=True)
        self.thread.start()

    def _beat(self) -> bool:
        try:
            if self._redis is None:
                self._redis = connections.sync_client(self.url, reconnect=False, socket_timeout=5,
                                                      socket_connect_timeout=5)
            with self.identities_lock:
                identities = list(self.identities)
            beat(self._redis, self.namespace, self.client_id, identities)
            return True
        except redis.RedisError as exc:  # Redis away: try again next beat (nothing depends on it now)
            log.info("liveness heartbeat of namespace %r failed (will retry): %s", self.namespace, exc)
            return False

    def _run(self) -> None:
        while not self.stop.wait(BEAT_S):
            self._beat()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)
        try:
            client = self._redis or connections.sync_client(self.url, reconnect=False, socket_timeout=2,
                                                            socket_connect_timeout=2)
            client.zrem(clients_key(self.namespace), self.client_id)
            client.close()
        except (redis.RedisError, OSError):
            pass  # the entry expires by itself


_lock = threading.Lock()
_beats: dict[tuple[int, str, str], _Heartbeat] = {}


def attach(url: str, namespace: str, identity: Identity | None = None) -> str:
    """Count a client of ``namespace`` at ``url`` in this process (starting its heartbeat); returns
    the process's client id there. ``identity``: the client's, which each beat checks."""
    key = (os.getpid(), url, namespace)
    with _lock:
        hb = _beats.get(key)
        if hb is None:
            hb = _beats[key] = _Heartbeat(url, namespace)
            hb.remember(identity)
            hb.start()
        else:
            hb.remember(identity)
        hb.users += 1
        return hb.client_id


def detach(url: str, namespace: str, identity: Identity | None = None) -> None:
    """A client of ``namespace`` at ``url`` closed; the last one stops the heartbeat and removes
    the process's entry."""
    key = (os.getpid(), url, namespace)
    with _lock:
        hb = _beats.get(key)
        if hb is None:
            return
        if identity is not None:
            with hb.identities_lock:
                hb.identities.discard(identity)
        hb.users -= 1
        if hb.users > 0:
            return
        del _beats[key]
    hb.close()


def beat(r: Any, namespace: str, client_id: str, identities: Iterable[Identity] = ()) -> None:
    """Write ``client_id``'s liveness entry and the namespace's ``touched_ms`` (Redis's clock).

    With ``identities`` (the process's clients of the namespace), the namespace's epoch is read first:
    each client whose epoch it is not is marked lost, and nothing is written unless one still belongs."""
    identities = list(identities)
    if identities and not _belongs(text(r.hget(config_key(namespace), FIELD)), identities):
        return
    sec, usec = r.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    key = clients_key(namespace)
    pipe = r.pipeline(transaction=False)
    pipe.zadd(key, {client_id: now_ms + int(GONE_AFTER_S * 1000)})
    pipe.zremrangebyscore(key, "-inf", now_ms)
    pipe.pexpire(key, int(2 * GONE_AFTER_S * 1000))
    pipe.hsetnx(config_key(namespace), "created_ms", now_ms)
    pipe.hset(config_key(namespace), "touched_ms", now_ms)
    pipe.execute()


def _belongs(epoch: str | None, identities: list[Identity]) -> bool:
    """Check each client's epoch against ``epoch``; whether one of them still belongs to it."""
    belongs = False
    for ident in identities:
        try:
            ident.verify(epoch, "seen by the liveness heartbeat")
        except ServerStateLost:
            continue
        belongs = belongs or ident.epoch in (None, epoch)  # one not learned yet knows of no other
    return belongs


def live_clients(r: Any, namespace: str, now_ms: int) -> list[str]:
    """Ids (``host:pid:random``) of the clients of ``namespace`` whose last beat is recent."""
    found = r.zrangebyscore(clients_key(namespace), now_ms, "+inf")
    return [m.decode() if isinstance(m, bytes) else str(m) for m in found]
