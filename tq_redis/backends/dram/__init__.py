"""The DRAM store: tq-redis's own storage-node processes, sharded by key, shared memory on one host.

Client side: :mod:`~tq_redis.backends.dram.store` (``DramStore``), :mod:`~tq_redis.backends.dram.discovery`
(the live node set from Redis), :mod:`~tq_redis.backends.dram.placement` (key -> node),
:mod:`~tq_redis.backends.dram.pool` and :mod:`~tq_redis.backends.dram.parallel` (connections, one
request per node at once), :mod:`~tq_redis.backends.dram.replies` and :mod:`~tq_redis.backends.dram.values`.
Node side: :mod:`~tq_redis.backends.dram.server` (``tq-redis node``), :mod:`~tq_redis.backends.dram.session`,
:mod:`~tq_redis.backends.dram.handlers`, :mod:`~tq_redis.backends.dram.node` (the memory), and
:mod:`~tq_redis.backends.dram.spill`. Both: :mod:`~tq_redis.backends.dram.protocol` (the wire protocol)
and :mod:`~tq_redis.backends.dram.launcher` (starting nodes).
"""
