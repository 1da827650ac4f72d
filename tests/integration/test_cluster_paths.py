"""The paths above the metadata plane on a 3-master Redis Cluster (Valkey, and Redis 7.0 where installed):
GRPOTransferDock (MindSpeed-RL's calls), StreamingDataset / StreamingDataLoader, checkpoints and the demo.

Each case puts its partitions (docks, steps) on all three shards and asks the cluster which shard owns
each (``CLUSTER KEYSLOT`` / ``CLUSTER SLOTS``), so a path that only worked on one shard, or that sent a
multi-key command across slots, fails here. Clients get the URL of one node only, not always the first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from redis.crc import key_slot
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client
from tests.procs import mp_context
from tests.records import without_records
from tq_redis import GRPOTransferDock
from tq_redis.backends.dram.launcher import spawn_node
from tq_redis.meta.keys import PartitionKeys, config_key

DOCK_NAMES = ("b", "c", "d")  # partitions dock.b / dock.c / dock.d: one per shard of 3
STEPS = ("step_0", "step_1", "step_2")  # the demo's and the loader's partitions: one per shard of 3
SPREAD = ("p3", "p2", "p0")  # checkpointed partitions: one per shard of 3


@pytest.fixture
def namespace(cluster) -> str:
    """A fresh namespace in which each name set above puts one partition on every shard: the
    namespace is part of every partition's hash tag, so which shard a name lands on depends on it."""
    table = cluster.node_client(cluster.url).execute_command("CLUSTER", "SLOTS")
    ranges = [(int(r[0]), int(r[1]), (r[2][0].decode() if isinstance(r[2][0], bytes) else r[2][0], int(r[2][1])))
              for r in table]  # fmt: skip

    def shard(key: str) -> tuple:
        slot = key_slot(key.encode())
        return next(owner for first, last, owner in ranges if first <= slot <= last)

    sets = [[f"dock.{d}" for d in DOCK_NAMES], list(STEPS), list(SPREAD)]
    for _ in range(100_000):
        ns = f"t{uuid.uuid4().hex[:10]}"
        if all(len({shard(PartitionKeys(ns, p).meta) for p in names}) == len(ranges) for names in sets):
            return ns
    raise AssertionError("no namespace spreads the test's partitions over every shard")


def _owners(cluster, keys: dict[str, str]) -> dict[str, str]:
    """Name -> URL of the primary owning that name's key, asked of the cluster."""
    return {name: cluster.owner_url(key) for name, key in keys.items()}


def _assert_on_every_shard(cluster, namespace: str, partitions) -> None:
    owners = _owners(cluster, {p: PartitionKeys(namespace, p).meta for p in partitions})
    assert set(owners.values()) == set(cluster.urls), f"expected one partition per shard: {owners}"


def _blocked_on(node, command: str) -> bool:
    """Whether some client of ``node`` is blocked in ``command`` right now."""
    return any(e.get("cmd") == command and "b" in e.get("flags", "") for e in node.client_list())


def _wait_blocked(node, command: str, what: str) -> None:
    deadline = time.monotonic() + 10
    while not _blocked_on(node, command):  # polling an observable condition of the server, not timing
        assert time.monotonic() < deadline, f"{what} never blocked on its shard"
        time.sleep(0.005)


# ------------------------------------------------------------------ waits longer than a socket timeout

LONG_WAIT_S = 6.0  # longer than redis-py 8's default socket timeout (5 s)


def test_a_get_meta_wait_longer_than_5_s_returns_empty_after_its_timeout(cluster_client, namespace):
    """A consumer may wait longer than any socket timeout: the blocked call is the wait itself
    (redis-py 8 reads with a 5 s timeout by default; tq-redis's connections do not)."""
    started = time.monotonic()
    meta = cluster_client.get_meta(["x"], 1, "idle", task_name="t", timeout=LONG_WAIT_S)
    waited = time.monotonic() - started
    assert meta.size == 0 and LONG_WAIT_S - 0.1 <= waited < LONG_WAIT_S + 3, waited


# ------------------------------------------------------------------ GRPOTransferDock


def _prompt_rows(prompts: range) -> TensorDict:
    """One row per prompt (MindSpeed puts prompts already repeated; ``repeat_prompts`` does it here)."""
    return TensorDict.from_dict({
        "prompts": torch.stack([torch.full((3,), 100 * p) for p in prompts]),
        "prompt_length": torch.tensor([[p % 3 + 1] for p in prompts]),
    })


def test_docks_on_every_shard_serve_mindspeed_calls(cluster, namespace):
    make_client(cluster.url, namespace).close()  # records the namespace's store
    docks = [GRPOTransferDock(2, 2, None, 1, 0, None, ["critic"], redis_url=cluster.urls[k], namespace=namespace,
                              name=name) for k, name in enumerate(DOCK_NAMES)]
    try:
        owners = _owners(cluster, {d.name: d._pk.meta for d in docks})
        assert set(owners.values()) == set(cluster.urls), owners
        for k, dock in enumerate(docks):
            assert dock.put_experience(_prompt_rows(range(2)), repeat_prompts=True) == [0, 1, 2, 3]
            assert dock.prefetch_request_index(3) == [0, 1, 2] and dock.get_cur_index() == 3
            batch, rows = dock.get_experience("actor_rollout", ["prompts"], 2)  # MindSpeed's padded default
            assert rows == [0, 1] and batch["prompts"].tolist() == [[0, 0, 0]] * 2
            assert batch["original_length"].tolist() == [3, 3]
            # responses of different lengths; a half-done prompt is never handed out
            dock.put_experience({"responses": [torch.ones(n + 1, dtype=torch.long) * k for n in range(3)],
                                 "response_length": torch.tensor([[1], [2], [3]])}, indexes=[0, 1, 2])
            assert dock.get_incomplete_response_num().item() == 1
            _, rows = dock.get_experience("critic", ["responses"], 2)
            assert rows == [0, 1] and dock.get_experience("critic", ["responses"], 2) == (None, None)
            last = {"responses": [torch.ones(4, dtype=torch.long)], "response_length": torch.tensor([[4]])}
            dock.put_experience(last, indexes=[3])
            # seqlen balance (a client-side choice claimed if still free) and reads by index
            _, rows = dock.get_experience("actor_train", ["responses"], 2, get_n_samples=False,
                                          use_batch_seqlen_balance=True)
            assert len(rows) == 2
            batch, rows = dock.get_experience("trainer", ["responses", "prompts"], indexes=[3, 1], layout="jagged")
            assert rows == [3, 1] and [len(r) for r in batch["responses"].unbind()] == [4, 2]
            dock.update_metrics("reward", [k], cumulate=True)
            dock.update_metrics(value={"reward": [k + 10]}, cumulate=True)
            assert dock.get_metrics().metric["reward"] == [k, k + 10]
            assert dock.get_consumer_status()["trainer"].tolist() == [0, 1, 0, 1]
            assert dock.get_update_ready()
        for dock in docks:
            _, rows = dock.get_experience("critic", ["responses"], 2, timeout=5)
            assert rows == [2, 3] and dock.all_consumed("critic") and not dock.all_consumed("actor_train")
            dock.clear()
            assert dock.get_consumer_status()["critic"].sum() == 0 and dock.get_cur_index() == 0
            assert dock.put_experience(_prompt_rows(range(1)), repeat_prompts=True) == [0, 1]
    finally:
        for dock in docks:
            dock.close()


def test_a_read_by_index_waits_on_its_shard_and_wakes_on_a_put_elsewhere(cluster, namespace):
    make_client(cluster.url, namespace).close()
    reader = GRPOTransferDock(2, 2, redis_url=cluster.urls[0], namespace=namespace, name="c", layout="jagged")
    writer = GRPOTransferDock(2, 2, redis_url=cluster.urls[1], namespace=namespace, name="c")
    owner = cluster.node_client(cluster.owner_url(reader._pk.meta))
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=reader.get_experience("trainer", ["rm_scores"], indexes=[2])))
    try:
        thread.start()
        _wait_blocked(owner, "xread", "the read by index")
        assert "r" not in out
        writer.put_experience({"rm_scores": torch.tensor([0.25])}, indexes=[2])
        thread.join(10)
        td, rows = out["r"]
        assert rows == [2] and td["rm_scores"].tolist() == [0.25]
    finally:
        thread.join(10)
        for c in (reader, writer, owner):
            c.close()


def _dock_stage(docks: list, consumer: str, out) -> None:
    """Claim whole prompts from every dock (each arrived pickled: it attaches by address) until all are consumed."""
    got: dict[str, list[int]] = {d.name: [] for d in docks}
    while not all(d.all_consumed(consumer) for d in docks):
        for dock in docks:
            td, rows = dock.get_experience(consumer, ["prompts"], 2, timeout=0.2, layout="jagged")
            if rows is not None:
                assert [int(r[0]) // 100 for r in td["prompts"].unbind()] == [i // 2 for i in rows]
                got[dock.name].extend(rows)
    out.put(got)
    for dock in docks:
        dock.close()


def test_processes_share_docks_on_every_shard_and_claim_each_row_once(cluster, namespace):
    make_client(cluster.url, namespace).close()
    prompts = 12
    docks = [GRPOTransferDock(prompts, 2, redis_url=cluster.urls[k], namespace=namespace, name=name)
             for k, name in enumerate(DOCK_NAMES)]
    ctx = mp_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_dock_stage, args=(docks, "actor_train", out)) for _ in range(3)]
    try:
        for p in procs:
            p.start()
        for start in range(0, prompts, 3):
            for dock in docks:
                dock.put_experience(_prompt_rows(range(start, start + 3)), repeat_prompts=True)
        got = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        for dock in docks:  # every row once across the processes: nothing lost, nothing twice
            assert sorted(i for g in got for i in g[dock.name]) == list(range(prompts * 2)), dock.name
            assert dock.get_consumer_status()["actor_train"].tolist() == [1] * prompts * 2
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for dock in docks:
            dock.close()


# ------------------------------------------------------------------ StreamingDataset / StreamingDataLoader


def _put_rows(client, partition: str, start: int, n: int) -> None:
    x = torch.arange(start, start + n)
    resp = torch.nested.nested_tensor([torch.full((int(i) % 3 + 1,), int(i)) for i in x], layout=torch.jagged)
    client.put(TensorDict({"x": x, "resp": resp}, batch_size=[n]), partition_id=partition)


def _rows_ok(td, meta) -> list[int]:
    """The rows' ``x``, after checking each jagged row and that the metadata names the same rows."""
    values = td["x"].tolist()
    for value, row in zip(values, td["resp"].unbind()):
        assert row.tolist() == [value] * (value % 3 + 1)
    assert [v % 1000 for v in values] == meta.global_indexes
    return values


def test_a_blocked_loader_follows_steps_on_every_shard(cluster, namespace):
    """One dataset steps through partitions on the 3 shards: it blocks on each one's shard, wakes on a
    put made through another node's URL, and ends each step once it is sealed and drained."""
    _assert_on_every_shard(cluster, namespace, STEPS)
    producer = make_client(cluster.urls[2], namespace)
    conf = {"redis": {"url": cluster.urls[0]}, "namespace": namespace, "compat": {"nested_output": False}}
    ds = tq.StreamingDataset(conf, 3, 3, ["x", "resp"], STEPS[0], "train")
    seen: dict[str, list[int]] = {}

    def consume() -> None:
        for k, step in enumerate(STEPS):
            if k:
                ds.step(step)
            seen[step] = [v for td, meta in ds for v in _rows_ok(td, meta)]

    thread = threading.Thread(target=consume)
    try:
        thread.start()
        for k, step in enumerate(STEPS):
            owner = cluster.node_client(cluster.owner_url(PartitionKeys(namespace, step).meta))
            try:
                _wait_blocked(owner, "xread", f"the loader on {step}")
            finally:
                owner.close()
            _put_rows(producer, step, 1000 * k, 3)
            _put_rows(producer, step, 1000 * k + 3, 2)  # a short tail: yielded whole once sealed
            producer.seal_partition(step)
        thread.join(30)
        assert not thread.is_alive()
        assert seen == {step: [1000 * k + i for i in range(5)] for k, step in enumerate(STEPS)}
    finally:
        thread.join(10)
        ds.close()
        producer.close()


def _loader_producer(url: str, ns: str, go) -> None:
    client = tq.TransferQueueClient(url, ns, nested_output=False)
    go.wait()
    for chunk in range(4):  # the steps fill side by side, each on its own shard
        for k, step in enumerate(STEPS):
            _put_rows(client, step, 1000 * k + 6 * chunk, 6)
    for step in STEPS:
        client.seal_partition(step)
    client.close()


def _loader_rank(url: str, ns: str, rank: int, go, out) -> None:
    conf = {"redis": {"url": url}, "namespace": ns, "compat": {"nested_output": False}}
    ds = tq.StreamingDataset(conf, 4, 2, ["x", "resp"], STEPS[0], "train", rank)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    go.wait()
    seen: dict[str, list[int]] = {}
    for step in STEPS:
        loader.step(step)
        seen[step] = [v for td, meta in loader for v in _rows_ok(td, meta)]
    out.put(seen)


def test_loader_ranks_with_workers_take_each_sample_once_on_every_shard(cluster, namespace):
    make_client(cluster.url, namespace).close()
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_loader_producer, args=(cluster.urls[0], namespace, go))]
    procs += [ctx.Process(target=_loader_rank, args=(cluster.urls[1 + r], namespace, r, go, out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        go.set()
        seen = [out.get(timeout=90) for _ in range(2)]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for k, step in enumerate(STEPS):  # at most once, and nothing lost, per step
        assert sorted(seen[0][step] + seen[1][step]) == [1000 * k + i for i in range(24)], step


# ------------------------------------------------------------------ checkpoints


def _node_keys(cluster, namespace: str) -> dict[str, set[str]]:
    """Per node URL, every key of the namespace that node holds (asked of each node)."""
    out = {}
    for url in cluster.urls:
        node = cluster.node_client(url)
        try:
            keys = without_records(node.scan_iter(match=f"{namespace}:*", count=1000), node)  # they expire
            out[url] = {k.decode() for k in keys}
        finally:
            node.close()
    return out


def _plain(item) -> list:
    return item.tolist() if isinstance(item, torch.Tensor) else list(item)


def _in_flight(client, partition: str, task: str) -> list[int]:
    return sorted(int(i) for i in client.redis.zrange(PartitionKeys(client.namespace, partition).lease(task), 0, -1))


@pytest.mark.parametrize("backend", ["redis", "dram"])
def test_checkpoint_restores_leases_kv_and_data_on_every_shard(cluster, namespace, tmp_path, backend):
    """With the ``redis`` store the bytes are keys on every shard; with ``dram`` a storage node holds them
    (registered on the cluster) and the checkpoint reads them per partition."""
    _assert_on_every_shard(cluster, namespace, SPREAD)
    node = spawn_node(cluster.urls[0], namespace, capacity="64MiB") if backend == "dram" else None
    tq.init({"redis": {"url": cluster.urls[1]}, "namespace": namespace, "storage": {"backend": backend}})
    try:
        client = tq.get_client()
        leased = {}
        for k, p in enumerate(SPREAD):
            client.put(TensorDict({"x": torch.arange(6) + 10 * k}, [6]), partition_id=p)
            leased[p] = client.get_meta(["x"], 4, p, task_name="actor", lease_s=120)
            assert client.ack(leased[p][0:1]) is None  # one acked, three in flight
            client.kv_batch_put([f"k{k}a", f"k{k}b"], f"kv{p}", TensorDict({"v": torch.tensor([k, -k])}, [2]),
                                tags=[{"score": k}, {"score": -k}])
        dock = GRPOTransferDock(1, 2, redis_url=cluster.urls[1], namespace=namespace, name="d", layout="jagged")
        dock.put_experience({"prompts": [torch.arange(3)]}, repeat_prompts=True)
        chan = tq.Channel.create("ch", redis_url=cluster.urls[1], namespace=namespace)
        # a tensor item's bytes are saved with the redis store only (checkpoint.py: "not saved ... tensor items
        # still queued in a Channel" with another store), so the dram case queues a plain item
        chan.put(torch.arange(4) if backend == "redis" else [0, 1, 2, 3], weight=2)
        chan.put("text", key="side")
        kv_before = client.kv_list()
        keys_before = _node_keys(cluster, namespace)
        assert all(keys_before.values()), "every shard should hold some of the namespace's keys"
        tq.save_checkpoint(tmp_path / "ckpt", metadata={"step": 7})

        # change everything: acks, clears, KV deletes, new partitions on every shard
        for p in SPREAD:
            assert client.ack(leased[p][1:]) is None
        client.clear_partition(SPREAD[1])
        client.kv_clear(["k0a"], f"kv{SPREAD[0]}")
        client.kv_put("new", f"kv{SPREAD[2]}", {"v": torch.tensor([9])})
        for p in ("p1", "p4", "p7"):  # stale partitions the load must delete, on several shards
            client.put(TensorDict({"x": torch.arange(3)}, [3]), partition_id=p)
        dock.get_experience("actor_train", ["prompts"], 2)
        dock.clear()
        assert chan.get(key="side") == "text" and _plain(chan.get()) == [0, 1, 2, 3]
        assert tq.load_checkpoint(tmp_path / "ckpt", replace=True) == {"step": 7}

        assert _node_keys(cluster, namespace) == keys_before  # every shard holds exactly what it held
        assert client.kv_list() == kv_before
        listed = [*SPREAD, *(f"kv{p}" for p in SPREAD), dock.partition_id]
        assert sorted(client.get_partition_list()) == sorted(listed)
        for k, p in enumerate(SPREAD):
            assert _in_flight(client, p, "actor") == leased[p].global_indexes[1:]
            assert client.kv_batch_get([f"k{k}b", f"k{k}a"], f"kv{p}")["v"].tolist() == [-k, k]
            meta = client.get_meta(["x"], 6, p, mode="force_fetch")
            assert client.get_data(meta)["x"].tolist() == [10 * k + i for i in range(6)]
            # the restored leases are live: their holder can ack them, the rest is handed out once
            assert client.ack(leased[p][1:]) is None
            assert client.get_meta(["x"], 2, p, task_name="actor", lease_s=60).global_indexes == [4, 5]
            assert client.get_meta(["x"], 1, p, task_name="actor").size == 0
        td, rows = dock.get_experience("actor_train", ["prompts"], 2)  # the dock and the channel are back
        assert rows == [0, 1] and [r.tolist() for r in td["prompts"].unbind()] == [[0, 1, 2]] * 2
        assert chan.qsize() == 1 and _plain(chan.get()) == [0, 1, 2, 3] and chan.get(key="side") == "text"
        dock.close()
        chan.close()
    finally:
        tq.close()
        if node is not None:
            node.stop()


# ------------------------------------------------------------------ the demo


def test_demo_on_a_cluster_with_a_storage_node_trains_every_sample_once(cluster, namespace, tmp_path):
    """``tq-redis storage-unit`` registers on the cluster, then ``tq-redis demo --redis <a node's URL>``
    streams one step per shard through it and trains every sample once."""
    _assert_on_every_shard(cluster, namespace, STEPS)
    admin = make_client(cluster.url, namespace)
    admin.redis.hset(config_key(namespace), "mark", "kept")  # the namespace's settings, restored after the run
    node = subprocess.Popen(
        [sys.executable, "-m", "tq_redis.cli", "storage-unit", "--redis", cluster.urls[2], "--namespace", namespace,
         "--capacity", "256MiB", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not admin.redis.hlen(f"{namespace}:storage:nodes"):  # registration is observable in Redis
            assert node.poll() is None, node.communicate()[0]
            assert time.monotonic() < deadline, "the storage node never registered on the cluster"
            time.sleep(0.05)
        env = {k: v for k, v in os.environ.items() if k not in ("TQ_REDIS_URL", "TQ_NAMESPACE")}
        proc = subprocess.run(
            [sys.executable, "-m", "tq_redis.demo.main", "--redis", cluster.urls[1], "--namespace", namespace,
             "--steps", "3", "--batch", "4", "--max-tokens", "700", "--out", str(tmp_path), "--progress", "plain"],
            capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
        )
        assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        assert "demo OK: trained=48 expected=48" in proc.stdout, proc.stdout
        summary = json.loads(Path(tmp_path / "summary.json").read_text())
        assert summary["trained"] == summary["trained_unique"] == 48 and summary["steps_trained"] == 3
        assert summary["bytes_moved"] > 0
        # an attached run leaves the namespace as it found it: its steps cleared, the settings restored
        assert [p for p in admin.get_partition_list() if p in STEPS] == []
        settings = admin.redis.hgetall(config_key(namespace))
        assert settings[b"mark"] == b"kept" and json.loads(settings[b"storage"])["backend"] == "redis"
    finally:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()
        admin.close()
