"""Batch metadata handed between producers, consumers and the storage layer.

:class:`BatchMeta` describes a batch of samples by reference (ids, partition, per-field schema,
production state, per-sample tags) without holding any tensor bytes. It is columnar plain data:
lists, dicts and one small ``numpy.int8`` array, so it pickles small and fast and can be sent
between rank processes freely.

:class:`KVBatchMeta` is the same idea for the key/value API, where samples are named by user keys.

Both follow the public semantics of TransferQueue 0.1.11's classes of the same names, so code
written against the reference keeps working after switching the import. Differences on purpose:
errors are typed (``tq_redis.errors``) and say what to fix; nothing is logged-and-ignored.

Field schema entries (``BatchMeta.field_schema[name]``) hold:

``dtype``          ``torch.dtype`` of the field, ``numpy.dtype`` for numpy arrays that TensorDict
                   keeps as non-tensor data, ``None`` for other Python objects
``shape``          per-sample shape as a tuple (batch dimension excluded); ``None`` when samples
                   differ in shape, or for Python objects
``is_nested``      ``True`` for nested-tensor fields (samples may differ in shape)
``is_non_tensor``  ``True`` for values stored next to tensors (strings, dicts, numpy arrays ...)
``per_sample_shapes``  only for nested fields: one shape tuple per sample, in batch order
``kind``           one of the ``KIND_*`` constants (defined in ``tq_redis.schemas``, importable here)
"""

from __future__ import annotations

import copy as _copy
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from tq_redis.errors import (
    BatchSizeMismatch,
    InvalidArgument,
    KeyNotInBatch,
    UnknownField,
)
from tq_redis.schemas import (
    KIND_JAGGED,
    KIND_NDARRAY,
    KIND_OBJECT,
    KIND_STRIDED,
    KIND_TENSOR,
    batchmeta_schema_of,
)

__all__ = [
    "KIND_JAGGED",
    "KIND_NDARRAY",
    "KIND_OBJECT",
    "KIND_STRIDED",
    "KIND_TENSOR",
    "BatchMeta",
    "KVBatchMeta",
    "KeyNotInBatch",
    "extract_field_schema",
    "field_kind",
]

READY = 1
"""Value of ``BatchMeta.production_status`` for a sample whose fields are all stored."""

_REPR_MAX_ITEMS = 6


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def field_kind(meta: Mapping[str, Any]) -> str:
    """Return the ``kind`` of a field schema entry, deriving it from the flags when absent."""
    kind = meta.get("kind")
    if kind is not None:
        return kind
    if meta.get("is_non_tensor"):
        return KIND_NDARRAY if isinstance(meta.get("dtype"), np.dtype) else KIND_OBJECT
    if meta.get("is_nested"):
        return KIND_JAGGED
    return KIND_TENSOR


def _normalized_field_meta(name: str, meta: Any) -> dict[str, Any]:
    if not isinstance(meta, Mapping):
        raise InvalidArgument(
            f"field_schema[{name!r}] must be a dict with keys dtype, shape, is_nested, is_non_tensor; "
            f"got {type(meta).__name__}"
        )
    out = dict(meta)
    if "kind" not in out:
        out["kind"] = field_kind(out)
    return out


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that does not trip over tensors / arrays (whose ``==`` is elementwise)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # an exotic __eq__ (e.g. returns an array) means "not provably equal"
        return False


def _merge_extra_info(infos: Iterable[Mapping[str, Any] | None], who: str) -> dict[str, Any]:
    """Union of several extra_info dicts; a key present with different values is an error."""
    merged: dict[str, Any] = {}
    for pos, info in enumerate(infos):
        if not info:
            continue
        for key, value in info.items():
            if key in merged and not _values_equal(merged[key], value):
                raise InvalidArgument(
                    f"{who}: extra_info key {key!r} has conflicting values across chunks "
                    f"(extra_info[{key!r}] is {merged[key]!r} in an earlier batch, {value!r} in batch #{pos}); "
                    f"make the values equal or remove the key with remove_extra_info() before concatenating"
                )
            merged.setdefault(key, value)
    return merged


def _as_index_list(indexes: Any, what: str) -> list[int]:
    if isinstance(indexes, np.ndarray):
        if indexes.ndim != 1:
            raise InvalidArgument(f"{what} must be one-dimensional, got shape {indexes.shape}")
        return indexes.tolist()
    if isinstance(indexes, torch.Tensor):
        return indexes.reshape(-1).tolist()
    if isinstance(indexes, (str, bytes)) or not isinstance(indexes, Iterable):
        raise InvalidArgument(f"{what} must be a sequence of ints, got {type(indexes).__name__}")
    return list(indexes)


def _check_permutation(indices: list[int], size: int, who: str) -> None:
    if len(indices) != size:
        raise InvalidArgument(
            f"{who}: indexes length {len(indices)} does not match the batch size {size}; "
            f"pass a permutation of range({size})"
        )
    seen = set(indices)
    if len(seen) != size:
        raise InvalidArgument(
            f"{who}: Contain duplicate indexes {_duplicates(indices)}; pass a permutation of range({size})"
        )
    bad = [i for i in indices if not isinstance(i, (int, np.integer)) or i < 0 or i >= size]
    if bad:
        raise InvalidArgument(
            f"{who}: indices {bad[:_REPR_MAX_ITEMS]} are outside [0, {size}); "
            f"pass a permutation of range({size})"
        )


def _chunk_bounds(size: int, chunks: Any, who: str) -> list[tuple[int, int]]:
    """Split ``range(size)`` into ``chunks`` contiguous runs whose lengths differ by at most one."""
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise InvalidArgument(f"{who}: chunks must be a positive int, got {chunks!r}")
    base, extra = divmod(size, int(chunks))
    bounds = []
    start = 0
    for i in range(int(chunks)):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _short_list(values: Sequence[Any]) -> str:
    if len(values) <= _REPR_MAX_ITEMS:
        return repr(list(values))
    head = ", ".join(repr(v) for v in values[: _REPR_MAX_ITEMS - 2])
    return f"[{head}, ..., {values[-1]!r}]"


def extract_field_schema(data: TensorDictBase) -> dict[str, dict[str, Any]]:
    """Describe each field of a TensorDict as a field-schema entry (see the module docstring).

    The first batch dimension of ``data`` is the sample dimension. Dense tensors record their
    per-sample shape (a 1-D tensor has per-sample shape ``()``); nested tensors record
    ``is_nested=True`` and ``per_sample_shapes`` (``shape`` only if every sample has the same
    one); non-tensor values record ``is_non_tensor=True``. Each entry is
    :func:`tq_redis.schemas.batchmeta_schema_of`'s.

    Raises:
        InvalidArgument: ``data`` has no batch dimension.
        BatchSizeMismatch: a nested tensor does not have one sample per row.
        UnsupportedValue: a field holds a sub-TensorDict (flatten it with ``data.flatten_keys()``).
    """
    if not isinstance(data, TensorDictBase):
        raise InvalidArgument(f"expected a TensorDict, got {type(data).__name__}")
    if len(data.batch_size) == 0:
        raise InvalidArgument("the TensorDict has no batch dimension; build it with batch_size=[num_samples]")
    n = int(data.batch_size[0])
    return {name: batchmeta_schema_of(name, value, n) for name, value in data.items()}


# ---------------------------------------------------------------------------------------------
# per-sample views
# ---------------------------------------------------------------------------------------------


class _SampleView:
    """Read-only view of one row of a :class:`BatchMeta`; computed on access, never cached."""

    __slots__ = ("_batch", "_idx")

    def __init__(self, batch: BatchMeta, idx: int) -> None:
        self._batch = batch
        self._idx = idx

    @property
    def global_index(self) -> int:
        """The sample's id in its partition."""
        return self._batch.global_indexes[self._idx]

    @property
    def partition_id(self) -> str:
        """The partition the sample belongs to."""
        return self._batch.partition_ids[self._idx]

    @property
    def production_status(self) -> int:
        """1 when all the batch's fields are stored for this sample, else 0."""
        return int(self._batch.production_status[self._idx])

    @property
    def custom_meta(self) -> Mapping[str, Any]:
        """The sample's tags (read-only; change them with ``BatchMeta.update_custom_meta``)."""
        return MappingProxyType(self._batch.custom_meta[self._idx])

    @property
    def fields(self) -> Mapping[str, Mapping[str, Any]]:
        """Field schema as seen by this sample: jagged fields show this sample's own ``shape``."""
        out: dict[str, Mapping[str, Any]] = {}
        for name, meta in self._batch.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is None:
                out[name] = MappingProxyType(dict(meta))
            else:
                row = {k: v for k, v in meta.items() if k != "per_sample_shapes"}
                row["shape"] = shapes[self._idx]
                out[name] = MappingProxyType(row)
        return MappingProxyType(out)

    def __repr__(self) -> str:
        return (
            f"Sample(global_index={self.global_index}, partition_id={self.partition_id!r}, "
            f"production_status={self.production_status}, fields={self._batch.field_names})"
        )


class _SampleViewList(Sequence):
    """``BatchMeta.samples``: indexable, iterable, sized; views are made on demand."""

    __slots__ = ("_batch",)

    def __init__(self, batch: BatchMeta) -> None:
        self._batch = batch

    def __len__(self) -> int:
        return self._batch.size

    def __getitem__(self, idx: int) -> _SampleView:  # type: ignore[override]
        n = self._batch.size
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"samples[...] takes an int, got {type(idx).__name__}")
        i = int(idx) + n if idx < 0 else int(idx)
        if not 0 <= i < n:
            raise IndexError(f"sample {idx} out of range for a batch of {n}")
        return _SampleView(self._batch, i)

    def __iter__(self) -> Iterator[_SampleView]:
        return (_SampleView(self._batch, i) for i in range(self._batch.size))


# ---------------------------------------------------------------------------------------------
# BatchMeta
# ---------------------------------------------------------------------------------------------


_Rows = list[dict[str, Any]] | None
"""Per-sample dicts; ``None`` stands for "every sample's dict is empty" and is materialised lazily."""


def _rows_from(values: Sequence[Mapping[str, Any]] | None, n: int, what: str) -> _Rows:
    # An empty list means "none given", as in the reference system.
    if not values:
        return None
    if len(values) != n:
        raise BatchSizeMismatch(
            f"{what} has {len(values)} entries for a batch of {n}; give one dict per sample"
        )
    try:
        return [dict(m) for m in values]
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what} must be a list of dicts, one per sample") from exc


def _rows_take(rows: _Rows, positions: list[int] | slice) -> _Rows:
    if rows is None:
        return None
    if isinstance(positions, slice):
        return [dict(r) for r in rows[positions]]
    return [dict(rows[i]) for i in positions]


def _rows_full(rows: _Rows, n: int) -> list[dict[str, Any]]:
    return rows if rows is not None else [{} for _ in range(n)]


class BatchMeta:
    """Metadata of a batch of samples: which samples, which fields, and whether they are ready.

    Attributes:
        global_indexes: sample ids, one per sample, in batch order.
        partition_ids: partition of each sample (a batch may span partitions after ``concat``).
        field_schema: field name -> schema entry (see the module docstring).
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
        gidx = _as_index_list(global_indexes, "global_indexes")
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

        schema: dict[str, dict[str, Any]] = {}
        for name, meta in (field_schema or {}).items():
            entry = _normalized_field_meta(name, meta)
            shapes = entry.get("per_sample_shapes")
            if shapes is not None:
                if len(shapes) != n:
                    raise BatchSizeMismatch(
                        f"field_schema[{name!r}]['per_sample_shapes'] has {len(shapes)} entries "
                        f"for a batch of {n}"
                    )
                entry["per_sample_shapes"] = list(shapes)
            schema[name] = entry
        self.field_schema: dict[str, dict[str, Any]] = schema

        if production_status is None:
            status = np.zeros(n, dtype=np.int8)
        elif isinstance(production_status, (int, np.integer)) and not isinstance(production_status, bool):
            status = np.full(n, production_status, dtype=np.int8)
        else:
            status = np.array(production_status, dtype=np.int8, copy=True).reshape(-1)
            if len(status) != n:
                raise BatchSizeMismatch(f"production_status has {len(status)} entries for a batch of {n}")
        self.production_status: np.ndarray = status

        self._cm: _Rows = _rows_from(custom_meta, n, "custom_meta")
        self._bm: _Rows = _rows_from(backend_meta, n, "_custom_backend_meta")
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
        custom_meta: _Rows,
        backend_meta: _Rows,
        extra_info: dict[str, Any],
    ) -> BatchMeta:
        """Build from containers the caller already owns and has validated; nothing is copied."""
        obj = cls.__new__(cls)
        obj.global_indexes = global_indexes
        obj.partition_ids = partition_ids
        obj.field_schema = field_schema
        obj.production_status = production_status
        obj._cm = custom_meta
        obj._bm = backend_meta
        obj.extra_info = extra_info
        return obj

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
        gidx = _as_index_list(global_indexes, "global_indexes")
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

    @property
    def custom_meta(self) -> list[dict[str, Any]]:
        """Per-sample tags: one dict per sample, in batch order."""
        if self._cm is None:
            self._cm = [{} for _ in range(self.size)]
        return self._cm

    @custom_meta.setter
    def custom_meta(self, value: Sequence[Mapping[str, Any]]) -> None:
        rows = _rows_from(value, self.size, "custom_meta")
        self._cm = rows

    @property
    def _custom_backend_meta(self) -> list[dict[str, Any]]:
        """Per-sample, per-field data written by storage backends (e.g. object handles)."""
        if self._bm is None:
            self._bm = [{} for _ in range(self.size)]
        return self._bm

    @_custom_backend_meta.setter
    def _custom_backend_meta(self, value: Sequence[Mapping[str, Any]]) -> None:
        self._bm = _rows_from(value, self.size, "_custom_backend_meta")

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
        for slot, value in zip(self.__slots__, values):
            setattr(self, slot, value)
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
    def samples(self) -> _SampleViewList:
        """Per-sample read-only views: ``meta.samples[i].fields['x']['shape']``."""
        return _SampleViewList(self)

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
        return _copy.deepcopy(self.extra_info)

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
            raise InvalidArgument(f"update_custom_meta: entries {bad[:_REPR_MAX_ITEMS]} are not dicts")
        for row, tags in zip(self.custom_meta, custom_meta):
            row.update(tags)

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """A deep copy of every sample's tags, in batch order."""
        if self._cm is None:
            return [{} for _ in range(self.size)]
        return _copy.deepcopy(self._cm)

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
        schema: dict[str, dict[str, Any]] = {}
        for name, meta in self.field_schema.items():
            entry = dict(meta)
            shapes = meta.get("per_sample_shapes")
            if shapes is not None:
                entry["per_sample_shapes"] = (
                    shapes[sel] if isinstance(sel, slice) else [shapes[i] for i in sel]
                )
            schema[name] = entry
        return BatchMeta._adopt(
            gidx,
            pids,
            schema,
            status,
            _rows_take(self._cm, sel),
            _rows_take(self._bm, sel),
            dict(self.extra_info),
        )

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        """A new batch holding the samples at these positions (0-based, in this order).

        Per-sample dicts are copied one level deep. Positions may repeat.

        Raises:
            InvalidArgument: a position is outside ``[0, size)``.
        """
        idx = _as_index_list(sample_indices, "sample_indices")
        n = self.size
        if idx and (min(idx) < 0 or max(idx) >= n):
            bad = [i for i in idx if i < 0 or i >= n]
            raise InvalidArgument(
                f"select_samples: positions {bad[:_REPR_MAX_ITEMS]} are outside [0, {n}); "
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
        schema = {f: _copy.deepcopy(self.field_schema[f]) for f in wanted}
        backend: _Rows = None
        if self._bm is not None:
            # Backend entries keyed by a field follow the field; "_"-prefixed ones are per-sample.
            backend = [{k: v for k, v in row.items() if k.startswith("_") or k in keep} for row in self._bm]
        return BatchMeta._adopt(
            list(self.global_indexes),
            list(self.partition_ids),
            schema,
            self.production_status.copy(),
            _rows_take(self._cm, slice(None)),
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
        return [self._take(range(a, b)) for a, b in _chunk_bounds(self.size, chunks, "chunk")]

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
        schema = _copy.deepcopy(self.field_schema)
        schema.update(_copy.deepcopy(other.field_schema))
        return BatchMeta._adopt(
            list(self.global_indexes),
            list(self.partition_ids),
            schema,
            np.bitwise_and(self.production_status, other.production_status),
            _rows_merge(self._cm, other._cm, self.size),
            _rows_merge(self._bm, other._bm, self.size),
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
        first = parts[0]
        if validate:
            names = first.field_names
            for pos, b in enumerate(parts[1:], start=1):
                if b.field_names != names:
                    extra = sorted(set(b.field_names) - set(names))
                    missing = sorted(set(names) - set(b.field_names))
                    raise InvalidArgument(
                        f"concat: batch #{pos} has different fields than batch #0 (extra {extra}, "
                        f"missing {missing}); select_fields() a common set first"
                    )
            for name in names:
                dtype = first.field_schema[name].get("dtype")
                for pos, b in enumerate(parts[1:], start=1):
                    other_dtype = b.field_schema[name].get("dtype")
                    if other_dtype != dtype:
                        raise InvalidArgument(
                            f"concat: field {name!r} is {dtype} in batch #0 but {other_dtype} in "
                            f"batch #{pos}; cast the data to one dtype"
                        )

        schema = {name: _merged_field_meta(name, parts) for name in first.field_schema}
        gidx: list[int] = []
        pids: list[str] = []
        for b in parts:
            gidx.extend(b.global_indexes)
            pids.extend(b.partition_ids)
        return cls._adopt(
            gidx,
            pids,
            schema,
            np.concatenate([b.production_status for b in parts]).astype(np.int8, copy=False),
            _rows_concat([(b._cm, b.size) for b in parts]),
            _rows_concat([(b._bm, b.size) for b in parts]),
            _merge_extra_info((b.extra_info for b in parts), "BatchMeta.concat"),
        )

    def reorder(self, indices: Sequence[int]) -> None:
        """Permute the samples in place: position ``k`` receives the sample at ``indices[k]``.

        Raises:
            InvalidArgument: ``indices`` is not a permutation of ``range(size)``.
        """
        idx = _as_index_list(indices, "indices")
        _check_permutation(idx, self.size, "BatchMeta.reorder")
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
            _copy.deepcopy(self.field_schema),
            self.production_status.copy(),
            _copy.deepcopy(self._cm),
            _copy.deepcopy(self._bm),
            _copy.deepcopy(self.extra_info),
        )

    # -- display -------------------------------------------------------------------------------

    def __repr__(self) -> str:
        ready = int(np.count_nonzero(self.production_status == READY))
        parts = list(dict.fromkeys(self.partition_ids))
        return (
            f"BatchMeta(size={self.size}, ready={ready}/{self.size}, partitions={_short_list(parts)}, "
            f"fields={self.field_names}, global_indexes={_short_list(self.global_indexes)}, "
            f"extra_info_keys={sorted(self.extra_info)})"
        )

    __str__ = __repr__


def _rows_merge(a: _Rows, b: _Rows, n: int) -> _Rows:
    if a is None and b is None:
        return None
    return [{**x, **y} for x, y in zip(_rows_full(a, n), _rows_full(b, n))]


def _rows_concat(parts: list[tuple[_Rows, int]]) -> _Rows:
    if all(rows is None for rows, _ in parts):
        return None
    out: list[dict[str, Any]] = []
    for rows, n in parts:
        out.extend([{} for _ in range(n)] if rows is None else (dict(r) for r in rows))
    return out


def _merged_field_meta(name: str, parts: Sequence[BatchMeta]) -> dict[str, Any]:
    """Schema entry for field ``name`` over the concatenation of ``parts``."""
    metas = [b.field_schema.get(name) for b in parts]
    base = dict(next(m for m in metas if m is not None))
    present = [m for m in metas if m is not None]
    tensor = not base.get("is_non_tensor", False)
    dense_shapes = {m.get("shape") for m in present if not m.get("is_nested")}
    jagged = tensor and (
        any(m.get("is_nested") for m in present)
        or any(m.get("per_sample_shapes") is not None for m in present)
        or len(dense_shapes) > 1
    )
    if not jagged:
        base.pop("per_sample_shapes", None)
        return base
    shapes: list[Any] = []
    for b, m in zip(parts, metas):
        if m is not None and m.get("per_sample_shapes") is not None:
            shapes.extend(m["per_sample_shapes"])
        else:
            shapes.extend([m.get("shape") if m is not None else None] * b.size)
    base.update(
        is_nested=True,
        # A dense field that turned ragged across batches is described as jagged.
        kind=field_kind(base) if base.get("is_nested") else KIND_JAGGED,
        shape=shapes[0] if all(s == shapes[0] for s in shapes) else None,
        per_sample_shapes=shapes,
    )
    return base


# ---------------------------------------------------------------------------------------------
# KVBatchMeta
# ---------------------------------------------------------------------------------------------


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
                f"KVBatchMeta: Got duplicated keys {_duplicates(self.keys)}; keys must be unique"
            )
        if any(not isinstance(t, Mapping) for t in tags):
            raise InvalidArgument("KVBatchMeta tags must be dicts, one per key")
        # deep copies, as the reference makes: mutating a tag's list later leaks into no other batch
        self.tags = [_copy_row(t) for t in tags]
        if self.fields is not None:
            if isinstance(self.fields, str):
                raise InvalidArgument(
                    "fields must be a list of names, got a single string; wrap it in a list"
                )
            self.fields = list(self.fields)
            if len(set(self.fields)) != len(self.fields):
                raise InvalidArgument(
                    f"KVBatchMeta: Got duplicated fields {_duplicates(self.fields)}; fields must be unique"
                )
        self.extra_info = _copy.deepcopy(dict(self.extra_info)) if self.extra_info else {}

    @property
    def size(self) -> int:
        """Number of keys."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return (
            f"KVBatchMeta(size={self.size}, partition_id={self.partition_id!r}, fields={self.fields}, "
            f"keys={_short_list(self.keys)}, extra_info_keys={sorted(self.extra_info)})"
        )

    def _with(self, keys: list[str], tags: list[dict[str, Any]]) -> KVBatchMeta:
        return KVBatchMeta(
            keys=keys,
            tags=tags,
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )

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
            raise InvalidArgument(f"select_keys: Contain duplicate keys {_duplicates(wanted)}; list each key once")
        pos = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in wanted if k not in pos]
        if missing:
            raise KeyNotInBatch(
                f"select_keys: keys {_short_list(missing)} not found in current batch "
                f"(partition {self.partition_id!r}, {self.size} keys); select among this batch's keys"
            )
        return self._with(wanted, [self.tags[pos[k]] for k in wanted])

    def reorder(self, indexes: Sequence[int]) -> None:
        """Permute the keys in place: position ``k`` receives the key at ``indexes[k]``.

        Raises:
            InvalidArgument: ``indexes`` is not a permutation of ``range(size)``.
        """
        idx = _as_index_list(indexes, "indexes")
        _check_permutation(idx, self.size, "KVBatchMeta.reorder")
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
            for a, b in _chunk_bounds(self.size, chunks, "KVBatchMeta.chunk")
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
            extra_info=_merge_extra_info((b.extra_info for b in parts), "KVBatchMeta.concat"),
        )


_ATOMIC = (str, int, float, bool, bytes, type(None))


def _copy_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of one tag dict; a flat dict of scalars (the usual case) needs only ``dict()``."""
    if all(isinstance(v, _ATOMIC) for v in row.values()):
        return dict(row)
    return _copy.deepcopy(dict(row))


def _duplicates(values: Iterable[Any]) -> list[Any]:
    seen: set[Any] = set()
    dups: dict[Any, None] = {}
    for v in values:
        if v in seen:
            dups[v] = None
        seen.add(v)
    return list(dups)[:_REPR_MAX_ITEMS]
