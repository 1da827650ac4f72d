"""Invariant 5: metadata survives a Redis restart with AOF, and clients reconnect with backoff."""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import _redis7_binary, make_client
from tq_redis.embedded import EmbeddedServer


@pytest.mark.parametrize("flavour", ["valkey", "redis7"])
def test_metadata_survives_crash_and_client_reconnects(tmp_path, namespace, flavour):
    binary = None
    if flavour == "redis7":
        binary = _redis7_binary()
        if binary is None:
            pytest.skip("redis-server not installed")
    server = EmbeddedServer(data_dir=tmp_path, appendonly=True, appendfsync="always", binary=binary).start()
    client = make_client(server.url, namespace)
    try:
        meta = client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), partition_id="p")
        first = client.get_meta(["x"], 3, "p", task_name="train")
        assert first.global_indexes == [0, 1, 2]

        server.kill()  # SIGKILL: no clean shutdown, the AOF is all that is left
        result: dict = {}

        def call_while_down():
            try:
                result["meta"] = client.get_meta(["x"], 3, "p", task_name="train")
            except Exception as exc:  # surfaced below
                result["error"] = exc

        thread = threading.Thread(target=call_while_down)
        thread.start()
        restarted = EmbeddedServer(port=server.port, data_dir=tmp_path, appendonly=True, appendfsync="always",
                                   binary=binary).start()
        thread.join(30)
        assert "error" not in result, result.get("error")
        assert result["meta"].global_indexes == [3, 4, 5], "consumption state was lost or replayed"
        assert torch.equal(client.get_data(result["meta"])["x"], torch.tensor([3, 4, 5]))
        assert client.put(TensorDict({"x": torch.arange(1)}, batch_size=[1]), partition_id="p").global_indexes == [8]
        assert client.get_partition_list() == ["p"]
        assert meta.size == 8
        restarted.stop(remove_data=False)
    finally:
        client.close()
        server.stop(remove_data=False)


@pytest.mark.parametrize("flavour", ["valkey", "redis7"])
def test_bytes_in_redis_stay_reachable_across_a_restart(tmp_path, namespace, flavour):
    """The ``redis`` store reconnects with backoff too: a read issued while the server is down waits."""
    binary = None
    if flavour == "redis7":
        binary = _redis7_binary()
        if binary is None:
            pytest.skip("redis-server not installed")
    server = EmbeddedServer(data_dir=tmp_path, appendonly=True, appendfsync="always", binary=binary).start()
    client = make_client(server.url, namespace)
    try:
        meta = client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), partition_id="p")
        assert torch.equal(client.get_data(meta)["x"], torch.arange(8))  # the store's connection is pooled
        server.kill()
        result: dict = {}

        def read_while_down():
            try:
                result["x"] = client.get_data(meta)["x"]
            except Exception as exc:  # surfaced below
                result["error"] = exc

        thread = threading.Thread(target=read_while_down)
        thread.start()
        restarted = EmbeddedServer(port=server.port, data_dir=tmp_path, appendonly=True, appendfsync="always",
                                   binary=binary).start()
        thread.join(30)
        assert "error" not in result, result.get("error")
        assert torch.equal(result["x"], torch.arange(8))
        restarted.stop(remove_data=False)
    finally:
        client.close()
        server.stop(remove_data=False)
