"""Where tq-redis meets other systems' code.

* :mod:`tq_redis.integrations.alias` -- the ``transfer_queue`` alias: the reference system's imports
  resolve to tq-redis (``install_transfer_queue_alias``, ``python -m tq_redis.integrations.alias --pythonpath``);
* :mod:`tq_redis.integrations.controller` -- the alias's ``init``/``close`` and the controller actor the
  reference's Ray code looks for (a read-only inspector of the Redis state);
* :mod:`tq_redis.integrations.dataloader` -- ``StreamingDataset`` / ``StreamingDataLoader``;
* :mod:`tq_redis.integrations.ray_placement` -- one storage node per Ray node.
"""
