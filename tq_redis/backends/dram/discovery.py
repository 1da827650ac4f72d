"""The ``dram`` store client's view of its nodes: discovery through Redis, the live ring, the links.

Storage nodes register in Redis under :func:`~tq_redis.meta.keys.storage_nodes_key` and heartbeat
there. :class:`NodeDiscovery` (the base of :class:`~tq_redis.backends.dram.store.DramStore`) reads that
registry with Redis's clock in one round trip through :class:`~tq_redis.server.registry.RegistryReader`
(``lua/read_registry.lua``, a function of the library: a namespace's ACL user runs no ``EVAL``), a
plain redis-py client below the user-facing client and the operations, which this module never
imports (as fsspec's implementations never import its user API). It keeps a :class:`~tq_redis.backends.dram.pool.Link`
per node instance (made when a node appears, closed when it leaves or restarts as a new
instance), and builds the placement :class:`~tq_redis.backends.dram.placement.Ring` of the live
ones (heartbeat fresh), trusted for ``refresh_s``. While Redis is unreachable the last known ring
serves; while every registered node looks dead it re-reads for up to ``registry_wait_s``. It holds
the options links connect with (token, timeouts, shared memory, TLS, ``max_frame``), starts afresh
after ``fork()``, and retries an operation once on a fresh ring when a node restarted or left.

Rings a put used are recorded in Redis (:func:`~tq_redis.meta.keys.storage_rings_key`: ring id -> its
members) before the put's bytes are sent, so any process can later place a key under a ring it
never saw live (:meth:`NodeDiscovery.recorded_ring`) and reach the node that holds it.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import uuid
import weakref
from typing import Any

import redis

from tq_redis.backends.dram.placement import Member, Ring, replicas_of
from tq_redis.backends.dram.pool import Link
from tq_redis.errors import ConfigError, ConnectionFailed, StorageError, StorageUnavailable
from tq_redis.meta.keys import storage_nodes_key, storage_rings_key
from tq_redis.redact import public_registration, redact
from tq_redis.server.registry import DEFAULT_FORGET_AFTER_S, RegistryReader, forget_nodes, forgettable
from tq_redis.settings import settings

log = logging.getLogger(__name__)

__all__ = ["NodeDiscovery"]

#: how often the registry is re-read while every registered node looks dead (see registry_wait_s)
_REGISTRY_POLL_S = 0.05


def _members(ring: Ring) -> list[Member]:
    """A ring's nodes as recorded members (id, address, host)."""
    return [Member(lk.node_id, lk.address, lk.host) for lk in ring.links]


def _release(links: dict[Any, Link], client: Any) -> None:
    """Finaliser of a store dropped without ``close()``: close its sockets and unmap node slabs."""
    for link in list(links.values()):
        try:
            link.close()
        except Exception:  # noqa: BLE001 - a finaliser must not raise; the OS reclaims the rest
            pass
    links.clear()
    try:
        client.close()
    except Exception:  # noqa: BLE001
        pass


class NodeDiscovery:
    """The live nodes of one namespace and this client's links to them (thread-safe).

    The options are checked by the store that extends this class (see its ``__init__``).
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        *,
        token: str | None,
        timeout_s: float,
        shm: bool,
        max_frame: int,
        refresh_s: float,
        dead_after_s: float,
        registry_wait_s: float,
        forget_after_s: float = DEFAULT_FORGET_AFTER_S,
        tls: bool | None,
        tls_ca: str | None,
        tls_check_hostname: bool,
        replicas: int = 1,
    ) -> None:
        self.replicas = replicas
        self.tls = tls
        self.tls_ca = tls_ca
        self.tls_check_hostname = bool(tls_check_hostname)
        self._tls_ctx: ssl.SSLContext | None = None
        self.max_frame = max_frame
        self.registry_wait_s = float(registry_wait_s)
        self.redis_url = redis_url
        self.namespace = namespace
        self.token = token if token is not None else settings.storage_token
        self.timeout_s = float(timeout_s)
        self.shm = bool(shm)
        self.refresh_s = float(refresh_s)
        self.dead_after_s = float(dead_after_s)
        self.forget_after_s = float(forget_after_s)
        self.client_id = uuid.uuid4().hex
        # no reconnect loop of its own: while Redis is away the last known node list serves; the
        # reader checks (and loads, where allowed) the library before the first call, as clients do
        self._registry = RegistryReader(
            redis_url, reconnect=False, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
        )
        self._redis = self._registry.redis
        self._key = storage_nodes_key(namespace)
        self._rings_key = storage_rings_key(namespace)
        self._lock = threading.Lock()
        self._links: dict[tuple[str, str], Link] = {}
        self._by_id: dict[str, Link] = {}  # node id -> the link of its current registration (live or not)
        self._recorded: dict[str, Ring] = {}  # ring id -> ring, for rings known to be in Redis
        self._seen: dict[str, Ring] = {}  # ring id -> members, of every live ring this process used
        self._ring: Ring | None = None
        self._fetched = 0.0
        self._stale = True
        self._seen_live = False  # some node was live once: an empty registry may be a Redis restart
        self._closed = False
        self._pid = os.getpid()
        # a store dropped without close() still lets go of its sockets and the nodes' memory slabs
        self._finalizer = weakref.finalize(self, _release, self._links, self._redis)

    def _mark_stale(self) -> None:
        """The node list is out of date (a node restarted): read it again before the next operation."""
        self._stale = True

    def tls_context(self, required: bool) -> ssl.SSLContext | None:
        """The TLS context for a TCP connection to a node (None: plain TCP).

        ``required``: the node's registration says it serves TLS. The ``tls`` option decides
        (None follows the node); a context is built once, verifying with ``tls_ca``.
        """
        use = required if self.tls is None else self.tls
        if not use:
            return None
        if self._tls_ctx is None:
            try:
                ctx = ssl.create_default_context(cafile=self.tls_ca)
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"the dram store option tls_ca={self.tls_ca!r} is not a readable PEM file ({exc})"
                ) from None
            ctx.check_hostname = self.tls_check_hostname
            self._tls_ctx = ctx
        return self._tls_ctx

    def _read_registry(self) -> tuple[float, dict[str, dict[str, Any]]]:
        """Redis's clock and every registration, in one round trip (``lua/read_registry.lua``).

        Connection failures are :class:`ConnectionFailed`; an ACL refusal or a library that is not
        loaded raise their own typed errors (a stale node list would not fix them).
        """
        reply = self._registry.read(self.namespace)
        nodes = {}
        for k, v in reply.entries:
            try:
                info = json.loads(v)
                if not isinstance(info, dict):
                    raise ValueError("not an object")
                nodes[k] = info
            except ValueError:
                log.warning("ignoring unreadable storage-node registration %r", k)
        return reply.now, nodes

    def _after_fork(self) -> None:
        """In a forked child: never talk over the parent's sockets; start with fresh state."""
        for link in self._links.values():
            for conn in link.idle:
                conn.sock.close()  # close (no shutdown): the parent's connection stays intact
            link.idle = []
            link.closed = True
        self._links.clear()  # the same dict: the finaliser holds it
        self._by_id = {}
        self._ring = None
        self._lock = threading.Lock()
        self.client_id = uuid.uuid4().hex
        self._pid = os.getpid()

    def _current_ring(self, force: bool = False) -> Ring:
        if self._closed:
            raise StorageError("the dram store is closed")
        if self._pid != os.getpid():
            self._after_fork()
        now = time.monotonic()
        ring = self._ring
        if ring is not None and not force and not self._stale and now - self._fetched < self.refresh_s:
            return ring
        with self._lock:
            if (
                self._ring is not None
                and not force
                and not self._stale
                and (time.monotonic() - self._fetched < self.refresh_s)
            ):
                return self._ring
            try:
                live = self._read_live()
            except ConnectionFailed:
                if self._ring is not None:  # keep serving with the last known ring
                    log.warning("Redis unreachable; using the last known storage-node list")
                    return self._ring
                raise
            if not live:
                raise StorageUnavailable(
                    f"no live DRAM storage node is registered in namespace {self.namespace!r} at "
                    f"{redact(self.redis_url)} (key {self._key}); start some with `tq-redis storage-unit "
                    f"--redis URL --namespace {self.namespace} ...` or `tq-redis up`"
                )
            self._ring = Ring(live, self.replicas)
            self._seen.setdefault(self._ring.id, Ring(_members(self._ring), self.replicas))
            self._seen_live = True
            self._fetched = time.monotonic()
            self._stale = False
            return self._ring

    def _read_live(self) -> list[Link]:
        """The live nodes' links (lock held), re-reading the registry for up to ``registry_wait_s``
        while every registered node looks dead but one may be about to beat again.

        That is the moment after a Redis outage longer than ``dead_after_s`` (or a Redis restart
        that lost the registry): running nodes re-register within a fraction of a second of Redis
        returning, and an operation should not fail in between.
        """
        deadline = time.monotonic() + self.registry_wait_s
        while True:
            rnow, nodes = self._read_registry()
            nodes = self._without_gone(rnow, nodes)
            live = self._update_links(rnow, nodes)
            if live or not (nodes or self._seen_live) or time.monotonic() >= deadline:
                return live
            time.sleep(_REGISTRY_POLL_S)

    def _without_gone(self, rnow: float, nodes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The registrations less those of nodes that are gone, which are removed from Redis
        (``forget_after_s``; at once for a node of this host whose process is gone)."""
        gone = forgettable(nodes, rnow, self.dead_after_s, self.forget_after_s)
        if not gone:
            return nodes
        try:
            forget_nodes(self._redis, self.namespace, gone)
        except redis.RedisError as exc:  # the next read tries again; the nodes stay out of the ring anyway
            log.warning("could not remove the registrations of gone storage nodes %s: %s", gone, exc)
        log.info("removed the registrations of storage nodes that are gone: %s", ", ".join(gone))
        return {k: v for k, v in nodes.items() if k not in gone}

    def _update_links(self, rnow: float, nodes: dict[str, dict[str, Any]]) -> list[Link]:
        """Links for the registered nodes (new ones made, departed ones closed); the live ones."""
        live: list[Link] = []
        seen = set()
        by_id: dict[str, Link] = {}
        for node_id, info in sorted(nodes.items()):
            info.setdefault("node_id", node_id)
            try:
                heartbeat = float(info.get("heartbeat", 0))
                if not (isinstance(info.get("address"), str) and isinstance(info.get("instance"), str)):
                    raise ValueError("no address or instance")
            except (TypeError, ValueError) as exc:
                log.warning("ignoring malformed storage-node registration %r (%s)", node_id, exc)
                continue
            key = (node_id, info["instance"])
            seen.add(key)
            link = self._links.get(key)
            if link is None:
                link = self._links[key] = Link(info, self)
            else:
                link.info = info
            link.heartbeat_age = rnow - heartbeat
            by_id[node_id] = link
            if rnow - heartbeat <= self.dead_after_s:
                live.append(link)
        for key in [k for k in self._links if k not in seen]:
            self._links.pop(key).close()  # deregistered or restarted as a new instance
        self._by_id = by_id
        return live

    # -- rings recorded in Redis ----------------------------------------------------------------
    def record_ring(self, ring: Ring) -> None:
        """Make sure ``ring``'s members are in Redis under its id (once per ring and process), so a
        value put under it can be found by any process whatever the live ring is by then."""
        if ring.id in self._recorded:
            return
        if ring.replicas == 1:
            members = json.dumps([[lk.node_id, lk.address] for lk in ring.links])
        else:  # the hosts decide a replicated ring's holders: every reader needs them
            members = json.dumps([[lk.node_id, lk.address, lk.host] for lk in ring.links])
        try:
            self._redis.hsetnx(self._rings_key, ring.id, members)
        except redis.RedisError as exc:
            raise ConnectionFailed(
                f"cannot record the DRAM storage nodes of a put in Redis at {redact(self.redis_url)} ({exc}); "
                f"check that Redis is running"
            ) from exc
        self._recorded[ring.id] = Ring(_members(ring), ring.replicas)

    def recorded_ring(self, ring_id: str) -> Ring:
        """The ring a value was put under, or this process read under, from its id (read from
        Redis once per process)."""
        ring = self._recorded.get(ring_id) or self._seen.get(ring_id)
        if ring is not None:
            return ring
        try:
            raw = self._redis.hget(self._rings_key, ring_id)
        except redis.RedisError as exc:
            raise ConnectionFailed(
                f"cannot read where DRAM values were put from Redis at {redact(self.redis_url)} ({exc}); "
                f"check that Redis is running"
            ) from exc
        try:
            listed = json.loads(raw)
            if not all(isinstance(m, list) and 2 <= len(m) <= 3 for m in listed):
                raise ValueError("a member is not [node id, address(, host)]")
            members = [Member(*map(str, m)) for m in listed]
        except (TypeError, ValueError) as exc:
            raise StorageError(
                f"the DRAM node ring {ring_id!r} that values were put under is not recorded in Redis "
                f"({self._rings_key}: {'missing' if raw is None else 'unreadable'}); the values cannot be located"
            ) from exc
        ring = self._recorded[ring_id] = Ring(members, replicas_of(ring_id))
        return ring

    def link_of(self, node_id: str) -> Link | None:
        """The link of ``node_id``'s current registration (live or not); None: it is not registered."""
        try:
            self._current_ring()  # the registry as read at most refresh_s ago
        except StorageUnavailable:
            pass  # no node is live: the registrations read on the way still say who is registered
        return self._by_id.get(node_id)

    def nodes(self) -> list[dict[str, Any]]:
        """Registration of every live node (address, capacity, used bytes, heartbeat ...), without its access key."""
        return [public_registration(lk.info) for lk in self._current_ring(force=True).links]

    def _with_retry(self, fn):
        """Run ``fn(ring)``; if a node failed because it restarted or left, retry once on a fresh ring."""
        ring = self._current_ring()
        try:
            return fn(ring)
        except StorageUnavailable as exc:
            self._mark_stale()
            before = {lk.node_id: lk.instance for lk in ring.links}
            try:
                fresh = self._current_ring(force=True)
            except (StorageUnavailable, ConnectionFailed):
                raise exc from None  # the error naming the node says more than "no nodes left"
            if {lk.node_id: lk.instance for lk in fresh.links} == before:
                raise
            return fn(fresh)
