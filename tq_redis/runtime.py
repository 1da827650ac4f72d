"""Module-level ``init`` / ``close`` / ``get_client``: the process-wide default client.

``init()`` with no Redis URL (and no ``TQ_REDIS_URL``) starts an embedded Valkey and local DRAM
storage nodes owned by this process; ``close()`` stops them. With a URL it only attaches; the URL
may name any node of a Redis Cluster (``redis.cluster`` / ``TQ_REDIS_CLUSTER`` force the choice,
see :mod:`tq_redis.connections`). Either
way the effective config it returns carries the URL and namespace other processes attach with.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from tq_redis import config as config_mod
from tq_redis import connections, metrics, ray_discovery, samplers
from tq_redis.embedded import EmbeddedServer
from tq_redis.errors import TQError
from tq_redis.keys import config_key
from tq_redis.samplers import sampler_spec
from tq_redis.sync import TransferQueueClient

_lock = threading.Lock()
_state: dict[str, Any] = {}


class NotInitialized(TQError, RuntimeError):
    """A module-level function was called before ``tq_redis.init()``."""


def init(conf: Any = None) -> dict[str, Any]:
    """Start (or attach to) tq-redis and create this process's default client.

    Returns the effective config: ``conf["redis"]["url"]`` and ``conf["namespace"]`` are what
    other processes pass to ``TransferQueueClient`` (or export as ``TQ_REDIS_URL`` /
    ``TQ_NAMESPACE`` before their own ``init()``).
    """
    with _lock:
        if _state:
            return _state["config"]
        cfg = config_mod.load(conf)
        explicit_storage = isinstance(conf, dict) and ("storage" in conf or "backend" in conf)
        if cfg["redis"]["url"] is None:
            _attach_to_ray_job_system(cfg, conf)
        server = nodes = None
        storage = cfg["storage"]
        try:
            if cfg["redis"]["url"] is None:
                server, nodes = _start_embedded(cfg)
                explicit_storage = True
                winner = ray_discovery.publish(cfg["redis"]["url"], cfg["namespace"])
                if winner is not None:  # another process of this Ray job started one first
                    _stop(nodes, server)
                    server = nodes = None
                    cfg["redis"]["url"], cfg["namespace"] = winner["url"], winner["namespace"]
                    explicit_storage = False
            # every client this process builds for the URL follows redis.cluster (None: detect)
            connections.declare_cluster(cfg["redis"]["url"], cfg["redis"]["cluster"])
            client = TransferQueueClient(
                cfg["redis"]["url"], cfg["namespace"],
                allow_pickle=bool(cfg["codec"]["allow_pickle"]),
                nested_output=bool(cfg["compat"]["nested_output"]),
                strict_schema=bool(cfg["compat"].get("strict_schema", False)),
            )
            spec = json.dumps({"backend": storage["backend"], "options": storage.get("options") or {}})
            key = config_key(cfg["namespace"])
            if explicit_storage:
                client.redis.hset(key, "storage", spec)
            else:
                client.redis.hsetnx(key, "storage", spec)
            sampler = json.dumps(sampler_spec(cfg["sampler"]))
            if _gives_sampler(conf):
                client.redis.hset(key, "sampler", sampler)
            else:  # an argument-less init (a worker attaching) keeps the job's sampler
                client.redis.hsetnx(key, "sampler", sampler)
            if cfg["metrics"].get("enabled"):
                metrics.start_exporter(
                    int(cfg["metrics"].get("port") or 0), redis_url=cfg["redis"]["url"], namespace=cfg["namespace"]
                )
        except BaseException:
            if server is not None:
                ray_discovery.withdraw(server.url)
            _stop(nodes, server)
            if cfg["redis"]["url"] is not None:
                connections.declare_cluster(cfg["redis"]["url"], None)
            raise
        # Without a sampler in conf, get_meta uses the one recorded in Redis (the job's).
        if _gives_sampler(conf):
            samplers.set_process_default(cfg["redis"]["url"], cfg["namespace"], cfg["sampler"])
        _state.update(config=cfg, client=client, server=server, nodes=nodes)
        return cfg


def _attach_to_ray_job_system(cfg: dict[str, Any], conf: Any) -> None:
    """Inside a Ray job whose system is already up (see :mod:`tq_redis.ray_discovery`), attach to it."""
    found = ray_discovery.lookup()
    if found is None:
        return
    cfg["redis"]["url"] = found["url"]
    given_namespace = isinstance(conf, dict) and "namespace" in conf
    if not given_namespace and not os.environ.get("TQ_NAMESPACE"):
        cfg["namespace"] = found["namespace"]


def _gives_sampler(conf: Any) -> bool:
    plain = config_mod.to_plain(conf)
    return plain.get("sampler") is not None or (plain.get("controller") or {}).get("sampler") is not None


def _start_embedded(cfg: dict[str, Any]) -> tuple[EmbeddedServer, Any]:
    """An embedded Valkey and, for the dram store, this process's local storage nodes."""
    storage = cfg["storage"]
    server = EmbeddedServer().start()
    cfg["redis"]["url"] = server.url
    nodes = None
    try:
        if storage["backend"] == "dram":
            from tq_redis.backends.dram_launcher import start_local_nodes

            nodes = start_local_nodes(
                cfg["redis"]["url"], cfg["namespace"], n=int(storage["units"]),
                capacity=str(storage["unit_capacity"]), spill=storage.get("spill") or None,
            )
    except BaseException:
        server.stop()
        raise
    return server, nodes


def _stop(nodes: Any, server: EmbeddedServer | None) -> None:
    if nodes is not None:
        nodes.stop()
    if server is not None:
        server.stop()


def get_client() -> TransferQueueClient:
    """The client ``init()`` created for this process."""
    if not _state:
        raise NotInitialized("call tq_redis.init() (or init(conf)) before using the module-level API")
    return _state["client"]


def get_metrics_endpoint() -> str | None:
    """URL of the Prometheus exporter (``init({"metrics": {"enabled": True}})``), else None."""
    return metrics.endpoint()


def close() -> None:
    """Close the default client and stop whatever ``init()`` started. Idempotent."""
    with _lock:
        if not _state:
            return
        metrics.stop_exporter()
        cfg = _state["config"]
        samplers.set_process_default(cfg["redis"]["url"], cfg["namespace"], None)
        _state["client"].close()
        connections.declare_cluster(cfg["redis"]["url"], None)
        if _state.get("server") is not None:
            ray_discovery.withdraw(_state["server"].url)
        _stop(_state.get("nodes"), _state.get("server"))
        _state.clear()
