"""AsyncTransferQueueClient runs the same operations as the sync client, on asyncio.

Real servers only: fakeredis' TCP server drops a redis.asyncio connection after any error reply
(even "Function not found"), which real servers do not; the Lua paths themselves are covered on
fakeredis through the sync client.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from tensordict import TensorDict

from tq_redis import AsyncTransferQueueClient, errors
from tq_redis.meta.keys import config_key


@pytest.fixture
def aclient(real_server, namespace):
    import redis

    r = redis.Redis.from_url(real_server.url)
    r.hset(config_key(namespace), "storage", json.dumps({"backend": "redis", "options": {}}))
    r.close()
    return AsyncTransferQueueClient(real_server.url, namespace, nested_output=False)


def test_async_round_trip_and_status(aclient):
    async def main():
        meta = await aclient.async_put(TensorDict({"x": torch.arange(6)}, batch_size=[6]), partition_id="p")
        assert meta.global_indexes == list(range(6))
        batch = await aclient.async_get_meta(["x"], 4, "p", task_name="t")
        data = await aclient.async_get_data(batch)
        assert data["x"].tolist() == [0, 1, 2, 3]
        ids, status = await aclient.async_get_consumption_status("t", "p")
        assert status.tolist() == [1, 1, 1, 1, 0, 0]
        assert await aclient.async_check_production_status(["x"], "p")
        assert await aclient.async_get_partition_list() == ["p"]
        await aclient.async_clear_partition("p")
        assert await aclient.async_get_partition_list() == []
        assert not await aclient.async_check_production_status(["x"], "p")  # cleared: no samples
        with pytest.raises(errors.UnknownPartition):
            await aclient.async_get_meta(["x"], 1, "p", mode="force_fetch")
        await aclient.async_close()

    asyncio.run(main())


def test_async_waiters_and_producer_share_one_loop(aclient):
    async def main():
        async def consumer(task):
            return await aclient.async_get_meta(["x"], 3, "q", task_name=task, timeout=10)

        waiting = [asyncio.create_task(consumer(t)) for t in ("a", "b", "c")]
        await asyncio.sleep(0)  # let the waiters start; they block on the stream, not the loop
        await aclient.async_put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id="q")
        metas = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        assert [m.global_indexes for m in metas] == [[0, 1, 2]] * 3
        leased = await aclient.async_get_meta(["x"], 3, "q", task_name="d", lease_s=30)
        assert await aclient.async_nack(leased) == []
        again = await aclient.async_get_meta(["x"], 3, "q", task_name="d", lease_s=30)
        assert again.global_indexes == [0, 1, 2]
        assert await aclient.async_ack(again) is None
        await aclient.async_close()

    asyncio.run(main())


def test_async_user_samplers_racing_on_one_loop_never_share_a_sample(aclient):
    """Coroutines whose samplers choose among the same few ids lose choices to each other; the
    losers pause on the loop (not blocking it) and retry, and every sample goes out exactly once."""
    import random

    from tq_redis.samplers import BaseSampler

    class Contended(BaseSampler):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.rng, self.calls = random.Random(seed), 0

        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            self.calls += 1
            chosen = self.rng.sample(ready_indexes[: 3 * batch_size], batch_size)
            return chosen, chosen

    async def consumer(seed: int) -> tuple[list[int], int, int]:
        sampler, seen, batches = Contended(seed), [], 0
        while True:
            meta = await aclient.async_get_meta(["x"], 4, "r", task_name="t", sampling_config={"sampler": sampler})
            if not meta.size:
                return seen, batches, sampler.calls
            seen.extend(meta.global_indexes)
            batches += 1

    async def main():
        await aclient.async_put(TensorDict({"x": torch.arange(240)}, batch_size=[240]), partition_id="r")
        results = await asyncio.wait_for(asyncio.gather(*(consumer(s) for s in range(6))), 60)
        await aclient.async_close()
        return results

    results = asyncio.run(main())
    ids = sorted(i for seen, _, _ in results for i in seen)
    assert ids == list(range(240))  # nothing duplicated, nothing lost
    batches, calls = sum(r[1] for r in results), sum(r[2] for r in results)
    assert batches == 60
    assert calls > batches  # choices were lost and retried
