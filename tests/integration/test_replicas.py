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
