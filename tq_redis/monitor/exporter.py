"""The Prometheus exporter: the instruments of :mod:`tq_redis.instruments` served over HTTP.

The drivers and the storage manager record into those instruments (call and wait latencies, bytes
and values moved) in every process. An exporter started by :func:`start_exporter`
(``init({"metrics": {"enabled": True}})``) serves them and adds
  a scrape-time collector for queue depth: ready-but-unconsumed samples per partition and task,
  read from Redis (``tq_redis_queue_depth``), in-flight leases, and every storage node's used bytes,
  capacity and heartbeat age as the nodes registered them in Redis; and the counters of lease
  expiries, redeliveries and poisoned samples the claim scripts keep in Redis (``..._total``).

Metrics live in their own registry (:data:`REGISTRY`), so importing tq_redis never touches a
program's default registry.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tq_redis.instruments import REGISTRY

_TASK = ["namespace", "partition", "task"]
_PARTITION = ["namespace", "partition"]

# name -> (help, labels, how a task's / partition's status gives the value); every one a gauge read
# from Redis at scrape time, so every process (and the standalone exporter) reports the same numbers
TASK_GAUGES: dict[str, tuple[str, Any]] = {
    "tq_redis_queue_depth": ("Samples the task can claim now (produced, not claimed, not leased)",
                             lambda s, p: s["claimable"]),
    "tq_redis_unclaimed": ("Alive samples the task has not claimed, produced or not", lambda s, p: s["unclaimed"]),
    "tq_redis_consumed": ("Samples the task consumed for good (claimed, not in flight, not poison)",
                          lambda s, p: s["consumed"]),
    "tq_redis_consumed_ratio": ("Consumed samples over the partition's samples (0..1)",
                                lambda s, p: s["consumed"] / p["samples"] if p["samples"] else 0.0),
    "tq_redis_in_flight": ("Leased samples not yet acked", lambda s, p: s["in_flight"]),
    "tq_redis_leases_lapsed": ("Leases past their deadline, handed back by the task's next claim",
                               lambda s, p: s["lapsed"]),
    "tq_redis_redelivered_samples": ("Samples delivered more than once (a lapsed or nacked lease)",
                                     lambda s, p: s["redelivered"]),
    "tq_redis_poison": ("Samples put aside after max_deliveries", lambda s, p: s["poison"]),
    "tq_redis_waiters": ("Consumers blocked in get_meta on the task", lambda s, p: s["waiters"]),
}
# counter name (exposed with ``_total``) -> (help, the status name of the count in ``<p>:counters``);
# kept by the claim scripts as the events happen, never reset: a cleared or dropped partition keeps its series
TASK_COUNTERS: dict[str, tuple[str, str]] = {
    "tq_redis_lease_expiries": ("Leases that lapsed and were taken back by a claim", "lease_expiries"),
    "tq_redis_redeliveries": ("Deliveries of a sample the task had been handed before (after a lapsed or "
                              "nacked lease)", "redeliveries"),
    "tq_redis_poisoned": ("Samples put aside for the task (max_deliveries reached, or too stale)", "poisoned"),
}
PARTITION_GAUGES: dict[str, tuple[str, Any]] = {
    "tq_redis_partition_samples": ("Live samples per partition", lambda p: p["samples"]),
    "tq_redis_partition_age_seconds": ("Seconds since the partition was created", lambda p: p["age_s"]),
    "tq_redis_inline_values": ("Values kept inline in Redis", lambda p: p["inline"]["values"]),
    "tq_redis_inline_bytes": ("Bytes Redis spends on the partition's inline values", lambda p: p["inline"]["bytes"]),
    "tq_redis_producers_waiting": ("Producers held back by a rate limiter or the staleness bound",
                                   lambda p: p.get("producers_waiting", 0)),
}
# gauge name -> (help, value of a task's rate limiter in the snapshot); see set_rate_limit
RATE_LIMIT_GAUGES: dict[str, tuple[str, Any]] = {
    "tq_redis_rate_limit_balance": ("inserts * samples_per_insert - samples of a task's rate limiter",
                                    lambda lim: lim["balance"]),
    "tq_redis_rate_limit_min_balance": ("The lowest balance the rate limiter lets the task's claims reach",
                                        lambda lim: lim["window"][0]),
    "tq_redis_rate_limit_max_balance": ("The highest balance the rate limiter lets inserts reach",
                                        lambda lim: lim["window"][1]),
    "tq_redis_rate_limit_inserts": ("Inserts the rate limiter counted", lambda lim: lim["inserts"]),
    "tq_redis_rate_limit_samples": ("Samples handed to the task that the rate limiter counted",
                                    lambda lim: lim["samples"]),
}


def _event_counters(ns: str, snap: dict[str, Any]) -> list[CounterMetricFamily]:
    """The ``..._total`` counters of every partition that counted an event (dropped ones too) and
    of every task of a listed partition (0 until it counts one, so ``rate()`` sees it start)."""
    counts = {(p, t): c for p, tasks in snap["counters"]["partitions"].items() for t, c in tasks.items()}
    for p in snap["partitions"]:
        for task, s in p["tasks"].items():
            counts.setdefault((p["id"], task), s)
    families = []
    for name, (help_text, key) in TASK_COUNTERS.items():
        family = CounterMetricFamily(name, help_text, labels=_TASK)
        for (partition, task), c in sorted(counts.items()):
            family.add_metric([ns, partition, task], float(c.get(key, 0)))
        families.append(family)
    return families


class NamespaceCollector:
    """Scrape-time gauges of one namespace, from one :func:`~tq_redis.monitor.status.snapshot` per scrape:
    per task claimable (``tq_redis_queue_depth``), consumed, in flight, lapsed, redelivered, poison
    and waiters, and the counters of lease expiries, redeliveries and poisoned samples (every
    partition that counted one, cleared ones included); per field production; per partition samples,
    age, inline bytes and producers held back; per task rate limiter its balance, window and counts; per storage
    node used bytes, capacity, spilled bytes and heartbeat age; the server's memory."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        from tq_redis.server import connections

        self.namespace = namespace
        self._redis = connections.sync_client(redis_url, socket_timeout=5)
        self.last_error: str | None = None

    def close(self) -> None:
        self._redis.close()

    def collect(self):
        from tq_redis.monitor.status import snapshot

        ns = self.namespace
        up = GaugeMetricFamily("tq_redis_namespace_up", "1 when the last scrape read the namespace from Redis",
                               labels=["namespace"])
        try:
            snap = snapshot(self._redis, ns)
            self.last_error = None
        except Exception as exc:  # a scrape must not crash the exporter: tq_redis_namespace_up says it failed
            self.last_error = f"{type(exc).__name__}: {exc}"
            up.add_metric([ns], 0)
            yield up
            return
        up.add_metric([ns], 1)
        yield up
        task_families = {n: GaugeMetricFamily(n, h, labels=_TASK) for n, (h, _) in TASK_GAUGES.items()}
        part_families = {n: GaugeMetricFamily(n, h, labels=_PARTITION) for n, (h, _) in PARTITION_GAUGES.items()}
        limit_families = {n: GaugeMetricFamily(n, h, labels=_TASK) for n, (h, _) in RATE_LIMIT_GAUGES.items()}
        produced = GaugeMetricFamily("tq_redis_field_produced", "Samples with the field produced",
                                     labels=[*_PARTITION, "field"])
        produced_ratio = GaugeMetricFamily("tq_redis_field_produced_ratio",
                                           "Samples with the field produced over the partition's samples (0..1)",
                                           labels=[*_PARTITION, "field"])
        for p in snap["partitions"]:
            for name, (_, value) in PARTITION_GAUGES.items():
                v = value(p)
                if v is not None:
                    part_families[name].add_metric([ns, p["id"]], float(v))
            for f, s in p["fields"].items():
                produced.add_metric([ns, p["id"], f], s["produced"])
                produced_ratio.add_metric([ns, p["id"], f], s["produced"] / p["samples"] if p["samples"] else 0.0)
            for task, s in p["tasks"].items():
                for name, (_, value) in TASK_GAUGES.items():
                    task_families[name].add_metric([ns, p["id"], task], float(value(s, p)))
            for task, lim in p.get("rate_limits", {}).items():
                for name, (_, value) in RATE_LIMIT_GAUGES.items():
                    limit_families[name].add_metric([ns, p["id"], task], float(value(lim)))
        yield from _event_counters(ns, snap)
        yield from part_families.values()
        yield produced
        yield produced_ratio
        yield from task_families.values()
        yield from limit_families.values()
        node = ["namespace", "node"]
        used = GaugeMetricFamily("tq_redis_node_used_bytes", "Bytes held by a storage node", labels=node)
        capacity = GaugeMetricFamily("tq_redis_node_capacity_bytes", "Memory budget of a storage node", labels=node)
        spilled = GaugeMetricFamily("tq_redis_node_spilled_bytes", "Bytes a storage node spilled", labels=node)
        age = GaugeMetricFamily("tq_redis_node_heartbeat_age_seconds", "Seconds since a node's last heartbeat",
                                labels=node)
        for n in snap.get("storage_nodes", []):
            used.add_metric([ns, n["id"]], float(n.get("used", 0)))
            capacity.add_metric([ns, n["id"]], float(n.get("capacity", 0)))
            spilled.add_metric([ns, n["id"]], float(n.get("spilled_bytes") or 0))
            if "heartbeat_age_s" in n:
                age.add_metric([ns, n["id"]], n["heartbeat_age_s"])
        yield from (used, capacity, spilled, age)
        rep = snap.get("replica_repair")
        if rep is not None:
            for name, help_text, value in (
                ("tq_redis_under_replicated_values", "Values of the current DRAM repair not re-made yet",
                 rep["under_replicated"]),
                ("tq_redis_replica_repair_values_done", "Values the current DRAM repair re-made", rep["values_done"]),
                ("tq_redis_replica_repair_values_total", "Values the current DRAM repair re-makes",
                 rep["values_total"]),
                ("tq_redis_replica_repaired_values", "Values DRAM repairs re-made since the namespace began",
                 rep["repaired"]),
                ("tq_redis_replica_repair_waiting", "1 while a DRAM repair waits for enough live nodes",
                 1 if rep.get("waiting") else 0),
            ):  # fmt: skip
                gauge = GaugeMetricFamily(name, help_text, labels=["namespace"])
                gauge.add_metric([ns], float(value))
                yield gauge
        server = snap["server"]
        if server.get("refused"):  # INFO not allowed: no server gauges rather than made-up ones
            return
        memory = GaugeMetricFamily("tq_redis_server_used_memory_bytes", "Memory the Redis server uses "
                                   "(summed over a cluster's primaries)", labels=["namespace"])
        memory.add_metric([ns], float(server["used_memory"]))
        limit = GaugeMetricFamily("tq_redis_server_maxmemory_bytes", "The server's maxmemory (0: no limit)",
                                  labels=["namespace"])
        limit.add_metric([ns], float(server["maxmemory"]))
        yield from (memory, limit)


_exporter_lock = threading.Lock()
_exporter: dict[str, Any] = {}


def start_exporter(port: int = 0, addr: str = "127.0.0.1", redis_url: str | None = None,
                   namespace: str | None = None) -> str:
    """Serve ``/metrics`` over HTTP (port 0: a free one); returns the endpoint URL. Idempotent."""
    with _exporter_lock:
        if "endpoint" in _exporter:
            return _exporter["endpoint"]
        if redis_url and namespace:
            collector = NamespaceCollector(redis_url, namespace)
            REGISTRY.register(collector)
            _exporter["collector"] = collector
        server, thread = start_http_server(port, addr=addr, registry=REGISTRY)
        _exporter.update(server=server, thread=thread,
                         endpoint=f"http://{addr}:{server.server_address[1]}/metrics")
        return _exporter["endpoint"]


def stop_exporter() -> None:
    """Stop the exporter started by :func:`start_exporter` (if any)."""
    with _exporter_lock:
        if "server" in _exporter:
            _exporter["server"].shutdown()
            _exporter["server"].server_close()
        if "collector" in _exporter:
            REGISTRY.unregister(_exporter["collector"])
            _exporter["collector"].close()
        _exporter.clear()


def endpoint() -> str | None:
    """The exporter's URL, or None when it is not running."""
    return _exporter.get("endpoint")


def serve_namespace(redis_url: str, namespace: str, port: int = 0, addr: str = "127.0.0.1"):
    """The standalone exporter (``tq-redis exporter``): ``/metrics`` of one namespace, read from
    Redis once per scrape, in a registry of its own (no per-process instruments: a rank's own
    latencies are its exporter's). Returns ``(server, url, collector)``; ``server.shutdown()`` stops it."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    collector = NamespaceCollector(redis_url, namespace)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, f"http://{addr}:{server.server_address[1]}/metrics", collector
