"""A dock's metrics: :class:`DockMetrics` (MindSpeed-RL's ``Metric`` contract) and the log of updates.

A dock keeps its metrics in Redis as a list of updates (``...:dockmetrics``, one entry per
``update_metrics`` call; an append is atomic, so concurrent updates are never lost) and rebuilds
them for ``get_metrics`` by replaying every update, in order, on a fresh copy of the ``metrics``
object the dock was given (a :class:`DockMetrics` when none was).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from tq_redis.codec import objects
from tq_redis.errors import InvalidArgument


class DockMetrics:
    """The metrics a dock keeps when it was built without ``metrics=``: MindSpeed-RL's ``Metric`` contract.

    ``metric`` maps a name to its value. ``update(key, value)`` sets one; ``update(value=dict)``
    sets several; with ``cumulate=True`` the values (lists) are appended to what is there (a
    name not there yet starts as a list of them; a name holding a non-list value is replaced).
    """

    def __init__(self) -> None:
        self.metric: dict[str, Any] = {}

    def update(self, key: str = "", value: Any = None, cumulate: bool = False) -> None:
        """Set (or with ``cumulate`` append to) ``key``, or every key of a dict ``value``."""
        pairs = list(value.items()) if isinstance(value, Mapping) else [(key, value)]
        for name, item in pairs:
            if not cumulate:
                self.metric[name] = item
            elif isinstance(self.metric.get(name), list):
                self.metric[name].extend(item)
            elif name in self.metric:
                self.metric[name] = item
            else:
                self.metric[name] = list(item)

    def reset(self) -> None:
        """Forget every metric."""
        self.metric = {}

    def __repr__(self) -> str:
        return f"DockMetrics({getattr(self, 'metric', {})!r})"


def fresh_metrics(template: Any) -> Any:
    """An empty copy of ``template`` (the dock's ``metrics=``), or a :class:`DockMetrics` for None."""
    if template is None:
        return DockMetrics()
    try:
        fresh = copy.deepcopy(template)
    except Exception as exc:  # noqa: BLE001 - the object's own copy hooks: any error means "cannot copy"
        raise InvalidArgument(
            f"the dock's metrics object ({type(template).__name__}) cannot be copied ({exc}); the dock "
            f"rebuilds its metrics on a copy of it, so give a copyable object (or metrics=None)"
        ) from exc
    if callable(getattr(fresh, "reset", None)):
        fresh.reset()
    elif hasattr(fresh, "metric"):
        fresh.metric = {}
    return fresh


def encode_update(template: Any, key: str, value: Any, cumulate: bool, *, allow_pickle: bool) -> bytes:
    """One update as a log entry, once the metrics object accepts it (else ``InvalidArgument``)."""
    if template is not None and not callable(getattr(template, "update", None)):
        raise InvalidArgument(
            f"update_metrics needs a metrics object with update(key, value, cumulate=) like MindSpeed-RL's "
            f"Metric; this dock was built with metrics of type {type(template).__name__}, which has none"
        )
    try:
        fresh_metrics(template).update(key, value, cumulate=cumulate)
    except Exception as exc:  # the metrics object's own check; nothing is recorded
        raise InvalidArgument(
            f"update_metrics({key!r}, {value!r:.60}, cumulate={cumulate}) is rejected by the metrics object "
            f"({exc}); with cumulate=True give a list (or a dict of lists)"
        ) from exc
    return objects.encode_object([key, value, bool(cumulate)], allow_pickle=allow_pickle)


def replay(template: Any, entries: Iterable[bytes], *, allow_pickle: bool) -> Any:
    """A fresh copy of ``template`` with every logged update applied, in order."""
    out = fresh_metrics(template)
    for raw in entries:
        key, value, cumulate = objects.decode_object(raw, allow_pickle=allow_pickle)
        out.update(key, value, cumulate=cumulate)
    return out
