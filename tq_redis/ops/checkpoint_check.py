"""A checkpoint's files checked before a load writes anything, free of I/O: the manifest
``save_checkpoint`` writes (every file with its size and SHA-256), and the decoding and shape of
each file (:data:`~tq_redis.ops.checkpoint.METADATA_FILE`, the key records, the data parts).

Each function takes a file's bytes and its name (relative to the checkpoint directory) and returns
what it holds, or raises :class:`~tq_redis.errors.CheckpointCorrupt` naming the file and what is
wrong with it. :mod:`tq_redis.client.checkpoint` reads the files and calls these before its first
write to Redis or a store, so a damaged checkpoint leaves the namespace as it was.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from tq_redis import names
from tq_redis.codec import objects
from tq_redis.errors import CheckpointCorrupt, InvalidName, TQError
from tq_redis.ops.checkpoint import FORMAT, METADATA_FILE

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1

#: the Redis types a key record may have, and the Python type its value decodes to
_KINDS: dict[str, tuple[type, ...]] = {
    "string": (bytes, str, int, float),
    "hash": (dict,),
    "list": (list,),
    "set": (list,),
    "zset": (list,),
    "stream": (list,),
}
#: key suffixes (less ``<ns>:``) no checkpoint holds: whoever runs the loading namespace owns them
_NOT_SAVED = ("config", "clients", "storage:")


def digest(blob: bytes) -> str:
    """The checksum a manifest keeps of a file (SHA-256, hex)."""
    return hashlib.sha256(blob).hexdigest()


def entry(blob: bytes) -> tuple[int, str]:
    """What a manifest keeps of a file: its size and SHA-256."""
    return len(blob), digest(blob)


def manifest(entries: Mapping[str, tuple[int, str]]) -> bytes:
    """The manifest of a checkpoint whose files (name relative to the directory) have ``entries``."""
    listed = {name: {"size": size, "sha256": sha} for name, (size, sha) in sorted(entries.items())}
    return json.dumps({"format": MANIFEST_FORMAT, "files": listed}, indent=1).encode()


def _corrupt(name: str, what: str) -> CheckpointCorrupt:
    return CheckpointCorrupt(f"checkpoint file {name} {what}; save the checkpoint again, or load another one", name)


def _json(blob: bytes, name: str) -> Any:
    try:
        return json.loads(blob)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _corrupt(name, f"is not JSON ({exc})") from None


def read_manifest(blob: bytes) -> dict[str, tuple[int, str]]:
    """``{file: (size, sha256)}`` from the bytes of :data:`MANIFEST_FILE`."""
    doc = _json(blob, MANIFEST_FILE)
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise _corrupt(MANIFEST_FILE, f"is not a manifest of format {MANIFEST_FORMAT} (a 'files' object)")
    out = {}
    for name, line in files.items():
        size = line.get("size") if isinstance(line, dict) else None
        sha = line.get("sha256") if isinstance(line, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str) \
                or len(sha) != 64:
            raise _corrupt(MANIFEST_FILE, f"lists {name!r} without a size and a sha256")
        out[name] = (size, sha)
    if METADATA_FILE not in out:
        raise _corrupt(MANIFEST_FILE, f"does not list {METADATA_FILE}")
    return out


def verify(name: str, blob: bytes, listed: dict[str, tuple[int, str]]) -> str:
    """Check ``blob`` (file ``name``) against the manifest ``listed``; returns its digest."""
    if name not in listed:
        raise _corrupt(name, f"is not listed in {MANIFEST_FILE} (a file from elsewhere)")
    size, sha = listed[name]
    if len(blob) != size:
        raise _corrupt(name, f"has {len(blob)} bytes, {MANIFEST_FILE} says {size} (truncated or appended to)")
    got = digest(blob)
    if got != sha:
        raise _corrupt(name, f"does not match its sha256 in {MANIFEST_FILE} (altered since it was saved)")
    return got


def metadata(blob: bytes) -> dict[str, Any]:
    """The checkpoint's description (:data:`METADATA_FILE`): format, store, user metadata."""
    info = _json(blob, METADATA_FILE)
    if not isinstance(info, dict):
        raise _corrupt(METADATA_FILE, f"holds a JSON {type(info).__name__}, not an object")
    if info.get("format") != FORMAT:
        raise _corrupt(METADATA_FILE, f"says format {info.get('format')!r}; this tq-redis loads format {FORMAT}")
    if not isinstance(info.get("backend"), str):
        raise _corrupt(METADATA_FILE, "names no store ('backend')")
    if not isinstance(info.get("user_metadata", {}), dict):
        raise _corrupt(METADATA_FILE, "has a 'user_metadata' that is not an object")
    return info


def _decode(blob: bytes, name: str) -> Any:
    try:
        return objects.decode_object(blob)
    except TQError as exc:  # truncated, garbage, or a pickled object: never run on load
        raise _corrupt(name, f"cannot be decoded ({exc})") from None


def _record_ok(rec: Any) -> str | None:
    """What is wrong with key record ``rec`` (``[suffix, type, value, ttl_ms]``), or None."""
    if not isinstance(rec, list) or len(rec) != 4:
        return "is not [key, type, value, ttl_ms]"
    suffix, kind, value, ttl = rec
    if not isinstance(suffix, str) or not suffix:
        return "has no key name"
    if suffix.startswith(_NOT_SAVED):
        return f"holds key {suffix!r}, which checkpoints never hold"
    if kind not in _KINDS:
        return f"gives key {suffix!r} the type {kind!r}"
    if not isinstance(value, _KINDS[kind]) or isinstance(value, bool):
        return f"gives {kind} key {suffix!r} a {type(value).__name__} value"
    if not isinstance(ttl, int) or isinstance(ttl, bool):
        return f"gives key {suffix!r} the TTL {ttl!r}"
    if kind == "zset" and not all(isinstance(e, list) and len(e) == 2 and isinstance(e[1], int | float)
                                  for e in value):
        return f"gives zset key {suffix!r} members that are not [member, score]"
    if kind == "stream" and not all(isinstance(e, list) and len(e) == 2 and isinstance(e[1], list)
                                    and len(e[1]) % 2 == 0 for e in value):
        return f"gives stream key {suffix!r} entries that are not [id, [field, value, ...]]"
    return None


def records(blob: bytes, name: str) -> list[list[Any]]:
    """The key records of a checkpoint's key file ``name``, each checked."""
    recs = _decode(blob, name)
    if not isinstance(recs, list):
        raise _corrupt(name, f"holds a {type(recs).__name__}, not a list of key records")
    for at, rec in enumerate(recs):
        wrong = _record_ok(rec)
        if wrong:
            raise _corrupt(name, f"record {at} {wrong}")
    return recs


def part(blob: bytes, name: str) -> dict[str, Any]:
    """A data file's ``{"partition", "columns": {field: {"ids", "values"}}}``, each part checked."""
    doc = _decode(blob, name)
    if not isinstance(doc, dict) or not isinstance(doc.get("columns"), dict):
        raise _corrupt(name, "is not {partition, columns}")
    try:
        names.internal_partition_id(doc.get("partition"))
        for field in doc["columns"]:
            names.key_part("field name", field)  # an appended field's hidden parts (f~k) too
    except InvalidName as exc:
        raise _corrupt(name, f"names a partition or field tq-redis never writes ({exc})") from None
    for field, column in doc["columns"].items():
        ids = column.get("ids") if isinstance(column, dict) else None
        values = column.get("values") if isinstance(column, dict) else None
        if not isinstance(ids, list) or not isinstance(values, list) or len(ids) != len(values):
            raise _corrupt(name, f"field {field!r} is not as many ids as values")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise _corrupt(name, f"field {field!r} has sample ids that are not integers >= 0")
        if not all(isinstance(v, bytes) for v in values):
            raise _corrupt(name, f"field {field!r} has values that are not bytes")
    return doc
