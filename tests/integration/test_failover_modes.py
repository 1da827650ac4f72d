"""What a Sentinel failover costs claims and acks, in each durable mode (README "High availability").

Deterministic: the replica is held back (``SentinelSetup.fail_over_after``) while a consumer claims,
so the primary applies the claims and the replica never sees them; then the primary is SIGKILLed
and the replica promoted. One fetch task and one lease task claim in the same window.

* ``none`` (and ``aof`` alone, which fsyncs the primary but waits for no replica): the claims
  returned, and the failover lost them: their samples are delivered again, and with leases the
  first holder's ack counts beside the second's (the delivery count starts again on the replica).
* ``replicas:1`` (and ``aof:1``): the claims raise ``NotDurable`` and are handed back at once, so
  nothing is handed out: after the failover every sample is delivered once and acknowledged once.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.sentinel_setup import SentinelSetup, flavour_binary
from tq_redis import errors
from tq_redis.server import durability
from tq_redis.server.durability import NotDurable

FIELDS = ["x"]
N = 8


@pytest.fixture
def declared():
    """Declare durable modes for URLs as init does; forgotten after the test."""
    urls: list[str] = []

    def declare(url: str, setting: str, timeout_ms: int = 300) -> None:
        durability.declare(url, setting, timeout_ms)
        urls.append(url)

    yield declare
    for url in urls:
        durability.declare(url, None)


def _setup(flavour: str, tmp_path, appendonly: bool = False) -> SentinelSetup:
    return SentinelSetup(flavour_binary(flavour), tmp_path, appendonly=appendonly).start()


def _claim_both(client):
    """One fetch claim and one leased claim of all N samples: (fetch outcome, lease outcome)."""
    outcomes = []
    for kwargs in ({"task_name": "fetch"}, {"task_name": "lease", "lease_s": 60}):
        try:
            outcomes.append(client.get_meta(FIELDS, N, "p", **kwargs))
        except NotDurable as exc:
            outcomes.append(exc)
    return outcomes


def _acks(client, holders) -> dict[int, int]:
    """Each holder acks what it holds; how many acks counted per sample."""
    counted: dict[int, int] = {}
    for meta in holders:
        try:
            client.ack(meta)
            lost = set()
        except errors.LeaseLost as exc:
            lost = set(exc.ids)
        for i in meta.global_indexes:
            if i not in lost:
                counted[i] = counted.get(i, 0) + 1
    return counted


def _cost_without_replicas(ha: SentinelSetup, namespace: str) -> None:
    client = make_client(ha.url, namespace)
    put = client.put(TensorDict({"x": torch.arange(N)}, batch_size=[N]), partition_id="p")
    ha.wait_replicas(ha.primary_port(), 1)  # the samples are on the replica before the lag
    (fetched, leased), _ = ha.fail_over_after(lambda: _claim_both(client))
    assert fetched.size == N and leased.size == N  # acknowledged by the old primary ...
    # ... and lost with it: the same samples are handed out again
    again = client.get_meta(FIELDS, N, "p", task_name="fetch")
    assert sorted(again.global_indexes) == sorted(put.global_indexes)
    second = client.get_meta(FIELDS, N, "p", task_name="lease", lease_s=60)
    assert sorted(second.global_indexes) == sorted(put.global_indexes)
    assert second.get_extra_info("delivery_counts") == [1] * N  # the count starts again
    # both holders' acks count: the cost of a failover without durable mode
    assert set(_acks(client, [leased, second]).values()) == {2}
    client.close()


@pytest.mark.parametrize("flavour", ["redis7", "valkey"])
def test_without_durable_mode_a_failover_delivers_claims_again_and_acks_count_twice(flavour, tmp_path, namespace):
    ha = _setup(flavour, tmp_path)
    try:
        _cost_without_replicas(ha, namespace)
    finally:
        ha.stop()


def _handed_back(ha: SentinelSetup, namespace: str) -> None:
    client = make_client(ha.url, namespace)
    put = client.put(TensorDict({"x": torch.arange(N)}, batch_size=[N]), partition_id="p")  # confirmed
    (fetched, leased), old = ha.fail_over_after(lambda: _claim_both(client))
    for outcome in (fetched, leased):
        assert isinstance(outcome, NotDurable), outcome
        assert outcome.result is None and "handed back" in str(outcome)
    ha.restart(old)  # the new primary gets a replica again, so writes are confirmed
    ha.wait_replicas(ha.primary_port(), 1)
    again = client.get_meta(FIELDS, N, "p", task_name="fetch")
    assert sorted(again.global_indexes) == sorted(put.global_indexes)
    second = client.get_meta(FIELDS, N, "p", task_name="lease", lease_s=60)
    assert sorted(second.global_indexes) == sorted(put.global_indexes)
    holders = [o.result for o in (fetched, leased) if o.result is not None] + [second]
    assert _acks(client, [h for h in holders if h.get_extra_info("delivery_counts")]) == dict.fromkeys(
        put.global_indexes, 1)  # fmt: skip
    assert client.get_meta(FIELDS, 1, "p", task_name="fetch").size == 0
    assert client.get_meta(FIELDS, 1, "p", task_name="lease", lease_s=60).size == 0
    client.close()


@pytest.mark.parametrize("flavour", ["redis7", "valkey"])
def test_durable_replicas_mode_hands_back_an_unconfirmed_claim_so_each_sample_is_acked_once(
    flavour, tmp_path, namespace, declared
):
    ha = _setup(flavour, tmp_path)
    try:
        declared(ha.url, "replicas:1")
        _handed_back(ha, namespace)
    finally:
        ha.stop()


@pytest.mark.parametrize("mode", ["aof", "aof:1"])
def test_aof_modes_on_a_failover(mode, tmp_path, namespace, declared):
    """``aof`` fsyncs the primary's AOF and waits for no replica: a failover costs what it costs
    without durable mode. ``aof:1`` also waits for a replica's fsync: as ``replicas:1``. (Valkey:
    Redis 7.0 has no WAITAOF.)"""
    ha = _setup("valkey", tmp_path, appendonly=True)
    try:
        # a replica fsyncs its AOF once a second (everysec): WAITAOF for it takes up to ~1 s
        declared(ha.url, mode, 2500)
        if mode == "aof":
            _cost_without_replicas(ha, namespace)
        else:
            _handed_back(ha, namespace)
    finally:
        ha.stop()


def test_a_claim_no_replica_confirms_hands_nothing_out(real_server, namespace, declared):
    """Without a failover too: a server with no replica confirms nothing in durable mode
    ``replicas:1``. Each claim is handed back (the samples stay claimable, none counts as
    delivered), by the sync and the async client; a RankAwareSampler batch, which the other ranks
    of its group share, comes in ``.result`` instead."""
    import asyncio

    from tq_redis import AsyncTransferQueueClient

    plain = make_client(real_server.url, namespace)
    plain.put(TensorDict({"x": torch.arange(N)}, batch_size=[N]), partition_id="p")
    declared(real_server.url, "replicas:1", 20)
    durable = make_client(real_server.url, namespace)
    for kwargs in ({}, {"lease_s": 60}):
        with pytest.raises(NotDurable, match="handed back") as refused:
            durable.get_meta(FIELDS, 4, "p", task_name="t", **kwargs)
        assert refused.value.result is None

    async def claim_async():
        client = AsyncTransferQueueClient(real_server.url, namespace)
        try:
            return await client.async_get_meta(FIELDS, 4, "p", task_name="t", lease_s=60)
        finally:
            await client.async_close()

    with pytest.raises(NotDurable, match="handed back"):
        asyncio.run(claim_async())
    rank = {"sampler": "RankAwareSampler", "dp_rank": 0, "batch_index": 0, "dp_size": 1}
    with pytest.raises(NotDurable, match="not handed back") as shared:
        durable.get_meta(FIELDS, 4, "p", task_name="r", sampling_config=rank)
    assert shared.value.result.global_indexes == [0, 1, 2, 3]
    durability.declare(real_server.url, None)
    # every sample is still there for t, delivered for the first time, with its first delivery count
    leased = plain.get_meta(FIELDS, N, "p", task_name="t", lease_s=60)
    assert leased.global_indexes == list(range(N)) and leased.get_extra_info("delivery_counts") == [1] * N
    # the shared batch stayed claimed: the group's next batch is the next samples
    nxt = plain.get_meta(FIELDS, 4, "p", task_name="r", sampling_config={**rank, "batch_index": 1})
    assert nxt.global_indexes == [4, 5, 6, 7]
    durable.close()
    plain.close()
