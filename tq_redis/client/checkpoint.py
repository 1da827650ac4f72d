"""Checkpoints: a namespace's state in a directory, and back (:func:`save`, :func:`load`; the
module-level ``tq_redis.save_checkpoint`` / ``load_checkpoint`` run them with ``init()``'s client,
and ``TransferQueueClient.save_storage_checkpoint`` and its siblings with that client).

This is the client-level half, which does the blocking I/O (Redis through the client's own
redis-py connection and operations, the store, the files); the record format it writes, free of
I/O, is :mod:`tq_redis.ops.checkpoint`.

What is saved: every Redis key of the namespace (partitions, production and consumption
bitmaps, leases, tags, KV keys, channels, event streams), written type by type (not ``DUMP``, so a
checkpoint of Valkey loads into Redis and back), and the bytes of every produced field of every
partition, read from the namespace's store. With the ``redis`` store those bytes are Redis keys
and travel with the rest. Keys are found through the namespace's registries (``partitions``,
``partitions:kept``, ``channels``; see :mod:`tq_redis.meta.keys`), never by a key pattern, so another
namespace (``a:b`` beside ``a``) is never read or touched, and the multi-key deletes of a load are
grouped per hash slot, so both work on a Redis Cluster. The sampler caches ``rank:``/``bal:``
(which expire within seconds) are not saved. Keys relative to the namespace are stored without it, so a checkpoint
loads into another namespace too. Not saved: ``<ns>:config`` and ``<ns>:storage:*`` (the
store and the storage nodes are whatever the loading process's ``init`` set up), where a placing
store put each value (``<p>:rings``, ``<p>:loc:*``, a queued item's ring: the load puts the bytes
where the loading namespace's nodes are and records that instead), and, with a store other than
``redis``, tensor items still queued in a ``Channel``.

Call both between steps, while no process writes to the namespace: the keys are read one by one,
not as one snapshot. ``save_checkpoint`` also writes ``manifest.json`` (every file with its size and
SHA-256). ``load_checkpoint`` is all or nothing: it checks every file before its first write
(:mod:`tq_redis.client.checkpoint_files`), refuses a namespace that holds data unless
``replace=True`` (then that data is cleared, its bytes deleted from every store), deletes the keys
not in the checkpoint, and writes bytes to the store before the metadata that makes them visible.
A checkpoint directory is replaced atomically (written aside, then renamed), as in TransferQueue
0.1.11, whose signatures these follow.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tq_redis import names
from tq_redis.client import checkpoint_files as files
from tq_redis.codec import objects
from tq_redis.errors import ConfigError, NamespaceNotEmpty
from tq_redis.meta import bitmaps
from tq_redis.meta.keys import ChannelKeys, PartitionKeys, by_slot, channels_key, kept_partitions_key, partitions_key
from tq_redis.meta.schemas import KIND_PARTS
from tq_redis.ops import channel as channel_ops
from tq_redis.ops import checkpoint_check as check
from tq_redis.ops import data as ops_data
from tq_redis.ops.checkpoint import (
    DATA_DIR,
    FORMAT,
    KEYS_FILE,
    METADATA_FILE,
    is_placement,
    placed,
    placement_codes,
    portable,
    record_value,
    registries,
    unplaced,
)
from tq_redis.ops.context import Context, Op, storage
from tq_redis.ops.encoding import text

__all__ = ["CheckpointClient", "load", "namespace_keys", "save"]

_BATCH = 1000  # keys per pipelined round trip (and per DEL)

R = TypeVar("R")


class CheckpointClient(Protocol):
    """What a checkpoint needs of a client (a :class:`~tq_redis.client.blocking.TransferQueueClient`)."""

    namespace: str

    @property
    def redis(self) -> Any:
        """The client's redis-py connection."""

    @property
    def context(self) -> Context:
        """What the client's operations run with."""

    def run(self, op: Op[R]) -> R:
        """Run an operation to its result, blocking."""

    def _restore_identity(self) -> None:
        """Take up the namespace's epoch, drawn if it has none (:mod:`tq_redis.server.identity`)."""


# ------------------------------------------------------------------ which keys the namespace has


def _partition_ids(r: Any, ns: str) -> list[str]:
    """Every partition that may hold keys: the listed ones, then those kept after a clear."""
    pipe = r.pipeline(transaction=False)
    pipe.zrange(partitions_key(ns), 0, -1)
    pipe.smembers(kept_partitions_key(ns))
    listed, kept = pipe.execute()
    return list(dict.fromkeys([text(p) for p in listed] + sorted(text(p) for p in kept)))


def _partition_keys(r: Any, pk: PartitionKeys, with_data: bool) -> list[str]:
    """The keys partition ``pk`` may have, named by its own registries (its fields, tasks, waiting
    tasks and tag names); with ``with_data`` the ``redis`` store's value keys of its alive and
    trashed samples too."""
    pipe = r.pipeline(transaction=False)
    pipe.hkeys(pk.fields)
    for key in (pk.tasks, pk.waittasks, pk.tagnames, pk.trash_fields):
        pipe.smembers(key)
    pipe.get(pk.alive)
    pipe.get(pk.trash)
    fields, tasks, waiting, tagnames, trash_fields, alive, trash = pipe.execute()
    fields = [text(f) for f in fields]
    keys = [pk.meta, pk.seq, pk.alive, pk.fields, pk.tasks, pk.tagnames, pk.groups, pk.groupidx, pk.kv,
            pk.kvkeys, pk.events, pk.tagchanges, pk.waittasks, pk.trash, pk.trash_fields, pk.inline, pk.dock,
            pk.dockstate, pk.dockmetrics, pk.dockdone, pk.dockready, pk.dockage, pk.closed, pk.rings, pk.counters]
    keys += [pk.prod(f) for f in fields]
    keys += [pk.loc(f) for f in fields]
    for task in sorted(map(text, tasks)):
        keys += [pk.cons(task), pk.lease(task), pk.deliveries(task), pk.poison(task)]
    for task in sorted(map(text, waiting)):
        keys += [pk.waiters(task), pk.waitneed(task), pk.wake(task), pk.wakebudget(task)]
    keys += [pk.tag(t) for t in sorted(map(text, tagnames))]
    if with_data:
        ids = sorted(set(bitmaps.set_ids(alive)) | set(bitmaps.set_ids(trash)))
        for field in dict.fromkeys(fields + sorted(map(text, trash_fields))):
            keys += pk.data_keys(ids, field)
    return keys


def _channel_keys(r: Any, ck: ChannelKeys, with_data: bool) -> list[str]:
    """The keys of channel ``ck``: its queues are named by its ``meta`` hash; with ``with_data``
    the ``redis`` store's keys of its queued tensor items too."""
    queues = channel_ops.queue_keys(ck, r.hkeys(ck.meta))
    keys = [ck.meta, ck.seq, ck.puts, ck.gets, *queues]
    if with_data and queues:
        pipe = r.pipeline(transaction=False)
        for q in queues:
            pipe.lrange(q, 0, -1)
        data = ck.data_keys()
        for entries in pipe.execute():
            for entry in entries:
                ids, fields, _ = channel_ops.stored_parts(entry)
                keys += [data.data(i, f) for i in ids for f in fields]
    return keys


def _namespace_keys(r: Any, ns: str, with_data: bool) -> list[str]:
    """Every key of namespace ``ns`` a checkpoint holds (not ``<ns>:config`` nor ``<ns>:storage:*``:
    those belong to whoever runs the namespace), found through its registries."""
    keys = [partitions_key(ns), kept_partitions_key(ns), channels_key(ns)]
    for pid in _partition_ids(r, ns):
        keys += _partition_keys(r, PartitionKeys.internal(ns, pid), with_data)
    for name in sorted(text(c) for c in r.smembers(channels_key(ns))):
        keys += _channel_keys(r, ChannelKeys(ns, name), with_data)
    return list(dict.fromkeys(keys))


def namespace_keys(r: Any, ns: str, with_data: bool) -> list[str]:
    """Every key of namespace ``ns`` its registries name (see :func:`_namespace_keys`)."""
    return _namespace_keys(r, ns, with_data)


# ------------------------------------------------------------------ reading and writing keys


def _read_keys(r: Any, keys: list[str]) -> list[tuple[str, str, Any, int]]:
    """``(key, type, value, ttl_ms)`` of each key that exists, in two round trips per batch."""
    out = []
    for start in range(0, len(keys), _BATCH):
        batch = keys[start : start + _BATCH]
        pipe = r.pipeline(transaction=False)
        for key in batch:
            pipe.type(key)
        kinds = [text(k) for k in pipe.execute()]
        present = [(key, kind) for key, kind in zip(batch, kinds) if kind != "none"]
        pipe = r.pipeline(transaction=False)
        for key, kind in present:
            _queue_read(pipe, key, kind)
            pipe.pttl(key)
        replies = pipe.execute()
        for (key, kind), value, ttl in zip(present, replies[::2], replies[1::2]):
            out.append((key, kind, record_value(kind, value), int(ttl)))
    return out


def _queue_read(pipe: Any, key: str, kind: str) -> None:
    if kind == "string":
        pipe.get(key)
    elif kind == "hash":
        pipe.hgetall(key)
    elif kind == "list":
        pipe.lrange(key, 0, -1)
    elif kind == "set":
        pipe.smembers(key)
    elif kind == "zset":
        pipe.zrange(key, 0, -1, withscores=True)
    elif kind == "stream":
        pipe.xrange(key)
    else:
        raise ConfigError(f"key {key!r} has type {kind}, which checkpoints do not support")


def _delete(r: Any, keys: list[str]) -> None:
    """Delete ``keys``: one DEL per hash slot (and per batch), pipelined."""
    pipe = r.pipeline(transaction=False)
    for group in by_slot(keys).values():
        for start in range(0, len(group), _BATCH):
            pipe.execute_command("DEL", *group[start : start + _BATCH])
    pipe.execute()


def _write_key(pipe: Any, key: str, kind: str, value: Any, ttl_ms: int) -> None:
    pipe.delete(key)
    if kind == "string":
        pipe.set(key, value)
    elif kind == "hash" and value:
        pipe.hset(key, mapping=value)
    elif kind == "list" and value:
        pipe.rpush(key, *value)
    elif kind == "set" and value:
        pipe.sadd(key, *value)
    elif kind == "zset" and value:
        pipe.zadd(key, {m: s for m, s in value})
    elif kind == "stream":
        for entry_id, flat in value:
            pipe.xadd(key, dict(zip(flat[::2], flat[1::2])), id=entry_id)
    if ttl_ms > 0:
        pipe.pexpire(key, ttl_ms)


def _write(root: Path, name: str, blob: bytes, entries: dict[str, tuple[int, str]]) -> None:
    """Write file ``name`` (relative to ``root``) and note its size and checksum in ``entries``."""
    (root / name).write_bytes(blob)
    entries[name] = check.entry(blob)


def _save_data(client: CheckpointClient, store: Any, root: Path, entries: dict[str, tuple[int, str]]) -> int:
    """Bytes of every produced (sample, field) of every partition, one file per partition, then
    the bytes of every channel's queued tensor items (they live in the channel's hidden
    partition, named by the queue entries rather than by bits)."""
    r, ns = client.redis, client.namespace
    saved = 0
    n = -1
    for n, pid in enumerate(text(p) for p in r.zrange(partitions_key(ns), 0, -1)):
        pk = client.context.keys(pid)
        alive = set(bitmaps.set_ids(r.get(pk.alive)))
        inline = {text(name) for name in r.hkeys(pk.inline)}  # saved with the metadata
        columns: dict[str, dict[str, list]] = {}
        for field, schema in ((text(f), text(s)) for f, s in r.hgetall(pk.fields).items()):
            if json.loads(schema).get("kind") == KIND_PARTS:
                continue  # a field written in parts has no bytes of its own: they are its <field>~<k> fields
            ids = [i for i in bitmaps.set_ids(r.get(pk.prod(field))) if i in alive and f"{i}:{field}" not in inline]
            if ids:
                where = client.run(ops_data.check_visible(pk, ids, [field], placement=True)).placement
                values = store.get(pk, ids, [field], where)[field]
                columns[field] = {"ids": ids, "values": [bytes(v) for v in values]}
                saved += len(ids)
        if columns:
            blob = objects.encode_object({"partition": pid, "columns": columns})
            _write(root, f"{DATA_DIR}/{n:06d}.msgpack", blob, entries)
    for k, name in enumerate(sorted(text(c) for c in r.smembers(channels_key(ns)))):
        ck = ChannelKeys(ns, name)
        columns = _channel_columns(r, store, ck)
        if columns:
            blob = objects.encode_object({"partition": ck.data_partition, "columns": columns})
            _write(root, f"{DATA_DIR}/{n + 1 + k:06d}.msgpack", blob, entries)
            saved += sum(len(c["ids"]) for c in columns.values())
    return saved


def _channel_columns(r: Any, store: Any, ck: ChannelKeys) -> dict[str, dict[str, list]]:
    """``{field: {"ids", "values"}}`` of the tensor items queued in channel ``ck``."""
    columns: dict[str, dict[str, list]] = {}
    pk = ck.data_keys()
    for queue in channel_ops.queue_keys(ck, r.hkeys(ck.meta)):
        for entry in r.lrange(queue, 0, -1):
            ids, fields, rings = channel_ops.stored_parts(entry)
            if ids:
                got = store.get(pk, ids, fields, channel_ops.item_placement(rings))
                for field in fields:
                    column = columns.setdefault(field, {"ids": [], "values": []})
                    column["ids"].extend(ids)
                    column["values"].extend(bytes(v) for v in got[field])
    return columns


def save(client: CheckpointClient, checkpoint_dir: str | Path, *, metadata: dict[str, Any] | None = None,
         include_storage: bool = True) -> None:
    """Save the namespace of ``client`` (a :class:`~tq_redis.client.blocking.TransferQueueClient`) to
    ``checkpoint_dir`` (``tq_redis.save_checkpoint`` does it with ``init()``'s client).

    ``metadata`` (JSON-serialisable) is stored in ``metadata.json`` and returned by
    :func:`load`. ``include_storage=False`` saves metadata only (for stores whose data
    outlives the job); it has no effect with the ``redis`` store, whose bytes are Redis keys, nor
    with the ``dram`` store, whose nodes do not outlive the job (as the reference forces it for
    SimpleStorage: a metadata-only checkpoint of them could never be loaded).
    """
    final = Path(checkpoint_dir)
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / DATA_DIR).mkdir(parents=True)
    try:
        store = client.run(storage(client.context))
        if store.backend == "dram":
            include_storage = True
        saved = 0
        entries: dict[str, tuple[int, str]] = {}  # every file written: the manifest's lines
        if include_storage and store.backend != "redis":
            saved = _save_data(client, store, tmp, entries)
        r, ns = client.redis, client.namespace
        keys = _namespace_keys(r, ns, with_data=store.backend == "redis")
        records = [
            [portable(key[len(ns) + 1 :], ns), kind, unplaced(key, kind, value), ttl]
            for key, kind, value, ttl in _read_keys(r, keys)
            if not is_placement(key)
        ]
        _write(tmp, KEYS_FILE, objects.encode_object(records), entries)
        info = {
            "format": FORMAT, "namespace": ns, "backend": store.backend, "saved_at": time.time(),
            "storage_saved": include_storage or store.backend == "redis", "values_saved": saved,
            "manifest": check.MANIFEST_FILE, "user_metadata": metadata or {},
        }
        _write(tmp, METADATA_FILE, json.dumps(info, indent=2).encode(), entries)
        (tmp / check.MANIFEST_FILE).write_bytes(check.manifest(entries))
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old.exists() and not final.exists():
            old.rename(final)
        raise


def load(client: CheckpointClient, checkpoint_dir: str | Path, *, replace: bool = False) -> dict[str, Any]:
    """Load the checkpoint in ``checkpoint_dir`` into ``client``'s namespace; returns its user
    ``metadata`` (``tq_redis.load_checkpoint`` does it with ``init()``'s client).

    All or nothing: every file is read, checked against the manifest and decoded before the first
    write (:mod:`tq_redis.client.checkpoint_files`). A namespace that holds data (partitions,
    channels) is refused unless ``replace``; replacing clears that data first, its bytes deleted
    from every store, and deletes every key of the namespace the checkpoint does not hold.

    Raises:
        CheckpointNotFound: no checkpoint in ``checkpoint_dir``.
        CheckpointCorrupt: a file is missing, truncated, altered or malformed; nothing was written.
        NamespaceNotEmpty: the namespace holds data and ``replace`` is False; nothing was written.
        ConfigError: the checkpoint's bytes cannot go to this namespace's store.
    """
    final = Path(checkpoint_dir)
    old = final.with_name(final.name + ".old")
    if not final.exists() and old.exists():  # a save died between its two renames
        old.rename(final)
    checked = files.read_checked(final)
    r, ns = client.redis, client.namespace
    # before the first call: a namespace Redis lost is taken up again, under an epoch (server.identity);
    # on a namespace that has one this only reads it, so a refusal below leaves nothing changed
    client._restore_identity()
    store = client.run(storage(client.context))
    if checked.data and store.backend == "redis":
        raise ConfigError(
            f"the checkpoint holds {checked.info['backend']} store data but this namespace uses the redis store"
        )
    present = files.held(r, ns)
    if present and not replace:
        raise NamespaceNotEmpty(
            f"namespace {ns!r} holds {present}, which loading {final} would delete; nothing was changed: "
            f"clear them first, load into a new namespace, or pass replace=True (their bytes are then "
            f"deleted from every store too)"
        )
    if present:
        files.clear_held(client, present)
    placements = []  # where a placing store put each partition's fields: recorded with the bits
    for name, sha in checked.data:  # data first, then the bits that make it visible
        part = files.read_part(final, name, sha)
        pid = part["partition"]  # a channel's hidden partition carries the reserved prefix
        internal = pid.startswith(names.RESERVED_PARTITION_PREFIX)
        pk = PartitionKeys.internal(ns, pid) if internal else client.context.keys(pid)
        rings = {}
        for field, column in part["columns"].items():
            rings[field] = store.put(pk, column["ids"], {field: [[v] for v in column["values"]]}), column["ids"]
        if not internal:
            placements.append((pk, rings))
    records = registries(ns, checked.records)
    records = [[placed(suffix, ns), *rest] for suffix, *rest in records]
    keep = {f"{ns}:{suffix}" for suffix, *_ in records}
    _delete(r, [k for k in _namespace_keys(r, ns, with_data=store.backend == "redis") if k not in keep])
    pipe = r.pipeline(transaction=False)
    for suffix, kind, value, ttl_ms in records:
        _write_key(pipe, f"{ns}:{suffix}", kind, value, ttl_ms)
    for pk, rings in placements:
        _write_placement(pipe, pk, rings)
    pipe.execute()
    return checked.info.get("user_metadata") or {}


def _write_placement(pipe: Any, pk: PartitionKeys, rings: dict[str, tuple[str | None, list[int]]]) -> None:
    """Record where the load put each field of a partition (:func:`tq_redis.ops.checkpoint.placement_codes`)."""
    index, codes = placement_codes(rings)
    for ring, k in index.items():
        pipe.hset(pk.rings, ring, k)
    for field, code in codes.items():
        for i in rings[field][1]:
            pipe.setrange(pk.loc(field), 2 * i, code)
