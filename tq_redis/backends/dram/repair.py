"""Repair of replicated DRAM values: copies of a dead node re-made from a surviving copy, no controller.

Any ``dram`` store whose namespace puts replicated values (``storage.replicas`` > 1) runs
:func:`repair_once` now and then (:class:`RepairLoop`, a daemon thread of the store). One pass:

1. takes the lease :func:`~tq_redis.meta.keys.storage_repair_lease_key` (``SET NX PX``), so one
   process repairs at a time; a repairer that dies loses it when it expires and another continues;
2. for each replicated ring (``<ns>:storage:rings``) with a node that holds copies under it and is
   dead (heartbeat older than ``dead_after_s``) or gone (not registered), and not repaired yet:
   lists the ring's keys on its live nodes (``OP_KEYS``), picks those the dead node held, copies
   each from a live holder to its new holder (the best node of the live ring that holds it not yet,
   :func:`~tq_redis.backends.dram.replicas.replacements`), two-phase like a put, the lease renewed
   between batches;
3. records the repair (``<ns>:storage:repairs``: ring id -> ``[[dead node, live ring id], ...]``)
   only if the lease is still its own (``WATCH``/``MULTI``), so readers and clears find the new
   copies; then drops the copies of values a clear deleted meanwhile (their source is gone).

Progress is kept in :func:`~tq_redis.meta.keys.storage_repair_key` for ``tq-redis status``, the
exporter and the dashboard: ``state`` (idle / copying / waiting), ``dead``, ``ring``,
``values_total``, ``values_done``, ``bytes_done``, ``repaired`` (values re-made since the namespace
began) and ``waiting`` (why a repair cannot run: too few live nodes).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

import numpy as np
import redis

from tq_redis.backends.dram.placement import Ring, group_by_node, replicas_of
from tq_redis.backends.dram.pool import check_reply, hold, release, run
from tq_redis.backends.dram.protocol import OP_KEYS
from tq_redis.backends.dram.replicas import replacements
from tq_redis.backends.dram.values import Gathered, PutValues
from tq_redis.errors import StorageError
from tq_redis.meta.keys import storage_repair_key, storage_repair_lease_key, storage_repairs_key, storage_rings_key

#: the :class:`~tq_redis.backends.dram.store.DramStore` repaired (not imported: it imports this module)
DramStore = Any

log = logging.getLogger(__name__)

__all__ = ["BATCH", "LEASE_S", "RepairLoop", "repair_once"]

#: how long a repairer's lease lasts without renewal (it renews it between batches)
LEASE_S = 10.0
#: values copied per batch
BATCH = 1024


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Lease:
    """The repair lease of one pass: taken with ``SET NX PX``, renewed and released only while it is ours."""

    def __init__(self, r: redis.Redis, key: str) -> None:
        self.r, self.key, self.token = r, key, uuid.uuid4().hex

    def take(self) -> bool:
        return bool(self.r.set(self.key, self.token, nx=True, px=int(LEASE_S * 1000)))

    def _if_ours(self, act) -> bool:
        with self.r.pipeline() as pipe:
            try:
                pipe.watch(self.key)
                if _text(pipe.get(self.key) or b"") != self.token:
                    return False
                pipe.multi()
                act(pipe)
                pipe.execute()
                return True
            except redis.WatchError:
                return False

    def renew(self) -> bool:
        return self._if_ours(lambda p: p.pexpire(self.key, int(LEASE_S * 1000)))

    def commit(self, act) -> bool:
        """Run ``act(pipeline)`` atomically, and only while the lease is ours."""
        return self._if_ours(act)

    def release(self) -> None:
        self._if_ours(lambda p: p.delete(self.key))


def repair_once(store: DramStore) -> dict[str, Any]:
    """One repair pass (see the module's docstring); returns what it did: ``{"leased": bool,
    "repaired": values re-made, "pending": [(ring, dead node), ...] left for later}``."""
    r = store._redis
    ns = store.namespace
    lease = _Lease(r, storage_repair_lease_key(ns))
    if not lease.take():
        return {"leased": False, "repaired": 0, "pending": []}
    done, pending = 0, []
    try:
        live = store._current_ring(force=True)
        live_ids = {lk.node_id for lk in live.links}
        rings = [_text(k) for k in r.hkeys(storage_rings_key(ns))]
        for ring_id in [x for x in rings if replicas_of(x) > 1]:
            ring = store.recorded_ring(ring_id)
            gens = store.generations(ring_id, fresh=True)
            repaired = {dead for dead, _ in gens}
            members = [lk.node_id for lk in ring.links] + [lk.node_id for _, g in gens for lk in g.links]
            for dead in dict.fromkeys(members):
                if dead in live_ids or dead in repaired:
                    continue
                fresh = Ring([lk for lk in live.links if lk.node_id != dead], ring.replicas)
                if len(fresh.links) < ring.replicas:
                    pending.append((ring_id, dead))
                    r.hset(storage_repair_key(ns), mapping={
                        "state": "waiting", "dead": dead, "ring": ring_id,
                        "waiting": f"{len(fresh.links)} live node(s), {ring.replicas} needed to re-make the copies",
                    })  # fmt: skip
                    continue
                done += _repair(store, lease, ring, dead, fresh, members)
                gens = store.generations(ring_id, fresh=True)
                repaired.add(dead)
        state = "idle" if not pending else "waiting"
        r.hset(storage_repair_key(ns), mapping={"state": state, "updated": time.time()})
        if not pending:
            r.hdel(storage_repair_key(ns), "waiting")
    finally:
        lease.release()
    return {"leased": True, "repaired": done, "pending": pending}


def _repair(store: DramStore, lease: _Lease, ring: Ring, dead: str, fresh: Ring, members: list[str]) -> int:
    """Re-make the copies ``dead`` held under ``ring`` on nodes of ``fresh``; record the repair."""
    r, ns = store._redis, store.namespace
    listed: dict[str, str] = {}  # key -> a live node holding it
    for node_id in dict.fromkeys(members):
        link = store.link_of(node_id)
        if node_id == dead or link is None or link.heartbeat_age > store.dead_after_s:
            continue
        conns = hold([link])
        try:
            (reply,) = run([(link, conns[0], OP_KEYS, {"ring": ring.id}, ())], check_reply)
        finally:
            release([link], conns)
        for k in reply.get("keys") or []:
            listed.setdefault(k, node_id)
    keys = list(listed)
    held = store._holders(ring, keys, fresh=True) if keys else np.empty((0, ring.replicas), object)
    mine = np.flatnonzero((held == dead).any(axis=1)) if keys else np.empty(0, np.intp)
    keys = [keys[i] for i in mine.tolist()]
    status = storage_repair_key(ns)
    r.hset(status, mapping={"state": "copying", "dead": dead, "ring": ring.id, "values_total": len(keys),
                            "values_done": 0, "bytes_done": 0, "started": time.time()})  # fmt: skip
    target = replacements(held[mine], keys, dead, fresh) if keys else held[mine]
    copied: list[tuple[str, str, str]] = []  # key, source, new holder
    nbytes = 0
    for start in range(0, len(keys), BATCH):
        if not lease.renew():
            raise StorageError(
                f"the DRAM repair lease was lost while re-making the copies of {dead!r}; another repairer goes on"
            )
        part = keys[start : start + BATCH]
        rows = target[start : start + BATCH].tolist()
        new = [next(n for n in row if n not in held[mine[start + j]].tolist()) for j, row in enumerate(rows)]
        nbytes += _copy(store, ring.id, part, [listed[k] for k in part], new)
        copied += list(zip(part, [listed[k] for k in part], new))
        r.hset(status, mapping={"values_done": start + len(part), "bytes_done": nbytes})
    gens = [[d, g.id] for d, g in store.generations(ring.id, fresh=True)] + [[dead, fresh.id]]
    store.record_ring(fresh)
    if not lease.commit(lambda p: (p.hset(storage_repairs_key(ns), ring.id, json.dumps(gens)),
                                   p.hincrby(status, "repaired", len(keys)))):  # fmt: skip
        raise StorageError(
            f"the DRAM repair lease was lost before the repair of {dead!r} was recorded; the next pass redoes it"
        )
    store.generations(ring.id, fresh=True)
    _drop_cleared(store, copied)
    log.info("re-made %d copies held by dead DRAM node %r under ring %s (%d bytes)", len(keys), dead, ring.id, nbytes)
    return len(keys)


def _copy(store: DramStore, ring_id: str, keys: list[str], sources: list[str], targets: list[str]) -> int:
    """Read ``keys`` from their ``sources`` and put each on its node of ``targets`` (tagged with the ring)."""
    out = Gathered(len(keys))
    src = np.array(sources, dtype=object)
    groups = [(store.link_of(n), np.flatnonzero(src == n)) for n in dict.fromkeys(sources)]
    missing = store._get_from(groups, keys, out)  # a value cleared meanwhile is simply not copied
    table = out.table()
    keep = np.setdiff1d(np.arange(len(keys)), missing)
    tgt = np.array(targets, dtype=object)[keep]
    names = list(dict.fromkeys(tgt.tolist()))
    owner = np.array([names.index(n) for n in tgt.tolist()], dtype=np.intp)
    links = [store.link_of(n) for n in names]
    sub = [keys[i] for i in keep.tolist()]
    vals = PutValues([[table[i]] for i in keep.tolist()])
    conns = hold(links)
    try:
        store._put_on(links, conns, group_by_node(owner, len(names)), sub, vals, ring_id)
    finally:
        release(links, conns)
    return int(vals.sizes.sum()) if len(sub) else 0


def _drop_cleared(store: DramStore, copied: list[tuple[str, str, str]]) -> None:
    """Delete the new copies of values whose source no longer holds them (a clear ran meanwhile)."""
    by_source: dict[str, list[tuple[str, str]]] = {}
    for key, source, new in copied:
        by_source.setdefault(source, []).append((key, new))
    for source, items in by_source.items():
        link = store.link_of(source)
        if link is None:
            continue
        keys = [k for k, _ in items]
        gone = store._get_from([(link, np.arange(len(keys)))], keys, Gathered(len(keys)))
        for p in gone.tolist():
            target = store.link_of(items[p][1])
            if target is not None:
                store._delete_on([(target, np.array([0]))], [items[p][0]])


class RepairLoop:
    """A daemon thread running :func:`repair_once` every ``every_s`` seconds while its store is open."""

    def __init__(self, store: DramStore, every_s: float) -> None:
        self.store, self.every_s = store, every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tq-dram-repair", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                repair_once(self.store)
            except Exception as exc:  # noqa: BLE001 - the next pass retries; the lease lapses on its own
                if self.stop.is_set():
                    return
                log.warning("DRAM replica repair pass failed (the next one retries): %s", exc)
