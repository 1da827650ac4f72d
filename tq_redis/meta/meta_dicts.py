"""The dict-valued parts of batch metadata: per-sample rows and the batch-level ``extra_info``.

Per-sample rows are the lists of one dict per sample that ``BatchMeta`` keeps for ``custom_meta``
and for the storage backends' ``_custom_backend_meta``, and ``KVBatchMeta`` for ``tags``. Most
batches carry no tags, so ``BatchMeta`` stores an all-empty column as ``None`` (:data:`Rows`) and
the functions here take and give that form. ``extra_info`` unions follow one rule for both
classes: a key present in several batches must have equal values. Depends only on the errors.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tq_redis.errors import BatchSizeMismatch, InvalidArgument

__all__ = [
    "Rows",
    "copy_row",
    "merge_extra_info",
    "rows_concat",
    "rows_from",
    "rows_full",
    "rows_merge",
    "rows_take",
    "values_equal",
]

Rows = list[dict[str, Any]] | None
"""Per-sample dicts; ``None`` stands for "every sample's dict is empty" and is materialised lazily."""

_ATOMIC = (str, int, float, bool, bytes, type(None))


def rows_from(values: Sequence[Mapping[str, Any]] | None, n: int, what: str) -> Rows:
    """Copy of a caller's per-sample dicts (one level deep) for a batch of ``n``.

    An empty list means "none given", as in the reference system, and gives ``None``.

    Raises:
        BatchSizeMismatch: not one dict per sample.
        InvalidArgument: an entry is not a dict; ``what`` names the argument in the message.
    """
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


def rows_take(rows: Rows, positions: list[int] | slice) -> Rows:
    """The rows at ``positions`` (validated by the caller), each copied one level deep."""
    if rows is None:
        return None
    if isinstance(positions, slice):
        return [dict(r) for r in rows[positions]]
    return [dict(rows[i]) for i in positions]


def rows_full(rows: Rows, n: int) -> list[dict[str, Any]]:
    """``rows`` with ``None`` materialised as ``n`` empty dicts."""
    return rows if rows is not None else [{} for _ in range(n)]


def rows_merge(a: Rows, b: Rows, n: int) -> Rows:
    """Row-by-row merge of two columns over the same ``n`` samples; ``b`` wins on a clash."""
    if a is None and b is None:
        return None
    return [{**x, **y} for x, y in zip(rows_full(a, n), rows_full(b, n))]


def rows_concat(parts: list[tuple[Rows, int]]) -> Rows:
    """The columns of several batches, given as ``(rows, size)``, appended in order."""
    if all(rows is None for rows, _ in parts):
        return None
    out: list[dict[str, Any]] = []
    for rows, n in parts:
        out.extend([{} for _ in range(n)] if rows is None else (dict(r) for r in rows))
    return out


def copy_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of one tag dict; a flat dict of scalars (the usual case) needs only ``dict()``."""
    if all(isinstance(v, _ATOMIC) for v in row.values()):
        return dict(row)
    return copy.deepcopy(dict(row))


def values_equal(a: Any, b: Any) -> bool:
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


def merge_extra_info(infos: Iterable[Mapping[str, Any] | None], who: str) -> dict[str, Any]:
    """Union of several extra_info dicts; a key present with different values is an error.

    Raises:
        InvalidArgument: a key has different values in two of ``infos``; ``who`` names the method.
    """
    merged: dict[str, Any] = {}
    for pos, info in enumerate(infos):
        if not info:
            continue
        for key, value in info.items():
            if key in merged and not values_equal(merged[key], value):
                raise InvalidArgument(
                    f"{who}: extra_info key {key!r} has conflicting values across chunks "
                    f"(extra_info[{key!r}] is {merged[key]!r} in an earlier batch, {value!r} in batch #{pos}); "
                    f"make the values equal or remove the key with remove_extra_info() before concatenating"
                )
            merged.setdefault(key, value)
    return merged
