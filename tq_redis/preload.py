"""Do once, in a parent process, the work every process that attaches to tq-redis repeats.

``import tq_redis`` is lazy: it imports nothing more until a name is used, so a forkserver or a
zygote that preloads it preloads almost nothing, and each rank it starts imports the client stack
and builds the function library's source itself (about 2 s here without bytecode caches). Preload
this module instead and a rank's ``init()`` or ``TransferQueueClient(url, namespace)`` is a few
round trips to Redis::

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensordict", "tq_redis.preload"])

For Ray workers, name it in ``runtime_env={"worker_process_setup_hook": "tq_redis.preload.warm"}``.
"""

from __future__ import annotations

import importlib

from tq_redis.server import library

__all__ = ["warm"]

#: the modules ``init()``, ``TransferQueueClient`` and the module-level functions use
CLIENT_STACK = ("tq_redis.api.system", "tq_redis.api.functions", "tq_redis.client.aio")


def warm() -> None:
    """Import the client stack and build the function library's source and version (cached)."""
    for name in CLIENT_STACK:
        importlib.import_module(name)
    library.library()


warm()
