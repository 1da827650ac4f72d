"""The Redis/Valkey server: reaching it, what it must hold, and starting one.

* :mod:`tq_redis.server.connections` -- one Redis client per URL (single server, Cluster, Sentinel via
  :mod:`tq_redis.server.sentinel`), with reconnects;
* :mod:`tq_redis.server.library` -- loading and checking the Lua function library (``tq_redis/lua``);
* :mod:`tq_redis.server.policy` -- what tq-redis requires of a server it shares;
* :mod:`tq_redis.server.durability` -- durable mode (``WAIT`` / ``WAITAOF``);
* :mod:`tq_redis.server.acl` -- per-namespace ACL users;
* :mod:`tq_redis.server.registry` -- the storage-node registry: read with the server's clock, gone nodes forgotten;
* :mod:`tq_redis.server.embedded`, :mod:`tq_redis.server.embedded_cluster`,
  :mod:`tq_redis.server.spawner`, :mod:`tq_redis.server.leftovers` -- the embedded Valkey ``init()``
  starts, the children that die with their parent, and what a killed job left behind;
* :mod:`tq_redis.server.ray_discovery` -- the server a Ray job published for its processes.
"""
