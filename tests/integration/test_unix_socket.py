"""A ``unix:///path.sock`` URL reaches a local server the way ``redis://`` does, sync and asyncio.

Real servers only (Valkey 9 and Debian's Redis 7.0), each also listening on a socket file. A client
that passed a TCP-only option to redis-py's socket connection (it once passed ``socket_keepalive``
and failed at its first command) fails here.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client, server_binary
from tq_redis import AsyncTransferQueueClient, TransferQueueClient, errors
from tq_redis.server.embedded import EmbeddedServer


@pytest.fixture(params=["valkey", "redis7"])
def socket_url(request) -> Iterator[str]:
    # a short directory of its own: a socket path must fit in 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="tq-sock-"))
    server = EmbeddedServer(binary=server_binary(request.param), data_dir=folder, unix_socket=folder / "redis.sock")
    try:
        server.start()
        yield server.socket_url
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_sync_client_puts_waits_claims_and_reads_over_a_socket(socket_url, namespace):
    client = make_client(socket_url, namespace)  # values in the redis store, dense fields
    try:
        assert "U" in client.redis.client_info()["flags"]  # the server sees a unix-socket client
        client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id="p")
        meta = client.get_meta(["x"], 4, "p", task_name="t")
        assert client.get_data(meta)["x"].tolist() == [0, 1, 2, 3]
        # nothing left: a waiting claim (BLPOP and the claim on the lane) times out empty
        assert client.get_meta(["x"], 1, "p", task_name="t", timeout=0.2).size == 0
        meta, data = client.get_meta_and_data(["x"], 2, "p", task_name="u")
        assert data["x"].tolist() == [0, 1]
        client.clear_partition("p")
        assert client.get_partition_list() == []
    finally:
        client.close()


def test_async_client_round_trips_over_a_socket(socket_url, namespace):
    make_client(socket_url, namespace).close()  # records the redis store for the namespace

    async def main():
        aclient = AsyncTransferQueueClient(socket_url, namespace, nested_output=False)
        try:
            waiting = asyncio.create_task(aclient.async_get_meta(["x"], 3, "q", task_name="t", timeout=10))
            await asyncio.sleep(0)
            await aclient.async_put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id="q")
            meta = await asyncio.wait_for(waiting, 10)
            data = await aclient.async_get_data(meta)
            assert data["x"].tolist() == [0, 1, 2]
        finally:
            await aclient.async_close()

    asyncio.run(main())


def test_init_attaches_to_a_socket_url(socket_url, monkeypatch):
    monkeypatch.delenv("TQ_REDIS_URL", raising=False)
    conf = tq.init({"redis": {"url": socket_url}, "storage": {"backend": "redis"}, "namespace": "sock"})
    try:
        assert conf["redis"]["url"] == socket_url
        client = tq.get_client()
        client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
        meta = client.get_meta(["x"], 2, "p", task_name="t")
        assert client.get_data(meta)["x"].reshape(-1).tolist() == [0, 1]
        client.clear_partition("p")
    finally:
        tq.close()


def test_a_missing_socket_is_a_connection_error_that_names_it(tmp_path, namespace):
    url = f"unix://{tmp_path}/absent.sock"
    with pytest.raises(errors.ConnectionFailed, match="absent.sock"):
        client = TransferQueueClient(url, namespace)
        try:
            client.get_partition_list()
        finally:
            client.close()


def test_a_socket_path_too_long_for_linux_falls_back_or_is_refused(tmp_path):
    deep = tmp_path / ("d" * 120)
    server = EmbeddedServer(data_dir=deep, unix_socket=True)  # init()'s choice: TCP only, no error
    assert server.socket_url is None and server.url.startswith("redis://127.0.0.1:")
    with pytest.raises(errors.ConfigError, match="longer than the 107 bytes"):
        EmbeddedServer(data_dir=tmp_path, unix_socket=deep / "redis.sock")
    short = EmbeddedServer(data_dir=tmp_path, unix_socket=True)
    expected = tmp_path / "valkey.sock"
    assert short.socket_url == (f"unix://{expected}" if len(str(expected)) <= 107 else None)
