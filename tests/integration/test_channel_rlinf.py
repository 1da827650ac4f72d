"""Channel as RLinf's code calls it: signatures and defaults, keys of any hashable kind, get_batch's
weight rule and default target, ``str(channel)``, and local (in-process) channels."""

from __future__ import annotations

import asyncio
import inspect
import pickle
from dataclasses import dataclass

import pytest
import torch

from tests.procs import mp_context
from tq_redis import Channel
from tq_redis.errors import ChannelNotFound, InvalidArgument
from tq_redis.ops.channel_rules import DEFAULT_KEY, WeightedItem


def _create(server, namespace, name, **kw) -> Channel:
    return Channel.create(name, redis_url=server.url, namespace=namespace, **kw)


def _defaults(fn) -> dict:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def test_signatures_and_defaults_are_rlinfs():
    assert DEFAULT_KEY == "default_queue"
    assert list(inspect.signature(Channel.create).parameters)[:6] == [
        "name", "maxsize", "distributed", "node_rank", "local", "disable_distributed_log"]
    assert _defaults(Channel.create).items() >= {"maxsize": 0, "distributed": False, "node_rank": 0, "local": False,
                                                 "disable_distributed_log": True}.items()
    assert list(inspect.signature(Channel.connect).parameters)[:2] == ["name", "current_worker"]
    assert list(inspect.signature(Channel.put).parameters)[:5] == ["self", "item", "weight", "key", "async_op"]
    assert _defaults(Channel.put).items() >= {"weight": 0, "key": DEFAULT_KEY, "async_op": False}.items()
    assert _defaults(Channel.put_nowait) == {"weight": 0, "key": DEFAULT_KEY}
    assert list(inspect.signature(Channel.get).parameters)[:3] == ["self", "key", "async_op"]
    assert _defaults(Channel.get_nowait) == {"key": DEFAULT_KEY}
    assert list(inspect.signature(Channel.get_batch).parameters)[:4] == ["self", "target_weight", "key", "async_op"]
    assert _defaults(Channel.get_batch).items() >= {"target_weight": 0, "key": DEFAULT_KEY, "async_op": False}.items()
    for query in (Channel.qsize, Channel.empty, Channel.full):
        assert _defaults(query) == {"key": DEFAULT_KEY}


def test_rlinf_style_positional_calls(server, namespace):
    ch = Channel.create(f"pos-{namespace}", 0, False, 0, False, True, redis_url=server.url, namespace=namespace)
    ch.put("item1", 1)
    ch.put("item2", 2, DEFAULT_KEY, True).wait()
    assert ch.get(DEFAULT_KEY, False) == "item1"
    assert ch.get_batch(2, DEFAULT_KEY, True).wait() == ["item2"]
    ch.close()


def test_get_batch_default_target_is_zero(server, namespace):
    ch = _create(server, namespace, "gb0")
    ch.put("a")  # weight 0
    ch.put("b")
    assert ch.get_batch() == ["a"]  # target 0: the head item if it weighs 0, one at a time
    assert ch.get_batch(async_op=True).wait(5) == ["b"]
    ch.put("heavy", weight=1)
    assert ch.get_batch() == []  # heavier than the target: nothing taken
    assert ch.qsize() == 1
    with pytest.raises(TimeoutError):
        _create(server, namespace, "gb0-empty").get_batch(timeout=0.05)  # an empty queue waits
    ch.close()


def test_get_batch_rule_on_mixed_weights(server, namespace):
    ch = _create(server, namespace, "gbr")
    for item, weight in [("item1", 1), ("item2", 2), ("item3", 3)]:
        ch.put(item, weight)
    assert ch.get_batch(3) == ["item1", "item2"]
    assert ch.get() == "item3"
    for i, weight in enumerate([2, 2, 0, 1]):
        ch.put(i, weight)
    assert ch.get_batch(3) == [0]  # 2 + 2 would overshoot 3
    assert ch.get_batch(3) == [1, 2, 3]  # 2 + 0 + 1 reaches 3
    ch.close()


def test_str_lists_the_default_queue_like_rlinf(server, namespace):
    ch = _create(server, namespace, "str")
    for i, item in enumerate(["item1", "item2", "item3"]):
        ch.put(item, weight=i)
    ch.put(torch.arange(3), weight=2.5)
    ch.put("elsewhere", key="other")
    text = str(ch)
    assert text.startswith("[WeightedItem(weight=0, item='item1'), WeightedItem(weight=1, item='item2'), ")
    assert "WeightedItem(weight=2.5, item=tensor([0, 1, 2]))" in text and "elsewhere" not in text
    assert ch.peek_all("other") == [WeightedItem(0, "elsewhere")]
    assert ch.qsize() == 4  # nothing was taken, tensor bytes included
    assert [ch.get() for _ in range(3)] == ["item1", "item2", "item3"]
    assert torch.equal(ch.get(), torch.arange(3))
    assert str(ch) == "[]"
    ch.close()


def test_keys_of_any_hashable_value_kind(server, namespace):
    ch = _create(server, namespace, "keys")
    other = Channel.connect("keys", redis_url=server.url, namespace=namespace)
    ch.put("int", key=3)
    ch.put("str", key="3")
    ch.put("tuple", key=(1, "a", (2.5, None)))
    ch.put("set", key=frozenset({1, 2}))
    ch.put("bytes", key=b"\x00k")
    ch.put("odd str", key="a b{c}#")
    ch.put("hash str", key="#i3")
    assert other.get(key="3") == "str" and other.get(key=3.0) == "int"  # 3 == 3.0, not "3"
    assert other.get(key=(1, "a", (2.5, None))) == "tuple"
    assert other.get(key=frozenset({2, 1})) == "set"
    assert other.get(key=b"\x00k") == "bytes"
    assert other.get(key="a b{c}#") == "odd str"
    assert other.get_nowait(key="#i3") == "hash str"
    ch.put("bool", key=True)
    assert other.qsize(1) == 1 and other.get(key=1) == "bool"  # True == 1, as dict keys
    with pytest.raises(InvalidArgument):
        ch.put("x", key=[1, 2])  # unhashable
    with pytest.raises(InvalidArgument, match="tuple"):
        ch.put("x", key=object())  # hashable, but not equal by value across processes
    ch.close()
    other.close()


def test_rlinf_stress_on_a_thousand_keys(server, namespace):
    ch = _create(server, namespace, "stress")

    async def stress_multiple_queues():
        for i in range(1000):
            ch.put(item=i, key=f"stress_key{i}", async_op=True)
        works = [ch.get(async_op=True, key=f"stress_key{i}") for i in range(1000)]
        return await asyncio.gather(*(w.async_wait() for w in works))

    assert asyncio.run(stress_multiple_queues()) == list(range(1000))
    ch.close()


# ------------------------------------------------------------------ local channels


@dataclass(frozen=True)
class SessionKey:
    rank: int
    name: str


def test_local_channel_lives_in_this_process(monkeypatch):
    monkeypatch.delenv("TQ_REDIS_URL", raising=False)
    ch = Channel.create("inproc", maxsize=2, local=True)  # no Redis anywhere
    assert ch.is_local and ch.maxsize == 2
    tensor, obj = torch.ones(2), object()
    ch.put(tensor, weight=1)
    ch.put(obj, weight=1, key=SessionKey(0, "a"))  # any hashable key; any object (no encoding)
    assert ch.get() is tensor and ch.get(key=SessionKey(0, "a")) is obj
    ch.put(1)
    ch.put(2)
    assert ch.full() and ch.qsize() == 2
    with pytest.raises(asyncio.QueueFull):
        ch.put_nowait(3)
    blocked = ch.put(3, async_op=True)  # waits for room without blocking the caller
    assert not blocked.done()
    assert ch.get() == 1
    assert blocked.wait(5) is None and str(ch) == "[WeightedItem(weight=0, item=2), WeightedItem(weight=0, item=3)]"
    assert ch.get_batch() == [2] and ch.get_nowait() == 3
    with pytest.raises(asyncio.QueueEmpty):
        ch.get_nowait()
    with pytest.raises(TimeoutError):
        ch.get(timeout=0.05)
    pending = ch.get(key="late", async_op=True)
    ch.put("now", key="late")
    assert pending.wait(5) == "now"
    weighted = Channel.create("inproc-w", local=True)
    for i, weight in enumerate([1, 2, 3, 2, 2]):
        weighted.put(i, weight, key="w")
    assert weighted.get_batch(3, key="w") == [0, 1] and weighted.get_batch(3, key="w") == [2]
    assert weighted.get_batch(3, key="w") == [3]  # the next one would overshoot
    with pytest.raises(TimeoutError):  # 2 fits but does not reach 3: wait, take nothing
        weighted.get_batch(3, key="w", timeout=0.05)
    assert weighted.qsize("w") == 1


def _child_uses_its_copy(ch: Channel) -> tuple[int, int]:
    before = ch.qsize()
    ch.put("from the child")
    return before, ch.qsize()


def test_local_channel_copies_share_queues_in_process_not_across(server, namespace):
    ch = Channel.create("shared-here", local=True)
    ch.put("parent item")
    same = pickle.loads(pickle.dumps(ch))
    assert same.qsize() == 1 and same.get() == "parent item"
    ch.put("parent item")
    with mp_context().Pool(1) as pool:
        assert pool.apply(_child_uses_its_copy, (ch,)) == (0, 1)  # its own, empty channel
    assert ch.qsize() == 1 and ch.get() == "parent item"
    with pytest.raises(ChannelNotFound):  # a local channel has no name in Redis
        Channel.connect("shared-here", redis_url=server.url, namespace=namespace)
