"""Invariant 5: metadata survives a Redis restart with AOF, and clients reconnect with backoff."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import aof_server, make_client
from tq_redis.server.embedded import EmbeddedServer


def _across_a_crash(server: EmbeddedServer, flavour: str, data_dir: Path, call: Callable[[], Any]) -> tuple[Any, Any]:
    """SIGKILL ``server``, run ``call`` while it is down, restart it from its AOF.

    Returns ``(what call returned, the restarted server)``; raises what ``call`` raised.
    """
    server.kill()  # no clean shutdown: the AOF is all that is left
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = call()
        except Exception as exc:  # surfaced below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    restarted = aof_server(flavour, data_dir, port=server.port)
    thread.join(30)
    if "error" in result:
        restarted.stop(remove_data=False)
        raise result["error"]
    assert "value" in result, "the call did not return within 30 s of the restart"
    return result["value"], restarted


@pytest.mark.parametrize("flavour", ["valkey", "redis7"])
def test_metadata_survives_crash_and_client_reconnects(tmp_path, namespace, flavour):
    server = aof_server(flavour, tmp_path)
    client = make_client(server.url, namespace)
    try:
        meta = client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), partition_id="p")
        first = client.get_meta(["x"], 3, "p", task_name="train")
        assert first.global_indexes == [0, 1, 2]

        again, restarted = _across_a_crash(
            server, flavour, tmp_path, lambda: client.get_meta(["x"], 3, "p", task_name="train")
        )
        assert again.global_indexes == [3, 4, 5], "consumption state was lost or replayed"
        assert torch.equal(client.get_data(again)["x"], torch.tensor([3, 4, 5]))
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
    server = aof_server(flavour, tmp_path)
    client = make_client(server.url, namespace)
    try:
        meta = client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), partition_id="p")
        assert torch.equal(client.get_data(meta)["x"], torch.arange(8))  # the store's connection is pooled
        data, restarted = _across_a_crash(server, flavour, tmp_path, lambda: client.get_data(meta))
        assert torch.equal(data["x"], torch.arange(8))
        restarted.stop(remove_data=False)
    finally:
        client.close()
        server.stop(remove_data=False)
