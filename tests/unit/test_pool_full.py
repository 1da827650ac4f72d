"""A client whose connection pool is full says so, not that Redis cannot be reached."""

from __future__ import annotations

import redis

from tq_redis.client.plans import handed_over
from tq_redis.errors import ConnectionFailed
from tq_redis.ops.effects import Cmd


def _pool_full_error() -> BaseException:
    """The error redis-py itself raises for a pool at its cap (no server needed: the cap is checked
    before a connection is made)."""
    pool = redis.ConnectionPool.from_url("redis://127.0.0.1:1/0", max_connections=1)
    pool.make_connection()  # made, not connected
    try:
        pool.make_connection()
    except redis.ConnectionError as exc:
        return exc
    raise AssertionError("a pool of 1 connection made two")


def test_a_full_pool_is_named_as_such():
    exc = _pool_full_error()
    typed = handed_over("redis://:secret@127.0.0.1:1/0", Cmd(("GET", "k")), exc)
    assert isinstance(typed, ConnectionFailed)
    message = str(typed)
    assert "pool" in message and "is full" in message and "the server is reachable" in message
    assert "cannot reach" not in message and "secret" not in message


def test_a_refused_connection_still_says_redis_cannot_be_reached():
    typed = handed_over("redis://127.0.0.1:1/0", Cmd(("GET", "k")), redis.ConnectionError("Connection refused"))
    assert isinstance(typed, ConnectionFailed) and "cannot reach Redis" in str(typed)
