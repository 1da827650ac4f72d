"""Replay: the priorities :class:`~tq_redis.samplers.PrioritizedSampler` draws by.

A sample's priority is its ``priority`` tag (custom meta), so it goes wherever tags go: it comes
back in ``get_meta``'s custom meta, and it is cleared with the sample. :func:`update_priority`
writes it with the tag script (``lua/set_tags.lua``), which refuses ids that are not alive.
``max_times_sampled`` (replay counts) lives in the claim script (``lua/includes/replay.lua``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from tq_redis.errors import BatchSizeMismatch, InvalidArgument
from tq_redis.ops import arguments, script_budget, transitions
from tq_redis.ops.context import Context, Op

PRIORITY_TAG = "priority"
"""The tag PrioritizedSampler reads (lua/includes/priority.lua)."""


def _priorities(value: Any) -> list[float]:
    if hasattr(value, "tolist") and getattr(value, "ndim", 1) in (0, 1):  # numpy array / tensor
        value = value.tolist()
        if not isinstance(value, list):
            value = [value]
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidArgument(f"priorities must be a list of numbers, got {type(value).__name__} {value!r:.80}")
    out: list[float] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | float) or not math.isfinite(item) or item <= 0:
            raise InvalidArgument(f"priorities must be finite numbers > 0, got {item!r:.80}")
        out.append(float(item))
    return out


def update_priority(ctx: Context, partition_id: str, global_indexes: Any, priorities: Any) -> Op[None]:
    """Set the priorities of samples ``global_indexes`` of ``partition_id`` (one finite number > 0
    each): :class:`~tq_redis.samplers.PrioritizedSampler` then draws them in proportion to
    ``priority ** alpha``. Atomic per call of up to 512 samples (a bigger one goes in pieces).
    Raises ``UnknownPartition`` / ``SampleNotFound`` for a partition or ids that do not exist
    (nothing of that piece is written)."""
    pk = ctx.keys(partition_id)
    ids = arguments.ids(global_indexes)
    values = _priorities(priorities)
    if len(values) != len(ids):
        raise BatchSizeMismatch(f"update_priority() got {len(values)} priorities for {len(ids)} global_indexes")
    rows = [{PRIORITY_TAG: v} for v in values]
    for piece in script_budget.slices(len(ids)):
        yield from transitions.set_tags(pk, ids[piece], [PRIORITY_TAG], rows[piece]).call()
