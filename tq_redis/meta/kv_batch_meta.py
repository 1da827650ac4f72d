"""KVBatchMeta: the metadata of a batch addressed by user keys (the key/value API).

The KV counterpart of :class:`tq_redis.meta.batch_meta.BatchMeta`: samples are named by unique user
keys in one partition, each with a dict of tags. Its public semantics follow TransferQueue
0.1.11's class of the same name; import it from :mod:`tq_redis.meta`. Shares the position
helpers (:mod:`tq_redis.meta.batch_positions`) and the dict rules (:mod:`tq_redis.meta.meta_dicts`) with
``BatchMeta``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tq_redis.errors import BatchSizeMismatch, InvalidArgument, KeyNotInBatch
from tq_redis.meta.batch_positions import as_permutation, chunk_bounds, duplicates, short_list
from tq_redis.meta.meta_dicts import copy_row, merge_extra_info

__all__ = ["KVBatchMeta"]


@dataclasses.dataclass
class KVBatchMeta:
    """Metadata of a batch addressed by user keys (the KV API).

    Attributes:
        keys: the samples' keys, unique, in batch order.
        tags: one dict of tags per key.
        partition_id: the partition the keys live in.
        fields: field names of the batch, if known.
        extra_info: batch-level information.

    Raises (on construction):
        BatchSizeMismatch: ``tags`` does not have one entry per key.
        InvalidArgument: duplicate keys or fields, or a tag entry that is not a dict.
    """

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.keys, str):
            raise InvalidArgument("keys must be a list of strings, got a single string; wrap it in a list")
        self.keys = list(self.keys)
        tags = list(self.tags) if self.tags is not None else []
        if len(tags) != len(self.keys):
            raise BatchSizeMismatch(
                f"KVBatchMeta: keys and tags must have same length, but got {len(self.keys)} and {len(tags)}; "
                f"give one tag dict per key"
            )
        if len(set(self.keys)) != len(self.keys):
            raise InvalidArgument(
                f"KVBatchMeta: Got duplicated keys {duplicates(self.keys)}; keys must be unique"
            )
        if any(not isinstance(t, Mapping) for t in tags):
            raise InvalidArgument("KVBatchMeta tags must be dicts, one per key")
        # deep copies, as the reference makes: mutating a tag's list later leaks into no other batch
        self.tags = [copy_row(t) for t in tags]
        if self.fields is not None:
            if isinstance(self.fields, str):
                raise InvalidArgument(
                    "fields must be a list of names, got a single string; wrap it in a list"
                )
            self.fields = list(self.fields)
            if len(set(self.fields)) != len(self.fields):
                raise InvalidArgument(
                    f"KVBatchMeta: Got duplicated fields {duplicates(self.fields)}; fields must be unique"
                )
        self.extra_info = copy.deepcopy(dict(self.extra_info)) if self.extra_info else {}

    @property
    def size(self) -> int:
        """Number of keys."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return (
            f"KVBatchMeta(size={self.size}, partition_id={self.partition_id!r}, fields={self.fields}, "
            f"keys={short_list(self.keys)}, extra_info_keys={sorted(self.extra_info)})"
        )

    def _with(self, keys: list[str], tags: list[dict[str, Any]]) -> KVBatchMeta:
        return dataclasses.replace(self, keys=keys, tags=tags)

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        """A new batch with only these keys, in the order given.

        Raises:
            InvalidArgument: ``keys_to_select`` has duplicates.
            KeyNotInBatch: a key is not in this batch (a ``SampleNotFound``, also a ``RuntimeError``
                as the reference raises).
        """
        if isinstance(keys_to_select, str):
            keys_to_select = [keys_to_select]
        wanted = list(keys_to_select)
        if len(set(wanted)) != len(wanted):
            raise InvalidArgument(f"select_keys: Contain duplicate keys {duplicates(wanted)}; list each key once")
        pos = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in wanted if k not in pos]
        if missing:
            raise KeyNotInBatch(
                f"select_keys: keys {short_list(missing)} not found in current batch "
                f"(partition {self.partition_id!r}, {self.size} keys); select among this batch's keys"
            )
        return self._with(wanted, [self.tags[pos[k]] for k in wanted])

    def reorder(self, indexes: Sequence[int]) -> None:
        """Permute the keys in place: position ``k`` receives the key at ``indexes[k]``.

        Raises:
            InvalidArgument: ``indexes`` is not a permutation of ``range(size)``.
        """
        idx = as_permutation(indexes, self.size, "indexes", "KVBatchMeta.reorder")
        self.keys = [self.keys[i] for i in idx]
        self.tags = [self.tags[i] for i in idx]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """Split into ``chunks`` contiguous batches whose sizes differ by at most one.

        With more chunks than keys the trailing chunks are empty.

        Raises:
            InvalidArgument: ``chunks`` is not a positive int.
        """
        return [
            self._with(self.keys[a:b], self.tags[a:b])
            for a, b in chunk_bounds(self.size, chunks, "KVBatchMeta.chunk")
        ]

    @classmethod
    def concat(cls, data: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """Append several batches of the same partition and fields into one.

        Empty batches are skipped; no batches gives an empty ``KVBatchMeta``. Batches whose
        ``fields`` is ``None`` (unknown) match any fields.

        Raises:
            InvalidArgument: partitions differ, field sets differ, a key repeats, or an
                ``extra_info`` key has different values in two batches.
        """
        parts = [b for b in data if b is not None and b.size > 0]
        if not parts:
            return cls()
        partition = parts[0].partition_id
        fields: list[str] | None = None
        keys: list[str] = []
        tags: list[dict[str, Any]] = []
        for pos, b in enumerate(parts):
            if not isinstance(b, KVBatchMeta):
                raise InvalidArgument(f"concat: item #{pos} is a {type(b).__name__}, not a KVBatchMeta")
            if b.partition_id != partition:
                raise InvalidArgument(
                    f"KVBatchMeta.concat: Partition do not match for concatenation: batch #{pos} is in partition "
                    f"{b.partition_id!r}, batch #0 in {partition!r}; only batches of one partition can be concatenated"
                )
            if b.fields is not None:
                if fields is None:
                    fields = b.fields
                elif set(b.fields) != set(fields):
                    raise InvalidArgument(
                        f"KVBatchMeta.concat: Field names do not match for concatenation: batch #{pos} has fields "
                        f"{sorted(b.fields)}, expected {sorted(fields)}"
                    )
            keys.extend(b.keys)
            tags.extend(b.tags)
        return cls(
            keys=keys,
            tags=tags,
            partition_id=partition,
            fields=fields,
            extra_info=merge_extra_info((b.extra_info for b in parts), "KVBatchMeta.concat"),
        )
