"""One client shared by more callers than redis-py's default pool holds (100 connections in redis-py
8): 150 threads of one blocking client, or 150 coroutines of one asyncio client, each blocked in a
``get_meta`` wait (which holds a connection while it waits), are all served once the data comes --
none fails with "Too many connections" (as a dock in a Ray actor with ``max_concurrency=100``
did, its waiting reads and the lane together passing 100)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis import AsyncTransferQueueClient

WAITERS = 150
TIMEOUT_S = 120.0


def _blocked_in_waits(client, count: int) -> bool:
    """Whether ``count`` connections of this server are blocked (the waits are in the server)."""
    return sum(1 for e in client.redis.client_list() if "b" in e.get("flags", "")) >= count


def _until(condition, what: str) -> None:
    import time

    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.02)


def test_150_threads_of_one_client_wait_and_are_all_served(real_server, namespace):
    client = make_client(real_server.url, namespace)
    admin = make_client(real_server.url, namespace)
    released = threading.Barrier(WAITERS + 1, timeout=TIMEOUT_S)

    def wait(k: int) -> list[int]:
        released.wait()
        return client.get_meta(["x"], 1, "p", task_name=f"task{k}", timeout=TIMEOUT_S).global_indexes

    try:
        with ThreadPoolExecutor(max_workers=WAITERS) as pool:
            futures = [pool.submit(wait, k) for k in range(WAITERS)]
            released.wait()
            _until(lambda: _blocked_in_waits(admin, WAITERS) or any(f.done() for f in futures),
                   f"{WAITERS} waits blocked in the server")
            admin.put(TensorDict({"x": torch.arange(1)}, batch_size=[1]), partition_id="p")
            got = [f.result(timeout=TIMEOUT_S) for f in futures]
        assert got == [[0]] * WAITERS  # every task's waiter got the sample: none lost, none raised
    finally:
        client.close()
        admin.close()


def test_150_coroutines_of_one_async_client_wait_and_are_all_served(real_server, namespace):
    make_client(real_server.url, namespace).close()
    admin = make_client(real_server.url, namespace)

    async def main() -> list[list[int]]:
        client = AsyncTransferQueueClient(real_server.url, namespace)
        try:
            waits = [asyncio.ensure_future(client.async_get_meta(["x"], 1, "p", task_name=f"task{k}",
                                                                 timeout=TIMEOUT_S)) for k in range(WAITERS)]
            while not _blocked_in_waits(admin, WAITERS):
                assert not any(w.done() for w in waits), [w.exception() for w in waits if w.done()][:1]
                await asyncio.sleep(0.02)
            await asyncio.to_thread(admin.put, TensorDict({"x": torch.arange(1)}, batch_size=[1]), partition_id="p")
            return [m.global_indexes for m in await asyncio.wait_for(asyncio.gather(*waits), TIMEOUT_S)]
        finally:
            await client.async_close()

    try:
        assert asyncio.run(main()) == [[0]] * WAITERS
    finally:
        admin.close()
