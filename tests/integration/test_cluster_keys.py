"""Multi-key work grouped per hash slot, keys found through registries: the ``redis`` store,
checkpoints and ``Channel.delete`` on a 3-master cluster (embedded Valkey)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.backends.redis_inline import RedisInlineStore
from tq_redis.errors import ChannelNotFound, DataMissing
from tq_redis.meta.keys import PartitionKeys, by_slot
from tq_redis.server.embedded_cluster import EmbeddedCluster


@pytest.fixture(scope="module")
def cluster():
    c = EmbeddedCluster(masters=3).start()
    yield c
    c.stop()


def test_redis_store_spreads_one_batch_over_many_slots(cluster, namespace):
    store = RedisInlineStore(cluster.url)
    try:
        keys = [k for p in range(12) for k in PartitionKeys(namespace, f"p{p}").data_keys(range(700), "x")]
        assert len(by_slot(keys)) == 12  # a chunk of 512 keys would span slots without the grouping
        values = [[b"v%d" % i] for i in range(len(keys))]
        store.put(keys, values)
        assert [bytes(v) for v in store.get(keys[::-1])] == [v[0] for v in values[::-1]]
        store.delete(keys)
        with pytest.raises(DataMissing):
            store.get(keys[:1])
    finally:
        store.close()


def test_checkpoint_round_trip_on_a_cluster(cluster, namespace, tmp_path):
    tq.init({"redis": {"url": cluster.url}, "namespace": namespace, "storage": {"backend": "redis"}})
    try:
        client = tq.get_client()
        for p in range(5):
            client.put(TensorDict({"x": torch.arange(3) + p}, [3]), partition_id=f"p{p}")
        tq.save_checkpoint(tmp_path / "ckpt")
        for p in range(5, 8):  # stale partitions on other slots: load deletes them per slot
            client.put(TensorDict({"x": torch.arange(3)}, [3]), partition_id=f"p{p}")
        client.clear_partition("p1")
        tq.load_checkpoint(tmp_path / "ckpt", replace=True)
        assert client.get_partition_list() == [f"p{p}" for p in range(5)]
        meta = client.get_meta(["x"], 3, "p1", mode="force_fetch")
        assert client.get_data(meta)["x"].tolist() == [1, 2, 3]
    finally:
        tq.close()


def test_channel_delete_on_a_cluster_touches_only_its_channel(cluster, namespace):
    star = tq.Channel.create("a*", redis_url=cluster.url, namespace=namespace)
    other = tq.Channel.create("ab", redis_url=cluster.url, namespace=namespace)
    try:
        star.put(torch.ones(2))
        star.put("s", key="k")
        other.put("keep")
        star.delete()
        assert other.get_nowait() == "keep"
        with pytest.raises(ChannelNotFound):
            tq.Channel.connect("a*", redis_url=cluster.url, namespace=namespace)
    finally:
        other.close()
