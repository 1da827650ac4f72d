"""torch's jagged-layout nested tensors, taken apart and built without torch's dispatcher.

A ``torch.jagged`` nested tensor is a Python tensor subclass: every attribute or method call on
it (``.dtype``, ``.size(0)``, ``.values()``) runs its ``__torch_function__`` and often its
``__torch_dispatch__``, 10 to 40 µs each, and the public constructor goes through a dispatched
view op. For the small fields of an RL batch that was most of a put's or a get_data's CPU. The
class keeps its parts as plain attributes (values, offsets, lengths, the ragged dimension, the
size) and can be constructed directly, so :func:`jagged_parts` reads them and
:func:`jagged_tensor` builds one. Both are private to torch: anything that is not exactly that
class, or a torch that lays it out differently, takes the public methods instead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np
import torch

try:  # torch's own class for the jagged layout and its way of holding the seqlen bounds
    from torch.nested._internal.nested_tensor import NestedTensor as JAGGED_CLASS
    from torch.nested._internal.nested_tensor import _store_val_in_tensor
except ImportError:  # pragma: no cover - another torch: the public methods and constructor
    JAGGED_CLASS = None

_PARTS = ("_values", "_offsets", "_lengths", "_ragged_idx", "_size")


class JaggedParts(NamedTuple):
    """What a jagged nested tensor is made of."""

    values: torch.Tensor  # every row's elements, one row after the other
    offsets: torch.Tensor  # rows + 1 start offsets into ``values``
    lengths: torch.Tensor | None  # per-row lengths when rows have holes between them, else None
    ragged_idx: int  # which dimension is ragged (1: the usual, one row per sample)
    rows: int  # the size of the batch dimension


def jagged_parts(t: Any) -> JaggedParts | None:
    """``t``'s parts when it is a ``torch.jagged`` nested tensor of torch's own class, else None."""
    if JAGGED_CLASS is None or type(t) is not JAGGED_CLASS:
        return None
    try:
        values, offsets, lengths, ragged_idx, size = (getattr(t, a) for a in _PARTS)
    except AttributeError:  # a torch that keeps them elsewhere
        return None
    return JaggedParts(values, offsets, lengths, ragged_idx, int(size[0]))


def parts_of(t: torch.Tensor) -> JaggedParts:
    """The parts of jagged nested tensor ``t``: read directly (:func:`jagged_parts`) when it is
    torch's own class, through its public methods otherwise."""
    parts = jagged_parts(t)
    if parts is None:
        parts = JaggedParts(t.values(), t.offsets(), t.lengths(), t._ragged_idx, t.size(0))
    return parts


@functools.lru_cache(maxsize=1024)
def _seqlen_bound(value: int) -> torch.Tensor:
    # torch keeps a seqlen bound as the size of a (value, 0) tensor; it holds no data, so one per
    # value serves all. The class marks a bound's size dynamic (for torch.compile) each time it is
    # handed one; marking the shared tensor once here is the same and saves that per tensor built.
    bound = _store_val_in_tensor(value)
    torch._dynamo.mark_dynamic(bound, 0)
    return bound


def jagged_tensor(values: torch.Tensor, offsets: torch.Tensor, min_seqlen: int, max_seqlen: int) -> torch.Tensor:
    """The jagged nested tensor of ``values`` cut at ``offsets``, knowing its row-length bounds.

    Same tensor as ``torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=,
    max_seqlen=)``, built with the class itself: the public function goes through a dispatched
    view op that costs ~75 µs a field (most of a tiny get_data), the class ~20 µs.
    """
    if JAGGED_CLASS is not None:
        try:
            built = JAGGED_CLASS(values, offsets)
            built._metadata_cache = {"min_seqlen": _seqlen_bound(min_seqlen), "max_seqlen": _seqlen_bound(max_seqlen)}
            return built
        except (TypeError, RuntimeError):  # a torch whose class takes other arguments
            pass
    return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=min_seqlen, max_seqlen=max_seqlen)


def row_offsets(lengths: Sequence[int]) -> np.ndarray:
    """The ``len(lengths) + 1`` start offsets of rows of ``lengths`` (int64; from numpy, because
    ``torch.tensor`` of a Python list costs ~3x as much for a few rows)."""
    return np.fromiter(accumulate(lengths, initial=0), np.int64, len(lengths) + 1)


def jagged_from_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The jagged nested tensor of ``rows`` (one tensor per sample, ragged in their first
    dimension, alike in the others): what ``torch.nested.as_nested_tensor(rows,
    layout=torch.jagged)`` builds, in a quarter of its time for a few small rows.

    Raises:
        ValueError: ``rows`` is empty.
        RuntimeError: the rows differ in dtype, device or trailing dimensions (from ``torch.cat``).
    """
    if not rows:
        raise ValueError("a jagged tensor needs at least one row")
    lengths = [len(r) for r in rows]
    offsets = torch.from_numpy(row_offsets(lengths))
    device = rows[0].device
    if device.type != "cpu":
        offsets = offsets.to(device)
    return jagged_tensor(torch.cat(list(rows)), offsets, min(lengths), max(lengths))


def row_views(t: torch.Tensor) -> list[torch.Tensor]:
    """The rows of jagged tensor ``t`` as views of its values, cut at its offsets; ``unbind()``
    (the fallback for rows with holes or another ragged dimension) goes through torch's
    dispatcher, ~0.2 ms for a few small rows."""
    parts = parts_of(t)
    if parts.lengths is not None or parts.ragged_idx != 1:
        return list(t.unbind())
    bounds = parts.offsets.tolist()
    return [parts.values[a:b] for a, b in zip(bounds, bounds[1:])]
