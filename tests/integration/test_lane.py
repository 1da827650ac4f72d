"""A single-server client's lane: function calls on one kept connection, every reply to its own call.

The lane skips the pool's per-command checkout; these tests hold it to what the pool path
guaranteed: a reply never goes to another call (threads, an interrupted call, a fork), and a
connection that dies is replaced without the caller seeing it.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid

import pytest
import redis

from tq_redis.server import connections

ECHO_LIBRARY = "#!lua name=lanetest\nredis.register_function('lane_echo', function(keys, args) return args[1] end)"


@pytest.fixture
def lane_client(real_server):
    admin = redis.Redis.from_url(real_server.url)
    admin.function_load(ECHO_LIBRARY, replace=True)
    client = connections.sync_client(real_server.url, cluster=False)
    assert isinstance(client, connections.SingleClient)
    yield client
    client.close()
    admin.function_delete("lanetest")
    admin.close()


def _echo(client, value: str) -> str:
    return client.execute_command("FCALL", "lane_echo", 0, value).decode()


def _kill(conn, url: str) -> None:
    """Kill connection ``conn`` from another client (``CLIENT KILL``), as a dropped link would."""
    conn.send_command("CLIENT", "ID")
    conn_id = conn.read_response()
    admin = redis.Redis.from_url(url)
    try:
        assert admin.client_kill_filter(_id=conn_id) == 1
    finally:
        admin.close()


def test_function_calls_reuse_one_connection_without_pool_checkouts(lane_client, monkeypatch):
    _echo(lane_client, "warm")
    checkouts = []
    real_get = lane_client.connection_pool.get_connection
    monkeypatch.setattr(lane_client.connection_pool, "get_connection", lambda *a: checkouts.append(1) or real_get(*a))
    assert [_echo(lane_client, str(i)) for i in range(100)] == [str(i) for i in range(100)]
    assert checkouts == []
    assert lane_client.execute_command("PING") is True  # other commands: the pool's way
    assert checkouts == [1]


def test_a_killed_lane_connection_is_replaced_and_the_call_still_answers(lane_client, real_server):
    _echo(lane_client, "warm")
    _kill(lane_client._lane, real_server.url)
    assert _echo(lane_client, "after the kill") == "after the kill"
    assert _echo(lane_client, "and again") == "and again"


class _Interrupted(BaseException):
    """Stands for Ctrl-C or a timeout exception thrown into the caller mid-call."""


def test_a_call_interrupted_before_its_reply_does_not_hand_that_reply_to_the_next(lane_client, monkeypatch):
    _echo(lane_client, "warm")
    conn = lane_client._lane

    def interrupted(*args, **kwargs):
        monkeypatch.undo()  # once: the pool may hand this connection out again, reconnected
        raise _Interrupted

    monkeypatch.setattr(conn, "read_response", interrupted)
    with pytest.raises(_Interrupted):
        _echo(lane_client, "lost")
    assert lane_client._lane is None
    assert _echo(lane_client, "mine") == "mine"  # not "lost", the reply left unread
    assert _echo(lane_client, "and mine") == "and mine"


def test_threads_sharing_a_client_each_get_their_own_replies(lane_client):
    wrong: list[tuple[str, str]] = []

    def calls(tag: str) -> None:
        for i in range(300):
            want = f"{tag}-{i}"
            got = _echo(lane_client, want)
            if got != want:
                wrong.append((want, got))

    threads = [threading.Thread(target=calls, args=(f"t{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []


def _child_echoes(client, out) -> None:
    out.put([_echo(client, f"child-{i}") for i in range(20)])


def test_a_forked_child_uses_its_own_connection_and_the_parent_keeps_its_lane(lane_client):
    _echo(lane_client, "warm")
    parent_lane = lane_client._lane
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_echoes, args=(lane_client, out))
    child.start()
    try:
        assert out.get(timeout=60) == [f"child-{i}" for i in range(20)]
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0
    token = uuid.uuid4().hex
    assert _echo(lane_client, token) == token
    assert lane_client._lane is parent_lane


def test_closing_the_client_closes_its_lane(real_server):
    client = connections.sync_client(real_server.url, cluster=False)
    admin = redis.Redis.from_url(real_server.url)
    try:
        admin.function_load(ECHO_LIBRARY, replace=True)
        name = f"lane-{uuid.uuid4().hex[:8]}"
        client.client_setname(name)  # the pool's connection; the lane is named below
        _echo(client, "warm")
        lane = client._lane
        lane.send_command("CLIENT", "SETNAME", name)
        assert lane.read_response() in (b"OK", "OK", True)
        assert any(c["name"] == name for c in admin.client_list())
        client.close()
        deadline = time.monotonic() + 10  # the server drops a closed connection on its next loop
        while any(c["name"] == name for c in admin.client_list()):
            assert time.monotonic() < deadline, "the lane's connection is still open after close()"
    finally:
        admin.close()


# ------------------------------------------------------------------ pipelines on the lane


def test_a_pipeline_goes_out_on_the_lane_with_its_replies_in_order(lane_client, monkeypatch):
    _echo(lane_client, "warm")
    checkouts = []
    real_get = lane_client.connection_pool.get_connection
    monkeypatch.setattr(lane_client.connection_pool, "get_connection", lambda *a: checkouts.append(1) or real_get(*a))
    key, members = f"lane:{uuid.uuid4().hex}", f"lane:{uuid.uuid4().hex}"
    commands = [
        ("FCALL", "lane_echo", 0, "a"), ("SET", key, "v"), ("INCR", key), ("SADD", members, "x", "y"),
        ("SMEMBERS", members), ("FCALL", "lane_echo", 0, "b"),
    ]  # fmt: skip
    replies = lane_client.pipeline_on_lane(commands)
    assert replies is not None and checkouts == []
    assert replies[0] == b"a" and replies[1] is True and replies[3] == 2
    assert replies[4] == {b"x", b"y"} and replies[5] == b"b"  # as redis-py's callbacks make them
    assert isinstance(replies[2], redis.ResponseError)  # an error reply takes its command's place
    assert _echo(lane_client, "next") == "next"  # and the lane is still in step
    lane_client.delete(key, members)
    pipe = lane_client.pipeline(transaction=False)
    for args in commands:
        pipe.execute_command(*args)
    pooled = pipe.execute(raise_on_error=False)  # the same pipeline the pool's way gives the same replies
    lane_client.delete(key, members)
    again = lane_client.pipeline_on_lane(commands)
    assert [type(r) for r in again] == [type(r) for r in pooled]
    assert [r for r in again if not isinstance(r, Exception)] == [r for r in pooled if not isinstance(r, Exception)]
    lane_client.delete(key, members)


def test_a_pipeline_on_a_killed_lane_connection_is_left_to_the_pool(lane_client, real_server):
    _echo(lane_client, "warm")
    _kill(lane_client._lane, real_server.url)
    lost = lane_client.pipeline_on_lane([("FCALL", "lane_echo", 0, "x")])
    assert lost is connections.LANE_LOST  # the caller resends (it may have run: request records)
    assert lane_client._lane is None
    assert lane_client.pipeline_on_lane([("FCALL", "lane_echo", 0, "y")]) == [b"y"]  # a new lane


def test_a_pipeline_is_left_to_the_pool_while_another_thread_holds_the_lane(lane_client):
    _echo(lane_client, "warm")
    assert lane_client._lane_lock.acquire(blocking=False)
    try:
        assert lane_client.pipeline_on_lane([("FCALL", "lane_echo", 0, "x")]) is None
    finally:
        lane_client._lane_lock.release()


def test_an_interrupted_pipeline_leaves_no_reply_for_the_next_call(lane_client, monkeypatch):
    _echo(lane_client, "warm")
    conn = lane_client._lane
    calls = []

    def second_read_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            monkeypatch.undo()
            raise _Interrupted
        return real_read(*args, **kwargs)

    real_read = conn.read_response
    monkeypatch.setattr(conn, "read_response", second_read_interrupted)
    with pytest.raises(_Interrupted):
        lane_client.pipeline_on_lane([("FCALL", "lane_echo", 0, "one"), ("FCALL", "lane_echo", 0, "two")])
    assert lane_client._lane is None
    assert _echo(lane_client, "mine") == "mine"  # not "two", the reply left unread


def test_the_driver_resends_a_pipeline_its_lane_lost_the_pool_way(real_server):
    from tq_redis.client.driver import SyncDriver
    from tq_redis.ops.effects import Cmd, Pipe

    driver = SyncDriver(real_server.url)
    key = f"lane:{uuid.uuid4().hex}"

    def incr_twice():
        return (yield Pipe((Cmd(("INCR", key)), Cmd(("INCR", key)))))

    assert driver.run(incr_twice()) == [1, 2]
    _kill(driver.redis._lane, real_server.url)
    admin = redis.Redis.from_url(real_server.url)
    try:
        assert driver.run(incr_twice()) == [3, 4]  # sent once more, the pool's way, and only once
        assert int(admin.get(key)) == 4
        admin.delete(key)
    finally:
        admin.close()
        driver.close()


@pytest.mark.parametrize(
    "value, sent",
    [
        ("plain", b"plain"),
        ("é ü", "é ü".encode()),
        (b"\x00\xffbytes", b"\x00\xffbytes"),
        (memoryview(b"a view"), b"a view"),
        (bytearray(b"a bytearray"), b"a bytearray"),  # hiredis refuses it: redis-py's packer sends it
        (12345678901234, b"12345678901234"),
        (-7, b"-7"),
        (2.5, b"2.5"),
    ],
)
def test_every_argument_type_arrives_byte_for_byte(lane_client, value, sent):
    """The lane packs commands with hiredis directly; what the server receives is what redis-py's
    own packer would have sent."""
    assert lane_client.execute_command("FCALL", "lane_echo", 0, value) == sent
    # a pipeline too, with a command whose reply redis-py's callback turns into a bool
    echo = ("FCALL", "lane_echo", 0, value)
    assert lane_client.pipeline_on_lane([echo, ("PING",), echo]) == [sent, True, sent]
    packed = connections._packed(("FCALL", "lane_echo", 0, value))
    if isinstance(value, bytearray):
        assert packed is None
    else:
        assert packed == _redis_py_packed(lane_client, value)


def _redis_py_packed(client, value) -> bytes:
    conn = client.connection_pool.make_connection()
    try:
        return b"".join(bytes(chunk) for chunk in conn.pack_command("FCALL", "lane_echo", 0, value))
    finally:
        conn.disconnect()
