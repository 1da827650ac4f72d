"""``data_parser``: a user's hook that rewrites a batch's values before they are stored.

The reference system lets ``put`` / ``kv_put`` resolve references (URLs, file names ...) into
real values on the way in; here the hook runs in the client, for every store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tq_redis.errors import InvalidArgument

DataParser = Callable[[dict[str, Any]], Any]


def apply_data_parser(td: TensorDict, data_parser: DataParser) -> TensorDict:
    """Run the user's parser on a plain dict of the batch's columns (it edits values in place)."""
    columns: dict[str, Any] = {}
    for name in td.keys():
        value = td.get(name)
        if isinstance(value, NonTensorStack):
            columns[name] = value.tolist()
        elif isinstance(value, torch.Tensor) and value.is_nested:
            columns[name] = list(value.unbind(0))
        else:
            columns[name] = value
    before = {k: len(v) for k, v in columns.items()}
    data_parser(columns)
    after = {k: len(v) for k, v in columns.items()}
    if after != before:
        raise InvalidArgument(
            f"data_parser must edit values in place without adding, removing or resizing columns; "
            f"columns were {before}, are {after}"
        )
    out: dict[str, Any] = {}
    for name, value in columns.items():
        original = td.get(name)
        if isinstance(original, NonTensorStack):
            out[name] = NonTensorStack(*[NonTensorData(v) for v in value])
        elif isinstance(original, torch.Tensor) and original.is_nested:
            out[name] = torch.nested.as_nested_tensor(list(value), layout=original.layout)
        else:
            out[name] = value
    return TensorDict(out, batch_size=td.batch_size)
