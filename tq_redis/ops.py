"""Client operations, each written once as a generator of effects (see :mod:`tq_redis.driver`).

An operation validates its input, yields Redis calls (one atomic Lua function per state
transition) and blocking store I/O, and returns the result. Order of work follows the
invariants of the architecture: bytes are stored *before* the bits that make them visible, and
bits are cleared *before* bytes are deleted.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict

from tq_redis import bitmaps, codec, samplers, transitions
from tq_redis.backends.base import StoreContext
from tq_redis.data_parser import DataParser, apply_data_parser
from tq_redis.driver import Cmd, Offload, Pipe, WaitToken
from tq_redis.errors import (
    BatchSizeMismatch,
    DataMissing,
    DataNotReady,
    EmptyBatch,
    InvalidArgument,
    SampleNotFound,
    UnknownField,
    UnknownPartition,
    UnsupportedValue,
)
from tq_redis.keys import PartitionKeys, check_name, config_key, partitions_key
from tq_redis.metadata import BatchMeta
from tq_redis.schemas import to_batchmeta_schema
from tq_redis.storage import KVStorageManager
from tq_redis.transitions import ClaimReply, text
from tq_redis.transitions import id_ranges as id_ranges  # re-exported: ops.id_ranges predates transitions

Op = Generator[Any, Any, Any]

MODES = ("fetch", "force_fetch", "insert")


@dataclass
class Context:
    """What operations need besides Redis: the namespace, client options and the data plane."""

    namespace: str
    redis_url: str
    allow_pickle: bool = False
    nested_output: bool = True
    strict_schema: bool = False
    # the default sampler (name, class or instance); None: this process's init() default, else
    # the one the namespace's config records (resolved once into ``resolved_sampler``)
    default_sampler: Any = None
    resolved_sampler: samplers.BaseSampler | None = None
    storage: KVStorageManager | None = None
    _keys: dict[str, PartitionKeys] = field(default_factory=dict)

    def keys(self, partition_id: str) -> PartitionKeys:
        pk = self._keys.get(partition_id)
        if pk is None:
            pk = self._keys[partition_id] = PartitionKeys(self.namespace, partition_id)
        return pk


def canonical(schema: dict[str, Any]) -> str:
    """The schema JSON exactly as Redis stores and compares it."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


# ------------------------------------------------------------------ data plane


def storage(ctx: Context) -> Op:
    """The namespace's storage manager, built from the ``storage`` settings ``init`` put in Redis."""
    if ctx.storage is None:
        raw = yield Cmd(("HGET", config_key(ctx.namespace), "storage"))
        spec = json.loads(raw) if raw else {"backend": "redis", "options": {}}
        ctx.storage = KVStorageManager(
            spec["backend"], spec.get("options") or {}, StoreContext(ctx.redis_url, ctx.namespace)
        )
    return ctx.storage


def write_config(ctx: Context, settings: dict[str, Any]) -> Op:
    """Record namespace settings (store, sampler) so attaching processes use the same ones."""
    mapping = {k: json.dumps(v) for k, v in settings.items()}
    yield Cmd(("HSET", config_key(ctx.namespace), *[x for kv in mapping.items() for x in kv]))


# ------------------------------------------------------------------ put


def _as_tensordict(data: Any) -> TensorDict:
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
    return td


def _batch_len(data: dict[str, Any]) -> int:
    first = next(iter(data.values()))
    if isinstance(first, torch.Tensor | np.ndarray):
        return int(first.shape[0]) if first.ndim else 1
    try:
        return len(first)
    except TypeError:
        raise UnsupportedValue(f"field value {first!r} has no batch dimension") from None


def _encode(ctx: Context, td: TensorDict) -> tuple[dict[str, str], dict[str, list]]:
    n = td.batch_size[0]
    schemas: dict[str, str] = {}
    values: dict[str, list] = {}
    for name in td.keys():
        check_name("field name", name)
        schema, per_sample = codec.encode_field(name, td.get(name), n, allow_pickle=ctx.allow_pickle)
        schemas[name] = canonical(schema)
        values[name] = per_sample
    return schemas, values


def _batchmeta_schema(schemas: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {name: to_batchmeta_schema(json.loads(s)) for name, s in schemas.items()}


def put(
    ctx: Context,
    data: Any,
    metadata: BatchMeta | None = None,
    partition_id: str | None = None,
    data_parser: DataParser | None = None,
) -> Op:
    """Insert new samples (no metadata) or write fields of existing samples (with metadata).

    ``data_parser`` (the reference's hook) may rewrite the batch's values in place first. With
    metadata, its ``custom_meta`` is stored as the samples' tags too, as the reference does.
    """
    td = _as_tensordict(data)
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
    result = yield from _rewrite(ctx, td, metadata)
    if any(metadata.custom_meta):
        yield from set_custom_meta(ctx, metadata)
    return result


def _insert(ctx: Context, td: TensorDict, partition_id: str) -> Op:
    pk = ctx.keys(partition_id)
    n = td.batch_size[0]
    schemas, values = _encode(ctx, td)
    first = yield from transitions.reserve(pk, n, schemas, ctx.strict_schema).call()
    ids = list(range(first, first + n))
    store = yield from storage(ctx)
    try:
        # A put that fails may still have written part of the batch (on the nodes that took it).
        yield Offload(store.put, (pk, ids, values))
        yield from transitions.pipeline(
            transitions.insert(pk, first, n, schemas, ctx.strict_schema),
            Cmd(("ZADD", partitions_key(ctx.namespace), "NX", time.time(), partition_id)),
        )
    except Exception as exc:
        # Leave no orphaned bytes; if even that fails they wait in the trash for the next clear.
        note = yield from discard_bytes(store, pk, ids, list(schemas))
        if note:
            exc.add_note(note)
        raise
    return BatchMeta.from_columns(
        ids, partition_id, _batchmeta_schema(schemas), production_status=np.ones(n, dtype=np.int8)
    )


def _allocate(ctx: Context, pk: PartitionKeys, fields: list[str], count: int) -> Op:
    """``mode="insert"``: ``count`` new samples with no field produced yet, for a later
    ``put(data, metadata=...)``. They are alive (listed, clearable) but no task can claim them
    before their fields are put."""
    first = yield from transitions.reserve(pk, count).call()
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
    schemas, values = _encode(ctx, td)
    store = yield from storage(ctx)
    groups = _group_by_partition(metadata)
    # Check every partition before writing any bytes: a conflict must leave nothing half-written.
    checks: list[Any] = []
    for pid, positions in groups.items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        checks += [Cmd(("EXISTS", pk.meta)), Cmd(("HMGET", pk.fields, *schemas)), transitions.check_visible(pk, ids)]
    replies = yield from transitions.pipeline(*checks)
    for k, pid in enumerate(groups):
        exists, registered, visible = replies[3 * k : 3 * k + 3]
        if not exists:
            raise UnknownPartition(f"partition {pid!r} does not exist (cleared, or never created)")
        for name, reg in zip(schemas, registered):
            if ctx.strict_schema and reg is not None and text(reg) != schemas[name]:
                transitions.raise_schema_conflict(name, reg, schemas[name])
        gone = visible.not_alive[:10]
        if gone:
            raise SampleNotFound(f"samples {gone[:10]} of partition {pid!r} were cleared or never inserted")
    if any(metadata.custom_meta):  # tags first: a consumer may claim the samples once their bits flip
        yield from set_custom_meta(ctx, metadata)
    for pid, positions in groups.items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        part = {name: [vals[i] for i in positions] for name, vals in values.items()}
        yield Offload(store.put, (pk, ids, part))
        yield from transitions.produce(pk, ids, schemas, ctx.strict_schema).call()
    result = metadata.copy()
    result.field_schema.update(_batchmeta_schema(schemas))
    result.production_status[:] = 1
    return BatchMeta(
        result.global_indexes,
        result.partition_ids,
        result.field_schema,
        production_status=result.production_status,
        extra_info=result.extra_info,
        custom_meta=result.custom_meta,
    )


def _group_by_partition(metadata: BatchMeta) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for pos, pid in enumerate(metadata.partition_ids):
        groups.setdefault(pid, []).append(pos)
    return groups


# ------------------------------------------------------------------ get_meta


def _check_fields(data_fields: Any) -> list[str]:
    if isinstance(data_fields, str):
        data_fields = [data_fields]
    if not isinstance(data_fields, list | tuple):
        raise InvalidArgument(f"data_fields must be a list of field names, got {data_fields!r}")
    return [check_name("field name", f) for f in data_fields]


def get_meta(
    ctx: Context,
    data_fields: Sequence[str],
    batch_size: int,
    partition_id: str,
    mode: str = "fetch",
    task_name: str | None = None,
    sampling_config: dict[str, Any] | None = None,
    timeout: float = 0.0,
    lease_s: float | None = None,
    max_deliveries: int | None = None,
) -> Op:
    """Claim a batch for ``task_name`` (fetch) or describe every sample (force_fetch).

    The sampler is ``sampling_config["sampler"]`` or the namespace default. A built-in runs
    inside the ``claim`` script (one round trip); any other sampler runs here on the ready list
    and its choice is claimed with ``claim_ids`` only if still free (see :mod:`tq_redis.samplers`).
    ``max_deliveries`` (or ``sampling_config["max_deliveries"]``) bounds redeliveries of a leased
    sample; past it the sample goes to the task's poison set.
    """
    fields = _check_fields(data_fields)
    if mode not in MODES:
        raise InvalidArgument(f"mode must be one of {MODES}, got {mode!r}")
    pk = ctx.keys(partition_id)
    if mode == "force_fetch":
        return (yield from _describe_partition(ctx, pk, fields))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size <= 0:
        raise InvalidArgument(f"batch_size must be a positive integer, got {batch_size!r}")
    batch_size = int(batch_size)
    if mode == "insert":
        return (yield from _allocate(ctx, pk, fields, batch_size))
    if task_name is None:
        raise InvalidArgument("get_meta(mode='fetch') needs task_name= (the consumer whose progress is tracked)")
    check_name("task_name", task_name)
    if timeout is None or timeout < 0:
        raise InvalidArgument(f"timeout must be >= 0 seconds, got {timeout!r}")
    if lease_s is not None and lease_s <= 0:
        raise InvalidArgument(f"lease_s must be > 0 seconds (or None for no lease), got {lease_s!r}")
    if sampling_config is not None and not isinstance(sampling_config, dict):
        raise InvalidArgument(f"sampling_config must be a dict, got {type(sampling_config).__name__}")
    config = dict(sampling_config or {})
    lease_ms = max(1, int(lease_s * 1000)) if lease_s else 0
    if max_deliveries is None:
        max_deliveries = config.get("max_deliveries", 0)
    if isinstance(max_deliveries, bool) or not isinstance(max_deliveries, int) or max_deliveries < 0:
        raise InvalidArgument(f"max_deliveries must be an integer >= 0 (0 = unlimited), got {max_deliveries!r}")
    spec = config.get("sampler")
    sampler = samplers.resolve_sampler(spec) if spec is not None else (yield from _default_sampler(ctx))
    if samplers.is_builtin(sampler):
        plan = samplers.builtin_plan(sampler, config, batch_size)
        attempt = _builtin_claim(pk, plan, task_name, lease_ms, max_deliveries, fields)
    else:
        attempt = _user_claim(pk, sampler, config, batch_size, task_name, lease_ms, max_deliveries, fields)
    # Waiting is for a wake token, not for any event: each event wakes one waiting consumer of
    # the task (who wakes the next if it got something), never all of them at once.
    deadline = time.monotonic() + timeout
    waiter = uuid.uuid4().hex if timeout > 0 else None
    user_registered = False  # whether the user-sampler path registered the waiter
    while True:
        wait_ms = int((deadline - time.monotonic()) * 1000) if waiter else 0
        meta, last_id, next_deadline, registered = yield from attempt(waiter, max(wait_ms, 0))
        remaining = deadline - time.monotonic()
        if meta is not None or remaining <= 0:
            if user_registered:  # stop counting as a waiter, so no token is spent on us
                yield Cmd(("ZREM", pk.waiters(task_name), waiter))
            if meta is None:
                return BatchMeta.empty()
            meta.set_extra_info("task_name", task_name)
            return meta
        if not registered:  # the user-sampler path: register unless something changed meanwhile
            wait_ms = max(1, int(remaining * 1000))
            registered = yield from transitions.wait(pk, task_name, waiter, wait_ms, last_id).call()
            user_registered = user_registered or registered
        if next_deadline >= 0:  # a lease of this task lapses sooner: re-check then
            remaining = min(remaining, max(0.001, (next_deadline - transitions.clock_ms()) / 1000))
        if registered:
            yield WaitToken(pk.wake(task_name), remaining)


# A user sampler whose choice keeps being taken by other consumers gives up after this many tries.
USER_SAMPLER_ATTEMPTS = 16


def _default_sampler(ctx: Context) -> Op:
    """The client's default sampler: its context's, else what ``init`` got in this process for
    the namespace (class or instance included), else the spec ``init`` recorded in
    ``<ns>:config``; resolved once per client."""
    if ctx.resolved_sampler is not None:
        return ctx.resolved_sampler
    spec = ctx.default_sampler
    if spec is None:
        spec = samplers.process_default(ctx.redis_url, ctx.namespace)
    if spec is not None:
        sampler = samplers.resolve_sampler(spec)
    else:
        raw = yield Cmd(("HGET", config_key(ctx.namespace), "sampler"))
        sampler = samplers.sampler_from_spec(raw)
    ctx.resolved_sampler = sampler
    return sampler


def _builtin_claim(
    pk: PartitionKeys, plan: samplers.SamplerPlan, task: str, lease_ms: int, max_deliveries: int, fields: list[str]
):
    """One claim with a built-in sampler: an attempt ``(waiter, wait_ms)`` yielding ``(meta|None,
    last_id, deadline, registered)``; with nothing to claim the script registers the waiter itself."""

    def attempt(waiter: str | None, wait_ms: int) -> Op:
        got = yield from transitions.claim(
            pk, task, plan, fields, lease_ms=lease_ms, max_deliveries=max_deliveries, waiter=waiter, wait_ms=wait_ms
        ).call()
        meta = _claimed_meta(pk.partition, got) if got.ids else None
        return meta, got.last_event_id, got.next_deadline_ms, got.registered

    return attempt


def _checked_choice(name: str, chosen: Any, ready: set[int], sampler: samplers.BaseSampler) -> list[int]:
    try:
        ids = [int(i) for i in chosen]
    except (TypeError, ValueError):
        raise samplers.SamplerError(
            f"{type(sampler).__name__}.sample() must return two lists of sample ids; {name} is {chosen!r}"
        ) from None
    if len(set(ids)) != len(ids):
        raise samplers.SamplerError(f"{type(sampler).__name__}.sample() returned duplicate ids in {name}: {ids[:10]}")
    strays = [i for i in ids if i not in ready]
    if strays:
        raise samplers.SamplerError(
            f"{type(sampler).__name__}.sample() chose ids {strays[:10]} in {name} that were not in ready_indexes"
        )
    return ids


Chooser = Callable[[list[int]], Op]
"""Picks from a task's ready ids (ascending): a generator, which may yield effects, returning
``(sampled, consumed)`` (see :meth:`tq_redis.samplers.BaseSampler.sample`) or None to take nothing."""


class ChoiceClaim(NamedTuple):
    """What :func:`claim_choice` got."""

    meta: BatchMeta | None  # the claimed batch, None if nothing was claimed
    last_event_id: str  # what to wait from when nothing was claimed
    next_deadline_ms: int  # earliest lease deadline of the task, -1 if none
    exhausted: bool  # every attempt's choice was taken by other consumers first
    lost: list[int]  # then: the ids the last attempt lost


def claim_choice(
    pk: PartitionKeys,
    task: str,
    fields: list[str],
    batch_size: int,
    choose: Chooser,
    *,
    lease_ms: int = 0,
    max_deliveries: int = 0,
    attempts: int = 0,
) -> Op:
    """Claim for ``task`` what ``choose`` picks from the samples ready for it, if still free.

    Reads the ready set (``lua/ready_ids.lua``); with fewer than ``batch_size`` ready, or a
    choice of nothing, claims nothing. The choice is claimed only if every id is still free
    (``lua/claim_ids.lua``); when another consumer took one first, the loop starts over with a
    fresh ready set, at most ``attempts`` times (0: :data:`USER_SAMPLER_ATTEMPTS`). Returns a
    :class:`ChoiceClaim`; the caller decides what running out of attempts means.
    """
    last_id, next_deadline, lost = "", -1, []
    for _ in range(attempts or USER_SAMPLER_ATTEMPTS):
        ready = yield from transitions.ready_ids(pk, task, fields, max_deliveries=max_deliveries).call()
        last_id, next_deadline = ready.last_event_id, ready.next_deadline_ms
        if len(ready.ids) < batch_size:
            break
        choice = yield from choose(ready.ids)
        if choice is None or not choice[0]:
            break
        sampled, consumed = choice
        got = yield from transitions.claim_ids(pk, task, sampled, consumed, fields, lease_ms=lease_ms).call()
        if got.claimed is not None:
            done = got.claimed
            return ChoiceClaim(_claimed_meta(pk.partition, done), done.last_event_id, done.next_deadline_ms, False, [])
        if got.partition_missing:
            break
        lost = got.taken
    else:
        return ChoiceClaim(None, last_id, next_deadline, True, lost)
    return ChoiceClaim(None, last_id, next_deadline, False, [])


def _user_claim(
    pk: PartitionKeys,
    sampler: samplers.BaseSampler,
    config: dict[str, Any],
    batch_size: int,
    task: str,
    lease_ms: int,
    max_deliveries: int,
    fields: list[str],
):
    """One claim with a user's Python sampler (:func:`claim_choice`): read the ready set, let the
    sampler choose, and claim the choice only if every id is still free; on a conflict, try
    again with a fresh ready set, up to :data:`USER_SAMPLER_ATTEMPTS` times, then raise."""
    kwargs = {k: v for k, v in config.items() if k not in ("sampler", "max_deliveries")}
    kwargs.update(task_name=task, partition_id=pk.partition)

    def choose(ready: list[int]) -> Op:
        yield from ()  # the sampler runs here, with no Redis call
        sampled, consumed = sampler.sample(ready, batch_size, **kwargs)
        ready_set = set(ready)
        sampled = _checked_choice("sampled", sampled, ready_set, sampler)
        consumed = _checked_choice("consumed", consumed, ready_set, sampler)
        return sampled, consumed

    def attempt(waiter: str | None, wait_ms: int) -> Op:  # waiting is registered by get_meta (`wait`)
        got = yield from claim_choice(
            pk, task, fields, batch_size, choose, lease_ms=lease_ms, max_deliveries=max_deliveries
        )
        if got.exhausted:
            raise samplers.SamplerError(
                f"{type(sampler).__name__} lost its choice to other consumers {USER_SAMPLER_ATTEMPTS} times in a "
                f"row (last taken: {got.lost[:10]}); make it pick less contended samples, e.g. spread choices at "
                f"random"
            )
        return got.meta, got.last_event_id, got.next_deadline_ms, False

    return attempt


def _claimed_meta(partition_id: str, claimed: ClaimReply) -> BatchMeta:
    n = len(claimed.ids)
    meta = BatchMeta.from_columns(
        claimed.ids,
        partition_id,
        _batchmeta_schema(claimed.schemas),
        production_status=np.ones(n, dtype=np.int8),
        custom_meta=claimed.tags,
    )
    if claimed.deliveries:
        counts = claimed.deliveries
        meta.set_extra_info("delivery_counts", counts)
        # Per sample too, so the fencing token follows a sample through select/chunk/concat.
        meta._custom_backend_meta = [{_DELIVERY: d} for d in counts]
    return meta


def _describe_partition(ctx: Context, pk: PartitionKeys, fields: list[str], *, unknown_unproduced: bool = False) -> Op:
    """Every alive sample with its production status of ``fields`` (force_fetch and the status
    calls). A field never put raises ``UnknownField``, or with ``unknown_unproduced`` counts as
    produced for no sample (the status calls: the reference knows fields from ``mode="insert"``)."""
    calls = [Cmd(("EXISTS", pk.meta)), Cmd(("GET", pk.alive)), Cmd(("SMEMBERS", pk.tagnames))]
    if fields:
        calls.append(Cmd(("HMGET", pk.fields, *fields)))
    calls += [Cmd(("GET", pk.prod(f))) for f in fields]
    replies = yield Pipe(tuple(calls))
    exists, alive_raw, tagnames = replies[:3]
    if not exists:
        raise UnknownPartition(f"partition {pk.partition!r} does not exist (cleared, or never created)")
    alive = bitmaps.unpack(alive_raw)
    ids = np.flatnonzero(alive)
    ready = np.ones(len(ids), dtype=np.int8)
    schema: dict[str, dict[str, Any]] = {}
    if fields:
        for name, raw in zip(fields, replies[3]):
            if raw is None:
                if unknown_unproduced:
                    ready[:] = 0
                    continue
                raise UnknownField(
                    f"field {name!r} was never put in partition {pk.partition!r}; known fields come from put()"
                )
            schema[name] = to_batchmeta_schema(json.loads(raw))
        for raw in replies[4:]:
            bits = bitmaps.unpack(raw)
            produced = np.zeros(len(alive), dtype=bool)
            produced[: min(len(bits), len(alive))] = bits[: len(alive)]
            ready &= produced[ids].astype(np.int8)
    id_list = ids.tolist()
    custom = None
    if tagnames and id_list:
        names = [text(t) for t in tagnames]
        values = yield Pipe(tuple(Cmd(("HMGET", pk.tag(t), *id_list)) for t in names))
        custom = transitions.tag_rows([x for pair in zip(names, values) for x in pair], len(id_list))
    return BatchMeta.from_columns(id_list, pk.partition, schema, production_status=ready, custom_meta=custom)


# ------------------------------------------------------------------ get_data


def get_data(ctx: Context, metadata: BatchMeta) -> Op:
    """Fetch the fields of ``metadata`` as a TensorDict ordered like ``metadata.global_indexes``."""
    if not isinstance(metadata, BatchMeta):
        raise InvalidArgument(f"get_data() takes the BatchMeta returned by get_meta/put, got {type(metadata).__name__}")
    fields = list(metadata.field_names)
    n = metadata.size
    if n == 0:
        return TensorDict({}, batch_size=[0])
    if not fields:
        raise InvalidArgument("metadata has no fields to fetch; get_meta(data_fields=[...]) names them")
    store = yield from storage(ctx)
    groups = _group_by_partition(metadata)
    per_field: dict[str, list] = {f: [None] * n for f in fields}
    for pid, positions in groups.items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        try:
            got = yield Offload(store.get, (pk, ids, fields))
        except DataMissing:
            got = None
        # Bits are cleared before bytes are deleted, so reading the bits after the bytes proves
        # the bytes belong to live, produced samples (ids are never reused).
        yield from _verify_visible(pk, ids, fields)
        if got is None:
            raise DataMissing(f"data of partition {pid!r} is missing from the store although marked produced")
        if len(groups) == 1:  # one partition: the store's order is already the batch's
            per_field = got
            break
        for name in fields:
            column = per_field[name]
            for pos, value in zip(positions, got[name]):
                column[pos] = value
    out = {}
    for name in fields:
        out[name] = codec.decode_field(
            name, per_field[name], allow_pickle=ctx.allow_pickle, nested_output=ctx.nested_output
        )
    return TensorDict(out, batch_size=[n])


def _verify_visible(pk: PartitionKeys, ids: list[int], fields: list[str]) -> Op:
    visible = yield from transitions.check_visible(pk, ids, fields).call()
    if visible.not_alive:
        raise SampleNotFound(f"samples {visible.not_alive[:10]} of partition {pk.partition!r} were cleared")
    if visible.field is not None:
        name, missing = visible.field, visible.not_produced[:10]
        raise DataNotReady(
            f"field {name!r} is not produced yet for samples {missing} of partition {pk.partition!r}; "
            f"get_meta(mode='fetch') only returns ready samples"
        )


# ------------------------------------------------------------------ tags, clear, status


def set_custom_meta(ctx: Context, metadata: BatchMeta) -> Op:
    """Write ``metadata.custom_meta`` as per-sample tags."""
    if len(metadata.custom_meta) != metadata.size:
        raise BatchSizeMismatch(f"custom_meta has {len(metadata.custom_meta)} entries for {metadata.size} samples")
    for pid, positions in _group_by_partition(metadata).items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        rows = [metadata.custom_meta[i] for i in positions]
        names = sorted({k for row in rows for k in row})
        if names:
            yield from transitions.set_tags(pk, ids, names, rows).call()


def clear_samples(ctx: Context, metadata: BatchMeta) -> Op:
    """Remove samples (bits first, then bytes). Idempotent.

    If a store is unreachable the bytes stay in the partition's trash (in Redis) and the error is
    raised; clearing the same samples again, or the partition, deletes them.
    """
    store = yield from storage(ctx)
    for pid, positions in _group_by_partition(metadata).items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        cleared = yield from transitions.clear(pk, ids).call()
        if cleared.ids:
            yield from delete_bytes(store, pk, cleared.ids, cleared.fields)
        elif cleared.older:  # a repeated clear: finish what an earlier one could not
            yield from empty_trash(store, pk)


def clear_partition(ctx: Context, partition_id: str) -> Op:
    """Remove a partition and its data. Idempotent; its sample ids are never reused.

    Bytes an earlier clear could not delete (a store was unreachable) are deleted too.
    """
    pk = ctx.keys(partition_id)
    store = yield from storage(ctx)
    dropped = yield from transitions.drop_partition(pk).call()
    yield Cmd(("ZREM", partitions_key(ctx.namespace), partition_id))
    if dropped.older:
        yield from empty_trash(store, pk)
        return
    ids = dropped.alive_ids()
    if ids:
        yield from delete_bytes(store, pk, ids, dropped.fields)


def delete_bytes(store: KVStorageManager, pk: PartitionKeys, ids: list[int], fields: list[str]) -> Op:
    """Delete the bytes of samples already in the partition's trash, then take them out of it."""
    yield Offload(store.delete, (pk, ids, fields))
    yield from transitions.trash_done(pk, ids).call()


def empty_trash(store: KVStorageManager, pk: PartitionKeys) -> Op:
    """Delete every sample's bytes waiting in the partition's trash."""
    raw, fields = yield Pipe((Cmd(("GET", pk.trash)), Cmd(("SMEMBERS", pk.trash_fields))))
    ids = bitmaps.set_ids(raw)
    if ids:
        yield from delete_bytes(store, pk, ids, sorted(text(f) for f in fields))


def discard_bytes(store: KVStorageManager, pk: PartitionKeys, ids: list[int], fields: list[str]) -> Op:
    """Delete bytes written for samples that will never become visible (a put that failed).

    They go into the trash first, so if the delete fails they are retried by a later clear. Runs
    while the caller handles the put's error, which is the one to raise: returns None when the
    bytes are gone, else a note for that error saying what is left and why.
    """
    try:
        yield from transitions.trash_add(pk, ids, fields).call()
    except Exception as exc:
        return f"the bytes this put wrote may remain in the store: they could not be recorded for deletion ({exc})"
    try:
        yield from delete_bytes(store, pk, ids, fields)
    except Exception as exc:
        return (
            f"the bytes this put wrote are not deleted yet ({exc}); the next clear of partition "
            f"{pk.partition!r} deletes them"
        )
    return None


def reset_consumption(ctx: Context, partition_id: str, task_name: str | None = None) -> Op:
    pk = ctx.keys(partition_id)
    if task_name is not None:
        check_name("task_name", task_name)
    return (yield from transitions.reset_consumption(pk, task_name).call())


def get_partition_list(ctx: Context) -> Op:
    names = yield Cmd(("ZRANGE", partitions_key(ctx.namespace), 0, -1))
    return [text(n) for n in names]


def _no_status() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.int8)


def production_status(ctx: Context, data_fields: Sequence[str], partition_id: str) -> Op:
    """``(global_indexes, status)`` tensors: status 1 where every field is produced.

    A partition that does not exist (cleared, or never created) has no samples: both are empty,
    as in the reference system, since user code polls this after clearing.
    """
    fields = _check_fields(data_fields)
    try:
        meta = yield from _describe_partition(ctx, ctx.keys(partition_id), fields, unknown_unproduced=True)
    except UnknownPartition:
        return _no_status()
    return torch.tensor(meta.global_indexes, dtype=torch.long), torch.from_numpy(meta.production_status.copy())


def consumption_status(ctx: Context, task_name: str, partition_id: str) -> Op:
    """``(global_indexes, status)`` tensors: status 1 where the task consumed the sample (both
    empty for a partition that does not exist, as for :func:`production_status`)."""
    check_name("task_name", task_name)
    pk = ctx.keys(partition_id)
    exists, alive_raw, cons_raw = yield Pipe(
        (Cmd(("EXISTS", pk.meta)), Cmd(("GET", pk.alive)), Cmd(("GET", pk.cons(task_name))))
    )
    if not exists:
        return _no_status()
    alive = bitmaps.unpack(alive_raw)
    ids = np.flatnonzero(alive)
    cons = np.zeros(len(alive), dtype=bool)
    bits = bitmaps.unpack(cons_raw)[: len(alive)]
    cons[: len(bits)] = bits
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(cons[ids].astype(np.int8))


_DELIVERY = "_delivery"


def _fences(metadata: BatchMeta) -> list[int]:
    """The delivery count each sample was handed out with (0 where unknown: settle unfenced)."""
    n = metadata.size
    rows = metadata._custom_backend_meta
    fences = [int(row.get(_DELIVERY, 0)) for row in rows]
    if not any(fences):
        counts = metadata.get_extra_info("delivery_counts")
        if isinstance(counts, list) and len(counts) == n:
            fences = [int(c) for c in counts]
    return fences


def settle(ctx: Context, metadata: BatchMeta, task_name: str, action: str, lease_s: float = 0.0) -> Op:
    """ack / nack / extend the leases of ``metadata``'s samples; returns the ids not held.

    Each sample's delivery count is sent along as a fencing token (``lua/settle.lua``): once a
    lapsed lease was handed to another consumer, the old holder can no longer settle it.
    """
    check_name("task_name", task_name)
    if action not in ("ack", "nack", "extend"):
        raise InvalidArgument(f"settle action must be 'ack', 'nack' or 'extend', got {action!r}")
    if action == "extend" and not lease_s > 0:
        raise InvalidArgument(f"extend_lease needs seconds > 0, got {lease_s!r}")
    fences = _fences(metadata)
    not_held: list[int] = []
    for pid, positions in _group_by_partition(metadata).items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        held_with, lease_ms = [fences[i] for i in positions], max(1, int(lease_s * 1000))
        settled = yield from transitions.settle(pk, task_name, action, ids, held_with, lease_ms).call()
        not_held.extend(settled.not_held)
    return not_held

