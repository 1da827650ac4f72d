"""Bytes whose delete failed are not lost: they wait in the partition's trash for the next clear.

A clear drops the samples' bits, then deletes their bytes from the store. If the store is
unreachable at that moment (or the client dies), the ids stay in ``ns:{p}:trash`` and a later
clear of the same samples, or of the partition, deletes them. A put that fails after writing part
of a batch goes through the trash as well. Every case runs on each server flavour (the Lua).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis import ops
from tq_redis.errors import StorageUnavailable
from tq_redis.meta.keys import PartitionKeys


def _batch(n: int = 8) -> TensorDict:
    return TensorDict({"x": torch.arange(n * 3).reshape(n, 3), "y": torch.ones(n, 2)}, batch_size=[n])


class _Flaky:
    """Wraps one store method: the first ``fails`` calls raise (after calling through if ``after``)."""

    def __init__(self, fn, fails: int = 1, after: bool = False) -> None:
        self.fn, self.fails, self.after, self.calls = fn, fails, after, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.fails:
            if self.after:
                self.fn(*args, **kwargs)
            raise StorageUnavailable("storage node 'flaky' is unreachable (simulated)")
        return self.fn(*args, **kwargs)


def _store(client):
    """The client's store object (built on first use), to wrap its methods."""
    return client.run(ops.storage(client.context)).store


def _data_keys(client, pk: PartitionKeys) -> list[bytes]:
    return sorted(client.redis.scan_iter(match=f"{pk.prefix}d:*", count=1000))


def _assert_all_deleted(client, pk: PartitionKeys) -> None:
    """No bytes left in the store and no trash keys left in Redis."""
    assert _data_keys(client, pk) == []
    assert not client.redis.exists(pk.trash, pk.trash_fields)


def _trash(client, pk: PartitionKeys) -> tuple[int, set[str]]:
    count = client.redis.bitcount(pk.trash)
    fields = {f.decode() for f in client.redis.smembers(pk.trash_fields)}
    return count, fields


@pytest.fixture
def flaky_client(server, namespace):
    client = make_client(server.url, namespace)
    yield client, PartitionKeys(namespace, "p")
    client.close()


def test_a_normal_clear_leaves_no_trash(flaky_client):
    client, pk = flaky_client
    meta = client.put(_batch(), partition_id="p")
    client.clear_samples(meta.select_samples([0, 1, 2]))
    client.clear_partition("p")
    _assert_all_deleted(client, pk)


def test_clear_partition_retries_a_delete_that_failed(flaky_client):
    client, pk = flaky_client
    client.put(_batch(), partition_id="p")
    store = _store(client)
    store.delete = _Flaky(store.delete)
    with pytest.raises(StorageUnavailable, match="flaky"):
        client.clear_partition("p")
    assert "p" not in client.get_partition_list()  # the metadata is gone at once
    assert len(_data_keys(client, pk)) == 16  # the bytes are not...
    assert _trash(client, pk) == (8, {"x", "y"})  # ...and they are remembered

    client.clear_partition("p")  # the store is back: this clear finishes the job
    _assert_all_deleted(client, pk)


def test_repeating_clear_samples_retries_a_delete_that_failed(flaky_client):
    client, pk = flaky_client
    meta = client.put(_batch(), partition_id="p")
    part = meta.select_samples([1, 3, 5])
    store = _store(client)
    store.delete = _Flaky(store.delete)
    with pytest.raises(StorageUnavailable):
        client.clear_samples(part)
    assert _trash(client, pk) == (3, {"x", "y"})
    assert len(_data_keys(client, pk)) == 16

    client.clear_samples(part)
    assert len(_data_keys(client, pk)) == 10  # the five samples left keep their two fields
    assert not client.redis.exists(pk.trash)
    rest = client.get_data(meta.select_samples([0, 2, 4, 6, 7]))
    assert torch.equal(rest["x"], _batch()["x"][[0, 2, 4, 6, 7]])


def test_a_put_that_fails_after_writing_deletes_what_it_wrote(flaky_client):
    client, pk = flaky_client
    store = _store(client)
    store.put = _Flaky(store.put, after=True)  # bytes land, then the put reports a failure
    with pytest.raises(StorageUnavailable):
        client.put(_batch(), partition_id="p")
    _assert_all_deleted(client, pk)


def test_a_failed_put_whose_cleanup_fails_too_is_retried_by_the_next_clear(flaky_client):
    client, pk = flaky_client
    client.put(_batch(2), partition_id="p")  # the partition exists with two samples
    store = _store(client)
    store.put = _Flaky(store.put, after=True)
    store.delete = _Flaky(store.delete)
    with pytest.raises(StorageUnavailable) as info:
        client.put(_batch(), partition_id="p")
    assert any("the next clear of partition 'p' deletes them" in note for note in getattr(info.value, "__notes__", []))
    assert _trash(client, pk) == (8, {"x", "y"})
    assert len(_data_keys(client, pk)) == 4 + 16

    client.clear_partition("p")
    _assert_all_deleted(client, pk)


def test_status_shows_bytes_awaiting_deletion(flaky_client):
    from tq_redis.monitor import status

    client, pk = flaky_client
    client.put(_batch(), partition_id="p")
    store = _store(client)
    store.delete = _Flaky(store.delete)
    with pytest.raises(StorageUnavailable):
        client.clear_partition("p")
    snap = status.snapshot(client.redis, pk.ns)
    assert snap["pending_deletes"] == {"p": 8}
    assert "the bytes of 8 cleared sample(s) are not deleted yet" in status.render(snap)
    client.clear_partition("p")
    assert status.snapshot(client.redis, pk.ns)["pending_deletes"] == {}
