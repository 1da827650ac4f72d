"""Per-sample read-only views of a :class:`~tq_redis.meta.batch_meta.BatchMeta` (``meta.samples[i]``).

``BatchMeta`` is columnar; these views present one row of it as the reference's per-sample
``SampleMeta`` did (``global_index``, ``partition_id``, ``production_status``, ``custom_meta``,
``fields``), computed from the columns on each access and never cached, so a view always shows
the batch's current state. A view reads the batch through :class:`Columns`, the few columns it
needs, so this module does not depend on :mod:`tq_redis.meta.batch_meta` (which depends on it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np


class Columns(Protocol):
    """What a view reads of its batch (``BatchMeta`` has all of it)."""

    @property
    def size(self) -> int: ...
    @property
    def global_indexes(self) -> list[int]: ...
    @property
    def partition_ids(self) -> list[str]: ...
    @property
    def production_status(self) -> Any: ...
    @property
    def custom_meta(self) -> list[dict[str, Any]]: ...
    @property
    def field_schema(self) -> Mapping[str, Mapping[str, Any]]: ...
    @property
    def field_names(self) -> list[str]: ...

__all__ = ["Columns", "SampleView", "SampleViewList"]


class SampleView:
    """Read-only view of one row of a batch; computed on access, never cached."""

    __slots__ = ("_batch", "_idx")

    def __init__(self, batch: Columns, idx: int) -> None:
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


class SampleViewList(Sequence):
    """``BatchMeta.samples``: indexable, iterable, sized; views are made on demand."""

    __slots__ = ("_batch",)

    def __init__(self, batch: Columns) -> None:
        self._batch = batch

    def __len__(self) -> int:
        return self._batch.size

    def __getitem__(self, idx: int) -> SampleView:  # type: ignore[override]
        n = self._batch.size
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"samples[...] takes an int, got {type(idx).__name__}")
        i = int(idx) + n if idx < 0 else int(idx)
        if not 0 <= i < n:
            raise IndexError(f"sample {idx} out of range for a batch of {n}")
        return SampleView(self._batch, i)

    def __iter__(self) -> Iterator[SampleView]:
        return (SampleView(self._batch, i) for i in range(self._batch.size))
