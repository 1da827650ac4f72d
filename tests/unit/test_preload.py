"""tq_redis.preload: what a forkserver preloads so that each rank attaches in a few round trips."""

from __future__ import annotations

import subprocess
import sys

import redis

from tq_redis.server import connections


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_preload_imports_the_client_stack_and_builds_the_library_once() -> None:
    out = _run(
        "import sys, tq_redis.preload\n"
        "from tq_redis.server import library\n"
        "print(all(m in sys.modules for m in tq_redis.preload.CLIENT_STACK), library.library.cache_info().currsize)"
    )
    assert out == "True 1"


def test_a_dict_config_does_not_import_omegaconf() -> None:
    out = _run(
        "import sys\n"
        "from tq_redis.api import config\n"
        "config.load({'namespace': 'n', 'redis': {'url': 'redis://127.0.0.1:1'}})\n"
        "print('omegaconf' in sys.modules)"
    )
    assert out == "False"


def test_connections_do_not_look_up_redis_pys_version_each_time(monkeypatch) -> None:
    """redis-py 8 reads its version from the package metadata for each new connection unless told it."""
    calls = []
    monkeypatch.setattr("redis.utils.get_lib_version", lambda: calls.append(1) or redis.__version__)
    for _ in range(3):
        client = connections.sync_client("redis://127.0.0.1:1", cluster=False, reconnect=False)
        try:  # port 1 refuses: the connection object is made, then fails to connect
            client.ping()
        except redis.ConnectionError:
            pass
        client.close()
    assert calls == []
    assert "driver_info" in connections.connection_options(asyncio=True) or not hasattr(redis, "driver_info")
