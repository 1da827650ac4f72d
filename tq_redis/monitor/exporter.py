"""The Prometheus exporter: the instruments of :mod:`tq_redis.instruments` served over HTTP.

The drivers and the storage manager record into those instruments (call and wait latencies, bytes
and values moved) in every process. An exporter started by :func:`start_exporter`
(``init({"metrics": {"enabled": True}})``) serves them and adds
  a scrape-time collector for queue depth: ready-but-unconsumed samples per partition and task,
  read from Redis (``tq_redis_queue_depth``), in-flight leases, and every storage node's used bytes,
  capacity and heartbeat age as the nodes registered them in Redis.

Metrics live in their own registry (:data:`REGISTRY`), so importing tq_redis never touches a
program's default registry.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import GaugeMetricFamily

from tq_redis.instruments import REGISTRY


class QueueDepthCollector:
    """Scrape-time gauges from Redis: ready-unconsumed samples and leases per partition and task."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        from tq_redis.server import connections

        self.namespace = namespace
        self._redis = connections.sync_client(redis_url, socket_timeout=2)

    def collect(self):
        from tq_redis.monitor.status import snapshot

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
