"""The KV API: samples named by user keys instead of global indexes (what verl's trainer uses).

Each partition keeps ``<ns>:{p}:kv`` (user key -> sample id) and ``<ns>:{p}:kvkeys`` (the reverse)
in Redis; keys of two partitions never collide. ``lua/kv_resolve.lua`` maps keys to ids in one
atomic step, giving unknown keys fresh, never-reused ids; the bytes then go through the ordinary
rewrite path of :func:`tq_redis.ops.put` (data first, then bits), so a key's fields accumulate
over several puts and concurrent writers of different fields never lose an update.

Operations are generators of effects (see :mod:`tq_redis.ops.effects`); the clients expose them as
``kv_*`` / ``async_kv_*`` methods, and :mod:`tq_redis.api.functions` as module-level functions on the
client ``tq_redis.init()`` created.

Deliberate differences from TransferQueue 0.1.11 (whose semantics are otherwise kept):

* ``kv_batch_get`` raises :class:`~tq_redis.errors.UnknownKey` (a ``SampleNotFound`` and a
  ``ValueError`` saying "not found") naming the missing keys when *any* key is unknown; the
  reference silently returns only the keys it found, so rows no longer line up with the keys.
* A selected field that no key has is left out of the result, as in the reference (verl selects
  optional fields such as ``ref_log_prob``); one that only some keys have raises
  :class:`~tq_redis.errors.DataNotReady` (the reference drops it for every key, hiding the gap).
* ``kv_retrieve_keys`` raises :class:`~tq_redis.errors.SampleNotFound` for ids with no key (the
  reference raises ``RuntimeError``).
* ``data_parser`` works with every store (the reference: SimpleStorage only); it runs in the client
  (:mod:`tq_redis.ops.data_parser`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tq_redis import names
from tq_redis.errors import (
    BatchSizeMismatch,
    DataNotReady,
    InvalidArgument,
    PartitionClosed,
    SampleNotFound,
    UnknownKey,
    UnsupportedValue,
)
from tq_redis.meta import BatchMeta, KVBatchMeta
from tq_redis.meta.keys import PartitionKeys, check_name, partitions_key
from tq_redis.meta.schemas import to_batchmeta_schema
from tq_redis.ops import arguments, encoding, ratelimit, script_budget, transitions
from tq_redis.ops.clear import CLEAR_COST, delete_bytes
from tq_redis.ops.context import Context, Op, storage
from tq_redis.ops.data import check_one_batch_dim, encode_batch, get_data, set_custom_meta, write_fields
from tq_redis.ops.data_parser import DataParser, apply_data_parser
from tq_redis.ops.effects import Cmd, Pipe
from tq_redis.ops.encoding import encode_tag, text

# ------------------------------------------------------------------ helpers


def _key_list(keys: Any, who: str) -> list[str]:
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, Sequence) or not keys:
        raise InvalidArgument(f"{who}: keys must be a non-empty list of strings, got {keys!r}")
    out = list(keys)
    for k in out:
        names.kv_key(k, f"{who}: key")
    if len(set(out)) != len(out):
        seen: set[str] = set()
        dups = [k for k in out if k in seen or seen.add(k)]  # type: ignore[func-returns-value]
        raise InvalidArgument(f"{who}: keys must be unique; duplicated: {dups[:5]!r}")
    return out


def _field_list(fields: Any, who: str) -> list[str] | None:
    if fields is None:
        return None
    if isinstance(fields, str):
        fields = [fields]
    if not isinstance(fields, Sequence) or isinstance(fields, bytes):
        raise InvalidArgument(f"{who}: select_fields must be a field name or a list of names, got {fields!r}")
    return [names.field_name(f) for f in fields]


def _single_row(fields: Mapping[str, Any] | TensorDictBase) -> TensorDict:
    """``kv_put``'s fields as a batch of one: a dict holds one sample's values (unsqueezed)."""
    if isinstance(fields, TensorDictBase):
        if len(fields.batch_size) == 0:
            return fields.unsqueeze(0)  # type: ignore[return-value]
        check_one_batch_dim(fields, "kv_put")  # type: ignore[arg-type]
        return fields  # type: ignore[return-value]
    if not isinstance(fields, Mapping):
        raise UnsupportedValue(f"kv_put: fields must be a dict or a TensorDict, got {type(fields).__name__}")
    batch: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise InvalidArgument(
                    f"kv_put: field {name!r} is a nested tensor, i.e. a batch; use kv_batch_put for batches"
                )
            batch[name] = value.unsqueeze(0)
        elif isinstance(value, NonTensorData | NonTensorStack):
            batch[name] = value
        else:
            batch[name] = NonTensorStack(NonTensorData(value))
    return TensorDict(batch, batch_size=[1])


def _batch(fields: Any, n: int) -> TensorDict:
    if isinstance(fields, TensorDictBase):
        td = fields
    elif isinstance(fields, Mapping):
        try:
            td = TensorDict(dict(fields), batch_size=[n])
        except (RuntimeError, ValueError, TypeError) as exc:
            raise BatchSizeMismatch(
                f"kv_batch_put: fields do not all have {n} rows (one per key): {exc}"
            ) from exc
    else:
        raise UnsupportedValue(f"kv_batch_put: fields must be a TensorDict, got {type(fields).__name__}")
    if len(td.batch_size) == 0 or td.batch_size[0] != n:
        raise BatchSizeMismatch(
            f"kv_batch_put: {n} keys but the fields have batch_size {list(td.batch_size)}; "
            f"give one row per key"
        )
    if not list(td.keys()):
        raise InvalidArgument("kv_batch_put: fields has no field; pass fields=None to update tags only")
    check_one_batch_dim(td, "kv_batch_put")
    return td  # type: ignore[return-value]


# ------------------------------------------------------------------ resolution


RESOLVE_COST = 2
"""The script work of resolving one key, in items (tq_redis.ops.script_budget): its two mappings, its
alive bit and fields, its tags."""


class Resolved:
    """What ``kv_resolve`` said about a list of keys."""

    __slots__ = ("created", "fresh", "ids", "schemas", "tags")

    def __init__(self, ids: list[int], created: int, schemas: dict[str, str], tags: list[dict[str, Any]]):
        self.ids = ids
        self.created = created
        self.schemas = schemas  # fields produced for every pre-existing key, in registration order
        self.tags = tags
        self.fresh: list[tuple[str, int]] = []  # (key, id) of the keys created (see resolve)

    def joined(self, more: Resolved) -> Resolved:
        """This resolution followed by ``more``'s (the next keys): the fields every key with an id
        has are those both have (none once a key was created: it has no field yet; a part without
        a key that has an id does not count)."""
        if self.created or more.created:
            common = {}
        elif not any(i >= 0 for i in self.ids):
            common = more.schemas
        elif not any(i >= 0 for i in more.ids):
            common = self.schemas
        else:
            common = {f: s for f, s in self.schemas.items() if f in more.schemas}
        both = Resolved(self.ids + more.ids, self.created + more.created, common, self.tags + more.tags)
        both.fresh = self.fresh + more.fresh
        return both

    def meta(
        self, partition_id: str, fields: Sequence[str], positions: Sequence[int] | None = None
    ) -> BatchMeta:
        pos = list(range(len(self.ids))) if positions is None else list(positions)
        schema = {f: to_batchmeta_schema(json.loads(self.schemas[f])) for f in fields}
        return BatchMeta.from_columns(
            [self.ids[i] for i in pos],
            partition_id,
            schema,
            production_status=1,
            custom_meta=[self.tags[i] for i in pos],
        )


def resolve(
    ctx: Context, pk: PartitionKeys, keys: list[str], create: bool, schemas: Mapping[str, str] | None = None
) -> Op:
    """Run ``lua/kv_resolve.lua``: a :class:`Resolved`, or None if the partition does not exist
    (``create=False``). ``schemas`` (field -> schema JSON) are checked before creating.

    Many keys go in pieces of at most :data:`~tq_redis.ops.script_budget.SCRIPT_ITEMS`, one call each;
    if a later piece fails, the keys the earlier ones created are forgotten again."""

    def attempt(piece: list[str], listing: bool, waiter: str, wait_ms: int) -> Op:
        call = transitions.kv_resolve(
            pk, piece, create, schemas or transitions.NO_SCHEMAS, ctx.strict_schema, waiter=waiter, wait_ms=wait_ms
        )
        if not listing:
            return (yield from call.call())
        try:
            got, _ = yield from transitions.pipeline(
                call, Cmd(("ZADD", partitions_key(ctx.namespace), "NX", time.time(), pk.partition))
            )
        except PartitionClosed:
            # the ZADD ran after the refusal: take out what it listed (the clear had unlisted it)
            yield Cmd(("ZREM", partitions_key(ctx.namespace), pk.partition))
            raise
        return got

    found: Resolved | None = None
    for piece in script_budget.pieces(keys, RESOLVE_COST):
        run = partial(attempt, list(piece), create and found is None)
        try:
            if create:  # new keys are inserts: a rate limiter may hold them back
                got = yield from ratelimit.admitted(pk, run, f"kv_put of {len(keys)} key(s)")
            else:
                got = yield from run("", 0)
        except Exception:
            if found is not None:
                yield from _forget(ctx, pk, found.fresh)
            raise
        if got is None:
            return None
        part = Resolved(*got)
        part.fresh = _created_pairs(list(piece), part)
        found = part if found is None else found.joined(part)
    return found


def retrieve_meta(ctx: Context, keys: Any, partition_id: str, create: bool = False) -> Op:
    """``BatchMeta`` of the keys found (created with ``create=True``), with the fields every one has."""
    keys = _key_list(keys, "kv_retrieve_meta")
    pk = ctx.keys(partition_id)
    res = yield from resolve(ctx, pk, keys, create)
    if res is None:
        return BatchMeta.empty()
    found = [i for i, sid in enumerate(res.ids) if sid >= 0]
    return res.meta(partition_id, list(res.schemas), found)


def retrieve_keys(ctx: Context, global_indexes: Any, partition_id: str) -> Op:
    """The user key of each sample id; raises :class:`SampleNotFound` for ids without a key."""
    ids = arguments.ids(global_indexes, "kv_retrieve_keys: global_indexes")
    if not ids:
        raise InvalidArgument("kv_retrieve_keys: global_indexes is empty")
    pk = ctx.keys(partition_id)
    bitfield = [x for i in ids for x in ("GET", "u1", i)]
    keys, alive = yield Pipe((Cmd(("HMGET", pk.kvkeys, *ids)), Cmd(("BITFIELD", pk.alive, *bitfield))))
    missing = [i for i, k, a in zip(ids, keys, alive) if k is None or not a]
    if missing:
        raise SampleNotFound(
            f"samples {missing[:10]} of partition {partition_id!r} have no key (cleared, or not put by key)"
        )
    return [text(k) for k in keys]


# ------------------------------------------------------------------ put


def batch_put(
    ctx: Context,
    keys: Any,
    partition_id: str,
    fields: TensorDict | Mapping[str, Any] | None = None,
    tags: Sequence[Mapping[str, Any]] | None = None,
    data_parser: DataParser | None = None,
    *,
    single: bool = False,
) -> Op:
    """Write fields and/or tags of keys, creating unknown keys. Returns a :class:`KVBatchMeta`."""
    who = "kv_put" if single else "kv_batch_put"
    keys = _key_list(keys, who)
    if fields is None and tags is None:
        raise InvalidArgument(f"{who}: give fields=, tags= or both")
    if tags is not None:
        if isinstance(tags, Mapping) or len(tags) != len(keys):
            raise BatchSizeMismatch(f"{who}: {len(keys)} keys need {len(keys)} tag dicts, got {tags!r:.80}")
        if any(not isinstance(t, Mapping) for t in tags):
            raise InvalidArgument(f"{who}: every tag entry must be a dict")
        for t in tags:
            for name, value in t.items():
                names.tag_name(name)
                encoding.encode_tag(value)  # a value with no JSON form fails before any write
    td = None
    if fields is not None:
        td = _single_row(fields) if single else _batch(fields, len(keys))
        if single and td.batch_size[0] != 1:
            raise BatchSizeMismatch(
                f"kv_put: fields hold {td.batch_size[0]} rows; use kv_batch_put for batches"
            )
        if data_parser is not None:
            td = apply_data_parser(td, data_parser)
    # Everything is checked and encoded before the first write: a bad field, value or tag must
    # not create keys, advance the partition's id sequence or register the partition.
    schemas, values = encode_batch(ctx, td) if td is not None else ({}, {})
    pk = ctx.keys(partition_id)
    res = yield from resolve(ctx, pk, keys, True, schemas)
    meta = res.meta(partition_id, list(res.schemas))
    merged = meta.get_all_custom_meta()
    for row, new in zip(merged, tags or ()):
        row.update(new)
    meta.clear_custom_meta()  # stored tags are not written again
    try:
        if td is None:
            yield from set_custom_meta(ctx, BatchMeta.from_columns(res.ids, partition_id, {}, custom_meta=tags))
        else:
            # New tags go with the fields' bits (tags first: whoever claims a key once its fields
            # are produced sees its tags), and kv_watch hears of them once the fields are there.
            meta.update_custom_meta(tags)
            # kv_resolve has just checked the partition, the ids and the schemas: no second look
            meta = yield from write_fields(ctx, schemas, values, meta, checked=True)
    except Exception:
        if res.created:  # leave no half-created keys behind
            yield from _forget(ctx, pk, res.fresh)
        raise
    return KVBatchMeta(
        keys=keys,
        tags=merged,
        partition_id=partition_id,
        fields=list(meta.field_names),
        extra_info=meta.extra_info,
    )


def _created_pairs(keys: list[str], res: Resolved) -> list[tuple[str, int]]:
    """(key, id) of the keys one ``kv_resolve`` reply created."""
    if not res.created:
        return []
    # Fresh ids come from one INCRBY, so they are the largest ids of this reply.
    first_fresh = sorted(res.ids)[-res.created]
    return [(k, i) for k, i in zip(keys, res.ids) if i >= first_fresh]


def _forget(ctx: Context, pk: PartitionKeys, pairs: list[tuple[str, int]]) -> Op:
    """Clear these samples (bits, then bytes) and drop their key mappings."""
    if not pairs:
        return
    for piece in script_budget.pieces(pairs, CLEAR_COST):
        ids = [i for _, i in piece]
        cleared, _ = yield from transitions.pipeline(transitions.clear(pk, ids), transitions.kv_unmap(pk, piece))
        if cleared.doomed:
            store = yield from storage(ctx)
            yield from delete_bytes(store, pk, cleared.doomed, cleared.fields, cleared.rings)


# ------------------------------------------------------------------ get, list, clear


def batch_get(ctx: Context, keys: Any, partition_id: str, select_fields: Any = None) -> Op:
    """The fields of keys as a TensorDict in key order (default: the fields every key has)."""
    keys = _key_list(keys, "kv_batch_get")
    wanted = _field_list(select_fields, "kv_batch_get")
    pk = ctx.keys(partition_id)
    dropped: set[str] = set()
    while True:
        res = yield from resolve(ctx, pk, keys, False)
        if res is None:
            raise UnknownKey(
                f"kv_batch_get: keys {keys[:10]} not found: partition {partition_id!r} does not exist "
                f"(cleared, or never put)"
            )
        missing = [k for k, i in zip(keys, res.ids) if i < 0]
        if missing:
            raise UnknownKey(f"kv_batch_get: keys {missing[:10]} not found in partition {partition_id!r}")
        fields = list(res.schemas) if wanted is None else [f for f in wanted if f not in dropped]
        if not fields:
            if wanted is not None:  # every selected field is absent from every key
                return TensorDict({}, batch_size=[len(keys)])
            raise DataNotReady(
                f"kv_batch_get: keys {keys[:10]} of partition {partition_id!r} have no field in common yet"
            )
        absent = [f for f in fields if f not in res.schemas]
        if not absent:
            return (yield from get_data(ctx, res.meta(partition_id, fields)))
        # Fields no key has are left out; one some keys lack raises; one produced since
        # kv_resolve looked is read on the next pass.
        none_have = yield from _absent_from_every_key(pk, keys, res.ids, absent)
        dropped |= none_have
        if none_have.issuperset(absent):  # nothing changed meanwhile: read the rest now
            fields = [f for f in fields if f not in none_have]
            if not fields:
                return TensorDict({}, batch_size=[len(keys)])
            return (yield from get_data(ctx, res.meta(partition_id, fields)))


def _absent_from_every_key(pk: PartitionKeys, keys: list[str], ids: list[int], fields: list[str]) -> Op:
    """Which of ``fields`` none of the keys has (the reference leaves those out of a read).

    Raises:
        DataNotReady: a field some keys have and others lack (a read would hide the gap).
    """
    bitfield = [x for i in ids for x in ("GET", "u1", i)]
    calls = [Cmd(("HMGET", pk.fields, *fields))] + [Cmd(("BITFIELD", pk.prod(f), *bitfield)) for f in fields]
    replies = yield Pipe(tuple(calls))
    none_have: set[str] = set()
    for name, registered, bits in zip(fields, replies[0], replies[1:]):
        lacking = [k for k, b in zip(keys, bits) if not b]
        if registered is None or len(lacking) == len(keys):
            none_have.add(name)
        elif lacking:
            raise DataNotReady(
                f"field {name!r} is not produced yet for keys {lacking[:10]} of partition {pk.partition!r} "
                f"(the other keys have it); wait for its producer or select the keys that have it"
            )
    return none_have


def batch_get_by_meta(ctx: Context, meta: KVBatchMeta, select_fields: Any = None) -> Op:
    """:func:`batch_get` of a :class:`KVBatchMeta` (``select_fields`` must be among ``meta.fields``)."""
    if not isinstance(meta, KVBatchMeta):
        raise InvalidArgument(f"kv_batch_get_by_meta takes a KVBatchMeta, got {type(meta).__name__}")
    if meta.partition_id is None:
        raise InvalidArgument("kv_batch_get_by_meta: the KVBatchMeta has no partition_id")
    wanted = _field_list(select_fields, "kv_batch_get_by_meta")
    if wanted is not None:
        unknown = [f for f in wanted if meta.fields is None or f not in meta.fields]
        if unknown:
            raise InvalidArgument(
                f"kv_batch_get_by_meta: select_fields {unknown} not found in the KVBatchMeta's "
                f"fields {meta.fields}"
            )
    else:
        wanted = meta.fields
    return (yield from batch_get(ctx, meta.keys, meta.partition_id, wanted))


def list_keys(ctx: Context, partition_id: str | None = None, where: dict[str, Any] | None = None) -> Op:
    """``{partition: {key: tags}}`` of one partition (``{}`` if unknown) or of all of them;
    with ``where`` ({tag name: value}), only the keys whose tags have those values, filtered in
    the listing script (values compare as their JSON text: scalars exactly, ``1`` is not ``1.0``)."""
    filters = conditions(where)
    if partition_id is None:
        names = yield Cmd(("ZRANGE", partitions_key(ctx.namespace), 0, -1))
        partitions = [text(n) for n in names]
    else:
        partitions = [partition_id]
    if not partitions:
        return {}
    # The first page of every partition in one round trip, the further pages of a big one after
    # (script_budget: no call lists more than a piece of keys).
    page = script_budget.piece_size(RESOLVE_COST)
    firsts = yield from transitions.pipeline(
        *(transitions.kv_list(ctx.keys(p), "0", page, filters) for p in partitions)
    )
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for pid, listing in zip(partitions, firsts):
        found: dict[str, tuple[int, dict[str, Any]]] = {}
        while True:
            for key, sid, row in zip(listing.keys, listing.ids, listing.tags):
                found[key] = (sid, row)  # a key HSCAN returned twice is the same key
            if listing.cursor == "0":
                break
            listing = yield from transitions.kv_list(ctx.keys(pid), listing.cursor, page, filters).call()
        if not found and partition_id is not None:
            continue
        out[pid] = {key: row for key, (_, row) in sorted(found.items(), key=lambda kv: kv[1][0])}  # creation order
    if partition_id is not None and partition_id not in out:
        exists = yield Cmd(("EXISTS", ctx.keys(partition_id).meta))
        if exists:
            out[partition_id] = {}
    return out


def conditions(where: Any, who: str = "kv_list") -> list[tuple[str, str]]:
    """``where`` of ``kv_list`` (or ``kv_watch``: ``who``) as (tag name, JSON text) pairs, checked."""
    if where is None:
        return []
    if not isinstance(where, dict):
        raise InvalidArgument(f"{who}(where=) takes a dict of tag name -> value, got {type(where).__name__}")
    pairs = []
    for name, value in where.items():
        if not isinstance(name, str):
            raise InvalidArgument(f"{who}(where=) tag names are strings, got {name!r:.80}")
        check_name("tag name", name)
        if value is not None and not isinstance(value, str | int | float | bool):
            raise InvalidArgument(
                f"{who}(where=) compares tags with a str, int, float, bool or None; {name!r} got "
                f"{type(value).__name__} (filter on a scalar tag)"
            )
        pairs.append((name, encode_tag(value)))
    return pairs


def clear(ctx: Context, keys: Any, partition_id: str) -> Op:
    """Remove keys, their samples and bytes. Unknown keys are ignored (idempotent)."""
    keys = _key_list(keys, "kv_clear")
    pk = ctx.keys(partition_id)
    # Plain reads, not kv_resolve (a script that may write): a full Redis (maxmemory) refuses
    # scripts that may write, and clearing must still work there to free memory.
    exists, ids = yield from transitions.pipeline(Cmd(("EXISTS", pk.meta)), Cmd(("HMGET", pk.kv, *keys)))
    if not exists:
        return
    yield from _forget(ctx, pk, [(k, int(i)) for k, i in zip(keys, ids) if i is not None])
