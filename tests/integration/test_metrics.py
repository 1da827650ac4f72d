"""Prometheus metrics: recorded by clients, served by the exporter, scraped over HTTP."""

from __future__ import annotations

import re
import urllib.request

import torch
from tensordict import TensorDict

import tq_redis as tq


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


def test_grafana_dashboard_queries_metrics_we_export():
    import json
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[2] / "deploy/grafana/tq-redis-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for name in ("tq_redis_redis_call_seconds_bucket", "tq_redis_bytes_total", "tq_redis_queue_depth",
                 "tq_redis_in_flight", "tq_redis_wait_seconds_bucket", "tq_redis_store_call_seconds_bucket"):
        assert name in exprs
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
