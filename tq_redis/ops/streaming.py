"""Streaming reads: seal a partition, and claim a task's next batch until the partition is drained.

A producer calls ``seal_partition`` when no more samples will be inserted (``lua/seal_partition``
sets ``sealed`` in the partition's meta hash and emits an event, waking every blocked reader).
:func:`next_batch` is what each rank's loader runs: claim a batch; if none is ready, read the
partition's :func:`progress` and either end (sealed and drained) or block on the event stream
(XREAD BLOCK) until something changes. Nothing polls or sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tq_redis.meta import BatchMeta
from tq_redis.meta.keys import check_name, partitions_key
from tq_redis.ops import arguments, transitions
from tq_redis.ops.claim import fetch
from tq_redis.ops.context import Context, Op, check_fields
from tq_redis.ops.effects import Cmd, Wait
from tq_redis.ops.transitions import Progress

WAIT_SLICE_S = 5.0
"""Longest single XREAD BLOCK while waiting without a deadline (the loop re-checks after it)."""


def seal_partition(ctx: Context, partition_id: str) -> Op:
    """Mark the partition sealed (creating it if needed); True if this call sealed it."""
    pk = ctx.keys(partition_id)
    sealed, _ = yield from transitions.pipeline(
        transitions.seal_partition(pk), Cmd(("ZADD", partitions_key(ctx.namespace), "NX", time.time(), partition_id))
    )
    return sealed


def reopen_partition(ctx: Context, partition_id: str) -> Op:
    """Let a partition that was sealed and then cleared be created again (by the next put): until
    then puts into it raise ``PartitionClosed``. True if it was closed; a no-op otherwise."""
    pk = ctx.keys(partition_id)
    removed = yield Cmd(("DEL", pk.closed))
    return bool(removed)


def progress(ctx: Context, partition_id: str, task_name: str, fields: Sequence[str] = ()) -> Op:
    """The partition's :class:`Progress` for ``task_name`` reading ``fields``."""
    check_name("task_name", task_name)
    fields = [check_name("field name", f) for f in fields]
    state: Progress = yield from transitions.progress(ctx.keys(partition_id), task_name, fields).call()
    return state


def wait_for_event(ctx: Context, partition_id: str, last_event_id: str, timeout_s: float) -> Op:
    """Block until the partition's event stream moves past ``last_event_id`` or the timeout passes."""
    yield Wait(ctx.keys(partition_id).events, last_event_id, timeout_s)


def next_batch(
    ctx: Context,
    data_fields: Sequence[str],
    batch_size: int,
    partition_id: str,
    task_name: str,
    sampling_config: dict[str, Any] | None = None,
    *,
    drop_last: bool = False,
    end_when_consumed: bool = False,
    timeout: float | None = None,
    values: dict[str, list[bytes | None]] | None = None,
) -> Op:
    """Claim ``task_name``'s next batch of ``partition_id``, waiting for data as long as needed.
    ``values``: a dict that receives the batch's inline values with the claim (see
    :func:`tq_redis.ops.batch.read_claimed`, which reads the batch from them).

    Returns ``None`` when the stream has ended: the partition is sealed and the task consumed
    every sample, or (``end_when_consumed``) every sample present is consumed, or what is left
    can never form a batch (sealed, all of it ready, and fewer than ``batch_size`` with
    ``drop_last``, or a sampler that refuses it). With ``drop_last=False`` the last batch of a
    sealed partition may be smaller than ``batch_size``. Raises ``TimeoutError`` if ``timeout``
    seconds pass without a batch.
    """
    timeout = arguments.seconds(timeout, "timeout", allow_none=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    fields = check_fields(data_fields)
    batch_size = arguments.count(batch_size, "batch_size")
    pk = ctx.keys(partition_id)
    previous: Progress | None = None
    while True:
        # Progress first: any change after it emits an event after last_event_id, so the wait
        # below cannot miss what the claim did not see.
        state = yield from progress(ctx, partition_id, task_name, fields)
        meta: BatchMeta = yield from fetch(ctx, fields, batch_size, pk, task_name, sampling_config, values=values)
        if meta.size:
            return meta
        if state.drained or (end_when_consumed and state.alive and state.pending == 0):
            return None
        if state.settled:
            if not drop_last and 0 < state.ready < batch_size:
                meta = yield from fetch(ctx, fields, state.ready, pk, task_name, sampling_config, values=values)
                if meta.size:
                    return meta
            if previous == state:
                return None  # a second look saw the same: what is left cannot form a batch
            previous = state
            continue
        previous = None
        remaining = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"no batch of {batch_size} for task {task_name!r} in partition {partition_id!r} "
                f"within {timeout}s ({state.ready} ready, {state.pending} pending)"
            )
        yield from wait_for_event(ctx, partition_id, state.last_event_id, min(remaining, WAIT_SLICE_S))

