"""A reply lost to a dropped connection: the call is sent again and acts once (request records).

Each test puts :class:`tests.faultproxy.FaultProxy` between the client and a real server (Valkey
and Redis 7.0) and has it cut the connection after a script's request reached the server and
before its reply came back; redis-py sends the call again on a new connection, with the same
request record key (``tq_redis/client/plans.py``), and gets the reply the first run recorded
(``lua/includes/requests.lua``). One test per lost-reply row of issue 43: an insert (a put of 1
and a put of 4 leave 5 rows, not 9), a ``commit_group`` (no ``ReservationLost``, the group visible
once), a ``fetch`` claim (the batch is delivered, once), also when the claim rode behind a wake
token's ``BLPOP``; and the same through the asyncio client, and between a client and a DRAM
storage node.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.faultproxy import FaultProxy
from tq_redis.errors import ReservationLost

WAIT_S = 120.0  # a wait's timeout that only decides failure: a woken consumer returns long before


def _rows(n: int, base: int = 0) -> TensorDict:
    return TensorDict({"x": torch.arange(base, base + n).reshape(n, 1)}, batch_size=[n])


@pytest.fixture(params=["store", "inline"])
def via_proxy(request, real_server, namespace):
    """``(client through the proxy, the proxy, a direct client)`` of one namespace."""
    proxy = FaultProxy.for_url(real_server.url)
    inline = 4096 if request.param == "inline" else 0
    client = make_client(proxy.url(real_server.url), namespace, inline_max_bytes=inline)
    direct = make_client(real_server.url, namespace, inline_max_bytes=inline)
    yield client, proxy, direct
    client.close()
    direct.close()
    proxy.close()


def _alive(client, partition: str = "p") -> list[int]:
    meta = client.get_meta(["x"], 0, partition, mode="force_fetch")
    return sorted(meta.global_indexes)


def test_an_insert_whose_reply_is_lost_inserts_once(via_proxy):
    client, proxy, direct = via_proxy
    client.put(_rows(1), partition_id="p")
    proxy.drop_reply_after(b"tq_insert")
    meta = client.put(_rows(4, base=1), partition_id="p")
    assert proxy.dropped == 1, "the proxy dropped no reply: the test did not test anything"
    assert meta.size == 4
    assert _alive(direct) == [0, 1, 2, 3, 4]  # 5 rows, not 9
    data = direct.get_data(direct.get_meta(["x"], 5, "p", task_name="t"))
    assert sorted(data["x"].reshape(-1).tolist()) == [0, 1, 2, 3, 4]


def test_a_commit_whose_reply_is_lost_commits_once_and_raises_nothing(via_proxy):
    client, proxy, direct = via_proxy
    reservation = client.reserve_group("p", 4)
    proxy.drop_reply_after(b"tq_group_commit")
    try:
        meta = client.commit_group(reservation, _rows(4))
    except ReservationLost as exc:  # what the lost reply made of it before request records
        pytest.fail(f"commit_group raised {exc!r} although its group was committed")
    assert proxy.dropped == 1
    assert sorted(meta.global_indexes) == _alive(direct) == [0, 1, 2, 3]
    assert direct.get_meta(["x"], 4, "p", task_name="t").size == 4
    assert direct.get_meta(["x"], 1, "p", task_name="t").size == 0  # visible once


def test_a_fetch_claim_whose_reply_is_lost_delivers_the_batch_once(via_proxy):
    client, proxy, direct = via_proxy
    direct.put(_rows(6), partition_id="p")
    proxy.drop_reply_after(b"tq_claim")
    first = client.get_meta(["x"], 4, "p", task_name="t")
    assert proxy.dropped == 1
    assert first.size == 4  # the batch it claimed, not lost
    rest = client.get_meta(["x"], 2, "p", task_name="t")
    assert sorted([*first.global_indexes, *rest.global_indexes]) == list(range(6))  # and never twice
    assert client.get_meta(["x"], 1, "p", task_name="t").size == 0


def test_a_woken_claim_whose_reply_is_lost_is_delivered_without_waiting_again(via_proxy):
    """The claim that rides behind the wake token's BLPOP: the token is taken and the claim ran;
    the consumer gets that claim's batch at once rather than waiting for another token."""
    client, proxy, direct = via_proxy
    proxy.drop_reply_after(b"BLPOP")
    got: list = []
    started = time.monotonic()
    consumer = threading.Thread(target=lambda: got.append(client.get_meta(["x"], 3, "p", task_name="t",
                                                                          timeout=WAIT_S)))
    consumer.start()
    while proxy.pending_drops() and consumer.is_alive():  # until the consumer blocks in its BLPOP
        direct.redis.ping()
        if time.monotonic() - started > WAIT_S:
            break
    direct.put(_rows(3), partition_id="p")
    consumer.join(WAIT_S)
    assert not consumer.is_alive()
    assert got and sorted(got[0].global_indexes) == [0, 1, 2]
    assert time.monotonic() - started < WAIT_S, "the consumer waited out its timeout"
    assert direct.get_meta(["x"], 1, "p", task_name="t").size == 0


def test_the_async_client_rides_through_lost_replies(real_server, namespace):
    from tq_redis import AsyncTransferQueueClient

    async def main() -> None:
        with FaultProxy.for_url(real_server.url) as proxy:
            direct = make_client(real_server.url, namespace)
            client = AsyncTransferQueueClient(proxy.url(real_server.url), namespace, nested_output=False)
            try:
                await client.async_put(_rows(1), partition_id="p")
                proxy.drop_reply_after(b"tq_insert")
                await client.async_put(_rows(4, base=1), partition_id="p")
                proxy.drop_reply_after(b"tq_claim")
                meta = await client.async_get_meta(["x"], 5, "p", task_name="t")
                assert proxy.dropped == 2
                assert sorted(meta.global_indexes) == [0, 1, 2, 3, 4]
                assert _alive(direct) == [0, 1, 2, 3, 4]
                assert direct.get_meta(["x"], 1, "p", task_name="t").size == 0
            finally:
                await client.async_close()
                direct.close()

    asyncio.run(main())


def test_ack_nack_tags_and_clears_whose_replies_are_lost_act_once(via_proxy):
    client, proxy, direct = via_proxy
    direct.put(_rows(4), partition_id="p")
    meta = client.get_meta(["x"], 2, "p", task_name="t", lease_s=300)
    proxy.drop_reply_after(b"tq_settle")
    client.ack(meta)
    meta2 = client.get_meta(["x"], 2, "p", task_name="t", lease_s=300)
    proxy.drop_reply_after(b"tq_settle")
    client.nack(meta2)
    again = client.get_meta(["x"], 2, "p", task_name="t", lease_s=300)
    assert sorted(again.global_indexes) == sorted(meta2.global_indexes)  # handed back, once
    client.ack(again)
    assert client.get_meta(["x"], 1, "p", task_name="t", lease_s=300).size == 0
    tagged = direct.get_meta(["x"], 0, "p", mode="force_fetch")
    tagged.update_custom_meta([{"v": i} for i in range(tagged.size)])
    proxy.drop_reply_after(b"tq_set_tags")
    client.set_custom_meta(tagged)
    proxy.drop_reply_after(b"tq_clear")
    client.clear_samples(tagged.select_samples([0, 1]))
    assert proxy.dropped == 4
    assert _alive(direct) == [2, 3]
    assert [m["v"] for m in direct.get_meta(["x"], 0, "p", mode="force_fetch").get_all_custom_meta()] == [2, 3]


@pytest.mark.parametrize("script", [b"tq_kv_resolve", b"tq_produce"])
def test_a_kv_put_whose_reply_is_lost_maps_its_key_once(via_proxy, script):
    client, proxy, direct = via_proxy
    client.kv_put("a", "p", {"x": torch.tensor([1])})
    proxy.drop_reply_after(script)
    client.kv_put("b", "p", {"x": torch.tensor([2])})
    assert proxy.dropped == 1, f"kv_put sent no {script!r}"
    client.kv_put("a", "p", {"x": torch.tensor([3])})  # a rewrite of a's field, not a new sample
    assert _alive(direct) == [0, 1]
    got = direct.kv_batch_get(["a", "b"], "p")
    assert got["x"].reshape(-1).tolist() == [3, 2]
    proxy.drop_reply_after(b"tq_kv_unmap")
    client.kv_clear(["a"], "p")
    assert proxy.dropped == 2
    assert _alive(direct) == [1]


def test_a_channel_put_or_get_whose_reply_is_lost_acts_once(real_server, namespace):
    from tq_redis import Channel

    with FaultProxy.for_url(real_server.url) as proxy:
        ch = Channel.create("c", redis_url=proxy.url(real_server.url), namespace=namespace)
        watch = Channel.connect("c", redis_url=real_server.url, namespace=namespace)
        try:
            proxy.drop_reply_after(b"tq_channel_put")
            ch.put("a", weight=1)
            ch.put("b", weight=1)
            assert watch.qsize() == 2  # not 3
            proxy.drop_reply_after(b"tq_channel_pop")
            assert ch.get() == "a"  # the item the lost reply carried, not lost
            assert ch.get_nowait() == "b"
            assert watch.empty()
            assert proxy.dropped == 2
        finally:
            ch.close()
            watch.close()


def test_a_storage_node_behind_the_proxy_delays_and_drops(real_server, namespace):
    """Between a client and a DRAM storage node: delayed replies change nothing; a put whose reply
    from the node is lost raises ``StorageUnavailable`` naming the node, makes nothing visible (data
    first, then bits) and leaves no bytes once cleared; the program's next put goes through."""
    from tests.soak.helpers import await_nodes_empty, use_store
    from tq_redis import TransferQueueClient
    from tq_redis.backends.dram.launcher import spawn_node
    from tq_redis.errors import StorageUnavailable
    from tq_redis.server.embedded import free_port

    port = free_port()
    proxy = FaultProxy(("127.0.0.1", port))
    node = spawn_node(real_server.url, namespace, listen=f"127.0.0.1:{port}", capacity="64MiB", shm=False,
                      extra_args=["--advertise", proxy.address])
    use_store(real_server.url, namespace, "dram", {"shm": False})
    client = TransferQueueClient(real_server.url, namespace, nested_output=False)
    marker = 0x5A17_0D0E_C0DE_F00D
    try:
        proxy.delay_replies(0.02)
        client.put(_rows(4), partition_id="p")
        data = client.get_data(client.get_meta(["x"], 4, "p", task_name="t"))
        assert data["x"].reshape(-1).tolist() == [0, 1, 2, 3]
        proxy.delay_replies(0)
        proxy.drop_reply_after(torch.tensor([marker]).numpy().tobytes())
        with pytest.raises(StorageUnavailable, match=proxy.address):
            client.put(TensorDict({"x": torch.full((2, 1), marker)}, batch_size=[2]), partition_id="p")
        assert proxy.dropped == 1
        assert _alive(client) == [0, 1, 2, 3]  # nothing of the failed put is visible
        client.put(_rows(2, base=4), partition_id="p")
        data = client.get_data(client.get_meta(["x"], 2, "p", task_name="t"))
        assert data["x"].reshape(-1).tolist() == [4, 5]
        client.clear_partition("p")
        await_nodes_empty(real_server.url, namespace)
    finally:
        client.close()
        node.stop()
        proxy.close()


def test_reserve_extend_abort_and_appends_whose_replies_are_lost_act_once(via_proxy):
    client, proxy, direct = via_proxy
    proxy.drop_reply_after(b"tq_group_reserve")
    held = client.reserve_group("p", 4, lease_s=60)
    assert held.global_indexes == [0, 1, 2, 3]
    assert client.reserve_group("p", 2, lease_s=60).global_indexes == [4, 5]  # ids 0..3 reserved once
    proxy.drop_reply_after(b"tq_group_extend")
    extended = client.extend_reservation(held, 120)
    assert extended.deadline_ms >= held.deadline_ms
    proxy.drop_reply_after(b"tq_group_abort")
    assert client.abort_group(held) is True  # the first run's answer, not "no longer held"
    prompts = direct.put(TensorDict({"prompt": torch.tensor([[7], [8]])}, batch_size=[2]), partition_id="a")
    proxy.drop_reply_after(b"tq_part_append")
    client.append_parts(prompts, {"resp": torch.tensor([[1], [2]])}, policy_version=0)
    proxy.drop_reply_after(b"tq_part_append")
    client.append_parts(prompts, {"resp": torch.tensor([[3], [4]])}, policy_version=1, complete=True)
    assert proxy.dropped == 5
    data = direct.get_data(direct.get_meta(["prompt", "resp"], 2, "a", task_name="t"))
    assert [r.reshape(-1).tolist() for r in data["resp"].unbind()] == [[1, 3], [2, 4]]  # each part once
