"""Module-level ``init`` / ``close`` / ``get_client``: the process-wide default client.

``init()`` with no Redis URL (and no ``TQ_REDIS_URL``) starts an embedded Valkey and local DRAM
storage nodes owned by this process, private to its user (a random password, carried by the URL
in the returned config; nodes that admit only holders of their access key); ``close()`` stops
them. With a URL it only attaches; the URL may name any node of a Redis Cluster
(``redis.cluster`` / ``TQ_REDIS_CLUSTER`` force the choice, see :mod:`tq_redis.server.connections`). Either
way the effective config it returns carries the URL and namespace other processes attach with.

Before anything is written, ``init`` checks the server as every client does at first use
(:mod:`tq_redis.server.policy`): an evicting ``maxmemory-policy`` is refused
(``redis.on_eviction: error``, the default) or warned about, and the function library is loaded
(``redis.load_library: auto``) or must have been loaded by an admin (``never``).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import redis

from tq_redis import names
from tq_redis.api import config as config_mod
from tq_redis.client.blocking import TransferQueueClient
from tq_redis.errors import ConfigError, ConnectionFailed, TQError
from tq_redis.meta.keys import config_key
from tq_redis.monitor import exporter
from tq_redis.samplers import sampler_spec
from tq_redis.server import acl, connections, durability, leftovers, ray_discovery
from tq_redis.server import policy as server_policy
from tq_redis.server.embedded import EmbeddedServer
from tq_redis.settings import settings
from tq_redis.storage.base import StoreContext
from tq_redis.storage.durable import check_durable

_lock = threading.Lock()
_state: dict[str, Any] = {}


class NotInitialized(TQError, RuntimeError):
    """A module-level function was called before ``tq_redis.init()``."""


def init(conf: Any = None) -> dict[str, Any]:
    """Start (or attach to) tq-redis and create this process's default client.

    Returns the effective config: ``conf["redis"]["url"]`` and ``conf["namespace"]`` are what
    other processes pass to ``TransferQueueClient`` (or export as ``TQ_REDIS_URL`` /
    ``TQ_NAMESPACE`` before their own ``init()``). For the embedded server the URL carries its
    password: hand it to your own processes, and print it through ``tq_redis.redact.redact``.
    """
    with _lock:
        if _state:
            return _state["config"]
        cfg = config_mod.load(conf)
        if cfg["storage"]["durable"] is not None:  # a tier no put could write is refused now
            check_durable(cfg["storage"]["durable"], StoreContext(cfg["redis"]["url"] or "", cfg["namespace"]))
        explicit_storage = isinstance(conf, dict) and ("storage" in conf or "backend" in conf)
        if cfg["redis"]["url"] is None:
            _attach_to_ray_job_system(cfg, conf)
        server = nodes = None
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
            server_policy.declare(cfg["redis"]["url"], on_eviction=cfg["redis"]["on_eviction"],
                                  load_library=cfg["redis"]["load_library"])
            durability.declare(cfg["redis"]["url"], cfg["redis"]["durable"], cfg["redis"]["durable_timeout_ms"])
            # Without a sampler in conf, get_meta uses the one recorded in Redis (the job's); with
            # one, this client uses it as given (a class or an instance cannot be recorded in Redis).
            client = TransferQueueClient(
                cfg["redis"]["url"], cfg["namespace"],
                allow_pickle=bool(cfg["codec"]["allow_pickle"]),
                nested_output=bool(cfg["compat"]["nested_output"]),
                strict_schema=bool(cfg["compat"].get("strict_schema", False)),
                sampler=cfg["sampler"] if _gives_sampler(conf) else None,
            )
            _record_settings(client, cfg, conf, explicit_storage)
            if cfg["metrics"].get("enabled"):
                exporter.start_exporter(
                    int(cfg["metrics"].get("port") or 0), redis_url=cfg["redis"]["url"], namespace=cfg["namespace"]
                )
        except BaseException:
            if server is not None:
                ray_discovery.withdraw(_served_url(server))
            _stop(nodes, server)
            if cfg["redis"]["url"] is not None:
                connections.declare_cluster(cfg["redis"]["url"], None)
                server_policy.forget(cfg["redis"]["url"])
                durability.declare(cfg["redis"]["url"], None)
            raise
        _state.update(config=cfg, client=client, server=server, nodes=nodes)
        return cfg


def _record_settings(client: TransferQueueClient, cfg: dict[str, Any], conf: Any, explicit_storage: bool) -> None:
    """Check the server (eviction policy, library: :func:`tq_redis.server.policy.node_checks` on
    every primary), then record the namespace's store and sampler in ``<ns>:config``."""
    url = cfg["redis"]["url"]
    options = dict(cfg["storage"].get("options") or {})
    if cfg["storage"].get("replicas", 1) != 1:  # storage.replicas is the dram store's option
        options["replicas"] = cfg["storage"]["replicas"]
    spec = json.dumps({
        "backend": cfg["storage"]["backend"], "options": options,
        "inline_max_bytes": cfg["storage"]["inline_max_bytes"],
        **({"durable": cfg["storage"]["durable"]} if cfg["storage"].get("durable") else {}),
    })
    key = config_key(cfg["namespace"])
    sampler = json.dumps(sampler_spec(cfg["sampler"]))
    try:
        client._driver.ensure_loaded()
        if explicit_storage:
            client.redis.hset(key, "storage", spec)
        else:
            client.redis.hsetnx(key, "storage", spec)
        if _gives_sampler(conf):
            client.redis.hset(key, "sampler", sampler)
        else:  # an argument-less init (a worker attaching) keeps the job's sampler
            client.redis.hsetnx(key, "sampler", sampler)
        if "staleness" in config_mod.to_plain(conf):  # the namespace's bound (tq_redis.ops.reservations)
            bound = cfg["staleness"]
            if bound["max_lag"] is None:
                client.redis.hdel(key, "staleness")
            else:
                client.redis.hset(key, "staleness", json.dumps(bound))
        if cfg.get("namespace_ttl") is not None:  # read by `tq-redis namespace gc` (tq_redis.monitor.namespaces)
            client.redis.hset(key, "ttl_s", repr(float(cfg["namespace_ttl"])))
    except redis.RedisError as exc:
        typed = server_policy.typed_error(url, exc)
        if typed is not None:
            raise typed from exc
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            raise ConnectionFailed(f"cannot reach Redis at {server_policy.redact(url)} ({exc}); check that "
                                   f"the server is running and the URL is right") from exc
        raise


def _attach_to_ray_job_system(cfg: dict[str, Any], conf: Any) -> None:
    """Inside a Ray job whose system is already up (see :mod:`tq_redis.server.ray_discovery`), attach to it."""
    found = ray_discovery.lookup()
    if found is None:
        return
    cfg["redis"]["url"] = found["url"]
    given_namespace = isinstance(conf, dict) and "namespace" in conf
    if not given_namespace and not settings.namespace:
        cfg["namespace"] = found["namespace"]


def _gives_sampler(conf: Any) -> bool:
    plain = config_mod.to_plain(conf)
    return plain.get("sampler") is not None or (plain.get("controller") or {}).get("sampler") is not None


def _served_url(server: EmbeddedServer) -> str:
    """The URL clients of an embedded server get: its socket's (every client is on its host, and
    a socket skips the TCP stack), its loopback port's where the socket path was too long."""
    return server.socket_url or server.url


def _start_embedded(cfg: dict[str, Any]) -> tuple[EmbeddedServer, Any]:
    """An embedded Valkey and, for the dram store, this process's local storage nodes."""
    storage = cfg["storage"]
    # private to this user: a random password (in the URL other processes attach with) on every
    # connection, TCP or its socket file (itself in a 0700 directory); see tq_redis.server.embedded
    leftovers.remove_abandoned()  # what earlier jobs killed with SIGKILL left in the temp directory
    server = EmbeddedServer(unix_socket=True, password=acl.new_password()).start()
    cfg["redis"]["url"] = _served_url(server)
    nodes = None
    try:
        if storage["backend"] == "dram":
            from tq_redis.backends.dram.launcher import start_local_nodes

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
    return exporter.endpoint()


def close() -> None:
    """Close the default client and stop whatever ``init()`` started. Idempotent."""
    with _lock:
        if not _state:
            return
        exporter.stop_exporter()
        cfg = _state["config"]
        _state["client"].close()
        connections.declare_cluster(cfg["redis"]["url"], None)
        server_policy.forget(cfg["redis"]["url"])
        durability.declare(cfg["redis"]["url"], None)
        if _state.get("server") is not None:
            ray_discovery.withdraw(_served_url(_state["server"]))
        _stop(_state.get("nodes"), _state.get("server"))
        _state.clear()


def resolve_target(redis_url: str | None, namespace: str | None) -> tuple[str, str, bool]:
    """(url, namespace, allow_pickle) from the arguments, ``tq_redis.init()``, the environment
    or, inside a Ray job, the system the job published (see :mod:`tq_redis.server.ray_discovery`).
    The facades (channels, docks) find their server with it."""
    if namespace is not None:  # given: checked as given ("" is refused, not taken as "unset")
        names.namespace(namespace)
    try:
        client = get_client()
    except NotInitialized:
        client = None
    if redis_url is None and client is not None:
        return client.redis_url, namespace or client.namespace, client.context.allow_pickle
    url = redis_url or settings.redis_url
    if not url:
        found = ray_discovery.lookup()
        if found is not None:
            return found["url"], namespace or settings.namespace or found["namespace"], False
        raise ConfigError(
            "Channel needs the Redis URL: pass redis_url=, export TQ_REDIS_URL, or call tq_redis.init() first"
        )
    return url, namespace or settings.namespace or "tq", False
