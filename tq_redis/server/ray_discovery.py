"""Find the tq-redis system of the current Ray job, as the reference finds its controller actor.

The first ``init()`` of a Ray job that starts a system (no Redis URL given) publishes where it is
(the Redis URL and namespace) in Ray's internal key-value store under a key of the job's id. An
argument-less ``init()`` in any other process of that job (a Ray task or actor, verl's workers)
finds it there and attaches instead of starting a second embedded Valkey.

Ray is never imported here: a process that has not imported it is not inside a Ray job.
"""

from __future__ import annotations

import json
import sys
from typing import Any

_KEY_PREFIX = "tq_redis:system:"
_NAMESPACE = "tq_redis"


def _ray_ready() -> Any | None:
    """The ``ray`` module when this process is connected to a Ray job, else None."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        from ray.experimental import internal_kv

        return ray if internal_kv._internal_kv_initialized() else None
    except Exception:  # a half-shut-down Ray: behave as outside Ray
        return None


def _key(ray: Any) -> bytes:
    return (_KEY_PREFIX + ray.get_runtime_context().get_job_id()).encode()


def lookup() -> dict[str, str] | None:
    """``{"url", "namespace"}`` of the system this Ray job published, or None."""
    ray = _ray_ready()
    if ray is None:
        return None
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_key(ray), namespace=_NAMESPACE)
    return json.loads(raw) if raw else None


def publish(url: str, namespace: str) -> dict[str, str] | None:
    """Publish this process's system for the Ray job; returns another one published first, or None.

    Two processes that both started a system race here: the first to publish wins, the other
    gets the winner back and should stop its own and attach.
    """
    ray = _ray_ready()
    if ray is None:
        return None
    from ray.experimental import internal_kv

    value = json.dumps({"url": url, "namespace": namespace}).encode()
    existed = internal_kv._internal_kv_put(_key(ray), value, overwrite=False, namespace=_NAMESPACE)
    if not existed:
        return None
    return lookup()


def withdraw(url: str) -> None:
    """Remove the job's published system if it is the one at ``url`` (on ``close()``)."""
    ray = _ray_ready()
    if ray is None:
        return
    from ray.experimental import internal_kv

    try:
        current = lookup()
        if current is not None and current.get("url") == url:
            internal_kv._internal_kv_del(_key(ray), namespace=_NAMESPACE)
    except Exception:  # Ray shutting down: the key dies with the job anyway
        return
