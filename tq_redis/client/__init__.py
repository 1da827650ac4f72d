"""The clients: one implementation of each operation, run blocking or awaited.

* :mod:`tq_redis.client.driver` -- :class:`~tq_redis.client.driver.SyncDriver` and
  :class:`~tq_redis.client.driver.AsyncDriver`, which run an operation's effects
  (:mod:`tq_redis.ops.effects`) against Redis and the stores, carrying out the I/O requests of
* :mod:`tq_redis.client.plans` -- every decision of running an effect, written once: each effect's
  plan as a generator of I/O requests (retries, library reload, BUSY pauses, durable waits);
* :mod:`tq_redis.client.methods` -- client methods made from operations, typed with ``ParamSpec``;
* :mod:`tq_redis.client.blocking` -- ``TransferQueueClient``; :mod:`tq_redis.client.aio` --
  ``AsyncTransferQueueClient``;
* :mod:`tq_redis.client.checkpoint` -- checkpoints of a client's namespace (the blocking Redis, store and
  file I/O; the record format is :mod:`tq_redis.ops.checkpoint`);
* :mod:`tq_redis.client.liveness` -- the heartbeat that says a client process is alive.
"""
