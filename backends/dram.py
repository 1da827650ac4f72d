"""Client of tq-redis's own DRAM storage nodes (the ``dram`` store).

Storage nodes (``backends/dram_server.py``) register themselves in Redis under
:func:`~tq_redis.keys.storage_nodes_key`; this client needs nothing but the Redis URL and the namespace.

Design, in short:

* **Placement** is rendezvous (highest-random-weight) hashing of each key over the live nodes
  (registered, heartbeat fresh by Redis's clock), so adding a node moves ~1/(n+1) of the keys. A
  get that misses on a key's first-ranked node also asks the second-ranked one (the node that held
  the key while the first was out of the ring), and deletes go to both.
* **Transport** is a small length-prefixed binary protocol over plain sockets: a 16-byte header,
  a msgpack header map and the raw concatenated values, written with ``sendmsg`` straight from the
  caller's buffers and read with ``recv_into`` straight into the node's memory (no per-value
  syscalls, no intermediate joins). One request per node per batch; the requests of a batch are
  all sent before any reply is read, so the nodes work in parallel.
* **Same host**: a client on the node's host connects over the node's abstract Unix socket and
  receives the node's memory slabs (``memfd`` file descriptors passed with ``SCM_RIGHTS``) once, and
  keeps them mapped. A put is then ALLOC (the node reserves space) -> one memcpy per segment into
  the mapped slab -> COMMIT; a get returns read-only views into the slabs (zero copy), *pinned* on
  the node until every view is garbage-collected, so the node never reuses memory a caller can
  still see. Slabs are anonymous (``memfd``), so nothing can be left in ``/dev/shm`` even when a
  node is SIGKILLed: the kernel frees a slab when the last process mapping it lets go.
* **Socket path** (other hosts, ``shm=False``, nodes started ``--no-shm``): blocking sockets with
  kernel timeouts, so a batch moves in about one syscall per 1024 values; received values are
  views of warm buffers from :mod:`tq_redis.buffers`, recycled once the caller drops them.
* **Threads and processes**: thread-safe (connections are pooled per node, one thread at a time
  each); a store used after ``fork()`` opens its own connections in the child.
* **Hostile or broken nodes**: no length a node announces is trusted before it is checked
  against a bound (a HELLO reply is at most 8 KiB; other header maps 64 MiB; payloads the
  ``max_frame`` option and the sizes in the reply), and a reply that does not decode or does not
  fit its request is a :class:`~tq_redis.backends.dram_protocol.ProtocolError` (a
  ``StorageUnavailable`` naming the node); its connection is dropped. With ``tls`` / ``tls_ca``
  TCP connections use TLS and verify the node's certificate.
* **Failures** are typed: an unreachable or silent node raises :class:`StorageUnavailable` naming
  it after at most ``timeout_s``; a full node :class:`StorageFull`; a missing key
  :class:`DataMissing`; a wrong token :class:`StorageAuthError`. A put spread over several nodes is
  two-phase (reserve + write everywhere, then commit), so a refusal leaves nothing half-written.

Modules of the client, each importing only those listed before it: :mod:`.dram_protocol` (the wire
format, shared with the node), :mod:`.dram_values` (put and get value tables),
:mod:`.dram_placement` (rendezvous hashing), :mod:`.dram_pool` (connections, mapped slabs and the
request exchange), and this one: the store (node discovery through Redis, put / get / delete).
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
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis
from tq_redis.backends.base import Buffer, Segments, StoreContext
from tq_redis.backends.batches import ValueTable
from tq_redis.backends.dram_placement import Ring, group_by_node
from tq_redis.backends.dram_pool import (
    Conn,
    Link,
    Unpin,
    check_data_reply,
    check_put_size,
    check_reply,
    exchange,
    hold,
    malformed,
    release,
    run,
)
from tq_redis.backends.dram_protocol import (
    OP_ABORT,
    OP_ALLOC,
    OP_COMMIT,
    OP_DEL,
    OP_GET,
    OP_PUT,
    OP_STATS,
    ProtocolError,
    format_size,
    layout,
    recv_into,
)
from tq_redis.backends.dram_values import Gathered, PutValues, private_copy

from tq_redis import buffers, connections
from tq_redis.config import parse_size
from tq_redis.errors import (
    ConfigError,
    ConnectionFailed,
    DataMissing,
    InvalidArgument,
    StorageAuthError,
    StorageError,
    StorageUnavailable,
)
from tq_redis.keys import storage_nodes_key

log = logging.getLogger(__name__)

#: Redis's clock and the registry in one call that a Redis Cluster routes by the registry key
_REGISTRY_SCRIPT = "local t = redis.call('TIME') return {t[1], t[2], redis.call('HGETALL', KEYS[1])}"
#: offsets and lengths in replies stay below this (so their sums cannot overflow int64)
_MAX_OFFSET = 1 << 48
#: how often the registry is re-read while every registered node looks dead (see registry_wait_s)
_REGISTRY_POLL_S = 0.05


def _int_table(raw: Any, dtype: str, n: int, link: Link, allow_negative: bool = False) -> np.ndarray:
    """A reply's packed integer column of ``n`` entries, checked (``ProtocolError`` if it is not one)."""
    width = np.dtype(dtype).itemsize
    if not isinstance(raw, bytes) or len(raw) != n * width:
        raise ProtocolError(f"DRAM storage node {link.label} sent a malformed reply: a column is not {n} integers")
    col = np.frombuffer(raw, dtype=dtype)
    if n and (int(col.max()) > _MAX_OFFSET or (not allow_negative and int(col.min()) < 0)):
        raise ProtocolError(f"DRAM storage node {link.label} sent an offset or length out of range")
    return col


def _put_reply(i: int, link: Link, conn: Conn, code: int, meta: dict[str, Any], plen: int, fds: list[int]) -> Any:
    """Reply handler of PUT / ALLOC: the header map, its transaction id and reservation checked."""
    meta = check_reply(i, link, conn, code, meta, plen, fds)
    txn = meta.get("txn")
    if txn is not None and type(txn) is not int:
        raise ProtocolError(f"DRAM storage node {link.label} sent a malformed transaction id {txn!r:.40}")
    chunks = meta.get("chunks")
    if chunks is not None and not (
        isinstance(chunks, list)
        and all(isinstance(c, list) and len(c) == 4 and all(type(x) is int for x in c) for c in chunks)
    ):
        raise ProtocolError(f"DRAM storage node {link.label} sent a malformed reservation {chunks!r:.60}")
    return meta


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

# format_size and parse_size were defined here before the split; importable from here still.
__all__ = ["DramStore", "StorageAuthError", "format_size", "parse_size"]


class DramStore:
    """Store client for tq-redis DRAM storage nodes discovered through Redis.

    Thread-safe: connections are pooled per node and used by one thread at a time.

    Args:
        redis_url: the metadata plane's URL (nodes register there).
        namespace: the tq namespace the nodes registered under.
        token: shared secret the nodes were started with (default: env ``TQ_STORAGE_TOKEN``).
        timeout_s: bound on connecting to / waiting for one node before ``StorageUnavailable``.
        shm: use the same-host shared-memory path when a node runs on this host.
        zero_copy_get: on the shared-memory path, ``get`` returns read-only views of the node's
            memory (pinned until released) instead of private copies.
        inline_threshold: a node's share of a put smaller than this many bytes travels inline on
            the socket (one round trip) rather than through shared memory (two).
        refresh_s: how long the node list read from Redis is trusted.
        dead_after_s: a node whose heartbeat is older than this leaves the placement ring.
        registry_wait_s: when every registered node looks dead (e.g. just after a Redis outage,
            before the nodes' next heartbeat), how long to keep re-reading the registry before
            ``StorageUnavailable``. Not waited when no node was ever registered.
        tls: ``None`` (default): TLS to the nodes whose registration says they serve it
            (``--tls-cert``); ``True``: TLS to every node over TCP (refuses plain ones);
            ``False``: never (a TLS node's handshake then fails). The same-host shared-memory
            path is a local Unix socket and never uses TLS.
        tls_ca: PEM file of the CA (or the self-signed certificate) nodes' certificates are
            verified with; default: the system's trusted CAs.
        tls_check_hostname: check that a node's certificate names the host it is dialled at.
        max_frame: the largest reply payload accepted from one node in one request (a node
            announcing more is a protocol error, before anything is allocated); also caps puts.
    """

    name = "dram"

    def __init__(
        self,
        redis_url: str,
        namespace: str = "tq",
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        shm: bool = True,
        zero_copy_get: bool = True,
        inline_threshold: int | str = 256 * 1024,
        refresh_s: float = 2.0,
        dead_after_s: float = 10.0,
        registry_wait_s: float = 2.0,
        tls: bool | None = None,
        tls_ca: str | None = None,
        tls_check_hostname: bool = True,
        max_frame: int | str = "64GiB",
    ) -> None:
        try:
            bad = not (timeout_s > 0 and refresh_s >= 0 and dead_after_s > 0 and registry_wait_s >= 0)
        except TypeError:
            bad = True
        if bad:
            raise ConfigError(
                "timeout_s and dead_after_s must be positive numbers, refresh_s and registry_wait_s non-negative"
            )
        if tls not in (None, True, False):
            raise ConfigError(f"the dram store option tls must be true, false or null, not {tls!r}")
        self.tls = tls
        self.tls_ca = tls_ca
        self.tls_check_hostname = bool(tls_check_hostname)
        self._tls_ctx: ssl.SSLContext | None = None
        self.max_frame = parse_size(max_frame)
        self.registry_wait_s = float(registry_wait_s)
        self.redis_url = redis_url
        self.namespace = namespace
        self.token = token if token is not None else os.environ.get("TQ_STORAGE_TOKEN") or None
        self.timeout_s = float(timeout_s)
        self.shm = bool(shm)
        self.zero_copy_get = bool(zero_copy_get)
        self.inline_threshold = parse_size(inline_threshold) if inline_threshold else 0
        self.refresh_s = float(refresh_s)
        self.dead_after_s = float(dead_after_s)
        self.client_id = uuid.uuid4().hex
        # no reconnect loop of its own: while Redis is away the last known node list serves
        self._redis = connections.sync_client(
            redis_url, reconnect=False, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
        )
        self._key = storage_nodes_key(namespace)
        self._lock = threading.Lock()
        self._links: dict[tuple[str, str], Link] = {}
        self._ring: Ring | None = None
        self._fetched = 0.0
        self._stale = True
        self._seen_live = False  # some node was live once: an empty registry may be a Redis restart
        self._closed = False
        self._pid = os.getpid()
        # a store dropped without close() still lets go of its sockets and the nodes' memory slabs
        self._finalizer = weakref.finalize(self, _release, self._links, self._redis)

    @classmethod
    def from_config(cls, options: dict[str, Any], ctx: StoreContext) -> DramStore:
        """Build from the store options of the tq config (keys: the keyword arguments of ``__init__``)."""
        allowed = {
            "token", "timeout_s", "shm", "zero_copy_get", "inline_threshold", "refresh_s",
            "dead_after_s", "registry_wait_s", "tls", "tls_ca", "tls_check_hostname", "max_frame",
        }  # fmt: skip
        unknown = set(options) - allowed
        if unknown:
            raise ConfigError(
                f"unknown option(s) {sorted(unknown)} for the dram store; known: {sorted(allowed)}"
            )
        return cls(ctx.redis_url, ctx.namespace, **options)

    # -- discovery ----------------------------------------------------------------------------
    def _mark_stale(self) -> None:
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
        """Redis's clock and every registration, in one round trip.

        One script call on the registry key: on a Redis Cluster it runs on the node that owns
        the key (a pipeline of ``TIME`` and ``HGETALL`` cannot be routed there as one unit).
        """
        try:
            sec, usec, flat = self._redis.eval(_REGISTRY_SCRIPT, 1, self._key)
            now = int(sec) + int(usec) / 1e6
        except redis.RedisError as exc:
            raise ConnectionFailed(
                f"cannot read the DRAM storage nodes from Redis at {self.redis_url} ({exc}); "
                f"check that Redis is running"
            ) from exc
        except (TypeError, ValueError) as exc:
            raise ConnectionFailed(f"unexpected reply reading the DRAM storage nodes from Redis ({exc})") from exc
        nodes = {}
        for k, v in zip(flat[::2], flat[1::2]):
            try:
                info = json.loads(v)
                if not isinstance(info, dict):
                    raise ValueError("not an object")
                nodes[k.decode(errors="replace")] = info
            except ValueError:
                log.warning("ignoring unreadable storage-node registration %r", k)
        return now, nodes

    def _after_fork(self) -> None:
        """In a forked child: never talk over the parent's sockets; start with fresh state."""
        for link in self._links.values():
            for conn in link.idle:
                conn.sock.close()  # close (no shutdown): the parent's connection stays intact
            link.idle = []
            link.closed = True
        self._links.clear()  # the same dict: the finaliser holds it
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
            if self._ring is not None and not force and not self._stale and (
                time.monotonic() - self._fetched < self.refresh_s
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
                    f"{self.redis_url} (key {self._key}); start some with `tq-redis storage-unit "
                    f"--redis {self.redis_url} --namespace {self.namespace} ...` or `tq-redis up`"
                )
            self._ring = Ring(live)
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
            live = self._update_links(rnow, nodes)
            if live or not (nodes or self._seen_live) or time.monotonic() >= deadline:
                return live
            time.sleep(_REGISTRY_POLL_S)

    def _update_links(self, rnow: float, nodes: dict[str, dict[str, Any]]) -> list[Link]:
        """Links for the registered nodes (new ones made, departed ones closed); the live ones."""
        live: list[Link] = []
        seen = set()
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
            if rnow - heartbeat <= self.dead_after_s:
                live.append(link)
        for key in [k for k in self._links if k not in seen]:
            self._links.pop(key).close()  # deregistered or restarted as a new instance
        return live

    def nodes(self) -> list[dict[str, Any]]:
        """Registration of every live node (address, capacity, used bytes, heartbeat ...)."""
        return [dict(lk.info) for lk in self._current_ring(force=True).links]

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

    # -- StorageClient ------------------------------------------------------------------------
    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        """Store ``values[i]`` (the concatenation of its segments) under ``keys[i]``, overwriting.

        All-or-nothing when a node refuses (``StorageFull``): nothing of the batch is stored.
        """
        if len(keys) != len(values):
            raise InvalidArgument(f"put got {len(keys)} keys but {len(values)} values")
        if not len(keys):
            return
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("put got the same key twice in one batch")
        vals = PutValues(values)
        self._with_retry(lambda ring: self._put(ring, keys, vals))

    def _put(self, ring: Ring, keys: list[str], vals: PutValues) -> None:
        groups = group_by_node(ring.owners(keys), len(ring.links))
        links = [ring.links[n] for n, _ in groups]
        conns = hold(links)
        try:
            self._put_on(links, conns, groups, keys, vals)
        finally:
            release(links, conns)

    def _put_on(self, links, conns, groups, keys: list[str], vals: PutValues) -> None:
        two_phase = len(groups) > 1
        reqs, plans = [], []
        for (_n, idx), link, conn in zip(groups, links, conns):
            gsizes = vals.sizes[idx]
            gkeys = list(map(keys.__getitem__, idx.tolist()))
            meta = {"keys": gkeys, "sizes": gsizes.astype("<i8").tobytes()}
            nbytes = int(gsizes.sum())
            shm = conn.shm and nbytes >= self.inline_threshold
            if shm:
                reqs.append((link, conn, OP_ALLOC, meta, ()))
            else:
                check_put_size(conn, link, nbytes)
                meta["commit"] = not two_phase
                reqs.append((link, conn, OP_PUT, meta, vals.payload(idx)))
            plans.append((idx, gsizes, shm))
        replies, err = exchange(reqs, _put_reply)
        txns = [
            (link, conn, r["txn"]) for (link, conn, *_), r in zip(reqs, replies) if r and r.get("txn")
        ]
        spilling = [k for k, r in enumerate(replies) if err is None and r and r.get("inline")]
        if spilling:
            # a full node that spills to its tier takes these values inline on the socket instead
            for k in spilling:
                check_put_size(reqs[k][1], reqs[k][0], int(plans[k][1].sum()))
            again = [(reqs[k][0], reqs[k][1], OP_PUT, {**reqs[k][3], "commit": not two_phase},
                      vals.payload(plans[k][0])) for k in spilling]  # fmt: skip
            more, err = exchange(again, _put_reply)
            txns += [(lk, c, r["txn"]) for (lk, c, *_), r in zip(again, more) if r and r.get("txn")]
            for k in spilling:
                plans[k] = (plans[k][0], plans[k][1], False)
        if err is not None:
            self._end(txns, OP_ABORT)  # the reservations that were granted hold nothing visible
            raise err
        try:
            for (idx, gsizes, shm), (link, conn, *_), reply in zip(plans, reqs, replies):
                if shm:
                    self._copy_into(link, conn, reply.get("chunks"), idx, gsizes, vals)
        except BaseException:
            self._end(txns, OP_ABORT)
            raise
        if txns:
            self._end(txns, OP_COMMIT, check=True)

    def _end(self, txns: list[tuple[Link, Conn, int]], op: int, check: bool = False) -> None:
        """Commit or abort transactions on the connections that opened them."""
        reqs = [(lk, c, op, {"txns": [t]}, ()) for lk, c, t in txns if not c.broken]
        _res, err = exchange(reqs, check_reply)
        if check and err is not None:
            raise err

    def _copy_into(self, link: Link, conn: Conn, chunks, idx: np.ndarray, gsizes, vals: PutValues) -> None:
        """Write each value into the node's slab at the offsets it reserved.

        The reservation must cover the batch and fit the slab (a node saying otherwise is a
        protocol error: nothing is written past a slab's end).
        """
        try:
            covered = 0
            for sid, base, start, count in chunks:
                if start != covered or count <= 0 or base < 0:
                    raise ValueError(f"reservation chunk {[sid, base, start, count]} does not continue the batch")
                covered += count
                offs, _ = layout(gsizes[start : start + count])
                vals.copy_into(link.slab(conn, sid).rw_view, idx[start : start + count], offs + base)
            if covered != len(idx):
                raise ValueError(f"the reservation covers {covered} of {len(idx)} values")
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            link.fail(conn)
            raise malformed(link, exc) from None

    def get(self, keys: Sequence[str]) -> Sequence[Buffer]:
        """Return every key's value, in order; ``DataMissing`` names the keys no node holds.

        The values come back as a :class:`ValueTable`: a sequence of memoryviews that are slices
        of a few large buffers. On the same-host path those are read-only views of the node's
        memory, pinned there until every view (and the table) is released or this store is
        closed; with ``zero_copy_get=False`` they are slices of one private, writable copy.
        """
        keys = list(keys)
        if not keys:
            return []
        table = self._with_retry(lambda ring: self._get(ring, keys))
        return table if self.zero_copy_get else private_copy(table)

    def _get(self, ring: Ring, keys: list[str]) -> ValueTable:
        out = Gathered(len(keys))
        owner = ring.owners(keys)
        missing = self._get_from(ring, keys, np.arange(len(keys)), owner, out)
        if len(missing) and len(ring.links) > 1:
            # placed while its first-ranked node was out of the ring? ask the runner-up too
            asked = [ring.links[owner[p]].node_id for p in missing.tolist()]
            ring = self._current_ring(force=True)
            rank = ring.ranked([keys[p] for p in missing.tolist()], 2)
            pos, alt = [], []
            for j, p in enumerate(missing.tolist()):
                for n in rank[j].tolist():
                    if ring.links[n].node_id != asked[j]:
                        pos.append(p)
                        alt.append(n)
                        break
            if pos:
                still = self._get_from(ring, keys, np.array(pos), np.array(alt, dtype=np.intp), out)
                missing = np.union1d(np.setdiff1d(missing, pos), still)
        if len(missing):
            names = [keys[i] for i in missing[:5].tolist()]
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise DataMissing(
                f"{len(missing)} of {len(keys)} key(s) are missing from the DRAM store: "
                f"{', '.join(map(repr, names))}{more}. They were deleted, or the storage node that "
                f"held them restarted and lost its memory."
            )
        return out.table()

    def _get_from(self, ring: Ring, keys, positions: np.ndarray, owner: np.ndarray, out: Gathered) -> np.ndarray:
        """Fetch ``keys[positions]`` from their ``owner`` nodes into ``out``; return the still missing."""
        groups = group_by_node(owner, len(ring.links))
        links = [ring.links[n] for n, _ in groups]
        missing: list[np.ndarray] = []
        pos_of = [positions[idx] for _n, idx in groups]

        def on_reply(i, link, conn, code, meta, plen, fds):
            check_data_reply(i, link, conn, code, meta, plen, fds)
            pos = pos_of[i]
            miss = meta.get("missing") or []
            if miss:
                if not (isinstance(miss, list) and all(type(m) is int for m in miss)) or len(set(miss)) != len(
                    miss
                ) or min(miss) < 0 or max(miss) >= len(pos):
                    raise ProtocolError(f"DRAM storage node {link.label} sent a malformed list of missing keys")
                missing.append(pos[miss])
                pos = np.delete(pos, miss)
            if "offs" in meta:
                self._views(link, conn, meta, plen, pos, out)
                return
            lens = _int_table(meta.get("sizes"), "<i8", len(pos), link)
            if int(lens.sum()) != plen:
                raise ProtocolError(f"DRAM storage node {link.label} sent {plen} bytes for values of {int(lens.sum())}")
            mv = memoryview(buffers.take(plen))  # lazily backed: only the bytes that arrive take memory
            recv_into(conn.sock, mv)
            out.add(mv, pos, np.cumsum(lens) - lens, lens)

        conns = hold(links)
        try:
            reqs = [
                (lk, c, OP_GET, {"keys": [keys[p] for p in pos.tolist()], "shm": c.shm}, ())
                for lk, c, pos in zip(links, conns, pos_of)
            ]
            run(reqs, on_reply)
        finally:
            release(links, conns)
        return np.concatenate(missing) if missing else np.empty(0, dtype=np.intp)

    def _views(
        self, link: Link, conn: Conn, meta: dict[str, Any], plen: int, pos: np.ndarray, out: Gathered
    ) -> None:
        """Values of a shared-memory GET reply: read-only views into the mapped slabs.

        Values the node spilled to its tier (slab -1) come in the reply's payload instead.
        """
        n = len(pos)
        sids = _int_table(meta.get("slabs"), "<i4", n, link, allow_negative=True)
        offs = _int_table(meta.get("offs"), "<i8", n, link)
        lens = _int_table(meta.get("lens"), "<i8", n, link)
        spilled = sids < 0
        if int(lens[spilled].sum()) != plen or bool((offs[spilled] + lens[spilled] > plen).any()):
            raise ProtocolError(f"DRAM storage node {link.label} sent {plen} inline bytes that do not hold its values")
        if plen:
            inline = memoryview(buffers.take(plen))
            recv_into(conn.sock, inline)
            out.add(inline, pos[spilled], offs[spilled], lens[spilled])
            kept = ~spilled
            sids, offs, lens, pos = sids[kept], offs[kept], lens[kept], pos[kept]
        used = np.unique(sids).tolist()
        pin = meta.get("pin") or 0
        if type(pin) is not int:
            raise ProtocolError(f"DRAM storage node {link.label} sent a malformed pin {pin!r:.40}")
        slabs = [link.slab(conn, sid) for sid in used]
        for slab in slabs:
            mine = sids == slab.id
            if bool((offs[mine] + lens[mine] > slab.size).any()):
                raise ProtocolError(f"DRAM storage node {link.label} sent values past the end of slab {slab.id}")
        unpin = Unpin(link, pin, len(used)) if pin else None
        for sid, slab in zip(used, slabs):
            # a fresh array per get: its finaliser fires once the last view of this get is gone
            arr = np.frombuffer(slab.readonly(), dtype=np.uint8)
            if unpin is not None:
                weakref.finalize(arr, unpin)
            mine = slice(None) if len(used) == 1 else sids == sid
            out.add(memoryview(arr), pos[mine], offs[mine], lens[mine])

    def delete(self, keys: Sequence[str]) -> None:
        """Remove keys from their nodes; absent keys are ignored (idempotent)."""
        keys = list(keys)
        if keys:
            # a fresh ring: a key put by a client that already saw a new node must be found there
            self._mark_stale()
            self._with_retry(lambda ring: self._delete(ring, keys))

    def _delete(self, ring: Ring, keys: list[str]) -> None:
        n_nodes = len(ring.links)
        rank = ring.ranked(keys, 2) if n_nodes > 1 else np.zeros((len(keys), 1), np.intp)
        per_node: dict[int, list[str]] = {}
        for col in range(rank.shape[1]):
            for node, idx in group_by_node(rank[:, col], n_nodes):
                per_node.setdefault(node, []).extend(keys[i] for i in idx.tolist())
        primary = set(np.unique(rank[:, 0]).tolist())
        links, conns = [], []
        down: StorageUnavailable | None = None  # an unreachable node that is some key's home
        try:
            for node in per_node:
                try:
                    conns.append(ring.links[node].acquire())
                    links.append(ring.links[node])
                except StorageUnavailable as exc:
                    # The reachable nodes still get their deletes; a runner-up only holds keys
                    # placed during a ring change, so missing one is not an error.
                    if node in primary:
                        down = down or exc
            reqs = [
                (lk, c, OP_DEL, {"keys": per_node[ring.links.index(lk)]}, ()) for lk, c in zip(links, conns)
            ]
            _res, err = exchange(reqs, check_reply)
            if err is not None:
                failed_primary = any(
                    c.broken and ring.links.index(lk) in primary for lk, c in zip(links, conns)
                )
                if failed_primary or not isinstance(err, StorageUnavailable):
                    raise err
            if down is not None:
                raise down
        finally:
            release(links, conns)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per live node: used / capacity bytes, key and slab counts, pins and open transactions."""
        ring = self._current_ring(force=True)
        conns = hold(ring.links)
        try:
            replies = run([(lk, c, OP_STATS, {}, ()) for lk, c in zip(ring.links, conns)], check_reply)
        finally:
            release(ring.links, conns)
        return {lk.node_id: m for lk, m in zip(ring.links, replies)}

    def flush(self) -> None:
        """Send queued unpins (of released ``get`` views) now rather than with the next request."""
        with self._lock:
            links = [lk for lk in self._links.values() if lk.unpins and not lk.closed]
        for link in links:
            try:
                conn = link.acquire()
            except StorageError:
                continue
            try:
                exchange([(link, conn, OP_STATS, {}, ())], check_reply)
            finally:
                link.release(conn)

    def close(self) -> None:
        """Release connections and mappings (views from ``get`` are unpinned); the nodes keep the data."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            with self._lock:
                links = list(self._links.values())
                self._links.clear()
                self._ring = None
            for link in links:
                link.close()
            self._redis.close()
            self._finalizer.detach()

    def __enter__(self) -> DramStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
