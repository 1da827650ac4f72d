"""Every field type the reference system accepts round-trips through put/get_data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from tests.conftest import make_client


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if a.is_nested:
            return all(_equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            torch.nan_to_num(a.float() if a.dtype == torch.bfloat16 else a, nan=1234.5),
            torch.nan_to_num(b.float() if b.dtype == torch.bfloat16 else b, nan=1234.5),
        ) if a.is_floating_point() else a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and all(_equal(x, y) for x, y in zip(a.tolist(), b.tolist()))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


CASES = {
    "int64": torch.arange(12).reshape(3, 4),
    "bf16": torch.randn(3, 5).to(torch.bfloat16),
    "bool": torch.tensor([[True, False], [False, False], [True, True]]),
    "f16_nan_inf": torch.tensor([[float("nan"), 1.0], [float("inf"), -float("inf")], [0.0, -0.0]], dtype=torch.float16),
    "one_d": torch.tensor([1.5, 2.5, 3.5]),
    "uint8_3d": torch.randint(0, 255, (3, 2, 2, 2), dtype=torch.uint8),
    "jagged": torch.nested.nested_tensor([torch.arange(2), torch.arange(5), torch.arange(1)], layout=torch.jagged),
    "strided": torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(1, 4), torch.ones(3, 1)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tensor_fields_round_trip(client, name):
    value = CASES[name]
    meta = client.put(TensorDict({name: value}, batch_size=[3]), partition_id="p")
    got = client.get_data(meta)[name]
    assert got.is_nested == value.is_nested
    if value.is_nested:
        assert got.layout == value.layout
    assert _equal(value, got)


def test_dense_stays_dense_and_jagged_stays_jagged_after_claim(client):
    jag = torch.nested.nested_tensor([torch.arange(i + 1) for i in range(4)], layout=torch.jagged)
    td = TensorDict({"dense": torch.ones(4, 3), "jag": jag}, batch_size=[4])
    client.put(td, partition_id="p")
    meta = client.get_meta(["dense", "jag"], 2, "p", task_name="t")
    out = client.get_data(meta)
    assert not out["dense"].is_nested and out["dense"].shape == (2, 3)
    assert out["jag"].is_nested and [len(x) for x in out["jag"].unbind()] == [1, 2]


def test_order_follows_metadata(client):
    meta = client.put(TensorDict({"x": torch.arange(5) * 10}, batch_size=[5]), partition_id="p")
    meta.reorder([4, 0, 3, 1, 2])
    assert client.get_data(meta)["x"].tolist() == [40, 0, 30, 10, 20]


def test_numpy_and_python_values_round_trip(client):
    td = TensorDict(
        {
            "np_float": np.arange(6, dtype=np.float32).reshape(3, 2),
            "ints": [1, 2, 3],
            "words": ["a", "bb", "ccc"],
            "dicts": NonTensorStack({"k": 1}, {"k": [2, 3]}, {"k": None}),
            "np_bytes": np.array([b"x", b"yy", b"zzz"]),
            "np_object": np.array([{"a": 1}, "s", 3], dtype=object),
        },
        batch_size=[3],
    )
    meta = client.put(td, partition_id="p")
    got = client.get_data(meta)
    assert torch.equal(got["np_float"], torch.arange(6, dtype=torch.float32).reshape(3, 2))
    assert got["ints"].tolist() == [1, 2, 3]
    assert got.get("words").tolist() == ["a", "bb", "ccc"]
    assert got.get("dicts").tolist() == [{"k": 1}, {"k": [2, 3]}, {"k": None}]
    assert got["np_bytes"].dtype.kind == "S" and list(got["np_bytes"]) == [b"x", b"yy", b"zzz"]
    assert got["np_object"].dtype == object and list(got["np_object"]) == [{"a": 1}, "s", 3]


def test_nested_output_compat_flag(server, namespace):
    client = make_client(server.url, namespace, nested_output=True)
    meta = client.put(TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]), partition_id="p")
    out = client.get_data(meta)["x"]
    assert out.is_nested and [tuple(t.shape) for t in out.unbind()] == [(3,), (3,)]
    client.close()


def test_pickle_opt_in(server, namespace):
    from fractions import Fraction

    client = make_client(server.url, namespace, allow_pickle=True)
    td = TensorDict({"x": torch.ones(2), "frac": NonTensorStack(Fraction(1, 3), Fraction(2, 3))}, batch_size=[2])
    meta = client.put(td, partition_id="p")
    assert client.get_data(meta).get("frac").tolist() == [Fraction(1, 3), Fraction(2, 3)]
    client.close()
