"""init() on the embedded default, attaching from other processes, and close()."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.api.system import NotInitialized

ATTACH = """
import sys, torch, tq_redis as tq
cfg = tq.init()                      # attaches: TQ_REDIS_URL / TQ_NAMESPACE are set
client = tq.get_client()
meta = client.get_meta(["x"], 4, "p", task_name="other-process", timeout=10)
data = client.get_data(meta)
assert data["x"].tolist() == [0, 1, 2, 3], data["x"]
client.put({"y": torch.full((4,), 7)}, metadata=meta)
print("attached", cfg["redis"]["url"], cfg["namespace"])
tq.close()
"""


@pytest.mark.parametrize("backend", ["redis", "dram"])
def test_embedded_default_and_attach_from_another_process(backend, monkeypatch):
    monkeypatch.delenv("TQ_REDIS_URL", raising=False)
    cfg = tq.init({"namespace": "rt", "storage": {"backend": backend}})
    url = cfg["redis"]["url"]
    try:
        # the embedded server's clients reach it through its socket file, with its password (see
        # tq_redis.server.embedded), which the URL handed to other processes carries
        assert url.startswith("unix://:") and url.endswith("/valkey.sock")
        assert len(redis.connection.parse_url(url)["password"]) >= 32
        assert "U" in tq.get_client().redis.client_info()["flags"]
        assert cfg["namespace"] == "rt"
        assert tq.init() is cfg  # idempotent within a process
        client = tq.get_client()
        client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id="p")
        env = dict(os.environ, TQ_REDIS_URL=url, TQ_NAMESPACE="rt")
        out = subprocess.run([sys.executable, "-c", ATTACH], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"attached {url} rt" in out.stdout
        meta = client.get_meta(["x", "y"], 4, "p", task_name="main")
        assert client.get_data(meta)["y"].tolist() == [7, 7, 7, 7]
    finally:
        tq.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
    with pytest.raises(NotInitialized):
        tq.get_client()
    tq.close()  # idempotent


def test_embedded_nodes_spill_beyond_their_capacity(monkeypatch, tmp_path):
    monkeypatch.delenv("TQ_REDIS_URL", raising=False)
    storage = {"backend": "dram", "units": 1, "unit_capacity": "1MiB", "spill": str(tmp_path)}
    tq.init({"namespace": "rt-spill", "storage": storage})
    try:
        client = tq.get_client()
        x = torch.arange(64 * 4096).reshape(64, 4096)  # 2 MiB: twice the node's memory
        meta = client.put(TensorDict({"x": x}, batch_size=[64]), partition_id="p")
        assert torch.equal(client.get_data(meta)["x"].to_padded_tensor(0), x)  # nested by default
        assert sum(len(files) for _d, _s, files in os.walk(tmp_path)) == 64
        client.clear_partition("p")
        assert sum(len(files) for _d, _s, files in os.walk(tmp_path)) == 0
    finally:
        tq.close()
    assert list(tmp_path.iterdir()) == []


def test_the_embedded_server_has_its_own_process_group_in_our_session():
    """Ctrl-C in a terminal (the foreground process group) does not reach the server, yet it stays
    in our session: Linux schedules a session as one group, and a server in a session of its own
    is woken per request under load. A detached server (``up --detach``) gets its own session,
    so closing the terminal does not stop it."""
    from tq_redis.server.embedded import EmbeddedServer

    server = EmbeddedServer().start()
    try:
        pid = server.process.pid
        assert os.getsid(pid) == os.getsid(0)
        assert os.getpgid(pid) == pid != os.getpgid(0)
    finally:
        server.stop()
    detached = EmbeddedServer(die_with_parent=False).start()
    try:
        assert os.getsid(detached.process.pid) == detached.process.pid != os.getsid(0)
    finally:
        detached.stop()
