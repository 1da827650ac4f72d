"""A Redis that lost its state is detected, never trusted (issue 43 item 2; tq_redis.server.identity).

Real servers of both flavours, restarted empty (SIGKILL, no persistence) or flushed under live
clients: each client refuses its next call with ``ServerStateLost`` instead of handing out ids
0, 1, ... again; a process attaching afterwards is refused while DRAM nodes still remember the
namespace; a restart with persistence, a drop followed by a new job, and a checkpoint loaded after
the loss keep working.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
import redis
import torch
from tensordict import TensorDict

from tests.conftest import aof_server, make_client, server_binary
from tq_redis import AsyncTransferQueueClient
from tq_redis.backends.dram.launcher import start_local_nodes
from tq_redis.client import liveness
from tq_redis.errors import ServerStateLost
from tq_redis.meta.keys import config_key, storage_nodes_key
from tq_redis.monitor import namespaces
from tq_redis.server.embedded import EmbeddedServer

FLAVOURS = ["valkey", "redis7"]


def _server(flavour: str, port: int | None = None) -> EmbeddedServer:
    """A server of ``flavour`` without persistence: a restart comes back empty."""
    return EmbeddedServer(port=port, binary=server_binary(flavour)).start()


def _rows(n: int, start: int = 0) -> TensorDict:
    return TensorDict({"x": torch.arange(start, start + n)}, batch_size=[n])


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for a state another process writes (a node's heartbeat); the timeout only decides failure."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _node_epochs(admin: redis.Redis, ns: str) -> set[str | None]:
    return {json.loads(raw).get("epoch") for raw in admin.hgetall(storage_nodes_key(ns)).values()}


def _namespace_keys(admin: redis.Redis, ns: str) -> list[bytes]:
    return sorted(admin.scan_iter(match=f"{ns}:*"))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_live_client_refuses_a_redis_restarted_empty(namespace, flavour):
    server = _server(flavour)
    client = make_client(server.url, namespace)
    aclient = AsyncTransferQueueClient(server.url, namespace)
    try:
        before = client.put(_rows(4), partition_id="p")
        assert before.global_indexes == [0, 1, 2, 3]
        claimed = client.get_meta(["x"], 2, "p", task_name="train")
        assert asyncio.run(aclient.async_get_partition_list()) == ["p"]
        epoch = redis.Redis.from_url(server.url).hget(config_key(namespace), "epoch")
        assert epoch is not None and len(epoch) == 16

        server.kill()
        server = _server(flavour, port=server.port)  # same address, nothing in it
        with pytest.raises(ServerStateLost, match="load_checkpoint") as lost:
            client.put(_rows(4), partition_id="p")
        assert "no epoch" in str(lost.value) and namespace in str(lost.value)
        for call in (
            lambda: client.get_meta(["x"], 2, "p", task_name="train"),  # every later call too
            lambda: client.get_data(claimed),  # metadata from before reads nothing new
            lambda: client.put(_rows(1), partition_id="q"),
            lambda: asyncio.run(aclient.async_put(_rows(4), partition_id="p")),
        ):
            with pytest.raises(ServerStateLost):
                call()
        # nothing was sent: no id handed out again, no config re-created with other settings
        assert _namespace_keys(redis.Redis.from_url(server.url), namespace) == []
    finally:
        client.close()
        aclient.close()
        server.stop()


_ATTACH = textwrap.dedent("""
    import sys
    import torch
    from tensordict import TensorDict
    from tq_redis import TransferQueueClient
    from tq_redis.errors import ServerStateLost
    client = TransferQueueClient(sys.argv[1], sys.argv[2])
    try:
        meta = client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id="p")
    except ServerStateLost as exc:
        print("ServerStateLost", exc)
    else:
        print("put", meta.global_indexes)
    client.close()
""")


def _attach_in_a_new_process(url: str, ns: str) -> str:
    done = subprocess.run([sys.executable, "-c", _ATTACH, url, ns], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_process_attaching_after_the_loss_is_refused_while_dram_nodes_remember(namespace, flavour):
    server = _server(flavour)
    admin = redis.Redis.from_url(server.url)
    nodes = start_local_nodes(server.url, namespace, n=2, capacity="64MiB")
    client = make_client(server.url, namespace, "dram")
    try:
        client.put(_rows(4), partition_id="p")
        epoch = admin.hget(config_key(namespace), "epoch").decode()
        _wait_until(lambda: _node_epochs(admin, namespace) == {epoch}, "both nodes to register the epoch")

        server.kill()
        server = _server(flavour, port=server.port)
        admin = redis.Redis.from_url(server.url)
        _wait_until(lambda: len(_node_epochs(admin, namespace)) == 1 and admin.hlen(storage_nodes_key(namespace)) == 2,
                    "the nodes to register again after the restart")
        assert _node_epochs(admin, namespace) == {epoch}  # they remember the namespace they serve
        out = _attach_in_a_new_process(server.url, namespace)
        assert out.startswith("ServerStateLost") and "still serve" in out, out
        with pytest.raises(ServerStateLost):  # and the client from before refuses too
            client.put(_rows(4), partition_id="p")
        assert not admin.exists(f"{namespace}:{{{namespace}/p}}:seq")  # no id was handed out again
        assert admin.hget(config_key(namespace), "epoch") is None  # nor the namespace founded afresh
    finally:
        client.close()
        nodes.stop()
        server.stop()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_restart_with_persistence_keeps_the_namespace(tmp_path, namespace, flavour):
    server = aof_server(flavour, tmp_path)
    nodes = start_local_nodes(server.url, namespace, n=1, capacity="64MiB")
    client = make_client(server.url, namespace, "dram")
    try:
        assert client.put(_rows(4), partition_id="p").global_indexes == [0, 1, 2, 3]
        admin = redis.Redis.from_url(server.url)
        epoch = admin.hget(config_key(namespace), "epoch").decode()
        _wait_until(lambda: _node_epochs(admin, namespace) == {epoch}, "the node to register the epoch")
        server.kill()
        server = aof_server(flavour, tmp_path, port=server.port)
        assert client.put(_rows(2, 4), partition_id="p").global_indexes == [4, 5]
        meta = client.get_meta(["x"], 6, "p", task_name="train")
        assert torch.equal(client.get_data(meta)["x"], torch.arange(6))
        assert _attach_in_a_new_process(server.url, namespace) == "put [6, 7, 8, 9]"
        assert redis.Redis.from_url(server.url).hget(config_key(namespace), "epoch").decode() == epoch
    finally:
        client.close()
        nodes.stop()
        server.stop()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_flush_while_the_client_is_idle_is_noticed_by_its_heartbeat(monkeypatch, namespace, flavour):
    monkeypatch.setattr(liveness, "BEAT_S", 0.1)
    server = _server(flavour)
    admin = redis.Redis.from_url(server.url)
    client = make_client(server.url, namespace)
    try:
        client.put(_rows(4), partition_id="p")
        admin.flushall()  # the connection stays up: only the heartbeat can see it
        assert client._identity.lost_event.wait(30), "the heartbeat did not notice the flush"
        with pytest.raises(ServerStateLost, match="liveness heartbeat"):
            client.put(_rows(4), partition_id="p")
        assert _namespace_keys(admin, namespace) == []  # the heartbeat wrote nothing back either
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_dropped_namespace_refuses_its_old_client_and_starts_afresh_for_a_new_one(monkeypatch, namespace,
                                                                                     flavour):
    monkeypatch.setattr(liveness, "BEAT_S", 0.1)
    server = _server(flavour)
    admin = redis.Redis.from_url(server.url)
    old = make_client(server.url, namespace)
    try:
        old.put(_rows(4), partition_id="p")
        epoch = admin.hget(config_key(namespace), "epoch")
        namespaces.drop(server.url, namespace, force=True)  # a live client: only by force
        assert old._identity.lost_event.wait(30), "the heartbeat did not notice the drop"
        with pytest.raises(ServerStateLost):
            old.put(_rows(1), partition_id="p")
        new = make_client(server.url, namespace)  # a new job of the same name: a new namespace
        try:
            assert new.put(_rows(2), partition_id="p").global_indexes == [0, 1]
            assert admin.hget(config_key(namespace), "epoch") not in (None, epoch)
            with pytest.raises(ServerStateLost):  # the old one stays refused
                old.get_meta(["x"], 2, "p", task_name="train")
        finally:
            new.close()
    finally:
        old.close()
        server.stop()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_loading_a_checkpoint_after_the_loss_takes_the_namespace_up_again(tmp_path, namespace, flavour):
    server = _server(flavour)
    client = make_client(server.url, namespace)
    try:
        client.put(_rows(4), partition_id="p")
        client.save_storage_checkpoint(str(tmp_path / "ckpt"))
        server.kill()
        server = _server(flavour, port=server.port)
        with pytest.raises(ServerStateLost):
            client.get_meta(["x"], 4, "p", task_name="train")
        make_client(server.url, namespace).close()  # the store's setting, as init() would record it
        client.load_storage_checkpoint(str(tmp_path / "ckpt"))
        meta = client.get_meta(["x"], 4, "p", task_name="train")
        assert torch.equal(client.get_data(meta)["x"], torch.arange(4))
        assert client.put(_rows(1), partition_id="p").global_indexes == [4]  # ids go on from the checkpoint
        assert redis.Redis.from_url(server.url).hget(config_key(namespace), "epoch") is not None
    finally:
        client.close()
        server.stop()


def test_on_a_cluster_a_namespace_that_lost_its_config_is_refused(monkeypatch, cluster, namespace):
    """``<ns>:config`` lives in one slot; the heartbeat reads it there (the cluster is shared by the
    session, so the loss is the namespace's own keys deleted, not a flush of every node)."""
    monkeypatch.setattr(liveness, "BEAT_S", 0.1)
    client = make_client(cluster.url, namespace)
    try:
        assert client.put(_rows(4), partition_id="p").global_indexes == [0, 1, 2, 3]
        assert client.redis.hget(config_key(namespace), "epoch") is not None
        client.redis.delete(config_key(namespace), f"{namespace}:{{{namespace}/p}}:seq")
        assert client._identity.lost_event.wait(30), "the heartbeat did not notice"
        with pytest.raises(ServerStateLost):
            client.put(_rows(4), partition_id="p")
        assert not client.redis.exists(f"{namespace}:{{{namespace}/p}}:seq")  # no id handed out again
    finally:
        client.close()
