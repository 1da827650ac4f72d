"""What an operator looks at.

* :mod:`tq_redis.monitor.status` -- a read-only snapshot of a namespace (``tq-redis status``);
* :mod:`tq_redis.monitor.status_view` -- how ``tq-redis status`` draws it (rich tables or plain text);
* :mod:`tq_redis.monitor.exporter` -- the Prometheus exporter and its scrape-time collector (the
  instruments the drivers and stores record into are in :mod:`tq_redis.instruments`), and the
  standalone ``tq-redis exporter``;
* :mod:`tq_redis.monitor.dashboard` -- ``tq-redis dashboard``, a live read-only web page;
* :mod:`tq_redis.monitor.namespaces` -- the namespaces on a server: find, size and drop them.
"""
