"""The ``tq-redis`` command: ``up``, ``node``, ``status``, ``namespaces``, ``demo`` ...

:mod:`tq_redis.cli.main` parses the command line; :mod:`tq_redis.cli.namespaces` holds the
``namespaces`` subcommands. ``python -m tq_redis.cli`` runs it too.
"""
