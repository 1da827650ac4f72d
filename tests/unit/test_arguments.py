"""tq_redis.ops.arguments: the shared checks of durations, counts, sample ids and metadata arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tq_redis.errors import InvalidArgument
from tq_redis.meta import BatchMeta, KVBatchMeta
from tq_redis.ops import arguments


@pytest.mark.parametrize("value", [0, 0.0, 1, 2.5, np.float32(0.5), np.int64(3), arguments.MAX_SECONDS])
def test_seconds_accepts_finite_non_negative_numbers(value):
    got = arguments.seconds(value, "timeout")
    assert isinstance(got, float) and got == float(value)


@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, -0.001, "1", None, True, np.bool_(True), [1], arguments.MAX_SECONDS * 2]
)
def test_seconds_refuses_everything_else_with_a_typed_error(value):
    with pytest.raises(InvalidArgument, match="timeout must be a finite number of seconds"):
        arguments.seconds(value, "timeout")


def test_seconds_zero_and_none_only_where_allowed():
    with pytest.raises(InvalidArgument, match="> 0"):
        arguments.seconds(0, "lease_s", allow_zero=False)
    assert arguments.seconds(None, "lease_s", allow_none=True) is None
    with pytest.raises(InvalidArgument, match="or None"):
        arguments.seconds("x", "lease_s", allow_none=True)


@pytest.mark.parametrize("value", [1, np.int32(7), 2**32])
def test_count_accepts_positive_ints(value):
    assert arguments.count(value, "batch_size") == int(value)


@pytest.mark.parametrize("value", [0, -1, 1.0, math.nan, "2", None, True, 2**32 + 1])
def test_count_refuses_the_rest(value):
    with pytest.raises(InvalidArgument, match="batch_size must be a positive integer"):
        arguments.count(value, "batch_size")


def test_count_maximum():
    with pytest.raises(InvalidArgument, match="at most 8"):
        arguments.count(9, "n", maximum=8)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, [3]),
        ([0, 1, 2**32 - 1], [0, 1, 2**32 - 1]),
        ((5,), [5]),
        (np.array([1, 2]), [1, 2]),
        (torch.tensor([4, 5]), [4, 5]),
        (torch.tensor(6), [6]),
        ([], []),
    ],
)
def test_ids_accepts_ints_and_iterables_of_them(value, expected):
    assert arguments.ids(value) == expected


@pytest.mark.parametrize("value", [None, "1", b"1", [1.0], [math.nan], [math.inf], [-1], [2**32], [True], ["a"]])
def test_ids_refuses_the_rest(value):
    with pytest.raises(InvalidArgument, match="sample id"):
        arguments.ids(value, "global_indexes")


def test_metadata_arguments():
    meta = BatchMeta.empty()
    assert arguments.batch_meta(meta, "clear_samples") is meta
    with pytest.raises(InvalidArgument, match=r"clear_samples\(\) takes the BatchMeta"):
        arguments.batch_meta(None, "clear_samples")
    kv = KVBatchMeta(keys=["a"], tags=[{}], partition_id="p", fields=[])
    assert arguments.kv_batch_meta(kv, "kv_batch_get_by_meta") is kv
    with pytest.raises(InvalidArgument, match="KVBatchMeta"):
        arguments.kv_batch_meta(meta, "kv_batch_get_by_meta")
