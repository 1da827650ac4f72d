"""The reference system's module-level KV API (``tq.kv_put`` ...) and checkpoints, on the default client.

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
from tq_redis.client.blocking import TransferQueueClient
from tq_redis.meta import KVBatchMeta
from tq_redis.ops import checkpoint
from tq_redis.ops.data_parser import DataParser

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
    :func:`tq_redis.ops.checkpoint.save`.
    """
    checkpoint.save(_client(), checkpoint_dir, metadata=metadata, include_storage=include_storage)


def load_checkpoint(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Replace the namespace's state with the checkpoint's; returns its user ``metadata``."""
    return checkpoint.load(_client(), checkpoint_dir)


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


async_kv_put = _coroutine_of(kv_put)
async_kv_batch_put = _coroutine_of(kv_batch_put)
async_kv_batch_get = _coroutine_of(kv_batch_get)
async_kv_batch_get_by_meta = _coroutine_of(kv_batch_get_by_meta)
async_kv_list = _coroutine_of(kv_list)
async_kv_clear = _coroutine_of(kv_clear)
async_update_priority = _coroutine_of(update_priority)

__all__ = [
    name
    for function in (kv_put, kv_batch_put, kv_batch_get, kv_batch_get_by_meta, kv_list, kv_clear, update_priority)
    for name in (function.__name__, f"async_{function.__name__}")
]
