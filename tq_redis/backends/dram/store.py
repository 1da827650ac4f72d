"""Client of tq-redis's own DRAM storage nodes (the ``dram`` store).

Storage nodes (``tq_redis/backends/dram/server.py``) register themselves in Redis under
:func:`~tq_redis.meta.keys.storage_nodes_key`; this client needs nothing but the Redis URL and the namespace.

Design, in short:

* **Placement** is rendezvous (highest-random-weight) hashing of each key over the live nodes
  (registered, heartbeat fresh by Redis's clock), so adding a node moves ~1/(n+1) of the keys.
  A put returns the id of the ring it used, after recording that ring's members in Redis; the
  metadata plane records the ring id with the values' bits (``lua/includes/placement.lua``), so
  a read or a delete reaches the node a value was put on after nodes joined, left or restarted
  under new ids (:meth:`DramStore.read` / :meth:`~DramStore.get_placed` / :meth:`~DramStore.delete`).
  If that node is gone, the error names it, its address and the keys. A plain :meth:`get` (no
  record at hand) asks a key's first-ranked node, then its second-ranked one.
* **Deletes a node misses** (it is unreachable, or its heartbeat is stale) are recorded in Redis
  (:func:`~tq_redis.meta.keys.pending_deletes_key`); the node runs them when it is back.
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
  views of warm buffers from :mod:`tq_redis.codec.buffers`, recycled once the caller drops them.
* **Threads and processes**: thread-safe (connections are pooled per node, one thread at a time
  each); a store used after ``fork()`` opens its own connections in the child.
* **Hostile or broken nodes**: no length a node announces is trusted before it is checked
  against a bound (a HELLO reply is at most 8 KiB; other header maps 64 MiB; payloads the
  ``max_frame`` option and the sizes in the reply), and a reply that does not decode or does not
  fit its request is a :class:`~tq_redis.backends.dram.protocol.ProtocolError` (a
  ``StorageUnavailable`` naming the node); its connection is dropped. With ``tls`` / ``tls_ca``
  TCP connections use TLS and verify the node's certificate.
* **Failures** are typed: an unreachable or silent node raises :class:`StorageUnavailable` naming
  it after at most ``timeout_s``; a full node :class:`StorageFull`; a missing key
  :class:`DataMissing`; a wrong token :class:`StorageAuthError`. A put spread over several nodes is
  two-phase (reserve + write everywhere, then commit), so a refusal leaves nothing half-written.

Modules of the client, each importing only those listed before it: :mod:`.dram_protocol` (the wire
format, shared with the node), :mod:`.dram_values` (put and get value tables),
:mod:`.dram_placement` (rendezvous hashing), :mod:`.dram_pool` (connections, mapped slabs and the
request exchange), :mod:`.dram_replies` (the checks a node's replies must pass),
:mod:`.dram_discovery` (node discovery through Redis, the live ring, retries on a fresh one), and
this one: the store (put / get / delete, stats).
"""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis

from tq_redis.backends.dram.discovery import NodeDiscovery
from tq_redis.backends.dram.placement import Ring, group_by_holders, group_by_node, replicas_of
from tq_redis.backends.dram.pool import (
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
from tq_redis.backends.dram.protocol import (
    OP_ABORT,
    OP_ALLOC,
    OP_COMMIT,
    OP_DEL,
    OP_GET,
    OP_PUT,
    OP_STATS,
    layout,
    recv_into,
)
from tq_redis.backends.dram.repair import RepairLoop, repair_once
from tq_redis.backends.dram.replicas import Generation, holder_ids
from tq_redis.backends.dram.replies import (
    check_in_slabs,
    inline_sizes,
    missing_of,
    pin_of,
    put_reply,
    slab_columns,
)
from tq_redis.backends.dram.values import Gathered, PutValues, private_copy
from tq_redis.codec import buffers
from tq_redis.codec.batches import ValueTable
from tq_redis.errors import (
    ConfigError,
    ConnectionFailed,
    DataMissing,
    InvalidArgument,
    StorageError,
    StorageUnavailable,
)
from tq_redis.meta.keys import pending_deletes_key, pending_nodes_key, storage_repairs_key
from tq_redis.redact import redact
from tq_redis.server.registry import DEFAULT_FORGET_AFTER_S
from tq_redis.storage.base import Buffer, Segments, StoreContext
from tq_redis.units import parse_size

__all__ = ["DramStore"]


class DramStore(NodeDiscovery):
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
        forget_after_s: a registration whose heartbeat is older than this is removed from Redis
            (with the deletes recorded for its node), and at once one of this host whose process
            is gone; its node, and the values it held, are gone. Default: 600 s, or
            ``dead_after_s`` when that is longer.
        tls: ``None`` (default): TLS to the nodes whose registration says they serve it
            (``--tls-cert``); ``True``: TLS to every node over TCP (refuses plain ones);
            ``False``: never (a TLS node's handshake then fails). The same-host shared-memory
            path is a local Unix socket and never uses TLS.
        tls_ca: PEM file of the CA (or the self-signed certificate) nodes' certificates are
            verified with; default: the system's trusted CAs.
        tls_check_hostname: check that a node's certificate names the host it is dialled at.
        max_frame: the largest reply payload accepted from one node in one request (a node
            announcing more is a protocol error, before anything is allocated); also caps puts.
        replicas: how many distinct nodes (on distinct hosts where the registry knows that many)
            hold each value (``storage.replicas`` in ``init``'s config). A put returns once every
            copy is stored; a read takes the nearest live copy (same-host shared memory first).
        repair_every_s: with ``replicas`` > 1, how often this store tries to repair (re-make the
            copies of dead nodes, one repairer at a time under a lease in Redis:
            :mod:`.dram_repair`); 0: never (another process repairs).
    """

    name = "dram"
    places_keys = True  # put returns the ring it used; reads and deletes take the recorded rings

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
        forget_after_s: float | None = None,
        tls: bool | None = None,
        tls_ca: str | None = None,
        tls_check_hostname: bool = True,
        max_frame: int | str = "64GiB",
        replicas: int = 1,
        repair_every_s: float = 2.0,
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(
                f"storage.replicas (the dram store option replicas) must be an integer >= 1 (how many "
                f"distinct DRAM nodes hold each value), got {replicas!r}"
            )
        try:
            bad = not (timeout_s > 0 and refresh_s >= 0 and dead_after_s > 0 and registry_wait_s >= 0)
            if forget_after_s is None:
                forget_after_s = max(DEFAULT_FORGET_AFTER_S, dead_after_s)
            bad = bad or not forget_after_s >= dead_after_s
        except TypeError:
            bad = True
        if bad:
            raise ConfigError(
                "timeout_s and dead_after_s must be positive numbers, refresh_s and registry_wait_s non-negative, "
                "forget_after_s at least dead_after_s"
            )
        if tls not in (None, True, False):
            raise ConfigError(f"the dram store option tls must be true, false or null, not {tls!r}")
        max_frame = parse_size(max_frame)
        inline_threshold = parse_size(inline_threshold) if inline_threshold else 0
        self.zero_copy_get = bool(zero_copy_get)
        self.inline_threshold = inline_threshold
        super().__init__(
            redis_url, namespace, token=token, timeout_s=timeout_s, shm=shm, max_frame=max_frame,
            refresh_s=refresh_s, dead_after_s=dead_after_s, registry_wait_s=registry_wait_s,
            forget_after_s=forget_after_s, tls=tls, tls_ca=tls_ca, tls_check_hostname=tls_check_hostname,
            replicas=replicas,
        )  # fmt: skip
        self._generations: dict[str, list[Generation]] = {}
        self._generations_read = -float("inf")
        if isinstance(repair_every_s, bool) or not isinstance(repair_every_s, int | float) or repair_every_s < 0:
            raise ConfigError(
                f"the dram store option repair_every_s must be a number >= 0 (0: off), got {repair_every_s!r}"
            )
        self.repair_every_s = float(repair_every_s)
        self._repairs: RepairLoop | None = None
        if replicas > 1 and self.repair_every_s > 0:
            self._repairs = RepairLoop(self, self.repair_every_s)

    @classmethod
    def from_config(cls, options: dict[str, Any], ctx: StoreContext) -> DramStore:
        """Build from the store options of the tq config (keys: the keyword arguments of ``__init__``)."""
        allowed = {
            "token", "timeout_s", "shm", "zero_copy_get", "inline_threshold", "refresh_s",
            "dead_after_s", "registry_wait_s", "forget_after_s", "tls", "tls_ca", "tls_check_hostname", "max_frame",
            "replicas", "repair_every_s",
        }  # fmt: skip
        unknown = set(options) - allowed
        if unknown:
            raise ConfigError(
                f"unknown option(s) {sorted(unknown)} for the dram store; known: {sorted(allowed)}"
            )
        return cls(ctx.redis_url, ctx.namespace, **options)

    # -- StorageClient ------------------------------------------------------------------------
    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> str | None:
        """Store ``values[i]`` (the concatenation of its segments) under ``keys[i]``, overwriting.

        All-or-nothing when a node refuses (``StorageFull``): nothing of the batch is stored.
        Returns the id of the ring the values went to (recorded in Redis before any byte was
        sent); pass it to the metadata plane so readers find them whatever the ring is later.
        """
        if len(keys) != len(values):
            raise InvalidArgument(f"put got {len(keys)} keys but {len(values)} values")
        if not len(keys):
            return None
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("put got the same key twice in one batch")
        vals = PutValues(values)
        return self._with_retry(lambda ring: self._put(ring, keys, vals))

    def _put(self, ring: Ring, keys: list[str], vals: PutValues) -> str:
        if ring.replicas > len(ring.links):
            raise StorageUnavailable(
                f"storage.replicas={ring.replicas} puts each value on {ring.replicas} distinct DRAM storage "
                f"nodes, but only {len(ring.links)} are live in namespace {self.namespace!r} "
                f"({', '.join(lk.label for lk in ring.links)}); start more nodes or lower storage.replicas"
            )
        self.record_ring(ring)
        if ring.replicas == 1:
            groups = group_by_node(ring.owners(keys), len(ring.links))
        else:
            groups = group_by_holders(ring.holders(keys), len(ring.links))
        links = [ring.links[n] for n, _ in groups]
        conns: list[Conn] = []
        try:
            conns = hold(links)
            self._put_on(links, conns, groups, keys, vals, None if ring.replicas == 1 else ring.id)
        except StorageError as exc:
            if ring.replicas == 1:
                raise
            raise _not_all_copies(exc, ring.replicas, links, conns) from None
        finally:
            release(links[: len(conns)], conns)
        return ring.id

    def _put_on(self, links, conns, groups, keys: list[str], vals: PutValues, place: str | None = None) -> None:
        two_phase = len(groups) > 1
        reqs, plans = [], []
        for (_n, idx), link, conn in zip(groups, links, conns):
            gsizes = vals.sizes[idx]
            gkeys = list(map(keys.__getitem__, idx.tolist()))
            meta = {"keys": gkeys, "sizes": gsizes.astype("<i8").tobytes()}
            if place is not None:  # a replicated ring's keys are listed by a repair (OP_KEYS)
                meta["place"] = place
            nbytes = int(gsizes.sum())
            shm = conn.shm and nbytes >= self.inline_threshold
            if shm:
                reqs.append((link, conn, OP_ALLOC, meta, ()))
            else:
                check_put_size(conn, link, nbytes)
                meta["commit"] = not two_phase
                reqs.append((link, conn, OP_PUT, meta, vals.payload(idx)))
            plans.append((idx, gsizes, shm))
        replies, err = exchange(reqs, put_reply)
        txns = [
            (link, conn, r["txn"], len(meta["keys"])) for (link, conn, _op, meta, _), r in zip(reqs, replies)
            if r and r.get("txn")
        ]  # fmt: skip
        spilling = [k for k, r in enumerate(replies) if err is None and r and r.get("inline")]
        if spilling:
            # a full node that spills to its tier takes these values inline on the socket instead
            for k in spilling:
                check_put_size(reqs[k][1], reqs[k][0], int(plans[k][1].sum()))
            again = [(reqs[k][0], reqs[k][1], OP_PUT, {**reqs[k][3], "commit": not two_phase},
                      vals.payload(plans[k][0])) for k in spilling]  # fmt: skip
            more, err = exchange(again, put_reply)
            txns += [
                (lk, c, r["txn"], len(meta["keys"])) for (lk, c, _op, meta, _), r in zip(again, more)
                if r and r.get("txn")
            ]  # fmt: skip
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

    def _end(self, txns: list[tuple[Link, Conn, int, int]], op: int, check: bool = False) -> None:
        """Commit or abort transactions (with how many keys each holds) on the connections that opened them."""
        live = [(lk, c, t, n) for lk, c, t, n in txns if not c.broken]
        reqs = [(lk, c, op, {"txns": [t]}, ()) for lk, c, t, _n in live]
        _res, err = exchange(reqs, check_reply, work=[n for *_, n in live])
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

        Without a record of where the values were put, a key is asked of its node in the live
        ring, then of its second-ranked node (the one that held it while the first was out of the
        ring); :meth:`get_placed` reads values put under any earlier ring.

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
        if ring.replicas > 1:
            missing, failures = self._read_copies(ring, keys, out)
            if len(missing):
                raise self._not_found(keys, missing, failures)
            return out.table()
        owner = ring.owners(keys)
        missing = self._get_from(_groups(ring, owner, np.arange(len(keys))), keys, out)
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
                still = self._get_from(_groups(ring, np.array(alt, dtype=np.intp), np.array(pos)), keys, out)
                missing = np.union1d(np.setdiff1d(missing, pos), still)
        if len(missing):
            names = _some(keys, missing)
            raise DataMissing(
                f"{len(missing)} of {len(keys)} key(s) are missing from the DRAM store: {names}. They "
                f"were deleted, or the storage node that held them restarted and lost its memory."
            )
        return out.table()

    def read(self, keys: Sequence[str]) -> tuple[ValueTable, str, np.ndarray]:
        """First attempt of a read whose values' placement is checked afterwards: every key asked
        of its node in the live ring. Returns the values (a missing one is an empty slice), the
        ring's id and the positions of the missing keys; :meth:`misplaced` then says which values
        to read again with :meth:`get_placed`."""
        keys = list(keys)

        def attempt(ring: Ring) -> tuple[ValueTable, str, np.ndarray]:
            out = Gathered(len(keys))
            if ring.replicas > 1:
                missing, _failures = self._read_copies(ring, keys, out)
                return out.table(), ring.id, missing
            missing = self._get_from(_groups(ring, ring.owners(keys), np.arange(len(keys))), keys, out)
            return out.table(), ring.id, missing

        return self._with_retry(attempt)

    def misplaced(self, keys: Sequence[str], read_ring: str, rings: Sequence[str], index: np.ndarray) -> np.ndarray:
        """Positions of the keys that :meth:`read` under ``read_ring`` did not ask of the node
        their value was put on: key ``i`` was put under ring ``rings[index[i]]``."""
        if all(r == read_ring for r in rings):
            return np.empty(0, np.intp)
        if replicas_of(read_ring) > 1 or any(replicas_of(r) > 1 for r in rings):
            # replicated: a value put under another ring is read again from its own holders
            same = np.array([r == read_ring for r in rings], dtype=bool)
            return np.flatnonzero(~same[index])
        asked = self._owner_ids(self.recorded_ring(read_ring), keys, np.arange(len(keys)))
        out: list[np.ndarray] = []
        for r in np.unique(index).tolist():
            if rings[r] == read_ring:
                continue
            pos = np.flatnonzero(index == r)
            holder = self._owner_ids(self.recorded_ring(rings[r]), keys, pos)
            out.append(pos[holder != asked[pos]])
        return np.sort(np.concatenate(out)) if out else np.empty(0, np.intp)

    @staticmethod
    def _owner_ids(ring: Ring, keys: Sequence[str], pos: np.ndarray) -> np.ndarray:
        """The node id (as an object array) owning each of ``keys[pos]`` under ``ring``."""
        ids = np.array([lk.node_id for lk in ring.links], dtype=object)
        return ids[ring.owners([keys[p] for p in pos.tolist()])]

    def get_placed(self, keys: Sequence[str], rings: Sequence[str], index: np.ndarray) -> ValueTable:
        """Every key's value, read from the node it was put on: key ``i`` under ring
        ``rings[index[i]]`` (ids recorded by the metadata plane), whichever nodes are live now.

        Raises ``DataMissing`` naming the node, its address and the keys when the node has left
        (deregistered) or no longer holds them (deleted, or it restarted and lost its memory), and
        ``StorageUnavailable`` naming them when it does not answer.
        """
        keys = list(keys)
        out = Gathered(len(keys))
        used = np.unique(index).tolist()
        if any(replicas_of(rings[r]) > 1 for r in used):
            return self._get_replicated(keys, rings, index, out)
        groups: dict[str, list[np.ndarray]] = {}
        members: dict[str, str] = {}
        for r in np.unique(index).tolist():
            ring = self.recorded_ring(rings[r])
            pos = np.flatnonzero(index == r)
            holders = ring.owners([keys[p] for p in pos.tolist()])
            for n, idx in group_by_node(holders, len(ring.links)):
                member = ring.links[n]
                members[member.node_id] = member.address
                groups.setdefault(member.node_id, []).append(pos[idx])
        reachable: list[tuple[Link, np.ndarray]] = []
        for node_id, parts in groups.items():
            pos = np.concatenate(parts)
            link = self.link_of(node_id)
            if link is None:
                raise DataMissing(
                    f"{len(pos)} of {len(keys)} key(s) were put on DRAM storage node {node_id!r} (at "
                    f"{members[node_id]}), which has left: it is no longer registered in namespace "
                    f"{self.namespace!r}, and its memory went with it: {_some(keys, pos)}"
                )
            reachable.append((link, pos))
        try:
            missing = self._get_from(reachable, keys, out)
        except StorageUnavailable as exc:
            raise StorageUnavailable(f"{exc} (reading {_held(reachable, keys)})") from None
        if len(missing):
            at = {lk.node_id: lk for lk, pos in reachable if np.isin(pos, missing).any()}
            where = "; ".join(
                f"{lk.label} (its current run started {_started(lk)}): "
                f"{_some(keys, np.intersect1d(pos, missing))}"
                for lk, pos in reachable if lk.node_id in at
            )  # fmt: skip
            raise DataMissing(
                f"{len(missing)} of {len(keys)} key(s) are missing from the DRAM storage node(s) they "
                f"were put on: {where}. They were deleted, or the node restarted and lost its memory."
            )
        table = out.table()
        return table if self.zero_copy_get else private_copy(table)

    def _get_replicated(self, keys: list[str], rings: Sequence[str], index: np.ndarray, out: Gathered) -> ValueTable:
        """:meth:`get_placed` of values some of which were put under replicated rings: each from
        the nearest of its holders that has it."""
        width = max(replicas_of(rings[r]) for r in np.unique(index).tolist())
        cands = np.full((len(keys), width), None, dtype=object)
        for r in np.unique(index).tolist():
            pos = np.flatnonzero(index == r)
            ids = self._holders(self.recorded_ring(rings[r]), [keys[p] for p in pos.tolist()])
            cands[pos, : ids.shape[1]] = ids
        missing, failures = self._read_any(cands, keys, out)
        if len(missing):
            raise self._not_found(keys, missing, failures)
        table = out.table()
        return table if self.zero_copy_get else private_copy(table)

    # -- replicated rings ---------------------------------------------------------------------
    def generations(self, ring_id: str, fresh: bool = False) -> list[Generation]:
        """The repairs recorded for ring ``ring_id`` (:mod:`.dram_replicas`), read from Redis at
        most ``refresh_s`` ago (``fresh``: now)."""
        if fresh or time.monotonic() - self._generations_read > self.refresh_s:
            try:
                raw = self._redis.hgetall(storage_repairs_key(self.namespace))
            except redis.RedisError as exc:
                if not fresh:
                    return self._generations.get(ring_id, [])  # the last known ones serve; reads fall back
                raise ConnectionFailed(
                    f"cannot read the DRAM replica repairs from Redis at {redact(self.redis_url)} ({exc}); "
                    f"check that Redis is running"
                ) from exc
            table: dict[str, list[Generation]] = {}
            for rid, entry in raw.items():
                rid = rid.decode() if isinstance(rid, bytes) else str(rid)
                try:
                    table[rid] = [(str(dead), self.recorded_ring(str(new))) for dead, new in json.loads(entry)]
                except (TypeError, ValueError) as exc:
                    raise StorageError(
                        f"the repairs of DRAM ring {rid!r} in {storage_repairs_key(self.namespace)} are unreadable "
                        f"({exc}); the copies they re-made cannot be located"
                    ) from exc
            self._generations = table
            self._generations_read = time.monotonic()
        return self._generations.get(ring_id, [])

    def _holders(self, ring: Ring, keys: Sequence[str], fresh: bool = False) -> np.ndarray:
        """The node ids holding each key put under ``ring`` (repairs included), best first."""
        if ring.replicas == 1:
            return np.array([lk.node_id for lk in ring.links], dtype=object)[ring.owners(keys)][:, None]
        return holder_ids(ring, keys, self.generations(ring.id, fresh))

    def _read_copies(self, ring: Ring, keys: list[str], out: Gathered) -> tuple[np.ndarray, dict[str, str]]:
        """Read keys put under the live replicated ``ring``: when every node is as near as the
        others, from each key's first holder in one exchange (what an unreplicated read costs);
        the keys that fails for, and every key otherwise, from their nearest holder that has them."""
        todo = np.arange(len(keys))
        if len({lk.nearby for lk in ring.links}) == 1:
            try:
                todo = self._get_from(_groups(ring, ring.owners(keys), todo), keys, out)
            except StorageUnavailable:
                pass  # a first holder failed: every key goes through the holder-by-holder read
            if not len(todo):
                return todo, {}
        return self._read_any(self._holders(ring, keys), keys, out)

    def _read_any(self, cands: np.ndarray, keys: list[str], out: Gathered) -> tuple[np.ndarray, dict[str, str]]:
        """Read each key from the first of its candidate nodes (``cands``: node ids per key, None
        for none) that has it, nearest first: same-host shared memory, then live over TCP, then
        registered but silent. Returns the positions no candidate gave and why nodes failed."""
        try:
            self._current_ring()
        except StorageUnavailable:
            pass  # no node is live: the registered ones are still tried, the error says why they failed
        by_id = self._by_id

        def rank(node_id: Any) -> int:
            link = by_id.get(node_id) if node_id is not None else None
            if link is None or link.closed:
                return 3
            if link.heartbeat_age > self.dead_after_s:
                return 2
            return 0 if link.nearby else 1

        names, inverse = np.unique(np.where(cands == None, "", cands).astype(str), return_inverse=True)  # noqa: E711
        code_of = np.array([3 if not n else rank(n) for n in names.tolist()], dtype=np.intp)
        codes = code_of[inverse.reshape(cands.shape)]
        if (codes != codes[:, :1]).any():  # some holders are nearer than others: nearest first
            order = np.argsort(codes, axis=1, kind="stable")
            cands = np.take_along_axis(cands, order, axis=1)
            codes = np.take_along_axis(codes, order, axis=1)
        failures: dict[str, str] = {}
        todo = np.arange(len(keys))
        for col in range(cands.shape[1]):
            if not len(todo):
                break
            groups: list[tuple[Link, np.ndarray]] = []
            who = cands[todo, col]
            for node_id in dict.fromkeys(who.tolist()):
                if node_id is None:
                    continue
                pos = todo[who == node_id]
                if codes[pos[0], col] == 3:
                    failures.setdefault(node_id, "it is not registered any more (it left, and its memory went with it)")
                    continue
                groups.append((by_id[node_id], pos))
            todo = np.setdiff1d(todo, self._get_isolated(groups, keys, out, failures), assume_unique=True)
        return todo, failures

    def _get_isolated(
        self, groups: list[tuple[Link, np.ndarray]], keys: list[str], out: Gathered, failures: dict[str, str]
    ) -> np.ndarray:
        """Read ``groups`` into ``out`` with every node's failure its own: the positions that were read."""
        if not groups:
            return np.empty(0, np.intp)
        asked = np.concatenate([pos for _, pos in groups])
        try:
            return np.setdiff1d(asked, self._get_from(groups, keys, out))
        except StorageUnavailable:
            pass  # one node failed the batch: ask each on its own, so the others' copies still count
        got: list[np.ndarray] = []
        for link, pos in groups:
            try:
                missing = self._get_from([(link, pos)], keys, out)
            except StorageUnavailable as exc:
                failures[link.node_id] = str(exc)
                continue
            if len(missing):
                failures.setdefault(link.node_id, f"{link.label} does not hold {len(missing)} of them")
            got.append(np.setdiff1d(pos, missing))
        return np.concatenate(got) if got else np.empty(0, np.intp)

    def _not_found(self, keys: list[str], missing: np.ndarray, failures: dict[str, str]) -> StorageError:
        """The error for replicated values no holder gave: ``StorageUnavailable`` when a holder
        did not answer (it may still have them), else ``DataMissing``; both name the nodes."""
        why = "; ".join(f"{node!r}: {reason}" for node, reason in failures.items()) or "no holder is known"
        unreachable = any("not registered" not in r and "does not hold" not in r for r in failures.values())
        kind = StorageUnavailable if unreachable else DataMissing
        return kind(
            f"{len(missing)} of {len(keys)} replicated key(s) could be read from none of their DRAM storage "
            f"nodes ({why}): {_some(keys, missing)}"
        )

    def _get_from(self, groups: list[tuple[Link, np.ndarray]], keys: list[str], out: Gathered) -> np.ndarray:
        """Fetch ``keys[positions]`` from each ``(link, positions)`` node into ``out``; return the
        positions still missing."""
        links = [lk for lk, _ in groups]
        missing: list[np.ndarray] = []
        pos_of = [pos for _, pos in groups]

        def on_reply(i, link, conn, code, meta, plen, fds):
            check_data_reply(i, link, conn, code, meta, plen, fds)
            pos = pos_of[i]
            miss = missing_of(meta, len(pos), link)
            if miss:
                missing.append(pos[miss])
                pos = np.delete(pos, miss)
            if "offs" in meta:
                self._views(link, conn, meta, plen, pos, out)
                return
            lens = inline_sizes(meta, len(pos), plen, link)
            mv = memoryview(buffers.take(plen))  # lazily backed: only the bytes that arrive take memory
            recv_into(conn.sock, mv)
            out.add(mv, pos, np.cumsum(lens) - lens, lens)

        conns = hold(links)
        try:
            reqs = [
                (lk, c, OP_GET, {"keys": [keys[p] for p in pos.tolist()], "shm": c.shm}, ())
                for lk, c, pos in zip(links, conns, pos_of)
            ]
            # replies are read at the same time: on_reply touches only its own link and `out`
            # (which takes a lock), and appends to `missing` (atomic)
            run(reqs, on_reply, parallel_replies=True)
        finally:
            release(links, conns)
        return np.sort(np.concatenate(missing)) if missing else np.empty(0, dtype=np.intp)

    def _views(
        self, link: Link, conn: Conn, meta: dict[str, Any], plen: int, pos: np.ndarray, out: Gathered
    ) -> None:
        """Values of a shared-memory GET reply: read-only views into the mapped slabs.

        Values the node spilled to its tier (slab -1) come in the reply's payload instead.
        """
        sids, offs, lens, spilled = slab_columns(meta, len(pos), plen, link)
        if plen:
            inline = memoryview(buffers.take(plen))
            recv_into(conn.sock, inline)
            out.add(inline, pos[spilled], offs[spilled], lens[spilled])
            kept = ~spilled
            sids, offs, lens, pos = sids[kept], offs[kept], lens[kept], pos[kept]
        used = np.unique(sids).tolist()
        pin = pin_of(meta, link)
        slabs = [link.slab(conn, sid) for sid in used]
        check_in_slabs(slabs, sids, offs, lens, link)
        unpin = Unpin(link, pin, len(used)) if pin else None
        for sid, slab in zip(used, slabs):
            # a fresh array per get: its finaliser fires once the last view of this get is gone
            arr = np.frombuffer(slab.readonly(), dtype=np.uint8)
            if unpin is not None:
                weakref.finalize(arr, unpin)
            mine = slice(None) if len(used) == 1 else sids == sid
            out.add(memoryview(arr), pos[mine], offs[mine], lens[mine])

    def delete(self, keys: Sequence[str], rings: Sequence[str] = ()) -> None:
        """Remove keys from their nodes; absent keys are ignored (idempotent).

        A key is deleted on its node in the live ring and that node's runner-up, and on its node
        under each ring of ``rings`` (the rings its partition's values were put under). A node
        that should get deletes but is unreachable, or whose heartbeat is stale, gets them later:
        they are recorded in Redis (:func:`~tq_redis.meta.keys.pending_deletes_key`) and the node runs
        them when it is back. Raises ``ConnectionFailed`` only if that record cannot be written.
        """
        keys = list(keys)
        if not keys:
            return
        # a fresh ring: a key put by a client that already saw a new node must be found there
        self._mark_stale()
        targets = self._delete_targets(keys, rings)
        live, later = [], {}
        for node_id, pos in targets.items():
            link = self._by_id.get(node_id)
            if link is None or link.closed:
                continue  # not registered (any more): its memory, and the keys in it, are gone
            if link.heartbeat_age > self.dead_after_s:
                later[node_id] = pos  # paused or dead: a connection would wait timeout_s for nothing
            else:
                live.append((link, pos))
        for link, pos in self._delete_on(live, keys):
            later[link.node_id] = pos
        if later:
            self._defer_deletes({node_id: [keys[p] for p in pos.tolist()] for node_id, pos in later.items()})

    def _delete_targets(self, keys: list[str], rings: Sequence[str]) -> dict[str, np.ndarray]:
        """Node id -> positions of the keys it may hold: their node and runner-up in the live
        ring, and their node under each recorded ring."""
        per_node: dict[str, list[np.ndarray]] = {}
        placements: list[tuple[Ring, np.ndarray]] = []
        replicated = self.replicas > 1 or any(replicas_of(r) > 1 for r in rings)
        try:
            ring = self._current_ring()
        except StorageUnavailable:
            if not rings:  # no node is live and no record says where the keys are: say so
                raise
        else:
            if replicated:
                # copies move with repairs: every live node is asked, whatever the records say
                everything = np.arange(len(keys))
                for lk in ring.links:
                    per_node.setdefault(lk.node_id, []).append(everything)
            depth = min(2, len(ring.links))
            rank = ring.ranked(keys, depth) if depth > 1 else np.zeros((len(keys), 1), np.intp)
            placements += [(ring, rank[:, col]) for col in range(rank.shape[1])]
        for ring_id in dict.fromkeys(rings):
            recorded = self.recorded_ring(ring_id)
            if recorded.replicas == 1:
                placements.append((recorded, recorded.owners(keys)))
                continue
            held = self._holders(recorded, keys, fresh=True)  # the nodes that are not live get them later
            for node_id in np.unique(held).tolist():
                per_node.setdefault(node_id, []).append(np.flatnonzero((held == node_id).any(axis=1)))
        for placed, owner in placements:
            for n, idx in group_by_node(owner, len(placed.links)):
                per_node.setdefault(placed.links[n].node_id, []).append(idx)
        return {node_id: np.unique(np.concatenate(parts)) for node_id, parts in per_node.items()}

    def _delete_on(self, targets: list[tuple[Link, np.ndarray]], keys: list[str]) -> list[tuple[Link, np.ndarray]]:
        """Send each node its deletes; returns the ``(link, positions)`` of those that failed."""
        failed, links, conns, sent = [], [], [], []
        try:
            for link, pos in targets:
                try:
                    conns.append(link.acquire())
                except StorageUnavailable:
                    failed.append((link, pos))
                    continue
                links.append(link)
                sent.append(pos)
            reqs = [
                (lk, c, OP_DEL, {"keys": [keys[p] for p in pos.tolist()]}, ()) for lk, c, pos in zip(links, conns, sent)
            ]
            _res, err = exchange(reqs, check_reply)
            if err is not None and not isinstance(err, StorageUnavailable):
                raise err
            failed += [(lk, pos) for lk, c, pos in zip(links, conns, sent) if c.broken]
        finally:
            release(links, conns)
        return failed

    def _defer_deletes(self, per_node: dict[str, list[str]]) -> None:
        """Record deletes for nodes that could not take them now (they run them when back)."""
        pipe = self._redis.pipeline(transaction=False)
        for node_id, keys in per_node.items():
            pipe.sadd(pending_nodes_key(self.namespace), node_id)
            pending = pending_deletes_key(self.namespace, node_id)
            for start in range(0, len(keys), PENDING_ENTRY_KEYS):
                pipe.rpush(pending, "\n".join(keys[start : start + PENDING_ENTRY_KEYS]))
        try:
            pipe.execute()
        except redis.RedisError as exc:
            nodes = ", ".join(map(repr, per_node))
            raise ConnectionFailed(
                f"DRAM storage node(s) {nodes} could not take deletes now, and recording them for later "
                f"in Redis at {redact(self.redis_url)} failed too ({exc}); the next clear retries them"
            ) from exc

    def repair(self) -> dict[str, Any]:
        """Run one repair pass now (:func:`~tq_redis.backends.dram.repair.repair_once`)."""
        return repair_once(self)

    def _after_fork(self) -> None:
        super()._after_fork()
        if self._repairs is not None:  # threads do not survive fork(): the child gets its own
            self._repairs = RepairLoop(self, self.repair_every_s)

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
        if self._repairs is not None:
            self._repairs.stop.set()
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


#: keys per entry of a node's pending-deletes list
PENDING_ENTRY_KEYS = 10_000


def _not_all_copies(exc: StorageError, replicas: int, links: list[Link], conns: list[Conn]) -> StorageError:
    """The error of a replicated put that could not store every copy, naming the nodes that could not."""
    failed = [lk.label for lk, c in zip(links, conns) if c.broken]
    who = ", ".join(failed) if failed else "one of " + ", ".join(lk.label for lk in links)
    err = type(exc)(
        f"a put with storage.replicas={replicas} returns only once all {replicas} copies of every value are "
        f"stored; DRAM storage node(s) {who} could not take theirs ({exc}); nothing of the batch was made "
        f"visible: retry the put"
    )
    return err


def _groups(ring: Ring, owner: np.ndarray, positions: np.ndarray) -> list[tuple[Link, np.ndarray]]:
    """``(link, positions)`` per node of ``ring`` that owns some of ``positions`` (``owner``: the
    node index of each)."""
    return [(ring.links[n], positions[idx]) for n, idx in group_by_node(owner, len(ring.links))]


def _some(keys: Sequence[str], positions: np.ndarray, limit: int = 5) -> str:
    """A few of ``keys[positions]`` for a message, and how many more there are."""
    names = ", ".join(repr(keys[p]) for p in positions[:limit].tolist())
    more = len(positions) - limit
    return names + (f" and {more} more" if more > 0 else "")


def _held(groups: list[tuple[Link, np.ndarray]], keys: Sequence[str]) -> str:
    """Which node was asked for which keys, for a message."""
    return "; ".join(f"{lk.label}: {_some(keys, pos, 3)}" for lk, pos in groups)


def _started(link: Link) -> str:
    """When the node's current run started (its registration's clock), for a message."""
    started = link.info.get("started")
    if not isinstance(started, (int, float)):
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
