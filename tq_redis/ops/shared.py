"""Group-shared fields: one value of a field put for a whole group of samples (the prompt or image
of a GRPO group, sent with each of its n samples), stored once and returned for every member.

:func:`put_shared` stores each field's one value under a *carrier* id, a fresh id of the
partition's counter that never becomes a sample (``lua/includes/shares.lua``), and one script
(``lua/share_put.lua``) points every member at it and marks the field produced for them. Small
values travel with that script (one round trip); larger ones go to the store first, under a
carrier ``lua/share_begin.lua`` allocated and marked pending (data first, then bits; a writer
killed in between leaves them for ``clear_partition``). ``get_data`` resolves members to their
carrier in ``lua/read_inline.lua``; a carrier's references are counted and dropped atomically by
``clear`` (and by a rewrite of a member's field), and the last one sends its bytes to the trash.
"""

from __future__ import annotations

from typing import Any

from tq_redis.errors import BatchSizeMismatch, InvalidArgument
from tq_redis.meta import BatchMeta
from tq_redis.ops import arguments, script_budget, transitions
from tq_redis.ops.clear import discard_bytes
from tq_redis.ops.context import Context, Op, group_by_partition, storage
from tq_redis.ops.data import as_tensordict, encode_batch, inline_payload, with_fields
from tq_redis.ops.effects import Offload


def put_shared(ctx: Context, data: Any, metadata: BatchMeta) -> Op[BatchMeta]:
    """Put ``data``'s fields once as the value of every sample of ``metadata`` (a group of one
    partition): ``data`` is a TensorDict (or dict) of one row. The bytes are stored once; every
    member's ``get_data`` returns the value, and it is deleted when the last member is cleared.
    The members must not have these fields yet. Returns the metadata with the fields added."""
    arguments.batch_meta(metadata, "put_shared")
    if metadata.size == 0:
        raise InvalidArgument("put_shared() got an empty BatchMeta; pass the group's samples")
    groups = group_by_partition(metadata)
    if len(groups) != 1:
        raise InvalidArgument(
            f"put_shared() shares a value within one partition; the metadata spans {sorted(groups)}: "
            f"call it once per partition (metadata.chunk_by_partition())"
        )
    ids = list(metadata.global_indexes)
    if len(set(ids)) != len(ids):
        raise InvalidArgument("put_shared() got a sample twice in the metadata; pass each member once")
    if len(ids) > script_budget.SCRIPT_ITEMS:
        raise InvalidArgument(
            f"put_shared() shares a value among at most {script_budget.SCRIPT_ITEMS} samples, got {len(ids)}"
        )
    td = as_tensordict(data)
    if td.batch_size[0] != 1:
        raise BatchSizeMismatch(
            f"put_shared() takes one row (the value every member shares), got {td.batch_size[0]}; "
            f"pass data[0:1], or a dict of values with a batch dimension of 1"
        )
    schemas, values = encode_batch(ctx, td)
    pk = ctx.keys(next(iter(groups)))
    store = yield from storage(ctx)
    inline = inline_payload(values, store.inline_max_bytes)
    if inline is not None:  # small values: carrier, values and bits in one script
        store.count_inline("put", inline)
        yield from transitions.share_put(pk, ids, schemas, ctx.strict_schema, inline_values=inline).call()
        return with_fields(metadata, schemas)
    carrier = yield from transitions.share_begin(pk, schemas, ctx.strict_schema).call()
    ring: str | None = None
    try:
        ring = yield Offload(store.put, (pk, [carrier], values))
        yield from transitions.share_put(pk, ids, schemas, ctx.strict_schema, carrier=carrier, ring=ring).call()
    except Exception as exc:
        # nothing points at the carrier: its bytes go (through the trash if the delete fails)
        note = yield from discard_bytes(store, pk, [carrier], list(schemas), ring)
        if note:
            exc.add_note(note)
        raise
    return with_fields(metadata, schemas)
