"""What every client operation shares: the :data:`Op` type, the :class:`Context` an operation runs
with, the namespace's storage manager and recorded settings, and small helpers over a batch.

Operations (see :mod:`tq_redis.ops`) are generators of effects (:mod:`tq_redis.ops.effects`); they get
everything besides Redis through their context, never by importing the runtime.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tq_redis import names, samplers
from tq_redis.errors import InvalidArgument
from tq_redis.meta import BatchMeta
from tq_redis.meta.keys import PartitionKeys, config_key
from tq_redis.meta.schemas import to_batchmeta_schema
from tq_redis.ops import script_budget
from tq_redis.ops.effects import Cmd
from tq_redis.storage.base import StoreContext
from tq_redis.storage.manager import DEFAULT_INLINE_MAX_BYTES, KVStorageManager

T = TypeVar("T")

Op = Generator[Any, Any, T]
"""An operation: a generator of effects whose return value is its result (``Op[BatchMeta]``: a
``BatchMeta``). A bare ``Op`` says nothing of the result."""


@dataclass
class Context:
    """What operations need besides Redis: the namespace, client options and the data plane."""

    namespace: str
    redis_url: str
    allow_pickle: bool = False
    nested_output: bool = True
    strict_schema: bool = False
    # the default sampler of get_meta (a built-in's name, a class or an instance), set by the
    # client it was built with (init's client: the config's); None: the one the namespace's config
    # records. Resolved once into ``resolved_sampler``.
    default_sampler: Any = None
    resolved_sampler: samplers.BaseSampler | None = None
    storage: KVStorageManager | None = None
    # the client's namespace identity (tq_redis.server.identity.Identity), whose check of every new
    # connection guards the redis store's connections too; None: no check
    identity: Any = None
    # the namespace's staleness bound (max_lag, batch_size) from init's config, once read (None: none)
    namespace_bound: tuple[int, int] | None = None
    namespace_bound_read: bool = False
    # partition -> whether its last claim said it keeps values inline (get_data reads those with
    # read_inline first; a partition said not to goes to the store first)
    inline_partitions: dict[str, bool] = field(default_factory=dict)
    # (partition, field) pairs an empty claim already checked for a typo (tq_redis.ops.typos)
    checked_claims: set[tuple[str, str]] = field(default_factory=set)
    _keys: dict[str, PartitionKeys] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Every client, channel and dock builds one: a bad namespace never reaches a key.
        names.namespace(self.namespace)

    def keys(self, partition_id: str) -> PartitionKeys:
        """Keys of a user's partition (its id checked once, by :func:`tq_redis.names.partition_id`)."""
        try:
            pk = self._keys.get(partition_id)
        except TypeError:  # unhashable: not a name at all
            pk = None
        if pk is None:
            pk = PartitionKeys(self.namespace, partition_id)
            self._keys[partition_id] = pk
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
        extra = {} if ctx.identity is None else {"on_connect": ctx.identity.check_connection}
        ctx.storage = KVStorageManager(
            spec["backend"], spec.get("options") or {}, StoreContext(ctx.redis_url, ctx.namespace, extra),
            inline_max_bytes=int(spec.get("inline_max_bytes", DEFAULT_INLINE_MAX_BYTES)),
            durable=spec.get("durable"),
        )
    return ctx.storage


def write_config(ctx: Context, settings: dict[str, Any]) -> Op:
    """Record namespace settings (store, sampler) so attaching processes use the same ones."""
    mapping = {k: json.dumps(v) for k, v in settings.items()}
    yield Cmd(("HSET", config_key(ctx.namespace), *[x for kv in mapping.items() for x in kv]))


# ------------------------------------------------------------------ batch helpers


def check_fields(data_fields: Any) -> list[str]:
    """``data_fields`` as a list of checked field names (one name may be given as a string)."""
    if isinstance(data_fields, str):
        data_fields = [data_fields]
    if not isinstance(data_fields, list | tuple):
        raise InvalidArgument(f"data_fields must be a list of field names, got {data_fields!r}")
    script_budget.check_fields(len(data_fields), "data_fields")
    return [names.field_name(f) for f in data_fields]


def batchmeta_schema(schemas: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``BatchMeta.field_schema`` entries from the schema JSON Redis stores per field (each a
    fresh dict: the caller's batch owns it)."""
    return {name: dict(_schema_entry(s)) for name, s in schemas.items()}


@functools.lru_cache(maxsize=4096)
def _schema_entry(schema_json: str) -> dict[str, Any]:
    # A field's schema JSON repeats in every claim of it: decode each distinct text once. The
    # entry's values (dtype, torch.Size, flags) are immutable, so a one-level copy is enough.
    return to_batchmeta_schema(json.loads(schema_json))


def group_by_partition(metadata: BatchMeta) -> dict[str, list[int]]:
    """Partition -> the positions of ``metadata``'s samples in it (in batch order)."""
    groups: dict[str, list[int]] = {}
    for pos, pid in enumerate(metadata.partition_ids):
        groups.setdefault(pid, []).append(pos)
    return groups
