"""get_meta(timeout=...) blocks on a wake-token list of its task and wakes when data lands."""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from tensordict import TensorDict

from tests.conftest import make_client


def _blocked(client) -> int:
    """How many connections of the server are blocked waiting for a wake token (BLPOP)."""
    return sum(e.get("cmd") == "blpop" and "b" in e.get("flags", "") for e in client.redis.client_list())


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)  # polling an observable condition, not synchronising on time
    return False


def test_waiting_get_meta_wakes_up_on_put(real_server, namespace):
    producer = make_client(real_server.url, namespace)
    consumer = make_client(real_server.url, namespace)
    result: dict = {}

    def consume():
        result["meta"] = consumer.get_meta(["x"], 4, "p", task_name="t", timeout=20)
        result["returned"] = time.monotonic()

    thread = threading.Thread(target=consume)
    started = time.monotonic()
    thread.start()
    assert _wait_until(lambda: _blocked(producer) > 0, 5), "consumer never blocked waiting"
    assert "meta" not in result
    put_at = time.monotonic()
    producer.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id="p")
    thread.join(20)
    assert result["meta"].global_indexes == [0, 1, 2, 3]
    wake_up = result["returned"] - put_at
    assert 0 <= wake_up < 0.5, f"woke {wake_up:.3f}s after the put"
    assert result["returned"] - started < 10
    producer.close()
    consumer.close()


def test_waiting_consumer_does_not_delay_others(real_server, namespace):
    waiter = make_client(real_server.url, namespace)
    other = make_client(real_server.url, namespace)
    thread = threading.Thread(target=lambda: waiter.get_meta(["x"], 1, "q", task_name="t", timeout=3))
    thread.start()
    assert _wait_until(lambda: _blocked(other) > 0, 5)
    t0 = time.monotonic()
    meta = other.put(TensorDict({"y": torch.arange(2)}, batch_size=[2]), partition_id="elsewhere")
    other.get_data(other.get_meta(["y"], 2, "elsewhere", task_name="t"))
    assert time.monotonic() - t0 < 0.5
    assert meta.size == 2
    thread.join(10)
    waiter.close()
    other.close()


def test_timeout_expires_with_empty_batch(client):
    t0 = time.monotonic()
    meta = client.get_meta(["x"], 2, "never", task_name="t", timeout=0.3)
    elapsed = time.monotonic() - t0
    assert meta.size == 0
    assert 0.25 <= elapsed < 2.0


def test_waiter_wakes_when_lease_lapses(real_client):
    real_client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
    leased = real_client.get_meta(["x"], 2, "p", task_name="t", lease_s=0.3)
    assert leased.size == 2
    t0 = time.monotonic()
    again = real_client.get_meta(["x"], 2, "p", task_name="t", timeout=5)
    assert again.global_indexes == [0, 1]
    assert time.monotonic() - t0 < 2.0


def _fcalls(client) -> int:
    return int(client.redis.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0))


@contextlib.contextmanager
def _waiting_consumers(server, namespace: str, n: int):
    """A producer client and ``got``: ``n`` consumer threads each blocked in ``get_meta`` for one
    sample of task ``t`` in partition ``p`` (``got[i]``: the ids consumer ``i`` got, None before)."""
    producer = make_client(server.url, namespace)
    consumers = [make_client(server.url, namespace) for _ in range(n)]
    got: list = [None] * n

    def consume(i: int) -> None:
        got[i] = consumers[i].get_meta(["x"], 1, "p", task_name="t", timeout=30).global_indexes

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        assert _wait_until(lambda: _blocked(producer) == n, 10), "the consumers never all waited"
        yield producer, got
        for t in threads:
            t.join(10)
        assert sorted(i for g in got for i in g) == list(range(n))  # each sample to exactly one consumer
    finally:
        for c in [producer, *consumers]:
            c.close()


def test_each_put_wakes_one_waiting_consumer_not_all(real_server, namespace):
    """16 consumers wait on one task; 16 single-sample puts hand each exactly one sample, and the
    server runs O(puts) scripts (waking every waiter on every put is O(puts x waiters) claims)."""
    n = 16
    with _waiting_consumers(real_server, namespace, n) as (producer, got):
        before = _fcalls(producer)
        for k in range(n):
            producer.put(TensorDict({"x": torch.tensor([k])}, batch_size=[1]), partition_id="p")
            assert _wait_until(lambda k=k: sum(g is not None for g in got) == k + 1, 10), f"put {k} woke no one"
        calls = _fcalls(producer) - before
    # per put: reserve + insert and the woken consumer's claim, 3 (measured: 48 for 16 puts). The
    # claim takes the task's last sample, so it passes no baton: one did (64 for 16 puts, a
    # claim in vain per put), and waking every waiter on every put took 103 for just 12.
    assert calls <= 3 * n + n // 4, f"{calls} script calls for {n} puts: consumers are woken in vain or in a herd"


def test_one_put_of_several_samples_reaches_every_waiter_through_the_baton(real_server, namespace):
    """The put wakes one waiter; each claim that leaves samples behind wakes the next, so all four
    waiters get one sample each from a single put, well before their timeout."""
    n = 4
    with _waiting_consumers(real_server, namespace, n) as (producer, got):
        producer.put(TensorDict({"x": torch.arange(n)}, batch_size=[n]), partition_id="p")
        assert _wait_until(lambda: all(g is not None for g in got), 10), f"waiters left without a sample: {got}"


def test_samples_too_few_for_the_first_waiter_go_to_one_that_wants_fewer(real_server, namespace):
    producer = make_client(real_server.url, namespace)
    big, small = make_client(real_server.url, namespace), make_client(real_server.url, namespace)
    got: dict = {}

    def wait_for(name: str, client, batch: int) -> threading.Thread:
        def run() -> None:
            got[name] = client.get_meta(["x"], batch, "m", task_name="t", timeout=30)

        return threading.Thread(target=run)

    wants_four, wants_one = wait_for("big", big, 4), wait_for("small", small, 1)
    wants_four.start()
    assert _wait_until(lambda: _blocked(producer) == 1, 10)
    wants_one.start()  # blocks behind the first: the first wake token goes to the batch of 4
    assert _wait_until(lambda: _blocked(producer) == 2, 10)
    producer.put(TensorDict({"x": torch.tensor([0])}, batch_size=[1]), partition_id="m")
    assert _wait_until(lambda: "small" in got, 10), "the one ready sample never reached the waiter wanting one"
    assert got["small"].global_indexes == [0] and "big" not in got
    producer.put(TensorDict({"x": torch.arange(1, 5)}, batch_size=[4]), partition_id="m")
    wants_four.join(10)
    assert got["big"].global_indexes == [1, 2, 3, 4]
    for c in (producer, big, small):
        c.close()


def test_a_wait_longer_than_redis_pys_socket_timeout_returns_empty_in_time(real_server, namespace):
    """redis-py 8 reads with a 5 s socket timeout by default: a 6 s get_meta wait must not be cut
    into a ConnectionFailed (it was, after ~70 s of retries)."""
    client = make_client(real_server.url, namespace)
    try:
        started = time.monotonic()
        meta = client.get_meta(["x"], 1, "idle", task_name="t", timeout=6.0)
        waited = time.monotonic() - started
        assert meta.size == 0 and 5.9 <= waited < 9, waited
    finally:
        client.close()


def _blocked_in_get_meta(target, observer) -> threading.Thread:
    """``target`` (a consumer's get_meta) started in a thread, once ``observer``'s server shows it blocked."""
    thread = threading.Thread(target=target)
    thread.start()
    assert _wait_until(lambda: _blocked(observer) > 0, 10), "consumer never blocked waiting"
    return thread


def test_a_woken_consumer_claims_in_the_round_trip_of_its_wait(real_server, namespace):
    """After the first claim finds nothing, the wait's BLPOP and the next claim go out in one
    write on the lane (the server runs the claim as the wait ends): no BLPOP of its own."""
    producer = make_client(real_server.url, namespace)
    consumer = make_client(real_server.url, namespace)
    consumer.get_partition_list()  # a client's first call learns the namespace's epoch (server.identity) first
    lane = consumer.redis
    sent: list[list[str]] = []
    real_pipeline = lane.pipeline_on_lane

    def recording(commands):
        sent.append([str(c[0]) if c[0] != "FCALL" else f"FCALL {c[1]}" for c in commands])
        return real_pipeline(commands)

    def no_blpop(*args, **kwargs):
        raise AssertionError("the wait went out on its own, not with the claim behind it")

    lane.pipeline_on_lane = recording
    lane.blpop = no_blpop
    got: dict = {}
    try:
        thread = _blocked_in_get_meta(
            lambda: got.setdefault("meta", consumer.get_meta(["x"], 1, "p", task_name="t", timeout=20)), producer
        )
        producer.put(TensorDict({"x": torch.tensor([7])}, batch_size=[1]), partition_id="p")
        thread.join(20)
        assert got["meta"].global_indexes == [0]
        assert sent == [["BLPOP", "FCALL tq_claim"]]
        assert consumer.get_data(got["meta"])["x"].tolist() == [7]
    finally:
        producer.close()
        consumer.close()


def test_a_wait_that_times_out_leaves_no_waiter_registered(real_client):
    """The claim sent behind the last wait registers the consumer again (for the time left before
    that wait); get_meta takes it back when it returns empty, so no wake token goes to no one."""
    from tq_redis.meta.keys import PartitionKeys

    meta = real_client.get_meta(["x"], 1, "idle", task_name="t", timeout=0.3)
    assert meta.size == 0
    waiters = PartitionKeys(real_client.namespace, "idle").waiters("t")
    assert real_client.redis.zcard(waiters) == 0


def test_a_lease_taken_after_a_wait_runs_from_the_claim_not_from_before_the_wait(real_server, namespace):
    """A claim's clock argument is taken when it is built: a leasing claim is not sent behind the
    wait, so a lease granted after a wait still lasts its full length."""
    from tq_redis.meta.keys import PartitionKeys

    producer = make_client(real_server.url, namespace)
    consumer = make_client(real_server.url, namespace)
    got: dict = {}
    try:
        thread = _blocked_in_get_meta(
            lambda: got.setdefault("meta", consumer.get_meta(["x"], 1, "p", task_name="t", timeout=20, lease_s=5)),
            producer,
        )
        blocked_at = time.time()
        while time.time() < blocked_at + 0.5:  # age the clock the consumer had before its wait
            time.sleep(0.05)
        put_ms = time.time() * 1000
        producer.put(TensorDict({"x": torch.tensor([1])}, batch_size=[1]), partition_id="p")
        thread.join(20)
        assert got["meta"].global_indexes == [0]
        deadline = producer.redis.zscore(PartitionKeys(namespace, "p").lease("t"), 0)
        assert deadline is not None and deadline >= put_ms + 5000 - 50, (deadline, put_ms)
    finally:
        producer.close()
        consumer.close()


def test_a_claim_behind_a_wait_reloads_a_library_the_server_lost(real_server, namespace):
    """FUNCTION FLUSH while a consumer waits: the claim that follows its wake finds no library,
    loads it and claims again, and the consumer carries on waiting instead of failing."""
    import redis

    from tq_redis.meta.keys import PartitionKeys

    consumer, observer = make_client(real_server.url, namespace), make_client(real_server.url, namespace)
    admin = redis.Redis.from_url(real_server.url)
    got: dict = {}
    try:
        thread = _blocked_in_get_meta(
            lambda: got.setdefault("meta", consumer.get_meta(["x"], 1, "lost", task_name="t", timeout=1.5)), observer
        )
        admin.function_flush()
        admin.rpush(PartitionKeys(namespace, "lost").wake("t"), "1")  # wake it with nothing to claim
        thread.join(20)
        assert got["meta"].size == 0
        libraries = [entry[entry.index(b"library_name") + 1] for entry in admin.function_list()]
        assert libraries == [b"tq_redis"]
    finally:
        admin.close()
        consumer.close()
        observer.close()
