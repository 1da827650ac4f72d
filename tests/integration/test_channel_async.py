"""Channel calls through one object run in issue order on one background thread, bounded in
connections, and a put issued with ``async_op=True`` is never lost: it lands even if nobody waits on
it, on close, on garbage collection and at process exit, and its error surfaces."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import redis

from tests.procs import mp_context
from tq_redis import Channel
from tq_redis.channel.in_redis import MAX_CONNECTIONS as _MAX_CONNECTIONS
from tq_redis.errors import ChannelClosed, ChannelNotFound, InvalidArgument, UnsupportedValue

ROOT = Path(__file__).resolve().parents[2]


def _create(server, namespace, name, **kw) -> Channel:
    return Channel.create(name, redis_url=server.url, namespace=namespace, **kw)


def _connect(server, namespace, name) -> Channel:
    return Channel.connect(name, redis_url=server.url, namespace=namespace)


def _connections(observer: redis.Redis, namespace: str, name: str) -> list[dict]:
    """The server's connections that belong to handles of channel ``name``."""
    return [c for c in observer.client_list() if c.get("name") == f"tq-channel:{namespace}:{name}"]


def test_thousand_fire_and_forget_puts_all_land_in_issue_order(real_server, namespace):
    observer = redis.Redis.from_url(real_server.url)
    ch = _create(real_server, namespace, "ff")
    for i in range(1000):
        ch.put({"i": i}, key="stress", async_op=True)  # the handle is dropped at once
    assert len(_connections(observer, namespace, "ff")) <= _MAX_CONNECTIONS + 1
    reader = _connect(real_server, namespace, "ff")
    works = [reader.get(key="stress", async_op=True) for _ in range(1000)]
    assert len(_connections(observer, namespace, "ff")) <= 2 * (_MAX_CONNECTIONS + 1)
    assert [w.wait(60)["i"] for w in works] == list(range(1000))  # all landed, FIFO, issue order
    assert reader.qsize("stress") == 0
    ch.close()
    reader.close()
    observer.close()


def test_calls_of_one_object_run_in_issue_order(server, namespace):
    ch = _create(server, namespace, "order")
    ch.put("a", async_op=True)
    first = ch.get(async_op=True)
    ch.put("b", async_op=True)
    second = ch.get(async_op=True)
    assert ch.qsize() == 0  # a sync call runs after every call issued before it
    ch.put("c", async_op=True)
    assert ch.qsize() == 1
    assert (first.wait(5), second.wait(5), ch.get_nowait()) == ("a", "b", "c")

    async def interleaved():
        for i in range(50):
            ch.put(i, weight=1, async_op=True)
        gets = [ch.get(async_op=True) for _ in range(20)]
        batch = ch.get_batch(30, async_op=True)
        return await asyncio.gather(*(g.async_wait() for g in gets)), await batch.async_wait()

    singles, batch = asyncio.run(interleaved())
    assert singles == list(range(20)) and batch == list(range(20, 50))
    ch.close()


def test_a_waiting_get_does_not_hold_up_later_calls(server, namespace):
    ch = _create(server, namespace, "ood")
    later = ch.get(key="q2", async_op=True)  # nothing there yet: it waits
    ch.put("hello", key="q1")
    assert ch.get(key="q1", async_op=True).wait(5) == "hello"
    assert not later.done()
    ch.put("world", key="q2", async_op=True)  # the same object wakes its own waiting get
    assert later.wait(5) == "world"
    ch.close()


def test_waiting_gets_of_one_key_are_served_in_issue_order(server, namespace):
    ch = _create(server, namespace, "fifo")
    singles = [ch.get(key=7, async_op=True) for _ in range(3)]
    batch = ch.get_batch(2, key=7, async_op=True)  # queues behind the three gets
    producer = _connect(server, namespace, "fifo")
    for i in range(5):
        producer.put(i, weight=1, key=7)
    assert [w.wait(5) for w in singles] == [0, 1, 2]
    assert batch.wait(5) == [3, 4]
    ch.close()
    producer.close()


def test_many_waiting_gets_share_one_blocked_connection(real_server, namespace):
    observer = redis.Redis.from_url(real_server.url)
    ch = _create(real_server, namespace, "many")
    works = [ch.get(key=("session", i), async_op=True) for i in range(300)]
    assert ch.qsize() == 0  # runs after each get had its turn: all 300 are waiting now
    conns = _connections(observer, namespace, "many")
    assert len(conns) <= _MAX_CONNECTIONS + 1
    assert sum(c.get("cmd") == "xread" for c in conns) == 1
    producer = _connect(real_server, namespace, "many")
    for i in reversed(range(300)):
        producer.put(i, key=("session", i))
    assert [w.wait(10) for w in works] == list(range(300))
    ch.close()
    producer.close()
    observer.close()


def test_errors_surface_on_wait_and_async_wait(server, namespace):
    ch = _create(server, namespace, "err", maxsize=1)
    ch.put(1)
    late = ch.put(2, async_op=True, timeout=0.1)
    with pytest.raises(TimeoutError):
        late.wait(5)
    assert ch.qsize() == 1

    async def get_missing():
        return await ch.get(key="none", async_op=True, timeout=0.05).async_wait()

    with pytest.raises(TimeoutError):
        asyncio.run(get_missing())
    _connect(server, namespace, "err").delete()
    with pytest.raises(ChannelNotFound):
        ch.put("x", async_op=True).wait(5)
    with pytest.raises(ChannelNotFound):
        ch.get(async_op=True).wait(5)
    ch.close()


def test_a_failed_put_nobody_waited_for_is_logged_and_raised_by_close(server, namespace, caplog):
    ch = _create(server, namespace, "gone")
    _connect(server, namespace, "gone").delete()
    with caplog.at_level(logging.ERROR, logger="tq_redis.channel"):
        ch.put("never queued", async_op=True)  # handle dropped
        with pytest.raises(ChannelNotFound):
            ch.close()
    assert any("nobody waited" in r.getMessage() for r in caplog.records)


def test_bad_input_raises_at_the_call_even_with_async_op(server, namespace):
    ch = _create(server, namespace, "bad")
    with pytest.raises(InvalidArgument):
        ch.put("x", weight=-1, async_op=True)
    with pytest.raises(UnsupportedValue):
        ch.put(object(), async_op=True)
    with pytest.raises(InvalidArgument):
        ch.get(key=["unhashable"], async_op=True)
    with pytest.raises(InvalidArgument):
        ch.get_batch(-1, async_op=True)
    with pytest.raises(InvalidArgument):
        ch.put(1, async_op=True, timeout=-1)
    value = {"v": 1}
    ch.put(value, async_op=True)
    value["v"] = 2  # the item was captured when put() was called
    assert ch.get() == {"v": 1}
    assert ch.qsize() == 0
    ch.close()


def test_close_lands_pending_puts_and_fails_waiting_gets(server, namespace):
    ch = _create(server, namespace, "cl", maxsize=2)
    consumer = _connect(server, namespace, "cl")
    waiting_get = ch.get(key="other", async_op=True)
    for i in range(6):
        ch.put(i, async_op=True)  # four of them wait for room
    closer = threading.Thread(target=ch.close)
    closer.start()
    assert [consumer.get(timeout=10) for _ in range(6)] == list(range(6))
    closer.join(10)
    assert not closer.is_alive()
    with pytest.raises(ChannelClosed):
        waiting_get.wait(5)
    with pytest.raises(ChannelClosed):
        ch.put("after close")
    assert consumer.qsize() == 0 and consumer.qsize("other") == 0
    consumer.close()


def test_close_timeout_leaves_the_put_landing_later(server, namespace):
    ch = _create(server, namespace, "clt", maxsize=1)
    ch.put("first")
    pending = ch.put("second", async_op=True)
    with pytest.raises(TimeoutError):
        ch.close(timeout=0.2)
    consumer = _connect(server, namespace, "clt")
    assert consumer.get(timeout=5) == "first"
    assert consumer.get(timeout=10) == "second"
    assert pending.wait(5) is None
    ch.close()
    consumer.close()


def test_a_garbage_collected_handle_still_lands_its_puts(server, namespace):
    def produce():
        ch = _create(server, namespace, "gc")
        for i in range(100):
            ch.put(i, async_op=True)

    produce()
    gc.collect()
    reader = _connect(server, namespace, "gc")
    assert [reader.get(timeout=10) for _ in range(100)] == list(range(100))
    reader.close()


PRODUCERS, PER_PRODUCER = 3, 300


def _fire_and_forget_producer(url: str, ns: str, rank: int, go) -> None:
    ch = Channel.connect("xp", redis_url=url, namespace=ns)
    go.wait()
    for i in range(PER_PRODUCER):
        ch.put((rank, i), weight=1, key=f"k{i % 2}", async_op=True)
    # returns without wait() or close(): the exit hook must land everything (the queue is small)


def _key_consumer(url: str, ns: str, key: str, count: int, go, out) -> None:
    ch = Channel.connect("xp", redis_url=url, namespace=ns)
    go.wait()
    got = [tuple(ch.get(key=key, timeout=60)) for _ in range(count)]
    out.put((key, got))
    ch.close()


def test_producer_processes_fire_and_forget_nothing_lost_nothing_duplicated(real_server, namespace):
    Channel.create("xp", maxsize=8, redis_url=real_server.url, namespace=namespace).close()
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    per_key = PRODUCERS * PER_PRODUCER // 2
    producers = [ctx.Process(target=_fire_and_forget_producer, args=(real_server.url, namespace, r, go))
                 for r in range(PRODUCERS)]
    consumers = [ctx.Process(target=_key_consumer, args=(real_server.url, namespace, k, per_key, go, out))
                 for k in ("k0", "k1")]
    for p in producers + consumers:
        p.start()
    go.set()
    results = dict(out.get(timeout=120) for _ in consumers)
    for p in producers + consumers:
        p.join(60)
        assert p.exitcode == 0
    everything = results["k0"] + results["k1"]
    assert len(everything) == len(set(everything)) == PRODUCERS * PER_PRODUCER  # none lost, none twice
    assert set(everything) == {(r, i) for r in range(PRODUCERS) for i in range(PER_PRODUCER)}
    for key, got in results.items():
        for rank in range(PRODUCERS):  # each producer's items arrive in the order it issued them
            seq = [i for r, i in got if r == rank]
            assert seq == sorted(seq) and all(i % 2 == int(key[1]) for i in seq)
    check = Channel.connect("xp", redis_url=real_server.url, namespace=namespace)
    assert check.qsize("k0") == check.qsize("k1") == 0
    check.close()


def test_interpreter_exit_lands_fire_and_forget_puts(real_server, namespace):
    Channel.create("exit", maxsize=4, redis_url=real_server.url, namespace=namespace).close()
    script = textwrap.dedent(f"""
        from tq_redis import Channel
        ch = Channel.connect("exit", redis_url={real_server.url!r}, namespace={namespace!r})
        for i in range(200):
            ch.put(i, async_op=True)
        print("issued", flush=True)
    """)  # no wait(), no close(): the interpreter's exit must wait until all 200 landed
    env = {k: v for k, v in os.environ.items() if k not in ("TQ_REDIS_URL", "TQ_NAMESPACE")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "issued"
        consumer = Channel.connect("exit", redis_url=real_server.url, namespace=namespace)
        assert [consumer.get(timeout=30) for _ in range(200)] == list(range(200))
        assert proc.wait(60) == 0
        assert consumer.qsize() == 0
        consumer.close()
    finally:
        if proc.poll() is None:
            proc.kill()
