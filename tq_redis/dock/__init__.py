"""MindSpeed-RL's ``TransferDock`` / ``GRPOTransferDock`` on tq-redis.

* :mod:`tq_redis.dock.dock` -- the docks users build;
* :mod:`tq_redis.dock.base` -- what both share (a namespace, a partition per dock, experience columns);
* :mod:`tq_redis.dock.layout` -- MindSpeed's column and consumer names mapped onto fields and tasks;
* :mod:`tq_redis.dock.metrics` -- ``DockMetrics``.
"""
