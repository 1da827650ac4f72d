"""A server busy in a long script (someone else's: tq-redis's own hold it a few ms at most) answers
every other command ``BUSY``. Our calls wait for it, within a bound, and then raise
``ServerBusy``, a typed error that says what is going on -- never redis-py's raw ``ResponseError``."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis import errors
from tq_redis.server import policy

# Read-only, so SCRIPT KILL can stop it: spins on the server's clock for ARGV[1] ms (forever if 0).
SPIN = """
local t = redis.call('TIME')
local until_us = tonumber(t[1]) * 1e6 + tonumber(t[2]) + tonumber(ARGV[1]) * 1000
while tonumber(ARGV[1]) == 0 or tonumber(t[1]) * 1e6 + tonumber(t[2]) < until_us do
  t = redis.call('TIME')
end
return 1
"""
THRESHOLD_MS = 50  # busy-reply-threshold: others get BUSY once a script ran this long


class BusyServer:
    """Runs SPIN from its own connection and thread; :meth:`wait_busy` returns once the server
    answers BUSY to others."""

    def __init__(self, url: str, ms: int) -> None:
        self.url, self.ms = url, ms
        self.admin = redis.Redis.from_url(url)
        self.threshold = self.admin.config_get("busy-reply-threshold")["busy-reply-threshold"]
        self.admin.config_set("busy-reply-threshold", THRESHOLD_MS)
        self.outcome: list = []
        self.thread = threading.Thread(target=self._spin)

    def _spin(self) -> None:
        conn = redis.Redis.from_url(self.url, socket_timeout=None)
        try:
            self.outcome.append(conn.eval(SPIN, 0, self.ms))
        except redis.ResponseError as exc:  # killed
            self.outcome.append(exc)
        finally:
            conn.close()

    def __enter__(self) -> BusyServer:
        self.thread.start()
        probe = redis.Redis.from_url(self.url)
        give_up = time.monotonic() + 60
        while True:
            assert time.monotonic() < give_up, "the server never became busy"
            try:
                probe.ping()
            except redis.ResponseError as exc:
                if str(exc).startswith("BUSY"):
                    break
                raise
            time.sleep(0.005)
        probe.close()
        return self

    def __exit__(self, *exc) -> None:
        if self.ms == 0:
            while self.thread.is_alive():
                try:
                    self.admin.script_kill()
                except redis.ResponseError:  # not running yet or any more
                    pass
                self.thread.join(0.1)
        self.thread.join()
        self.admin.config_set("busy-reply-threshold", self.threshold)
        self.admin.close()


def _put(client, n: int):
    return client.put(TensorDict({"x": torch.arange(n)}, batch_size=[n]), partition_id="p")


def test_calls_wait_out_a_long_script_and_then_run(real_server, namespace):
    client = make_client(real_server.url, namespace)
    _put(client, 4)
    with BusyServer(real_server.url, 1500):
        got = client.get_meta(["x"], 2, "p", task_name="t")  # a single script call
        meta = _put(client, 2)  # a pipeline (reserve, store, insert + registration)
    assert got.global_indexes == [0, 1]
    assert meta.global_indexes == [4, 5]
    assert client.get_data(meta)["x"].tolist() == [0, 1]
    client.close()


def test_a_server_busy_for_too_long_raises_server_busy(real_server, namespace, monkeypatch):
    client = make_client(real_server.url, namespace)
    _put(client, 4)
    monkeypatch.setattr(policy, "BUSY_WAIT_S", 0.5)
    with BusyServer(real_server.url, 0):
        started = time.monotonic()
        with pytest.raises(errors.ServerBusy, match="busy running a script") as busy:
            client.get_meta(["x"], 2, "p", task_name="t")
        assert time.monotonic() - started >= 0.5
        assert "SCRIPT KILL" in str(busy.value) and not isinstance(busy.value, redis.RedisError)
        with pytest.raises(errors.ServerBusy):
            _put(client, 1)
    # nothing of the refused calls ran
    assert client.get_meta(["x"], 4, "p", task_name="t").global_indexes == [0, 1, 2, 3]
    assert client.get_meta(["x"], 1, "p", task_name="t").size == 0
    client.close()
