"""Abandoned state is found and removed (issue 30): namespaces and clients have a liveness record,
``tq-redis namespace list|drop|gc`` find, size and remove them, dead storage-node registrations go,
and the temp directories of embedded servers whose jobs were SIGKILLed are removed.

Jobs here are real processes attached to a real Valkey 9 / Redis 7.0, with their own storage-node
processes, killed with SIGKILL as a whole process group (before the fix: every key, the dead
nodes' registrations, the leases of dead consumers and the /tmp directories stayed forever, and
nothing listed or removed them).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client
from tests.records import without_records
from tq_redis.backends.dram.launcher import spawn_node
from tq_redis.backends.dram.store import DramStore
from tq_redis.cli import main as cli
from tq_redis.errors import NamespaceInUse
from tq_redis.meta.keys import clients_key, config_key, pending_deletes_key, storage_nodes_key
from tq_redis.monitor import namespaces
from tq_redis.server import leftovers
from tq_redis.server.embedded import EmbeddedServer

# A job: attach to the shared Redis, start its own two storage nodes, put rows, hold leases, then
# wait to be killed. Its heartbeat is fast so that the test need not wait 30 s for it to lapse.
JOB = r"""
import json, os, sys, time, torch
from tensordict import TensorDict
import tq_redis as tq
from tq_redis.backends.dram.launcher import spawn_node
url, ns, ttl = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
nodes = [spawn_node(url, ns, capacity="64MiB", node_id=f"{ns}-node{i}") for i in range(2)]
conf = {"redis": {"url": url}, "namespace": ns, "storage": {"backend": "dram", "inline_max_bytes": 0}}
if ttl is not None:
    conf["namespace_ttl"] = ttl
tq.init(conf)
client = tq.get_client()
client.put(TensorDict({"x": torch.ones(32, 512)}, batch_size=[32]), partition_id="step_0")
client.get_meta(["x"], 16, "step_0", task_name="train", lease_s=600)
print(json.dumps([n.proc.pid for n in nodes]), flush=True)
time.sleep(3600)
"""


def _run_job(url: str, ns: str, ttl: float | None = None) -> tuple[subprocess.Popen, list[int]]:
    env = {**os.environ, "TQ_HEARTBEAT_S": "0.3"}
    job = subprocess.Popen([sys.executable, "-c", JOB, url, ns, json.dumps(ttl)], stdout=subprocess.PIPE,
                           start_new_session=True, env=env)
    line = job.stdout.readline()
    assert line, f"the job exited with {job.wait()}"
    return job, json.loads(line)


def _kill_job(job: subprocess.Popen, node_pids: list[int]) -> None:
    """SIGKILL the job's whole process group (its storage nodes too), as a scheduler does."""
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    for pid in node_pids:
        _wait_until(lambda pid=pid: not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"node {pid} is gone")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_until(condition, what: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _keys(r, ns: str) -> list[bytes]:
    return sorted(without_records(r.scan_iter(match=f"{ns}:*", count=1000), r))


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(list(argv))
    return code, out.getvalue()


def test_a_client_is_a_live_client_of_its_namespace_while_open(real_server, namespace):
    client = make_client(real_server.url, namespace)
    r = client.redis
    assert r.zcard(clients_key(namespace)) == 0  # nothing written before a first operation succeeded
    client.get_partition_list()
    _wait_until(lambda: r.zcard(clients_key(namespace)) == 1, "the heartbeat wrote the client's entry")
    (member, deadline), = r.zrange(clients_key(namespace), 0, -1, withscores=True)
    sec, _ = r.time()
    assert member.decode().split(":")[1] == str(os.getpid())
    assert deadline > sec * 1000 and r.pttl(clients_key(namespace)) > 0  # the record expires by itself
    created, touched = r.hmget(config_key(namespace), "created_ms", "touched_ms")
    assert created and touched and int(touched) >= int(created)
    other = make_client(real_server.url, namespace)  # one heartbeat per process and namespace
    other.get_partition_list()
    assert r.zcard(clients_key(namespace)) == 1
    other.close()
    assert r.zcard(clients_key(namespace)) == 1
    client.close()
    assert make_client(real_server.url, namespace, live=False).redis.zcard(clients_key(namespace)) == 0


def test_a_killed_jobs_namespace_is_listed_then_dropped_with_its_nodes_registrations(real_server, namespace):
    url = real_server.url
    job, node_pids = _run_job(url, namespace)
    admin = make_client(url, namespace, live=False).redis
    assert namespace in namespaces.find(admin)
    live = namespaces.describe(admin, namespace)
    assert len(live.live_clients) == 1 and len(live.live_nodes) == 2 and live.keys > 10 and live.key_bytes > 0
    with pytest.raises(NamespaceInUse, match="in use by"):
        namespaces.drop(url, namespace)

    _kill_job(job, node_pids)
    _wait_until(lambda: not namespaces.describe(admin, namespace).live_clients, "the killed job's heartbeat lapsed")
    # its entry's key expires a little later: counted before and after, the listing would differ by one
    _wait_until(lambda: not admin.exists(clients_key(namespace)), "the killed job's liveness entry expired")
    info = namespaces.describe(admin, namespace)
    assert info.live_clients == [] and info.live_nodes == [] and sorted(info.dead_nodes) == [
        f"{namespace}-node0", f"{namespace}-node1"
    ]
    code, out = _cli("namespace", "list", "--redis", url, "--json")
    assert code == 0
    (listed,) = [n for n in json.loads(out) if n["namespace"] == namespace]
    assert listed["keys"] == info.keys and listed["live_clients"] == [] and len(listed["dead_nodes"]) == 2

    code, out = _cli("namespace", "drop", namespace, "--redis", url)
    assert code == 0, out
    assert _keys(admin, namespace) == []  # leases, partitions, registrations, config: all gone
    assert namespace not in namespaces.find(admin)


def test_drop_deletes_the_values_on_running_storage_nodes(real_server, namespace):
    url = real_server.url
    node = spawn_node(url, namespace, capacity="64MiB", node_id="keeper")
    try:
        client = make_client(url, namespace, backend="dram")
        client.put(TensorDict({"x": torch.ones(64, 512)}, batch_size=[64]), partition_id="p")
        store = DramStore(url, namespace)
        assert store.stats()["keeper"]["keys"] == 64
        code, out = _cli("namespace", "drop", namespace, "--redis", url)
        assert code == 1 and "in use by" in out  # this test's client and the node are live
        client.close()
        code, out = _cli("namespace", "drop", namespace, "--redis", url, "--force")
        assert code == 0 and "still run" in out
        assert store.stats()["keeper"]["keys"] == 0
        # the node registers again with its next heartbeat, and nothing else of the namespace is left
        _wait_until(lambda: _keys(store._redis, namespace) == [storage_nodes_key(namespace).encode()],
                    "only the running node's registration is left")
        store.close()
    finally:
        node.stop()


def test_gc_drops_namespaces_whose_ttl_ran_out_and_no_other(real_server, namespace):
    url = real_server.url
    expiring, kept, busy = f"{namespace}-ttl", f"{namespace}-nottl", f"{namespace}-busy"
    job, pids = _run_job(url, expiring, ttl=1)
    other, other_pids = _run_job(url, kept)
    client = make_client(url, busy)
    client.put(TensorDict({"x": torch.ones(2)}, batch_size=[2]), partition_id="p")
    client.redis.hset(config_key(busy), "ttl_s", "0.001")  # expired, but its client is alive
    _kill_job(job, pids)
    _kill_job(other, other_pids)
    r = client.redis
    _wait_until(lambda: namespaces.describe(r, expiring).expired(int(r.time()[0]) * 1000)
                and not namespaces.describe(r, expiring).in_use, "the TTL ran out")
    code, out = _cli("namespace", "gc", "--redis", url)
    assert code == 0 and f"dropped namespace {expiring!r}" in out
    assert _keys(r, expiring) == []
    assert _keys(r, kept) and _keys(r, busy)  # no TTL; a live client
    client.close()
    namespaces.drop(url, kept)


def test_a_dead_nodes_registration_is_removed_by_the_next_client(real_server, namespace):
    url = real_server.url
    alive = spawn_node(url, namespace, capacity="64MiB", node_id="alive")
    dead = spawn_node(url, namespace, capacity="64MiB", node_id="dead")
    try:
        r = make_client(url, namespace, live=False).redis
        r.rpush(pending_deletes_key(namespace, "dead"), "k")
        dead.proc.send_signal(signal.SIGKILL)
        dead.proc.wait()
        store = DramStore(url, namespace, dead_after_s=0.5, refresh_s=0)

        def forgotten() -> bool:
            store.nodes()  # a client reading the registry (as every operation does, each refresh_s)
            return not r.hexists(storage_nodes_key(namespace), "dead")

        _wait_until(forgotten, "the dead node's registration is removed")
        assert r.hexists(storage_nodes_key(namespace), "alive")
        assert not r.exists(pending_deletes_key(namespace, "dead"))
        store.close()
    finally:
        alive.stop()
        dead.stop()


KILLED_EMBEDDED = r"""
from tq_redis.server.embedded import EmbeddedServer
s = EmbeddedServer(unix_socket=True).start()
print(s.data_dir, s.process.pid, flush=True)
import time; time.sleep(3600)
"""


def test_an_embedded_servers_directory_left_by_sigkill_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    job = subprocess.Popen([sys.executable, "-c", KILLED_EMBEDDED], stdout=subprocess.PIPE, text=True)
    left, server_pid = job.stdout.readline().split()
    live = EmbeddedServer().start()  # another job's server, still running
    try:
        assert leftovers.abandoned_dirs(tmp_path) == []  # the job still runs
        job.send_signal(signal.SIGKILL)
        job.wait()
        _wait_until(lambda: _zombie(int(server_pid)), "its server died with it")
        assert leftovers.abandoned_dirs(tmp_path) == [tmp_path.resolve() / os.path.basename(left)]
        code, out = _cli("cleanup", "--dry-run")
        assert code == 0 and left in out and os.path.isdir(left)
        tq.init({"storage": {"backend": "redis"}})  # starting an embedded server clears what killed jobs left
        try:
            assert not os.path.exists(left) and os.path.isdir(live.data_dir)
        finally:
            tq.close()
    finally:
        live.stop()
