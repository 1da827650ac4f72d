"""BatchMeta: the columnar metadata of a batch of samples, handed between producers, consumers and stores.

:class:`BatchMeta` describes a batch of samples by reference (ids, partition, per-field schema,
production state, per-sample tags) without holding any tensor bytes. It is columnar plain data:
lists, dicts and one small ``numpy.int8`` array, so it pickles small and fast and can be sent
between rank processes freely. Its public semantics follow TransferQueue 0.1.11's class of the
same name; import it from :mod:`tq_redis.meta`.

The parts it is built from live next to it: :mod:`tq_redis.meta.schema_entries` (the per-field entries),
:mod:`tq_redis.meta.meta_dicts` (per-sample tag rows, ``extra_info`` unions),
:mod:`tq_redis.meta.batch_positions` (positions, permutations, chunks) and :mod:`tq_redis.meta.sample_views`
(``meta.samples[i]``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tensordict import TensorDictBase

from tq_redis.errors import BatchSizeMismatch, InvalidArgument, UnknownField
from tq_redis.meta.batch_positions import REPR_MAX_ITEMS, as_index_list, as_permutation, chunk_bounds, short_list
from tq_redis.meta.meta_dicts import Rows, merge_extra_info, rows_concat, rows_from, rows_merge, rows_take
from tq_redis.meta.sample_views import SampleViewList
from tq_redis.meta.schema_entries import (
    check_concat_schemas,
    concat_schema,
    copy_schema,
    extract_field_schema,
    normalized_schema,
    take_schema,
)

__all__ = ["READY", "BatchMeta"]

READY = 1
"""Value of ``BatchMeta.production_status`` for a sample whose fields are all stored."""


def _rows_property(slot: str, name: str, doc: str) -> property:
    """A per-sample dict column kept in ``slot``: ``None`` until read (then one empty dict per
    sample) or set (then checked to hold one dict per sample and copied one level deep)."""

    def get(self: BatchMeta) -> list[dict[str, Any]]:
        rows = getattr(self, slot)
        if rows is None:
            rows = [{} for _ in range(self.size)]
            setattr(self, slot, rows)
        return rows

    def set(self: BatchMeta, value: Sequence[Mapping[str, Any]]) -> None:
        setattr(self, slot, rows_from(value, self.size, name))

    return property(get, set, doc=doc)


class BatchMeta:
    """Metadata of a batch of samples: which samples, which fields, and whether they are ready.

    Attributes:
        global_indexes: sample ids, one per sample, in batch order.
        partition_ids: partition of each sample (a batch may span partitions after ``concat``).
        field_schema: field name -> schema entry (see :mod:`tq_redis.meta.schema_entries`).
        production_status: ``numpy.int8`` array, one entry per sample; 1 means ready.
        custom_meta: per-sample tags, one dict per sample (e.g. ``total_lengths``).
        extra_info: batch-level information that travels with the batch.

    Construction copies the containers it is given (one level deep), so later changes by the
    caller do not leak in. Mutating methods (``add_fields``, ``reorder``, ``update_custom_meta``,
    the ``*_extra_info`` setters) change this instance; all others return a new one.
    """

    __slots__ = (
        "global_indexes",
        "partition_ids",
        "field_schema",
        "production_status",
        "extra_info",
        # Per-sample dict lists, None until someone needs them: most batches carry no tags, and
        # a thousand empty dicts would dominate construction and pickling time.
        "_cm",
        "_bm",
    )

    def __init__(
        self,
        global_indexes: Sequence[int],
        partition_ids: Sequence[str],
        field_schema: Mapping[str, Mapping[str, Any]] | None = None,
        production_status: Any = None,
        extra_info: Mapping[str, Any] | None = None,
        custom_meta: Sequence[Mapping[str, Any]] | None = None,
        _custom_backend_meta: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        gidx = as_index_list(global_indexes, "global_indexes")
        pids = list(partition_ids)
        if len(pids) != len(gidx):
            raise BatchSizeMismatch(
                f"global_indexes has {len(gidx)} entries but partition_ids has {len(pids)}; "
                f"give one partition id per sample"
            )
        self._init_columns(
            gidx, pids, field_schema, production_status, extra_info, custom_meta, _custom_backend_meta
        )

    def _init_columns(
        self,
        gidx: list[int],
        pids: list[str],
        field_schema: Mapping[str, Mapping[str, Any]] | None,
        production_status: Any,
        extra_info: Mapping[str, Any] | None,
        custom_meta: Sequence[Mapping[str, Any]] | None,
        backend_meta: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        n = len(gidx)
        self.global_indexes: list[int] = gidx
        self.partition_ids: list[str] = pids

        self.field_schema: dict[str, dict[str, Any]] = normalized_schema(field_schema, n)

        if production_status is None:
            status = np.zeros(n, dtype=np.int8)
        elif isinstance(production_status, (int, np.integer)) and not isinstance(production_status, bool):
            status = np.full(n, production_status, dtype=np.int8)
        else:
            status = np.array(production_status, dtype=np.int8, copy=True).reshape(-1)
            if len(status) != n:
                raise BatchSizeMismatch(f"production_status has {len(status)} entries for a batch of {n}")
        self.production_status: np.ndarray = status

        self._cm: Rows = rows_from(custom_meta, n, "custom_meta")
        self._bm: Rows = rows_from(backend_meta, n, "_custom_backend_meta")
        if extra_info is not None and not isinstance(extra_info, Mapping):
            raise InvalidArgument(f"extra_info must be a dict, got {type(extra_info).__name__}")
        self.extra_info: dict[str, Any] = dict(extra_info) if extra_info else {}

    @classmethod
    def _adopt(
        cls,
        global_indexes: list[int],
        partition_ids: list[str],
        field_schema: dict[str, dict[str, Any]],
        production_status: np.ndarray,
        custom_meta: Rows,
        backend_meta: Rows,
        extra_info: dict[str, Any],
    ) -> BatchMeta:
        """Build from containers the caller already owns and has validated; nothing is copied."""
        obj = cls.__new__(cls)
        obj._set_slots(
            (global_indexes, partition_ids, field_schema, production_status, extra_info, custom_meta, backend_meta)
        )
        return obj

    def _set_slots(self, values: Sequence[Any]) -> None:
        """Set every slot, in ``__slots__`` order."""
        for slot, value in zip(self.__slots__, values):
            setattr(self, slot, value)

    @classmethod
    def from_columns(
        cls,
        global_indexes: Sequence[int],
        partition_id: str,
        field_schema: Mapping[str, Mapping[str, Any]] | None,
        production_status: Any = None,
        custom_meta: Sequence[Mapping[str, Any]] | None = None,
        extra_info: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """Build a batch whose samples all belong to ``partition_id``.

        ``production_status`` is an array-like with one entry per sample, a single int applied to
        every sample, or ``None`` (all not ready).
        """
        gidx = as_index_list(global_indexes, "global_indexes")
        obj = cls.__new__(cls)
        obj._init_columns(
            gidx, [partition_id] * len(gidx), field_schema, production_status, extra_info, custom_meta, None
        )
        return obj

    @classmethod
    def empty(cls, extra_info: Mapping[str, Any] | None = None) -> BatchMeta:
        """A batch with no samples and no fields (what ``get_meta`` returns when nothing is ready)."""
        return cls([], [], extra_info=extra_info)

    # -- per-sample dict columns -----------------------------------------------------------------

    custom_meta = _rows_property("_cm", "custom_meta", "Per-sample tags: one dict per sample, in batch order.")
    _custom_backend_meta = _rows_property(
        "_bm", "_custom_backend_meta", "Per-sample, per-field data written by storage backends (e.g. object handles)."
    )

    # -- pickling ----------------------------------------------------------------------------

    def __getstate__(self) -> tuple[Any, ...]:
        """The slot values, in ``__slots__`` order (the reference's layout); all-empty tag rows
        are sent as ``None``."""
        return tuple(
            None if slot in ("_cm", "_bm") and not any(getattr(self, slot) or ()) else getattr(self, slot)
            for slot in self.__slots__
        )

    def __setstate__(self, state: Sequence[Any] | Mapping[str, Any]) -> None:
        values = [state[slot] for slot in self.__slots__] if isinstance(state, Mapping) else list(state)
        if len(values) != len(self.__slots__):
            raise InvalidArgument(
                f"BatchMeta state has {len(values)} values, expected {len(self.__slots__)} ({self.__slots__}); "
                f"it was pickled by an incompatible version"
            )
        self._set_slots(values)
        # Zero-copy deserialisers (Ray/Arrow) hand back read-only arrays; add_fields writes to it.
        if not self.production_status.flags.writeable:
            self.production_status = self.production_status.copy()

    # -- read-only properties ----------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self.global_indexes)

    def __len__(self) -> int:
        return len(self.global_indexes)

    @property
    def field_names(self) -> list[str]:
        """Names of the fields in this batch, sorted."""
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        """True when the batch is non-empty and every sample's production status is ready."""
        return self.size > 0 and bool(np.all(self.production_status == READY))

    @property
    def samples(self) -> SampleViewList:
        """Per-sample read-only views: ``meta.samples[i].fields['x']['shape']``."""
        return SampleViewList(self)

    def _field(self, field_name: str) -> dict[str, Any]:
        try:
            return self.field_schema[field_name]
        except KeyError:
            raise UnknownField(
                f"field {field_name!r} is not in this batch; its fields are {self.field_names}"
            ) from None

    def get_dtypes(self, field_name: str) -> list[Any]:
        """The field's dtype, once per sample.

        Raises:
            UnknownField: the batch has no such field.
        """
        return [self._field(field_name).get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[Any]:
        """The field's per-sample shapes, one per sample (jagged fields differ per sample).

        Raises:
            UnknownField: the batch has no such field.
        """
        meta = self._field(field_name)
        shapes = meta.get("per_sample_shapes")
        if shapes is not None:
            return list(shapes)
        return [meta.get("shape")] * self.size

    # -- extra_info (batch level) --------------------------------------------------------------

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        """Value of ``extra_info[key]``, or ``default``."""
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        """Set ``extra_info[key] = value``."""
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        """A deep copy of ``extra_info``."""
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: Mapping[str, Any]) -> None:
        """Add or overwrite several ``extra_info`` entries."""
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        """Remove ``extra_info[key]`` and return its value (``None`` if it was absent)."""
        return self.extra_info.pop(key, None)

    def has_extra_info(self, key: str) -> bool:
        """Whether ``extra_info`` has ``key``."""
        return key in self.extra_info

    def clear_extra_info(self) -> None:
        """Remove every ``extra_info`` entry."""
        self.extra_info.clear()

    # -- custom_meta (per sample) ----------------------------------------------------------------

    def update_custom_meta(self, custom_meta: Sequence[Mapping[str, Any]] | None) -> None:
        """Merge one dict of tags into each sample's ``custom_meta`` (in batch order).

        ``None`` is a no-op. Tags are stored locally; ``client.set_custom_meta(meta)`` persists them.

        Raises:
            BatchSizeMismatch: not exactly one dict per sample.
            InvalidArgument: an entry is not a dict.
        """
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise BatchSizeMismatch(
                f"update_custom_meta got {len(custom_meta)} dicts for a batch of {self.size}; "
                f"give one per sample"
            )
        bad = [i for i, m in enumerate(custom_meta) if not isinstance(m, Mapping)]
        if bad:
            raise InvalidArgument(f"update_custom_meta: entries {bad[:REPR_MAX_ITEMS]} are not dicts")
        for row, tags in zip(self.custom_meta, custom_meta):
            row.update(tags)

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """A deep copy of every sample's tags, in batch order."""
        if self._cm is None:
            return [{} for _ in range(self.size)]
        return copy.deepcopy(self._cm)

    def clear_custom_meta(self) -> None:
        """Drop every sample's tags."""
        self._cm = None

    # -- fields --------------------------------------------------------------------------------

    def add_fields(self, tensor_dict: TensorDictBase, set_all_ready: bool = True) -> BatchMeta:
        """Record the fields of ``tensor_dict`` (schema from :func:`extract_field_schema`) in place.

        Existing fields of the same name are replaced. With ``set_all_ready`` every sample is
        marked ready. Returns ``self``.

        Raises:
            BatchSizeMismatch: ``tensor_dict`` does not have one row per sample of this batch.
        """
        schema = extract_field_schema(tensor_dict)
        rows = int(tensor_dict.batch_size[0])
        if rows != self.size:
            raise BatchSizeMismatch(
                f"add_fields: the TensorDict has {rows} rows but the batch has {self.size} samples"
            )
        self.field_schema.update(schema)
        if set_all_ready:
            self.production_status[:] = READY
        return self

    # -- selection -----------------------------------------------------------------------------

    def _take(self, positions: list[int] | range) -> BatchMeta:
        """Samples at ``positions`` (already validated), copying per-sample dicts one level."""
        sel: list[int] | slice
        if isinstance(positions, range) and positions.step > 0:
            sel = slice(positions.start, positions.stop, positions.step)
            gidx = self.global_indexes[sel]
            pids = self.partition_ids[sel]
            status = self.production_status[sel].copy()
        else:
            sel = list(positions)
            gidx = [self.global_indexes[i] for i in sel]
            pids = [self.partition_ids[i] for i in sel]
            status = self.production_status[np.asarray(sel, dtype=np.intp)]
        return BatchMeta._adopt(
            gidx,
            pids,
            take_schema(self.field_schema, sel),
            status,
            rows_take(self._cm, sel),
            rows_take(self._bm, sel),
            dict(self.extra_info),
        )

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        """A new batch holding the samples at these positions (0-based, in this order).

        Per-sample dicts are copied one level deep. Positions may repeat.

        Raises:
            InvalidArgument: a position is outside ``[0, size)``.
        """
        idx = as_index_list(sample_indices, "sample_indices")
        n = self.size
        if idx and (min(idx) < 0 or max(idx) >= n):
            bad = [i for i in idx if i < 0 or i >= n]
            raise InvalidArgument(
                f"select_samples: positions {bad[:REPR_MAX_ITEMS]} are outside [0, {n}); "
                f"positions are relative to this batch, not global indexes"
            )
        return self._take(idx)

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        """A new batch with the same samples but only these fields.

        A name that is not a field of this batch is left out, as the reference does (verl selects
        optional fields, e.g. a critic's ``values`` that a run without a critic never produces).
        """
        if isinstance(field_names, str):
            field_names = [field_names]
        wanted = [f for f in dict.fromkeys(field_names) if f in self.field_schema]
        keep = set(wanted)
        schema = {f: copy.deepcopy(self.field_schema[f]) for f in wanted}
        backend: Rows = None
        if self._bm is not None:
            # Backend entries keyed by a field follow the field; "_"-prefixed ones are per-sample.
            backend = [{k: v for k, v in row.items() if k.startswith("_") or k in keep} for row in self._bm]
        return BatchMeta._adopt(
            list(self.global_indexes),
            list(self.partition_ids),
            schema,
            self.production_status.copy(),
            rows_take(self._cm, slice(None)),
            backend,
            dict(self.extra_info),
        )

    def __getitem__(self, item: int | slice) -> BatchMeta:
        """``meta[i]`` (negative allowed) or ``meta[a:b:c]``: a new batch of those samples."""
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            n = self.size
            i = int(item) + n if item < 0 else int(item)
            if not 0 <= i < n:
                raise IndexError(f"BatchMeta index {item} out of range for a batch of {n}")
            return self._take(range(i, i + 1))
        if isinstance(item, slice):
            return self._take(range(*item.indices(self.size)))
        raise TypeError(f"BatchMeta indices must be int or slice, not {type(item).__name__}")

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """Split into ``chunks`` contiguous batches whose sizes differ by at most one.

        Earlier chunks get the extra samples. With more chunks than samples the trailing chunks
        are empty, so the result always has exactly ``chunks`` entries (one per rank, say).

        Raises:
            InvalidArgument: ``chunks`` is not a positive int.
        """
        return [self._take(range(a, b)) for a, b in chunk_bounds(self.size, chunks, "chunk")]

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One batch per partition, in order of first appearance; sample order is kept."""
        groups: dict[str, list[int]] = {}
        for pos, pid in enumerate(self.partition_ids):
            groups.setdefault(pid, []).append(pos)
        if len(groups) == 1:
            return [self._take(range(self.size))]
        return [self._take(positions) for positions in groups.values()]

    # -- combination ---------------------------------------------------------------------------

    def union(self, other: BatchMeta) -> BatchMeta:
        """Combine the fields of two batches over the same samples into a new batch.

        Both must list the same ``global_indexes`` and ``partition_ids`` in the same order. On a
        field-name clash ``other``'s schema wins; a sample is ready only if it is ready in both;
        ``custom_meta`` and ``extra_info`` are merged with ``other`` winning. If either side is
        empty, a copy of the other is returned.

        Raises:
            BatchSizeMismatch: the batches have different sizes.
            InvalidArgument: the samples or their partitions differ.
        """
        if not isinstance(other, BatchMeta):
            raise InvalidArgument(f"union expects a BatchMeta, got {type(other).__name__}")
        if other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if self.size != other.size:
            raise BatchSizeMismatch(
                f"union: batches have {self.size} and {other.size} samples; union combines fields of "
                f"the same samples (use concat to append samples)"
            )
        for what in ("global_indexes", "partition_ids"):
            mine, theirs = getattr(self, what), getattr(other, what)
            if mine != theirs:
                at = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
                raise InvalidArgument(
                    f"BatchMeta.union: {what} do not match: they differ at position {at} "
                    f"({mine[at]!r} vs {theirs[at]!r}); both batches must list the same samples in the same order"
                )
        schema = copy.deepcopy(self.field_schema)
        schema.update(copy.deepcopy(other.field_schema))
        return BatchMeta._adopt(
            list(self.global_indexes),
            list(self.partition_ids),
            schema,
            np.bitwise_and(self.production_status, other.production_status),
            rows_merge(self._cm, other._cm, self.size),
            rows_merge(self._bm, other._bm, self.size),
            {**self.extra_info, **other.extra_info},
        )

    @classmethod
    def concat(cls, data: Sequence[BatchMeta], validate: bool = True) -> BatchMeta:
        """Append several batches into one, keeping sample order and per-sample tags.

        Empty batches are skipped; no batches gives :meth:`empty`. A field that is jagged in any
        batch, or whose dense shape differs between batches, becomes jagged in the result (with
        ``per_sample_shapes``). ``extra_info`` is the union of the batches' entries.

        Raises:
            InvalidArgument: with ``validate``, the batches' field names or a field's dtype differ;
                always, when an ``extra_info`` key has different values in two batches.
        """
        for pos, b in enumerate(data):
            if not isinstance(b, BatchMeta):
                raise InvalidArgument(f"concat: item #{pos} is a {type(b).__name__}, not a BatchMeta")
        parts = [b for b in data if b.size > 0]
        if not parts:
            return cls.empty()
        if validate:
            check_concat_schemas([b.field_schema for b in parts])
        gidx: list[int] = []
        pids: list[str] = []
        for b in parts:
            gidx.extend(b.global_indexes)
            pids.extend(b.partition_ids)
        return cls._adopt(
            gidx,
            pids,
            concat_schema([(b.field_schema, b.size) for b in parts]),
            np.concatenate([b.production_status for b in parts]).astype(np.int8, copy=False),
            rows_concat([(b._cm, b.size) for b in parts]),
            rows_concat([(b._bm, b.size) for b in parts]),
            merge_extra_info((b.extra_info for b in parts), "BatchMeta.concat"),
        )

    def reorder(self, indices: Sequence[int]) -> None:
        """Permute the samples in place: position ``k`` receives the sample at ``indices[k]``.

        Raises:
            InvalidArgument: ``indices`` is not a permutation of ``range(size)``.
        """
        idx = as_permutation(indices, self.size, "indices", "BatchMeta.reorder")
        self.global_indexes = [self.global_indexes[i] for i in idx]
        self.partition_ids = [self.partition_ids[i] for i in idx]
        self.production_status = self.production_status[np.asarray(idx, dtype=np.intp)]
        if self._cm is not None:
            self._cm = [self._cm[i] for i in idx]
        if self._bm is not None:
            self._bm = [self._bm[i] for i in idx]
        for meta in self.field_schema.values():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None:
                meta["per_sample_shapes"] = [shapes[i] for i in idx]

    def copy(self) -> BatchMeta:
        """A deep copy: nothing is shared with this batch."""
        return BatchMeta._adopt(
            list(self.global_indexes),
            list(self.partition_ids),
            copy_schema(self.field_schema),
            self.production_status.copy(),
            copy.deepcopy(self._cm),
            copy.deepcopy(self._bm),
            copy.deepcopy(self.extra_info),
        )

    # -- display -------------------------------------------------------------------------------

    def __repr__(self) -> str:
        ready = int(np.count_nonzero(self.production_status == READY))
        parts = list(dict.fromkeys(self.partition_ids))
        return (
            f"BatchMeta(size={self.size}, ready={ready}/{self.size}, partitions={short_list(parts)}, "
            f"fields={self.field_names}, global_indexes={short_list(self.global_indexes)}, "
            f"extra_info_keys={sorted(self.extra_info)})"
        )

    __str__ = __repr__
