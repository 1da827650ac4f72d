"""A read-only snapshot of a namespace: what ``tq-redis status`` prints (and ``--json`` emits).

Everything comes from plain Redis reads (no Lua), two pipelined round trips per partition, so it
is safe to run against a live job as often as you like.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from tq_redis.meta.keys import PartitionKeys, kept_partitions_key, partitions_key, storage_nodes_key
from tq_redis.redact import public_registration
from tq_redis.units import format_size


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def partition_status(r: redis.Redis, ns: str, partition: str) -> dict[str, Any]:
    """Samples, per-field production and per-task consumption of one partition."""
    pk = PartitionKeys(ns, partition)
    meta, fields, tasks = r.pipeline(transaction=False).hgetall(pk.meta).hkeys(pk.fields).smembers(pk.tasks).execute()
    fields = sorted(_text(f) for f in fields)
    tasks = sorted(_text(t) for t in tasks)
    pipe = r.pipeline(transaction=False)
    pipe.bitcount(pk.alive)
    for f in fields:
        pipe.bitcount(pk.prod(f))
    for t in tasks:
        pipe.bitcount(pk.cons(t)).zcard(pk.lease(t)).scard(pk.poison(t))
    counts = pipe.execute()
    samples = counts[0]
    meta = {_text(k): _text(v) for k, v in meta.items()}
    out: dict[str, Any] = {
        "id": partition,
        "samples": samples,
        "sealed": meta.get("sealed") == "1",
        "created_ms": int(meta["created_ms"]) if "created_ms" in meta else None,
        "fields": {},
        "tasks": {},
    }
    for k, f in enumerate(fields):
        produced = counts[1 + k]
        out["fields"][f] = {"produced": produced, "pct": round(100.0 * produced / samples, 1) if samples else 0.0}
    base = 1 + len(fields)
    for k, t in enumerate(tasks):
        claimed, in_flight, poison = counts[base + 3 * k : base + 3 * k + 3]
        out["tasks"][t] = {
            "consumed": claimed - in_flight - poison,
            "in_flight": in_flight,
            "poison": poison,
            "pct": round(100.0 * (claimed - in_flight - poison) / samples, 1) if samples else 0.0,
        }
    return out


def storage_nodes(r: redis.Redis, ns: str) -> list[dict[str, Any]]:
    """Registered storage nodes with bytes used and heartbeat age."""
    now = time.time()
    nodes = []
    for node_id, raw in sorted(r.hgetall(storage_nodes_key(ns)).items()):
        info = public_registration(json.loads(raw))  # never its access key
        info["id"] = _text(node_id)
        if "heartbeat" in info:
            info["heartbeat_age_s"] = round(now - float(info["heartbeat"]), 1)
        nodes.append(info)
    return nodes


def pending_deletes(r: redis.Redis, ns: str) -> dict[str, int]:
    """Partition -> samples whose bytes still await deletion (a clear's delete failed or is in flight).

    Candidates come from the registries, not from a keyspace SCAN: the live partitions and
    ``partitions:kept`` (a cleared partition's trash outlives its place in the partition list).
    """
    candidates = {_text(p) for p in r.zrange(partitions_key(ns), 0, -1)}
    candidates |= {_text(p) for p in r.smembers(kept_partitions_key(ns))}
    ordered = sorted(candidates)
    pipe = r.pipeline(transaction=False)
    for partition in ordered:
        pipe.bitcount(PartitionKeys.internal(ns, partition).trash)
    counts = pipe.execute() if ordered else []
    return {p: int(n) for p, n in zip(ordered, counts, strict=True) if n}


def snapshot(r: redis.Redis, ns: str) -> dict[str, Any]:
    """The whole namespace: partitions (oldest first), storage nodes and pending deletes."""
    partitions = [_text(p) for p in r.zrange(partitions_key(ns), 0, -1)]
    return {
        "namespace": ns,
        "time": round(time.time(), 3),
        "partitions": [partition_status(r, ns, p) for p in partitions],
        "storage_nodes": storage_nodes(r, ns),
        "pending_deletes": pending_deletes(r, ns),
    }


def render(snap: dict[str, Any]) -> str:
    """Human-readable text of a snapshot."""
    lines = [f"namespace {snap['namespace']!r}: {len(snap['partitions'])} partition(s)"]
    for p in snap["partitions"]:
        sealed = ", sealed" if p["sealed"] else ""
        lines.append(f"  partition {p['id']!r}: {p['samples']} samples{sealed}")
        for f, s in p["fields"].items():
            lines.append(f"    field {f:<24} produced {s['produced']:>8} ({s['pct']:5.1f}%)")
        for t, s in p["tasks"].items():
            lines.append(
                f"    task  {t:<24} consumed {s['consumed']:>8} ({s['pct']:5.1f}%)  "
                f"in flight {s['in_flight']}  poison {s['poison']}"
            )
    nodes = snap["storage_nodes"]
    lines.append(f"storage nodes: {len(nodes)}")
    for n in nodes:
        used, cap = n.get("used", 0), n.get("capacity", 0)
        age = n.get("heartbeat_age_s")
        spilled = n.get("spilled_bytes") or 0
        lines.append(
            f"  {n['id']} {n.get('address', '?')}: {format_size(used)} / {format_size(cap)} used"
            + (f", {format_size(spilled)} spilled" if spilled else "")
            + (f", heartbeat {age:.1f}s ago" if age is not None else "")
        )
    for partition, count in snap.get("pending_deletes", {}).items():
        lines.append(
            f"partition {partition!r}: the bytes of {count} cleared sample(s) are not deleted yet "
            f"(a store was unreachable); clear_partition({partition!r}) deletes them"
        )
    return "\n".join(lines)
