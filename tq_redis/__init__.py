"""tq-redis: a controller-less, sample-level data gateway for LLM RL post-training.

Switch from TransferQueue with one import: ``import tq_redis as tq``.
"""

from tq_redis.channel import Channel
from tq_redis.client import AsyncTransferQueueClient
from tq_redis.dataloader import StreamingDataLoader, StreamingDataset
from tq_redis.kv import (
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
)
from tq_redis.metadata import BatchMeta, KVBatchMeta
from tq_redis.runtime import close, get_client, get_metrics_endpoint, init
from tq_redis.sync import TransferQueueClient

__version__ = "0.1.0"

__all__ = [
    "AsyncTransferQueueClient",
    "BatchMeta",
    "Channel",
    "KVBatchMeta",
    "StreamingDataLoader",
    "StreamingDataset",
    "TransferQueueClient",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
]
