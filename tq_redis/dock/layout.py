"""Rows in and rows out of a dock: MindSpeed-RL's padded column layout and back.

``put_experience`` takes columns as a tensor (one row per index) or a list of per-row tensors,
and with ``original_length`` (every row's length, column after column, as MindSpeed's
``padding_dict_to_tensor_dict`` makes it) cuts each row back to its length first (:func:`unpadded`).
A column is stored as one field: dense for scalar rows, jagged for tensor rows (:func:`rows_to_field`).
``get_experience`` returns the columns zero-padded along each row's first dimension plus
``original_length`` (:func:`as_layout` with ``"padded"``), or as jagged nested tensors (``"jagged"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torch.nn.utils.rnn import pad_sequence

from tq_redis.errors import BatchSizeMismatch, InvalidArgument

ORIGINAL_LENGTH = "original_length"
LAYOUTS = ("padded", "jagged")


def check_layout(value: str) -> str:
    """``value`` if it names a layout (:data:`LAYOUTS`), else ``InvalidArgument``."""
    if value not in LAYOUTS:
        raise InvalidArgument(f"layout must be one of {LAYOUTS}, got {value!r}")
    return value


def _rows(name: str, value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0)) if value.ndim else [value]
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    raise InvalidArgument(f"column {name!r}: give a tensor (one row per index) or a list of rows")


def _lengths(value: Any, expected: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        lengths = value.reshape(-1).tolist()
    elif isinstance(value, Sequence):
        lengths = [int(v) for v in value]
    else:
        raise InvalidArgument(f"{ORIGINAL_LENGTH} must be a tensor or a list of row lengths")
    if len(lengths) != expected:
        raise BatchSizeMismatch(
            f"{ORIGINAL_LENGTH} holds {len(lengths)} lengths but the columns hold {expected} rows; it needs "
            f"one length per row, column after column (as padding_dict_to_tensor_dict makes it)"
        )
    if any(n < 0 for n in lengths):
        raise InvalidArgument(f"{ORIGINAL_LENGTH} holds negative lengths")
    return [int(n) for n in lengths]


def unpadded(data_dict: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Column -> rows; with ``original_length`` each row is cut back to its length (padding dropped)."""
    if not hasattr(data_dict, "items"):
        raise InvalidArgument(f"data_dict must be a dict or TensorDict of columns, got {type(data_dict).__name__}")
    items = [(str(k), v) for k, v in data_dict.items() if v is not None]
    columns = {k: _rows(k, v) for k, v in items if k != ORIGINAL_LENGTH}
    raw_lengths = next((v for k, v in items if k == ORIGINAL_LENGTH), None)
    if raw_lengths is None:
        return columns
    lengths = iter(_lengths(raw_lengths, sum(len(r) for r in columns.values())))
    out = {}
    for name, rows in columns.items():
        cut = []
        for row in rows:
            n = next(lengths)
            if isinstance(row, torch.Tensor) and row.ndim:
                if n > row.shape[0]:
                    raise InvalidArgument(f"column {name!r}: {ORIGINAL_LENGTH} {n} exceeds the row's {row.shape[0]}")
                row = row[:n]
            cut.append(row)
        out[name] = cut
    return out


def rows_to_field(name: str, rows: list[Any]) -> Any:
    """One field: dense for scalar rows, a jagged nested tensor for tensor rows (lengths may vary)."""
    if all(isinstance(r, torch.Tensor) for r in rows):
        if all(r.ndim == 0 for r in rows):
            return torch.stack(rows)
        try:
            return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        except (RuntimeError, ValueError) as exc:
            raise InvalidArgument(f"column {name!r}: rows must share dtype and all but the first dim ({exc})") from exc
    return rows


def row_tensors(name: str, value: Any) -> list[torch.Tensor]:
    """A column's rows as tensors (the padded layout cannot return non-tensor rows)."""
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(
            f"column {name!r} holds non-tensor rows, which the padded layout cannot return; use layout='jagged'"
        )
    return list(value.unbind())


def _padded(name: str, rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Rows zero-padded along their first dimension, and each row's length (1 for a scalar)."""
    if all(r.ndim == 0 for r in rows):
        return torch.stack(rows), [1] * len(rows)
    if any(r.ndim == 0 for r in rows):
        raise InvalidArgument(f"column {name!r} mixes scalar and tensor rows; get it with layout='jagged'")
    try:
        padded = pad_sequence(rows, batch_first=True, padding_value=0)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"column {name!r}: rows differ beyond their first dimension or in dtype ({exc}); "
            f"get it with layout='jagged'"
        ) from exc
    return padded, [int(r.shape[0]) for r in rows]


def as_layout(td: TensorDict, columns: list[str], layout: str) -> TensorDict:
    """``columns`` of ``td`` in ``layout``: as they are (jagged), or padded plus ``original_length``."""
    if layout == "jagged":
        return td
    batch: dict[str, torch.Tensor] = {}
    lengths: list[int] = []
    for name in columns:
        batch[name], row_lengths = _padded(name, row_tensors(name, td[name]))
        lengths.extend(row_lengths)
    batch[ORIGINAL_LENGTH] = torch.tensor(lengths, dtype=torch.int64)
    return TensorDict.from_dict(batch)
