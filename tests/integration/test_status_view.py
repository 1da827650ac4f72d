"""``tq-redis status`` against a known workload: claimable, waiters, leases, redeliveries, poison,
partition age, where bytes live, the server's memory and policy; ``--watch`` rates; a typed
one-line error for an unreachable server; one namespace only; a Redis Cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import torch
from tensordict import TensorDict

from tests.cluster import cluster  # noqa: F401
from tests.conftest import make_client
from tq_redis.monitor import status_view
from tq_redis.monitor.status import render, snapshot
from tq_redis.server import connections
from tq_redis.server.embedded import free_port

CLI = [sys.executable, "-m", "tq_redis.cli.main"]


def _status_json(url: str, namespace: str) -> dict:
    out = subprocess.run(CLI + ["status", "--json", "--redis", url, "--namespace", namespace],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _until(condition, what: str, deadline_s: float = 60.0):
    """Poll ``condition`` (a state to reach, not a time to wait) until it returns truthy."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"never reached: {what}")


def _workload(url: str, namespace: str):
    """10 samples of field a (8 bytes each, inline), b produced for 4; actor claims 6 of a; critic
    leases 2 of a for 60 s; judge leases 3 and nacks them (redelivered); probe leases 1 with
    max_deliveries=1, nacks it and claims again (sample 0 goes to poison, sample 1 in flight)."""
    client = make_client(url, namespace, inline_max_bytes=4096)
    meta = client.put(TensorDict({"a": torch.arange(10, dtype=torch.int64)}, batch_size=[10]), partition_id="p")
    client.put(TensorDict({"b": torch.arange(4, dtype=torch.int64)}, batch_size=[4]), metadata=meta[0:4])
    client.get_meta(["a"], 6, "p", task_name="actor")
    client.get_meta(["a"], 2, "p", task_name="critic", lease_s=60)
    judged = client.get_meta(["a"], 3, "p", task_name="judge", lease_s=60)
    client.nack(judged)
    client.get_meta(["a"], 3, "p", task_name="judge", lease_s=60)
    probe = client.get_meta(["a"], 1, "p", task_name="probe", lease_s=60, max_deliveries=1)
    client.nack(probe)
    client.get_meta(["a"], 1, "p", task_name="probe", lease_s=60, max_deliveries=1)  # puts sample 0 aside
    return client


def test_status_answers_the_operators_questions(real_server, namespace):
    client = _workload(real_server.url, namespace)
    other = make_client(real_server.url, namespace + "x", inline_max_bytes=4096)  # another job's namespace
    other.put(TensorDict({"z": torch.arange(3)}, batch_size=[3]), partition_id="q")
    waiting = threading.Event()
    got = {}

    def ref_waits():
        waiting.set()
        got["meta"] = client.get_meta(["b"], 5, "p", task_name="ref", timeout=120)

    thread = threading.Thread(target=ref_waits, daemon=True)
    thread.start()
    waiting.wait(30)
    snap = _until(lambda: (s := _status_json(real_server.url, namespace))["partitions"][0]["tasks"]
                  .get("ref", {}).get("waiters") and s, "ref's consumer registered as a waiter")
    assert snap["namespace"] == namespace and [p["id"] for p in snap["partitions"]] == ["p"]  # not q
    (p,) = snap["partitions"]
    assert p["samples"] == 10 and p["age_s"] is not None and p["age_s"] >= 0
    tasks = p["tasks"]
    # actor consumed 6; with every field needed (a and b), of the 4 complete samples none is left
    assert tasks["actor"]["consumed"] == 6 and tasks["actor"]["unclaimed"] == 4
    assert tasks["actor"]["claimable_fields"] == ["a", "b"] and tasks["actor"]["claimable"] == 0
    assert tasks["critic"]["in_flight"] == 2 and tasks["critic"]["claimable"] == 2  # samples 2, 3
    assert tasks["critic"]["lapsed"] == 0 and 0 < tasks["critic"]["next_deadline_s"] <= 60
    assert tasks["judge"]["redelivered"] == 3 and tasks["judge"]["max_delivery"] == 2
    assert tasks["judge"]["in_flight"] == 3
    assert tasks["probe"]["poison"] == 1 and tasks["probe"]["in_flight"] == 1
    # ref waits for 5 samples with b: 4 are claimable for it
    assert tasks["ref"]["waiters"] == 1
    assert tasks["ref"]["waiting_for"] == {"batch": 5, "fields": ["b"]}
    assert tasks["ref"]["claimable_fields"] == ["b"] and tasks["ref"]["claimable"] == 4
    assert p["inline"]["values"] == 14 and p["inline"]["bytes"] > 14 * 8
    assert snap["bytes"]["inline"] == p["inline"]["bytes"] and snap["bytes"]["nodes"] == {}
    server = snap["server"]
    assert server["version"] and server["used_memory"] > 0 and server["maxmemory_policy"]
    assert server["product"] == ("redis" if real_server.flavour == "redis7" else "valkey")

    text = subprocess.run(CLI + ["status", "--plain", "--redis", real_server.url, "--namespace", namespace],
                          capture_output=True, text=True, timeout=120).stdout
    assert "partition 'p': 10 samples" in text and "age " in text
    assert "claimable      4" in text and "waiters 1 (for batch 5 of b)" in text
    assert "leases 2 (0 lapsed, next lapses in" in text and "redelivered 3" in text and "poison 1" in text
    assert "inline in Redis (14 values)" in text and "eviction policy" in text
    assert "'q'" not in text

    client.put(TensorDict({"b": torch.arange(6, dtype=torch.int64)}, batch_size=[6]),
               metadata=client.get_meta(["a"], 10, "p", mode="force_fetch")[4:10])
    thread.join(60)
    assert len(got["meta"]) == 5
    after = _status_json(real_server.url, namespace)["partitions"][0]["tasks"]
    assert after["ref"]["waiters"] == 0 and after["ref"]["consumed"] == 5
    client.close()
    other.close()


def test_status_renders_with_rich(valkey, namespace):
    from rich.console import Console

    client = _workload(valkey.url, namespace)
    r = connections.sync_client(valkey.url)
    snap = snapshot(r, namespace)
    console = Console(record=True, width=220)
    for item in status_view.rich_renderables(snap):
        console.print(item)
    text = console.export_text()
    assert "partition 'p': 10 samples" in text and "claimable" in text and "redelivered" in text
    assert "leases 2 (0 lapsed" in text and "inline in Redis (14 values)" in text
    r.close()
    client.close()


def test_watch_shows_rates_between_refreshes(valkey, namespace):
    client = make_client(valkey.url, namespace, inline_max_bytes=4096)
    client.put(TensorDict({"a": torch.arange(4)}, batch_size=[4]), partition_id="p")
    proc = subprocess.Popen(CLI + ["status", "--watch", "--json", "--interval", "0.2", "--redis", valkey.url,
                                   "--namespace", namespace], stdout=subprocess.PIPE, text=True)
    try:
        decoder = json.JSONDecoder()
        buffer = ""

        def next_snapshot():
            nonlocal buffer
            while True:
                buffer = buffer.lstrip()
                try:
                    snap, end = decoder.raw_decode(buffer)
                except ValueError:
                    line = proc.stdout.readline()
                    assert line, "status --watch exited"
                    buffer += line
                    continue
                buffer = buffer[end:]
                return snap

        next_snapshot()
        client.put(TensorDict({"a": torch.arange(6)}, batch_size=[6]), partition_id="p")
        client.get_meta(["a"], 5, "p", task_name="actor")
        snap = _until(lambda: (s := next_snapshot())["partitions"][0]["samples"] == 10 and s, "the second put seen")
        # the refresh that saw the put may have seen the claim already; rates are positive per second
        assert snap["rates"]["p"]["samples"] > 0 and snap["rates"]["p"]["fields"]["a"] > 0
    finally:
        proc.terminate()
        proc.wait(30)
    client.close()


def test_unreachable_server_is_one_typed_line():
    url = f"redis://127.0.0.1:{free_port()}/0"
    for command in (["status"], ["status", "--json"], ["exporter", "--port", "0"], ["dashboard", "--port", "0"]):
        out = subprocess.run(CLI + command + ["--redis", url, "--namespace", "x"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "cannot reach Redis" in out.stderr
    out = subprocess.run(CLI + ["status", "--redis", "redis://:secret@127.0.0.1:1/0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "secret" not in out.stderr and "Traceback" not in out.stderr


def test_status_exporter_and_dashboard_on_a_cluster(cluster, namespace):  # noqa: F811
    client = _workload(cluster.url, namespace)
    snap = _status_json(cluster.url, namespace)
    (p,) = snap["partitions"]
    assert p["tasks"]["critic"]["in_flight"] == 2 and p["tasks"]["judge"]["redelivered"] == 3
    assert p["tasks"]["probe"]["poison"] == 1 and p["inline"]["values"] == 14
    assert snap["server"]["primaries"] == 3 and snap["server"]["used_memory"] > 0
    assert "partition 'p'" in render(snap)
    # the exporter and the live page read the same snapshot on a cluster
    import urllib.request

    from tq_redis.monitor.dashboard import serve
    from tq_redis.monitor.exporter import serve_namespace

    server, endpoint, collector = serve_namespace(cluster.url, namespace)
    try:
        with urllib.request.urlopen(endpoint, timeout=30) as resp:
            text = resp.read().decode()
        assert f'tq_redis_namespace_up{{namespace="{namespace}"}} 1.0' in text
        assert f'tq_redis_in_flight{{namespace="{namespace}",partition="p",task="critic"}} 2.0' in text
    finally:
        server.shutdown()
        server.server_close()
        collector.close()
    server, page, dashboard = serve(cluster.url, namespace)
    try:
        with urllib.request.urlopen(page + "api/snapshot", timeout=30) as resp:
            body = json.loads(resp.read())
        assert body["errors"] == [] and body["snapshot"]["partitions"][0]["tasks"]["probe"]["poison"] == 1
    finally:
        server.shutdown()
        server.server_close()
        dashboard.close()
    client.close()


def test_each_storage_node_is_named_once(valkey, namespace):
    """A node named by its address (no --node-id) appears once, not as "id address"; a node with an
    id of its own is shown with its address after it. Plain text, rich tables and the JSON."""
    from rich.console import Console

    from tq_redis.backends.dram.launcher import spawn_node, start_local_nodes

    nodes = start_local_nodes(valkey.url, namespace, n=1, capacity="64MiB")
    named = spawn_node(valkey.url, namespace, capacity="64MiB", node_id="gpu-host-7")
    try:
        snap = _status_json(valkey.url, namespace)
        by_id = {n["id"]: n for n in snap["storage_nodes"]}
        assert len(by_id) == 2 and "gpu-host-7" in by_id
        (plain_id,) = [i for i in by_id if i != "gpu-host-7"]
        assert by_id[plain_id]["address"] == plain_id  # a node without --node-id is named by its address
        own_address = by_id["gpu-host-7"]["address"]
        text = subprocess.run(CLI + ["status", "--plain", "--redis", valkey.url, "--namespace", namespace],
                              capture_output=True, text=True, timeout=120, check=True).stdout
        console = Console(record=True, width=220)
        r = connections.sync_client(valkey.url)
        for item in status_view.rich_renderables(snapshot(r, namespace)):
            console.print(item)
        r.close()
        for shown in (text, console.export_text()):
            assert shown.count(plain_id) == 1, shown
            assert shown.count("gpu-host-7") == 1 and shown.count(own_address) == 1, shown
        assert f"node gpu-host-7 at {own_address}:" in text and f"node {plain_id}:" in text
    finally:
        named.stop()
        nodes.stop()
