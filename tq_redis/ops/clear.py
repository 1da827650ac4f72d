"""Clearing operations: remove samples or a whole partition, and delete their bytes via the trash.

Bits are cleared *before* bytes are deleted: the script that clears a sample's bits puts its id in
the partition's trash (``ns:{p}:trash``), and the id leaves the trash only once the store has
deleted its bytes. So when a store is unreachable, or the client dies, in between, the bytes wait
in the trash and the next clear of those samples (or of the partition) deletes them; a put that
fails after writing part of its batch cleans up the same way (:func:`discard_bytes`). Deletes go
to every node the partition's values were put on (the rings the scripts return), wherever the
store's live ring is now; a node unreachable at that moment gets them when it is back (the store
records them in Redis).
"""

from __future__ import annotations

import time

from tq_redis.errors import RedisOutOfMemory
from tq_redis.meta import BatchMeta, bitmaps
from tq_redis.meta.keys import PartitionKeys, kept_partitions_key, partitions_key
from tq_redis.ops import arguments, script_budget, transitions
from tq_redis.ops.context import Context, Op, group_by_partition, storage
from tq_redis.ops.effects import Cmd, Offload, Pipe
from tq_redis.ops.encoding import text
from tq_redis.storage.manager import KVStorageManager

CLEAR_COST = 4
"""The script work of clearing one sample, in items (tq_redis.ops.script_budget): its alive, trash,
produced and consumed bits, its inline values, tags, leases and delivery counts."""


def clear_samples(ctx: Context, metadata: BatchMeta) -> Op:
    """Remove samples (bits first, then bytes). Idempotent.

    If a store is unreachable the bytes stay in the partition's trash (in Redis) and the error is
    raised; clearing the same samples again, or the partition, deletes them.
    """
    arguments.batch_meta(metadata, "clear_samples")
    store = yield from storage(ctx)
    for pid, positions in group_by_partition(metadata).items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        # A big batch is cleared in pieces (each sample's bits, tags and leases go together, and
        # into the trash), then its bytes are deleted at once.
        gone: list[int] = []
        fields: set[str] = set()
        rings: set[str] = set()
        older = 0
        for piece in script_budget.pieces(ids, CLEAR_COST):
            cleared = yield from transitions.clear(pk, piece).call()
            gone += cleared.doomed
            fields.update(cleared.fields)
            rings.update(cleared.rings)
            older = older or cleared.older
        if gone:
            yield from delete_bytes(store, pk, gone, sorted(fields), sorted(rings))
        elif older:  # a repeated clear: finish what an earlier one could not
            yield from empty_trash(store, pk)


def clear_partition(ctx: Context, partition_id: str) -> Op:
    """Remove a partition and its data. Idempotent; its sample ids are never reused.

    Bytes an earlier clear could not delete (a store was unreachable) are deleted too. A sealed
    partition stays closed: later puts into it raise ``PartitionClosed`` until ``reopen_partition``.
    """
    pk = ctx.keys(partition_id)
    store = yield from storage(ctx)
    # The partition leaves the list, but its seq (ids are never reused) and trash stay: the
    # ``partitions:kept`` registry keeps them findable (checkpoints) without a key pattern.
    keep = Cmd(("SADD", kept_partitions_key(ctx.namespace), partition_id))
    # The sequence read before the drop bounds the ids of the partition as it was (ids are never
    # reused): the durable tier (storage.durable) deletes what those left, whatever the bits say.
    # Read only where there is a tier: without one the clear stays the same pipeline.
    seq = (Cmd(("GET", pk.seq)),) if store.durable_spec is not None else ()
    try:
        *read, _, dropped, _ = yield from transitions.pipeline(
            *seq, keep, transitions.drop_partition(pk, now_ms=int(time.time() * 1000)),
            Cmd(("ZREM", partitions_key(ctx.namespace), partition_id)),
        )
    except RedisOutOfMemory:
        # Redis is full: the drop (allow-oom) and the ZREM ran, the SADD was refused. The dropped
        # samples wait in the trash: delete their bytes, then register the partition in the memory
        # that freed (RedisOutOfMemory again only if Redis is still full).
        yield from empty_trash(store, pk)
        yield keep
        return
    if dropped.older:
        yield from empty_trash(store, pk)
    else:
        ids = dropped.alive_ids() if dropped.in_store else []  # inline values went with the partition
        if ids:
            yield from delete_bytes(store, pk, ids, dropped.fields, dropped.rings)
    if read and read[0] is not None:
        yield Offload(store.drop, (pk, int(text(read[0]))))


def delete_bytes(
    store: KVStorageManager, pk: PartitionKeys, ids: list[int], fields: list[str], rings: list[str]
) -> Op:
    """Delete the bytes of samples already in the partition's trash (from their holders under
    ``rings``), then take them out of it."""
    yield Offload(store.delete, (pk, ids, fields, rings))
    yield from transitions.trash_done(pk, ids).call()


def empty_trash(store: KVStorageManager, pk: PartitionKeys) -> Op:
    """Delete every sample's bytes waiting in the partition's trash."""
    raw, fields, rings = yield Pipe(
        (Cmd(("GET", pk.trash)), Cmd(("SMEMBERS", pk.trash_fields)), Cmd(("HKEYS", pk.rings)))
    )
    ids = bitmaps.set_ids(raw)
    if ids:
        yield from delete_bytes(store, pk, ids, sorted(text(f) for f in fields), [text(r) for r in rings])


def discard_bytes(
    store: KVStorageManager, pk: PartitionKeys, ids: list[int], fields: list[str], ring: str | None = None
) -> Op:
    """Delete bytes written for samples that will never become visible (a put that failed, or
    lost a race with a clear); ``ring``: where a placing store put them.

    They go into the trash first, so if the delete fails they are retried by a later clear. Runs
    while the caller handles the put's error, which is the one to raise: returns None when the
    bytes are gone, else a note for that error saying what is left and why.
    """
    try:
        yield from transitions.trash_add(pk, ids, fields, ring).call()
    except Exception as exc:
        return f"the bytes this put wrote may remain in the store: they could not be recorded for deletion ({exc})"
    try:
        yield from delete_bytes(store, pk, ids, fields, [ring] if ring else [])
    except Exception as exc:
        return (
            f"the bytes this put wrote are not deleted yet ({exc}); the next clear of partition "
            f"{pk.partition!r} deletes them"
        )
    return None
