"""Whether a namespace exists on a server, said the way a user who mistyped it needs to hear it.

``tq-redis status``, ``exporter``, ``dashboard`` and ``namespace drop`` of a namespace with no keys would
otherwise show (or drop) an empty namespace and exit 0: a typo would look like "no data yet".
"""

from __future__ import annotations

from typing import Any

import redis

from tq_redis import names
from tq_redis.errors import InvalidName

__all__ = ["find", "unknown_namespace"]

#: namespace-level keys; a namespace with keys has at least one of them
_MARKERS = ("config", "partitions", "partitions:kept", "channels", "clients", "storage:nodes")

_SHOWN = 20  # known namespaces a message lists


def find(r: Any) -> list[str]:
    """Every namespace that has keys on ``r``'s server (every primary of a cluster)."""
    found: set[str] = set()
    for marker in _MARKERS:
        for key in r.scan_iter(match=f"*:{marker}", count=1000):
            text = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            try:
                found.add(names.namespace(text[: -len(marker) - 1]))
            except InvalidName:  # some other application's key that happens to end like ours
                continue
    return sorted(found)


def exists(r: Any, ns: str) -> bool:
    """Whether namespace ``ns`` has keys on ``r``'s server: EXISTS of its namespace-level keys, which a
    namespace's own ACL user may run (it may not SCAN)."""
    return any(r.exists(f"{names.namespace(ns)}:{marker}") for marker in _MARKERS)


def unknown_namespace(r: Any, ns: str, *, hint: str = "") -> str | None:
    """None when namespace ``ns`` has keys on ``r``'s server; else one line saying it has none and
    naming the namespaces that do (``hint``: what to do if it is right, appended). The listing needs
    SCAN; a user refused it gets the line without the listing."""
    if exists(r, ns):
        return None
    try:
        known = find(r)
    except redis.exceptions.NoPermissionError:
        return f"no namespace {ns!r} on this server; check --namespace or TQ_NAMESPACE{hint}"
    listed = ", ".join(repr(n) for n in known[:_SHOWN])
    if len(known) > _SHOWN:
        listed += f", ... ({len(known)} in all)"
    found = f"known namespaces: {listed}" if known else "the server holds no tq-redis namespace"
    return f"no namespace {ns!r} on this server ({found}); check --namespace or TQ_NAMESPACE{hint}"
