"""A shared Redis is safe: eviction policy, maxmemory, the function library as an admin step, ACL users.

Every test here changes a server's settings (maxmemory, its policy, ACL users, the loaded library),
so each starts its own server of each real flavour (Valkey, Debian Redis 7.0) instead of sharing
the suite's.
"""

from __future__ import annotations

import asyncio
import time
import warnings

import pytest
import redis
import torch
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client, server_binary
from tq_redis.cli import main as cli
from tq_redis.errors import (
    EvictionPolicyError,
    LibraryNotLoaded,
    PermissionDenied,
    RedisOutOfMemory,
    StorageFull,
)
from tq_redis.server import acl
from tq_redis.server import library as scripts
from tq_redis.server import policy as server_policy
from tq_redis.server.embedded import EmbeddedServer
from tq_redis.server.policy import EvictionWarning


@pytest.fixture(params=["valkey", "redis7"])
def own_server(request):
    """A server of each real flavour for this test alone."""
    server = EmbeddedServer(binary=server_binary(request.param)).start()
    admin = redis.Redis.from_url(server.url)
    yield server, admin
    admin.close()
    server_policy.forget(server.url)
    server.stop()


def _td(n: int, width: int = 4, value: float = 1.0) -> TensorDict:
    return TensorDict({"x": torch.full((n, width), value)}, batch_size=[n])


def _used(admin: redis.Redis) -> int:
    return int(admin.info("memory")["used_memory"])


# ---------------------------------------------------------------------------------------------
# Eviction policy (issue 14 item 4)
# ---------------------------------------------------------------------------------------------


def test_an_evicting_policy_is_refused_at_init_and_at_attach(own_server, monkeypatch):
    server, admin = own_server
    admin.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(EvictionPolicyError, match="allkeys-lru.*noeviction.*on_eviction: warn"):
        tq.init({"redis": {"url": server.url}, "namespace": "ev"})
    assert admin.hgetall("ev:config") == {}  # refused before anything was written

    client = make_client(server.url, "ev2")  # attach: the first call refuses
    with pytest.raises(EvictionPolicyError, match="allkeys-lru"):
        client.put(_td(2), partition_id="p")
    assert admin.exists("ev2:{ev2/p}:meta") == 0
    client.close()

    monkeypatch.setenv(server_policy.ON_EVICTION_ENV, "warn")
    warned = make_client(server.url, "ev3")
    with pytest.warns(EvictionWarning, match="allkeys-lru"):
        meta = warned.put(_td(2), partition_id="p")
    assert meta.global_indexes == [0, 1]
    warned.close()


def test_init_may_accept_an_evicting_policy_with_a_warning(own_server):
    server, admin = own_server
    admin.config_set("maxmemory-policy", "allkeys-lfu")
    with pytest.warns(EvictionWarning, match="allkeys-lfu"):
        cfg = tq.init({"redis": {"url": server.url, "on_eviction": "warn"}, "namespace": "evw",
                       "storage": {"backend": "redis"}})
    try:
        assert cfg["redis"]["on_eviction"] == "warn"
        tq.get_client().put(_td(2), partition_id="p")
    finally:
        tq.close()


def test_volatile_policies_warn_and_noeviction_is_silent(own_server):
    server, admin = own_server
    admin.config_set("maxmemory-policy", "volatile-lru")
    client = make_client(server.url, "vol")
    with pytest.warns(EvictionWarning, match="volatile-lru.*no TTL"):
        client.put(_td(2), partition_id="p")
    client.close()
    server_policy.forget(server.url)
    admin.config_set("maxmemory-policy", "noeviction")
    quiet = make_client(server.url, "vol2")
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvictionWarning)
        quiet.put(_td(2), partition_id="p")
    quiet.close()


# ---------------------------------------------------------------------------------------------
# maxmemory with noeviction (issue 14 item 7)
# ---------------------------------------------------------------------------------------------


def _fill_then_cap(client, admin: redis.Redis, partition: str = "p") -> list:
    """Put ~4 MiB into Redis, then set maxmemory below what is used: Redis is over its limit."""
    metas = [client.put(_td(64, 4096, float(i)), partition_id=partition) for i in range(4)]
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", _used(admin) - 1_000_000)
    return metas


def _wait_below(admin: redis.Redis, limit: int) -> int:
    """Wait until used memory is below ``limit`` (a server may free deleted values in the background)."""
    deadline = time.monotonic() + 10
    while (used := _used(admin)) >= limit:
        assert time.monotonic() < deadline, f"used memory stayed at {used} (limit {limit})"
        time.sleep(0.02)  # polling another process's memory counter
    return used


def test_at_maxmemory_puts_fail_typed_and_clearing_samples_frees_memory(own_server):
    server, admin = own_server
    client = make_client(server.url, "oom")
    metas = _fill_then_cap(client, admin)
    before = _used(admin)
    with pytest.raises(RedisOutOfMemory, match="is full.*clear_partition") as info:
        client.put(_td(2), partition_id="p")
    assert isinstance(info.value, StorageFull)
    with pytest.raises(RedisOutOfMemory):
        client.kv_put("k", "kvp", {"x": torch.ones(1, 4)})

    client.clear_samples(metas[0])
    client.clear_samples(metas[1])
    _wait_below(admin, before - 1_000_000)
    after = client.put(_td(2), partition_id="p")  # memory is free again: puts work
    assert after.global_indexes[0] >= 256  # ids are never reused
    assert torch.equal(client.get_data(metas[2])["x"], torch.full((64, 4096), 2.0))
    client.close()


def test_at_maxmemory_kv_clear_frees_memory(own_server):
    server, admin = own_server
    client = make_client(server.url, "oomkv")
    keys = [f"k{i}" for i in range(64)]
    for part in range(4):
        client.kv_batch_put([f"{k}-{part}" for k in keys], "kvp", _td(64, 4096))
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", _used(admin) - 1_000_000)
    before = _used(admin)
    with pytest.raises(RedisOutOfMemory):
        client.kv_put("new", "kvp", {"x": torch.ones(1, 4)})
    client.kv_clear([f"{k}-0" for k in keys] + [f"{k}-1" for k in keys], "kvp")
    _wait_below(admin, before - 1_000_000)
    client.kv_put("new", "kvp", {"x": torch.ones(1, 4)})
    client.close()


def test_at_maxmemory_clear_partition_frees_memory(own_server):
    server, admin = own_server
    client = make_client(server.url, "oomp")
    _fill_then_cap(client, admin)
    before = _used(admin)
    with pytest.raises(RedisOutOfMemory):
        client.put(_td(2), partition_id="p")
    client.clear_partition("p")
    _wait_below(admin, before - 2_000_000)
    assert admin.sismember("oomp:partitions:kept", "p")  # its seq stays findable by checkpoints
    assert client.put(_td(2), partition_id="p").global_indexes[0] >= 256
    client.close()


# ---------------------------------------------------------------------------------------------
# The function library: exact code, and an admin step (issue 14 item 5)
# ---------------------------------------------------------------------------------------------


def _foreign_library() -> str:
    """Our library with one change, its tq_version still answering our version: what a user allowed
    to FUNCTION LOAD could install under our name (here: every get_meta deletes the partition)."""
    source, _ = scripts.library()
    tampered = source.replace("local function claim(KEYS, ARGV)\n",
                              "local function claim(KEYS, ARGV)\n  redis.call('DEL', KEYS[1])\n", 1)
    assert tampered != source
    return tampered


def test_a_library_with_our_version_but_other_code_is_replaced(own_server):
    server, admin = own_server
    owner = make_client(server.url, "libb")
    owner.put(_td(4), partition_id="p")
    admin.execute_command("FUNCTION", "LOAD", "REPLACE", _foreign_library())
    assert admin.execute_command("FCALL", "tq_version", 0).decode() == scripts.library()[1]  # it lies

    fresh = make_client(server.url, "libb")  # a client's first use checks the code, not the version
    meta = fresh.get_meta(["x"], 2, "p", task_name="t")
    assert meta.size == 2 and admin.exists("libb:{libb/p}:meta") == 1
    assert scripts.library_state(admin.execute_command(*scripts.list_command())) == "current"
    owner.close()
    fresh.close()


def test_with_load_library_never_a_foreign_or_missing_library_is_an_error(own_server, monkeypatch):
    server, admin = own_server
    monkeypatch.setenv(server_policy.LOAD_LIBRARY_ENV, "never")
    client = make_client(server.url, "libn")
    with pytest.raises(LibraryNotLoaded, match="is not loaded.*tq-redis load-library"):
        client.put(_td(2), partition_id="p")
    admin.execute_command("FUNCTION", "LOAD", "REPLACE", _foreign_library())
    again = make_client(server.url, "libn")
    with pytest.raises(LibraryNotLoaded, match="different code.*tq-redis load-library"):
        again.put(_td(2), partition_id="p")
    assert scripts.library_state(admin.execute_command(*scripts.list_command())) == "foreign"  # left alone

    assert cli.main(["load-library", "--redis", server.url]) == 0
    loaded = make_client(server.url, "libn")
    assert loaded.put(_td(2), partition_id="p").global_indexes == [0, 1]
    for c in (client, again, loaded):
        c.close()


# ---------------------------------------------------------------------------------------------
# ACL users per namespace (issue 14 item 5, deliverable 3)
# ---------------------------------------------------------------------------------------------


def _user_url(server: EmbeddedServer, user: str, password: str) -> str:
    return f"redis://{user}:{password}@{server.host}:{server.port}/0"


def _ns_user(server: EmbeddedServer, namespace: str, role: str = "client") -> str:
    user, password = acl.default_user(namespace, role), f"pw-{namespace}-{role}"
    args = ["acl", namespace, "--role", role, "--user", user, "--password", password, "--apply", "--redis", server.url]
    assert cli.main(args) == 0
    return _user_url(server, user, password)


def test_namespace_users_work_in_their_namespace_and_are_refused_elsewhere(own_server, monkeypatch):
    server, admin = own_server
    monkeypatch.setenv(server_policy.LOAD_LIBRARY_ENV, "never")  # clients of a shared Redis
    url_a, url_b = _ns_user(server, "nsa"), _ns_user(server, "nsb")
    with pytest.raises(redis.exceptions.NoPermissionError):  # a namespace user cannot replace the library
        redis.Redis.from_url(url_a).execute_command(*scripts.load_command())

    early = make_client(url_a, "nsa")
    with pytest.raises(LibraryNotLoaded, match="tq-redis load-library"):
        early.put(_td(2), partition_id="p")
    early.close()
    assert cli.main(["load-library", "--redis", server.url]) == 0  # the admin step

    a = make_client(url_a, "nsa")
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvictionWarning)  # the policy is read through INFO
        meta = a.put(_td(6), partition_id="p")
    a.put(TensorDict({"y": torch.ones(6, 2)}, batch_size=[6]), metadata=meta)
    got = a.get_meta(["x", "y"], 4, "p", task_name="actor")
    assert torch.equal(a.get_data(got)["x"], torch.ones(4, 4))
    leased = a.get_meta(["x"], 2, "p", task_name="critic", lease_s=30)
    assert a.ack(leased) is None
    a.set_custom_meta(got)
    a.clear_samples(got[0:2])
    assert a.get_partition_list() == ["p"]
    a.kv_put("key", "kvp", {"x": torch.ones(4)}, tag={"v": 1})
    assert list(a.kv_list("kvp")["kvp"]) == ["key"]
    assert torch.equal(a.kv_batch_get(["key"], "kvp")["x"], torch.ones(1, 4))
    a.kv_clear(["key"], "kvp")
    a.clear_partition("p")
    assert a.get_partition_list() == ["kvp"] or a.get_partition_list() == []

    chan = tq.Channel.create("q", redis_url=url_a, namespace="nsa")
    chan.put(torch.arange(3), weight=2)
    chan.put("text")
    assert torch.equal(chan.get(), torch.arange(3)) and chan.get() == "text"
    chan.delete()

    b = make_client(url_b, "nsb")
    b.put(_td(2), partition_id="p")
    intruder = tq.TransferQueueClient(url_a, "nsb")  # user A naming namespace B
    for call in (lambda: intruder.put(_td(2), partition_id="p"),
                 lambda: intruder.get_meta(["x"], 1, "p", task_name="t"),
                 lambda: intruder.get_partition_list(),
                 lambda: intruder.clear_partition("p")):
        with pytest.raises(PermissionDenied, match="tq-redis acl") as info:
            call()
        assert "pw-" not in str(info.value)  # the password never reaches a message
    assert admin.exists("nsb:{nsb/p}:meta") == 1 and b.get_partition_list() == ["p"]

    async def async_intruder():
        client = tq.AsyncTransferQueueClient(url_a, "nsb")
        try:
            await client.async_get_partition_list()
        finally:
            await client.async_close()

    with pytest.raises(PermissionDenied):
        asyncio.run(async_intruder())
    for c in (a, b, intruder):
        c.close()


def test_wrong_credentials_are_a_typed_error_at_the_first_refusal(own_server):
    server, admin = own_server
    _ns_user(server, "nsc")
    admin.acl_log_reset()
    client = tq.TransferQueueClient(_user_url(server, "tq-nsc", "wrong"), "nsc")
    with pytest.raises(PermissionDenied, match="refused the credentials") as info:
        client.get_partition_list()
    assert "wrong" not in str(info.value)
    client.close()
    # No reconnect can fix a refused password: one try per connection (the attach check's and the
    # client's), not the reconnect backoff's 13 each.
    refusals = [e for e in admin.acl_log() if e["reason"] == "auth"]
    assert 1 <= sum(int(e["count"]) for e in refusals) <= 2


def test_storage_nodes_register_with_their_own_user(own_server, monkeypatch):
    from tq_redis.backends.dram.launcher import start_local_nodes

    server, admin = own_server
    monkeypatch.setenv(server_policy.LOAD_LIBRARY_ENV, "never")
    assert cli.main(["load-library", "--redis", server.url]) == 0
    url_client, url_node = _ns_user(server, "nsd"), _ns_user(server, "nsd", "storage-node")
    with pytest.raises(redis.exceptions.NoPermissionError):  # a node's user reaches nothing else
        redis.Redis.from_url(url_node).get("nsd:config")
    with start_local_nodes(url_node, "nsd", n=1, capacity="64MiB", shm=False) as nodes:
        assert len(admin.hgetall("nsd:storage:nodes")) == 1
        client = make_client(url_client, "nsd", backend="dram")
        meta = client.put(_td(8, 16, 3.0), partition_id="p")
        assert torch.equal(client.get_data(meta)["x"], torch.full((8, 16), 3.0))
        client.clear_partition("p")
        client.close()
        assert nodes is not None
