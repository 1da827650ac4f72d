"""A checkpoint's record format, free of I/O: the files a checkpoint directory holds, how a key is
kept so that it loads into any namespace, and how records are made whole before a load.

:mod:`tq_redis.client.checkpoint` reads the namespace from Redis and the store, and writes and reads
the directory, with these rules (its docstring says what is saved). A checkpoint directory holds
:data:`METADATA_FILE` (JSON: format, namespace, store, user metadata), :data:`KEYS_FILE` (msgpack:
one ``[suffix, type, value, ttl_ms]`` record per Redis key, the suffix being the key less ``<ns>:``,
made :func:`portable`), for a store other than ``redis`` one msgpack file per partition in
:data:`DATA_DIR`, and a manifest of them all (:mod:`tq_redis.ops.checkpoint_check`, which also
checks each file's contents before a load).
"""

from __future__ import annotations

from typing import Any

from tq_redis import names
from tq_redis.ops import channel as channel_ops
from tq_redis.ops.encoding import text

FORMAT = 1
METADATA_FILE = "metadata.json"
KEYS_FILE = "redis_keys.msgpack"
DATA_DIR = "data"


def portable(suffix: str, ns: str) -> str:
    """A key (less ``<ns>:``) as checkpoints keep it: without the namespace in its hash tag
    (``{ns/p}:meta`` -> ``{p}:meta``), so a checkpoint loads into any namespace and into either
    key layout (the tag was ``{p}`` before 0.2)."""
    for head in ("{", "chan:{"):
        if suffix.startswith(head + ns + "/"):
            return head + suffix[len(head) + len(ns) + 1 :]
    return suffix


def placed(suffix: str, ns: str) -> str:
    """The key (less ``<ns>:``) a :func:`portable` suffix has in namespace ``ns``."""
    for head in ("chan:{", "{"):
        if suffix.startswith(head):
            return f"{head}{ns}/{suffix[len(head):]}"
    return suffix


def registries(ns: str, records: list[list[Any]]) -> list[list[Any]]:
    """``records`` with the registries made to name every partition and channel they hold keys of
    (a checkpoint written before the registries existed lists channels and cleared partitions only
    through their keys)."""
    listed: set[str] = set()
    by_suffix = {rec[0]: rec for rec in records}
    zset = by_suffix.get("partitions")
    if zset is not None:
        listed = {text(m) for m, _ in zset[2]}
    partitions: set[str] = set()
    channels: set[str] = set()
    for suffix, *_ in records:
        if suffix.startswith("{") and "}:" in suffix:
            pid = suffix[1 : suffix.index("}:")]
            if not pid.startswith(names.RESERVED_PARTITION_PREFIX):
                partitions.add(pid)
        elif suffix.startswith("chan:{") and suffix.endswith("}:meta"):
            channels.add(suffix[len("chan:{") : -len("}:meta")])
    out = [rec for rec in records if rec[0] not in ("partitions:kept", "channels")]
    kept = partitions - listed | {text(m) for m in (by_suffix.get("partitions:kept") or [None, None, []])[2]}
    chans = channels | {text(m) for m in (by_suffix.get("channels") or [None, None, []])[2]}
    if kept:
        out.append(["partitions:kept", "set", sorted(kept), -1])
    if chans:
        out.append(["channels", "set", sorted(chans), -1])
    return out


def record_value(kind: str, value: Any) -> Any:
    """A key's value as redis-py read it (``kind``: the key's type), in the form a record keeps."""
    if kind == "set":
        return sorted(value)
    if kind == "zset":
        return [[m, s] for m, s in value]
    if kind == "stream":
        return [[text(i), [x for kv in fields.items() for x in kv]] for i, fields in value]
    return value


def is_placement(key: str) -> bool:
    """Whether ``key`` records where a placing store put values (``<p>:rings``, ``<p>:loc:<field>``):
    not saved, since a load puts the bytes wherever the loading namespace's nodes are."""
    tail = key.split("}:", 1)[1] if "}:" in key else ""
    return tail == "rings" or tail.startswith("loc:")


def unplaced(key: str, kind: str, value: Any) -> Any:
    """A channel queue's entries without the ring their bytes were put under (see :func:`is_placement`)."""
    if kind != "list" or "}:q:" not in key or not key.split(":", 1)[1].startswith("chan:{"):
        return value
    return [channel_ops.without_ring(entry) for entry in value]


def placement_codes(rings: dict[str, tuple[str | None, list[int]]]) -> tuple[dict[str, int], dict[str, bytes]]:
    """Where a load put each field of a partition, in ``lua/includes/placement.lua``'s layout:
    ``(ring -> index, field -> two-byte code)``, given ``field -> (ring, ids)``; a field put without
    a ring (an unplaced store) has no code, nor does a field on ring 0 (the default, which
    ``<p>:loc:<field>`` does not record)."""
    index: dict[str, int] = {}
    codes: dict[str, bytes] = {}
    for field, (ring, _ids) in rings.items():
        if ring is None:
            continue
        k = index.setdefault(ring, len(index))
        if k:
            codes[field] = bytes((k % 256, k // 256))
    return index, codes
