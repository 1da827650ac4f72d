"""Sample positions in batch metadata: index lists, permutations, chunk bounds, and short lists.

Shared by :class:`tq_redis.meta.batch_meta.BatchMeta` and :class:`tq_redis.meta.kv_batch_meta.KVBatchMeta`
for the arguments of ``select_samples``, ``reorder`` and ``chunk``, and for the lists their error
messages and reprs quote. Plain functions over lists; depends only on the errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from tq_redis.errors import InvalidArgument

__all__ = ["REPR_MAX_ITEMS", "as_index_list", "as_permutation", "chunk_bounds", "duplicates", "short_list"]

REPR_MAX_ITEMS = 6
"""How many items a repr or an error message quotes from a long list."""


def as_index_list(indexes: Any, what: str) -> list[int]:
    """``indexes`` (a sequence, a 1-D numpy array or a tensor) as a list of positions.

    Raises:
        InvalidArgument: ``indexes`` is a string, not iterable, or a numpy array of more than one
            dimension; ``what`` names the argument in the message.
    """
    if isinstance(indexes, np.ndarray):
        if indexes.ndim != 1:
            raise InvalidArgument(f"{what} must be one-dimensional, got shape {indexes.shape}")
        return indexes.tolist()
    if isinstance(indexes, torch.Tensor):
        return indexes.reshape(-1).tolist()
    if isinstance(indexes, (str, bytes)) or not isinstance(indexes, Iterable):
        raise InvalidArgument(f"{what} must be a sequence of ints, got {type(indexes).__name__}")
    return list(indexes)


def as_permutation(indexes: Any, size: int, what: str, who: str) -> list[int]:
    """``indexes`` as a list of positions that is a permutation of ``range(size)``.

    Raises:
        InvalidArgument: ``indexes`` is not a sequence of ints (``what`` names the argument), or it
            is not a permutation: wrong length, a repeated position, or a position outside
            ``[0, size)`` (``who`` names the method).
    """
    indices = as_index_list(indexes, what)
    if len(indices) != size:
        raise InvalidArgument(
            f"{who}: indexes length {len(indices)} does not match the batch size {size}; "
            f"pass a permutation of range({size})"
        )
    seen = set(indices)
    if len(seen) != size:
        raise InvalidArgument(
            f"{who}: Contain duplicate indexes {duplicates(indices)}; pass a permutation of range({size})"
        )
    bad = [i for i in indices if not isinstance(i, (int, np.integer)) or i < 0 or i >= size]
    if bad:
        raise InvalidArgument(
            f"{who}: indices {bad[:REPR_MAX_ITEMS]} are outside [0, {size}); "
            f"pass a permutation of range({size})"
        )
    return indices


def chunk_bounds(size: int, chunks: Any, who: str) -> list[tuple[int, int]]:
    """Split ``range(size)`` into ``chunks`` contiguous runs whose lengths differ by at most one.

    Earlier runs get the extra items; with more chunks than items the trailing runs are empty.

    Raises:
        InvalidArgument: ``chunks`` is not a positive int.
    """
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


def short_list(values: Sequence[Any]) -> str:
    """``repr`` of a list, shortened to its first items and its last when it is long."""
    if len(values) <= REPR_MAX_ITEMS:
        return repr(list(values))
    head = ", ".join(repr(v) for v in values[: REPR_MAX_ITEMS - 2])
    return f"[{head}, ..., {values[-1]!r}]"


def duplicates(values: Iterable[Any]) -> list[Any]:
    """The values that occur more than once, in order of their second occurrence (at most a few)."""
    seen: set[Any] = set()
    dups: dict[Any, None] = {}
    for v in values:
        if v in seen:
            dups[v] = None
        seen.add(v)
    return list(dups)[:REPR_MAX_ITEMS]
