"""The reference's ``init`` / ``close`` under the alias, and the controller a Ray job expects to find.

The reference's own tests, tutorial 06 and its Relax recipe reach into its controller actor
(``ray.get_actor("TransferQueueController", namespace="transfer_queue")``) to read the config and
to list, clear and inspect partitions. tq-redis has no controller, so when the alias's :func:`init`
runs in a Ray driver it starts :class:`ControllerInspector` under that name: a read-only window onto
the Redis state (plus ``clear_partition``), never on the data path. The alias's :func:`close` kills
it. :mod:`tq_redis.integrations.alias` maps ``transfer_queue.init``/``close`` and
``transfer_queue.controller`` here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from typing import Any

__all__ = [
    "CONTROLLER_NAME",
    "CONTROLLER_NAMESPACE",
    "ControllerInspector",
    "PartitionSnapshot",
    "close",
    "init",
    "partition_snapshot",
    "reference_config",
]

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"

# ------------------------------------------------------------------- the alias's init / close

_state: dict[str, Any] = {}


def _ray() -> Any | None:
    """The ``ray`` module when Ray is installed, imported and initialized in this process."""
    ray = sys.modules.get("ray")
    if ray is None or not hasattr(ray, "is_initialized") or not ray.is_initialized():
        return None
    return ray


def _is_ray_driver(ray: Any) -> bool:
    """True in the process that called ``ray.init`` (not in a task or actor)."""
    worker = getattr(ray.get_runtime_context(), "worker", None)
    mode = getattr(worker, "mode", None)
    if mode is None:  # a Ray without that attribute: at least never start it from an actor
        return ray.get_runtime_context().get_actor_id() is None
    return mode == ray.SCRIPT_MODE


def _existing_controller(ray: Any) -> Any | None:
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return None


def init(conf: Any = None) -> dict[str, Any]:
    """The alias's ``transfer_queue.init``: :func:`tq_redis.init` plus the controller inspector.

    In a Ray driver it also starts the named actor ``TransferQueueController`` (namespace
    ``transfer_queue``) that the reference's tests inspect. (A Ray worker's argument-less
    ``init()`` attaches to the job's system by itself, see :mod:`tq_redis.server.ray_discovery`.)
    """
    from tq_redis.api import system as runtime

    ray = _ray()
    cfg = runtime.init(conf)
    if ray is not None and _is_ray_driver(ray):
        _start_inspector(ray, cfg)
    return cfg


def close() -> None:
    """The alias's ``transfer_queue.close``: kill the inspector actor, then :func:`tq_redis.close`."""
    from tq_redis.api import system as runtime

    actor = _state.pop("inspector", None)
    ray = _ray()
    if actor is not None and ray is not None:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone with its cluster: nothing left to stop
            pass
    runtime.close()


def _shareable_conf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The effective config, as the reference's controller keeps the one ``init`` was given (the
    user's own sections too): ``init(conf)`` with it attaches another process to this system."""
    out = {key: copy.deepcopy(value) for key, value in cfg.items()}
    out["redis"] = {**dict(cfg.get("redis") or {}), "url": cfg["redis"]["url"]}
    out["namespace"] = cfg["namespace"]
    return out


def reference_config(conf: dict[str, Any]) -> Any:
    """``conf`` as the reference's ``get_config`` returns it: an OmegaConf ``DictConfig`` (items
    also by attribute: ``conf.controller``) when OmegaConf is installed, else the dict."""
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return conf
    return OmegaConf.create(conf, flags={"allow_objects": True})


def _controller_class() -> Any:
    """The Ray actor class of :class:`ControllerInspector`, made once per process: what the alias
    serves as ``transfer_queue.controller.TransferQueueController`` and what ``init`` starts, so
    code that adjusts that class's ``options`` (NeMo-RL's adapter) adjusts the actor it gets."""
    made = _state.get("controller_class")
    if made is None:
        import ray

        made = _state.setdefault("controller_class", ray.remote(num_cpus=0)(ControllerInspector))
    return made


def __getattr__(name: str) -> Any:  # PEP 562: the actor class needs Ray, imported on first use only
    if name == "TransferQueueController":
        return _controller_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _start_inspector(ray: Any, cfg: dict[str, Any]) -> None:
    if _state.get("inspector") is not None or _existing_controller(ray) is not None:
        return
    actor_cls = _controller_class()
    try:
        actor = actor_cls.options(name=CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE).remote(_shareable_conf(cfg))
    except ValueError:  # another driver registered the name between our check and now
        return
    ray.get(actor.ping.remote())  # ready before init() returns: callers may get_actor() at once
    _state["inspector"] = actor


# --------------------------------------------------------------------- the controller inspector


@dataclasses.dataclass
class PartitionSnapshot:
    """A partition as the reference's controller describes it (``get_partition_snapshot``).

    ``production_status[global_index, field_name_mapping[field]]`` is 1 once that field of that
    sample is stored; ``custom_meta`` maps global index -> tags; ``keys_mapping`` maps KV keys to
    global indexes.
    """

    partition_id: str
    global_indexes: list[int]
    keys_mapping: dict[str, int]
    custom_meta: dict[int, dict[str, Any]]
    field_name_mapping: dict[str, int]
    production_status: Any  # torch.Tensor, int8, (max global index + 1, number of fields)

    @property
    def revert_keys_mapping(self) -> dict[int, str]:
        """Global index -> KV key."""
        return {v: k for k, v in self.keys_mapping.items()}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _tag_value(raw: Any) -> Any:
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return _text(raw)


def partition_snapshot(r: Any, namespace: str, partition_id: str) -> PartitionSnapshot | None:
    """Read one partition's state with plain Redis reads (no scripts, no writes); None if absent."""
    import torch

    from tq_redis.meta import bitmaps  # numpy: only once a snapshot is asked for
    from tq_redis.meta.keys import PartitionKeys

    pk = PartitionKeys(namespace, partition_id)
    exists, alive, fields, tagnames, kv = (
        r.pipeline(transaction=False)
        .exists(pk.meta).get(pk.alive).hkeys(pk.fields).smembers(pk.tagnames).hgetall(pk.kv)
        .execute()
    )
    if not exists:
        return None
    ids = bitmaps.set_ids(alive)
    field_names = sorted(_text(f) for f in fields)
    names = sorted(_text(t) for t in tagnames)
    pipe = r.pipeline(transaction=False)
    for f in field_names:
        pipe.get(pk.prod(f))
    tag_names = names if ids else []
    for t in tag_names:
        pipe.hmget(pk.tag(t), *ids)
    replies = pipe.execute() if field_names or tag_names else []
    rows = (max(ids) + 1) if ids else 0
    status = torch.zeros((rows, len(field_names)), dtype=torch.int8)
    alive_set = set(ids)
    for col, raw in enumerate(replies[: len(field_names)]):
        for gid in bitmaps.set_ids(raw):
            if gid in alive_set:
                status[gid, col] = 1
    custom: dict[int, dict[str, Any]] = {gid: {} for gid in ids}
    for name, values in zip(tag_names, replies[len(field_names):]):
        for gid, raw in zip(ids, values):
            if raw is not None:
                custom[gid][name] = _tag_value(raw)
    keys = {_text(k): int(v) for k, v in kv.items() if int(v) in alive_set}
    return PartitionSnapshot(
        partition_id=partition_id,
        global_indexes=ids,
        keys_mapping=keys,
        custom_meta=custom,
        field_name_mapping={f: i for i, f in enumerate(field_names)},
        production_status=status,
    )


class ControllerInspector:
    """Answers the reference controller's inspection calls from tq-redis's Redis state.

    Run as the Ray actor ``TransferQueueController`` (namespace ``transfer_queue``) by the alias's
    ``init()``. For compatibility only: it is never on the data path, and every method reads
    through an ordinary :class:`~tq_redis.client.blocking.TransferQueueClient`.
    """

    def __init__(self, conf: dict[str, Any]) -> None:
        from tq_redis.client.blocking import TransferQueueClient

        self._conf = conf
        self._client = TransferQueueClient(conf["redis"]["url"], conf["namespace"])

    def ping(self) -> bool:
        """True once the actor is up."""
        return True

    def get_config(self) -> Any:
        """The config ``init`` ran with, what another process passes to ``init`` to attach: its
        Redis URL, namespace, client settings and every other section given (a ``DictConfig``
        as the reference's, see :func:`reference_config`)."""
        return reference_config(self._conf)

    def get_partition_index_range(self, partition_id: str) -> list[int]:
        """The global indexes of the partition's live samples, ascending ([] when it does not exist)."""
        snap = self.get_partition_snapshot(partition_id)
        return [] if snap is None else sorted(snap.global_indexes)

    def list_partitions(self) -> list[str]:
        """Partition ids, oldest first."""
        return list(self._client.get_partition_list())

    def clear_partition(self, partition_id: str) -> None:
        """Clear a partition (metadata and bytes). Idempotent."""
        self._client.clear_partition(partition_id)

    def get_partition_snapshot(self, partition_id: str) -> PartitionSnapshot | None:
        """A :class:`PartitionSnapshot` of the partition, or None when it does not exist."""
        return partition_snapshot(self._client.redis, self._conf["namespace"], partition_id)
