"""The connection factory without a server: URLs, the cluster switch and its order of rules, key routing."""

from __future__ import annotations

import asyncio

import pytest
import redis

from tq_redis.errors import ConfigError
from tq_redis.server import connections
from tq_redis.server.embedded import free_port


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(connections.CLUSTER_ENV, raising=False)
    connections.forget()
    yield
    connections.forget()


def _down_url() -> str:
    return f"redis://127.0.0.1:{free_port()}"


@pytest.mark.parametrize(
    "url, match",
    [
        ("http://127.0.0.1:6379", "scheme 'http'.*redis://host:port"),
        ("127.0.0.1:6379", "redis://host:port"),
        ("", "non-empty string"),
        (None, "non-empty string"),
        ("redis://127.0.0.1:notaport", "cannot read Redis URL"),
    ],
)
def test_a_url_redis_cannot_use_is_refused_with_the_fix(url, match):
    with pytest.raises(ConfigError, match=match):
        connections.check_url(url)
    with pytest.raises(ConfigError, match=match):
        connections.sync_client(url)
    with pytest.raises(ConfigError, match=match):
        connections.async_client(url)


@pytest.mark.parametrize("url", ["redis://h:1", "rediss://u:p@h:1/0", "unix:///tmp/x.sock"])
def test_good_urls_pass(url):
    assert connections.check_url(url) == url


@pytest.mark.parametrize(
    "value, expected",
    [(True, True), (False, False), (None, None), ("1", True), ("TRUE", True), ("yes", True), ("on", True),
     ("0", False), ("false", False), ("No", False), ("off", False), ("", None), ("auto", None), (1, True)],
)
def test_cluster_flag_values(value, expected):
    assert connections.parse_cluster_flag(value) is expected


def test_a_cluster_flag_that_is_not_a_boolean_names_the_setting():
    with pytest.raises(ConfigError, match="TQ_REDIS_CLUSTER='maybe'.*true or false"):
        connections.parse_cluster_flag("maybe", "TQ_REDIS_CLUSTER")


def test_order_of_rules_argument_then_init_then_environment_then_detection(monkeypatch):
    url = _down_url()
    assert connections.cluster_mode(url) is False  # nobody answers: a single server, asked again later
    assert url not in connections._detected
    monkeypatch.setenv(connections.CLUSTER_ENV, "1")
    assert connections.cluster_mode(url) is True
    connections.declare_cluster(url, False)
    assert connections.cluster_mode(url) is False
    assert connections.cluster_mode(url, cluster=True) is True
    connections.declare_cluster(url, None)  # init closed: back to the environment
    assert connections.cluster_mode(url) is True
    monkeypatch.setenv(connections.CLUSTER_ENV, "bogus")
    with pytest.raises(ConfigError, match="TQ_REDIS_CLUSTER"):
        connections.cluster_mode(url)


def test_an_unreachable_server_gives_a_lazy_single_server_client():
    url = _down_url()
    client = connections.sync_client(url, reconnect=False)
    assert isinstance(client, connections.SingleClient) and not connections.is_cluster_client(client)
    with pytest.raises(redis.ConnectionError):
        client.ping()  # fails on use, as before the factory existed
    client.close()


@pytest.mark.parametrize(
    "url, match", [("unix:///tmp/x.sock", "unix socket"), ("redis://127.0.0.1:1/2", "only database 0")]
)
def test_cluster_urls_that_cannot_work_are_refused(url, match):
    with pytest.raises(ConfigError, match=match):
        connections.sync_client(url, cluster=True)
    with pytest.raises(ConfigError, match=match):
        connections.async_client(url, cluster=True)


def test_forced_cluster_with_every_node_down_is_a_connection_failure():
    from tq_redis.errors import ConnectionFailed

    url = _down_url()
    with pytest.raises(ConnectionFailed, match="cannot reach the Redis Cluster"):
        connections.sync_client(url, cluster=True)


def test_async_cluster_client_is_built_without_connecting():
    client = connections.async_client(_down_url(), cluster=True, max_connections=4, socket_timeout=1)
    assert isinstance(client, connections.AsyncClusterClient)
    asyncio.run(client.aclose())


def test_options_override_the_defaults_and_bounded_pools():
    url = _down_url()
    client = connections.sync_client(url, socket_timeout=3)
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 3 and kwargs["health_check_interval"] == 30
    assert client.get_retry().get_retries() == 12
    assert connections.sync_client(url, reconnect=False).get_retry().get_retries() == 0
    bounded = connections.async_client(url, max_connections=3, wait_for_connection=True)
    pool = bounded.connection_pool
    assert pool.max_connections == 3 and type(pool).__name__ == "BlockingConnectionPool"
    asyncio.run(bounded.aclose())


@pytest.mark.parametrize(
    "args, keys",
    [
        (("FCALL", "tq_claim", 1, "ns:{p}:meta", "task"), ["ns:{p}:meta"]),
        (("fcall_ro", "f", "2", b"a{x}", b"b{x}", "arg"), [b"a{x}", b"b{x}"]),
        (("FCALL", "tq_version", 0), []),
        (("XREAD", "COUNT", 1, "BLOCK", 5, "STREAMS", "s1", "s2", "0", "$"), ["s1", "s2"]),
        ((b"xread", b"streams", b"s", b"0"), [b"s"]),
        (("GET", "k"), None),
        (("XREAD", "COUNT", 1), None),
    ],
)
def test_keys_of_calls_routed_without_asking_the_server(args, keys):
    assert connections.keys_of_call(args) == keys


def _verify_failure() -> redis.ConnectionError:
    """What redis-py raises when the server's certificate fails verification: a ConnectionError
    raised while handling the ssl error."""
    import ssl

    try:
        try:
            raise ssl.SSLCertVerificationError(1, "certificate verify failed: unable to get local issuer")
        except OSError as error:
            raise redis.ConnectionError(f"Error connecting: {error}")  # noqa: B904 - as redis-py does
    except redis.ConnectionError as wrapped:
        return wrapped


@pytest.mark.parametrize(
    "error, gives_up_at_once",
    [
        (redis.exceptions.AuthenticationError("WRONGPASS invalid username-password pair"), True),
        (_verify_failure(), True),
        (redis.ConnectionError("Connection refused"), False),  # a restart: the whole backoff
        (redis.TimeoutError("Timeout reading from socket"), False),
    ],
    ids=["credentials", "certificate", "refused", "timeout"],
)
@pytest.mark.parametrize("asyncio_client", [False, True], ids=["sync", "async"])
def test_reconnects_give_up_at_once_only_where_no_reconnect_can_help(error, gives_up_at_once, asyncio_client):
    from redis.backoff import NoBackoff

    given = connections.connection_options(asyncio=asyncio_client)["retry"]
    retries = given.get_retries()
    assert retries == 12
    retry = type(given)(NoBackoff(), retries)  # the same policy without the pauses
    calls, failures = [], []
    expected = 1 if gives_up_at_once else retries + 1

    def do():
        calls.append(1)
        raise error

    if asyncio_client:

        async def ado():
            do()

        async def afail(e):
            failures.append(e)

        with pytest.raises(type(error)):
            asyncio.run(retry.call_with_retry(ado, afail))
    else:
        with pytest.raises(type(error)):
            retry.call_with_retry(do, failures.append)
    assert len(calls) == expected
    assert failures == [error] * expected  # redis-py's own failure handler still ran (it disconnects)
