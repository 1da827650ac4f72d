"""RLinf's ``Channel`` on tq-redis: named FIFO queues shared by every process that knows the name.

* :mod:`tq_redis.channel.channel` -- :class:`~tq_redis.channel.channel.Channel`, the facade;
* :mod:`tq_redis.channel.in_redis` -- a channel kept in Redis: the bounded driver that runs its
  operations (:mod:`tq_redis.ops.channel`) and the jobs it runs;
* :mod:`tq_redis.channel.executor` -- the ordered background work behind ``async_op=True`` calls;
* :mod:`tq_redis.channel.local` -- the in-process channel for a single process.
"""
