"""Shared fixtures: real servers (embedded Valkey, Debian Redis 7.0) and fakeredis over TCP.

``server`` is parametrized over all three flavours so every Lua path runs on each; tests that
need separate processes use ``real_server`` (Valkey and Redis 7.0 only). Each test gets its own
namespace, so tests share servers without seeing each other's keys.

Debian's ``redis-server`` is the oldest server we support. If it is not installed the Redis 7.0
cases are skipped with a reason, unless ``TQ_REQUIRE_REDIS7=1`` (set by CI), which fails them.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from dataclasses import dataclass

import pytest

from tq_redis.server.embedded import EmbeddedServer, free_port

pytest_plugins = ["tests.timing"]


@dataclass
class ServerInfo:
    flavour: str
    url: str
    handle: object


def _redis7_binary() -> str | None:
    return shutil.which("redis-server")


def server_binary(flavour: str) -> str | None:
    """The binary for a real-server flavour: None (embedded Valkey) or Debian's ``redis-server``.

    Without ``redis-server`` the test is skipped, or failed where ``TQ_REQUIRE_REDIS7=1`` (CI).
    """
    if flavour != "redis7":
        return None
    binary = _redis7_binary()
    if binary is None:
        if os.environ.get("TQ_REQUIRE_REDIS7") == "1":
            pytest.fail("redis-server (Debian Redis 7.0) is required here but not installed")
        pytest.skip("redis-server not installed (apt-get install redis-server); CI runs these cases")
    return binary


def aof_server(flavour: str, data_dir, port: int | None = None) -> EmbeddedServer:
    """A started server of ``flavour`` with its AOF fsynced on every write, in ``data_dir``.

    A restart with the same ``data_dir`` and ``port`` recovers everything acknowledged before.
    """
    return EmbeddedServer(
        port=port, data_dir=data_dir, appendonly=True, appendfsync="always", binary=server_binary(flavour)
    ).start()


def _start(flavour: str) -> ServerInfo:
    if flavour == "valkey":
        server = EmbeddedServer().start()
        return ServerInfo(flavour, server.url, server)
    if flavour == "redis7":
        server = EmbeddedServer(binary=server_binary(flavour)).start()
        return ServerInfo(flavour, server.url, server)
    if flavour == "fakeredis":
        from fakeredis import TcpFakeServer

        port = free_port()
        fake = TcpFakeServer(("127.0.0.1", port), server_type="redis")
        thread = threading.Thread(target=fake.serve_forever, daemon=True)
        thread.start()
        return ServerInfo(flavour, f"redis://127.0.0.1:{port}/0", fake)
    raise ValueError(flavour)


def _stop(info: ServerInfo) -> None:
    if info.flavour == "fakeredis":
        info.handle.shutdown()
        info.handle.server_close()
    else:
        info.handle.stop()


_servers: dict[str, ServerInfo] = {}


@pytest.fixture(scope="session", autouse=True)
def _stop_servers():
    yield
    for info in _servers.values():
        _stop(info)


def _server(flavour: str) -> ServerInfo:
    if flavour not in _servers:
        _servers[flavour] = _start(flavour)
    return _servers[flavour]


@pytest.fixture(params=["fakeredis", "valkey", "redis7"])
def server(request) -> ServerInfo:
    """One server of each flavour (module-shared), for tests of the Lua paths."""
    return _server(request.param)


@pytest.fixture(params=["valkey", "redis7"])
def real_server(request) -> ServerInfo:
    """A real server process (for multi-process and restart tests)."""
    return _server(request.param)


@pytest.fixture
def valkey() -> ServerInfo:
    return _server("valkey")


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def make_client(url: str, namespace: str, backend: str = "redis", *, inline_max_bytes: int = 0, **kwargs):
    """A client whose namespace stores data in ``backend`` (the ``redis`` store by default).

    Tests of the data plane compare what comes back with the dense tensors they put, so this
    client returns dense fields (``nested_output=False``) unless told otherwise; the default,
    the reference's nested layout, is covered by ``test_reference_defaults.py`` and ``tests/compat``.
    Values go to ``backend`` unless ``inline_max_bytes`` > 0 (the default of ``init``, 4 KiB,
    keeps small values in the metadata plane: ``test_inline.py``, and every test through ``init``).
    """
    import json

    from tq_redis import TransferQueueClient
    from tq_redis.meta.keys import config_key

    kwargs.setdefault("nested_output", False)
    client = TransferQueueClient(url, namespace, **kwargs)
    spec = {"backend": backend, "options": {}, "inline_max_bytes": inline_max_bytes}
    client.redis.hset(config_key(namespace), "storage", json.dumps(spec))
    return client


@pytest.fixture
def client(server, namespace):
    c = make_client(server.url, namespace)
    yield c
    c.close()


@pytest.fixture
def real_client(real_server, namespace):
    c = make_client(real_server.url, namespace)
    yield c
    c.close()
