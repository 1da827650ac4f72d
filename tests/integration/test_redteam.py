"""Closed by default, tried as an attacker would (issue 31): another local user, and another tenant.

The attacks run in a separate process as uid 65534 (``nobody``; the suite runs as root, as CI
does), with what such a user can find on the host (listening ports, ``/proc/net/unix``, the
public source: :mod:`tests.integration.redteam_probe`). Each test fails on the code before issue
31: the embedded server answered anyone on its port, the storage nodes handed their bytes to any
local user and to another namespace's client holding the shared node token, a namespace's ACL
user could run any Lua with ``EVAL``, and ``tq-redis status`` printed the Redis password.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from tensordict import TensorDict

from tests.conftest import server_binary
from tq_redis import acl, cli, server_policy
from tq_redis.embedded import EmbeddedServer

ROOT = Path(__file__).parents[2]
NOBODY = 65534
CLI = [sys.executable, "-m", "tq_redis.cli"]
SECRET = "Sup3rSecretPw"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changing to another uid needs root (CI runs as root)")


def _runnable_by_others(path: str) -> bool:
    """Whether every directory above ``path`` and the file itself let other users in."""
    real = Path(os.path.realpath(path))
    if not real.is_file() or not real.stat().st_mode & stat.S_IXOTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)


def _python_for_others() -> str:
    """An interpreter uid 65534 may run (the probe needs only the standard library)."""
    for candidate in (sys.executable, shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")):
        if candidate and _runnable_by_others(candidate):
            return candidate
    pytest.fail("no Python interpreter here is executable by other users (the probe runs as uid 65534)")


PROBE = Path(__file__).with_name("redteam_probe.py")


def as_nobody(plan: dict, timeout: float = 180) -> dict:
    """Run the probe with ``plan`` as uid/gid 65534 (no supplementary groups); what it managed."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(
        [_python_for_others(), str(PROBE), json.dumps(plan)],
        cwd=ROOT, user=NOBODY, group=NOBODY, extra_groups=[], env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["uid"] == NOBODY
    return result


def _refused(outcome) -> bool:
    return isinstance(outcome, str) and outcome.startswith(("refused", "unreachable", "dropped"))


def _assert_nodes_refused(result: dict) -> None:
    tries = [t for node in result["nodes"] for t in node]
    assert tries, "the probe tried no node"
    for t in tries:
        assert _refused(t["hello"]) and t["bytes"] == 0, result["nodes"]


def _td(n: int, width: int, value: float) -> TensorDict:
    return TensorDict({"x": torch.full((n, width), value)}, batch_size=[n])


# ---------------------------------------------------------------------------------------------
# Another tenant of a shared Redis: namespaces with their own ACL users
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["valkey", "redis7"])
def shared_redis(request):
    """A server whose default user needs a password (the admin's), the library loaded by the admin."""
    server = EmbeddedServer(binary=server_binary(request.param)).start()
    redis.Redis.from_url(server.url).config_set("requirepass", SECRET)  # from now on, the admin's
    admin_url = f"redis://:{SECRET}@{server.host}:{server.port}/0"
    assert cli.main(["load-library", "--redis", admin_url]) == 0
    yield server, admin_url
    server_policy.forget()
    server.stop()


def _user(server: EmbeddedServer, admin_url: str, namespace: str, role: str = "client") -> str:
    user, password = acl.default_user(namespace, role), f"pw-{namespace}-{role}"
    assert cli.main(["acl", namespace, "--role", role, "--user", user, "--password", password,
                     "--apply", "--redis", admin_url]) == 0  # fmt: skip
    return f"redis://{user}:{password}@{server.host}:{server.port}/0"


def test_a_namespace_user_can_run_no_script_and_reach_nothing_else(shared_redis):
    server, admin_url = shared_redis
    url_a = _user(server, admin_url, "nsa")
    admin = redis.Redis.from_url(admin_url)
    admin.set("nsb:config", "b's")
    attempts = [
        ["EVAL", "local t = redis.call('TIME') while redis.call('TIME')[1] - t[1] < 8 do end return 1", "0"],
        ["EVAL", "return redis.call('GET', KEYS[1])", "1", "nsa:config"],
        ["EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"],
        ["SCRIPT", "LOAD", "return 1"],
        ["FUNCTION", "LOAD", "#!lua name=evil\nredis.register_function('evil', function() return 1 end)"],
        ["FUNCTION", "FLUSH"],
        ["FLUSHALL"], ["FLUSHDB"], ["KEYS", "*"], ["SCAN", "0"], ["CONFIG", "GET", "requirepass"],
        ["GET", "nsb:config"], ["HGETALL", "nsb:storage:nodes"],
        ["FCALL", "tq_read_registry", "1", "nsb:storage:nodes"],
    ]  # fmt: skip
    result = as_nobody({"commands": {"url": url_a, "try": attempts}})
    assert all(v.startswith("refused") for v in result["commands"].values()), result["commands"]
    assert "NOPERM" in result["commands"][" ".join(attempts[0])[:60]] or "no permissions" in result["commands"][
        " ".join(attempts[0])[:60]].lower()  # fmt: skip
    assert admin.get("nsb:config") == b"b's"
    admin.close()
