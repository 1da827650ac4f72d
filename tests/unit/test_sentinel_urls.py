"""Sentinel URLs and the config block, and the durable-mode setting, without a server."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.sentinel import SentinelConnectionPool

from tq_redis.api import config
from tq_redis.errors import ConfigError
from tq_redis.server import connections, durability, sentinel


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in (connections.CLUSTER_ENV, durability.ENV, durability.TIMEOUT_ENV, "TQ_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    connections.forget()
    yield
    connections.forget()


@pytest.mark.parametrize(
    "url, hosts, service, db, user, password, sentinel_password",
    [
        ("redis+sentinel://127.0.0.1:26379/mymaster", [("127.0.0.1", 26379)], "mymaster", 0, None, None, None),
        ("redis+sentinel://a,b:26380,[::1]:5/svc/3", [("a", 26379), ("b", 26380), ("::1", 5)], "svc", 3,
         None, None, None),
        ("redis+sentinel://:p%40ss@h:1/m", [("h", 1)], "m", 0, None, "p@ss", None),
        ("redis+sentinel://alice:pw@h:1/m?sentinel_password=s%26", [("h", 1)], "m", 0, "alice", "pw", "s&"),
    ],
)
def test_sentinel_urls_are_read_and_written_back_alike(url, hosts, service, db, user, password, sentinel_password):
    target = sentinel.parse_url(url)
    assert list(target.hosts) == hosts and target.service == service and target.db == db
    assert (target.username, target.password, target.sentinel_password) == (user, password, sentinel_password)
    assert sentinel.parse_url(sentinel.build_url(target)) == target
    assert connections.check_url(url) == url


@pytest.mark.parametrize(
    "url, match",
    [
        ("redis+sentinel:///mymaster", "no Sentinel host"),
        ("redis+sentinel://h:1", "path must be /service"),
        ("redis+sentinel://h:1/m/0/extra", "path must be /service"),
        ("redis+sentinel://h:1/m/x", "database 'x' is not a number"),
        ("redis+sentinel://h:99999/m", "out of range"),
        ("redis+sentinel://h:port/m", "not host or host:port"),
        ("redis+sentinel://h:1/m?socket_timeout=1", "unknown parameter"),
    ],
)
def test_a_malformed_sentinel_url_says_what_to_write(url, match):
    with pytest.raises(ConfigError, match=match) as info:
        connections.check_url(url)
    assert "redis+sentinel://[user:password@]host:port" in str(info.value)


def test_passwords_stay_out_of_error_messages():
    with pytest.raises(ConfigError) as info:
        sentinel.parse_url("redis+sentinel://u:secret@h:1/m?sentinel_password=hidden&x=1")
    assert "secret" not in str(info.value) and "hidden" not in str(info.value)


def test_an_unknown_scheme_mentions_the_sentinel_form():
    with pytest.raises(ConfigError, match="redis\\+sentinel://"):
        connections.check_url("sentinel://h:1/m")


def test_sync_client_asks_the_sentinels_for_the_primary_with_our_options():
    url = "redis+sentinel://u:pw@127.0.0.1:1,127.0.0.1:2/svc/2?sentinel_password=sp"
    client = connections.sync_client(url, socket_timeout=3)
    pool = client.connection_pool
    assert isinstance(client, connections.SingleClient) and isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "svc" and pool.is_master
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["username"], kwargs["password"], kwargs["socket_timeout"]) == (2, "u", "pw", 3)
    assert client.get_retry().get_retries() == 12  # reconnects with backoff while a failover runs
    sentinels = client.tq_sentinel.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
    assert sentinels[0].connection_pool.connection_kwargs["password"] == "sp"
    assert url not in connections._detected  # never probed for cluster mode
    client.close()
    assert connections.sync_client(url, reconnect=False).get_retry().get_retries() == 0


def test_async_clients_behind_sentinel_with_bounded_pools():
    url = "redis+sentinel://127.0.0.1:1/svc"

    async def build() -> list:
        plain = connections.async_client(url)
        bounded = connections.async_client(url, max_connections=3, wait_for_connection=True)
        failing = connections.async_client(url, max_connections=3)
        single = connections.async_client(url, single_connection_client=True)  # connects on first use
        assert single.single_connection_client
        await single.aclose()
        pools = [plain.connection_pool, bounded.connection_pool, failing.connection_pool]
        for c in (plain, bounded, failing):
            await c.aclose()
        return pools

    plain, bounded, failing = asyncio.run(build())
    assert all(isinstance(p, AsyncSentinelPool) for p in (plain, bounded, failing))
    assert isinstance(bounded, BlockingConnectionPool) and bounded.max_connections == 3
    assert not isinstance(failing, BlockingConnectionPool) and failing.max_connections == 3


def test_sentinel_is_never_a_cluster():
    url = "redis+sentinel://127.0.0.1:1/svc"
    assert connections.cluster_mode(url) is False
    with pytest.raises(ConfigError, match="Sentinel, which serves a single primary"):
        connections.sync_client(url, cluster=True)


def test_the_config_block_becomes_the_canonical_url():
    cfg = config.load({"redis": {"sentinel": {"hosts": ["10.0.0.1:26379", "10.0.0.2"], "service": "mymaster",
                                              "password": "p w", "db": 1}}})
    assert cfg["redis"]["url"] == "redis+sentinel://:p%20w@10.0.0.1:26379,10.0.0.2:26379/mymaster/1"
    assert sentinel.url_from_block({"hosts": "a:1,b:2", "service": "m"}) == "redis+sentinel://a:1,b:2/m"
    assert sentinel.url_from_block({"hosts": [["a", 1]], "service": "m"}) == "redis+sentinel://a:1/m"


def test_the_config_block_wins_over_the_environment_url(monkeypatch):
    monkeypatch.setenv("TQ_REDIS_URL", "redis://h:1/0")
    cfg = config.load({"redis": {"sentinel": {"hosts": ["s:26379"], "service": "m"}}})
    assert cfg["redis"]["url"] == "redis+sentinel://s:26379/m"


@pytest.mark.parametrize(
    "redis_section, match",
    [
        ({"url": "redis://h:1", "sentinel": {"hosts": ["s:1"], "service": "m"}}, "either redis.url or redis.sentinel"),
        ({"sentinel": {"hosts": [], "service": "m"}}, "must list the Sentinels"),
        ({"sentinel": {"hosts": ["s:1"]}}, "must name the monitored primary"),
        ({"sentinel": {"hosts": ["s:1"], "service": "m", "pasword": "x"}}, "unknown key"),
        ({"sentinel": "s:1"}, "must be a mapping"),
        ({"durable": "fsync"}, "none, replicas\\[:N\\]"),
        ({"durable": "replicas:0"}, "waits for nothing"),
        ({"durable": "replicas:-1"}, ">= 0"),
        ({"durable": "aof", "durable_timeout_ms": 0}, "must be positive"),
    ],
)
def test_bad_high_availability_settings_are_refused(redis_section, match):
    with pytest.raises(ConfigError, match=match):
        config.load({"redis": redis_section})


@pytest.mark.parametrize(
    "value, mode, replicas, command",
    [
        (None, "none", 0, None),
        ("none", "none", 0, None),
        ("replicas", "replicas", 1, ("WAIT", 1, 1000)),
        ("Replicas:2", "replicas", 2, ("WAIT", 2, 1000)),
        ("aof", "aof", 0, ("WAITAOF", 1, 0, 1000)),
        ("aof:1", "aof", 1, ("WAITAOF", 1, 1, 1000)),
        ({"mode": "replicas", "replicas": 3, "timeout_ms": 50}, "replicas", 3, ("WAIT", 3, 50)),
    ],
)
def test_durable_settings(value, mode, replicas, command):
    setting = durability.parse(value)
    assert (setting.mode, setting.replicas) == (mode, replicas)
    if command is None:
        assert not setting.enabled and not setting.waits_after("insert")
    else:
        assert setting.command() == command
        assert setting.waits_after("claim") and not setting.waits_after("check_visible")


def test_durable_mode_from_config_then_environment(monkeypatch):
    assert config.load()["redis"]["durable"] == "none"
    monkeypatch.setenv(durability.ENV, "replicas:2")
    monkeypatch.setenv(durability.TIMEOUT_ENV, "250")
    cfg = config.load()
    assert (cfg["redis"]["durable"], cfg["redis"]["durable_timeout_ms"]) == ("replicas:2", 250)
    cfg = config.load({"redis": {"durable": "aof"}})  # the config wins, the timeout stays the environment's
    assert (cfg["redis"]["durable"], cfg["redis"]["durable_timeout_ms"]) == ("aof:0", 250)


def test_clients_take_what_init_declared_for_their_url_else_the_environment(monkeypatch):
    url = "redis://127.0.0.1:1/0"
    assert not durability.for_url(url).enabled
    monkeypatch.setenv(durability.ENV, "aof")
    assert durability.for_url(url).mode == "aof"
    durability.declare(url, "replicas:1", 70)
    try:
        assert durability.for_url(url) == durability.Durability("replicas", 1, 70)
    finally:
        durability.declare(url, None)
    assert durability.for_url(url).mode == "aof"


def test_a_wait_reply_short_of_the_target_names_what_is_missing():
    replicas = durability.parse("replicas:2")
    assert replicas.shortfall(2) is None and replicas.shortfall(3) is None
    assert replicas.shortfall(1) == "1 of 2 replica(s) acknowledged it"
    aof = durability.parse("aof:1")
    assert aof.shortfall([1, 1]) is None
    assert "did not fsync" in aof.shortfall([0, 1]) and "0 of 1 replica" in aof.shortfall([1, 0])
    err = replicas.not_durable("redis://h:1/0", "1 of 2 replica(s) acknowledged it", result=["meta"])
    assert isinstance(err, durability.NotDurable) and err.result == ["meta"] and "NOT durable" in str(err)


def test_durable_mode_is_refused_on_a_cluster_client():
    from tq_redis.client.driver import AsyncDriver

    with pytest.raises(durability.DurabilityUnsupported, match="not supported on a Redis Cluster"):
        AsyncDriver("redis://127.0.0.1:1", cluster=True, durable="replicas")


def test_the_newest_sentinel_configuration_wins():
    from redis.sentinel import MasterNotFoundError

    stale = {"ip": "10.0.0.1", "port": 6379, "config-epoch": 3}
    fresh = {"ip": "10.0.0.2", "port": 6380, "config-epoch": 4}
    assert sentinel._newest("m", [stale, fresh], []) == ("10.0.0.2", 6380)
    with pytest.raises(MasterNotFoundError, match="No master found for 'm': 26379: refused"):
        sentinel._newest("m", [], ["26379: refused"])


def test_redact_hides_the_primarys_and_the_sentinels_passwords():
    from tq_redis.server.policy import redact

    url = "redis+sentinel://u:pw@s1:26379,s2/mymaster?sentinel_password=sec&sentinel_username=adm"
    shown = redact(url)
    assert "pw" not in shown and "sec" not in shown
    assert shown == "redis+sentinel://u:***@s1:26379,s2/mymaster?sentinel_password=***&sentinel_username=adm"
