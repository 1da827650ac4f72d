"""``get_meta_and_data``: claim a batch and read its data, one round trip for small values.

``get_meta(mode="fetch")`` followed by ``get_data`` costs two round trips even when every value
is inline: the claim, then ``read_inline`` (which checks again that the samples are alive). Here
the ``claim`` script returns the batch's inline values in the same atomic step that hands the
samples out, so they are the values of live, produced samples at that instant and need no second
check. Values that live in a store are read from it afterwards and checked against the bits, as
``get_data`` does (bytes before bits). A user sampler claims through ``claim_ids``, which returns
no values; its batch is read with ``get_data``.

Only the combined call can do this: a ``get_data(meta)`` later must not return values the claim
saw, because the partition may have been cleared in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from tq_redis.meta import BatchMeta
from tq_redis.ops import arguments
from tq_redis.ops.claim import fetch
from tq_redis.ops.context import Context, Op, check_fields, storage
from tq_redis.ops.data import decode_batch, fill_from_store
from tq_redis.ops.partial import get_data, parts_fields


def get_meta_and_data(
    ctx: Context,
    data_fields: Sequence[str],
    batch_size: int,
    partition_id: str,
    *,
    task_name: str | None = None,
    sampling_config: dict[str, Any] | None = None,
    timeout: float = 0.0,
    lease_s: float | None = None,
    max_deliveries: int | None = None,
) -> Op[tuple[BatchMeta, TensorDict]]:
    """``(meta, data)``: ``get_meta(mode="fetch")`` of these arguments and ``get_data`` of the
    batch it claimed, in one round trip when the values are inline. An empty claim returns an
    empty ``BatchMeta`` and an empty TensorDict."""
    fields = check_fields(data_fields)
    batch_size = arguments.count(batch_size, "batch_size")
    pk = ctx.keys(partition_id)
    values: dict[str, list[bytes | None]] = {}
    meta: BatchMeta = yield from fetch(
        ctx, fields, batch_size, pk, task_name, sampling_config, timeout, lease_s, max_deliveries, values
    )
    return meta, (yield from read_claimed(ctx, meta, values))


def read_claimed(ctx: Context, meta: BatchMeta, values: dict[str, list[bytes | None]]) -> Op:
    """The data of a batch :func:`tq_redis.ops.claim.fetch` just claimed of one partition, from
    the inline ``values`` its claim returned (field -> value per sample, None where a value lives
    in a store): store values are read and checked against the bits; with no ``values`` (a user
    sampler's claim) the whole batch is read with ``get_data``."""
    if meta.size == 0:
        return TensorDict({}, batch_size=[0])
    if not values or parts_fields(meta):
        return (yield from get_data(ctx, meta))
    ids = list(meta.global_indexes)
    store = yield from storage(ctx)
    for column in values.values():
        store.count_inline("get", column)
    if any(None in column for column in values.values()):
        values = yield from fill_from_store(store, ctx.keys(meta.partition_ids[0]), ids, values)
    return decode_batch(ctx, list(values), values, len(ids))
