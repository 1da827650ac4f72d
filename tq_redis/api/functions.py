"""The module-level API on the default client: the reference system's KV calls (``tq.kv_put`` ...),
``kv_watch``, checkpoints, and the group reservations and staleness admission of asynchronous RL.

Each function runs the same operation as the client method of the same name on the client
``tq_redis.init()`` created (:func:`tq_redis.api.system.get_client`). Each ``async_<name>``
coroutine takes the parameters of ``<name>`` (written once, there) and awaits the client's
``async_<name>``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from tensordict import TensorDict

from tq_redis.api.system import get_client
from tq_redis.client import checkpoint
from tq_redis.client.blocking import TransferQueueClient
from tq_redis.meta import BatchMeta, KVBatchMeta
from tq_redis.ops.data_parser import DataParser
from tq_redis.ops.ratelimit import DEFAULT_INSERT_TIMEOUT_S, RateLimit
from tq_redis.ops.reservations import Reservation
from tq_redis.ops.transitions import Admission
from tq_redis.ops.watch import TagChanges

P = ParamSpec("P")
R = TypeVar("R")


def _client() -> TransferQueueClient:
    """The default client; it has the ``async_*`` coroutines too (one Redis pool per loop)."""
    return get_client()


def save_checkpoint(checkpoint_dir: str | Path, *, metadata: dict[str, Any] | None = None,
                    include_storage: bool = True) -> None:
    """Save the namespace of the client ``tq_redis.init()`` created to ``checkpoint_dir``.

    ``metadata`` (JSON-serialisable) is stored with it and returned by :func:`load_checkpoint`.
    ``include_storage=False`` saves metadata only (for stores whose data outlives the job); see
    :func:`tq_redis.client.checkpoint.save`.
    """
    checkpoint.save(_client(), checkpoint_dir, metadata=metadata, include_storage=include_storage)


def load_checkpoint(checkpoint_dir: str | Path, *, replace: bool = False) -> dict[str, Any]:
    """Load the checkpoint in ``checkpoint_dir`` into the namespace; returns its user ``metadata``.

    All or nothing: every file is read, checked against the checkpoint's manifest (sizes, SHA-256)
    and decoded before the first write, and a bad one raises ``CheckpointCorrupt`` naming it. A
    namespace that holds data raises ``NamespaceNotEmpty`` unless ``replace=True``, which clears that
    data first (its bytes deleted from every store). See :func:`tq_redis.client.checkpoint.load`.
    """
    return checkpoint.load(_client(), checkpoint_dir, replace=replace)


def kv_put(
    key: str,
    partition_id: str,
    fields: TensorDict | Mapping[str, Any] | None = None,
    tag: Mapping[str, Any] | None = None,
    data_parser: DataParser | None = None,
) -> KVBatchMeta:
    """Put one key's fields (a dict of one sample's values, or a batch-1 TensorDict) and/or tag.

    Fields accumulate: a later put of other fields adds them. ``fields=None`` updates the tag only.
    Returns a :class:`KVBatchMeta` whose ``fields`` lists every field the key has.
    """
    return _client().kv_put(key, partition_id, fields, tag, data_parser)


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: DataParser | None = None,
) -> KVBatchMeta:
    """Put a batch: row ``i`` of ``fields`` and ``tags[i]`` belong to ``keys[i]``."""
    return _client().kv_batch_put(keys, partition_id, fields, tags, data_parser)


def kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> TensorDict:
    """The keys' fields as a TensorDict in key order; by default the fields every key has."""
    return _client().kv_batch_get(keys, partition_id, select_fields)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> TensorDict:
    """:func:`kv_batch_get` of the keys, partition and fields of a :class:`KVBatchMeta`."""
    return _client().kv_batch_get_by_meta(meta, select_fields)


def kv_list(
    partition_id: str | None = None, *, where: dict[str, Any] | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{partition_id: {key: tags}}`` for one partition or every partition of the namespace;
    ``where={tag: value}`` keeps the keys whose tags have those values (filtered on the server)."""
    return _client().kv_list(partition_id, where=where)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Remove keys and their data. Idempotent."""
    _client().kv_clear(keys, partition_id)


def update_priority(partition_id: str, global_indexes: Any, priorities: Any) -> None:
    """Set the priorities of samples of a partition, which ``PrioritizedSampler`` draws by
    (see :meth:`tq_redis.TransferQueueClient.update_priority`)."""
    _client().update_priority(partition_id, global_indexes, priorities)


def kv_watch(
    partition_id: str,
    cursor: str | None = None,
    *,
    timeout: float = 0.0,
    where: dict[str, Any] | None = None,
) -> TagChanges:
    """The keys whose tags changed after ``cursor`` (None: from now), waiting up to ``timeout``
    seconds for one; ``where={tag: value}`` keeps those whose tags now have those values. Go on
    from the returned ``cursor``: each change is seen once. ``WatchCursorExpired`` (carrying the
    newest cursor): the changes were trimmed or the partition cleared; list again, watch on."""
    return _client().kv_watch(partition_id, cursor, timeout=timeout, where=where)


def reserve_group(
    partition_id: str, n: int, lease_s: float = 600.0, *, policy_version: int | None = None, timeout: float = 0.0
) -> Reservation:
    """Reserve ``n`` sample ids (a prompt group) for ``lease_s`` seconds of the server's clock; under
    the staleness bound wait up to ``timeout`` seconds for room (then ``StalenessExceeded``)."""
    return _client().reserve_group(partition_id, n, lease_s, policy_version=policy_version, timeout=timeout)


def commit_group(reservation: Reservation, data: Any, *, end_policy_version: int | None = None) -> BatchMeta:
    """Store the reserved group's ``data`` and make it visible at once (``ReservationLost`` if the
    reservation is not held any more); returns the group's ``BatchMeta``."""
    return _client().commit_group(reservation, data, end_policy_version=end_policy_version)


def abort_group(reservation: Reservation) -> bool:
    """Free a reservation (nothing of it becomes visible); False if it was not held any more."""
    return _client().abort_group(reservation)


def extend_reservation(reservation: Reservation, lease_s: float) -> Reservation:
    """Renew a reservation's lease for ``lease_s`` seconds from now (server time)."""
    return _client().extend_reservation(reservation, lease_s)


def set_policy_version(partition_id: str, version: int) -> int | None:
    """Publish the trainer's policy version (wakes reservers the staleness bound blocks); returns
    the version published before."""
    return _client().set_policy_version(partition_id, version)


def set_staleness_bound(partition_id: str, max_lag: int | None, batch_size: int = 1) -> Admission:
    """Bound the partition's admission: reserved samples stay within ``(version + max_lag + 1) *
    batch_size`` (``max_lag=None`` removes the bound)."""
    return _client().set_staleness_bound(partition_id, max_lag, batch_size)


def set_rate_limit(
    partition_id: str,
    task_name: str,
    samples_per_insert: float | None,
    *,
    min_size_to_sample: int = 1,
    error_buffer: float | None = None,
    insert_timeout: float | None = DEFAULT_INSERT_TIMEOUT_S,
) -> RateLimit | None:
    """Hold ``task_name``'s consumers and the partition's producers to ``samples_per_insert``
    samples per insert, within ``error_buffer`` (``None`` removes the limiter); see
    :meth:`tq_redis.TransferQueueClient.set_rate_limit`."""
    return _client().set_rate_limit(
        partition_id, task_name, samples_per_insert, min_size_to_sample=min_size_to_sample,
        error_buffer=error_buffer, insert_timeout=insert_timeout,
    )  # fmt: skip


def get_rate_limit(partition_id: str, task_name: str) -> RateLimit | None:
    """``task_name``'s rate limiter on the partition with its counts now, or None."""
    return _client().get_rate_limit(partition_id, task_name)


def _coroutine_of(function: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """``async_<name>``: the coroutine of the default client's ``async_<name>``, with ``function``'s
    parameters (``inspect.signature`` shows them)."""
    name = f"async_{function.__name__}"

    async def coroutine(*args: P.args, **kwargs: P.kwargs) -> R:
        return await getattr(_client(), name)(*args, **kwargs)

    coroutine.__name__ = coroutine.__qualname__ = name
    coroutine.__doc__ = f"Coroutine of :func:`{function.__name__}`."
    coroutine.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
    return coroutine


_FUNCTIONS = (
    kv_put, kv_batch_put, kv_batch_get, kv_batch_get_by_meta, kv_list, kv_clear, kv_watch, update_priority,
    reserve_group, commit_group, abort_group, extend_reservation, set_policy_version, set_staleness_bound,
    set_rate_limit, get_rate_limit,
)  # fmt: skip

async_kv_put = _coroutine_of(kv_put)
async_kv_batch_put = _coroutine_of(kv_batch_put)
async_kv_batch_get = _coroutine_of(kv_batch_get)
async_kv_batch_get_by_meta = _coroutine_of(kv_batch_get_by_meta)
async_kv_list = _coroutine_of(kv_list)
async_kv_clear = _coroutine_of(kv_clear)
async_update_priority = _coroutine_of(update_priority)
async_kv_watch = _coroutine_of(kv_watch)
async_reserve_group = _coroutine_of(reserve_group)
async_commit_group = _coroutine_of(commit_group)
async_abort_group = _coroutine_of(abort_group)
async_extend_reservation = _coroutine_of(extend_reservation)
async_set_policy_version = _coroutine_of(set_policy_version)
async_set_staleness_bound = _coroutine_of(set_staleness_bound)
async_set_rate_limit = _coroutine_of(set_rate_limit)
async_get_rate_limit = _coroutine_of(get_rate_limit)

__all__ = [name for function in _FUNCTIONS for name in (function.__name__, f"async_{function.__name__}")]
