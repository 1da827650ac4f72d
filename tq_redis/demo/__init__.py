"""``tq-redis demo``: a rollout/reward/train pipeline on the embedded default, with a report.

:mod:`tq_redis.demo.main` runs it (``python -m tq_redis.demo`` too); :mod:`~tq_redis.demo.config`,
:mod:`~tq_redis.demo.workload`, :mod:`~tq_redis.demo.stages`, :mod:`~tq_redis.demo.pipeline` and
:mod:`~tq_redis.demo.report` are its parts. Needs the ``[demo]`` extra (rich, matplotlib).
"""
