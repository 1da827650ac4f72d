"""The module-level API: ``tq.init()`` and the process's default system, and the functions on it.

* :mod:`tq_redis.api.system` -- ``init`` / ``close`` / ``get_client``: the process-wide default client,
  the embedded server and local storage nodes ``init()`` starts, and :func:`~tq_redis.api.system.resolve_target`
  (where a facade finds its Redis URL and namespace);
* :mod:`tq_redis.api.functions` -- the reference system's module-level KV functions (``tq.kv_put`` ...)
  and checkpoints, each running the client method of the same name on the default client;
* :mod:`tq_redis.api.config` -- ``init``'s configuration: defaults, environment, the reference's shape.
"""
