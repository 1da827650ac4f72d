"""tq-redis: a controller-less, sample-level data gateway for LLM RL post-training.

Switch from TransferQueue with one import: ``import tq_redis as tq``.
"""

from tq_redis.client import AsyncTransferQueueClient
from tq_redis.metadata import BatchMeta, KVBatchMeta
from tq_redis.runtime import close, get_client, init
from tq_redis.sync import TransferQueueClient

__version__ = "0.1.0"

__all__ = [
    "AsyncTransferQueueClient",
    "BatchMeta",
    "KVBatchMeta",
    "TransferQueueClient",
    "close",
    "get_client",
    "init",
]
