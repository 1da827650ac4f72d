"""``save_checkpoint`` / ``load_checkpoint``: a namespace's state in a directory, and back.

What is saved: every Redis key of the namespace (partitions, production and consumption
bitmaps, leases, tags, KV keys, channels, event streams), written type by type (not ``DUMP``, so a
checkpoint of Valkey loads into Redis and back), and the bytes of every produced field of every
partition, read from the namespace's store. With the ``redis`` store those bytes are Redis keys
and travel with the rest. Keys relative to the namespace are stored without it, so a checkpoint
loads into another namespace too. Not saved: ``<ns>:config`` and ``<ns>:storage:*`` (the
store and the storage nodes are whatever the loading process's ``init`` set up), and, with a
store other than ``redis``, tensor items still queued in a ``Channel``.

Call both between steps, while no process writes to the namespace: the keys are read one by one,
not as one snapshot. ``load_checkpoint`` replaces the namespace's state: keys not in the
checkpoint are deleted; bytes are written to the store before the metadata that makes them
visible. A checkpoint directory is replaced atomically (written aside, then renamed), as in
TransferQueue 0.1.11, whose signatures these follow.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from tq_redis import bitmaps, objects, ops
from tq_redis.errors import ConfigError, InvalidArgument
from tq_redis.keys import config_key, partitions_key, storage_nodes_key

FORMAT = 1
METADATA_FILE = "metadata.json"
KEYS_FILE = "redis_keys.msgpack"
DATA_DIR = "data"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _skipped(ns: str) -> tuple[str, ...]:
    return (config_key(ns), storage_nodes_key(ns).rsplit(":", 1)[0] + ":")


def _namespace_keys(r: Any, ns: str) -> list[bytes]:
    skip = _skipped(ns)
    return [k for k in r.scan_iter(match=f"{ns}:*", count=1000) if not _text(k).startswith(skip)]


def _read_key(r: Any, key: bytes) -> tuple[str, Any, int] | None:
    kind = _text(r.type(key))
    if kind == "string":
        value: Any = r.get(key)
    elif kind == "hash":
        value = r.hgetall(key)
    elif kind == "list":
        value = r.lrange(key, 0, -1)
    elif kind == "set":
        value = sorted(r.smembers(key))
    elif kind == "zset":
        value = [[m, s] for m, s in r.zrange(key, 0, -1, withscores=True)]
    elif kind == "stream":
        value = [[_text(i), [x for kv in fields.items() for x in kv]] for i, fields in r.xrange(key)]
    elif kind == "none":  # deleted since the scan
        return None
    else:
        raise ConfigError(f"key {_text(key)!r} has type {kind}, which checkpoints do not support")
    return kind, value, int(r.pttl(key))


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


def _save_data(client: Any, store: Any, target: Path) -> int:
    """Bytes of every produced (sample, field) of every partition, one file per partition."""
    r, ns = client.redis, client.namespace
    saved = 0
    for n, pid in enumerate(_text(p) for p in r.zrange(partitions_key(ns), 0, -1)):
        pk = client.context.keys(pid)
        alive = set(bitmaps.set_ids(r.get(pk.alive)))
        columns: dict[str, dict[str, list]] = {}
        for field in (_text(f) for f in r.hkeys(pk.fields)):
            ids = [i for i in bitmaps.set_ids(r.get(pk.prod(field))) if i in alive]
            if ids:
                values = store.get(pk, ids, [field])[field]
                columns[field] = {"ids": ids, "values": [bytes(v) for v in values]}
                saved += len(ids)
        if columns:
            blob = objects.encode_object({"partition": pid, "columns": columns})
            (target / f"{n:06d}.msgpack").write_bytes(blob)
    return saved


def save_checkpoint(checkpoint_dir: str | Path, *, metadata: dict[str, Any] | None = None,
                    include_storage: bool = True) -> None:
    """Save the namespace of the client ``tq_redis.init()`` created to ``checkpoint_dir``.

    ``metadata`` (JSON-serialisable) is stored in ``metadata.json`` and returned by
    :func:`load_checkpoint`. ``include_storage=False`` saves metadata only (for stores whose data
    outlives the job); it has no effect with the ``redis`` store, whose bytes are Redis keys, nor
    with the ``dram`` store, whose nodes do not outlive the job (as the reference forces it for
    SimpleStorage: a metadata-only checkpoint of them could never be loaded).
    """
    from tq_redis.runtime import get_client

    client = get_client()
    final = Path(checkpoint_dir)
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / DATA_DIR).mkdir(parents=True)
    try:
        store = client.run(ops.storage(client.context))
        if store.backend == "dram":
            include_storage = True
        saved = 0
        if include_storage and store.backend != "redis":
            saved = _save_data(client, store, tmp / DATA_DIR)
        r, ns = client.redis, client.namespace
        records = []
        for key in _namespace_keys(r, ns):
            got = _read_key(r, key)
            if got is not None:
                records.append([_text(key)[len(ns) + 1 :], *got])
        (tmp / KEYS_FILE).write_bytes(objects.encode_object(records))
        info = {
            "format": FORMAT, "namespace": ns, "backend": store.backend, "saved_at": time.time(),
            "storage_saved": include_storage or store.backend == "redis", "values_saved": saved,
            "user_metadata": metadata or {},
        }
        (tmp / METADATA_FILE).write_text(json.dumps(info, indent=2))
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


def load_checkpoint(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Replace the namespace's state with the checkpoint's; returns its user ``metadata``."""
    from tq_redis.runtime import get_client

    client = get_client()
    final = Path(checkpoint_dir)
    old = final.with_name(final.name + ".old")
    if not final.exists() and old.exists():  # a save died between its two renames
        old.rename(final)
    if not (final / METADATA_FILE).exists():
        raise FileNotFoundError(f"{final} is not a checkpoint ({METADATA_FILE} is missing)")
    info = json.loads((final / METADATA_FILE).read_text())
    if info.get("format") != FORMAT:
        raise InvalidArgument(f"checkpoint format {info.get('format')!r} is not {FORMAT}")
    r, ns = client.redis, client.namespace
    store = client.run(ops.storage(client.context))
    data_files = sorted((final / DATA_DIR).glob("*.msgpack"))
    if data_files and store.backend == "redis":
        raise ConfigError(f"the checkpoint holds {info['backend']} store data but this namespace uses the redis store")
    for path in data_files:  # data first, then the bits that make it visible
        part = objects.decode_object(path.read_bytes())
        pk = client.context.keys(part["partition"])
        for field, column in part["columns"].items():
            store.put(pk, column["ids"], {field: [[v] for v in column["values"]]})
    records = objects.decode_object((final / KEYS_FILE).read_bytes())
    keep = {f"{ns}:{suffix}" for suffix, *_ in records}
    stale = [k for k in _namespace_keys(r, ns) if _text(k) not in keep]
    pipe = r.pipeline(transaction=False)
    for start in range(0, len(stale), 1000):
        pipe.delete(*stale[start : start + 1000])
    for suffix, kind, value, ttl_ms in records:
        _write_key(pipe, f"{ns}:{suffix}", kind, value, ttl_ms)
    pipe.execute()
    return info["user_metadata"]
