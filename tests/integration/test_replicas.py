"""``storage.replicas``: every value on N distinct DRAM storage nodes, read from any live copy.

Real storage-node processes registered in a real Valkey 9 and Redis 7.0: a replicated put stores
each value on two of three nodes (and only returns once both hold it), a read survives the
SIGKILL of a holder without the caller seeing an error, a clear deletes every copy, and a put
whose copies cannot all be stored raises a typed error naming the node and leaves nothing visible.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis import ops
from tq_redis.backends.dram.launcher import spawn_node
from tq_redis.backends.dram.pool import check_reply, run
from tq_redis.backends.dram.protocol import OP_STATS
from tq_redis.errors import StorageFull, StorageUnavailable, UnknownField, UnknownPartition
from tq_redis.meta.keys import config_key
from tq_redis.monitor.exporter import NamespaceCollector
from tq_redis.monitor.status import replica_repair, replica_repair_text

ROWS = 64
WIDTH = 256  # int64 per row: 2 KiB values, all kept in the store


def _client(url: str, ns: str, replicas: int = 2, **options):
    """A client of namespace ``ns`` whose values all go to the DRAM nodes, ``replicas`` copies each."""
    client = make_client(url, ns)
    spec = {"backend": "dram", "options": {"refresh_s": 0.0, "replicas": replicas, **options}, "inline_max_bytes": 0}
    client.redis.hset(config_key(ns), "storage", json.dumps(spec))
    return client


def _store(client):
    return client.run(ops.storage(client.context)).store


def _rows(start: int, n: int = ROWS, width: int = WIDTH) -> TensorDict:
    x = torch.arange(start * width, (start + n) * width, dtype=torch.int64).reshape(n, width)
    return TensorDict({"x": x, "y": -x}, batch_size=[n])


def _keys_on(store, node_id: str) -> int:
    """How many values node ``node_id`` holds right now (asked directly)."""
    link = store.link_of(node_id)
    assert link is not None, f"{node_id} is not registered"
    conn = link.acquire()
    try:
        (stats,) = run([(link, conn, OP_STATS, {}, ())], check_reply)
    finally:
        link.release(conn)
    return int(stats["keys"])


def _visible(client) -> int:
    """How many samples of partition ``p`` a consumer could read (none if it was never created)."""
    try:
        return client.get_meta(["x"], 1, "p", mode="force_fetch").size
    except (UnknownPartition, UnknownField):
        return 0


@pytest.fixture
def nodes(real_server, namespace):
    """Spawn storage nodes of ``namespace`` on demand (stopped at the end)."""
    spawned = []

    def spawn(node_id: str, capacity: str = "64MiB", **kwargs):
        node = spawn_node(real_server.url, namespace, capacity=capacity, node_id=node_id, **kwargs)
        spawned.append(node)
        return node

    yield spawn
    for node in spawned:
        node.stop()


def test_each_value_is_on_two_nodes_and_a_read_survives_the_kill_of_a_holder(real_server, namespace, nodes):
    started = [nodes(f"n{i}") for i in range(3)]
    client = _client(real_server.url, namespace)
    meta = client.put(_rows(0), partition_id="p")
    store = _store(client)
    held = [_keys_on(store, f"n{i}") for i in range(3)]
    assert sum(held) == 2 * 2 * ROWS, f"expected two copies of each of {2 * ROWS} values, nodes hold {held}"
    assert all(held), f"a node got none of the copies: {held}"

    victim = max(range(3), key=held.__getitem__)
    os.kill(started[victim].proc.pid, signal.SIGKILL)
    started[victim].proc.wait()
    reader = _client(real_server.url, namespace)  # a fresh process's view: the victim still looks registered
    got = reader.get_data(meta)
    assert torch.equal(got["x"], _rows(0)["x"]) and torch.equal(got["y"], _rows(0)["y"])

    reader.clear_partition("p")
    survivors = [f"n{i}" for i in range(3) if i != victim]
    assert [_keys_on(_store(reader), n) for n in survivors] == [0, 0]
    client.close()
    reader.close()


def test_a_put_needs_as_many_live_nodes_as_replicas(real_server, namespace, nodes):
    nodes("n0")
    client = _client(real_server.url, namespace)
    with pytest.raises(StorageUnavailable, match=r"storage.replicas=2 .* only 1 are live"):
        client.put(_rows(0), partition_id="p")
    assert not _visible(client)
    client.close()


def test_a_copy_that_cannot_be_stored_fails_the_put_naming_the_node_and_leaves_nothing(
    real_server, namespace, nodes
):
    nodes("big0", capacity="256MiB")
    nodes("big1", capacity="256MiB")
    nodes("tiny", capacity="1MiB")
    client = _client(real_server.url, namespace)
    store = _store(client)
    with pytest.raises(StorageFull, match=r"storage.replicas=2 .*'tiny'.*nothing of the batch was made visible"):
        client.put(_rows(0, width=4096), partition_id="p")  # 32 KiB values: 4 MiB in all, 2/3 on each node
    assert not _visible(client)
    assert [_keys_on(store, n) for n in ("big0", "big1", "tiny")] == [0, 0, 0]
    client.close()


# -- repair while producers and lease consumers stream ------------------------------------------

PRODUCERS, CONSUMERS, BATCHES, BATCH = 2, 2, 12, 8
TOTAL = PRODUCERS * BATCHES * BATCH


def _produce(url: str, ns: str, who: int) -> None:
    """Put BATCHES batches of rows tagged ``who * 100000 + i``; a put refused while a node dies is retried."""
    client = _client(url, ns, dead_after_s=3.0)
    for b in range(BATCHES):
        first = who * 100000 + b * BATCH
        rows = TensorDict({"x": torch.arange(first, first + BATCH).repeat_interleave(WIDTH).reshape(BATCH, WIDTH)},
                          batch_size=[BATCH])  # fmt: skip
        for _attempt in range(60):
            try:
                client.put(rows, partition_id="p")
                break
            except StorageUnavailable:
                time.sleep(0.2)  # a holder just died and does not look dead yet: the next ring leaves it out
        else:
            raise AssertionError("a put kept failing after a node died")
    client.redis.incr(f"{ns}:test:produced")
    client.close()


def _consume(url: str, ns: str) -> None:
    """Claim with a lease, read, ack, and record each sample's tag once acked, until all are acked."""
    client = _client(url, ns, dead_after_s=3.0)
    done = f"{ns}:test:acked"
    while client.redis.llen(done) < TOTAL:
        meta = client.get_meta(["x"], 4, "p", task_name="train", lease_s=60, timeout=1.0)
        if not meta.size:
            continue
        got = client.get_data(meta)
        tags = got["x"][:, 0].tolist()
        assert all((got["x"] == got["x"][:, :1]).all(dim=1).tolist()), "a row came back corrupted"
        client.ack(meta)
        client.redis.rpush(done, *tags)
    client.close()


def _copies(store, node_ids: list[str]) -> list[int]:
    return [_keys_on(store, n) for n in node_ids]


def test_streaming_through_a_node_kill_and_a_join_loses_nothing_and_repairs_to_two_copies(
    real_server, namespace, nodes
):
    import multiprocessing as mp

    started = {f"n{i}": nodes(f"n{i}") for i in range(3)}
    main = _client(real_server.url, namespace, dead_after_s=3.0)
    main.put(_rows(10**6, n=BATCH), partition_id="warm")  # rings and library in place before the workers
    main.clear_partition("warm")
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_produce, args=(real_server.url, namespace, w)) for w in range(PRODUCERS)]
    workers += [ctx.Process(target=_consume, args=(real_server.url, namespace)) for _ in range(CONSUMERS)]
    for w in workers:
        w.start()
    store = _store(main)
    deadline = time.monotonic() + 120
    while main.redis.llen(f"{namespace}:test:acked") < TOTAL // 4:  # streaming is under way
        assert time.monotonic() < deadline and all(w.exitcode in (None, 0) for w in workers), "no progress"
        time.sleep(0.05)
    victim = max(started, key=lambda n: _keys_on(store, n))
    os.kill(started[victim].proc.pid, signal.SIGKILL)
    started[victim].proc.wait()
    nodes("n3")  # a node joins while the others stream
    for w in workers:
        w.join(timeout=300)
        assert w.exitcode == 0, f"worker {w.name} failed (exit code {w.exitcode})"

    acked = [int(x) for x in main.redis.lrange(f"{namespace}:test:acked", 0, -1)]
    expected = {w * 100000 + i for w in range(PRODUCERS) for i in range(BATCHES * BATCH)}
    assert len(acked) == len(set(acked)), f"{len(acked) - len(set(acked))} sample(s) acked twice"
    assert set(acked) == expected, f"lost: {sorted(expected - set(acked))[:10]}"

    live = [n for n in ("n0", "n1", "n2", "n3") if n != victim]
    t0 = time.monotonic()
    while sum(_copies(store, live)) != 2 * TOTAL:  # every value back to two copies on live nodes
        assert time.monotonic() - t0 < 120, f"replicas not back to 2: live nodes hold {_copies(store, live)}"
        time.sleep(0.1)
    repaired = time.monotonic() - t0
    status = main.redis.hgetall(f"{namespace}:storage:repair")
    assert int(status.get(b"repaired", 0)) > 0, status
    shown = replica_repair(main.redis, namespace)  # what `tq-redis status` and the dashboard show
    assert shown["repaired"] == int(status[b"repaired"]) and shown["under_replicated"] == 0, shown
    assert "re-made in all" in replica_repair_text(shown)
    gauges = {m.name: m.samples[0].value for m in NamespaceCollector(real_server.url, namespace).collect()
              if m.name.startswith("tq_redis_replica") or m.name == "tq_redis_under_replicated_values"}
    assert gauges["tq_redis_replica_repaired_values"] == shown["repaired"], gauges
    meta = main.get_meta(["x"], TOTAL, "p", mode="force_fetch")
    assert meta.size == TOTAL
    got = main.get_data(meta)["x"][:, 0].tolist()
    assert set(got) == expected
    print(f"lost 0, duplicated 0, copies back to 2 within {repaired:.1f} s of the last ack, "
          f"{int(status[b'repaired'])} values repaired")  # fmt: skip

    main.clear_partition("p")
    assert _copies(store, live) == [0, 0, 0]
    assert all(store.stats()[n]["used"] == 0 for n in live)
    main.close()
