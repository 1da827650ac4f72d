"""Typical calls of tq-redis's public API, as users write them: mypy must find no error here.

Checked, never run, by tests/unit/test_typing.py (with tests/typing/mypy.ini); the calls it must
flag are in tests/typing/wrong_calls.py. ``assert_type`` fails on ``Any`` too, so each one proves
that a checker sees the call's real result type.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from tensordict import TensorDict
from typing_extensions import assert_type

import tq_redis as tq
from tq_redis import AsyncTransferQueueClient, BatchMeta, KVBatchMeta, TransferQueueClient


def batch(n: int) -> TensorDict:
    return TensorDict({"prompt": torch.zeros(n, 8, dtype=torch.long)}, batch_size=[n])


def blocking_client(url: str) -> None:
    client = TransferQueueClient(url, "job", allow_pickle=False, nested_output=True)
    meta = client.put(batch(8), partition_id="step_0")
    assert_type(meta, BatchMeta)
    meta = client.put(batch(8), metadata=meta)
    claimed = client.get_meta(["prompt"], 4, "step_0", task_name="train", timeout=5.0, lease_s=30.0)
    assert_type(claimed, BatchMeta)
    everything = client.get_meta(["prompt"], 8, "step_0", mode="force_fetch")
    assert_type(everything, BatchMeta)
    data = client.get_data(claimed)
    assert_type(data, TensorDict)
    client.ack(claimed)
    lost: list[int] = client.nack(claimed)
    client.extend_lease(claimed, 10.0)
    pair = client.get_meta_and_data(["prompt"], 2, "step_0", task_name="train", max_deliveries=3)
    grown = client.append_parts(meta, {"responses": torch.ones(8, 4, dtype=torch.long)}, 0)
    assert_type(grown, BatchMeta)
    assert_type(client.complete_parts(grown, ["responses"]), BatchMeta)
    assert_type(pair, tuple[BatchMeta, TensorDict])
    kv_meta = client.kv_put("key-1", "kv", {"score": torch.ones(1)}, tag={"round": 1})
    assert_type(kv_meta, KVBatchMeta)
    values = client.kv_batch_get(["key-1"], "kv", select_fields="score")
    assert_type(values, TensorDict)
    listing = client.kv_list("kv")
    assert_type(listing, dict[str, dict[str, dict[str, Any]]])
    assert_type(client.seal_partition("step_0"), bool)
    assert_type(client.get_partition_list(), list[str])
    client.clear_partition("step_0")
    client.close()
    print(lost, everything, pair, values)


async def async_client(url: str) -> None:
    client = AsyncTransferQueueClient(url, namespace="job")
    meta = await client.async_put(batch(4), partition_id="p")
    assert_type(meta, BatchMeta)
    claimed = await client.async_get_meta(["prompt"], 4, "p", task_name="train", timeout=1.0)
    assert_type(claimed, BatchMeta)
    data = await client.async_get_data(claimed)
    assert_type(data, TensorDict)
    pair = await client.async_get_meta_and_data(["prompt"], 4, "p", task_name="ref")
    grown = await client.async_append_parts(meta, {"responses": torch.ones(4, 4, dtype=torch.long)}, 1, complete=True)
    assert_type(grown, BatchMeta)
    assert_type(pair, tuple[BatchMeta, TensorDict])
    kv_meta = await client.async_kv_put("key-1", "kv", {"score": torch.ones(1)})
    assert_type(kv_meta, KVBatchMeta)
    await client.async_clear_partition("p")
    await client.async_close()


def module_level() -> None:
    config = tq.init({"namespace": "job"})
    url: str = config["redis"]["url"]
    client = tq.get_client()
    assert_type(client, TransferQueueClient)
    meta = client.put(batch(2), partition_id="p")
    assert_type(meta, BatchMeta)
    kv_meta = tq.kv_put("key-1", "kv", fields={"score": torch.ones(1)}, tag={"round": 1})
    assert_type(kv_meta, KVBatchMeta)
    tq.kv_batch_put(["a", "b"], "kv", batch(2), tags=[{}, {}])
    assert_type(tq.kv_batch_get(["a", "b"], "kv"), TensorDict)
    listing = asyncio.run(tq.async_kv_list("kv"))
    assert_type(listing, dict[str, dict[str, dict[str, Any]]])
    tq.kv_clear(["a", "b"], "kv")
    tq.close()
    print(url)
