"""Prometheus metrics of clients and storage nodes.

Recorded in three places, each once for the sync and async clients alike:

* the drivers time every Lua function call (``tq_redis_redis_call_seconds{fn=...}``, so
  ``fn="claim"`` is the claim latency) and every wait on an event stream
  (``tq_redis_wait_seconds``);
* the storage manager counts bytes and values moved per direction and store
  (``tq_redis_bytes_total``, ``tq_redis_values_total``) and times store calls;
* an exporter started by :func:`start_exporter` (``init({"metrics": {"enabled": True}})``) adds
  a scrape-time collector for queue depth: ready-but-unconsumed samples per partition and task,
  read from Redis (``tq_redis_queue_depth``), in-flight leases, and every storage node's used bytes,
  capacity and heartbeat age as the nodes registered them in Redis.

Metrics live in their own registry (:data:`REGISTRY`), so importing tq_redis never touches a
program's default registry.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

REDIS_CALL_SECONDS = Histogram(
    "tq_redis_redis_call_seconds", "Latency of tq-redis Lua function calls", ["fn"],
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
WAIT_SECONDS = Histogram(
    "tq_redis_wait_seconds", "Time get_meta spent blocked on a partition's event stream",
    buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 30, 120), registry=REGISTRY,
)
STORE_SECONDS = Histogram(
    "tq_redis_store_call_seconds", "Latency of data-plane store calls", ["op", "store"],
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
BYTES = Counter("tq_redis_bytes", "Payload bytes moved through the data plane", ["direction", "store"],
                registry=REGISTRY)
VALUES = Counter("tq_redis_values", "Values (sample x field) moved through the data plane", ["direction", "store"],
                 registry=REGISTRY)


class QueueDepthCollector:
    """Scrape-time gauges from Redis: ready-unconsumed samples and leases per partition and task."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        from tq_redis import connections

        self.namespace = namespace
        self._redis = connections.sync_client(redis_url, socket_timeout=2)

    def collect(self):
        from tq_redis.status import snapshot

        depth = GaugeMetricFamily("tq_redis_queue_depth", "Samples not yet consumed by a task",
                                  labels=["namespace", "partition", "task"])
        in_flight = GaugeMetricFamily("tq_redis_in_flight", "Leased samples not yet acked",
                                      labels=["namespace", "partition", "task"])
        samples = GaugeMetricFamily("tq_redis_partition_samples", "Live samples per partition",
                                    labels=["namespace", "partition"])
        try:
            snap = snapshot(self._redis, self.namespace)
        except Exception:  # a scrape must not crash the exporter; the gauges are simply absent
            snap = {"partitions": []}
        for p in snap["partitions"]:
            samples.add_metric([self.namespace, p["id"]], p["samples"])
            for task, s in p["tasks"].items():
                depth.add_metric([self.namespace, p["id"], task], p["samples"] - s["consumed"] - s["in_flight"])
                in_flight.add_metric([self.namespace, p["id"], task], s["in_flight"])
        used = GaugeMetricFamily("tq_redis_node_used_bytes", "Bytes held by a storage node", labels=["node"])
        capacity = GaugeMetricFamily("tq_redis_node_capacity_bytes", "Memory budget of a storage node",
                                     labels=["node"])
        age = GaugeMetricFamily("tq_redis_node_heartbeat_age_seconds", "Seconds since a node's last heartbeat",
                                labels=["node"])
        for node in snap.get("storage_nodes", []):
            used.add_metric([node["id"]], float(node.get("used", 0)))
            capacity.add_metric([node["id"]], float(node.get("capacity", 0)))
            if "heartbeat_age_s" in node:
                age.add_metric([node["id"]], node["heartbeat_age_s"])
        yield samples
        yield depth
        yield in_flight
        yield used
        yield capacity
        yield age


_exporter_lock = threading.Lock()
_exporter: dict[str, Any] = {}


def start_exporter(port: int = 0, addr: str = "127.0.0.1", redis_url: str | None = None,
                   namespace: str | None = None) -> str:
    """Serve ``/metrics`` over HTTP (port 0: a free one); returns the endpoint URL. Idempotent."""
    with _exporter_lock:
        if "endpoint" in _exporter:
            return _exporter["endpoint"]
        if redis_url and namespace:
            collector = QueueDepthCollector(redis_url, namespace)
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
        _exporter.clear()


def endpoint() -> str | None:
    """The exporter's URL, or None when it is not running."""
    return _exporter.get("endpoint")
