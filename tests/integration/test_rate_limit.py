"""The samples-per-insert rate limiter (issue 34, item 4), on every server flavour: producers ahead
of the ratio wait until a claim wakes them, consumers ahead of it find nothing until an insert
wakes them, across processes, and the counts never leave the window at any moment."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis.errors import InvalidArgument, InvalidName, RateLimited
from tq_redis.meta.keys import PartitionKeys
from tq_redis.monitor.status import render, snapshot
from tq_redis.samplers import BaseSampler

DEADLINE_S = 120.0
TASK = "train"


def _row(i: int) -> TensorDict:
    return TensorDict({"x": torch.tensor([i])}, batch_size=[1])


def _wait_until(check, what: str, deadline_s: float = DEADLINE_S) -> None:
    """Wait (on a condition, not a sleep) until ``check()`` holds."""
    end = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < end, f"timed out waiting until {what}"
        time.sleep(0.01)


def _counts(client, pid: str = "p") -> tuple[int, int]:
    limit = client.get_rate_limit(pid, TASK)
    return limit.inserts, limit.samples


def _scrape(url: str, namespace: str) -> str:
    """What the exporter serves for the namespace now."""
    from prometheus_client import CollectorRegistry, generate_latest

    from tq_redis.monitor.exporter import NamespaceCollector

    registry = CollectorRegistry(auto_describe=False)
    collector = NamespaceCollector(url, namespace)
    registry.register(collector)
    try:
        return generate_latest(registry).decode()
    finally:
        collector.close()


def _producer(url: str, ns: str, n: int, batch: int, go, out) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    go.wait()
    ids: list[int] = []
    for i in range(n):
        rows = TensorDict({"x": torch.arange(i * batch, (i + 1) * batch)}, batch_size=[batch])
        ids += client.put(rows, partition_id="p").global_indexes
    out.put(("producer", ids))
    client.close()


def _consumer(url: str, ns: str, batch: int, want: int, timeout: float, config: dict, go, out) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    go.wait()
    got: list[int] = []
    while len(got) < want:
        meta = client.get_meta(["x"], batch, "p", task_name=TASK, timeout=timeout, sampling_config=config)
        if meta.size == 0:
            break
        got += meta.global_indexes
    out.put(("consumer", got))
    client.close()


def test_a_producer_ahead_of_the_ratio_waits_until_a_claim_wakes_it(server, namespace):
    client = make_client(server.url, namespace)
    pk = PartitionKeys(namespace, "p")
    # 1 sample per insert, from 2 inserts on, within 2: inserts - samples stays in [0, 4]
    limit = client.set_rate_limit("p", TASK, 1.0, min_size_to_sample=2, error_buffer=2, insert_timeout=DEADLINE_S)
    assert (limit.inserts, limit.samples, limit.error_buffer) == (0, 0, 2.0)
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    producer = ctx.Process(target=_producer, args=(server.url, namespace, 8, 1, go, out))
    producer.start()
    go.set()
    # the fifth put would take the producers 5 ahead: it waits, registered for a wake-up
    _wait_until(lambda: client.redis.zcard(pk.admitwaiters) == 1, "the producer waits")
    assert _counts(client) == (4, 0)
    # the operator sees why: tq-redis status shows the limiter, its balance and the waiting producer
    (part,) = snapshot(client.redis, namespace)["partitions"]
    assert part["rate_limits"] == {TASK: {"samples_per_insert": 1.0, "min_size_to_sample": 2, "error_buffer": 2.0,
                                          "inserts": 4, "samples": 0, "balance": 4.0, "window": [0.0, 4.0]}}
    assert part["producers_waiting"] == 1
    assert ("rate limit train: 1 samples per insert from 2 inserts: 4 inserts, 0 samples, balance 4 (kept in "
            "[0, 4]); producers waiting 1") in render(snapshot(client.redis, namespace))
    scraped = _scrape(server.url, namespace)
    labels = f'namespace="{namespace}",partition="p",task="{TASK}"'
    for metric, value in (("balance", 4.0), ("min_balance", 0.0), ("max_balance", 4.0), ("inserts", 4.0),
                          ("samples", 0.0)):
        assert f"tq_redis_rate_limit_{metric}{{{labels}}} {value}" in scraped, metric
    assert f'tq_redis_producers_waiting{{namespace="{namespace}",partition="p"}} 1.0' in scraped
    assert client.get_meta(["x"], 1, "p", task_name=TASK).global_indexes == [0]
    # that claim woke it: one more insert, then it waits again
    _wait_until(lambda: _counts(client) == (5, 1) and client.redis.zcard(pk.admitwaiters) == 1, "one more insert")
    got = [0]
    while len(got) < 8:
        meta = client.get_meta(["x"], 1, "p", task_name=TASK, timeout=DEADLINE_S)
        assert meta.size == 1, "a consumer within the window found nothing"
        got += meta.global_indexes
        inserts, samples = _counts(client)
        assert 0 <= inserts - samples <= 4
    producer.join(DEADLINE_S)
    assert producer.exitcode == 0
    assert out.get(timeout=DEADLINE_S) == ("producer", list(range(8)))
    assert got == list(range(8))
    assert client.redis.zcard(pk.admitwaiters) == 0
    client.close()


def _held_producer(url: str, ns: str, out) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    out.put(("producer", client.put(_row(9), partition_id="p").global_indexes))
    client.close()


def test_a_held_back_producer_killed_while_it_waits_leaves_nothing_behind(real_server, namespace):
    """SIGKILL a producer the limiter holds back: it wrote nothing, was never counted, and the next
    producer is still woken and admitted by a claim."""
    import os
    import signal

    client = make_client(real_server.url, namespace)
    pk = PartitionKeys(namespace, "p")
    client.set_rate_limit("p", TASK, 1.0, error_buffer=1, insert_timeout=DEADLINE_S)  # window [0, 2]
    client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
    ctx = mp_context()
    out = ctx.Queue()
    doomed = ctx.Process(target=_held_producer, args=(real_server.url, namespace, out))
    doomed.start()
    _wait_until(lambda: client.redis.zcard(pk.admitwaiters) == 1, "the first producer waits")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(DEADLINE_S)
    survivor = ctx.Process(target=_held_producer, args=(real_server.url, namespace, out))
    survivor.start()
    _wait_until(lambda: client.redis.zcard(pk.admitwaiters) == 2, "the second producer waits beside the dead one")
    assert _counts(client) == (2, 0), "a held-back put was counted"
    assert client.get_meta(["x"], 1, "p", task_name=TASK).global_indexes == [0]
    assert out.get(timeout=DEADLINE_S) == ("producer", [2])  # woken and admitted
    survivor.join(DEADLINE_S)
    assert survivor.exitcode == 0
    assert _counts(client) == (3, 1)
    assert client.get_meta(["x"], 10, "p", task_name="all", mode="force_fetch").global_indexes == [0, 1, 2]
    client.close()


def test_a_consumer_ahead_of_the_ratio_finds_nothing_until_inserts_wake_it(server, namespace):
    client = make_client(server.url, namespace)
    pk = PartitionKeys(namespace, "p")
    # from 3 inserts on, within 1: inserts - samples stays in [2, 4]
    client.set_rate_limit("p", TASK, 1.0, min_size_to_sample=3, error_buffer=1)
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    consumer = ctx.Process(target=_consumer, args=(server.url, namespace, 1, 5, DEADLINE_S, {}, go, out))
    consumer.start()
    go.set()
    client.put(_row(0), partition_id="p")
    client.put(_row(1), partition_id="p")
    # two samples are ready, but fewer than min_size_to_sample were inserted: it waits
    _wait_until(lambda: client.redis.zcard(pk.waiters(TASK)) == 1, "the consumer waits")
    assert _counts(client) == (2, 0)
    client.put(_row(2), partition_id="p")
    # the insert woke it: it took one (3 - 1 = 2), and the next would leave the window
    _wait_until(lambda: _counts(client) == (3, 1) and client.redis.zcard(pk.waiters(TASK)) == 1, "one claim")
    assert client.get_meta(["x"], 1, "p", task_name=TASK).size == 0, "a claim below the window was handed out"
    for i in range(3, 7):
        client.put(_row(i), partition_id="p")
    consumer.join(DEADLINE_S)
    assert consumer.exitcode == 0
    assert out.get(timeout=DEADLINE_S) == ("consumer", [0, 1, 2, 3, 4])
    assert _counts(client) == (7, 5)
    client.close()


def test_producers_and_replaying_consumers_stay_in_the_window_across_processes(server, namespace):
    """2 producers and 2 consumers race; 2 samples per insert (every sample replayed twice); an
    observer reads the counts all along: they never leave the window, nothing is lost and no
    sample is handed out more than twice."""
    client = make_client(server.url, namespace)
    ratio, min_size, buffer, batch = 2.0, 2, 3.0, 2
    client.set_rate_limit("p", TASK, ratio, min_size_to_sample=min_size, error_buffer=buffer)
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    puts = 15
    config = {"max_times_sampled": 2}
    procs = [ctx.Process(target=_producer, args=(server.url, namespace, puts, 1, go, out)) for _ in range(2)]
    procs += [
        ctx.Process(target=_consumer, args=(server.url, namespace, batch, 10**6, 3.0, config, go, out))
        for _ in range(2)
    ]
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            seen.append(_counts(client))

    observer = threading.Thread(target=observe)
    for p in procs:
        p.start()
    observer.start()
    go.set()
    results = [out.get(timeout=DEADLINE_S) for _ in procs]
    for p in procs:
        p.join(DEADLINE_S)
        assert p.exitcode == 0
    stop.set()
    observer.join()
    seen.append(_counts(client))
    inserted = [i for kind, ids in results if kind == "producer" for i in ids]
    handed = [i for kind, ids in results if kind == "consumer" for i in ids]
    assert sorted(inserted) == list(range(2 * puts)), "an insert was lost or doubled"
    assert max(Counter(handed).values()) <= 2, "a sample was handed out more than max_times_sampled times"
    assert set(handed) <= set(inserted)
    high = ratio * min_size + buffer  # single inserts: no batch overshoot
    low = min(ratio * min_size - buffer, high - ratio) - batch
    assert len(seen) > 10
    for inserts, samples in seen:
        assert low <= inserts * ratio - samples <= high, f"left the window at {inserts} inserts, {samples} samples"
        assert inserts >= min_size or samples == 0
    assert seen[-1] == (2 * puts, len(handed))
    # the consumers stopped only because the limiter held them back at the end
    assert 2 * puts * ratio - len(handed) < ratio * min_size - buffer + batch
    client.close()


@pytest.mark.parametrize("inline", [False, True], ids=["store", "inline"])
def test_every_way_in_is_held_back_and_raises_rate_limited_after_its_timeout(server, namespace, inline):
    client = make_client(server.url, namespace, inline_max_bytes=4096 if inline else 0)
    client.set_rate_limit("p", TASK, 1.0, min_size_to_sample=1, error_buffer=1, insert_timeout=0.2)
    client.put(_row(0), partition_id="p")
    client.put(_row(1), partition_id="p")  # inserts - samples = 2: the window's top
    started = time.monotonic()
    with pytest.raises(RateLimited, match="task 'train'.s rate limiter") as held:
        client.put(_row(2), partition_id="p")
    assert time.monotonic() - started >= 0.2
    assert (held.value.task, held.value.inserts, held.value.samples, held.value.timeout_s) == (TASK, 2, 0, 0.2)
    assert isinstance(held.value, TimeoutError)
    with pytest.raises(RateLimited):
        client.kv_put("k", "p", {"x": torch.tensor([2])})
    with pytest.raises(RateLimited):
        client.get_meta(["x"], 1, "p", task_name="writer", mode="insert")
    with pytest.raises(RateLimited, match=r"reserve_group\('p', n=1\)"):
        client.reserve_group("p", 1)
    assert client.get_data(client.get_meta(["x"], 2, "p", task_name="other")).batch_size[0] == 2
    assert _counts(client) == (2, 0), "a refused insert was counted"
    assert client.redis.zcard(PartitionKeys(namespace, "p").admitwaiters) == 0, "a refused producer stayed listed"
    # a claim makes room for one; removing the limiter lets everything in
    assert client.get_meta(["x"], 1, "p", task_name=TASK).size == 1
    client.put(_row(2), partition_id="p")
    with pytest.raises(RateLimited):
        client.put(_row(3), partition_id="p")
    assert client.set_rate_limit("p", TASK, None) is None
    assert client.get_rate_limit("p", TASK) is None
    client.put(TensorDict({"x": torch.arange(10)}, batch_size=[10]), partition_id="p")
    client.kv_put("k", "p", {"x": torch.tensor([2])})
    assert client.get_meta(["x"], 1, "p", task_name="writer", mode="insert").size == 1
    assert not client.redis.exists(PartitionKeys(namespace, "p").ratelimit)
    client.close()


def test_a_reservation_freed_without_its_commit_takes_back_its_count(server, namespace):
    client = make_client(server.url, namespace)
    client.set_rate_limit("p", TASK, 1.0, error_buffer=4)
    kept = client.reserve_group("p", 3)
    dropped = client.reserve_group("p", 2)
    assert _counts(client) == (5, 0)
    assert client.abort_group(dropped)
    assert _counts(client) == (3, 0)
    client.commit_group(kept, TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    assert _counts(client) == (3, 0)
    lapsing = client.reserve_group("p", 2, lease_s=0.05)
    assert _counts(client) == (5, 0)
    _wait_until(lambda: _server_ms(client) > lapsing.deadline_ms, "the lease lapses on the server's clock")
    client.reserve_group("p", 1)  # frees the lapsed one first, then counts itself
    assert _counts(client) == (4, 0)
    client.close()


def _server_ms(client) -> int:
    seconds, micros = client.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


class EveryOther(BaseSampler):
    """A user sampler (runs in the client): the even ids first."""

    def sample(self, ready_indexes, batch_size, **kwargs):
        chosen = sorted(ready_indexes, key=lambda i: (i % 2, i))[:batch_size]
        return chosen, chosen


def test_a_user_samplers_claim_is_held_back_and_woken_too(server, namespace):
    client = make_client(server.url, namespace)
    client.set_rate_limit("p", TASK, 1.0, min_size_to_sample=2, error_buffer=1)  # window [1, 3]
    client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
    config = {"sampler": EveryOther()}
    assert client.get_meta(["x"], 1, "p", task_name=TASK, sampling_config=config).global_indexes == [0]
    assert client.get_meta(["x"], 1, "p", task_name=TASK, sampling_config=config).size == 0  # 2 - 2 < 1
    assert _counts(client) == (2, 1)
    woken: list[list[int]] = []
    waiter = threading.Thread(target=lambda: woken.append(
        client.get_meta(["x"], 1, "p", task_name=TASK, sampling_config=config, timeout=DEADLINE_S).global_indexes))
    waiter.start()
    _wait_until(lambda: client.redis.zcard(PartitionKeys(namespace, "p").waiters(TASK)) == 1, "the claim waits")
    client.put(_row(2), partition_id="p")
    waiter.join(DEADLINE_S)
    assert woken == [[2]]
    assert _counts(client) == (3, 2)
    client.close()


def test_a_limiter_set_on_a_partition_with_data_counts_what_is_there(client):
    client.put(TensorDict({"x": torch.arange(6)}, batch_size=[6]), partition_id="p")
    client.get_meta(["x"], 2, "p", task_name=TASK)
    limit = client.set_rate_limit("p", TASK, 0.5, min_size_to_sample=4, error_buffer=1)
    assert (limit.inserts, limit.samples) == (6, 2)
    # 6 * 0.5 - 2 = 1 is the window's bottom (0.5 * 4 - 1): no claim, an insert is welcome
    assert client.get_meta(["x"], 1, "p", task_name=TASK).size == 0
    assert client.get_meta(["x"], 1, "p", task_name="other").size == 1  # other tasks are not limited
    client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
    assert client.get_meta(["x"], 1, "p", task_name=TASK).size == 1
    again = client.set_rate_limit("p", TASK, 0.5, min_size_to_sample=4, error_buffer=2, insert_timeout=None)
    assert (again.inserts, again.samples, again.insert_timeout_s) == (8, 3, None)
    assert client.get_rate_limit("p", TASK) == again
    client.clear_partition("p")  # the counts only grow, like the id counter
    assert _counts(client) == (8, 3)


def test_set_rate_limit_refuses_bad_arguments(client, namespace):
    for bad in (0, -1.0, float("nan"), float("inf"), "2", True, None.__class__):
        with pytest.raises(InvalidArgument, match="samples_per_insert must be a finite number > 0"):
            client.set_rate_limit("p", TASK, bad)
    with pytest.raises(InvalidArgument, match=r"error_buffer must be at least max\(1, samples_per_insert\) = 2"):
        client.set_rate_limit("p", TASK, 2.0, error_buffer=1.5)
    with pytest.raises(InvalidArgument, match="min_size_to_sample"):
        client.set_rate_limit("p", TASK, 1.0, min_size_to_sample=0)
    with pytest.raises(InvalidArgument, match="insert_timeout"):
        client.set_rate_limit("p", TASK, 1.0, insert_timeout=-1)
    with pytest.raises(InvalidName):
        client.set_rate_limit("p", "bad task\t", 1.0)
    assert client.get_rate_limit("p", TASK) is None
    assert not client.redis.keys(f"{namespace}:*ratelimit*"), "a refused configuration wrote something"


def test_rate_limit_calls_of_the_async_client_and_the_module_api(server, namespace):
    import tq_redis as tq
    from tq_redis import AsyncTransferQueueClient

    async def run():
        aclient = AsyncTransferQueueClient(server.url, namespace)
        limit = await aclient.async_set_rate_limit("p", TASK, 1.0, error_buffer=3)
        assert (await aclient.async_get_rate_limit("p", TASK)) == limit
        await aclient.async_close()

    asyncio.run(run())
    tq.init({"redis": {"url": server.url}, "namespace": namespace})
    try:
        assert tq.get_rate_limit("p", TASK).error_buffer == 3.0
        assert tq.set_rate_limit("p", TASK, None) is None
        assert tq.get_rate_limit("p", TASK) is None
    finally:
        tq.close()
