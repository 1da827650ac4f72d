"""Watching tags instead of polling ``kv_list``: the keys whose tags changed since a cursor.

Every script that writes tags (``lua/set_tags.lua``, a group commit) appends one entry to the
partition's capped change stream ``<p>:tagchanges`` naming the samples it changed; a put of
fields and tags notes the change once the fields are produced, so a watcher that reads a key
finds its fields. :func:`kv_watch` runs ``lua/tag_changes.lua`` from a cursor (a stream id): it
returns the changed keys that are alive and whose tags match ``where`` now, and the cursor to go
on from. When nothing came, the client blocks on the stream (``XREAD BLOCK`` from that cursor)
until a change arrives or the timeout passes, then reads again: no polling, and nothing missed
between the read and the wait.

Each change is returned once: a caller that always goes on from the returned cursor sees every
change exactly once (a key changed twice before a read is returned once, with its tags as they
are now). A cursor whose successors were trimmed away (the stream keeps about 10,000 changes),
or one taken before the partition was cleared, raises :class:`~tq_redis.errors.WatchCursorExpired`
carrying the newest cursor: list the partition again and watch on from there.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tq_redis.errors import InvalidArgument, WatchCursorExpired
from tq_redis.ops import arguments, script_budget, transitions
from tq_redis.ops.context import Context, Op
from tq_redis.ops.effects import Wait
from tq_redis.ops.kv import RESOLVE_COST, conditions

_CURSOR = re.compile(r"\d{1,20}-\d{1,20}")


@dataclass(frozen=True)
class TagChanges:
    """What :func:`kv_watch` returns: the changed samples, in order of their first change since
    the cursor, and the cursor to watch on from (also when nothing changed)."""

    partition_id: str
    cursor: str
    keys: list[str | None] = field(default_factory=list)  # None: a sample put without a user key
    global_indexes: list[int] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)  # each sample's tags as they are now

    def __len__(self) -> int:
        return len(self.global_indexes)

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(key, tags)`` of the changed samples that have a user key."""
        return ((k, t) for k, t in zip(self.keys, self.tags) if k is not None)


def kv_watch(
    ctx: Context,
    partition_id: str,
    cursor: str | None = None,
    *,
    timeout: float = 0.0,
    where: dict[str, Any] | None = None,
) -> Op[TagChanges]:
    """The keys of ``partition_id`` whose tags changed after ``cursor`` (None: from now), waiting
    up to ``timeout`` seconds for a change if there is none yet; with ``where`` ({tag: value}),
    only the keys whose tags now have those values. Returns :class:`TagChanges` (empty after the
    timeout) whose ``cursor`` the next call goes on from.

    Raises:
        WatchCursorExpired: the changes after ``cursor`` were trimmed, or the partition was
            cleared since; ``.cursor`` is the newest one (list the partition again, then watch on).
        InvalidArgument: a cursor that is no stream id, a negative timeout, a bad ``where``.
    """
    pk = ctx.keys(partition_id)
    wait_s = arguments.seconds(timeout, "kv_watch: timeout")
    assert wait_s is not None
    filters = conditions(where, "kv_watch")
    if cursor is None:
        cursor = ""
    elif not isinstance(cursor, str) or not _CURSOR.fullmatch(cursor):
        raise InvalidArgument(
            f"kv_watch: cursor must be the cursor of an earlier kv_watch (like '1700000000000-0') or None "
            f"to start from now, got {cursor!r:.80}"
        )
    deadline = time.monotonic() + wait_s
    budget = script_budget.piece_size(RESOLVE_COST)
    while True:
        got = yield from transitions.tag_changes(pk, cursor, budget, filters).call()
        if got.expired:
            raise WatchCursorExpired(
                f"kv_watch: cursor {cursor!r} of partition {partition_id!r} expired (its changes were "
                f"trimmed from the capped change stream, or the partition was cleared since); list it "
                f"again with kv_list and watch on from the cursor {got.cursor!r} this error carries",
                cursor=got.cursor,
            )
        cursor = got.cursor
        if got.ids:
            return TagChanges(partition_id, cursor, got.keys, got.ids, got.tags)
        if got.more:  # changes that did not match the filter: read on at once
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return TagChanges(partition_id, cursor)
        yield Wait(pk.tagchanges, cursor, remaining)
