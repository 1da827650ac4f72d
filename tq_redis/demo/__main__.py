"""``python -m tq_redis.demo``: the demo pipeline."""

from tq_redis.demo.main import main

raise SystemExit(main())
