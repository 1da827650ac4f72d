"""Data-plane stores (installed as ``tq_redis.backends``): one module per store, looked up by name."""

from tq_redis.storage.base import (
    StorageClient,
    StoreContext,
    create_store,
    join_segments,
    register_store,
    registered_stores,
    store_class,
)

__all__ = [
    "StorageClient",
    "StoreContext",
    "create_store",
    "join_segments",
    "register_store",
    "registered_stores",
    "store_class",
]
