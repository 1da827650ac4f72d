"""The Prometheus instruments tq-redis records into, in a registry of its own.

The drivers time every Lua function call (``tq_redis_redis_call_seconds{fn=...}``) and every wait on
an event stream (``tq_redis_wait_seconds``); the storage manager counts bytes and values per
direction and store (``tq_redis_bytes_total``, ``tq_redis_values_total``; store ``inline``: values
kept in the metadata plane) and times store calls; every typed error an operation raises is counted
by type (``tq_redis_errors_total``). All of them are per process.
:mod:`tq_redis.monitor.exporter` serves them. They live in :data:`REGISTRY`, not the default
registry, so importing tq_redis never touches a program's own metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

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
ERRORS = Counter("tq_redis_errors", "Typed errors (tq_redis.errors) operations of this process raised, by type",
                 ["type"], registry=REGISTRY)
