"""Channel (RLinf's queue): FIFO per key across processes, weights, back-pressure, async handles."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis import Channel
from tq_redis.errors import ChannelNotFound, InvalidArgument, UnsupportedValue
from tq_redis.meta.keys import ChannelKeys


def _blocked(client) -> bool:
    """True while some connection is blocked in XREAD (a waiting put or get)."""
    return any(e.get("cmd") == "xread" and "b" in e.get("flags", "") for e in client.redis.client_list())


def _until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)  # polling an observable condition, not synchronising on time
    return False


@pytest.fixture
def chan_client(server, namespace):
    client = make_client(server.url, namespace)
    yield client
    client.close()


def test_fifo_per_key_nowait_errors_and_sizes(server, namespace, chan_client):
    ch = Channel.create("c", maxsize=3, redis_url=server.url, namespace=namespace)
    assert ch.maxsize == 3 and ch.empty()
    for i in range(3):
        ch.put({"i": i, "s": "x" * i})
    ch.put("other", key="k2")
    assert (ch.qsize(), ch.qsize("k2"), ch.full(), ch.full("k2")) == (3, 1, True, False)
    with pytest.raises(asyncio.QueueFull):
        ch.put_nowait("too many")
    assert [ch.get()["i"] for _ in range(2)] + [ch.get_nowait()["i"]] == [0, 1, 2]
    assert ch.get(key="k2") == "other"
    with pytest.raises(asyncio.QueueEmpty):
        ch.get_nowait()
    with pytest.raises(TimeoutError):
        ch.get(timeout=0.05)
    with pytest.raises(UnsupportedValue):  # not encodable without pickle, and nothing is queued
        ch.put(object())
    assert ch.empty()
    ch.close()


def test_get_batch_takes_what_fits_the_target_weight(server, namespace, chan_client):
    ch = Channel.create("w", redis_url=server.url, namespace=namespace)
    for i, w in enumerate([1, 2, 0.5, 3, 1]):
        ch.put(i, weight=w)
    assert ch.get_batch(3) == [0, 1]  # 1 + 2 reaches 3
    assert ch.get_batch(3.2) == [2]  # 0.5 + 3 would overshoot 3.2: stop before it
    assert ch.get_batch(2) == []  # the head (3) alone is heavier than 2: nothing is taken
    with pytest.raises(TimeoutError):
        ch.get_batch(5, timeout=0.05)  # 3 + 1 fit but do not reach 5: nothing is popped
    assert ch.qsize() == 2
    ch.put(5, weight=1)
    assert ch.get_batch(5) == [3, 4, 5]
    with pytest.raises(InvalidArgument):
        ch.get_batch(-1)
    with pytest.raises(InvalidArgument):
        ch.put("x", weight=-1)
    ch.close()


def test_get_batch_allow_exceed_takes_the_fewest_that_reach(server, namespace, chan_client):
    ch = Channel.create("wx", redis_url=server.url, namespace=namespace)
    for i, w in enumerate([1, 2, 0.5, 3, 1]):
        ch.put(i, weight=w)
    assert ch.get_batch(3, allow_exceed=True) == [0, 1]
    assert ch.get_batch(3.2, allow_exceed=True) == [2, 3]  # 0.5 + 3 exceeds 3.2
    with pytest.raises(TimeoutError):
        ch.get_batch(2, timeout=0.05, allow_exceed=True)  # only weight 1 queued
    with pytest.raises(InvalidArgument):
        ch.get_batch(0, allow_exceed=True)
    assert ch.get_nowait() == 4
    ch.close()


def test_tensors_go_through_the_data_plane(server, namespace, chan_client):
    ch = Channel.create("t", redis_url=server.url, namespace=namespace)
    big = torch.arange(4096, dtype=torch.float32).view(64, 64)
    td = TensorDict({"x": torch.ones(2, 3), "nested": {"y": torch.arange(2)}, "s": ["a", "b"]}, [2])
    ch.put(big, weight=1)
    ch.put(td, weight=1)
    ch.put(TensorDict({"z": torch.zeros(3)}, []), weight=1)
    entries = chan_client.redis.lrange(ChannelKeys(namespace, "t").queue("default_queue"), 0, -1)
    assert max(len(e) for e in entries) < 500  # references only; the bytes are in the store
    assert len(list(chan_client.redis.scan_iter(match=f"{namespace}:*:d:*"))) > 0
    got_big, got_td, got_scalar_td = ch.get_batch(3)  # weights 1 + 1 + 1
    assert torch.equal(got_big, big)
    assert torch.equal(got_td["x"], td["x"]) and torch.equal(got_td["nested", "y"], td["nested", "y"])
    assert got_td["s"] == ["a", "b"] and got_td.batch_size == torch.Size([2])
    assert got_scalar_td.batch_size == torch.Size([]) and torch.equal(got_scalar_td["z"], torch.zeros(3))
    assert list(chan_client.redis.scan_iter(match=f"{namespace}:*:d:*")) == []  # read, then deleted
    ch.delete()
    left = [k for k in chan_client.redis.scan_iter(match=f"{namespace}:chan:*") if b":rq:" not in k]
    assert left == []  # but the calls' request records, which expire by themselves
    ch.close()


def test_blocking_put_waits_for_space_and_async_handles(real_server, namespace):
    observer = make_client(real_server.url, namespace)
    ch = Channel.create("bp", maxsize=1, redis_url=real_server.url, namespace=namespace)
    ch.put("first")
    work = ch.put("second", async_op=True)
    assert _until(lambda: _blocked(observer)), "the put never blocked on the gets stream"
    assert not work.done()
    assert ch.get() == "first"
    assert work.wait(5) is None
    assert ch.get() == "second"

    async def main():
        pending = ch.get(async_op=True)
        assert _until(lambda: _blocked(observer))
        ch.put("third")
        return await pending.async_wait()

    assert asyncio.run(main()) == "third"
    observer.close()
    ch.close()


def test_create_connect_and_pickle(server, namespace, chan_client):
    with pytest.raises(ChannelNotFound):
        Channel.connect("nobody", redis_url=server.url, namespace=namespace)
    ch = Channel.create("c", maxsize=2, redis_url=server.url, namespace=namespace)
    with pytest.raises(InvalidArgument, match="maxsize=2"):
        Channel.create("c", maxsize=5, redis_url=server.url, namespace=namespace)
    other = Channel.connect("c", redis_url=server.url, namespace=namespace)
    assert other.maxsize == 2
    copy = pickle.loads(pickle.dumps(ch))
    copy.put("via copy")
    assert other.get() == "via copy"
    for c in (ch, other, copy):
        c.close()


PRODUCERS, ITEMS, CONSUMERS = 3, 40, 3


def _produce(url: str, ns: str, rank: int, go) -> None:
    ch = Channel.connect("mp", redis_url=url, namespace=ns)
    go.wait()
    for i in range(ITEMS):
        ch.put((rank, i), weight=1, key=f"k{i % 2}")
    ch.close()


def _consume(url: str, ns: str, go, out, taken) -> None:
    """Take batches until all PRODUCERS * ITEMS items are taken (counted across consumers in ``taken``).

    A get that times out only lets the loop look at the count again: an empty queue on a slow machine
    is no sign that the producers are done.
    """
    ch = Channel.connect("mp", redis_url=url, namespace=ns)
    go.wait()
    got = []
    deadline = time.monotonic() + 120  # decides failure only: the test's assertion then names what is missing
    while taken.value < PRODUCERS * ITEMS and time.monotonic() < deadline:
        for key in ("k0", "k1"):
            try:
                batch = [tuple(x) for x in ch.get_batch(2, key=key, timeout=0.2)]
            except TimeoutError:
                continue
            got.extend(batch)
            with taken.get_lock():
                taken.value += len(batch)
    out.put(got)
    ch.close()


def test_many_processes_fifo_per_key_exactly_once_with_backpressure(real_server, namespace):
    make_client(real_server.url, namespace).close()
    Channel.create("mp", maxsize=4, redis_url=real_server.url, namespace=namespace).close()
    ctx = mp_context()
    go, out, taken = ctx.Event(), ctx.Queue(), ctx.Value("i", 0)
    procs = [ctx.Process(target=_produce, args=(real_server.url, namespace, r, go)) for r in range(PRODUCERS)]
    procs += [ctx.Process(target=_consume, args=(real_server.url, namespace, go, out, taken)) for _ in range(CONSUMERS)]
    for p in procs:
        p.start()
    go.set()
    results = [out.get(timeout=180) for _ in range(CONSUMERS)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    everything = [x for r in results for x in r]
    assert sorted(everything) == sorted((r, i) for r in range(PRODUCERS) for i in range(ITEMS))
    for received in results:  # FIFO per key: each consumer sees each producer's items in order
        for rank in range(PRODUCERS):
            for k in range(2):
                seq = [i for r, i in received if r == rank and i % 2 == k]
                assert seq == sorted(seq)
