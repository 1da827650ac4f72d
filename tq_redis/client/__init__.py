"""The clients: one implementation of each operation, run blocking or awaited.

* :mod:`tq_redis.client.driver` -- :class:`~tq_redis.client.driver.SyncDriver` and
  :class:`~tq_redis.client.driver.AsyncDriver`, which run an operation's effects
  (:mod:`tq_redis.ops.effects`) against Redis and the stores;
* :mod:`tq_redis.client.methods` -- client methods made from operations, typed with ``ParamSpec``;
* :mod:`tq_redis.client.blocking` -- ``TransferQueueClient``; :mod:`tq_redis.client.aio` --
  ``AsyncTransferQueueClient``;
* :mod:`tq_redis.client.config` -- ``init``'s configuration: defaults, environment, the reference's shape;
* :mod:`tq_redis.client.liveness` -- the heartbeat that says a client process is alive.
"""
