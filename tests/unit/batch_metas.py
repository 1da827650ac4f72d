"""Batches the BatchMeta unit tests share: field-schema entries, a tagged batch, a contents check."""

from __future__ import annotations

import numpy as np
import torch

from tq_redis.meta import BatchMeta


def dense(dtype: torch.dtype = torch.float32, shape: tuple = (4,)) -> dict:
    return {"dtype": dtype, "shape": shape, "is_nested": False, "is_non_tensor": False}


def jagged(shapes: list[tuple], dtype: torch.dtype = torch.int64) -> dict:
    return {
        "dtype": dtype,
        "shape": None,
        "is_nested": True,
        "is_non_tensor": False,
        "per_sample_shapes": list(shapes),
    }


def make_meta(
    n: int = 4,
    *,
    start: int = 0,
    partition: str = "p0",
    ready: bool = True,
    tags: bool = True,
    extra: dict | None = None,
) -> BatchMeta:
    """A batch of ``n`` samples with a dense field ``a`` and a jagged field ``tok``."""
    return BatchMeta(
        global_indexes=list(range(start, start + n)),
        partition_ids=[partition] * n,
        field_schema={"a": dense(), "tok": jagged([(i + 1,) for i in range(start, start + n)])},
        production_status=np.ones(n, dtype=np.int8) if ready else None,
        extra_info=extra or {},
        custom_meta=[{"uid": f"u{i}"} for i in range(start, start + n)] if tags else None,
    )


def assert_same_contents(x: BatchMeta, y: BatchMeta) -> None:
    assert x.global_indexes == y.global_indexes
    assert x.partition_ids == y.partition_ids
    assert x.field_schema == y.field_schema
    np.testing.assert_array_equal(x.production_status, y.production_status)
    assert x.production_status.dtype == y.production_status.dtype == np.int8
    assert x.custom_meta == y.custom_meta
    assert x._custom_backend_meta == y._custom_backend_meta
    assert x.extra_info == y.extra_info
