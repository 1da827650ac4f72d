"""The namespaces on a Redis server: find them, say how big and how alive they are, drop them.

A job that was SIGKILLed leaves its namespace behind: its partitions, leases held by dead consumers,
the registrations of storage nodes that died with it. Nothing else would ever remove them, since
no controller watches the jobs. This module is what ``tq-redis namespace list|drop|gc`` runs:

* :func:`find` lists the namespaces that have keys: one ``SCAN`` per namespace-level key kind
  (``<ns>:config``, ``<ns>:partitions``, ...; each primary of a cluster). An admin's look at the
  whole server: clients never scan.
* :func:`describe` says, per namespace, when it was created and last touched (``<ns>:config``,
  written by every client's heartbeat, :mod:`tq_redis.client.liveness`), its live clients, its keys and
  their bytes (its keys are found through its registries, as checkpoints find them), its storage
  nodes (live or dead) and the bytes they hold, and its TTL.
* :func:`drop` deletes a namespace: the bytes of every partition and channel through the store
  (``clear_partition``: deletes reach every node the values were put on, or wait for an
  unreachable one in Redis), then every key. It refuses while a client or a storage node of the
  namespace is alive, unless forced.
* :func:`gc` drops every namespace whose ``namespace_ttl`` (``init`` config) has passed since any
  client last touched it and that has no live client, and forgets storage-node registrations
  that stopped beating long ago. No process runs it on a schedule (there is no controller): run
  ``tq-redis namespace gc`` from cron, or before a job (``tq-redis up`` runs it on the server it
  keeps data for).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from tq_redis import names
from tq_redis.client import checkpoint, liveness
from tq_redis.errors import NamespaceInUse, StorageError, TQError
from tq_redis.meta.keys import (
    ChannelKeys,
    by_slot,
    channels_key,
    clients_key,
    config_key,
    kept_partitions_key,
    partitions_key,
    pending_deletes_key,
    pending_nodes_key,
    storage_epoch_key,
    storage_nodes_key,
    storage_rings_key,
)
from tq_redis.monitor.known import find
from tq_redis.ops import channel as channel_ops
from tq_redis.server import connections
from tq_redis.server.registry import DEFAULT_FORGET_AFTER_S, forget_nodes, forgettable

__all__ = ["NamespaceInfo", "describe", "drop", "find", "gc"]

def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _now_ms(r: Any) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


@dataclass
class NamespaceInfo:
    """What :func:`describe` says of one namespace (times in ms by Redis's clock)."""

    namespace: str
    created_ms: int | None
    touched_ms: int | None
    ttl_s: float | None
    live_clients: list[str]
    partitions: int
    keys: int
    key_bytes: int
    live_nodes: list[str] = field(default_factory=list)
    dead_nodes: list[str] = field(default_factory=list)
    node_bytes: int = 0

    @property
    def in_use(self) -> bool:
        """A live client or storage node still works in it."""
        return bool(self.live_clients or self.live_nodes)

    def expired(self, now_ms: int) -> bool:
        """Its TTL has passed since it was last touched (never without a TTL)."""
        last = self.touched_ms or self.created_ms
        return self.ttl_s is not None and last is not None and now_ms - last > self.ttl_s * 1000

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def namespace_keys(r: Any, ns: str) -> list[str]:
    """Every key of namespace ``ns``: what its registries name (as checkpoints find them, the
    ``redis`` store's values included) and its namespace-level keys."""
    storage = _storage_backend(r, ns)
    keys = checkpoint.namespace_keys(r, ns, with_data=storage == "redis")
    pending = [_text(n) for n in r.smembers(pending_nodes_key(ns))]
    keys += [config_key(ns), clients_key(ns), storage_nodes_key(ns), storage_rings_key(ns), pending_nodes_key(ns),
             storage_epoch_key(ns)]
    keys += [pending_deletes_key(ns, n) for n in pending]
    return list(dict.fromkeys(keys))


def _storage_backend(r: Any, ns: str) -> str | None:
    raw = r.hget(config_key(ns), "storage")
    try:
        return json.loads(raw)["backend"] if raw else None
    except (ValueError, KeyError, TypeError):
        return None


def _key_bytes(r: Any, keys: list[str]) -> tuple[int, int]:
    """How many of ``keys`` exist, and the bytes Redis uses for them (``MEMORY USAGE``)."""
    count = total = 0
    for start in range(0, len(keys), 1000):
        pipe = r.pipeline(transaction=False)
        for key in keys[start : start + 1000]:
            pipe.memory_usage(key)
        for used in pipe.execute():
            if used is not None:
                count += 1
                total += int(used)
    return count, total


def describe(r: Any, ns: str, now_ms: int | None = None) -> NamespaceInfo:
    """Age, liveness and size of namespace ``ns`` (see :class:`NamespaceInfo`)."""
    now_ms = _now_ms(r) if now_ms is None else now_ms
    created, touched, ttl = r.hmget(config_key(ns), "created_ms", "touched_ms", "ttl_s")
    first = r.zrange(partitions_key(ns), 0, 0, withscores=True)
    created_ms = int(created) if created else (int(first[0][1] * 1000) if first else None)
    partitions = r.zcard(partitions_key(ns)) + r.scard(kept_partitions_key(ns))
    keys, key_bytes = _key_bytes(r, namespace_keys(r, ns))
    info = NamespaceInfo(
        ns, created_ms, int(touched) if touched else None, float(ttl) if ttl else None,
        liveness.live_clients(r, ns, now_ms), partitions, keys, key_bytes,
    )  # fmt: skip
    regs = {_text(k): v for k, v in r.hgetall(storage_nodes_key(ns)).items()}
    dead = set(forgettable(regs, now_ms / 1000, 0.0, DEAD_AFTER_S))  # silent too long, or its process is gone
    for node_id, raw in regs.items():
        (info.dead_nodes if node_id in dead else info.live_nodes).append(node_id)
        if node_id not in dead:
            try:
                info.node_bytes += int(json.loads(raw).get("used") or 0)
            except (ValueError, TypeError, AttributeError):
                pass
    return info


#: a storage node whose heartbeat is older than this counts as dead here (the dram store's default)
DEAD_AFTER_S = 10.0


def drop(url: str, ns: str, *, force: bool = False, say: Callable[[str], None] = lambda _m: None) -> NamespaceInfo:
    """Delete namespace ``ns`` from the server at ``url``: the bytes of its partitions and channels
    in its store, then every key. Returns what it held.

    Raises ``NamespaceInUse`` while a client or storage node of it is alive (``force``: drop it
    anyway; the live ones see it vanish). A store that cannot delete some bytes raises (``force``:
    reported through ``say`` and the keys dropped anyway, the bytes left where they are).
    """
    ns = names.namespace(ns)
    r = connections.sync_client(url)
    try:
        info = describe(r, ns)
        if info.in_use and not force:
            who = ", ".join([*info.live_clients, *(f"storage node {n}" for n in info.live_nodes)])
            raise NamespaceInUse(
                f"namespace {ns!r} is in use by {who}: stop them first (a client counts as gone "
                f"{liveness.GONE_AFTER_S:g} s after its last heartbeat), or drop it anyway with --force"
            )
        _drop_data(url, r, ns, force, say)
        keys = namespace_keys(r, ns)
        for group in by_slot(keys).values():
            for start in range(0, len(group), 1000):
                r.delete(*group[start : start + 1000])
        if info.live_nodes:
            say(f"storage node(s) {', '.join(info.live_nodes)} still run for namespace {ns!r}: they register "
                f"again; stop them to remove them too")
        return info
    finally:
        r.close()


def _drop_data(url: str, r: Any, ns: str, force: bool, say: Callable[[str], None]) -> None:
    """Delete the bytes of every partition (and its trash) and every channel's queued items."""
    from tq_redis.client.blocking import TransferQueueClient

    listed = [_text(p) for p in r.zrange(partitions_key(ns), 0, -1)]
    kept = [_text(p) for p in r.smembers(kept_partitions_key(ns))]
    channels = [_text(c) for c in r.smembers(channels_key(ns))]
    if not (listed or kept or channels):
        return
    client = TransferQueueClient(url, ns, live=False)
    try:
        for pid in dict.fromkeys(listed + kept):
            _each(lambda pid=pid: client.clear_partition(pid), f"partition {pid!r}", force, say)
        for name in channels:
            ck = ChannelKeys(ns, name)
            _each(lambda ck=ck: client.run(channel_ops.delete(client.context, ck)), f"channel {name!r}", force, say)
    finally:
        client.close()


def _each(action: Callable[[], Any], what: str, force: bool, say: Callable[[str], None]) -> None:
    try:
        action()
    except (TQError, redis.RedisError) as exc:
        if not force:
            raise StorageError(f"could not delete the bytes of {what} ({exc}); fix that and drop again, or "
                               f"pass --force to drop the keys and leave those bytes") from exc
        say(f"left the bytes of {what}: {exc}")


def gc(url: str, *, forget_after_s: float = DEFAULT_FORGET_AFTER_S,
       say: Callable[[str], None] = lambda _m: None) -> dict[str, list[str]]:
    """Drop every namespace whose TTL passed with no live client, and forget storage-node
    registrations dead for ``forget_after_s``. Returns ``{"dropped": [...], "forgotten": [...]}``."""
    r = connections.sync_client(url)
    dropped: list[str] = []
    forgotten: list[str] = []
    try:
        now_ms = _now_ms(r)
        for ns in find(r):
            regs = {_text(k): v for k, v in r.hgetall(storage_nodes_key(ns)).items()}
            dead = forgettable(regs, now_ms / 1000, DEAD_AFTER_S, forget_after_s)
            if dead:
                forget_nodes(r, ns, dead)
                forgotten += [f"{ns}/{n}" for n in dead]
            info = describe(r, ns, now_ms)
            if info.expired(now_ms) and not info.in_use:
                drop(url, ns, say=say)
                dropped.append(ns)
        return {"dropped": dropped, "forgotten": forgotten}
    finally:
        r.close()


def as_json(infos: list[NamespaceInfo]) -> str:
    return json.dumps([i.as_dict() for i in infos], indent=2)
