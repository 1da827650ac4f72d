"""The metadata plane on a 3-master Redis Cluster (Valkey, and Redis 7.0 where installed).

One URL of any node is all a client gets. Partitions land on different shards (asked of the
cluster with CLUSTER KEYSLOT / CLUSTER SLOTS, and checked on the owning node itself); every
operation, both clients, waiting, samplers and leases work across them; a primary that lost the
function library is repaired on first use; every Lua script runs on the cluster without a
cross-slot error (the servers refuse a function that touches a key outside its first key's slot).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest
import torch
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client
from tests.procs import up_attach
from tq_redis import Channel, GRPOTransferDock
from tq_redis.client import plans
from tq_redis.errors import ConfigError, RateLimited
from tq_redis.meta import BatchMeta
from tq_redis.meta.keys import PartitionKeys, config_key
from tq_redis.ops import streaming, transitions
from tq_redis.samplers import BaseSampler
from tq_redis.server import library as scripts

PARTITIONS = [f"step{i}" for i in range(8)]


def _put(client, n: int, partition: str, start: int = 0) -> BatchMeta:
    td = TensorDict({"x": torch.arange(start, start + n), "y": torch.ones(n, 2)}, batch_size=[n])
    return client.put(td, partition_id=partition)


def _tag(client, meta: BatchMeta, rows: list[dict]) -> None:
    meta = meta.copy()
    meta.update_custom_meta(rows)
    client.set_custom_meta(meta)


def _owners(cluster, namespace: str, partitions) -> dict[str, str]:
    return {p: cluster.owner_url(PartitionKeys(namespace, p).meta) for p in partitions}


# ------------------------------------------------------------------ the data path across shards


def test_partitions_spread_over_shards_and_each_one_works(cluster, cluster_client, namespace):
    client = cluster_client
    owners = _owners(cluster, namespace, PARTITIONS)
    assert len(set(owners.values())) == 3, f"8 partitions should use all 3 shards: {owners}"
    for k, p in enumerate(PARTITIONS):
        _put(client, 6, p, start=10 * k)
    for k, p in enumerate(PARTITIONS):
        node = cluster.node_client(owners[p])
        try:  # the partition's keys live on the shard that owns its slot, nowhere else
            assert node.exists(PartitionKeys(namespace, p).meta) == 1
        finally:
            node.close()
        meta = client.get_meta(["x", "y"], 4, p, task_name="train")
        assert meta.global_indexes == [0, 1, 2, 3]
        data = client.get_data(meta)
        assert data["x"].tolist() == [10 * k + i for i in range(4)] and data["y"].shape == (4, 2)
    assert sorted(client.get_partition_list()) == sorted(PARTITIONS)
    # production / consumption status, clears
    assert client.check_production_status(["x", "y"], "step0")
    assert not client.check_consumption_status("train", "step0")
    client.clear_samples(client.get_meta(["x"], 2, "step0", mode="force_fetch")[0:2])
    assert client.get_meta(["x"], 8, "step0", mode="force_fetch").global_indexes == [2, 3, 4, 5]
    for p in PARTITIONS[4:]:
        client.clear_partition(p)
        client.clear_partition(p)  # idempotent
    assert sorted(client.get_partition_list()) == sorted(PARTITIONS[:4])
    assert client.get_meta(["x"], 2, "step1", task_name="train").global_indexes == [4, 5]
    assert client.check_consumption_status("train", "step1")


def test_samplers_and_leases(cluster_client):
    client = cluster_client
    meta = _put(client, 16, "s")
    _tag(client, meta, [{"total_lengths": 10 * (i % 4 + 1), "policy_version": i % 3, "uid": i // 4}
                        for i in range(16)])
    assert client.get_meta(["x"], 3, "s", task_name="seq").global_indexes == [0, 1, 2]
    grpo = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": 4}
    assert client.get_meta(["x"], 8, "s", task_name="grpo", sampling_config=grpo).global_indexes == list(range(8))
    rank = {"sampler": "RankAwareSampler", "dp_rank": 0, "batch_index": 0}
    first = client.get_meta(["x"], 4, "s", task_name="dp", sampling_config=rank)
    assert client.get_meta(["x"], 4, "s", task_name="dp", sampling_config=rank).global_indexes == first.global_indexes
    balanced = {"sampler": "SeqlenBalancedSampler", "dp_size": 2, "batch_index": 0, "n_samples_per_prompt": 4}
    parts = [client.get_meta(["x"], 4, "s", task_name="bal", sampling_config={**balanced, "dp_rank": r})
             for r in range(2)]
    assert sorted(parts[0].global_indexes + parts[1].global_indexes) == list(range(8))
    budget = client.get_meta(["x"], 16, "s", task_name="tok", sampling_config={"max_tokens": 60})
    assert 0 < budget.size and sum(10 * (i % 4 + 1) for i in budget.global_indexes) <= 60
    fresh = client.get_meta(["x"], 5, "s", task_name="fresh", sampling_config={"min_policy_version": 2})
    assert fresh.global_indexes == [i for i in range(16) if i % 3 == 2]

    class Odds(BaseSampler):
        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            chosen = [i for i in ready_indexes if i % 2][:batch_size]
            return chosen, chosen

    assert client.get_meta(["x"], 3, "s", task_name="user", sampling_config={"sampler": Odds()}).global_indexes == [
        1, 3, 5]
    # leases: ack, nack (handed out again), a lapsed lease taken over
    _put(client, 2, "lease")
    leased = client.get_meta(["x"], 2, "lease", task_name="t", lease_s=30)
    assert leased.global_indexes == [0, 1] and client.extend_lease(leased, 60) is None
    assert client.ack(leased[0:1]) is None and client.nack(leased[1:]) == []
    again = client.get_meta(["x"], 1, "lease", task_name="t", lease_s=0.05)
    assert again.global_indexes == [1] and again.get_extra_info("delivery_counts") == [2]
    taken = client.get_meta(["x"], 1, "lease", task_name="t", lease_s=30, timeout=10)
    assert taken.global_indexes == [1] and taken.get_extra_info("delivery_counts") == [3]
    assert client.ack(taken) is None and client.check_consumption_status("t", "lease")
    assert client.reset_consumption("s", "seq")
    assert client.get_meta(["x"], 1, "s", task_name="seq").global_indexes == [0]


def test_waiting_get_meta_is_woken_by_a_put(cluster, namespace):
    producer = make_client(cluster.url, namespace)
    consumer = make_client(cluster.urls[1], namespace)
    owner = cluster.node_client(cluster.owner_url(PartitionKeys(namespace, "w").meta))
    result: dict = {}

    def consume():
        result["meta"] = consumer.get_meta(["x"], 4, "w", task_name="t", timeout=20)
        result["returned"] = time.monotonic()

    def blocked() -> bool:
        return any(e.get("cmd") == "blpop" for e in owner.client_list())

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 10
    while not blocked():  # polling an observable condition of the server, not timing
        assert time.monotonic() < deadline, "the consumer never blocked on the partition's shard"
        time.sleep(0.005)
    put_at = time.monotonic()
    _put(producer, 4, "w")
    thread.join(20)
    assert result["meta"].global_indexes == [0, 1, 2, 3]
    assert result["returned"] - put_at < 10.0  # woken by the put, well before the 20 s timeout
    for c in (producer, consumer, owner):
        c.close()


# ------------------------------------------------------------------ KV, status, asyncio, channel


def test_kv_api_across_shards(cluster, cluster_client, namespace):
    client = cluster_client
    a, b = _spread_pair(cluster, namespace)
    client.kv_put("k0", a, {"v": torch.tensor([1, 2])}, tag={"score": 1})
    client.kv_batch_put(["k1", "k2"], b, TensorDict({"v": torch.tensor([[3, 4], [5, 6]])}, [2]),
                        tags=[{"score": 2}, {"score": 3}])
    assert client.kv_batch_get(["k2", "k1"], b)["v"].tolist() == [[5, 6], [3, 4]]
    assert client.kv_list() == {a: {"k0": {"score": 1}}, b: {"k1": {"score": 2}, "k2": {"score": 3}}}
    assert client.kv_retrieve_meta(["k0"], a).global_indexes == [0]
    assert client.kv_retrieve_keys([1], b) == ["k2"]
    client.kv_clear(["k1"], b)
    assert client.kv_list(b) == {b: {"k2": {"score": 3}}}


def _spread_pair(cluster, namespace: str) -> tuple[str, str]:
    owners = _owners(cluster, namespace, PARTITIONS)
    a = PARTITIONS[0]
    return a, next(p for p in PARTITIONS if owners[p] != owners[a])


def test_status_cli_reads_a_cluster_through_any_node(cluster, cluster_client, namespace):
    a, b = _spread_pair(cluster, namespace)
    _put(cluster_client, 5, a)
    _put(cluster_client, 3, b)
    for p in (a, b):  # nacked, so the next claim redelivers it: counted in the partition's own slot
        cluster_client.nack(cluster_client.get_meta(["x"], 1, p, task_name="actor", lease_s=60))
    cluster_client.get_meta(["x"], 1, a, task_name="actor", lease_s=60)
    cluster_client.get_meta(["x"], 2, b, task_name="actor", lease_s=60)
    cluster_client.clear_partition(a)  # its counters stay (like its seq)
    out = subprocess.run([sys.executable, "-m", "tq_redis.cli.main", "status", "--json", "--redis", cluster.urls[2],
                          "--namespace", namespace], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    parts = {p["id"]: p for p in snap["partitions"]}
    assert a not in parts and parts[b]["samples"] == 3
    assert parts[b]["tasks"]["actor"]["in_flight"] == 2 and parts[b]["tasks"]["actor"]["redeliveries"] == 1
    once = {"actor": {"lease_expiries": 0, "redeliveries": 1, "poisoned": 0}}
    assert snap["counters"]["partitions"] == {a: once, b: once}
    assert snap["counters"]["total"]["redeliveries"] == 2


def test_async_client_across_shards(cluster, namespace):
    from tq_redis import AsyncTransferQueueClient

    make_client(cluster.url, namespace).close()  # records the namespace's store
    a, b = _spread_pair(cluster, namespace)

    async def main():
        client = AsyncTransferQueueClient(cluster.urls[1], namespace, nested_output=False)
        waiting = asyncio.ensure_future(client.async_get_meta(["x"], 3, b, task_name="t", timeout=20))
        await client.async_put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id=a)
        await client.async_put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id=b)
        woken = await waiting
        got = await client.async_get_meta(["x"], 3, a, task_name="t")
        data = await client.async_get_data(got)
        await client.async_clear_partition(a)
        parts = await client.async_get_partition_list()
        await client.async_close()
        return woken.global_indexes, data["x"].tolist(), parts

    woken, data, parts = asyncio.run(main())
    assert woken == [0, 1, 2] and data == [0, 1, 2] and parts == [b]


def test_channel_put_get_on_a_cluster(cluster, namespace):
    chan = Channel.create(f"{namespace}-ch", maxsize=4, redis_url=cluster.url)
    try:
        handles = [chan.put({"i": i}, weight=1, async_op=True) for i in range(4)]
        for h in handles:
            h.wait()
        assert chan.qsize() == 4 and chan.full()
        assert [chan.get()["i"] for _ in range(2)] == [0, 1]
        assert [item["i"] for item in chan.get_batch(2)] == [2, 3]
        assert chan.empty()
    finally:
        chan.close()


# ------------------------------------------------------------------ library repair


def _primary_owning(cluster, namespace: str) -> tuple[str, list[str]]:
    """A primary that owns some of PARTITIONS, and the partitions it owns."""
    owners = _owners(cluster, namespace, PARTITIONS)
    url = owners[PARTITIONS[0]]
    return url, [p for p in PARTITIONS if owners[p] == url]


def _flush_library(cluster, url: str) -> None:
    node = cluster.node_client(url)
    try:
        node.execute_command("FUNCTION", "FLUSH")
        assert node.execute_command("FUNCTION", "LIST") == []
    finally:
        node.close()


def _library_on(cluster, url: str) -> bool:
    node = cluster.node_client(url)
    try:
        return [lib[b"library_name"] for lib in node.execute_command("FUNCTION", "LIST")] == [b"tq_redis"]
    finally:
        node.close()


def test_a_primary_that_lost_the_library_is_repaired_on_first_use(cluster, cluster_client, namespace):
    client = cluster_client
    six = PARTITIONS[:6]
    for p in six:  # loads the library on every primary
        _put(client, 4, p)
    url, owned = _primary_owning(cluster, namespace)
    assert owned
    _flush_library(cluster, url)
    # pipelined calls (insert + registry) and plain function calls, across every shard
    for p in six:
        assert _put(client, 2, p).global_indexes == [4, 5]
    assert _library_on(cluster, url)
    _flush_library(cluster, url)
    assert [client.get_meta(["x"], 2, p, task_name="t").size for p in six] == [2] * 6
    assert _library_on(cluster, url)


def test_async_client_repairs_the_library_too(cluster, namespace):
    from tq_redis import AsyncTransferQueueClient

    make_client(cluster.url, namespace).close()
    url, _ = _primary_owning(cluster, namespace)

    async def main():
        client = AsyncTransferQueueClient(cluster.url, namespace)
        for p in PARTITIONS[:6]:
            await client.async_put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id=p)
        _flush_library(cluster, url)
        sizes = [(await client.async_get_meta(["x"], 2, p, task_name="t")).size for p in PARTITIONS[:6]]
        await client.async_close()
        return sizes

    assert asyncio.run(main()) == [2] * 6
    assert _library_on(cluster, url)


# ------------------------------------------------------------------ every script, no cross-slot access


def test_every_script_runs_on_a_cluster_without_cross_slot_access(cluster, cluster_client, namespace, monkeypatch):
    """Each function touches only keys of its first key's slot, or the server would refuse it."""
    called: set[str] = set()
    fcall_args = plans._fcall_args

    def recording(call):
        called.add(call.name)
        return fcall_args(call)

    monkeypatch.setattr(plans, "_fcall_args", recording)  # every function call, pipelined or not
    client = cluster_client
    meta = _put(client, 8, "all")
    client.put(TensorDict({"z": torch.ones(2)}, batch_size=[2]), metadata=meta[0:2])
    _tag(client, meta, [{"uid": i // 2} for i in range(8)])
    client.get_data(meta[0:2])
    parts = client.append_parts(meta[2:4], {"r": torch.ones(2, 3, dtype=torch.int64)}, 0)  # store: alloc, append
    client.get_data(client.complete_parts(parts, ["r"]).select_fields(["r"]))  # read the parts
    small = make_client(cluster.url, namespace, inline_max_bytes=4096)  # values kept in the metadata plane
    try:
        small.get_data(small.put(TensorDict({"s": torch.ones(2, 1)}, batch_size=[2]), partition_id="small"))
        meta, data = small.get_meta_and_data(["s"], 2, "small", task_name="t")  # the claim returns the values
        assert list(meta.global_indexes) == [0, 1] and torch.equal(data["s"], torch.ones(2, 1))
    finally:
        small.close()

    class First(BaseSampler):
        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            return ready_indexes[:batch_size], ready_indexes[:batch_size]

    client.get_meta(["x"], 1, "all", task_name="user", sampling_config={"sampler": First()})
    # a user sampler that finds too few waits on the partition (registers with the wait script)
    client.get_meta(["x"], 100, "all", task_name="user", sampling_config={"sampler": First()}, timeout=0.05)
    client.run(streaming.progress(client.context, "all", "t", ["x"]))
    client.run(transitions.trash_add(client.context.keys("all"), [7], ["x"]).call())  # a failed put's bytes
    client.run(transitions.read_registry(namespace).call())  # the dram store's view of its nodes
    leased = client.get_meta(["x"], 2, "all", task_name="t", lease_s=30)
    client.ack(leased)
    taken = client.get_meta(["x"], 1, "all", task_name="back")  # a claim durable mode could not confirm
    keys = client.context.keys("all")
    assert client.run(transitions.unclaim(keys, "back", taken.global_indexes, [0]).call()) == 1
    assert list(client.get_meta(["x"], 1, "all", task_name="back").global_indexes) == list(taken.global_indexes)
    client.get_meta(["x"], 100, "all", task_name="t", timeout=0.05)  # waits, then gives up
    client.get_consumption_status("t", "all")
    client.reset_consumption("all", "t")
    client.get_meta(["x"], 1, "all", task_name="t", sampling_config={"max_times_sampled": 2})  # replay counts
    client.update_priority("all", [3, 4], [2.0, 0.5])  # the prioritized sampler's priorities
    client.get_meta(["x"], 2, "all", task_name="per", sampling_config={"sampler": "PrioritizedSampler"})
    client.kv_put("k", "kv", {"v": torch.tensor([1])})
    client.kv_list("kv")
    client.kv_clear(["k"], "kv")
    cursor = client.kv_watch("kv").cursor  # the tag-change stream (lua/tag_changes.lua)
    client.kv_put("w", "kv", tag={"n": 1})
    watched = client.kv_watch("kv", cursor)
    assert watched.keys == ["w"]
    assert len(client.kv_watch("kv", watched.cursor, timeout=0.05)) == 0  # blocks on the stream, gives up
    client.clear_partition("kv")  # leaves the stream's `dropped` entry
    client.set_staleness_bound("rl", 1, 4)  # group reservations (docs/async-rl.rst)
    client.set_policy_version("rl", 1)
    client.commit_group(client.reserve_group("rl", 2), TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]))
    client.abort_group(client.reserve_group("rl", 2))
    client.set_rate_limit("lim", "t", 1.0, error_buffer=1, insert_timeout=0.05)  # samples-per-insert limiter
    _put(client, 2, "lim")
    with pytest.raises(RateLimited):  # held back: registers, waits for a wake token, gives up
        _put(client, 1, "lim")
    client.get_meta(["x"], 1, "lim", task_name="t", sampling_config={"sampler": First()})  # counted (claim_ids)
    client.get_meta(["x"], 1, "lim", task_name="t")  # counted by the claim script
    client.set_rate_limit("lim", "t", None)
    shared = client.put_shared({"img": torch.ones(1, 3)}, _put(client, 2, "all"))  # a group-shared field
    assert torch.equal(client.get_data(shared)["img"], torch.ones(2, 3))
    client.put({"img": torch.zeros(1, 3)}, metadata=shared[0:1])  # a rewrite drops a member's share
    client.seal_partition("all")
    client.clear_samples(meta[0:2])
    client.clear_partition("all")
    # MindSpeed's dock with partial rollout: its shape, marks, hand-backs, ready mask and re-sort are scripts too
    dock = GRPOTransferDock(2, 2, None, 2, 2, redis_url=cluster.url, namespace=namespace)
    try:
        dock.put_experience({"prompts": [torch.tensor([r]) for r in range(4)],
                             "prompt_length": [torch.tensor([1])] * 4}, [0, 1, 2, 3], is_prompt=True)
        _, rows = dock.get_experience("actor_rollout", ["prompts"], 4, get_n_samples=False)  # responses unwritten
        dock.put_experience({"responses": [torch.tensor([7])] * 4, "response_length": [torch.tensor([1])] * 4,
                             "input_ids": [torch.tensor([1])] * 4,
                             "rollout_completed": [torch.tensor([c]) for c in (1, 1, 0, 0)]}, rows)  # hand-back
        assert not dock.get_update_ready(require_max_age_all_finished=False)  # the ready mask: 1 prompt < 2
        dock.get_experience("actor_train", ["prompts"], indexes=[0, 1])  # a read by index marks its rows
        assert dock.prefetch_request_index(3) == [0, 1, 2]  # the dock's cursors
        dock.update_metrics("reward", 1.0)  # its log of metric updates
        dock.clear("actor_train")  # rows 2, 3 become rows 0, 1; the cursor and log go
        assert dock.get_experience_status()["prompts"].tolist() == [1, 1, 0, 0] and dock.get_cur_index() == 0
    finally:
        dock.close()
    chan = Channel.create(f"{namespace}-all", redis_url=cluster.url)
    try:
        chan.put("a", weight=1)
        chan.put("b", weight=1)
        chan.get()
        chan.get_batch(1)
    finally:
        chan.close()
    assert called == set(scripts.script_names()), f"not run on the cluster: {set(scripts.script_names()) - called}"


# ------------------------------------------------------------------ init and the cluster switch


def test_init_with_any_nodes_url(cluster, namespace):
    cfg = tq.init({"redis": {"url": cluster.urls[2]}, "namespace": namespace, "storage": {"backend": "redis"}})
    try:
        assert cfg["redis"]["url"] == cluster.urls[2]
        tq.kv_batch_put(["a", "b"], "p", TensorDict({"v": torch.tensor([7, 8])}, [2]))
        assert tq.kv_batch_get(["b", "a"], "p")["v"].tolist() == [8, 7]
        client = tq.get_client()
        assert json.loads(client.redis.hget(config_key(namespace), "storage"))["backend"] == "redis"
    finally:
        tq.close()


def test_forcing_a_single_server_client_onto_a_cluster_is_a_clear_error(cluster, namespace, monkeypatch):
    monkeypatch.setenv("TQ_REDIS_CLUSTER", "0")
    owners = _owners(cluster, namespace, PARTITIONS)
    url = next(u for u in cluster.urls if u != owners[PARTITIONS[0]])  # a node that does not own step0
    client = tq.TransferQueueClient(url, namespace)
    try:
        with pytest.raises(ConfigError, match="cluster node.*TQ_REDIS_CLUSTER"):
            client.get_meta(["x"], 1, PARTITIONS[0], mode="force_fetch")
    finally:
        client.close()
    with pytest.raises(ConfigError, match="cluster node"):
        tq.init({"redis": {"url": url, "cluster": False}, "namespace": namespace,
                 "storage": {"backend": "redis"}, "sampler": "SequentialSampler"})
        # ns:config may live on this very node: then the error comes with the first call elsewhere
        tq.get_client().get_meta(["x"], 1, PARTITIONS[0], mode="force_fetch")
    tq.close()


def test_detection_is_asked_once_per_url(cluster, valkey):
    from tq_redis.server import connections

    assert connections.detect_cluster(cluster.urls[1]) is True
    assert connections._detected[cluster.urls[1]] is True
    assert connections.detect_cluster(valkey.url) is False
    single = connections.sync_client(valkey.url)
    assert isinstance(single, connections.SingleClient)
    single.close()


def test_forcing_a_cluster_client_onto_a_single_server_is_a_clear_error(valkey, namespace, monkeypatch):
    from tq_redis import AsyncTransferQueueClient

    monkeypatch.setenv("TQ_REDIS_CLUSTER", "true")
    with pytest.raises(ConfigError, match="single server, not a cluster node.*TQ_REDIS_CLUSTER=1"):
        tq.TransferQueueClient(valkey.url, namespace)

    async def main():
        client = AsyncTransferQueueClient(valkey.url, namespace)  # connects on first use
        try:
            await client.async_get_partition_list()
        finally:
            await client.async_close()

    with pytest.raises(ConfigError, match="single server, not a cluster node"):
        asyncio.run(main())


def test_up_cluster_serves_a_cluster_and_storage_nodes_until_interrupted():
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "tq_redis.cli.main", "up", "--cluster", "3", "--units", "1",
                             "--capacity", "64MiB", "--namespace", "upc"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner, url = up_attach(proc)
        assert banner.startswith("tq-redis up: redis://:***@") and "3-master cluster" in banner, banner
        client = tq.TransferQueueClient(url, "upc")
        owners = {client.redis.get_node_from_key(PartitionKeys("upc", p).meta).name for p in PARTITIONS}
        assert len(client.redis.get_primaries()) == 3 and len(owners) == 3
        for p in PARTITIONS[:4]:
            meta = client.put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id=p)
            assert client.get_data(meta)["x"].tolist() == [0, 1, 2]
        assert len(client.redis.hgetall("upc:storage:nodes")) == 1
        client.close()
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and "stopped" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
