"""Every Lua transition through the public client, on fakeredis, embedded Valkey and Redis 7.0."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.records import without_records
from tq_redis import errors
from tq_redis.meta.keys import PartitionKeys


def _td(n: int, start: int = 0, **extra) -> TensorDict:
    fields = {"input_ids": torch.arange(start, start + n * 4, dtype=torch.long).reshape(n, 4)}
    fields.update(extra)
    return TensorDict(fields, batch_size=[n])


def test_insert_claim_roundtrip(client):
    meta = client.put(_td(6), partition_id="p")
    assert meta.global_indexes == list(range(6))
    assert meta.is_ready
    batch = client.get_meta(["input_ids"], 4, "p", task_name="train")
    assert batch.global_indexes == [0, 1, 2, 3]
    data = client.get_data(batch)
    assert torch.equal(data["input_ids"], torch.arange(16).reshape(4, 4))
    # never a partial batch: 2 left, 4 asked
    assert client.get_meta(["input_ids"], 4, "p", task_name="train").size == 0
    rest = client.get_meta(["input_ids"], 2, "p", task_name="train")
    assert rest.global_indexes == [4, 5]


def test_ids_monotonic_and_never_reused(client):
    first = client.put(_td(3), partition_id="p")
    client.clear_samples(first)
    second = client.put(_td(3), partition_id="p")
    assert second.global_indexes == [3, 4, 5]
    client.clear_partition("p")
    third = client.put(_td(2), partition_id="p")
    assert third.global_indexes == [6, 7]


def test_two_tasks_consume_independently(client):
    client.put(_td(4), partition_id="p")
    a = client.get_meta(["input_ids"], 4, "p", task_name="actor")
    b = client.get_meta(["input_ids"], 4, "p", task_name="critic")
    assert a.global_indexes == b.global_indexes == [0, 1, 2, 3]
    assert client.get_meta(["input_ids"], 1, "p", task_name="actor").size == 0
    assert client.check_consumption_status("actor", "p")
    assert not client.check_consumption_status("ref", "p")


def test_field_written_later_becomes_ready(client):
    meta = client.put(_td(4), partition_id="p")
    assert client.get_meta(["input_ids", "reward"], 2, "p", task_name="t").size == 0
    client.put(TensorDict({"reward": torch.tensor([1.0, 2.0])}, batch_size=[2]), metadata=meta[1:3])
    got = client.get_meta(["input_ids", "reward"], 2, "p", task_name="t")
    assert got.global_indexes == [1, 2]
    assert torch.equal(client.get_data(got)["reward"], torch.tensor([1.0, 2.0]))
    ids, status = client.get_production_status(["input_ids", "reward"], "p")
    assert ids.tolist() == [0, 1, 2, 3] and status.tolist() == [0, 1, 1, 0]
    assert not client.check_production_status(["input_ids", "reward"], "p")
    assert client.check_production_status(["input_ids"], "p")


def test_rewrite_is_seen_by_later_readers(client):
    meta = client.put(_td(2), partition_id="p")
    client.put(TensorDict({"input_ids": torch.full((2, 4), 7)}, batch_size=[2]), metadata=meta)
    got = client.get_meta(["input_ids"], 2, "p", task_name="t")
    assert torch.equal(client.get_data(got)["input_ids"], torch.full((2, 4), 7))


def test_force_fetch_marks_nothing(client):
    client.put(_td(3), partition_id="p")
    everything = client.get_meta(["input_ids"], 1, "p", mode="force_fetch")
    assert everything.global_indexes == [0, 1, 2]
    assert everything.production_status.tolist() == [1, 1, 1]
    assert client.get_meta(["input_ids"], 3, "p", task_name="t").size == 3


def test_reset_consumption(client):
    client.put(_td(2), partition_id="p")
    assert client.get_meta(["input_ids"], 2, "p", task_name="t").size == 2
    assert client.reset_consumption("p", "t") is True
    assert client.get_meta(["input_ids"], 2, "p", task_name="t").size == 2
    assert client.get_meta(["input_ids"], 2, "p", task_name="u").size == 2
    assert client.reset_consumption("p") is True
    assert client.get_meta(["input_ids"], 2, "p", task_name="u").size == 2
    assert client.reset_consumption("nope") is False


def test_clear_frees_data_and_hides_samples(client):
    meta = client.put(_td(4), partition_id="p")
    pk = PartitionKeys(client.namespace, "p")
    assert client.redis.exists(pk.data(0, "input_ids"))
    client.clear_samples(meta[0:2])
    client.clear_samples(meta[0:2])  # idempotent
    assert not client.redis.exists(pk.data(0, "input_ids"))
    assert client.redis.exists(pk.data(2, "input_ids"))
    with pytest.raises(errors.SampleNotFound):
        client.get_data(meta)
    got = client.get_meta(["input_ids"], 2, "p", task_name="t")
    assert got.global_indexes == [2, 3]
    client.clear_partition("p")
    client.clear_partition("p")  # idempotent
    assert not client.redis.exists(pk.data(2, "input_ids"))
    assert "p" not in client.get_partition_list()
    # only the id counter (ids are never reused) and the short-lived event stream remain
    left = set(without_records(client.redis.scan_iter(f"{client.namespace}:{{{client.namespace}/p}}:*"), client.redis))
    assert left == {pk.seq.encode(), pk.events.encode()}
    assert 0 < client.redis.pttl(pk.events) <= 60000


def test_wait_bookkeeping_expires_and_goes_with_the_partition(client):
    pk = PartitionKeys(client.namespace, "w")
    client.put(_td(2), partition_id="w")
    client.get_meta(["input_ids"], 2, "w", task_name="t")
    assert client.get_meta(["input_ids"], 1, "w", task_name="t", timeout=0.05).size == 0  # waited in vain
    # the consumer left the waiters when it gave up; what is left expires by itself
    assert client.redis.zcard(pk.waiters("t")) == 0
    assert 0 < client.redis.pttl(pk.waittasks) <= 60050
    client.clear_partition("w")
    left = set(without_records(client.redis.scan_iter(pk.prefix + "*"), client.redis))
    assert left == {pk.seq.encode(), pk.events.encode()}


def test_custom_meta_tags(client):
    meta = client.put(_td(3), partition_id="p")
    meta.update_custom_meta([{"total_lengths": 10}, {"total_lengths": 20, "uid": "a"}, {}])
    client.set_custom_meta(meta)
    got = client.get_meta(["input_ids"], 3, "p", task_name="t")
    assert got.custom_meta == [{"total_lengths": 10}, {"total_lengths": 20, "uid": "a"}, {}]
    ff = client.get_meta(["input_ids"], 3, "p", mode="force_fetch")
    assert ff.custom_meta[1] == {"total_lengths": 20, "uid": "a"}


def test_partition_list_and_namespaces_isolated(client, server):
    from tests.conftest import make_client

    client.put(_td(1), partition_id="a")
    client.put(_td(1), partition_id="b")
    assert client.get_partition_list() == ["a", "b"]
    other = make_client(server.url, client.namespace + "x")
    try:
        assert other.get_partition_list() == []
        assert other.get_meta(["input_ids"], 1, "a", task_name="t").size == 0
    finally:
        other.close()


def test_leases_ack_nack_and_lapse(client):
    client.put(_td(4), partition_id="p")
    leased = client.get_meta(["input_ids"], 2, "p", task_name="t", lease_s=30)
    assert leased.global_indexes == [0, 1]
    assert leased.get_extra_info("delivery_counts") == [1, 1]
    assert client.nack(leased) == []
    again = client.get_meta(["input_ids"], 2, "p", task_name="t", lease_s=30)
    assert again.global_indexes == [0, 1]
    assert again.get_extra_info("delivery_counts") == [2, 2]
    assert client.ack(again) is None
    assert client.ack(again) is None  # the holder's ack sent again (a retry): no error, counted once
    with pytest.raises(errors.LeaseLost):  # nacked: no longer this holder's
        client.ack(leased)
    short = client.get_meta(["input_ids"], 2, "p", task_name="t", lease_s=0.001)
    assert short.global_indexes == [2, 3]
    # the lapsed lease is handed back inside the next claim (no reaper process)
    redo = client.get_meta(["input_ids"], 2, "p", task_name="t", lease_s=30, timeout=5)
    assert redo.global_indexes == [2, 3]
    assert client.extend_lease(redo, 60) is None


def test_function_library_reloads_after_flush(client):
    client.put(_td(2), partition_id="p")
    client.redis.execute_command("FUNCTION", "FLUSH")
    assert client.get_meta(["input_ids"], 2, "p", task_name="t").size == 2
    client.redis.execute_command("FUNCTION", "FLUSH")
    # the insert travels in a pipeline: a missing library there is reloaded and the pipeline re-sent
    assert client.put(_td(1), partition_id="p").global_indexes == [2]


def test_keys_share_one_hash_tag(client):
    client.put(_td(2), partition_id="step_7")
    client.get_meta(["input_ids"], 1, "step_7", task_name="t", lease_s=10)
    keys = [k.decode() for k in without_records(client.redis.scan_iter(f"{client.namespace}:*"), client.redis)]
    tag = f"{{{client.namespace}/step_7}}"  # the namespace inside the tag: jobs spread over slots
    part_keys = [k for k in keys if tag in k]
    assert len(part_keys) >= 6
    assert all(k.startswith(f"{client.namespace}:{tag}:") for k in part_keys)
    ns = client.namespace
    assert set(keys) - set(part_keys) <= {f"{ns}:partitions", f"{ns}:config", f"{ns}:clients"}  # + its heartbeat
