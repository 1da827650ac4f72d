"""The data plane's interface: what every store implements, the store registry, and the manager.

* :mod:`tq_redis.storage.base` -- :class:`~tq_redis.storage.base.StorageClient` and the registry
  (``register_store``, looked up by name; the stores themselves are in :mod:`tq_redis.backends`);
* :mod:`tq_redis.storage.manager` -- :class:`~tq_redis.storage.manager.KVStorageManager`: maps
  (partition, sample, field) to store keys and moves a batch's values.
"""
