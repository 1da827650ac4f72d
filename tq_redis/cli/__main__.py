"""``python -m tq_redis.cli``: the ``tq-redis`` command."""

from tq_redis.cli.main import main

raise SystemExit(main())
