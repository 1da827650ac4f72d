"""The operations that move bytes: ``put`` (insert new samples, or rewrite fields of existing
ones), ``get_meta(mode="insert")``'s allocation of empty samples, per-sample tags, and ``get_data``.

Order of work follows the invariants of the architecture: a put stores the bytes *before* the
script that makes them visible flips their bits, and ``get_data`` re-reads the bits *after*
reading the bytes, so a sample cleared concurrently is never returned. A store that places keys
itself names the ring a put used; the script that flips the bits records it, and the re-read of
the bits after a store read brings that record back, so values are read again from the node they
were put on if the store's live ring has changed since (:func:`read_store`).

A put whose bits are refused after its bytes were stored (a clear won the race, the partition was
sealed and cleared) deletes what it wrote (:func:`~tq_redis.ops.clear.discard_bytes`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from tq_redis import names
from tq_redis.codec import tensors as codec
from tq_redis.errors import (
    BatchSizeMismatch,
    DataMissing,
    DataNotReady,
    EmptyBatch,
    InvalidArgument,
    PartitionClosed,
    SampleNotFound,
    UnknownPartition,
    UnsupportedValue,
)
from tq_redis.meta import BatchMeta
from tq_redis.meta.keys import PartitionKeys, partitions_key
from tq_redis.ops import arguments, ratelimit, script_budget, transitions
from tq_redis.ops.clear import discard_bytes, empty_trash
from tq_redis.ops.context import Context, Op, batchmeta_schema, canonical, group_by_partition, storage
from tq_redis.ops.data_parser import DataParser, apply_data_parser
from tq_redis.ops.effects import Cmd, Offload
from tq_redis.ops.encoding import text
from tq_redis.storage.base import Segments, join_segments
from tq_redis.storage.manager import INLINE_MAX_BATCH_BYTES, KVStorageManager, Placement, by_field

# ------------------------------------------------------------------ put

MAX_INSERT = 2**24
"""The most empty samples one ``get_meta(mode="insert")`` allocates (each is listed in its reply)."""


def as_tensordict(data: Any) -> TensorDict:
    if isinstance(data, TensorDict):
        td = data
    elif isinstance(data, dict):
        if not data:
            raise EmptyBatch("put() got an empty dict; pass a TensorDict or dict with at least one field")
        n = _batch_len(data)
        try:
            td = TensorDict(data, batch_size=[n])
        except (RuntimeError, ValueError, TypeError) as exc:
            raise BatchSizeMismatch(f"put() fields disagree on the batch size: {exc}") from exc
    else:
        raise UnsupportedValue(f"put() takes a TensorDict (or a dict of batched fields), got {type(data).__name__}")
    if len(td.batch_size) == 0 or td.batch_size[0] == 0 or not list(td.keys()):
        raise EmptyBatch(f"put() got an empty batch (batch_size={list(td.batch_size)}, fields={list(td.keys())})")
    check_one_batch_dim(td, "put")
    return td


def check_one_batch_dim(td: TensorDict, call: str) -> None:
    """Refuse a TensorDict with more than one batch dimension.

    A sample is one row of the first dimension; the reference system stores each field's row whole
    and returns ``batch_size=[n]``, so a ``[n, m]`` batch would silently come back as ``[n]``.
    """
    if len(td.batch_size) > 1:
        dims = list(td.batch_size)
        raise InvalidArgument(
            f"{call}() takes a TensorDict with one batch dimension (one row per sample), got batch_size={dims}; "
            f"the data would come back with batch_size={dims[:1]}. Pass td.view(-1) to store {math.prod(dims)} "
            f"samples, or a TensorDict with batch_size={dims[:1]} to keep each sample's {dims[1:]} inside its fields"
        )


def _batch_len(data: dict[str, Any]) -> int:
    first = next(iter(data.values()))
    if isinstance(first, torch.Tensor | np.ndarray):
        return int(first.shape[0]) if first.ndim else 1
    try:
        return len(first)
    except TypeError:
        raise UnsupportedValue(f"field value {first!r} has no batch dimension") from None


def encode_batch(ctx: Context, td: TensorDict) -> tuple[dict[str, str], dict[str, list]]:
    """``({field: schema JSON}, {field: per-sample stored values})`` of a batch: every field name,
    value and dtype is checked here, before anything is written.

    Raises:
        InvalidName, UnsupportedValue, BatchSizeMismatch, EmptyBatch: what the field holds cannot be stored.
    """
    n = td.batch_size[0]
    script_budget.check_fields(len(td.keys()), "a put")
    schemas: dict[str, str] = {}
    values: dict[str, list] = {}
    for name in td.keys():
        names.field_name(name)
        schema, per_sample = codec.encode_field(name, td.get(name), n, allow_pickle=ctx.allow_pickle)
        schemas[name] = canonical(schema)
        values[name] = per_sample
    return schemas, values


def put(
    ctx: Context,
    data: Any,
    metadata: BatchMeta | None = None,
    partition_id: str | None = None,
    data_parser: DataParser | None = None,
) -> Op[BatchMeta]:
    """Insert new samples (no metadata) or write fields of existing samples (with metadata).

    ``data_parser`` (the reference's hook) may rewrite the batch's values in place first. With
    metadata, its ``custom_meta`` is stored as the samples' tags too, as the reference does.
    """
    td = as_tensordict(data)
    if data_parser is not None:
        td = apply_data_parser(td, data_parser)
    if metadata is None:
        if partition_id is None:
            raise InvalidArgument("put() without metadata inserts new samples and needs partition_id=")
        return (yield from _insert(ctx, td, partition_id))
    if not isinstance(metadata, BatchMeta):
        raise InvalidArgument(f"metadata must be a BatchMeta, got {type(metadata).__name__}")
    if metadata.size != td.batch_size[0]:
        raise BatchSizeMismatch(
            f"put() data has {td.batch_size[0]} samples but metadata has {metadata.size}; "
            f"select the matching samples (metadata.select_samples / chunk) or slice the data"
        )
    return (yield from _rewrite(ctx, td, metadata))


def _insert(ctx: Context, td: TensorDict, partition_id: str) -> Op:
    pk = ctx.keys(partition_id)
    n = td.batch_size[0]
    schemas, values = encode_batch(ctx, td)
    store = yield from storage(ctx)
    inline = inline_payload(values, store.inline_max_bytes)
    if inline is not None:  # small values: ids, values and bits in one script, one round trip
        store.count_inline("put", inline)

        def insert_inline(waiter: str, wait_ms: int) -> Op:
            return (yield from transitions.pipeline(
                transitions.insert(pk, None, n, schemas, ctx.strict_schema, values=inline, waiter=waiter,
                                   wait_ms=wait_ms),
                Cmd(("ZADD", partitions_key(ctx.namespace), "NX", time.time(), partition_id)),
            ))  # fmt: skip

        first, _ = yield from ratelimit.admitted(pk, insert_inline, f"put() of {n} sample(s)")
        return BatchMeta.from_columns(
            list(range(first, first + n)), partition_id, batchmeta_schema(schemas),
            production_status=np.ones(n, dtype=np.int8),
        )  # fmt: skip
    first = yield from ratelimit.admitted(
        pk, lambda waiter, wait_ms: transitions.reserve(
            pk, n, schemas, ctx.strict_schema, waiter=waiter, wait_ms=wait_ms
        ).call(), f"put() of {n} sample(s)",
    )  # fmt: skip
    ids = list(range(first, first + n))
    ring: str | None = None
    try:
        # A put that fails may still have written part of the batch (on the nodes that took it).
        ring = yield Offload(store.put, (pk, ids, values))
        yield from _insert_written(ctx, pk, first, n, schemas, ring)
    except Exception as exc:
        # Leave no orphaned bytes; if even that fails they wait in the trash for the next clear.
        note = yield from discard_bytes(store, pk, ids, list(schemas), ring)
        if note:
            exc.add_note(note)
        raise
    return BatchMeta.from_columns(
        ids, partition_id, batchmeta_schema(schemas), production_status=np.ones(n, dtype=np.int8)
    )


def _insert_written(
    ctx: Context, pk: PartitionKeys, first: int, n: int, schemas: dict[str, str], ring: str | None
) -> Op:
    """Flip the bits of an insert whose bytes are stored, listing the partition in the same round
    trip; a partition that turned out closed (sealed and cleared) is not listed again."""
    try:
        yield from transitions.pipeline(
            transitions.insert(pk, first, n, schemas, ctx.strict_schema, ring=ring),
            Cmd(("ZADD", partitions_key(ctx.namespace), "NX", time.time(), pk.partition)),
        )
    except PartitionClosed:
        # the ZADD ran after the refusal: take out what it listed (the drop had unlisted it)
        yield Cmd(("ZREM", partitions_key(ctx.namespace), pk.partition))
        raise


def _nbytes(buffer: Any) -> int:
    return len(buffer) if isinstance(buffer, bytes | bytearray) else memoryview(buffer).nbytes


def inline_payload(values: dict[str, Sequence[Segments]], limit: int) -> list[bytes] | None:
    """The batch's values joined, field-major, when every one is at most ``limit`` bytes, all of
    them together at most :data:`~tq_redis.storage.manager.INLINE_MAX_BATCH_BYTES` and there are at most
    :data:`~tq_redis.ops.script_budget.SCRIPT_ITEMS` of them (one script stores them with the bits);
    else ``None`` (the values go to the store). ``limit`` 0 turns inline values off."""
    if limit <= 0 or sum(map(len, values.values())) > script_budget.SCRIPT_ITEMS:
        return None
    total = 0
    for column in values.values():
        size = getattr(column, "value_size", None)  # a RowBlock: every row the same size
        if size is not None:
            if size > limit:
                return None
            total += size * len(column)
        else:
            for segments in column:
                size = sum(map(_nbytes, segments))
                if size > limit:
                    return None
                total += size
        if total > INLINE_MAX_BATCH_BYTES:
            return None
    return [join_segments(segments) for column in values.values() for segments in column]


def allocate(ctx: Context, pk: PartitionKeys, fields: list[str], count: int) -> Op:
    """``mode="insert"``: ``count`` new samples with no field produced yet, for a later
    ``put(data, metadata=...)``. They are alive (listed, clearable) but no task can claim them
    before their fields are put."""
    count = arguments.count(count, "batch_size (mode='insert')", maximum=MAX_INSERT)
    first = yield from ratelimit.admitted(
        pk, lambda waiter, wait_ms: transitions.reserve(pk, count, waiter=waiter, wait_ms=wait_ms).call(),
        f"get_meta(mode='insert') of {count} sample(s)",
    )
    yield from transitions.pipeline(
        transitions.insert(pk, first, count),
        Cmd(("ZADD", partitions_key(ctx.namespace), "NX", time.time(), pk.partition)),
    )
    placeholder = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False, "kind": None}
    return BatchMeta.from_columns(
        list(range(first, first + count)), pk.partition, {f: dict(placeholder) for f in fields},
        production_status=np.zeros(count, dtype=np.int8),
    )


def _rewrite(ctx: Context, td: TensorDict, metadata: BatchMeta) -> Op:
    schemas, values = encode_batch(ctx, td)
    return (yield from write_fields(ctx, schemas, values, metadata))


def write_fields(
    ctx: Context, schemas: dict[str, str], values: dict[str, list], metadata: BatchMeta, *, checked: bool = False
) -> Op:
    """Write fields :func:`encode_batch` encoded to the samples of ``metadata`` (bytes first, then
    the bits and, from ``metadata.custom_meta``, the tags); returns the metadata with them.

    ``checked``: the caller has just checked, in this operation, that the partition exists, that
    the samples are alive and that ``schemas`` agree with the registered ones (``kv_resolve`` does
    all three), so the round trip of checks before the bytes are written is skipped. A clear that
    runs in between is still caught: the bits' script refuses, and the bytes are discarded."""
    store = yield from storage(ctx)
    groups = group_by_partition(metadata)
    inline = inline_payload(values, store.inline_max_bytes)
    if inline is not None and len(groups) == 1 and not any(metadata.custom_meta):
        # One partition, small values, no tags: the produce script checks the partition, the
        # samples and the schemas itself and writes values and bits at once (one round trip).
        pk = ctx.keys(next(iter(groups)))
        store.count_inline("put", inline)
        freed = yield from transitions.produce(pk, metadata.global_indexes, schemas, ctx.strict_schema, inline).call()
        if freed:  # the rewrite replaced a group's shared value for good: delete its bytes
            yield from empty_trash(store, pk)
        return with_fields(metadata, schemas)
    if not checked:
        yield from _check_targets(ctx, groups, schemas, metadata)
    # The metadata's custom_meta is stored as tags too, as the reference does: in the same round
    # trip as the bits, tags first, since a consumer may claim the samples once their bits flip.
    tags = _tag_rows(metadata) if any(metadata.custom_meta) else {}
    for pid, positions in groups.items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        part = {name: [vals[i] for i in positions] for name, vals in values.items()}
        part_inline = inline_payload(part, store.inline_max_bytes) if inline is not None else None
        ring = None
        if part_inline is None:
            ring = yield Offload(store.put, (pk, ids, part))
        # In pieces of at most SCRIPT_ITEMS values (and tags): a big batch's samples become
        # produced in parts, each sample's fields together.
        tag_names, tag_rows = tags.get(pid, ((), ()))
        try:
            for piece in script_budget.slices(len(ids), len(schemas) + len(tag_names)):
                piece_inline = ()
                if part_inline is not None:
                    piece_inline = inline_payload({n: v[piece] for n, v in part.items()}, store.inline_max_bytes) or ()
                calls: list[Any] = []
                if tag_names:  # the change is noted once the fields are produced (kv_watch)
                    calls.append(transitions.set_tags(pk, ids[piece], tag_names, tag_rows[piece], notify=False))
                calls.append(transitions.produce(pk, ids[piece], schemas, ctx.strict_schema, piece_inline, ring=ring))
                if tag_names:
                    calls.append(transitions.set_tags(pk, ids[piece], (), (), notify=True))
                replies = yield from transitions.pipeline(*calls)
                freed = replies[1 if tag_names else 0]  # produce's reply
                store.count_inline("put", piece_inline)
                if freed:  # the rewrite replaced a group's shared value for good: delete its bytes
                    yield from empty_trash(store, pk)
        except (UnknownPartition, SampleNotFound) as exc:
            if part_inline is None:  # a clear won the race: what this put stored must not outlive it
                note = yield from _discard_cleared(store, pk, ids, list(schemas), ring)
                if note:
                    exc.add_note(note)
            raise
    return with_fields(metadata, schemas)


def _check_targets(
    ctx: Context, groups: dict[str, list[int]], schemas: dict[str, str], metadata: BatchMeta
) -> Op:
    """Before a write's bytes go out: every partition exists, every sample is alive, every schema
    agrees (strict mode). A conflict must leave nothing half-written."""
    # One round trip, but for the samples past each partition's first piece (a big batch).
    checks: list[Any] = []
    more: list[tuple[PartitionKeys, list[Sequence[int]]]] = []
    for pid, positions in groups.items():
        pk = ctx.keys(pid)
        first, *rest = script_budget.pieces([metadata.global_indexes[i] for i in positions])
        checks += [Cmd(("EXISTS", pk.meta)), Cmd(("HMGET", pk.fields, *schemas)), transitions.check_visible(pk, first)]
        more.append((pk, rest))
    replies = yield from transitions.pipeline(*checks)
    for k, (pid, (pk, rest)) in enumerate(zip(groups, more)):
        exists, registered, visible = replies[3 * k : 3 * k + 3]
        if not exists:
            raise UnknownPartition(f"partition {pid!r} does not exist (cleared, or never created)")
        for name, reg in zip(schemas, registered):
            if ctx.strict_schema and reg is not None and text(reg) != schemas[name]:
                transitions.raise_schema_conflict(name, reg, schemas[name])
        for piece in rest:
            if visible.not_alive:
                break
            visible = yield from transitions.check_visible(pk, piece).call()
        if visible.not_alive:
            gone = visible.not_alive[:10]
            raise SampleNotFound(f"samples {gone} of partition {pid!r} were cleared or never inserted")


def _discard_cleared(
    store: KVStorageManager, pk: PartitionKeys, ids: list[int], fields: list[str], ring: str | None
) -> Op:
    """After a rewrite's bits were refused because a clear ran since the checks: delete the bytes
    it stored that nothing will ever read. Those of samples that are gone go through the trash (a
    later clear retries them); those of live samples only where the field was not produced for
    them (elsewhere the bytes replaced the value the bits point at). Returns a note for the
    caller's error if some could not be deleted."""
    gone, unread = yield from _unreadable(pk, ids, fields)
    notes = []
    if gone:
        notes.append((yield from discard_bytes(store, pk, gone, fields, ring)))
    for field, unread_ids in unread.items():
        try:
            yield Offload(store.delete, (pk, unread_ids, [field], [ring] if ring else []))
        except Exception as exc:  # the caller's error is the one to raise
            notes.append(f"the bytes this put wrote for field {field!r} of samples {unread_ids[:10]} remain ({exc})")
    return "; ".join(n for n in notes if n) or None


def _unreadable(pk: PartitionKeys, ids: list[int], fields: list[str]) -> Op:
    """The ids of ``ids`` that are gone, and per field the alive ones that lack it.

    A script reports the ids lacking a field only when all it was asked about are alive, and more
    may be cleared between two scripts: a field whose check found some gone is checked again on
    the ones left (a sample never comes back, so this ends).
    """
    gone: set[int] = set()
    unread: dict[str, list[int]] = {}
    todo = list(fields)
    while todo:
        alive = [i for i in ids if i not in gone]
        if not alive:
            break
        pieces = list(script_budget.pieces(alive, 2))
        per_field: list[list[transitions.Visibility]] = []
        if len(pieces) == 1:
            replies = yield from transitions.pipeline(*(transitions.check_visible(pk, alive, [f]) for f in todo))
            per_field = [[reply] for reply in replies]
        else:  # a big batch: one script call per piece (tq_redis.ops.script_budget)
            for f in todo:
                per_field.append([])
                for piece in pieces:
                    per_field[-1].append((yield from transitions.check_visible(pk, piece, [f]).call()))
        again = []
        for field, replies in zip(todo, per_field):
            not_alive = [i for visible in replies for i in visible.not_alive]
            if not_alive:
                gone.update(not_alive)
                again.append(field)
            else:
                lacking = [i for visible in replies for i in visible.not_produced]
                if lacking:
                    unread[field] = lacking
        todo = again
    return sorted(gone), unread


def with_fields(metadata: BatchMeta, schemas: dict[str, str]) -> BatchMeta:
    """A copy of ``metadata`` with ``schemas``' fields produced (what a put with metadata returns)."""
    result = metadata.copy()
    result.field_schema.update(batchmeta_schema(schemas))
    result.production_status[:] = 1
    return result


# ------------------------------------------------------------------ tags


def _tag_rows(metadata: BatchMeta) -> dict[str, tuple[list[str], list[dict[str, Any]]]]:
    """Per partition, the tag names and the rows of ``metadata.custom_meta`` to store (in the
    partition's order of samples); partitions without any tag are left out. Every tag name is
    checked here, before the caller writes anything (a rewrite stores its bytes before the tags)."""
    if len(metadata.custom_meta) != metadata.size:
        raise BatchSizeMismatch(f"custom_meta has {len(metadata.custom_meta)} entries for {metadata.size} samples")
    found = {}
    for pid, positions in group_by_partition(metadata).items():
        rows = [metadata.custom_meta[i] for i in positions]
        tag_names = sorted({k for row in rows for k in row})
        if tag_names:
            found[pid] = ([names.tag_name(t, "custom meta key") for t in tag_names], rows)
    return found


def set_custom_meta(ctx: Context, metadata: BatchMeta) -> Op:
    """Write ``metadata.custom_meta`` as per-sample tags (a big batch in pieces of at most
    :data:`~tq_redis.ops.script_budget.SCRIPT_ITEMS` tag values, one script call each)."""
    arguments.batch_meta(metadata, "set_custom_meta")
    for pid, (tag_names, rows) in _tag_rows(metadata).items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in group_by_partition(metadata)[pid]]
        for piece in script_budget.slices(len(ids), len(tag_names)):
            yield from transitions.set_tags(pk, ids[piece], tag_names, rows[piece]).call()


# ------------------------------------------------------------------ get_data


def get_data(ctx: Context, metadata: BatchMeta) -> Op:
    """Fetch the fields of ``metadata`` as a TensorDict ordered like ``metadata.global_indexes``."""
    if not isinstance(metadata, BatchMeta):
        raise InvalidArgument(f"get_data() takes the BatchMeta returned by get_meta/put, got {type(metadata).__name__}")
    fields = list(metadata.field_names)
    script_budget.check_fields(len(fields), "get_data")
    n = metadata.size
    if n == 0:
        return TensorDict({}, batch_size=[0])
    if not fields:
        raise InvalidArgument("metadata has no fields to fetch; get_meta(data_fields=[...]) names them")
    store = yield from storage(ctx)
    groups = group_by_partition(metadata)
    per_field: dict[str, list] = {f: [None] * n for f in fields}
    for pid, positions in groups.items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        got = None
        if store.inline_max_bytes <= 0 or not ctx.inline_partitions.get(pid, True):
            got = yield from _read_store_first(store, pk, ids, fields)
        if got is None:  # values may be inline (or the store lacked some): one round trip for those
            got = yield from _read_inline_first(ctx, store, pk, ids, fields)
        if len(groups) == 1:  # one partition: the reads' order is already the batch's
            per_field = got
            break
        for name in fields:
            column = per_field[name]
            for pos, value in zip(positions, got[name]):
                column[pos] = value
    return decode_batch(ctx, fields, per_field, n)


def decode_batch(ctx: Context, fields: list[str], per_field: dict[str, list], n: int) -> TensorDict:
    """The TensorDict of ``fields`` of ``n`` samples from their stored values (field -> value per sample)."""
    out = {}
    for name in fields:
        out[name] = codec.decode_field(
            name, per_field[name], allow_pickle=ctx.allow_pickle, nested_output=ctx.nested_output
        )
    return codec.assemble(out, n)


def _read_store_first(store: KVStorageManager, pk: PartitionKeys, ids: list[int], fields: list[str]) -> Op:
    """Read from the store, then check the bits; ``None`` when the store lacks a value (it may be
    inline: the caller reads with :func:`_read_inline_first` then)."""
    return (yield from read_store(store, pk, ids, fields, maybe_inline=True))


def read_store(
    store: KVStorageManager, pk: PartitionKeys, ids: list[int], fields: list[str], *, maybe_inline: bool = False
) -> Op:
    """The values of ``ids`` x ``fields`` from the store (field -> values aligned with ids), proved
    by the bits read *after* them: bits are cleared before bytes are deleted, so bits still set
    prove the bytes belong to live, produced samples (ids are never reused).

    The same check returns where a placing store's values were put; values the first read did
    not get from that node (nodes joined or left since) are read again from it, and proved again.
    ``maybe_inline``: return None instead of raising when the store lacks a value.
    """
    first = yield Offload(store.read, (pk, ids, fields))
    if maybe_inline and len(first.missing) and not store.places_keys:
        return None
    visible = yield from check_visible(pk, ids, fields, placement=store.places_keys)
    raise_invisible(pk, visible)
    if store.settled(first, visible.placement):
        return by_field(first.values, fields, len(ids))
    if maybe_inline and len(first.missing) and not (visible.placement and visible.placement.rings):
        return None  # nothing recorded where they were put: they may be inline values
    try:
        got = yield Offload(store.settle, (pk, ids, fields, first, visible.placement))
    except DataMissing:
        if maybe_inline:
            return None
        raise
    yield from _verify_visible(pk, ids, fields)
    return got


def _read_inline_first(
    ctx: Context, store: KVStorageManager, pk: PartitionKeys, ids: list[int], fields: list[str]
) -> Op:
    """One round trip checks the samples and returns their inline values (a big batch: one per
    piece of at most :data:`~tq_redis.ops.script_budget.SCRIPT_ITEMS` values); values kept in the store
    are read from it afterwards and checked again (bytes before bits)."""
    got: dict[str, list] = {f: [] for f in fields}
    inline = False
    shared: list[tuple[Sequence[int], transitions.InlineRead]] = []
    for piece in script_budget.pieces(ids, len(fields)):
        read = yield from transitions.read_inline(pk, piece, fields).call()
        raise_invisible(pk, read.visibility)
        inline = inline or bool(read.values) or bool(read.shared)
        for f in fields:
            column = read.values.get(f, {})
            got[f].extend(column.get(i) for i in piece)
            store.count_inline("get", column.values())
        if read.shared:
            shared.append((piece, read))
    ctx.inline_partitions[pk.partition] = inline
    for piece, read in shared:
        values = yield from _read_carriers(store, pk, read)
        proof = yield from transitions.read_inline(pk, piece, list(read.shared)).call()
        raise_invisible(pk, proof.visibility)
        if proof.shared != read.shared:  # a member's shared value was rewritten meanwhile: read again
            return (yield from _read_inline_first(ctx, store, pk, ids, fields))
        for f, refs in read.shared.items():
            column = got[f]
            for pos, i in enumerate(ids):
                carrier = refs.get(i)
                if carrier is not None:
                    column[pos] = values[f][carrier]
    return (yield from fill_from_store(store, pk, ids, got))


def _read_carriers(store: KVStorageManager, pk: PartitionKeys, read: transitions.InlineRead) -> Op:
    """The store values of the carriers of group-shared fields a ``read_inline`` named (field ->
    {carrier: value}), each from the node it was put on. Proved by the caller: the members still
    point at these carriers afterwards, so they were not freed (a carrier's bytes are deleted only
    once no member points at it, and its id is never reused)."""
    out: dict[str, dict[int, Any]] = {}
    where = read.placement
    for f, refs in read.shared.items():
        carriers = sorted(set(refs.values()))
        placement = None
        if where is not None and where.rings:
            at = np.searchsorted(np.asarray(read.carriers, dtype=np.int64), np.asarray(carriers, dtype=np.int64))
            placement = Placement(where.rings, {f: where.ring_of(f, len(read.carriers))[at]})
        got = yield Offload(store.get, (pk, carriers, [f], placement))
        out[f] = dict(zip(carriers, got[f]))
    return out


def fill_from_store(store: KVStorageManager, pk: PartitionKeys, ids: list[int], got: dict[str, list]) -> Op:
    """``got`` (field -> value per id of ``ids``, None where not read yet) with its Nones read
    from the store, each read checked against the bits afterwards (bytes before bits). A value
    the store lacks raises the store's ``DataMissing``, which names the keys, node and cause."""
    lacking = {f: [i for i, v in zip(ids, column) if v is None] for f, column in got.items()}
    lacking = {f: missing for f, missing in lacking.items() if missing}
    if not lacking:
        return got
    whole = [f for f, missing in lacking.items() if len(missing) == len(ids)]
    reads = [(ids, whole)] if whole else []
    reads += [(missing, [f]) for f, missing in lacking.items() if f not in whole]
    for read_ids, read_fields in reads:
        part = yield from read_store(store, pk, read_ids, read_fields)
        for name in read_fields:
            if len(read_ids) == len(ids):
                got[name] = list(part[name])
            else:
                at = {i: v for i, v in zip(read_ids, part[name])}
                got[name] = [at.get(i, v) if v is None else v for i, v in zip(ids, got[name])]
    return got


def _verify_visible(pk: PartitionKeys, ids: list[int], fields: list[str]) -> Op:
    raise_invisible(pk, (yield from check_visible(pk, ids, fields)))


def check_visible(pk: PartitionKeys, ids: list[int], fields: Sequence[str] = (), *, placement: bool = False) -> Op:
    """``lua/check_visible.lua`` for any number of ids: many go in pieces of at most
    :data:`~tq_redis.ops.script_budget.SCRIPT_ITEMS` ids x (fields + 1), one call each. The result is
    the first piece's refusal, or (all visible) the pieces' placements joined into one."""
    per_id = 1 + len(fields)
    if len(ids) <= script_budget.piece_size(per_id):
        return (yield from transitions.check_visible(pk, ids, fields, placement=placement).call())
    order = sorted(set(ids))  # a placement lists ascending ids: pieces of them concatenate
    found: list[Placement] = []
    sizes: list[int] = []
    for piece in script_budget.pieces(order, per_id):
        visible = yield from transitions.check_visible(pk, piece, fields, placement=placement).call()
        if not visible.ok:
            return visible
        if visible.placement is not None:
            found.append(visible.placement)
            sizes.append(len(piece))
    if not found:
        return transitions.Visibility([], None, [])
    rings = found[-1].rings  # ring indexes only grow: the last piece knows every ring of the others
    if not rings:
        return transitions.Visibility([], None, [], Placement([], {}))
    index: dict[str, np.ndarray | None] = {}
    for f in fields:
        columns = [p.index.get(f) for p in found]
        if all(c is None for c in columns):
            index[f] = None
        else:
            index[f] = np.concatenate([np.zeros(n, np.uint16) if c is None else c for c, n in zip(columns, sizes)])
    return transitions.Visibility([], None, [], Placement(rings, index))


def raise_invisible(pk: PartitionKeys, visible: transitions.Visibility) -> None:
    if visible.not_alive:
        raise SampleNotFound(f"samples {visible.not_alive[:10]} of partition {pk.partition!r} were cleared")
    if visible.field is not None:
        name, missing = visible.field, visible.not_produced[:10]
        raise DataNotReady(
            f"field {name!r} is not produced yet for samples {missing} of partition {pk.partition!r}; "
            f"get_meta(mode='fetch') only returns ready samples"
        )
