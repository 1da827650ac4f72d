"""A server that refuses ``INFO`` (an ACL user without it, fakeredis) still gets a status, minus the server figures."""

from __future__ import annotations

import redis

from tq_redis.monitor import status


class _NoInfo:
    def info(self, section: str):
        raise redis.exceptions.NoPermissionError("this user has no permissions to run the 'info' command")


def test_server_figures_are_unknown_and_say_why():
    server = status.server_status(_NoInfo())
    assert server["refused"] and "info" in server["refused"]
    assert server["used_memory"] is None and server["maxmemory_policy"] is None
    line = status.server_line({"server": server})
    assert line.startswith("server: INFO refused (") and "unknown" in line
