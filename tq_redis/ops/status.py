"""Read-only operations on a partition's state: every sample with its production status
(``get_meta(mode="force_fetch")`` and ``production_status``), a task's consumption status, and
the namespace's partition list.

A partition that does not exist (cleared, or never created) has no samples for the status calls,
as in the reference system, since user code polls them after clearing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tq_redis import names
from tq_redis.errors import UnknownField, UnknownPartition
from tq_redis.meta import BatchMeta, bitmaps
from tq_redis.meta.keys import PartitionKeys, partitions_key
from tq_redis.meta.schemas import to_batchmeta_schema
from tq_redis.ops import encoding
from tq_redis.ops.context import Context, Op, check_fields
from tq_redis.ops.effects import Cmd, Pipe
from tq_redis.ops.encoding import text


def describe_partition(
    ctx: Context, pk: PartitionKeys, fields: list[str], *, unknown_unproduced: bool = False, with_tags: bool = True
) -> Op:
    """Every alive sample with its production status of ``fields`` (force_fetch and the status
    calls). A field never put raises ``UnknownField``, or with ``unknown_unproduced`` counts as
    produced for no sample (the status calls: the reference knows fields from ``mode="insert"``).
    ``with_tags=False`` leaves the samples' tags out (the status calls need none)."""
    calls = [Cmd(("EXISTS", pk.meta)), Cmd(("GET", pk.alive))]
    if fields:
        calls.append(Cmd(("HMGET", pk.fields, *fields)))
    calls += [Cmd(("GET", pk.prod(f))) for f in fields]
    if with_tags:
        calls.append(Cmd(("SMEMBERS", pk.tagnames)))
    replies = yield Pipe(tuple(calls))
    exists, alive_raw = replies[:2]
    registered = replies[2] if fields else []
    produced_raws = replies[3 : 3 + len(fields)]
    tagnames = replies[-1] if with_tags else None
    if not exists:
        raise UnknownPartition(f"partition {pk.partition!r} does not exist (cleared, or never created)")
    alive = bitmaps.unpack(alive_raw)
    ids = np.flatnonzero(alive)
    ready = np.ones(len(ids), dtype=np.int8)
    schema: dict[str, dict[str, Any]] = {}
    if fields:
        for name, raw in zip(fields, registered):
            if raw is None:
                if unknown_unproduced:
                    ready[:] = 0
                    continue
                raise UnknownField(
                    f"field {name!r} was never put in partition {pk.partition!r}; known fields come from put()"
                )
            schema[name] = to_batchmeta_schema(json.loads(raw))
        for raw in produced_raws:
            bits = bitmaps.unpack(raw)
            produced = np.zeros(len(alive), dtype=bool)
            produced[: min(len(bits), len(alive))] = bits[: len(alive)]
            ready &= produced[ids].astype(np.int8)
    id_list = ids.tolist()
    custom = None
    if tagnames and id_list:
        names = [text(t) for t in tagnames]
        values = yield Pipe(tuple(Cmd(("HMGET", pk.tag(t), *id_list)) for t in names))
        custom = encoding.tag_rows([x for pair in zip(names, values) for x in pair], len(id_list))
    return BatchMeta.from_columns(id_list, pk.partition, schema, production_status=ready, custom_meta=custom)


def get_partition_list(ctx: Context) -> Op:
    """The namespace's partitions, oldest first."""
    names = yield Cmd(("ZRANGE", partitions_key(ctx.namespace), 0, -1))
    return [text(n) for n in names]


def _no_status() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.int8)


def production_status(ctx: Context, data_fields: Sequence[str], partition_id: str) -> Op:
    """``(global_indexes, status)`` tensors: status 1 where every field is produced.

    A partition that does not exist (cleared, or never created) has no samples: both are empty,
    as in the reference system, since user code polls this after clearing.
    """
    fields = check_fields(data_fields)
    try:
        meta = yield from describe_partition(
            ctx, ctx.keys(partition_id), fields, unknown_unproduced=True, with_tags=False
        )
    except UnknownPartition:
        return _no_status()
    return torch.tensor(meta.global_indexes, dtype=torch.long), torch.from_numpy(meta.production_status.copy())


def consumption_status(ctx: Context, task_name: str, partition_id: str) -> Op:
    """``(global_indexes, status)`` tensors: status 1 where the task consumed the sample (both
    empty for a partition that does not exist, as for :func:`production_status`)."""
    names.task_name(task_name)
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
