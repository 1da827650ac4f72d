"""Prometheus metrics: recorded by clients, served by the exporter, scraped over HTTP."""

from __future__ import annotations

import re
import urllib.request

import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.monitor import status


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def _value(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in scrape")


def test_exporter_serves_client_and_queue_metrics(monkeypatch):
    monkeypatch.delenv("TQ_REDIS_URL", raising=False)
    tq.init({"namespace": "met", "metrics": {"enabled": True, "port": 0}})  # embedded default: DRAM nodes
    try:
        endpoint = tq.get_metrics_endpoint()
        assert endpoint and re.match(r"http://127\.0\.0\.1:\d+/metrics", endpoint)
        client = tq.get_client()
        before = _scrape(endpoint)
        claims_before = _value(before, "tq_redis_redis_call_seconds_count", fn="claim") if 'fn="claim"' in before \
            else 0.0
        # 8 KiB values: above storage.inline_max_bytes, so they go through the DRAM store
        client.put(TensorDict({"x": torch.zeros(10, 1024, dtype=torch.int64)}, batch_size=[10]), partition_id="p")
        meta = client.get_meta(["x"], 4, "p", task_name="actor")
        client.get_data(meta)
        client.get_meta(["x"], 2, "p", task_name="critic", lease_s=60)
        text = _scrape(endpoint)
        assert _value(text, "tq_redis_redis_call_seconds_count", fn="claim") == claims_before + 2
        assert _value(text, "tq_redis_bytes_total", direction="put", store="dram") >= 10 * 1024 * 8
        assert _value(text, "tq_redis_bytes_total", direction="get", store="dram") >= 4 * 1024 * 8
        assert _value(text, "tq_redis_partition_samples", namespace="met", partition="p") == 10
        assert _value(text, "tq_redis_queue_depth", namespace="met", partition="p", task="actor") == 6
        assert _value(text, "tq_redis_queue_depth", namespace="met", partition="p", task="critic") == 8
        assert _value(text, "tq_redis_in_flight", namespace="met", partition="p", task="critic") == 2
        node_lines = [ln for ln in text.splitlines() if ln.startswith("tq_redis_node_capacity_bytes{")]
        assert len(node_lines) == 2 and all(float(ln.rsplit(" ", 1)[1]) > 0 for ln in node_lines)
    finally:
        tq.close()
    assert tq.get_metrics_endpoint() is None


def test_grafana_dashboard_queries_metrics_we_export(valkey, namespace):
    """Every metric name the dashboard's queries and variables use is one an exporter emits in this
    run: the standalone exporter's namespace gauges, or a process's own instruments."""
    import json
    from pathlib import Path

    from prometheus_client import generate_latest

    from tests.conftest import make_client
    from tq_redis.backends.dram.launcher import start_local_nodes
    from tq_redis.errors import InvalidArgument
    from tq_redis.instruments import REGISTRY

    dash = json.loads((Path(__file__).parents[2] / "deploy/grafana/tq-redis-dashboard.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "partition", "task"} <= set(variables)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in variables.values() if v["type"] == "query"]
    used = set(re.findall(r"\btq_redis_[a-z_]+", " ".join(exprs)))
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])

    nodes = start_local_nodes(valkey.url, namespace, n=1, capacity="64MiB")
    client = make_client(valkey.url, namespace, "dram", inline_max_bytes=4096)
    try:
        client.put(TensorDict({"x": torch.zeros(4, 1024, dtype=torch.int64), "y": torch.arange(4)}, batch_size=[4]),
                   partition_id="p")
        client.get_data(client.get_meta(["x", "y"], 2, "p", task_name="t", timeout=5))
        try:
            client.get_meta(["x"], 0, "p", task_name="t")
        except InvalidArgument:
            pass
        proc, endpoint = _start_exporter(valkey.url, namespace)
        try:
            emitted = _scrape(endpoint) + generate_latest(REGISTRY).decode()
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        client.close()
        nodes.stop()
    names = {line.split("{")[0].split(" ")[0] for line in emitted.splitlines() if line.startswith("tq_redis_")}
    missing = sorted(used - names)
    assert not missing, f"the dashboard queries metrics no exporter emitted: {missing}"
    for panel in dash["panels"]:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"


def _start_exporter(url: str, namespace: str):
    """``tq-redis exporter`` as its own process on a free port; returns (process, endpoint)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "tq_redis.cli.main", "exporter", "--redis", url,
                             "--namespace", namespace, "--port", "0"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # it prints its endpoint once it serves
    m = re.search(r"at (http://\S+/metrics)", line)
    assert m, f"tq-redis exporter printed {line!r}"
    return proc, m.group(1)


def _inline_bytes(url: str, namespace: str, partition: str, ids, field: str) -> int:
    from tq_redis.meta.keys import PartitionKeys
    from tq_redis.server import connections

    r = connections.sync_client(url)
    try:
        return sum(r.hstrlen(PartitionKeys(namespace, partition).inline, f"{i}:{field}") for i in ids)
    finally:
        r.close()


def test_standalone_exporter_and_counters_say_exactly_what_a_known_workload_did(real_server, namespace):
    """Put k=12 samples of b=64 bytes (8 int64, inline), produce a second field for 5, claim j=5 with
    a lease (actor), 3 plainly (critic), read the 3, nack 2 of the leases, poison one, fail once: the
    standalone exporter's gauges and this process's counters say exactly so."""
    from tests.conftest import make_client
    from tq_redis import errors
    from tq_redis.instruments import REGISTRY

    def counter(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    k, b, j = 12, 64, 5
    client = make_client(real_server.url, namespace, inline_max_bytes=4096)
    other = make_client(real_server.url, namespace + "o", inline_max_bytes=4096)
    other.put(TensorDict({"x": torch.zeros(7, 8, dtype=torch.int64)}, batch_size=[7]), partition_id="p")
    put_before = counter("tq_redis_bytes_total", direction="put", store="inline")
    get_before = counter("tq_redis_bytes_total", direction="get", store="inline")
    values_before = counter("tq_redis_values_total", direction="put", store="inline")
    errors_before = counter("tq_redis_errors_total", type="InvalidArgument")
    meta = client.put(TensorDict({"x": torch.arange(k * 8, dtype=torch.int64).reshape(k, 8)}, batch_size=[k]),
                      partition_id="p")
    client.put(TensorDict({"y": torch.ones(5, dtype=torch.int64)}, batch_size=[5]), metadata=meta[0:5])
    leased = client.get_meta(["x"], j, "p", task_name="actor", lease_s=600)
    read = client.get_meta(["x"], 3, "p", task_name="critic")
    client.get_data(read)
    client.nack(leased.select_samples([0, 1]))
    client.get_meta(["x"], 2, "p", task_name="actor", lease_s=600)  # the nacked two again: redelivered
    probe = client.get_meta(["x"], 1, "p", task_name="probe", lease_s=600, max_deliveries=1)
    client.nack(probe)
    client.get_meta(["x"], 1, "p", task_name="probe", lease_s=600, max_deliveries=1)  # sample 0: poison
    try:
        client.get_meta(["x"], 0, "p", task_name="actor")
    except errors.InvalidArgument:
        pass
    else:
        raise AssertionError("batch_size=0 was accepted")

    stored_x = _inline_bytes(real_server.url, namespace, "p", range(k), "x")
    stored_y = _inline_bytes(real_server.url, namespace, "p", range(5), "y")
    assert stored_x >= k * b  # each value: 64 bytes of int64 and the codec's header
    assert counter("tq_redis_bytes_total", direction="put", store="inline") - put_before == stored_x + stored_y
    assert counter("tq_redis_values_total", direction="put", store="inline") - values_before == k + 5
    assert counter("tq_redis_bytes_total", direction="get", store="inline") - get_before == \
        _inline_bytes(real_server.url, namespace, "p", read.global_indexes, "x")
    assert counter("tq_redis_errors_total", type="InvalidArgument") - errors_before == 1

    proc, endpoint = _start_exporter(real_server.url, namespace)
    try:
        text = _scrape(endpoint)
        ns, p = namespace, "p"
        assert _value(text, "tq_redis_namespace_up", namespace=ns) == 1
        assert _value(text, "tq_redis_partition_samples", namespace=ns, partition=p) == k
        assert _value(text, "tq_redis_field_produced", namespace=ns, partition=p, field="x") == k
        assert _value(text, "tq_redis_field_produced", namespace=ns, partition=p, field="y") == 5
        assert _value(text, "tq_redis_field_produced_ratio", namespace=ns, partition=p, field="y") == 5 / k
        actor = {"namespace": ns, "partition": p, "task": "actor"}
        # the actor holds 5 leases (2 of them redelivered); of the 7 left, none has y
        assert _value(text, "tq_redis_in_flight", **actor) == j
        assert _value(text, "tq_redis_redelivered_samples", **actor) == 2
        assert _value(text, "tq_redis_unclaimed", **actor) == k - j
        assert _value(text, "tq_redis_queue_depth", **actor) == 0  # no waiter said which fields: x and y
        critic = {**actor, "task": "critic"}
        assert _value(text, "tq_redis_consumed", **critic) == 3
        assert _value(text, "tq_redis_consumed_ratio", **critic) == 0.25
        assert _value(text, "tq_redis_in_flight", **critic) == 0
        probe = {**actor, "task": "probe"}
        assert _value(text, "tq_redis_poison", **probe) == 1 and _value(text, "tq_redis_in_flight", **probe) == 1
        assert _value(text, "tq_redis_leases_lapsed", **actor) == 0
        assert _value(text, "tq_redis_waiters", **actor) == 0
        assert _value(text, "tq_redis_inline_values", namespace=ns, partition=p) == k + 5
        assert _value(text, "tq_redis_server_used_memory_bytes", namespace=ns) > 0
        assert namespace + "o" not in text  # one namespace only
        # read once per scrape: a change shows at the next scrape
        client.put(TensorDict({"x": torch.zeros(3, 8, dtype=torch.int64)}, batch_size=[3]), partition_id="p")
        assert _value(_scrape(endpoint), "tq_redis_partition_samples", namespace=ns, partition=p) == k + 3
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    client.close()
    other.close()


def test_event_counters_say_what_happened_and_survive_a_clear(server, namespace):
    """k=3 lease expiries, j=5 redeliveries, p=1 poisoned sample, counted by the scripts as they happen:
    the status snapshot and the exporter's ``..._total`` counters say exactly so, before and after
    the partition is cleared (the gauges read from ``dlv:``/``poison:`` drop to nothing then)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from tests.conftest import make_client
    from tq_redis.monitor.exporter import NamespaceCollector
    from tq_redis.monitor.status import snapshot

    client = make_client(server.url, namespace, inline_max_bytes=4096)
    client.put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id="p")
    # 3 leases lapse; the next claim of the task (blocked until they do, on the server's clock)
    # takes them back and hands them out again: 3 expiries, 3 redeliveries
    first = client.get_meta(["x"], 3, "p", task_name="actor", lease_s=0.2)
    again = client.get_meta(["x"], 3, "p", task_name="actor", lease_s=600, timeout=60)
    assert again.global_indexes == first.global_indexes
    client.put(TensorDict({"x": torch.arange(7)}, batch_size=[7]), partition_id="p")
    client.nack(again.select_samples([0, 1]))  # handed back now (no expiry): 2 more redeliveries
    assert client.get_meta(["x"], 2, "p", task_name="actor", lease_s=600).size == 2
    probe = client.get_meta(["x"], 1, "p", task_name="probe", lease_s=600, max_deliveries=1)
    client.nack(probe)
    client.get_meta(["x"], 1, "p", task_name="probe", lease_s=600, max_deliveries=1)  # sample 0 turns poison
    client.get_meta(["x"], 4, "p", task_name="critic")  # fetch mode: no lease, nothing counted
    expected = {
        "actor": {"lease_expiries": 3, "redeliveries": 5, "poisoned": 0},
        "probe": {"lease_expiries": 0, "redeliveries": 0, "poisoned": 1},
    }
    registry = CollectorRegistry(auto_describe=False)
    collector = NamespaceCollector(server.url, namespace)
    registry.register(collector)
    try:
        for moment in ("before the clear", "after the clear"):
            snap = snapshot(client.redis, namespace)
            assert snap["counters"] == {"total": {"lease_expiries": 3, "redeliveries": 5, "poisoned": 1},
                                        "partitions": {"p": expected}}, moment
            text = generate_latest(registry).decode()
            for task, counts in expected.items():
                labels = {"namespace": namespace, "partition": "p", "task": task}
                assert _value(text, "tq_redis_lease_expiries_total", **labels) == counts["lease_expiries"], moment
                assert _value(text, "tq_redis_redeliveries_total", **labels) == counts["redeliveries"], moment
                assert _value(text, "tq_redis_poisoned_total", **labels) == counts["poisoned"], moment
            if moment == "before the clear":
                assert _value(text, "tq_redis_redeliveries_total", namespace=namespace, partition="p",
                              task="critic") == 0  # a task that counted nothing yet: its series at 0
                assert snap["partitions"][0]["tasks"]["actor"]["redeliveries"] == 5
                assert "lease expiries 3, redeliveries 5, poisoned 1" in status.render(snap)
                client.clear_partition("p")
            else:
                assert snap["partitions"] == []  # the gauges' records went with the partition
    finally:
        collector.close()
        client.close()
