"""Partial rollout: a field of a sample written in parts across calls, each part recorded with the
policy version that generated it, the sample visible to consumers only once marked complete.

A long generation interrupted by a weight update keeps its tokens so far: the producer appends
them (:func:`append_parts`), and appends the rest later, possibly under a newer policy, then marks
the field complete (``complete=True`` on the last append, or :func:`complete_parts`). A task claims
the sample only once it is complete (its ``<p>:prod:<field>`` bit is that mark), and
:func:`get_data` returns the parts joined, in order, with a companion ``"<field>~version"`` column:
the policy version of every row (token) of the field, from which a consumer builds its off-policy
mask. An unfinished sample simply stays in its partition across steps (and ages): its parts are
never copied.

Storage (see ``lua/includes/parts.lua``): part ``k`` of a sample is the hidden field
``"<field>~<k>"``, stored like any value (inline in Redis when small, else in the store) and
cleared with the sample; the per-sample tags ``"<field>~parts"`` (``[[policy_version, length, k],
...]``) and ``"<field>~next"`` say what is there. Every field or tag name holding ``~`` is
reserved for that (:mod:`tq_redis.names` refuses it as a user's field or tag, and reads leave these
tags out of ``custom_meta``).

Atomicity: small parts (at most ``storage.inline_max_bytes`` each) are stored and recorded by one
script. Larger ones take two: ``part_alloc`` hands out fresh part indexes and registers their
hidden fields *before* any byte is stored, then the bytes go to the store, then ``part_append``
records them (data first, then bits). A producer killed in between leaves bytes under a
registered field of the sample, never referenced by its parts, which the sample's (or the
partition's) clear deletes; a refused record deletes what it stored at once. A part index is
handed out once, so two appenders never write the same key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from tq_redis import names
from tq_redis.codec import tensors as codec
from tq_redis.errors import BatchSizeMismatch, InvalidArgument, UnsupportedValue
from tq_redis.meta import BatchMeta
from tq_redis.meta.keys import PartitionKeys
from tq_redis.meta.schemas import KIND_PARTS
from tq_redis.ops import arguments, script_budget, transitions
from tq_redis.ops import data as data_ops
from tq_redis.ops.clear import discard_bytes
from tq_redis.ops.context import Context, Op, batchmeta_schema, canonical, group_by_partition, storage
from tq_redis.ops.effects import Offload
from tq_redis.ops.transitions import PartSpec
from tq_redis.storage.manager import KVStorageManager

PART_MARK = names.RESERVED_MARK
"""Separates an appended field's name from its hidden parts and tags (``responses~0``,
``responses~parts``) and from the version column :func:`get_data` adds (``responses~version``)."""

VERSION_SUFFIX = PART_MARK + "version"


def version_column(field: str) -> str:
    """The name of the per-row policy-version column ``get_data`` returns beside ``field``."""
    return field + VERSION_SUFFIX


def _policy_version(value: Any) -> int:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) or value < 0:
        raise InvalidArgument(
            f"policy_version must be an integer >= 0 (the version that generated the part), got {value!r:.80}"
        )
    return int(value)


def _field(name: Any) -> str:
    return names.field_name(name)  # refuses PART_MARK: it names an appended field's hidden parts


def _row_lengths(name: str, value: Any, n: int) -> list[int]:
    """The length (first per-sample dimension: tokens) of each sample's part of ``value``."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return [int(row.shape[0]) if row.dim() else 1 for row in value.unbind()]
    if isinstance(value, torch.Tensor | np.ndarray):
        return [int(value.shape[1]) if value.ndim > 1 else 1] * n
    raise UnsupportedValue(
        f"append_parts() field {name!r}: a part must be a tensor or numpy array with one row per sample "
        f"(tokens first), got {type(value).__name__}"
    )


def append_parts(
    ctx: Context,
    metadata: BatchMeta,
    data: Any,
    policy_version: int,
    *,
    complete: bool = False,
) -> Op[BatchMeta]:
    """Append one part to each field of ``data`` for each sample of ``metadata`` (one row per
    sample: its new tokens), recorded with ``policy_version``; ``complete=True`` also marks those
    fields complete, making the samples claimable for tasks that need them.

    The samples must exist (a ``put`` of their prompts, or ``get_meta(mode="insert")``). Returns
    the metadata with the fields added (kind ``"parts"``; produced where complete).

    Raises:
        SampleComplete: a field is already complete for some sample; nothing was appended.
        SampleNotFound, UnknownPartition: the samples or the partition are gone.
        InvalidArgument, BatchSizeMismatch, UnsupportedValue: what the call passed cannot be appended.
    """
    version = _policy_version(policy_version)
    arguments.batch_meta(metadata, "append_parts")
    td = data_ops.as_tensordict(data)
    n = td.batch_size[0]
    if metadata.size != n:
        raise BatchSizeMismatch(f"append_parts() data has {n} samples but metadata has {metadata.size}")
    fields = [_field(name) for name in td.keys()]
    lengths = {name: _row_lengths(name, td.get(name), n) for name in fields}
    part_schemas, values = data_ops.encode_batch(ctx, td)
    specs = [PartSpec(f, part_schemas[f], _field_schema(part_schemas[f])) for f in fields]
    store = yield from storage(ctx)
    done = fields if complete else []
    for pid, positions in group_by_partition(metadata).items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        part = {f: [values[f][i] for i in positions] for f in fields}
        part_lengths = {f: [lengths[f][i] for i in positions] for f in fields}
        for piece in script_budget.slices(len(ids), 2 * len(fields) + 1):
            piece_values = {f: column[piece] for f, column in part.items()}
            piece_lengths = [x for f in fields for x in part_lengths[f][piece]]
            yield from _append_piece(ctx, store, pk, ids[piece], specs, piece_values, piece_lengths, version, done)
    return _with_parts(metadata, specs, complete)


def _field_schema(part_schema: str) -> str:
    dtype = json.loads(part_schema).get("dtype")
    return canonical({"dtype": dtype, "kind": KIND_PARTS, "shape": None})


def _append_piece(
    ctx: Context, store: KVStorageManager, pk: PartitionKeys, ids: list[int], specs: list[PartSpec],
    values: dict[str, list], lengths: list[int], version: int, complete: list[str],
) -> Op:  # fmt: skip
    inline = data_ops.inline_payload(values, store.inline_max_bytes)
    if inline is not None:  # small parts: stored and recorded by one script
        store.count_inline("put", inline)
        yield from transitions.part_append(
            pk, ids, specs, lengths, version, inline_values=inline, complete=complete
        ).call()
        return
    indexes = yield from transitions.part_alloc(pk, ids, specs).call()
    stored: list[str] = []
    ring: str | None = None
    try:
        for f_at, spec in enumerate(specs):
            by_index: dict[int, list[int]] = {}
            for i, k in enumerate(indexes[f_at * len(ids):(f_at + 1) * len(ids)]):
                by_index.setdefault(k, []).append(i)
            for k, rows in by_index.items():
                name = f"{spec.name}{PART_MARK}{k}"
                stored.append(name)
                column = {name: [values[spec.name][i] for i in rows]}
                got = yield Offload(store.put, (pk, [ids[i] for i in rows], column))
                if ring is not None and got != ring:
                    raise InvalidArgument(f"the store's ring changed during an append ({ring} -> {got}); append again")
                ring = got
        yield from transitions.part_append(
            pk, ids, specs, lengths, version, indexes=indexes, ring=ring, complete=complete
        ).call()
    except Exception as exc:
        # nothing references these fresh part keys: delete them (the trash retries a failed delete)
        note = yield from discard_bytes(store, pk, ids, stored, ring)
        if note:
            exc.add_note(note)
        raise


def complete_parts(ctx: Context, metadata: BatchMeta, fields: Sequence[str]) -> Op[BatchMeta]:
    """Mark appended ``fields`` complete for the samples of ``metadata`` without appending: they
    become claimable for tasks that need them. Raises ``SampleComplete`` if one already is."""
    arguments.batch_meta(metadata, "complete_parts")
    if isinstance(fields, str) or not fields:
        raise InvalidArgument(f"complete_parts() takes a non-empty list of field names, got {fields!r:.80}")
    fields = [_field(f) for f in fields]
    for pid, positions in group_by_partition(metadata).items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        for piece in script_budget.slices(len(ids), len(fields)):
            yield from transitions.part_append(pk, ids[piece], [], [], 0, complete=fields).call()
    result = metadata.copy()
    result.production_status[:] = 1
    return result


def _with_parts(metadata: BatchMeta, specs: list[PartSpec], complete: bool) -> BatchMeta:
    result = metadata.copy()
    result.field_schema.update(batchmeta_schema({s.name: s.field_schema for s in specs}))
    if complete:
        result.production_status[:] = 1
    return result


# ------------------------------------------------------------------ reading


def parts_fields(metadata: BatchMeta) -> list[str]:
    """The fields of ``metadata`` written in parts (schema kind ``"parts"``)."""
    schema = metadata.field_schema
    return [f for f in metadata.field_names if (schema.get(f) or {}).get("kind") == KIND_PARTS]


def get_data(ctx: Context, metadata: BatchMeta) -> Op[TensorDict]:
    """``get_data`` that also reads fields written in parts: each joined in order, with its
    ``"<field>~version"`` column (the policy version of every row of the field). A batch without
    such a field is read exactly as :func:`tq_redis.ops.data.get_data` reads it."""
    appended = parts_fields(metadata) if isinstance(metadata, BatchMeta) else []
    if not appended or metadata.size == 0:
        return (yield from data_ops.get_data(ctx, metadata))
    rest = [f for f in metadata.field_names if f not in appended]
    plain = (yield from data_ops.get_data(ctx, metadata.select_fields(rest))) if rest else None
    n = metadata.size
    columns: dict[str, Any] = {}
    for field in metadata.field_names:
        if field not in appended:
            columns[field] = plain.get(field)  # type: ignore[union-attr]
            continue
        rows: list[Any] = [None] * n
        versions: list[Any] = [None] * n
        for pid, positions in group_by_partition(metadata).items():
            ids = [metadata.global_indexes[i] for i in positions]
            got_rows, got_versions = yield from read_parts(ctx, ctx.keys(pid), ids, field)
            for pos, row, ver in zip(positions, got_rows, got_versions):
                rows[pos], versions[pos] = row, ver
        columns[field] = _column(rows, ctx.nested_output)
        columns[version_column(field)] = _column(versions, ctx.nested_output)
    return codec.assemble(columns, n)


def _column(rows: list[torch.Tensor], nested: bool) -> torch.Tensor:
    shapes = {tuple(r.shape) for r in rows}
    if len(shapes) == 1 and not nested:
        return torch.stack(rows)
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def read_parts(ctx: Context, pk: PartitionKeys, ids: list[int], field: str) -> Op:
    """``(rows, versions)``: per id, its parts of ``field`` joined (a tensor, tokens first) and the
    policy version of each row. Parts in a store are read from it and proved by their bits after."""
    store = yield from storage(ctx)
    parts: list[list[tuple[int, int, int]]] = []
    values: list[list[Any]] = []
    for piece in script_budget.pieces(ids, 4):
        read = yield from transitions.part_read(pk, piece, field).call()
        data_ops.raise_invisible(pk, read.visibility)
        parts += read.parts
        values += read.values
    lacking: dict[int, list[int]] = {}
    for at, (sample_parts, sample_values) in enumerate(zip(parts, values)):
        for j, (_, _, k) in enumerate(sample_parts):
            if sample_values[j] is None:
                lacking.setdefault(k, []).append(at)
    for k, positions in lacking.items():
        name = f"{field}{PART_MARK}{k}"
        got = yield from data_ops.read_store(store, pk, [ids[at] for at in positions], [name])
        for at, value in zip(positions, got[name]):
            j = next(j for j, p in enumerate(parts[at]) if p[2] == k)
            values[at][j] = value
    rows, versions = [], []
    for sample_parts, sample_values in zip(parts, values):
        pieces = [_one(field, value, ctx.allow_pickle) for value in sample_values]
        rows.append(torch.cat(pieces) if pieces else torch.empty(0))
        versions.append(
            torch.cat([torch.full((length,), v, dtype=torch.int64) for v, length, _ in sample_parts])
            if sample_parts else torch.empty(0, dtype=torch.int64)
        )  # fmt: skip
    return rows, versions


def _one(field: str, value: Any, allow_pickle: bool) -> torch.Tensor:
    decoded = codec.decode_field(field, [value], allow_pickle=allow_pickle)
    if isinstance(decoded, np.ndarray):
        decoded = torch.from_numpy(decoded)
    if not isinstance(decoded, torch.Tensor):
        raise UnsupportedValue(f"field {field!r}: a part decoded to {type(decoded).__name__}, not a tensor")
    row = decoded.unbind()[0] if decoded.is_nested else decoded[0]
    return row if row.dim() else row.reshape(1)
