"""Ray placement of DRAM storage nodes (:mod:`tq_redis.integrations.ray_placement`).

The fast tests check the placement logic and the argument checks without Ray running. The cluster
test starts a real two-node Ray cluster on this machine (``ray start --head`` and ``ray start
--address``, each with its own custom resource) and checks placement, same-host shared memory,
cross-host TCP and restart after a SIGKILL.

**How two Ray nodes on one machine become two hosts.** The ``dram`` store decides "same host" by
hostname (a node registers ``socket.gethostname()``; a client compares its own). Both Ray nodes would
share the machine's hostname, so every rank would use every node's shared memory and the test would
prove nothing. Each ``ray start`` therefore runs in its own UTS namespace (``unshare -u``) with its
own hostname (``tq-host-a``, ``tq-host-b``): every process of that Ray node — raylet, workers, the
keeper actor and the storage node it spawns, the rank actors — sees that hostname, exactly as on
two machines, while they still share the network (so TCP between "hosts" works). The production
code is unchanged: it uses the real hostname. Needs root or CAP_SYS_ADMIN; skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis.errors import ConfigError, InvalidArgument, StorageUnavailable
from tq_redis.integrations.ray_placement import (
    PlacedNode,
    _await_exit,
    place_storage_nodes,
    plan_placement,
    route_to,
    storage_node_id,
)
from tq_redis.meta.keys import PartitionKeys, storage_nodes_key

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
HOSTS = {"nodeA": "tq-host-a", "nodeB": "tq-host-b", "nodeC": "tq-host-c"}


# ------------------------------------------------------------------ placement logic (no Ray)


def _ray_node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, **resources}}


def test_plan_places_on_every_alive_node_without_a_keeper():
    nodes = [_ray_node("a"), _ray_node("b"), _ray_node("c", alive=False), _ray_node("d")]
    assert plan_placement(nodes, placed=[]) == ["a", "b", "d"]
    assert plan_placement(nodes, placed=["b"]) == ["a", "d"]  # refresh: only the new ones
    assert plan_placement(nodes, placed=["a", "b", "d"]) == []
    assert plan_placement(nodes + [_ray_node("a")], placed=[]) == ["a", "b", "d"]  # no node twice


def test_plan_can_be_restricted_to_nodes_offering_a_resource():
    nodes = [_ray_node("a", tq_storage=1), _ray_node("b"), _ray_node("c", tq_storage=0)]
    assert plan_placement(nodes, placed=[], resource="tq_storage") == ["a"]


def test_storage_node_ids_are_stable_and_name_their_ray_node():
    rid = "1fb53dc47b8c3e4a747735e9e103e7080a0a5f6b1578e10fad33b8f2"
    assert storage_node_id(rid) == f"ray-{rid}"
    ids = [storage_node_id(rid, i, 3) for i in range(3)]
    assert len(set(ids)) == 3 and all(i.startswith(f"ray-{rid}-") for i in ids)


def test_route_is_shared_memory_only_for_a_same_host_node_offering_it():
    reg = {"host": "h1", "shm": True, "uds": "tq-dram-x"}
    assert route_to(reg, "h1") == "shm"
    assert route_to(reg, "h2") == "tcp"
    assert route_to({**reg, "shm": False}, "h1") == "tcp"  # a node started --no-shm
    assert route_to({**reg, "uds": None}, "h1") == "tcp"
    placed = PlacedNode.from_registration(
        "r1", {"node_id": "ray-r1", "address": "10.0.0.1:5", "host": socket.gethostname(), "pid": 7,
               "instance": "i", "shm": True, "uds": "tq-dram-i"},
    )  # fmt: skip
    assert placed.route == "shm"  # this process's host


def test_bad_options_raise_typed_errors_before_ray_is_touched(monkeypatch):
    with pytest.raises(InvalidArgument, match="per_node"):
        place_storage_nodes("redis://127.0.0.1:1/0", "ns", per_node=0)
    with pytest.raises(ConfigError, match="lots"):
        place_storage_nodes("redis://127.0.0.1:1/0", "ns", capacity="lots")
    with pytest.raises(ConfigError):
        place_storage_nodes("http://not-redis", "ns")
    # Without a Ray in the process (a fresh interpreter: another test may have started one here):
    # no URL to find, and no ray.init, are ConfigErrors naming what to do.
    check = (
        "import pytest\n"
        "from tq_redis.errors import ConfigError\n"
        "from tq_redis.integrations.ray_placement import place_storage_nodes\n"
        "with pytest.raises(ConfigError, match='redis_url'):\n"
        "    place_storage_nodes()\n"
        "with pytest.raises(ConfigError, match=r'ray\\.init'):\n"
        "    place_storage_nodes('redis://127.0.0.1:1/0', 'ns')\n"
        "print('typed')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TQ_REDIS_URL"}
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "typed", done.stderr


# ------------------------------------------------------------------ a two-node Ray cluster


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-u", "true"], capture_output=True).returncode == 0


class _RayNode:
    """One ``ray start --block`` in its own UTS namespace (own hostname); output drained by a thread."""

    def __init__(self, hostname: str, args: list[str], env: dict[str, str]) -> None:
        ray_bin = str(Path(sys.executable).with_name("ray"))
        cmd = ["unshare", "-u", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, ray_bin, "start", "--block", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.started = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            if "Ray runtime started" in line:
                self.started.set()
        self.started.set()  # exited: the waiter checks the process

    def wait_started(self, timeout: float) -> None:
        if not self.started.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError("ray start failed:\n" + "".join(self.lines[-40:]))

    def descendants(self) -> list[tuple[int, str]]:
        """(pid, start time) of this node's processes: the tree under ``ray start`` and its session."""
        parent: dict[int, int] = {}
        info: dict[int, tuple[int, str]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry)] = int(fields[1])
            info[int(entry)] = (int(fields[3]), fields[19])  # session id, start time
        root = self.proc.pid
        found = {p for p, (sid, _) in info.items() if sid == root}  # start_new_session: sid == root pid
        todo = [root]
        while todo:
            p = todo.pop()
            found.add(p)
            todo.extend(c for c, pp in parent.items() if pp == p and c not in found)
        return [(p, info[p][1]) for p in found if p in info]

    def stop(self) -> None:
        """SIGTERM ``ray start --block`` (it stops what it started), then SIGKILL whatever is left."""
        procs = self.descendants()
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for pid, started in procs:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    still = f.read().rsplit(")", 1)[1].split()[19] == started  # not a reused pid
            except OSError:
                continue
            if still:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


class _Cluster:
    """The test's Ray cluster: ``ray start`` processes, each a "host" with its own hostname."""

    def __init__(self, env: dict[str, str], temp: str) -> None:
        from tq_redis.server.embedded import free_port

        self.env, self.temp, self.port = env, temp, free_port()
        self.nodes: list[_RayNode] = []

    def add(self, name: str) -> None:
        """Start Ray node ``name`` (custom resource ``name``, hostname ``HOSTS[name]``); the first is the head."""
        args = ["--num-cpus=1", f"--temp-dir={self.temp}", "--object-store-memory=80000000",
                "--disable-usage-stats", f"--resources={json.dumps({name: 1})}"]  # fmt: skip
        if self.nodes:
            args.append(f"--address=127.0.0.1:{self.port}")
        else:
            args += ["--head", f"--port={self.port}", "--include-dashboard=false"]
        node = _RayNode(HOSTS[name], args, self.env)
        self.nodes.append(node)
        node.wait_started(60)

    def ray_ids(self) -> dict[str, str]:
        """Custom resource name -> Ray node id, for the alive nodes."""
        return {r: n["NodeID"] for n in ray.nodes() if n["Alive"] for r in n["Resources"] if r in HOSTS}

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()


@pytest.fixture
def ray_cluster(monkeypatch):
    """A head (``nodeA``, host ``tq-host-a``) and a worker (``nodeB``, ``tq-host-b``); this process drives."""
    if not _can_unshare():
        pytest.skip("needs `unshare -u` (root or CAP_SYS_ADMIN) to give each Ray node its own hostname")
    if ray.is_initialized():
        pytest.skip("another test's Ray is running in this process")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's token auth: this process keeps the mode of its first ray.init (a local one, as in
    # test_ray_discovery, turns it on and sets RAY_AUTH_MODE=token with the token it saved), and the
    # cluster must match it; a process that never started Ray gets a cluster without tokens.
    if not os.environ.get("RAY_AUTH_MODE"):
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # rank actors import tests
    env.pop("RAY_ADDRESS", None)
    temp = tempfile.mkdtemp(prefix="tqray", dir="/tmp")  # short: Ray's socket paths live under it
    cluster = _Cluster(env, temp)
    try:
        cluster.add("nodeA")
        cluster.add("nodeB")
        ray.init(address=f"127.0.0.1:{cluster.port}", log_to_driver=False, namespace="tq-test")
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.stop()
        shutil.rmtree(temp, ignore_errors=True)


class _Rank:
    """A rank actor (wrapped with ``ray.remote`` in the test): put, get back, report what it mapped."""

    def __init__(self, url: str, namespace: str) -> None:
        from tq_redis import TransferQueueClient

        self.url, self.namespace = url, namespace
        self.client = TransferQueueClient(url, namespace, nested_output=False)

    def roundtrip(self, partition: str, samples: int, width: int, seed: int) -> dict:
        import torch
        from tensordict import TensorDict

        from tq_redis.integrations.ray_placement import local_storage_node

        x = torch.arange(samples * width, dtype=torch.float32).reshape(samples, width) + seed
        put = self.client.put(TensorDict({"x": x}, batch_size=[samples]), partition_id=partition)
        row_of = {g: i for i, g in enumerate(put.global_indexes)}
        meta = self.client.get_meta(["x"], samples, partition, task_name="check", timeout=10)
        data = self.client.get_data(meta)["x"]
        ok = meta.size == samples and torch.equal(data, x[[row_of[g] for g in meta.global_indexes]])
        del data
        local = local_storage_node(self.url, self.namespace)
        return {
            "ok": ok,
            "host": socket.gethostname(),
            "slabs": _slab_inodes(os.getpid()),  # memory slabs of storage nodes this process has mapped
            "local": None if local is None else (local.node_id, local.route),
        }


def _slab_inodes(pid: int) -> set[int]:
    """Inodes of the storage-node memory slabs (``memfd:tq-dram-slab-*``) process ``pid`` holds open."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        with contextlib.suppress(OSError):
            if "tq-dram-slab" in os.readlink(path):
                found.add(os.stat(path).st_ino)
    return found


def _registry(url: str, ns: str) -> dict[str, dict]:
    import redis

    r = redis.Redis.from_url(url)
    try:
        return {k.decode(): json.loads(v) for k, v in r.hgetall(storage_nodes_key(ns)).items()}
    finally:
        r.close()


def _restarted(placement, ray_node_id: str, before: PlacedNode) -> PlacedNode:
    """The node Ray's restart of ``before``'s keeper placed (each wait is a blocking call to the keeper)."""
    deadline = time.monotonic() + 60
    while True:
        fresh = placement.wait_ready(timeout=60)[ray_node_id][0]
        if fresh.keeper_pid != before.keeper_pid or time.monotonic() > deadline:
            break
    assert fresh.keeper_pid != before.keeper_pid and fresh.instance != before.instance, "not restarted"
    assert fresh.node_id == before.node_id and fresh.host == before.host  # same id, same host
    return fresh


@pytest.mark.slow  # ~40 s: a two-node Ray cluster; CI runs it in the "soak or slow" step
def test_one_storage_node_per_ray_node_used_through_local_shared_memory_and_restarted(ray_cluster, valkey, namespace):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    url = valkey.url
    make_client(url, namespace, backend="dram").close()  # the namespace stores data in the dram store
    ray_ids = ray_cluster.ray_ids()
    assert set(ray_ids) == {"nodeA", "nodeB"}

    placement = place_storage_nodes(url, namespace, capacity="64MiB")
    node_of: dict[str, PlacedNode] = {}
    try:
        placed = placement.wait_ready(timeout=60)
        # one node per Ray node, registered under an id naming that Ray node, running on its host
        assert set(placed) == set(ray_ids.values())
        registry = _registry(url, namespace)
        for name, rid in ray_ids.items():
            (node,) = placed[rid]
            assert node.node_id == f"ray-{rid}" and registry[node.node_id]["instance"] == node.instance
            assert registry[node.node_id]["host"] == node.host == HOSTS[name]  # node affinity held
            node_of[name] = node
        # placing again (another driver, a retry) reuses the keepers: no second node per Ray node
        again = place_storage_nodes(url, namespace, capacity="64MiB").wait_ready(timeout=60)
        assert {r: [n.keeper_pid for n in ns] for r, ns in again.items()} == {
            r: [n.keeper_pid for n in ns] for r, ns in placed.items()
        }
        assert placement.refresh() == []  # no Ray node without one

        Rank = ray.remote(num_cpus=0)(_Rank)
        ranks: dict[str, object] = {}

        def add_rank(name: str) -> None:
            strategy = NodeAffinitySchedulingStrategy(ray_ids[name], soft=False)
            ranks[name] = Rank.options(scheduling_strategy=strategy).remote(url, namespace)

        def check_round(tag: str) -> None:
            # 32 samples of 64 KiB: each node's share is far above the store's inline threshold
            refs = [r.roundtrip.remote(f"{tag}-{n}", 32, 16384, i) for i, (n, r) in enumerate(ranks.items())]
            out = dict(zip(ranks, ray.get(refs)))
            slabs = {name: _slab_inodes(node.pid) for name, node in node_of.items()}
            assert all(slabs.values()), f"{tag}: every storage node holds data"
            for name, res in out.items():
                assert res["ok"], f"{tag}: rank on {name} read back different bytes"
                assert res["host"] == HOSTS[name]
                assert res["local"] == (node_of[name].node_id, "shm")
                # same host: it mapped its local node's memory; the other hosts' only over TCP
                assert res["slabs"] & slabs[name], f"{tag}: rank on {name} did not use its node's shared memory"
                for other in node_of.keys() - {name}:
                    assert not res["slabs"] & slabs[other], f"{tag}: rank on {name} mapped {other}'s memory"

        for name in ray_ids:
            add_rank(name)
        check_round("before")

        # SIGKILL nodeB's keeper actor: its node stops, Ray restarts the keeper, which starts a new one
        victim = node_of["nodeB"]
        os.kill(victim.keeper_pid, signal.SIGKILL)
        assert _await_exit(victim.pid, 30), "the killed keeper's storage node did not stop"
        node_of["nodeB"] = _restarted(placement, ray_ids["nodeB"], victim)
        assert _registry(url, namespace)[victim.node_id]["instance"] == node_of["nodeB"].instance
        check_round("keeper-killed")  # puts and gets work again, through the new node's memory too

        # SIGKILL nodeA's storage-node process itself: the keeper exits with it and Ray restarts both
        victim = node_of["nodeA"]
        os.kill(victim.pid, signal.SIGKILL)
        node_of["nodeA"] = _restarted(placement, ray_ids["nodeA"], victim)
        check_round("node-killed")

        # values the driver put before a Ray node joins stay readable, and clearable, after it joined
        early_rows = torch.arange(64 * 512).reshape(64, 512)
        writer = make_client(url, namespace, backend="dram")
        early = writer.put(TensorDict({"x": early_rows}, batch_size=[64]), partition_id="early")
        writer.close()

        # a Ray node joins: refresh() places on it, and a rank there uses it through shared memory
        ray_cluster.add("nodeC")
        ray_ids = ray_cluster.ray_ids()
        assert placement.refresh() == [ray_ids["nodeC"]]
        (node_of["nodeC"],) = placement.wait_ready(timeout=60)[ray_ids["nodeC"]]
        assert node_of["nodeC"].host == HOSTS["nodeC"]
        add_rank("nodeC")
        check_round("joined")
        reader = make_client(url, namespace, backend="dram")
        assert torch.equal(reader.get_data(early)["x"], early_rows)
        reader.clear_partition("early")
        assert not reader.redis.exists(PartitionKeys(namespace, "early").rings)
        reader.close()

        # a node that cannot start (Redis unreachable) is reported, naming the Ray nodes, not waited on
        bad = place_storage_nodes("redis://127.0.0.1:1/0", namespace + "-bad", capacity="16MiB", start_timeout=5)
        try:
            with pytest.raises(StorageUnavailable, match="cannot register in Redis") as err:
                bad.wait_ready(timeout=60)
            assert all(rid in str(err.value) for rid in ray_ids.values())
        finally:
            bad.shutdown()
    finally:
        placement.shutdown()
    assert not any(k.startswith("ray-") for k in _registry(url, namespace)), "nodes deregister on shutdown"
    assert all(_await_exit(n.pid, 15) for n in node_of.values())
