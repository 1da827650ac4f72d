"""Dataclass and NamedTuple items through a Channel without pickle, across real processes.

RLinf's workers put dataclass items into channels. Allowed by default: the classes the program
defines (``tests.rlinf_items`` here, loaded by every process that uses them), with nothing
registered anywhere. A channel also allows the classes its creating process registered
(``tq_redis.register_item_class``) and those given as ``item_classes=``. A class nobody allowed
(one of the standard library here) raises at ``put``, in the producer, before anything is queued,
so no consumer waits for an item that never comes.
"""

from __future__ import annotations

import asyncio
import pstats

import pytest
import torch

from tests.conftest import make_client
from tests.procs import mp_context
from tests.rlinf_items import Rollout, Step, Tag, Unlisted
from tq_redis import Channel
from tq_redis.codec.item_classes import REGISTERED
from tq_redis.errors import ItemClassNotAllowed, UnsupportedValue

ITEMS = 12


def _creator(url: str, ns: str, name: str, ready) -> None:
    from tq_redis import register_item_class

    register_item_class(Rollout)
    register_item_class(Step)
    Channel.create(name, redis_url=url, namespace=ns).close()  # allows what this process registered
    ready.set()


def _producer(url: str, ns: str, name: str, out) -> None:
    ch = Channel.connect(name, redis_url=url, namespace=ns)
    works = [ch.put(Step(i, Rollout(torch.full((i + 1,), i), [i / 2], {"rank": 0}, group=i % 3)), weight=1,
                    async_op=True) for i in range(ITEMS)]
    for work in works:
        work.wait()
    try:
        ch.put(pstats.StatsProfile(0.5, {}), async_op=True)  # refused here, at once, though async
        out.put("queued an item of a class nobody allowed")
    except ItemClassNotAllowed as exc:
        out.put(f"refused:{exc.path}")
    ch.put(Unlisted(ITEMS), weight=1)  # the program's own class, registered nowhere
    ch.close()


def _consumer(url: str, ns: str, name: str, out) -> None:
    ch = Channel.connect(name, redis_url=url, namespace=ns)
    got = []
    while len(got) < ITEMS:
        got.extend(ch.get_batch(4, timeout=60))
    last = ch.get(timeout=60)  # what came after the refused put: the consumer was never left waiting on it
    out.put([(type(s).__name__, s.index, type(s.rollout).__name__, s.rollout.prompt_ids.tolist(), s.rollout.rewards,
              s.rollout.info, s.rollout.group, s.rollout.post_init_runs) for s in got] + [last])
    ch.close()


def test_registered_dataclass_items_cross_processes_that_registered_nothing(real_server, namespace):
    make_client(real_server.url, namespace).close()
    ctx, name = mp_context(), "rollouts"
    ready, out, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    creator = ctx.Process(target=_creator, args=(real_server.url, namespace, name, ready))
    creator.start()
    assert ready.wait(120)
    creator.join(30)
    procs = [ctx.Process(target=_producer, args=(real_server.url, namespace, name, out)),
             ctx.Process(target=_consumer, args=(real_server.url, namespace, name, results))]
    for p in procs:
        p.start()
    assert out.get(timeout=120) == "refused:pstats.StatsProfile"
    got = results.get(timeout=120)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert got[:-1] == [("Step", i, "Rollout", [i] * (i + 1), [i / 2], {"rank": 0}, i % 3, 1) for i in range(ITEMS)]
    assert got[-1] == Unlisted(ITEMS) and type(got[-1]) is Unlisted
    assert not REGISTERED.paths()  # this process registered nothing either
    ch = Channel.connect(name, redis_url=real_server.url, namespace=namespace)
    assert ch.qsize() == 0  # the refused item never reached the queue
    ch.close()


def test_item_classes_argument_and_a_list_extended_after_handles_were_made(server, namespace):
    make_client(server.url, namespace).close()
    target = {"redis_url": server.url, "namespace": namespace}
    early = Channel.create("tags", **target)  # allows only the program's own classes yet
    reader = Channel.connect("tags", **target)
    early.put(Tag("v", 1))
    assert reader.get(timeout=30) == Tag("v", 1)
    with pytest.raises(ItemClassNotAllowed, match="StatsProfile.*standard library.*register_item_class"):
        early.put(pstats.StatsProfile(0.5, {}))
    with pytest.raises(asyncio.QueueEmpty):
        reader.get_nowait()
    waiting = reader.get(async_op=True)  # a consumer already waiting when a put is refused
    with pytest.raises(ItemClassNotAllowed):
        early.put(pstats.StatsProfile(1.0, {}), async_op=True)
    assert early.qsize() == 0 and not waiting.done()
    early.put(Tag("v", 3))
    assert waiting.wait(30) == Tag("v", 3)  # the next item that was put, never the refused one
    Channel.create("tags", item_classes=[pstats.StatsProfile], **target).close()  # another process allows it
    early.put(pstats.StatsProfile(2.0, {}), async_op=True).wait()  # the old handles find it in the channel's list
    assert reader.get(timeout=30) == pstats.StatsProfile(2.0, {})
    with pytest.raises(UnsupportedValue, match="not a dataclass"):
        Channel.create("other", item_classes=[dict], **target)
    for ch in (early, reader):
        ch.close()


@pytest.fixture
def registered(monkeypatch):
    """This process's registry, emptied for the test and restored afterwards."""
    monkeypatch.setattr(REGISTERED, "_paths", set())
    monkeypatch.setattr(REGISTERED, "_resolved", {})
    return REGISTERED


def test_registered_classes_travel_through_put_and_get_data(server, namespace, registered):
    from tensordict import NonTensorStack, TensorDict

    from tq_redis import register_item_class

    client = make_client(server.url, namespace)
    items = [pstats.StatsProfile(0.5, {}), pstats.StatsProfile(1.5, {})]
    data = TensorDict({"tag": NonTensorStack(*items), "x": torch.arange(2)}, batch_size=[2])
    with pytest.raises(ItemClassNotAllowed, match="field 'tag', sample 0"):
        client.put(data, partition_id="p")
    assert client.get_partition_list() == []  # refused before anything was written
    register_item_class(pstats.StatsProfile)
    meta = client.put(data, partition_id="p")
    got = client.get_data(meta)["tag"]
    assert list(got) == items and all(type(t) is pstats.StatsProfile for t in got)
    own = TensorDict({"tag": NonTensorStack(Tag("a", 1), Tag("b", 2)), "x": torch.arange(2)}, batch_size=[2])
    assert list(client.get_data(client.put(own, partition_id="q"))["tag"]) == [Tag("a", 1), Tag("b", 2)]
    client.close()
