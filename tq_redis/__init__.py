"""tq-redis: a controller-less, sample-level data gateway for LLM RL post-training.

Switch from TransferQueue with one import: ``import tq_redis as tq``.

Names are imported lazily (PEP 562), so tools that need no tensors — ``tq-redis status``, a
storage node — start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tq_redis.lazy import lazy_names

__version__ = "0.1.11.1"
"""``<reference API level>.<release>``: the first three parts are the ``transferqueue`` release whose
public API this release implements (:data:`REFERENCE_API_LEVEL`), the fourth counts tq-redis
releases at that level. Code written for the reference gates features on its version (verl turns
its TransferQueue checkpoints on only when ``Version(tq.__version__) >= Version("0.1.9")``), and
``import tq_redis as tq`` must pass those gates as the API they test for. pyproject.toml reads the
package version from here (one source of truth)."""

# public name -> module that defines it
_EXPORTS = {
    "AsyncTransferQueueClient": "tq_redis.client.aio",
    "BatchMeta": "tq_redis.meta",
    "KVBatchMeta": "tq_redis.meta",
    "REFERENCE_API_LEVEL": "tq_redis.integrations.alias",
    "StorageKeyNotFoundError": "tq_redis.errors",
    "install_transfer_queue_alias": "tq_redis.integrations.alias",
    "register_item_class": "tq_redis.codec.item_classes",
    "Channel": "tq_redis.channel.channel",
    "DockMetrics": "tq_redis.dock.dock",
    "GRPOTransferDock": "tq_redis.dock.dock",
    "MMGRPOTransferDock": "tq_redis.dock.multimodal",
    "TransferDock": "tq_redis.dock.dock",
    "StreamingDataLoader": "tq_redis.integrations.dataloader",
    "StreamingDataset": "tq_redis.integrations.dataloader",
    "TransferQueueClient": "tq_redis.client.blocking",
    "load_checkpoint": "tq_redis.api.functions",
    "save_checkpoint": "tq_redis.api.functions",
    "close": "tq_redis.api.system",
    "get_client": "tq_redis.api.system",
    "get_metrics_endpoint": "tq_redis.api.system",
    "init": "tq_redis.api.system",
    **{
        name: "tq_redis.api.functions"
        for base in ("kv_put", "kv_batch_put", "kv_batch_get", "kv_batch_get_by_meta", "kv_list", "kv_clear",
                     "kv_watch", "reserve_group", "commit_group", "abort_group", "extend_reservation",
                     "set_policy_version", "set_staleness_bound", "update_priority", "set_rate_limit",
                     "get_rate_limit")
        for name in (base, f"async_{base}")
    },
    **{
        name: "tq_redis.samplers"
        for name in ("BaseSampler", "SequentialSampler", "GRPOGroupNSampler", "RankAwareSampler",
                     "SeqlenBalancedSampler", "PrioritizedSampler")
    },
}

__all__ = [
    "AsyncTransferQueueClient",
    "BaseSampler",
    "BatchMeta",
    "Channel",
    "DockMetrics",
    "GRPOGroupNSampler",
    "GRPOTransferDock",
    "KVBatchMeta",
    "MMGRPOTransferDock",
    "PrioritizedSampler",
    "REFERENCE_API_LEVEL",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StorageKeyNotFoundError",
    "StreamingDataLoader",
    "StreamingDataset",
    "TransferDock",
    "TransferQueueClient",
    "abort_group",
    "async_abort_group",
    "async_commit_group",
    "async_extend_reservation",
    "async_get_rate_limit",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "async_kv_watch",
    "async_reserve_group",
    "async_set_policy_version",
    "async_set_rate_limit",
    "async_set_staleness_bound",
    "async_update_priority",
    "close",
    "commit_group",
    "extend_reservation",
    "get_client",
    "get_metrics_endpoint",
    "get_rate_limit",
    "init",
    "install_transfer_queue_alias",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "kv_watch",
    "load_checkpoint",
    "register_item_class",
    "reserve_group",
    "save_checkpoint",
    "set_policy_version",
    "set_rate_limit",
    "set_staleness_bound",
    "update_priority",
]




if TYPE_CHECKING:  # for type checkers and IDEs
    from tq_redis.api.functions import (
        abort_group,
        async_abort_group,
        async_commit_group,
        async_extend_reservation,
        async_get_rate_limit,
        async_kv_batch_get,
        async_kv_batch_get_by_meta,
        async_kv_batch_put,
        async_kv_clear,
        async_kv_list,
        async_kv_put,
        async_kv_watch,
        async_reserve_group,
        async_set_policy_version,
        async_set_rate_limit,
        async_set_staleness_bound,
        async_update_priority,
        commit_group,
        extend_reservation,
        get_rate_limit,
        kv_batch_get,
        kv_batch_get_by_meta,
        kv_batch_put,
        kv_clear,
        kv_list,
        kv_put,
        kv_watch,
        load_checkpoint,
        reserve_group,
        save_checkpoint,
        set_policy_version,
        set_rate_limit,
        set_staleness_bound,
        update_priority,
    )
    from tq_redis.api.system import close, get_client, get_metrics_endpoint, init
    from tq_redis.channel.channel import Channel
    from tq_redis.client.aio import AsyncTransferQueueClient
    from tq_redis.client.blocking import TransferQueueClient
    from tq_redis.codec.item_classes import register_item_class
    from tq_redis.dock.dock import DockMetrics, GRPOTransferDock, TransferDock
    from tq_redis.dock.multimodal import MMGRPOTransferDock
    from tq_redis.errors import StorageKeyNotFoundError
    from tq_redis.integrations.alias import REFERENCE_API_LEVEL, install_transfer_queue_alias
    from tq_redis.integrations.dataloader import StreamingDataLoader, StreamingDataset
    from tq_redis.meta import BatchMeta, KVBatchMeta
    from tq_redis.samplers import (
        BaseSampler,
        GRPOGroupNSampler,
        PrioritizedSampler,
        RankAwareSampler,
        SeqlenBalancedSampler,
        SequentialSampler,
    )

if not TYPE_CHECKING:  # type checkers see the imports above instead, so a misspelt name is flagged
    __getattr__, __dir__ = lazy_names(globals(), _EXPORTS)
