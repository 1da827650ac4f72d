"""The storage-node registry read below the client (``tq_redis.server.registry``): one library call,
the library reloaded where it went missing, and the typed errors a client driver would raise."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis

from tq_redis.errors import ConnectionFailed, LibraryNotLoaded
from tq_redis.meta.keys import storage_nodes_key
from tq_redis.server import policy
from tq_redis.server.registry import RegistryReader


def test_the_reader_reloads_a_flushed_library_and_raises_typed_errors(valkey):
    ns = f"reg{uuid.uuid4().hex[:6]}"
    admin = redis.Redis.from_url(valkey.url)
    admin.hset(storage_nodes_key(ns), "n1", json.dumps({"heartbeat": time.time()}))
    reader = RegistryReader(valkey.url, socket_timeout=5)
    try:
        registry = reader.read(ns)
        assert [node for node, _ in registry.entries] == ["n1"] and abs(registry.now - time.time()) < 5
        admin.execute_command("FUNCTION", "FLUSH")
        assert [node for node, _ in reader.read(ns).entries] == ["n1"]  # loaded again, the call retried
        admin.execute_command("FUNCTION", "FLUSH")
        policy.declare(valkey.url, load_library="never")
        try:
            with pytest.raises(LibraryNotLoaded, match="load-library"):
                RegistryReader(valkey.url).read(ns)  # checked before the first call
            with pytest.raises(LibraryNotLoaded, match="load-library"):
                reader.read(ns)  # the call finds no function; the check again may not load it
        finally:
            policy.declare(valkey.url, load_library=None)
        assert reader.read(ns).entries
    finally:
        reader.close()
        admin.delete(storage_nodes_key(ns))
        admin.close()


def test_an_unreachable_redis_is_connection_failed():
    reader = RegistryReader("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    with pytest.raises(ConnectionFailed, match="cannot reach Redis"):
        reader.read("ns")
