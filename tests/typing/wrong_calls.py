"""Wrong calls of tq-redis's public API that mypy must flag: each line marked ``# expect: CODE``
must get exactly that error, and no other line any (tests/unit/test_typing.py). Never run."""

from __future__ import annotations

from tensordict import TensorDict

import tq_redis as tq
from tq_redis import AsyncTransferQueueClient, TransferQueueClient


def blocking_client(client: TransferQueueClient, td: TensorDict) -> None:
    client.put(td, partition_id="p", tiemout=5)  # expect: call-arg
    client.get_meta(["prompt"], "four", "p", task_name="train")  # expect: arg-type
    client.get_meta(["prompt"], 4, "p", "fetch", "train", None, 5.0)  # expect: call-arg


async def async_client(client: AsyncTransferQueueClient) -> None:
    await client.async_get_meta(["prompt"], 4, "p", task_nme="train")  # expect: call-arg


def module_level() -> None:
    tq.kv_put("key-1", partition_id=7)  # expect: arg-type
    tq.kv_putt("key-1", "kv")  # expect: attr-defined
