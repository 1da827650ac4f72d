"""MindSpeed-RL's ``TransferDock`` / ``GRPOTransferDock`` on tq-redis.

* :mod:`tq_redis.dock.dock` -- the docks users build;
* :mod:`tq_redis.dock.base` -- what both share (a namespace, a partition per dock, experience columns);
* :mod:`tq_redis.dock.layout` -- MindSpeed's column and consumer names mapped onto fields and tasks;
* :mod:`tq_redis.dock.metrics` -- ``DockMetrics``;
* :mod:`tq_redis.dock.aging` -- MindSpeed's partial rollout (``max_age > 1``): rows that age across
  steps, are handed back to ``actor_rollout`` until finished and re-sorted oldest first by ``clear``
  (not to be confused with :mod:`tq_redis.ops.partial`, a field appended in parts).
"""
