"""Pure helpers of tq_redis.ops."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tq_redis.ops import canonical
from tq_redis.ops.encoding import id_ranges


def test_id_ranges_examples():
    assert id_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert id_ranges([3]) == "3"
    assert id_ranges([9, 8, 7]) == "7-9"


@given(st.sets(st.integers(min_value=0, max_value=5000), min_size=1, max_size=300))
def test_id_ranges_expand_back_to_the_ids(ids):
    expanded = set()
    for part in id_ranges(list(ids)).split(","):
        a, _, b = part.partition("-")
        expanded.update(range(int(a), int(b or a) + 1))
    assert expanded == ids


def test_canonical_schema_json_is_order_independent():
    assert canonical({"b": 1, "a": [2]}) == canonical({"a": [2], "b": 1}) == '{"a":[2],"b":1}'


def test_claimed_schema_entries_are_decoded_once_and_owned_by_each_batch():
    import json

    import torch

    from tq_redis.ops.context import batchmeta_schema

    text = json.dumps({"kind": "tensor", "dtype": "int64", "shape": [2]})
    first = batchmeta_schema({"x": text})
    assert first["x"]["dtype"] == torch.int64 and first["x"]["shape"] == torch.Size([2])
    first["x"]["dtype"] = None  # a caller editing its batch's schema
    second = batchmeta_schema({"x": text, "y": text})
    assert second["x"]["dtype"] == torch.int64
    assert second["x"] is not second["y"] and second["x"] == second["y"]
