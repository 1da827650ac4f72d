"""RLinf's ``Channel`` on tq-redis: named FIFO queues shared by every process that knows the name.

* :mod:`tq_redis.channel.channel` -- :class:`~tq_redis.channel.channel.Channel`, the facade;
* :mod:`tq_redis.channel.driver` -- runs a channel's operations (:mod:`tq_redis.ops.channel`) on Redis;
* :mod:`tq_redis.channel.executor` -- the ordered background work behind ``async_op=True`` calls;
* :mod:`tq_redis.channel.local` -- the in-process channel for a single process.
"""
