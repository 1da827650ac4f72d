"""A read-only snapshot of a namespace: what ``tq-redis status`` prints (and ``--json`` emits).

Everything comes from plain Redis reads (no Lua, no scratch keys): per partition one pipelined
round trip for its registries and one for its bitmaps and lease, waiter and delivery records,
plus the server's ``INFO`` and clock once. It is safe to run against a live job as often as you
like; a partition's numbers are read in one pipeline, not in one atomic step.

What each task number means (the rules of the claim scripts, ``lua/includes/ready.lua``):

* ``claimable``: alive samples with every needed field produced that the task has not claimed
  (a claim sets the consumed bit, lease or not). The needed fields are what the task's waiting
  consumers stated (``waitneed``) when they stated one, else every field of the partition
  (``claimable_fields`` says which);
* ``unclaimed``: alive samples the task has not claimed, whatever their fields;
* ``in_flight``, ``lapsed``: leases held, and those past their deadline on the server's clock
  (the task's next claim hands them back); ``next_deadline_s``: seconds until the earliest lease
  lapses (negative: lapsed that long ago);
* ``redelivered``: samples delivered more than once (a lapsed or nacked lease), ``poison``:
  samples put aside after ``max_deliveries``;
* ``waiters``: consumers blocked in ``get_meta`` on the task, ``waiting_for``: their common need
  (``{"batch": n, "fields": [...]}``) or ``"any"`` when they differ or did not say;
* ``lease_expiries``, ``redeliveries``, ``poisoned``: event counters the claim scripts keep in
  ``<p>:counters`` as the events happen (a lapsed lease taken back, a sample delivered again, a
  sample put aside). They only grow: clears, drops and resets leave them. The snapshot's
  ``counters`` has them for every partition that ever counted one (dropped ones included, found
  through ``partitions:kept``) and their sums per namespace.

A partition's ``rate_limits`` (``set_rate_limit``) give each limited task's ratio, minimum size
and error buffer, and the counts the scripts keep: ``inserts``, ``samples`` handed to the task,
and ``balance`` (``inserts * samples_per_insert - samples``, kept within ``window``);
``producers_waiting`` counts the producers held back (by a rate limiter or the staleness bound).
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from tq_redis.meta.keys import (
    PartitionKeys,
    kept_partitions_key,
    partitions_key,
    storage_nodes_key,
    storage_repair_key,
)
from tq_redis.redact import public_registration
from tq_redis.units import format_size


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bits(raw: bytes | None, width: int) -> int:
    """A Redis bitmap as an int whose bit ``width*8 - 1 - i`` is sample ``i`` (padded to ``width`` bytes)."""
    raw = raw or b""
    return int.from_bytes(raw.ljust(width, b"\0"), "big")


def server_ms(r: Any) -> int:
    """The server's clock in ms (lease deadlines are on it, never on a client's)."""
    reply = r.time()
    if isinstance(reply, dict):  # a cluster answers per node: any one will do
        reply = next(iter(reply.values()))
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) // 1000


def _waiting_for(need: Any) -> Any:
    if need is None:
        return None
    need = _text(need)
    if need == "*":
        return "any"
    batch, *fields = need.split("\t")
    return {"batch": int(batch), "fields": fields}


def _task_reads(pipe: Any, pk: PartitionKeys, task: str, now_ms: int) -> None:
    """Queue the reads of one task's records (see :func:`_task_status` for their order)."""
    pipe.get(pk.cons(task))
    pipe.zcard(pk.lease(task))
    pipe.zcount(pk.lease(task), "-inf", now_ms)
    pipe.zrange(pk.lease(task), 0, 0, withscores=True)
    pipe.hvals(pk.deliveries(task))
    pipe.scard(pk.poison(task))
    pipe.zcount(pk.waiters(task), f"({now_ms}", "+inf")
    pipe.get(pk.waitneed(task))


_TASK_READS = 8


def _task_status(replies: list[Any], alive: int, prods: dict[str, int], every_field: list[str], width: int,
                 samples: int, now_ms: int) -> dict[str, Any]:
    cons_raw, in_flight, lapsed, earliest, deliveries, poison, waiters, need = replies
    cons = _bits(cons_raw, width)
    claimed = (alive & cons).bit_count()
    waiting_for = _waiting_for(need) if waiters else None
    fields = waiting_for["fields"] if isinstance(waiting_for, dict) else every_field
    ready = alive
    for f in fields:
        ready &= prods.get(f, 0)  # a field not registered yet: nothing is ready with it
    consumed = claimed - in_flight - poison
    counts = [int(c) for c in deliveries]
    return {
        "consumed": consumed,
        "in_flight": in_flight,
        "poison": poison,
        "pct": round(100.0 * consumed / samples, 1) if samples else 0.0,
        "claimable": (ready & ~cons).bit_count(),
        "claimable_fields": fields,
        "unclaimed": (alive & ~cons).bit_count(),
        "lapsed": lapsed,
        "next_deadline_s": round((earliest[0][1] - now_ms) / 1000.0, 1) if earliest else None,
        "redelivered": sum(1 for c in counts if c > 1),
        "max_delivery": max(counts, default=0),
        "waiters": waiters,
        "waiting_for": waiting_for,
    }


#: the fields of ``<p>:counters`` (``<kind>:<task>``, kept by ``lua/includes/leases.lua``) -> status names
COUNTER_KINDS = {"expired": "lease_expiries", "redelivered": "redeliveries", "poison": "poisoned"}


def _no_events() -> dict[str, int]:
    return dict.fromkeys(COUNTER_KINDS.values(), 0)


def event_counts(r: Any, ns: str, partitions: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    """Partition -> task -> ``{"lease_expiries", "redeliveries", "poisoned"}`` from each partition's
    ``counters`` hash, in one pipelined round trip; partitions and tasks that never counted one are left out."""
    pipe = r.pipeline(transaction=False)
    for partition in partitions:
        pipe.hgetall(PartitionKeys.internal(ns, partition).counters)
    out: dict[str, dict[str, dict[str, int]]] = {}
    for partition, raw in zip(partitions, pipe.execute() if partitions else [], strict=True):
        for field, value in raw.items():
            kind, _, task = _text(field).partition(":")
            if kind in COUNTER_KINDS:
                tasks = out.setdefault(partition, {})
                tasks.setdefault(task, _no_events())[COUNTER_KINDS[kind]] += int(value)
    return out


def counters(r: Any, ns: str, listed: list[str]) -> dict[str, Any]:
    """The namespace's event counters: per partition and task (the ``listed`` partitions and those
    kept after a clear) and their ``total``."""
    kept = sorted(_text(p) for p in r.smembers(kept_partitions_key(ns)))
    per = event_counts(r, ns, list(dict.fromkeys(listed + kept)))
    total = _no_events()
    for tasks in per.values():
        for counts in tasks.values():
            for name, n in counts.items():
                total[name] += n
    return {"total": total, "partitions": per}


def partition_status(r: redis.Redis, ns: str, partition: str, now_ms: int | None = None) -> dict[str, Any]:
    """Samples, per-field production, per-task claims, leases and waiters, inline bytes of one partition."""
    now_ms = server_ms(r) if now_ms is None else now_ms
    pk = PartitionKeys(ns, partition)
    meta, fields, tasks, waittasks = (
        r.pipeline(transaction=False).hgetall(pk.meta).hkeys(pk.fields).smembers(pk.tasks)
        .smembers(pk.waittasks).execute()
    )
    fields = sorted(_text(f) for f in fields)
    # a consumer may wait on a task before it ever claimed in this partition
    tasks = sorted({_text(t) for t in tasks} | {_text(t) for t in waittasks})
    pipe = r.pipeline(transaction=False)
    pipe.get(pk.alive)
    for f in fields:
        pipe.get(pk.prod(f))
    for t in tasks:
        _task_reads(pipe, pk, t, now_ms)
    pipe.hlen(pk.inline)
    pipe.memory_usage(pk.inline, samples=0)
    pipe.hgetall(pk.ratelimit)
    pipe.zcard(pk.admitwaiters)
    replies = pipe.execute(raise_on_error=False)
    inline_values, inline_bytes, limits, producers_waiting = replies[-4:]
    bitmaps = [b or b"" for b in replies[: 1 + len(fields)]]
    width = max((len(b) for b in bitmaps), default=0)
    alive = _bits(bitmaps[0], width)
    prods = {f: _bits(bitmaps[1 + k], width) for k, f in enumerate(fields)}
    samples = alive.bit_count()
    meta = {_text(k): _text(v) for k, v in meta.items()}
    created_ms = int(meta["created_ms"]) if "created_ms" in meta else None
    out: dict[str, Any] = {
        "id": partition,
        "samples": samples,
        "sealed": meta.get("sealed") == "1",
        "created_ms": created_ms,
        "age_s": round((now_ms - created_ms) / 1000.0, 1) if created_ms is not None else None,
        "fields": {},
        "tasks": {},
        "inline": {
            "values": inline_values if isinstance(inline_values, int) else 0,
            # MEMORY USAGE: what the inline hash costs Redis, overhead included (None: not answered)
            "bytes": inline_bytes if isinstance(inline_bytes, int) else (0 if inline_values == 0 else None),
        },
        "rate_limits": rate_limits(limits if isinstance(limits, dict) else {}),
        "producers_waiting": producers_waiting if isinstance(producers_waiting, int) else 0,
    }
    for f in fields:
        produced = (alive & prods[f]).bit_count()
        out["fields"][f] = {"produced": produced, "pct": round(100.0 * produced / samples, 1) if samples else 0.0}
    base = 1 + len(fields)
    for k, t in enumerate(tasks):
        part = replies[base + _TASK_READS * k: base + _TASK_READS * (k + 1)]
        for reply in part:
            if isinstance(reply, Exception):
                raise reply
        out["tasks"][t] = _task_status(part, alive, prods, fields, width, samples, now_ms)
    return out


def rate_limits(raw: dict[Any, Any]) -> dict[str, dict[str, Any]]:
    """Task -> its rate limiter and counts, from the ``<p>:ratelimit`` hash (``lua/includes/ratelimit.lua``)."""
    h = {_text(k): _text(v) for k, v in raw.items()}
    inserts = int(h.get("inserts", 0))
    out: dict[str, dict[str, Any]] = {}
    for field, cfg in sorted(h.items()):
        if not field.startswith("cfg:"):
            continue
        task = field[4:]
        ratio, min_size, buffer, _timeout = cfg.split("\t")
        r, m, e = float(ratio), int(min_size), float(buffer)
        samples = int(h.get(f"sampled:{task}", 0))
        out[task] = {
            "samples_per_insert": r, "min_size_to_sample": m, "error_buffer": e, "inserts": inserts,
            "samples": samples, "balance": inserts * r - samples, "window": [r * m - e, r * m + e],
        }  # fmt: skip
    return out


def rate_limit_lines(p: dict[str, Any]) -> list[str]:
    """One line per rate limiter of a partition's status."""
    lines = []
    for t, lim in p.get("rate_limits", {}).items():
        low, high = lim["window"]
        lines.append(
            f"    rate limit {t}: {lim['samples_per_insert']:g} samples per insert from {lim['min_size_to_sample']} "
            f"inserts: {lim['inserts']} inserts, {lim['samples']} samples, balance {lim['balance']:g} "
            f"(kept in [{low:g}, {high:g}]); producers waiting {p.get('producers_waiting', 0)}"
        )
    return lines


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


def _info_of(r: Any, section: str) -> list[dict[str, Any]]:
    """``INFO section`` of every primary (one on a single server)."""
    from redis.cluster import RedisCluster

    if isinstance(r, RedisCluster):
        replies = r.info(section, target_nodes=RedisCluster.PRIMARIES)
        if any(not isinstance(v, dict) for v in replies.values()):  # one primary: its reply as it is
            return [replies]
        return [replies[k] for k in sorted(replies)]
    return [r.info(section)]


def server_status(r: Any) -> dict[str, Any]:
    """Version, memory used and its limit, and eviction policy of the server (every primary of a cluster).

    A server that refuses ``INFO`` (a namespace's ACL user may not run it; fakeredis lacks it) gives
    ``None`` for each figure and the refusal in ``"refused"``: the rest of the snapshot still comes.
    """
    try:
        servers = _info_of(r, "server")
        memories = _info_of(r, "memory")
    except redis.ResponseError as exc:
        return {"product": None, "version": None, "primaries": None, "used_memory": None, "maxmemory": None,
                "maxmemory_policy": None, "refused": str(exc)}
    first = servers[0] if servers else {}
    version = first.get("valkey_version") or first.get("redis_version")
    product = "valkey" if "valkey_version" in first or first.get("server_name") == "valkey" else "redis"
    used = sum(int(m.get("used_memory", 0)) for m in memories)
    maxmemory = [int(m.get("maxmemory", 0)) for m in memories]
    policies = sorted({str(m.get("maxmemory_policy", "?")) for m in memories})
    return {
        "product": product,
        "version": str(version) if version is not None else None,
        "primaries": len(memories),
        "used_memory": used,
        "maxmemory": 0 if 0 in maxmemory else sum(maxmemory),  # 0: no limit on some primary
        "maxmemory_policy": ",".join(policies),
    }


def where_bytes_live(snap: dict[str, Any]) -> dict[str, Any]:
    """Bytes inline in Redis (all partitions), on each storage node, and spilled by the nodes."""
    inline = [p["inline"]["bytes"] for p in snap["partitions"]]
    return {
        "inline": None if None in inline else sum(inline),  # None: MEMORY USAGE not allowed
        "inline_values": sum(p["inline"]["values"] for p in snap["partitions"]),
        "nodes": {n["id"]: int(n.get("used", 0)) for n in snap["storage_nodes"]},
        "spilled": sum(int(n.get("spilled_bytes") or 0) for n in snap["storage_nodes"]),
    }


def replica_repair(r: redis.Redis, ns: str) -> dict[str, Any] | None:
    """The DRAM replica repair's state (``storage.replicas`` > 1; None before any repair pass):
    ``state`` (idle / copying / waiting), the ``dead`` node and ``ring`` of the last or current
    repair, ``values_total`` / ``values_done`` / ``bytes_done`` of it, ``under_replicated`` (values
    of it not re-made yet), ``repaired`` (values re-made since the namespace began), ``waiting``
    (why a repair cannot run now)."""
    raw = {_text(k): _text(v) for k, v in r.hgetall(storage_repair_key(ns)).items()}
    if not raw:
        return None
    out: dict[str, Any] = {"state": raw.get("state", "idle")}
    for name in ("dead", "ring", "waiting"):
        if name in raw:
            out[name] = raw[name]
    for name in ("values_total", "values_done", "bytes_done", "repaired"):
        try:
            out[name] = int(raw.get(name, 0))
        except ValueError:
            out[name] = 0
    out["under_replicated"] = out["values_total"] - out["values_done"] if out["state"] == "copying" else 0
    return out


def replica_repair_text(rep: dict[str, Any]) -> str:
    """One line saying what the replica repair does (for ``status``)."""
    line = f"replica repair: {rep['state']}, {rep['repaired']} value(s) re-made in all"
    if rep["state"] == "copying":
        line += (f"; re-making the copies of dead node {rep.get('dead')!r}: {rep['values_done']} of "
                 f"{rep['values_total']} ({format_size(rep['bytes_done'])}), "
                 f"{rep['under_replicated']} under-replicated")
    if rep.get("waiting"):
        line += f"; waiting to repair {rep.get('dead')!r}: {rep['waiting']}"
    return line


def snapshot(r: redis.Redis, ns: str) -> dict[str, Any]:
    """The whole namespace: server, partitions (oldest first), storage nodes, bytes and pending deletes."""
    now_ms = server_ms(r)
    partitions = [_text(p) for p in r.zrange(partitions_key(ns), 0, -1)]
    snap = {
        "namespace": ns,
        "time": round(time.time(), 3),
        "server_time_ms": now_ms,
        "server": server_status(r),
        "partitions": [partition_status(r, ns, p, now_ms) for p in partitions],
        "storage_nodes": storage_nodes(r, ns),
        "pending_deletes": pending_deletes(r, ns),
        "replica_repair": replica_repair(r, ns),
        "counters": counters(r, ns, partitions),
    }
    for p in snap["partitions"]:
        counted = snap["counters"]["partitions"].get(p["id"], {})
        for task, s in p["tasks"].items():
            s.update(counted.get(task) or _no_events())
    snap["bytes"] = where_bytes_live(snap)
    return snap


def rates(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """Per second between two snapshots: samples put per partition, produced per field, consumed per task."""
    if not before:
        return {}
    seconds = (after["server_time_ms"] - before["server_time_ms"]) / 1000.0
    if seconds <= 0:
        return {}
    old = {p["id"]: p for p in before["partitions"]}
    out: dict[str, Any] = {}
    for p in after["partitions"]:
        prev = old.get(p["id"])
        if prev is None:
            continue
        out[p["id"]] = {
            "samples": round((p["samples"] - prev["samples"]) / seconds, 1),
            "fields": {f: round((s["produced"] - prev["fields"].get(f, {}).get("produced", 0)) / seconds, 1)
                       for f, s in p["fields"].items()},
            "tasks": {t: round((s["consumed"] + s["in_flight"]
                                - prev["tasks"].get(t, {}).get("consumed", 0)
                                - prev["tasks"].get(t, {}).get("in_flight", 0)) / seconds, 1)
                      for t, s in p["tasks"].items()},
        }
    return out


def age_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = float(seconds)
    if abs(seconds) < 120:
        return f"{seconds:.1f}s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _size_or_unknown(nbytes: int | None) -> str:
    """A size, or ``?`` where Redis did not answer ``MEMORY USAGE`` (a user not allowed it)."""
    return "?" if nbytes is None else format_size(nbytes)


def _rate(per_s: float | None) -> str:
    return f" {per_s:+.1f}/s" if per_s is not None else ""


def server_line(snap: dict[str, Any]) -> str:
    s = snap["server"]
    if s.get("refused"):
        return f"server: INFO refused ({s['refused']}); version, memory and eviction policy unknown"
    limit = format_size(s["maxmemory"]) if s["maxmemory"] else "no limit"
    where = f", {s['primaries']} primaries" if s["primaries"] > 1 else ""
    return (f"server {s['product']} {s['version']}{where}: memory {format_size(s['used_memory'])} used of "
            f"{limit}, eviction policy {s['maxmemory_policy']}")


def waiting_text(s: dict[str, Any]) -> str:
    if not s["waiters"]:
        return "waiters 0"
    need = s["waiting_for"]
    what = f"batch {need['batch']} of {','.join(need['fields']) or '(no fields)'}" if isinstance(need, dict) \
        else "any change"
    return f"waiters {s['waiters']} (for {what})"


def node_label(n: dict[str, Any]) -> str:
    """A storage node as the views name it: its id, and its address only where it differs (a node
    started without ``--node-id`` is named by its address)."""
    address = n.get("address")
    return n["id"] if address in (None, "", n["id"]) else f"{n['id']} at {address}"


def lease_text(s: dict[str, Any]) -> str:
    if not s["in_flight"]:
        return "leases 0"
    deadline = s["next_deadline_s"]
    if deadline is not None and deadline <= 0:
        when = f"lapsed {age_text(-deadline)} ago"
    else:
        when = f"next lapses in {age_text(deadline)}"
    return f"leases {s['in_flight']} ({s['lapsed']} lapsed, {when})"


def events_text(counts: dict[str, Any]) -> str:
    """The event counters of a task (or their namespace totals) in words."""
    return (f"lease expiries {counts.get('lease_expiries', 0)}, redeliveries {counts.get('redeliveries', 0)}, "
            f"poisoned {counts.get('poisoned', 0)}")


def counters_line(snap: dict[str, Any]) -> str:
    return f"events counted (they never go down; cleared partitions included): {events_text(snap['counters']['total'])}"


def render(snap: dict[str, Any], rate: dict[str, Any] | None = None) -> str:
    """Human-readable text of a snapshot (``rate``: :func:`rates` since the previous one, for ``--watch``)."""
    rate = rate or {}
    lines = [f"namespace {snap['namespace']!r}: {len(snap['partitions'])} partition(s)", server_line(snap)]
    if "counters" in snap:
        lines.append(counters_line(snap))
    for p in snap["partitions"]:
        r = rate.get(p["id"], {})
        sealed = ", sealed" if p["sealed"] else ""
        inline = p["inline"]
        lines.append(
            f"  partition {p['id']!r}: {p['samples']} samples{_rate(r.get('samples'))}{sealed}, "
            f"age {age_text(p['age_s'])}"
            f", inline {inline['values']} values ({_size_or_unknown(inline['bytes'])})"
        )
        for f, s in p["fields"].items():
            lines.append(f"    field {f:<20} produced {s['produced']:>8} ({s['pct']:5.1f}%)"
                         f"{_rate(r.get('fields', {}).get(f))}")
        for t, s in p["tasks"].items():
            lines.append(
                f"    task  {t:<20} claimable {s['claimable']:>6}  consumed {s['consumed']:>8} ({s['pct']:5.1f}%)"
                f"{_rate(r.get('tasks', {}).get(t))}  {lease_text(s)}  redelivered {s['redelivered']}  "
                f"poison {s['poison']}  {waiting_text(s)}  counted: {events_text(s)}"
            )
        lines += rate_limit_lines(p)
    nodes = snap["storage_nodes"]
    b = snap["bytes"]
    lines.append(f"bytes: {_size_or_unknown(b['inline'])} inline in Redis ({b['inline_values']} values), "
                 f"{format_size(sum(b['nodes'].values()))} on {len(nodes)} storage node(s), "
                 f"{format_size(b['spilled'])} spilled")
    lines.append(f"storage nodes: {len(nodes)}")
    for n in nodes:
        used, cap = n.get("used", 0), n.get("capacity", 0)
        age = n.get("heartbeat_age_s")
        spilled = n.get("spilled_bytes") or 0
        lines.append(
            f"  node {node_label(n)}: {format_size(used)} / {format_size(cap)} used"
            + (f", {format_size(spilled)} spilled" if spilled else "")
            + (f", heartbeat {age:.1f}s ago" if age is not None else "")
        )
    if snap.get("replica_repair"):
        lines.append(replica_repair_text(snap["replica_repair"]))
    for partition, count in snap.get("pending_deletes", {}).items():
        lines.append(
            f"partition {partition!r}: the bytes of {count} cleared sample(s) are not deleted yet "
            f"(a store was unreachable); clear_partition({partition!r}) deletes them"
        )
    return "\n".join(lines)
