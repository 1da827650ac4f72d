"""Ray placement of DRAM storage nodes: one per Ray node, pinned there, restarted when it fails.

verl-style jobs already run inside Ray. :func:`place_storage_nodes` starts, on every alive Ray node,
a small *keeper* actor that owns that node's DRAM storage-node process(es)::

    import ray, tq_redis as tq
    from tq_redis.integrations.ray_placement import place_storage_nodes

    ray.init()
    cfg = tq.init({"redis": {"url": "redis://meta-host:6379/0"}, "storage": {"backend": "dram"}})
    placement = place_storage_nodes(cfg["redis"]["url"], cfg["namespace"], capacity="16GiB")
    placement.wait_ready(timeout=60)     # {ray node id: [PlacedNode(node_id, address, host, ...)]}
    ...                                  # ranks: TransferQueueClient(url, ns) as usual
    placement.refresh()                  # after Ray nodes joined: place on those without one
    placement.shutdown()

**How a keeper is placed.** ``NodeAffinitySchedulingStrategy(node_id, soft=False)``: the keeper
runs on that Ray node or not at all (never on another node, which would put two storage nodes on
one host and none on the other). It asks for ``num_cpus=0`` and no other resource: it is a
long-lived service that sleeps in ``wait()``, and the storage node is a separate process whose
memory budget is its own ``capacity``. Taking a logical CPU would withhold one from the trainer and
rollout workers Ray schedules by CPU, and on a node whose CPUs they hold already a hard-pinned
keeper could never start. ``actor_options`` adds Ray resources (``{"memory": ...}`` to make
Ray account for the node's memory, a custom resource ...). Keepers are named actors
(``tq_redis.storage.manager:<namespace>:<ray node id>`` in Ray namespace ``tq_redis``), so placing twice, or
from two drivers, reuses the keeper already there.

**Restart on failure.** Keepers have ``max_restarts=-1``. The storage node is started with
:func:`tq_redis.backends.dram.launcher.spawn_node` (the node's own CLI entry point, in a child
process that stops by itself when its keeper dies). A keeper whose node process exits exits too, so
one mechanism covers both failures: Ray restarts the keeper, and the new incarnation waits for the
previous node process (if still stopping) and starts a fresh one under the same stable node id
``ray-<ray node id>`` (``ray-<ray node id>-<i>`` with ``per_node > 1``), which re-registers in
Redis. The values the failed node held are lost, as with any DRAM node that dies; the capacity comes
back. A Ray node that leaves takes its keeper with it; ``refresh()`` forgets it.

**Same host, shared memory.** Nothing to configure: the ``dram`` store decides per node. A node
registers ``host`` (its ``socket.gethostname()``) and an abstract Unix socket; a client whose
hostname is the same connects over that socket and maps the node's memory (``memfd`` slabs), any
other client dials the node's TCP address. So a rank that Ray schedules on host H uses H's storage
node through shared memory and the nodes on other hosts over TCP. Two hosts that share a hostname
(containers) are still told apart: the Unix socket lives in the network namespace, so the attempt
fails and the client uses TCP. :func:`local_storage_node` tells a rank which node is its local one
and the route it takes to it. Keys are spread over all nodes by rendezvous hashing, so a rank's
batch still goes partly to remote nodes; only the local node's share takes the shared-memory path.

The TCP address a node advertises is its Ray node's IP (``ray.util.get_node_ip_address()``), so
other hosts can reach it; the Redis URL must be reachable from every Ray node (not ``127.0.0.1``
on a multi-host cluster).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from tq_redis import names
from tq_redis.errors import ConfigError, ConnectionFailed, InvalidArgument, StorageUnavailable
from tq_redis.meta.keys import storage_nodes_key
from tq_redis.redact import redact
from tq_redis.server import connections
from tq_redis.settings import settings
from tq_redis.units import parse_size

log = logging.getLogger(__name__)

__all__ = [
    "PlacedNode",
    "StoragePlacement",
    "host_identity",
    "local_storage_node",
    "local_storage_nodes",
    "place_storage_nodes",
    "plan_placement",
    "route_to",
    "storage_node_id",
]

#: Ray namespace of the keeper actors (named, so a second placement finds the first one's keepers)
RAY_NAMESPACE = "tq_redis"
#: how long a restarted keeper waits for the previous incarnation's node process to finish stopping
PREVIOUS_EXIT_S = 10.0


def host_identity() -> str:
    """This host as the ``dram`` store compares it with a node's registered ``host`` (the hostname)."""
    return socket.gethostname()


def storage_node_id(ray_node_id: str, index: int = 0, per_node: int = 1) -> str:
    """The stable registry id of storage node ``index`` placed on Ray node ``ray_node_id``.

    ``ray-<ray node id>`` (``ray-<ray node id>-<index>`` when ``per_node > 1``): stable across
    restarts, so a restarted node takes its predecessor's place in the hash ring.
    """
    return f"ray-{ray_node_id}" if per_node == 1 else f"ray-{ray_node_id}-{index}"


def route_to(registration: Mapping[str, Any], host: str | None = None) -> str:
    """``"shm"`` if a ``dram`` client on ``host`` (default: this one) uses the node's shared memory, else ``"tcp"``.

    The store's rule: the node offers shared memory (``shm`` and a Unix socket ``uds``) and
    registered the same ``host``. (The client can still fall back to TCP if the Unix socket is not
    reachable from its network namespace, or when it was built with the store option ``shm=False``.)
    """
    host = host_identity() if host is None else host
    offers = bool(registration.get("shm")) and bool(registration.get("uds"))
    return "shm" if offers and registration.get("host") == host else "tcp"


@dataclass(frozen=True)
class PlacedNode:
    """A storage node placed on a Ray node, as its registration in Redis describes it."""

    ray_node_id: str
    node_id: str  #: id in the storage registry (``<ns>:storage:nodes``)
    address: str  #: ``host:port`` TCP clients dial
    host: str  #: the hostname same-host clients compare with theirs
    pid: int  #: the storage-node process
    instance: str  #: changes every time the node (re)starts
    shm: bool  #: offers shared memory to same-host clients
    uds: str | None = None  #: its abstract Unix socket name
    keeper_pid: int | None = None  #: the Ray actor process that owns it (None: read from the registry)

    @classmethod
    def from_registration(cls, ray_node_id: str, info: Mapping[str, Any], keeper_pid: int | None = None) -> PlacedNode:
        """From a node's registration (the JSON its process writes to Redis)."""
        return cls(
            ray_node_id=ray_node_id, node_id=str(info["node_id"]), address=str(info["address"]),
            host=str(info.get("host", "")), pid=int(info.get("pid", 0)), instance=str(info.get("instance", "")),
            shm=bool(info.get("shm")), uds=info.get("uds"), keeper_pid=keeper_pid,
        )  # fmt: skip

    @property
    def route(self) -> str:
        """``"shm"`` or ``"tcp"``: how a ``dram`` client in this process reaches the node (see :func:`route_to`)."""
        return route_to({"shm": self.shm, "uds": self.uds, "host": self.host})


def plan_placement(
    ray_nodes: Iterable[Mapping[str, Any]], placed: Iterable[str], resource: str | None = None
) -> list[str]:
    """Ids of the alive Ray nodes (``ray.nodes()`` entries) that need a keeper.

    A node needs one when it is alive, has none in ``placed``, and (with ``resource``) offers that
    Ray resource (e.g. ``"tq_storage"`` to keep storage off some nodes). Order: as given.
    """
    have = set(placed)
    out = []
    for node in ray_nodes:
        node_id = node.get("NodeID")
        if not node.get("Alive") or not node_id or node_id in have or node_id in out:
            continue
        if resource is not None and not (node.get("Resources") or {}).get(resource):
            continue
        out.append(node_id)
    return out


# ------------------------------------------------------------------------------------------------
# The keeper actor (runs on its Ray node)
# ------------------------------------------------------------------------------------------------


def _previous_pid(redis_url: str, namespace: str, node_id: str) -> int | None:
    """Pid of this node id's previous process if it still runs on this host (a keeper restart)."""
    client = connections.sync_client(redis_url, reconnect=False, socket_timeout=5, socket_connect_timeout=5)
    try:
        info = json.loads(client.hget(storage_nodes_key(namespace), node_id) or "{}")
    except (redis.RedisError, ValueError):  # unreachable Redis: spawning the node reports it
        return None
    finally:
        client.close()
    pid = info.get("pid") if isinstance(info, dict) else None
    if type(pid) is not int or info.get("host") != host_identity() or pid == os.getpid():
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return pid if b"dram_server" in f.read() else None
    except OSError:
        return None


def _await_exit(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for process ``pid`` (not our child) to exit; True if it did."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:  # no pidfd (old kernel): do not wait
        return False
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


class _StorageKeeper:
    """Ray actor owning the storage-node process(es) of its Ray node (see the module docstring)."""

    def __init__(self, redis_url: str, namespace: str, spec: dict[str, Any]) -> None:
        import ray

        from tq_redis.backends.dram.launcher import spawn_node

        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.stopping = False
        self.procs: list[Any] = []
        host = spec.get("listen_host") or ray.util.get_node_ip_address()
        per_node = int(spec["per_node"])
        try:
            for i in range(per_node):
                node_id = storage_node_id(self.ray_node_id, i, per_node)
                previous = _previous_pid(redis_url, namespace, node_id)
                if previous is not None and not _await_exit(previous, PREVIOUS_EXIT_S):
                    log.warning("storage node %s: previous process %d is still running", node_id, previous)
                self.procs.append(
                    spawn_node(
                        redis_url, namespace, listen=f"{host}:0", capacity=spec["capacity"],
                        token=spec.get("token"), node_id=node_id, shm=bool(spec["shm"]),
                        extra_args=tuple(spec.get("extra_args") or ()), timeout=float(spec["start_timeout"]),
                        log_level=spec["log_level"],
                    )
                )  # fmt: skip
        except BaseException:
            self._stop_all(5.0)
            raise
        for proc in self.procs:
            threading.Thread(target=self._watch, args=(proc,), name="tq-keeper-watch", daemon=True).start()

    def _watch(self, node: Any) -> None:
        """A node process that exits on its own takes the keeper down, so Ray restarts both."""
        code = node.proc.wait()
        if not self.stopping:
            log.error("storage node %s exited with status %s; restarting through Ray", node.node_id, code)
            os._exit(1)

    def info(self) -> list[dict[str, Any]]:
        """Each node's registration, with this Ray node's id and the keeper's pid."""
        return [{**n.info, "ray_node_id": self.ray_node_id, "keeper_pid": os.getpid()} for n in self.procs]

    def _stop_all(self, timeout: float) -> None:
        self.stopping = True
        for n in self.procs:
            n.send_signal()  # all at once, so they stop in parallel
        for n in self.procs:
            n.stop(timeout)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the nodes cleanly (they finish requests, deregister, free memory)."""
        self._stop_all(timeout)
        return True


# ------------------------------------------------------------------------------------------------
# The driver side
# ------------------------------------------------------------------------------------------------


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        from tq_redis.errors import BackendNotInstalled

        raise BackendNotInstalled("Ray placement needs ray: pip install 'tq-redis[ray]'") from exc
    if not ray.is_initialized():
        raise ConfigError("Ray is not initialized: call ray.init(address=...) before placing storage nodes")
    return ray


def _target(redis_url: str | None, namespace: str | None) -> tuple[str, str]:
    """The Redis URL and namespace: given, else ``TQ_REDIS_URL``/``TQ_NAMESPACE``, else the Ray job's system."""
    from tq_redis.server import ray_discovery
    from tq_redis.server.connections import check_url

    found = None
    if redis_url is None:
        redis_url = settings.redis_url
    if redis_url is None:
        found = ray_discovery.lookup()
        if found is None:
            raise ConfigError(
                "no Redis URL to register the storage nodes in: pass redis_url=, set TQ_REDIS_URL, "
                "or call tq_redis.init() in this Ray job first"
            )
        redis_url = found["url"]
    check_url(redis_url)
    if namespace is None:
        namespace = settings.namespace or (found or {}).get("namespace") or "tq"
    return redis_url, names.namespace(namespace)


def _spec(
    capacity: str | int, per_node: int, shm: bool, token: str | None, listen_host: str | None,
    spill: str | None, start_timeout: float, log_level: str,
) -> dict[str, Any]:  # fmt: skip
    """The keepers' settings, checked here so a mistake fails in the driver, not on every node."""
    parse_size(capacity)
    if type(per_node) is not int or per_node < 1:
        raise InvalidArgument(f"per_node must be a positive int (storage nodes per Ray node), not {per_node!r}")
    if not start_timeout > 0:
        raise InvalidArgument(f"start_timeout must be a positive number of seconds, not {start_timeout!r}")
    return {
        "capacity": str(capacity), "per_node": per_node, "shm": bool(shm),
        "token": token if token is not None else settings.storage_token,
        "listen_host": listen_host, "extra_args": ["--spill", spill] if spill else [],
        "start_timeout": float(start_timeout), "log_level": log_level,
    }  # fmt: skip


class StoragePlacement:
    """Handle on the keepers :func:`place_storage_nodes` started (one per Ray node)."""

    def __init__(
        self, redis_url: str, namespace: str, spec: dict[str, Any], *, resource: str | None = None,
        detached: bool = False, actor_options: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.redis_url = redis_url
        self.namespace = namespace
        self.resource = resource
        self._spec = spec
        self._detached = detached
        self._actor_options = dict(actor_options or {})
        self._keepers: dict[str, Any] = {}  # Ray node id -> actor handle

    def actor_name(self, ray_node_id: str) -> str:
        """Name of the keeper actor of ``ray_node_id`` (in Ray namespace ``tq_redis``)."""
        return f"tq_redis.storage.manager:{self.namespace}:{ray_node_id}"

    def _start_keeper(self, ray_node_id: str) -> Any:
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options: dict[str, Any] = {
            "num_cpus": 0,
            "max_restarts": -1,
            "max_task_retries": -1,  # info()/stop() are idempotent: a call that met a dying keeper reruns
            "scheduling_strategy": NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
            "name": self.actor_name(ray_node_id),
            "namespace": RAY_NAMESPACE,
            "get_if_exists": True,
        }
        if self._detached:
            options["lifetime"] = "detached"
        options.update(self._actor_options)
        cls = ray.remote(_StorageKeeper)
        return cls.options(**options).remote(self.redis_url, self.namespace, self._spec)

    def refresh(self, ping_timeout: float = 1.0) -> list[str]:
        """Place keepers on alive Ray nodes that have none (new nodes, or a keeper that died for good).

        Forgets the keepers of Ray nodes that left. Returns the Ray node ids it placed on now.
        """
        ray = _ray()
        alive = ray.nodes()
        alive_ids = {n["NodeID"] for n in alive if n.get("Alive")}
        for gone in [r for r in self._keepers if r not in alive_ids]:
            del self._keepers[gone]
        for dead in self._dead_keepers(ping_timeout):
            del self._keepers[dead]
        new = plan_placement(alive, self._keepers, self.resource)
        for ray_node_id in new:
            self._keepers[ray_node_id] = self._start_keeper(ray_node_id)
        return new

    def _dead_keepers(self, timeout: float) -> list[str]:
        """Ray nodes whose keeper is dead for good (its constructor failed, or it was killed)."""
        ray = _ray()
        from ray.exceptions import RayActorError

        refs = {k.info.remote(): r for r, k in self._keepers.items()}
        if not refs:
            return []
        done, _pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        dead = []
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError:
                dead.append(refs[ref])
        return dead

    def wait_ready(self, timeout: float = 60.0) -> dict[str, list[PlacedNode]]:
        """Wait until every keeper's nodes are registered; returns them (see :meth:`nodes`).

        Raises :class:`~tq_redis.errors.StorageUnavailable` naming the Ray nodes whose storage
        node failed to start or did not start within ``timeout`` s.
        """
        ray = _ray()
        from ray.exceptions import GetTimeoutError, RayError

        refs = {r: k.info.remote() for r, k in self._keepers.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        out: dict[str, list[PlacedNode]] = {}
        failed: list[str] = []
        for ray_node_id, ref in refs.items():
            try:
                infos = ray.get(ref, timeout=0)
            except GetTimeoutError:
                failed.append(f"{ray_node_id}: not registered within {timeout:g} s")
                continue
            except RayError as exc:
                failed.append(f"{ray_node_id}: {str(exc).strip().splitlines()[-1][:500]}")
                continue
            out[ray_node_id] = [PlacedNode.from_registration(ray_node_id, i, i.get("keeper_pid")) for i in infos]
        if failed:
            raise StorageUnavailable(
                "DRAM storage nodes placed by Ray are not ready on " + "; ".join(failed)
                + f" (Redis {redact(self.redis_url)}, namespace {self.namespace!r}); see the keeper's log in Ray's"
                " logs (tq_redis.storage.manager:* actors)"
            )  # fmt: skip
        return out

    def nodes(self, timeout: float = 60.0) -> dict[str, list[PlacedNode]]:
        """Ray node id -> the storage nodes placed on it (id, address, host, pids ...)."""
        return self.wait_ready(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every placed node cleanly, then the keepers (no restart). Idempotent.

        Keepers are shared by name: this also stops those another placement of the same namespace
        found here (``get_if_exists``).
        """
        ray = _ray()
        from ray.exceptions import RayError

        keepers, self._keepers = self._keepers, {}
        stops = [k.stop.remote(timeout) for k in keepers.values()]
        with contextlib.suppress(RayError):
            ray.wait(stops, num_returns=len(stops), timeout=timeout + 5)
        for k in keepers.values():
            with contextlib.suppress(RayError, ValueError):
                ray.kill(k, no_restart=True)

    def __enter__(self) -> StoragePlacement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def place_storage_nodes(
    redis_url: str | None = None,
    namespace: str | None = None,
    *,
    capacity: str | int = "4GiB",
    per_node: int = 1,
    shm: bool = True,
    spill: str | None = None,
    token: str | None = None,
    resource: str | None = None,
    listen_host: str | None = None,
    detached: bool = False,
    actor_options: Mapping[str, Any] | None = None,
    start_timeout: float = 30.0,
    log_level: str = "WARNING",
) -> StoragePlacement:
    """Start ``per_node`` DRAM storage node(s) on every alive Ray node; returns the handle at once.

    Args:
        redis_url: the metadata plane the nodes register in (default: ``TQ_REDIS_URL``, else the
            system ``tq_redis.init()`` started in this Ray job).
        namespace: tq namespace (default: ``TQ_NAMESPACE``, that system's, else ``"tq"``).
        capacity: each node's memory budget (``"16GiB"``); memory is taken as it is used.
        per_node: storage nodes per Ray node.
        shm: offer same-host ranks shared memory (default on).
        spill: fsspec URL for values beyond ``capacity`` (each node uses its own directory).
        token: the nodes' shared secret (default: ``TQ_STORAGE_TOKEN``).
        resource: place only on Ray nodes offering this custom resource.
        listen_host: address to bind and advertise (default: the Ray node's IP).
        detached: keepers outlive this driver (``lifetime="detached"``); stop them with ``shutdown()``.
        actor_options: extra Ray actor options for the keepers (resources, runtime_env ...).
        start_timeout: seconds a node has to register after its process starts.

    Call :meth:`StoragePlacement.wait_ready` to wait for the nodes; the ``dram`` store of every
    client of the namespace uses them from then on.
    """
    spec = _spec(capacity, per_node, shm, token, listen_host, spill, start_timeout, log_level)
    url, ns = _target(redis_url, namespace)
    _ray()
    placement = StoragePlacement(url, ns, spec, resource=resource, detached=detached, actor_options=actor_options)
    placement.refresh()
    return placement


def local_storage_nodes(redis_url: str | None = None, namespace: str | None = None) -> list[PlacedNode]:
    """The storage nodes placed on the Ray node this process runs on (call it in a Ray task or actor).

    Same-host routing is automatic (see the module docstring); this tells a rank which node is
    local and its :attr:`PlacedNode.route` (``"shm"`` when this process uses its shared memory).
    """
    ray = _ray()
    url, ns = _target(redis_url, namespace)
    ray_node_id = ray.get_runtime_context().get_node_id()
    client = connections.sync_client(url, reconnect=False, socket_timeout=5, socket_connect_timeout=5)
    try:
        registry = client.hgetall(storage_nodes_key(ns))
    except redis.RedisError as exc:  # named, never raw out of the public API
        raise ConnectionFailed(f"cannot read the storage nodes from Redis at {redact(url)} ({exc})") from exc
    finally:
        client.close()
    prefix = storage_node_id(ray_node_id)
    found = []
    for key in sorted(registry):
        node_id = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
        if node_id == prefix or node_id.startswith(prefix + "-"):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                found.append(PlacedNode.from_registration(ray_node_id, json.loads(registry[key])))
    return found


def local_storage_node(redis_url: str | None = None, namespace: str | None = None) -> PlacedNode | None:
    """The (first) storage node placed on this process's Ray node, or None."""
    found = local_storage_nodes(redis_url, namespace)
    return found[0] if found else None
