# --- tq-redis's part for RLinf's test_channel.py (appended to alias_conftest.py's by tests/compat/user_suites.py)
"""RLinf's channel tests with tq-redis's Channel in place of RLinf's.

Before the test module imports ``rlinf.scheduler``, ``rlinf.scheduler.Channel`` (and the names it is
re-exported under) becomes :class:`tq_redis.Channel`, on an embedded Valkey this process starts; its
URL goes to the environment, so the Ray workers RLinf's ``Cluster`` starts attach to it. Nothing
is registered and nothing is pickled: the dataclasses the test module defines travel on the default
rule (classes the program defines, :mod:`tq_redis.codec.item_classes`), in the test process and in
the Ray workers, which load the test module by name to run its Worker classes.

The test file's ``DistributedChannel`` subclass builds itself RLinf's private way (``cls()``, then
``_initialize(...)`` with channel actors it launched on one node), so the class put in place also
takes that way: it makes the Redis channel of that name, and records the actors as RLinf does
(a channel in Redis needs none: every node reaches it).
"""

import atexit as _atexit
import os as _os

import rlinf.scheduler as _rlinf_scheduler
import rlinf.scheduler.channel as _rlinf_channel

import tq_redis as _tq

_cfg = _tq.init()
_os.environ["TQ_REDIS_URL"], _os.environ["TQ_NAMESPACE"] = _cfg["redis"]["url"], _cfg["namespace"]
_atexit.register(_tq.close)


class _Channel(_tq.Channel):
    """tq_redis.Channel, also built in RLinf's two steps."""

    def __init__(self, *args, **kwargs):
        if args or kwargs:
            super().__init__(*args, **kwargs)

    def _initialize(self, channel_name, channel_worker_group=None, channel_worker_actor=None, current_worker=None,
                    local_channel=None, maxsize=0, channel_actors=None):
        made = _tq.Channel.create.__func__(_Channel, channel_name, maxsize, local=local_channel is not None)
        self.__dict__.update(made.__dict__)
        self._exec = None  # this object opens its own connections; made's close with it
        self._distributed = channel_actors is not None and len(channel_actors) > 1
        self._channel_actors_by_rank = dict(channel_actors or {})


for _module in (_rlinf_scheduler, _rlinf_channel):
    _module.Channel = _Channel

