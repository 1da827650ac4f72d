"""Start a local Ray for a test that survives a slow start on a busy machine.

``ray.init`` gives its raylet a fixed 30 s to register with the GCS, then raises "The current node
timed out during startup ... or the GCS has become overloaded". On two cores busy with other tests
that can happen although nothing is wrong, so a start that times out is shut down and tried again
(three tries in all); any other failure, or a third time-out, is raised as it is.
"""

from __future__ import annotations

import os
from typing import Any

_TRIES = 3


def _startup_timed_out(exc: BaseException) -> bool:
    return "timed out during startup" in str(exc)


def init_local_ray(**options: Any) -> None:
    """``ray.init(address="local", **options)``, tried again when Ray only timed out starting."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    options.setdefault("address", "local")
    for attempt in range(1, _TRIES + 1):
        try:
            ray.init(**options)
            return
        except Exception as exc:
            if attempt == _TRIES or not _startup_timed_out(exc):
                raise
            ray.shutdown()
