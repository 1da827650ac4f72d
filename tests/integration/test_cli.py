"""The ``tq-redis`` command: ``up`` in the foreground, ``status`` (text and --json), ``--version``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import redis
import torch
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client
from tests.procs import up_attach

CLI = [sys.executable, "-m", "tq_redis.cli.main"]


def test_status_json_reflects_known_state(real_server, namespace):
    client = make_client(real_server.url, namespace)
    meta = client.put(TensorDict({"a": torch.arange(10)}, batch_size=[10]), partition_id="p")
    client.put(TensorDict({"b": torch.arange(4)}, batch_size=[4]), metadata=meta[0:4])
    client.get_meta(["a"], 6, "p", task_name="actor")
    client.get_meta(["a"], 2, "p", task_name="critic", lease_s=60)
    out = subprocess.run(CLI + ["status", "--json", "--redis", real_server.url, "--namespace", namespace],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    (p,) = snap["partitions"]
    assert p["id"] == "p" and p["samples"] == 10
    assert p["fields"]["a"] == {"produced": 10, "pct": 100.0}
    assert p["fields"]["b"] == {"produced": 4, "pct": 40.0}
    actor = p["tasks"]["actor"]
    assert {k: actor[k] for k in ("consumed", "in_flight", "poison", "pct")} == \
        {"consumed": 6, "in_flight": 0, "poison": 0, "pct": 60.0}
    assert p["tasks"]["critic"]["in_flight"] == 2 and p["tasks"]["critic"]["consumed"] == 0
    text = subprocess.run(CLI + ["status", "--redis", real_server.url, "--namespace", namespace],
                          capture_output=True, text=True, timeout=180).stdout
    assert "partition 'p': 10 samples" in text and "leases 2 (0 lapsed" in text
    client.close()


def test_status_needs_a_url():
    env = {k: v for k, v in os.environ.items() if k != "TQ_REDIS_URL"}
    out = subprocess.run(CLI + ["status"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "TQ_REDIS_URL" in out.stderr


def test_version_says_whether_batches_are_copied_and_scanned_natively():
    wide = {**os.environ, "COLUMNS": "200"}  # argparse wraps the version line to the terminal
    on = subprocess.run(CLI + ["--version"], capture_output=True, text=True, env=wide, timeout=60, check=True)
    assert on.stdout.startswith("tq-redis ") and "native batch copies on" in on.stdout
    assert "native batch scans on" in on.stdout
    env = {**os.environ, "TQ_NATIVE_COPY": "0", "COLUMNS": "200"}
    off = subprocess.run(CLI + ["--version"], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert "native batch copies off" in off.stdout and "TQ_NATIVE_COPY" in off.stdout
    assert "native batch scans on" in off.stdout  # each module is switched off on its own
    env = {**os.environ, "TQ_NATIVE_SCAN": "0", "COLUMNS": "200"}
    off = subprocess.run(CLI + ["--version"], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert "native batch scans off" in off.stdout and "TQ_NATIVE_SCAN" in off.stdout


def test_up_serves_until_interrupted():
    proc = subprocess.Popen(CLI + ["up", "--units", "2", "--capacity", "64MiB", "--namespace", "upns"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner, url = up_attach(proc)
        assert banner.startswith("tq-redis up: redis://:***@"), banner
        client = tq.TransferQueueClient(url, "upns")
        meta = client.put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id="p")
        assert client.get_data(meta)["x"].tolist() == [0, 1, 2]
        nodes = client.redis.hgetall("upns:storage:nodes")
        assert len(nodes) == 2
        client.close()
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, rest
        assert "stopped" in rest
        try:
            redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
            raise AssertionError("Redis still answers after up stopped")
        except redis.ConnectionError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
