"""Process start method for multi-process tests.

``spawn`` would import torch afresh in every child (seconds each on 2 cores); ``fork`` would
copy the test runner's threads (fakeredis' server thread). A forkserver that preloads torch and
tq_redis once gives clean children quickly.
"""

from __future__ import annotations

import multiprocessing as mp

_ctx = None


def mp_context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(["torch", "tensordict", "numpy", "redis", "tq_redis", "tq_redis.ops"])
    return _ctx
