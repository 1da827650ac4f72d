"""Values stay where they were put while DRAM storage nodes join, leave, pause and restart.

Real storage-node processes registered in a real Valkey 9 and Redis 7.0 (the scripts record where
each value went). Each test is a row of issue 30: before the fix, 64 rows put with one node were
partly unreadable (and never cleared) once two more nodes joined, a node paused during a clear
kept the cleared bytes forever, a rewrite that lost a race with a clear left its bytes behind, and
a straggler's put brought a sealed, cleared partition back.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.records import without_records
from tq_redis import ops
from tq_redis.backends.dram.launcher import spawn_node
from tq_redis.backends.dram.pool import check_reply, run
from tq_redis.backends.dram.protocol import OP_STATS
from tq_redis.errors import DataMissing, PartitionClosed, SampleNotFound, StorageUnavailable, UnknownPartition
from tq_redis.meta.keys import PartitionKeys, config_key, partitions_key, pending_deletes_key, storage_nodes_key

ROWS = 64
WIDTH = 256  # int64 per row: 2 KiB values, all kept in the store


def _client(url: str, ns: str, **options):
    """A client of namespace ``ns`` whose values all go to the DRAM nodes (none inline)."""
    client = make_client(url, ns)
    spec = {"backend": "dram", "options": {"refresh_s": 0.0, **options}, "inline_max_bytes": 0}
    client.redis.hset(config_key(ns), "storage", json.dumps(spec))
    return client


def _store(client):
    return client.run(ops.storage(client.context)).store


def _rows(start: int, n: int = ROWS) -> TensorDict:
    x = torch.arange(start * WIDTH, (start + n) * WIDTH, dtype=torch.int64).reshape(n, WIDTH)
    return TensorDict({"x": x, "y": -x}, batch_size=[n])


def _keys_on(store, node_id: str) -> int:
    """How many values node ``node_id`` holds right now (asked directly, live in the ring or not)."""
    link = store.link_of(node_id)
    assert link is not None, f"{node_id} is not registered"
    conn = link.acquire()
    try:
        (stats,) = run([(link, conn, OP_STATS, {}, ())], check_reply)
    finally:
        link.release(conn)
    return int(stats["keys"])


def _wait_until(condition, what: str, deadline_s: float = 60.0) -> None:
    """Wait for ``condition()`` to hold (re-checking it), failing after a generous deadline."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _deferred_deletes_ran(client, node_ids: list[str]) -> None:
    """Wait until the deletes recorded for ``node_ids`` (a node that did not answer within
    timeout_s on a loaded machine gets them later) have run: none is recorded any more, and every
    node beat again since (a node runs what it took off the list before its beat returns)."""
    ns = client.namespace
    pending = [pending_deletes_key(ns, n) for n in node_ids]
    _wait_until(lambda: not client.redis.exists(*pending), "no delete is pending")
    registrations = storage_nodes_key(ns)
    beats = client.redis.hmget(registrations, node_ids)

    def beat_again() -> bool:
        return all(now != then for now, then in zip(client.redis.hmget(registrations, node_ids), beats))

    _wait_until(beat_again, "every node beat again")


def _stopped(node) -> None:
    """SIGSTOP ``node`` and wait until it is stopped (as its parent, we are told)."""
    os.kill(node.proc.pid, signal.SIGSTOP)
    assert os.WIFSTOPPED(os.waitpid(node.proc.pid, os.WUNTRACED)[1])


#: a client's dead_after_s where a test needs a paused node to look dead: three of a node's 1 s
#: heartbeats, so a live node that a loaded machine schedules late does not look dead too
DEAD_AFTER_S = 3.0


def _looks_dead(client, node_id: str, dead_after_s: float) -> bool:
    """Whether ``node_id``'s heartbeat is older than ``dead_after_s`` by Redis's clock."""
    raw = client.redis.hget(f"{client.namespace}:storage:nodes", node_id)
    if raw is None:  # already removed as gone
        return True
    info = json.loads(raw)
    sec, usec = client.redis.time()
    return sec + usec / 1e6 - info["heartbeat"] > dead_after_s


@pytest.fixture
def nodes(real_server, namespace):
    """Spawn storage nodes of ``namespace`` on demand (stopped, and resumed if paused, at the end)."""
    spawned = []

    def spawn(node_id: str, **kwargs):
        node = spawn_node(real_server.url, namespace, capacity="64MiB", node_id=node_id, **kwargs)
        spawned.append(node)
        return node

    yield spawn
    for node in spawned:
        if node.proc.poll() is None:
            os.kill(node.proc.pid, signal.SIGCONT)
        node.stop()


def test_rows_put_before_nodes_joined_are_read_and_cleared_where_they_were_put(real_server, namespace, nodes):
    nodes("n1")
    writer = _client(real_server.url, namespace)
    first = writer.put(_rows(0), partition_id="p")
    nodes("n2")
    nodes("n3")  # a node restarting under a new id joins the same way
    later = writer.put(_rows(ROWS), partition_id="p")  # new writes go to the new nodes too
    reader = _client(real_server.url, namespace)
    store = _store(reader)
    assert _keys_on(store, "n2") and _keys_on(store, "n3"), "the nodes that joined got none of the new rows"

    for meta, start in ((first, 0), (later, ROWS)):
        got = reader.get_data(meta)
        assert torch.equal(got["x"], _rows(start)["x"]) and torch.equal(got["y"], _rows(start)["y"])

    reader.clear_partition("p")
    assert [_keys_on(store, n) for n in ("n1", "n2", "n3")] == [0, 0, 0]
    assert not reader.redis.exists(PartitionKeys(namespace, "p").rings)
    writer.close()
    reader.close()


def test_a_rewrite_after_nodes_joined_is_never_read_from_the_stale_copy(real_server, namespace, nodes):
    nodes("n1")
    writer = _client(real_server.url, namespace)
    meta = writer.put(_rows(0), partition_id="p")
    n2, n3 = nodes("n2"), nodes("n3")
    writer.put(_rows(1000), metadata=meta)  # keys now owned by n2/n3 leave their old copy on n1
    store = _store(writer)
    on_new = _keys_on(store, "n2") + _keys_on(store, "n3")
    assert on_new > 0

    # n2 and n3 pause: a reader's live ring is n1 alone, which still holds the stale copies
    reader = _client(real_server.url, namespace, dead_after_s=DEAD_AFTER_S, timeout_s=1.0)
    _stopped(n2)
    _stopped(n3)
    _wait_until(lambda: _looks_dead(reader, "n2", DEAD_AFTER_S) and _looks_dead(reader, "n3", DEAD_AFTER_S),
                "n2, n3 look dead")
    with pytest.raises(StorageUnavailable, match=r"'n[23]'.*\(reading .*:d:\d+:[xy]"):
        reader.get_data(meta)
    os.kill(n2.proc.pid, signal.SIGCONT)
    os.kill(n3.proc.pid, signal.SIGCONT)
    got = reader.get_data(meta)
    assert torch.equal(got["x"], _rows(1000)["x"]) and torch.equal(got["y"], _rows(1000)["y"])
    writer.clear_partition("p")
    assert [_keys_on(store, n) for n in ("n1", "n2", "n3")] == [0, 0, 0]
    writer.close()
    reader.close()


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_holder_that_left_is_named_with_its_address_and_keys(real_server, namespace, nodes, how):
    """Stopped, it deregisters; SIGKILLed, its registration stays until a client finds its process
    gone (this host) once it looks dead. Either way get_data says which node held which keys."""
    nodes("n1")
    n2 = nodes("n2")
    client = _client(real_server.url, namespace)
    meta = client.put(_rows(0), partition_id="p")
    assert _keys_on(_store(client), "n2")
    if how == "stopped":
        n2.stop()  # deregisters: its memory, and the values in it, are gone
    else:
        n2.proc.kill()
        n2.proc.wait()
        _wait_until(lambda: _looks_dead(client, "n2", DEAD_AFTER_S), "n2 looks dead")
    with pytest.raises(DataMissing) as caught:
        _client(real_server.url, namespace, dead_after_s=DEAD_AFTER_S).get_data(meta)
    message = str(caught.value)
    assert "'n2'" in message and n2.address in message and "has left" in message
    assert f"{namespace}:{{{namespace}/p}}:d:" in message  # the keys it held
    assert "although marked produced" not in message
    client.clear_partition("p")  # the values of the node that left are no error for a clear
    assert _keys_on(_store(client), "n1") == 0
    client.close()


@pytest.mark.parametrize(
    "dead_after_s", [pytest.param(DEAD_AFTER_S, id="looks-dead"), pytest.param(60.0, id="heartbeat-fresh")]
)
def test_a_node_paused_during_a_clear_deletes_the_cleared_values_when_it_is_back(
    real_server, namespace, nodes, dead_after_s
):
    """Paused past dead_after_s, the node is not even tried; with a fresh heartbeat the clear tries
    it and gives up after timeout_s. Either way the clear succeeds and the node deletes later."""
    nodes("n1")
    n2 = nodes("n2")
    client = _client(real_server.url, namespace, dead_after_s=dead_after_s, timeout_s=1.0)
    store = _store(client)
    client.put(_rows(0), partition_id="p")
    held = _keys_on(store, "n2")
    assert held and _keys_on(store, "n1")
    _stopped(n2)
    if dead_after_s < 60:
        _wait_until(lambda: _looks_dead(client, "n2", dead_after_s), "n2 looks dead")
    client.clear_partition("p")  # succeeds: n2's deletes are recorded for it
    assert _keys_on(store, "n1") == 0
    pending = client.redis.lrange(pending_deletes_key(namespace, "n2"), 0, -1)
    # every key it holds (and, while it is in the live ring, those it is the runner-up for)
    assert len(b"\n".join(pending).split(b"\n")) >= held
    other = _client(real_server.url, namespace)  # the client that cleared is gone: nothing depends on it
    client.close()
    os.kill(n2.proc.pid, signal.SIGCONT)
    _wait_until(lambda: _keys_on(_store(other), "n2") == 0, "n2 ran the recorded deletes")
    assert not other.redis.exists(pending_deletes_key(namespace, "n2"))
    other.close()


def _clearing_after_put(store_manager, clear):
    """Make the next put of ``store_manager`` run ``clear()`` right after its bytes are stored
    (the moment a concurrent clear wins the race against the bits)."""
    put = store_manager.put

    def racing(*args, **kwargs):
        ring = put(*args, **kwargs)
        store_manager.put = put
        clear()
        return ring

    store_manager.put = racing


def _clearing_at_first_delete(store_manager, clear):
    """Make the next delete of ``store_manager`` run ``clear()`` first (a second clear landing
    while a refused rewrite is cleaning up after the first)."""
    delete = store_manager.delete

    def racing(*args, **kwargs):
        store_manager.delete = delete
        clear()
        return delete(*args, **kwargs)

    store_manager.delete = racing


@pytest.mark.parametrize("how", ["partition", "samples", "samples-then-the-rest"])
def test_a_rewrite_that_loses_to_a_clear_leaves_no_bytes(real_server, namespace, nodes, how):
    nodes("n1")
    nodes("n2")
    client, other = _client(real_server.url, namespace), _client(real_server.url, namespace)
    meta = client.put(_rows(0), partition_id="p")
    half = meta.select_samples(list(range(ROWS // 2)))
    rest = meta.select_samples(list(range(ROWS // 2, ROWS)))
    manager = client.run(ops.storage(client.context))
    if how == "samples-then-the-rest":
        # the rest is cleared after the refused rewrite found which samples were gone, before it
        # looked which of the others lacked the field (CI: 8 keys of z left on the nodes)
        _clearing_after_put(manager, lambda: other.clear_samples(half))
        _clearing_at_first_delete(manager, lambda: other.clear_samples(rest))
        with pytest.raises(SampleNotFound):
            client.put(TensorDict({"z": torch.ones(ROWS, WIDTH)}, batch_size=[ROWS]), metadata=meta)
        left = 0
    elif how == "partition":
        _clearing_after_put(manager, lambda: other.clear_partition("p"))
        with pytest.raises(UnknownPartition):
            client.put(TensorDict({"z": torch.ones(ROWS, WIDTH)}, batch_size=[ROWS]), metadata=meta)
        left = 0
    else:
        _clearing_after_put(manager, lambda: other.clear_samples(half))
        with pytest.raises(SampleNotFound):
            client.put(TensorDict({"z": torch.ones(ROWS, WIDTH)}, batch_size=[ROWS]), metadata=meta)
        got = other.get_data(rest)  # the samples still alive keep their values
        assert torch.equal(got["x"], _rows(0)["x"][ROWS // 2 :])
        left = 2 * (ROWS // 2)  # x and y of the samples still alive (the refused z of none)
    store = _store(client)
    assert _keys_on(store, "n1") + _keys_on(store, "n2") == left
    client.clear_partition("p")
    assert _keys_on(store, "n1") + _keys_on(store, "n2") == 0
    client.close()
    other.close()


def test_a_kv_put_that_loses_to_a_clear_leaves_no_bytes_and_no_keys(real_server, namespace, nodes):
    """kv_batch_put writes its bytes right after kv_resolve (no second check in between): a clear
    landing between the bytes and the bits is refused by the bits' script, and neither the bytes
    nor the keys it created are left behind."""
    nodes("n1")
    nodes("n2")
    client, other = _client(real_server.url, namespace), _client(real_server.url, namespace)
    client.kv_batch_put(["old"], "p", fields=_rows(0, 1))  # the partition exists before the race
    manager = client.run(ops.storage(client.context))
    _clearing_after_put(manager, lambda: other.clear_partition("p"))
    with pytest.raises(UnknownPartition):
        client.kv_batch_put([f"k{i}" for i in range(ROWS)], "p", fields=_rows(0))
    store = _store(client)
    assert _keys_on(store, "n1") + _keys_on(store, "n2") == 0
    assert not client.kv_list("p").get("p")  # no key the refused put created is left
    meta = client.kv_batch_put(["k0"], "p", fields=_rows(7, 1))  # the keys are usable again
    assert torch.equal(client.kv_batch_get(["k0"], "p")["x"], _rows(7, 1)["x"])
    assert meta.keys == ["k0"]
    client.close()
    other.close()


def _rewriter(url: str, ns: str, conn) -> None:
    """Rewrite field ``z`` of the batch it is sent, over and over, until a clear refuses it."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    while (meta := conn.recv()) is not None:
        z = TensorDict({"z": torch.ones(meta.size, WIDTH)}, batch_size=[meta.size])
        conn.send("rewriting")
        rewrites = 0
        while True:
            try:
                client.put(z, metadata=meta)
                rewrites += 1
            except (UnknownPartition, SampleNotFound):
                break
        conn.send(rewrites)
    client.close()


def test_rewrites_racing_clears_in_another_process_leave_no_bytes(real_server, namespace, nodes):
    """A rewriter process rewrites a batch while this process clears it (all of it, or half)."""
    from tests.procs import mp_context

    nodes("n1")
    nodes("n2")
    client = _client(real_server.url, namespace)
    ours, theirs = mp_context().Pipe()
    proc = mp_context().Process(target=_rewriter, args=(real_server.url, namespace, theirs))
    proc.start()
    try:
        rewrites = 0
        for r in range(20):
            meta = client.put(_rows(0, 16), partition_id=f"race{r}")
            ours.send(meta)
            assert ours.recv() == "rewriting"
            if r % 2:
                client.clear_samples(meta.select_samples(list(range(8))))  # half: the rewrite is refused
                client.clear_samples(meta)
            else:
                client.clear_partition(f"race{r}")
            rewrites += ours.recv()
        ours.send(None)
        proc.join(30)
        assert proc.exitcode == 0
        for r in range(20):
            client.clear_partition(f"race{r}")
        _deferred_deletes_ran(client, ["n1", "n2"])
        store = _store(client)
        assert _keys_on(store, "n1") + _keys_on(store, "n2") == 0, f"orphaned bytes after {rewrites} rewrites"
    finally:
        if proc.is_alive():
            proc.kill()
        client.close()


def _partition_keys(client, namespace: str) -> list[bytes]:
    return sorted(without_records(client.redis.keys(f"{namespace}:{{{namespace}/p}}:*"), client.redis))


def test_a_put_into_a_sealed_and_cleared_partition_is_refused_until_reopened(real_server, namespace, nodes):
    nodes("n1")
    client = _client(real_server.url, namespace)
    store = _store(client)
    client.put(_rows(0), partition_id="p")
    client.seal_partition("p")
    client.clear_partition("p")
    pk = PartitionKeys(namespace, "p")
    before = _partition_keys(client, namespace)
    for write in (
        lambda: client.put(_rows(0, 4), partition_id="p"),
        lambda: client.kv_put("k", "p", {"x": torch.ones(WIDTH)}),
        lambda: client.get_meta(["x"], 4, "p", mode="insert"),
    ):
        with pytest.raises(PartitionClosed, match=r"reopen_partition\('p'\)"):
            write()
    assert _keys_on(store, "n1") == 0
    assert _partition_keys(client, namespace) == before  # nothing written
    assert client.redis.zscore(partitions_key(namespace), "p") is None

    assert client.reopen_partition("p") is True and not client.redis.exists(pk.closed)
    meta = client.put(_rows(0, 4), partition_id="p")
    assert torch.equal(client.get_data(meta)["x"], _rows(0, 4)["x"])
    client.clear_partition("p")  # not sealed this time: the name stays usable
    client.put(_rows(0, 4), partition_id="p")
    client.close()


def test_a_straggler_that_reserved_before_the_seal_and_clear_writes_nothing(real_server, namespace, nodes):
    nodes("n1")
    client, trainer = _client(real_server.url, namespace), _client(real_server.url, namespace)
    client.put(_rows(0), partition_id="p")

    def seal_and_clear():
        trainer.seal_partition("p")
        trainer.clear_partition("p")

    _clearing_after_put(client.run(ops.storage(client.context)), seal_and_clear)
    with pytest.raises(PartitionClosed):
        client.put(_rows(ROWS), partition_id="p")
    assert _keys_on(_store(client), "n1") == 0
    assert client.redis.zscore(partitions_key(namespace), "p") is None
    assert not client.redis.exists(PartitionKeys(namespace, "p").meta)
    client.close()
    trainer.close()


def test_rings_are_recorded_once_and_loc_keys_only_after_a_change(real_server, namespace, nodes):
    """The record costs nothing while the node set does not change: no per-value key."""
    nodes("n1")
    client = _client(real_server.url, namespace)
    pk = PartitionKeys(namespace, "p")
    for start in range(0, 4 * ROWS, ROWS):
        client.put(_rows(start), partition_id="p")
    assert client.redis.hlen(pk.rings) == 1 and not client.redis.exists(pk.loc("x"), pk.loc("y"))
    nodes("n2")
    client.put(_rows(4 * ROWS), partition_id="p")
    assert client.redis.hlen(pk.rings) == 2
    loc = np.frombuffer(client.redis.get(pk.loc("x")), "<u2")
    assert loc[: 4 * ROWS].tolist() == [0] * (4 * ROWS) and loc[4 * ROWS :].tolist() == [1] * ROWS
    client.clear_partition("p")
    assert not client.redis.exists(pk.rings, pk.loc("x"), pk.loc("y"))
    client.close()


def test_the_record_works_on_a_redis_cluster(cluster, namespace):
    """Rings, loc bytes and closed markers share the partition's hash tag (one slot per script)."""
    first = spawn_node(cluster.url, namespace, capacity="64MiB", node_id="c1")
    joined = []
    try:
        client = _client(cluster.url, namespace)
        meta = client.put(_rows(0), partition_id="p")
        joined += [spawn_node(cluster.url, namespace, capacity="64MiB", node_id=f"c{i}") for i in (2, 3)]
        client.put(_rows(5), metadata=meta)
        reader = _client(cluster.url, namespace)
        assert torch.equal(reader.get_data(meta)["x"], _rows(5)["x"])
        reader.seal_partition("p")
        reader.clear_partition("p")
        store = _store(reader)
        assert [_keys_on(store, n) for n in ("c1", "c2", "c3")] == [0, 0, 0]
        with pytest.raises(PartitionClosed):
            client.put(_rows(0, 2), partition_id="p")
        client.close()
        reader.close()
    finally:
        for node in [first, *joined]:
            node.stop()
