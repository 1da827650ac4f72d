"""Where the reference system (``transferqueue``) and we differed, its behaviour is now the default.

Each test names the cause from the drop-in issue it guards: jagged fields from puts of different
shapes or dtypes (1), nested output (2), ``async_*`` on the sync client (3), statuses of a cleared
partition and ``mode="insert"`` (7), ``put(data_parser=)`` and custom_meta on put (8). Our former
behaviour stays reachable as an option (``strict_schema``, ``nested_output=False``) and is tested
here too.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from tests.conftest import make_client
from tq_redis import errors


def _td(**fields) -> TensorDict:
    n = next(iter(fields.values())).size(0)
    return TensorDict(fields, batch_size=[n])


def _rows(value) -> list[list]:
    return [row.tolist() for row in value.unbind(0)]


# ---------------------------------------------------------------- 1. shapes and dtypes per put


def test_puts_of_different_shapes_make_the_field_jagged(server, namespace):
    """verl puts one trajectory per call, a dense (1, L) each with its own L."""
    client = make_client(server.url, namespace, nested_output=True)
    for length in (3, 5, 2):
        client.put(_td(responses=torch.arange(length).reshape(1, length)), partition_id="p")
    meta = client.get_meta(["responses"], 3, "p", task_name="trainer")
    assert meta.field_schema["responses"]["is_nested"] is True
    assert meta.field_schema["responses"]["dtype"] == torch.int64
    out = client.get_data(meta)["responses"]
    assert out.is_nested and out.layout == torch.jagged
    assert out.offsets().tolist() == [0, 3, 8, 10]
    assert _rows(out) == [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1]]
    client.close()


def test_rewrite_with_another_shape_widens_the_field(server, namespace):
    client = make_client(server.url, namespace, nested_output=True)
    meta = client.put(_td(prompt=torch.zeros(4, 2)), partition_id="p")
    client.put(_td(score=torch.ones(2, 3)), metadata=meta.select_samples([0, 1]))
    client.put(_td(score=torch.ones(2, 5)), metadata=meta.select_samples([2, 3]))  # was ShapeConflict
    data = client.get_data(client.get_meta(["score"], 4, "p", task_name="t"))
    assert [len(r) for r in data["score"].unbind(0)] == [3, 3, 5, 5]
    client.close()


def test_dtype_change_keeps_every_value_exactly(server, namespace):
    """The reference's tutorial 02 puts attention_mask as float32, later as int64."""
    client = make_client(server.url, namespace, nested_output=True)
    first = client.put(_td(mask=torch.ones(2, 4)), partition_id="p")
    second = client.put(_td(mask=torch.ones(2, 4, dtype=torch.int64)), partition_id="p")
    assert client.get_data(first)["mask"].dtype == torch.float32
    assert client.get_data(second)["mask"].dtype == torch.int64
    both = client.get_data(client.get_meta(["mask"], 4, "p", task_name="t")).get("mask")
    assert isinstance(both, NonTensorStack)  # as the reference: no nested tensor mixes dtypes
    assert [v.dtype for v in both.tolist()] == [torch.float32] * 2 + [torch.int64] * 2
    assert all(v.tolist() == [1, 1, 1, 1] for v in both.tolist())
    schema = client.get_meta(["mask"], 1, "p", mode="force_fetch").field_schema["mask"]
    assert schema["dtype"] is None and schema["is_nested"] is True
    client.close()


def test_kv_puts_of_different_lengths_read_back_jagged(server, namespace):
    client = make_client(server.url, namespace, nested_output=True)
    client.kv_put("a", "replay", fields={"ids": torch.arange(3)})
    client.kv_put("b", "replay", fields={"ids": torch.arange(6)})
    out = client.kv_batch_get(["a", "b"], "replay")["ids"]
    assert _rows(out) == [[0, 1, 2], list(range(6))]
    client.close()


def test_strict_schema_option_raises_and_writes_nothing(server, namespace):
    client = make_client(server.url, namespace, strict_schema=True)
    client.put(_td(x=torch.zeros(2, 3)), partition_id="p")
    with pytest.raises(errors.ShapeConflict, match="per-sample shape"):
        client.put(_td(x=torch.zeros(2, 4)), partition_id="p")
    with pytest.raises(errors.DTypeConflict, match="dtype"):
        client.put(_td(x=torch.zeros(2, 3, dtype=torch.int32)), partition_id="p")
    with pytest.raises(errors.ShapeConflict):
        client.kv_put("k", "p", fields={"x": torch.zeros(5)})
    _, status = client.get_production_status(["x"], "p")
    assert status.tolist() == [1, 1]  # the refused puts left no sample behind
    client.close()


# ---------------------------------------------------------------- 2. output layout


def test_default_output_is_the_reference_layout(server, namespace):
    client = make_client(server.url, namespace, nested_output=True)
    meta = client.put(_td(tokens=torch.arange(8).reshape(2, 4), reward=torch.tensor([0.5, 1.0])),
                      partition_id="p")
    data = client.get_data(meta)
    assert data["tokens"].is_nested and data["tokens"].layout == torch.jagged  # even of one shape
    assert data["tokens"].offsets().tolist() == [0, 4, 8]
    # verl pads what it gets back: to the longest row, not to the batch's total length
    assert torch.equal(data["tokens"].to_padded_tensor(0), torch.arange(8).reshape(2, 4))
    assert not data["reward"].is_nested  # one scalar per sample stays dense, as in the reference
    assert data["reward"].tolist() == [0.5, 1.0]
    client.close()


def test_dense_output_option(server, namespace):
    client = make_client(server.url, namespace, nested_output=False)
    meta = client.put(_td(tokens=torch.arange(8).reshape(2, 4)), partition_id="p")
    assert torch.equal(client.get_data(meta)["tokens"], torch.arange(8).reshape(2, 4))
    client.close()


def test_strided_field_with_one_ragged_dim_comes_back_jagged(server, namespace):
    client = make_client(server.url, namespace, nested_output=True)
    parts = [torch.ones(2, 3), torch.zeros(4, 3)]
    meta = client.put(_td(h=torch.nested.nested_tensor(parts)), partition_id="p")  # strided layout
    out = client.get_data(meta)["h"]
    assert out.layout == torch.jagged
    assert len(out) == 2 and [tuple(t.shape) for t in list(out)] == [(2, 3), (4, 3)]
    client.close()


# ---------------------------------------------------------------- 3. async on the sync client


def test_sync_client_awaits_async_methods_in_several_loops(real_server, namespace):
    """verl awaits get_client().async_put / async_get_data / async_kv_retrieve_meta ..."""
    client = make_client(real_server.url, namespace, nested_output=True)

    async def produce():
        meta = await client.async_put(_td(x=torch.arange(4).reshape(4, 1)), partition_id="p")
        await client.async_kv_put("k", "kvp", fields={"y": torch.arange(2)})
        return meta

    async def consume():
        batch = await client.async_get_meta(["x"], 4, "p", task_name="t")
        data = await client.async_get_data(batch)
        kv_meta = await client.async_kv_retrieve_meta(["k"], "kvp")
        keys = await client.async_kv_retrieve_keys(kv_meta.global_indexes, "kvp")
        return data, keys

    meta = asyncio.run(produce())  # each asyncio.run is a new event loop
    data, keys = asyncio.run(consume())
    assert meta.size == 4 and _rows(data["x"]) == [[0], [1], [2], [3]]
    assert keys == ["k"]
    assert client.get_partition_list() == ["p", "kvp"]  # the sync side still works
    client.close()


# ---------------------------------------------------------------- 7. insert mode, cleared statuses


def test_status_of_a_cleared_partition_is_empty(server, namespace):
    client = make_client(server.url, namespace, nested_output=True)
    meta = client.put(_td(x=torch.zeros(3)), partition_id="p")
    client.get_data(client.get_meta(["x"], 3, "p", task_name="t"))
    assert client.check_production_status(["x"], "p") and client.check_consumption_status("t", "p")
    client.clear_partition("p")
    assert client.check_production_status(["x"], "p") is False
    assert client.check_consumption_status("t", "p") is False
    ids, status = client.get_consumption_status("t", "p")
    assert ids.numel() == 0 and status.numel() == 0
    ids, status = client.get_production_status(["x"], "never-created")
    assert ids.numel() == 0 and status.numel() == 0
    assert meta.size == 3
    client.close()


def test_insert_mode_allocates_samples_for_a_later_put(server, namespace):
    client = make_client(server.url, namespace, nested_output=True)
    meta = client.get_meta(["a", "b"], 3, "p", mode="insert")
    assert meta.size == 3 and meta.production_status.tolist() == [0, 0, 0]
    assert set(meta.field_names) == {"a", "b"}
    assert client.get_meta(["a"], 1, "p", task_name="t").size == 0  # nothing produced yet
    client.put(_td(a=torch.arange(3)), metadata=meta)
    got = client.get_meta(["a"], 3, "p", task_name="t")
    assert got.global_indexes == meta.global_indexes
    assert client.get_meta(["a", "b"], 1, "p", task_name="t2").size == 0  # b still missing
    assert client.check_production_status(["a"], "p")
    assert not client.check_production_status(["a", "b"], "p")  # b was allocated, never put
    client.put(_td(b=torch.arange(3) * 10), metadata=meta)
    both = client.get_meta(["a", "b"], 3, "p", task_name="t2")
    assert client.get_data(both)["b"].tolist() == [0, 10, 20]
    again = client.get_meta(["a"], 2, "p", mode="insert")
    assert min(again.global_indexes) > max(meta.global_indexes)  # ids are never reused
    client.close()


# ---------------------------------------------------------------- 8. put(data_parser=), custom_meta


def test_put_runs_the_data_parser_and_stores_custom_meta(server, namespace):
    client = make_client(server.url, namespace, nested_output=True)

    def resolve(columns):
        columns["x"].mul_(10)  # e.g. a URL resolved into the real values

    meta = client.put(_td(x=torch.arange(3)), partition_id="p", data_parser=resolve)
    assert client.get_data(meta)["x"].tolist() == [0, 10, 20]
    meta.update_custom_meta([{"policy_version": 7}] * 3)
    client.put(_td(y=torch.ones(3)), metadata=meta)
    claimed = client.get_meta(["x", "y"], 3, "p", task_name="t")
    assert [m["policy_version"] for m in claimed.custom_meta] == [7, 7, 7]
    client.close()
