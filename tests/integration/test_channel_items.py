"""Dataclass and NamedTuple items through a Channel without pickle, across real processes.

RLinf's workers put dataclass items into channels. The channel allows the classes its creating
process registered (``tq_redis.register_item_class``) and those given as ``item_classes=``; the
producer and consumer processes register nothing. A class nobody allowed raises at ``put``, in
the producer, before anything is queued, so no consumer waits for an item that never comes.
"""

from __future__ import annotations

import asyncio

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
        ch.put(Unlisted(1), async_op=True)  # refused here, at once, though async
        out.put("queued an item of a class nobody allowed")
    except ItemClassNotAllowed as exc:
        out.put(f"refused:{exc.path}")
    ch.close()


def _consumer(url: str, ns: str, name: str, out) -> None:
    ch = Channel.connect(name, redis_url=url, namespace=ns)
    got = []
    while len(got) < ITEMS:
        got.extend(ch.get_batch(4, timeout=60))
    out.put([(type(s).__name__, s.index, type(s.rollout).__name__, s.rollout.prompt_ids.tolist(), s.rollout.rewards,
              s.rollout.info, s.rollout.group, s.rollout.post_init_runs) for s in got])
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
    assert out.get(timeout=120) == "refused:tests.rlinf_items.Unlisted"
    got = results.get(timeout=120)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert got == [("Step", i, "Rollout", [i] * (i + 1), [i / 2], {"rank": 0}, i % 3, 1) for i in range(ITEMS)]
    assert not REGISTERED.paths()  # this process registered nothing either
    ch = Channel.connect(name, redis_url=real_server.url, namespace=namespace)
    assert ch.qsize() == 0  # the refused item never reached the queue
    ch.close()


def test_item_classes_argument_and_a_list_extended_after_handles_were_made(server, namespace):
    make_client(server.url, namespace).close()
    target = {"redis_url": server.url, "namespace": namespace}
    early = Channel.create("tags", **target)  # allows nothing yet
    reader = Channel.connect("tags", **target)
    with pytest.raises(ItemClassNotAllowed, match="Tag.*register_item_class"):
        early.put(Tag("v", 1))
    with pytest.raises(asyncio.QueueEmpty):
        reader.get_nowait()
    Channel.create("tags", item_classes=[Tag], **target).close()  # another process allows Tag
    early.put(Tag("v", 2), async_op=True).wait()  # the old handles find it in the channel's list
    assert reader.get(timeout=30) == Tag("v", 2)
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
    items = [Tag("a", 1), Tag("b", 2)]
    data = TensorDict({"tag": NonTensorStack(*items), "x": torch.arange(2)}, batch_size=[2])
    with pytest.raises(ItemClassNotAllowed, match="field 'tag', sample 0"):
        client.put(data, partition_id="p")
    assert client.get_partition_list() == []  # refused before anything was written
    register_item_class(Tag)
    meta = client.put(data, partition_id="p")
    got = client.get_data(meta)["tag"]
    assert list(got) == items and all(type(t) is Tag for t in got)
    client.close()
