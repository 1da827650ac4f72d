"""The data-plane stores, one module each (``dram/`` a subpackage of its own), looked up by name.

The store interface and the registry these names come from are :mod:`tq_redis.storage.base`; they
are public here, where users register their own stores (``tq_redis.backends.register_store``).
"""

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
