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
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
import torch
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client, server_binary
from tests.procs import up_attach
from tq_redis.api import system as runtime
from tq_redis.backends.dram.launcher import spawn_node, start_local_nodes
from tq_redis.backends.dram.protocol import PROTOCOL_VERSION
from tq_redis.cli import main as cli
from tq_redis.errors import ConfigError, ConnectionFailed, StorageUnavailable
from tq_redis.meta.keys import PartitionKeys
from tq_redis.server import acl
from tq_redis.server import policy as server_policy
from tq_redis.server.embedded import EmbeddedServer, free_port

ROOT = Path(__file__).parents[2]
NOBODY = 65534
CLI = [sys.executable, "-m", "tq_redis.cli.main"]
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


def _all(x: torch.Tensor, value: float) -> bool:
    """Whether every element of a field read back (nested, as init's client returns it, or dense) is ``value``."""
    return bool((x.to_padded_tensor(0) if x.is_nested else x).eq(value).all())


# ---------------------------------------------------------------------------------------------
# Another local user against the embedded default: init() and tq-redis up
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def embedded_job(monkeypatch):
    """``tq.init()`` with no URL (its embedded Valkey and two storage nodes), holding small values
    inline in Redis and 8 KiB values on the nodes."""
    for name in ("TQ_REDIS_URL", "TQ_NAMESPACE", "TQ_STORAGE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    tq.init({"namespace": "victim", "storage": {"unit_capacity": "64MiB"}})
    try:
        client = tq.get_client()
        small = client.put(_td(4, 2, 7.0), partition_id="small")
        large = client.put(_td(2, 2048, 9.0), partition_id="large")  # 8 KiB a value: on the nodes
        yield client, small, large
    finally:
        tq.close()


def test_another_user_cannot_read_or_flush_the_embedded_server(embedded_job):
    client, small, large = embedded_job
    server = runtime._state["server"]
    inline = PartitionKeys("victim", "small").inline
    plan = {
        "redis": [{"url": f"redis://127.0.0.1:{server.port}/0", "read": [["hash", inline]], "flushall": True}],
        "socket_files": [server.unix_socket],
    }
    result = as_nobody(plan)
    (attempt,) = result["redis"]
    assert all(_refused(v) for v in attempt["read"].values()), attempt
    assert _refused(attempt["flushall"]), attempt
    assert attempt.get("password_from_cmdline") is False, attempt  # no command line shows the password
    assert all(_refused(v) for v in result["socket_files"].values()), result["socket_files"]
    assert _all(client.get_data(small)["x"], 7.0)  # nothing was flushed
    assert _all(client.get_data(large)["x"], 9.0)


def test_another_user_cannot_read_the_embedded_storage_nodes(embedded_job):
    client, small, large = embedded_job
    nodes = runtime._state["nodes"].nodes
    keys = PartitionKeys("victim", "large").data_keys(large.global_indexes, "x")
    plan = {
        "scan_unix": "tq-dram-",
        "nodes": [{"address": n.info["address"], "uds": n.info.get("uds"), "get": keys,
                   "hello": [{"v": PROTOCOL_VERSION, "client": "probe"},
                             {"v": PROTOCOL_VERSION, "client": "probe", "ns": "victim", "token": None}]}
                  for n in nodes],
    }  # fmt: skip
    result = as_nobody(plan)
    assert {n.info["uds"] for n in nodes} <= set(result["abstract"])  # anyone finds the sockets
    _assert_nodes_refused(result)
    assert _all(client.get_data(large)["x"], 9.0)


def test_up_admits_only_its_owner_and_says_how():
    env = {k: v for k, v in os.environ.items() if k not in ("TQ_STORAGE_TOKEN", "TQ_REDIS_URL")}
    proc = subprocess.Popen(CLI + ["up", "--units", "1", "--capacity", "64MiB", "--namespace", "upsec"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        said, url = up_attach(proc)
        port = int(re.search(r"127\.0\.0\.1:(\d+)", said).group(1))
        attach = re.search(r"source (\S+)", said).group(1)
        assert oct(os.stat(attach).st_mode & 0o777) == "0o600"
        password = redis.connection.parse_url(url)["password"]
        assert password and password not in said  # printed nowhere
        assert "password" in said and "access key" in said  # what protects what

        client = tq.TransferQueueClient(url, "upsec")  # the attach URL works
        meta = client.put(_td(2, 2048, 5.0), partition_id="p")
        node = json.loads(next(iter(client.redis.hgetall("upsec:storage:nodes").values())))
        keys = PartitionKeys("upsec", "p").data_keys(meta.global_indexes, "x")
        result = as_nobody({
            "redis": [{"url": f"redis://127.0.0.1:{port}/0", "read": [["get", "upsec:config"]], "flushall": True}],
            "nodes": [{"address": node["address"], "uds": node.get("uds"), "get": keys,
                       "hello": [{"v": PROTOCOL_VERSION, "client": "probe"}]}],
        })  # fmt: skip
        (attempt,) = result["redis"]
        assert _refused(attempt["flushall"]) and all(_refused(v) for v in attempt["read"].values()), attempt
        assert attempt.get("password_from_cmdline") is False, attempt
        _assert_nodes_refused(result)
        assert _all(client.get_data(meta)["x"], 5.0)
        client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


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


def test_a_shared_node_token_does_not_cross_namespaces(shared_redis, monkeypatch):
    """As docker-compose had it: one TQ_STORAGE_TOKEN for every node and every rank."""
    server, admin_url = shared_redis
    monkeypatch.setenv(server_policy.LOAD_LIBRARY_ENV, "never")
    monkeypatch.setenv("TQ_STORAGE_TOKEN", "shared-token")
    urls = {ns: _user(server, admin_url, ns) for ns in ("nsa", "nsb")}
    node_urls = {ns: _user(server, admin_url, ns, "storage-node") for ns in ("nsa", "nsb")}
    nodes = {ns: start_local_nodes(node_urls[ns], ns, n=1, capacity="64MiB", token="shared-token") for ns in urls}
    with nodes["nsa"], nodes["nsb"] as b_nodes:
        a = make_client(urls["nsa"], "nsa", backend="dram")
        a.put(_td(2, 2048, 1.0), partition_id="p")
        b = make_client(urls["nsb"], "nsb", backend="dram")
        secret = b.put(_td(2, 2048, 3.0), partition_id="p")
        keys = PartitionKeys("nsb", "p").data_keys(secret.global_indexes, "x")
        (b_node,) = b_nodes.nodes
        base = {"v": PROTOCOL_VERSION, "client": "probe", "token": "shared-token"}
        result = as_nobody({"nodes": [{
            "address": b_node.info["address"], "uds": b_node.info.get("uds"), "get": keys,
            "steal": {"url": urls["nsa"], "key": "nsa:storage:nodes"},
            "hello": [base, {**base, "ns": "nsb"}, {**base, "ns": "nsa", "access": "@stolen"},
                      {**base, "ns": "nsb", "access": "@stolen"}],
        }]})  # fmt: skip
        _assert_nodes_refused(result)
        assert _all(b.get_data(secret)["x"], 3.0)
        a.close()
        b.close()


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


# ---------------------------------------------------------------------------------------------
# No secret in any output
# ---------------------------------------------------------------------------------------------


class _SlamDoor:
    """A TCP port that accepts connections and closes them at once, counting them."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.count = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _status(url: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TQ_REDIS_URL"}
    return subprocess.run(CLI + ["status", "--redis", url, *extra], capture_output=True, text=True, env=env,
                          timeout=120)


def test_status_against_an_unreachable_redis_is_one_line_without_the_password():
    door = _SlamDoor()
    try:
        for url in (f"redis://:{SECRET}@127.0.0.1:{door.port}/0", f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"):
            out = _status(url)
            text = out.stdout + out.stderr
            assert out.returncode == 1, text
            assert SECRET not in text
            lines = [line for line in text.splitlines() if line.strip()]
            assert len(lines) == 1 and "cannot reach Redis" in lines[0] and "check" in lines[0], text
        assert door.count <= 3  # a short bounded try, not a reconnect backoff
    finally:
        door.close()


def test_status_and_errors_never_show_a_secret(shared_redis):
    server, admin_url = shared_redis
    url = _user(server, admin_url, "nss")
    node_url = _user(server, admin_url, "nss", "storage-node")
    with start_local_nodes(node_url, "nss", n=1, capacity="64MiB"):
        client = make_client(url, "nss", backend="dram")
        client.put(_td(2, 2048, 1.0), partition_id="p")
        registrations = redis.Redis.from_url(admin_url).hgetall("nss:storage:nodes").values()
        secrets = {SECRET, "pw-nss-client", "pw-nss-storage-node"}
        secrets |= {json.loads(r)["access"] for r in registrations}
        for extra in ((), ("--json",)):
            out = _status(url, "--namespace", "nss", *extra)
            assert out.returncode == 0, out.stderr
            assert "storage nodes: 1" in out.stdout or '"storage_nodes"' in out.stdout
            assert not any(s in out.stdout + out.stderr for s in secrets)
        client.close()
    wrong = f"redis://tq-nss:{SECRET}@{server.host}:{server.port}/0"
    out = _status(wrong, "--namespace", "nss")
    assert out.returncode == 1 and SECRET not in out.stdout + out.stderr
    assert len([line for line in (out.stdout + out.stderr).splitlines() if line.strip()]) == 1
    assert "refused the credentials" in out.stderr


def test_exceptions_and_logs_redact_the_url():
    dead = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"
    with pytest.raises(ConnectionFailed) as info:
        tq.init({"redis": {"url": dead}, "namespace": "redact"})
    assert SECRET not in str(info.value) and "***" in str(info.value)
    for bad in (f"http://:{SECRET}@host:1/0", f"redis://:{SECRET}@host:notaport/0"):
        with pytest.raises(ConfigError) as info:
            tq.TransferQueueClient(bad, "redact")
        assert SECRET not in str(info.value)
    with pytest.raises(StorageUnavailable) as info:  # the node's log, quoted in the error
        spawn_node(dead, "redact", capacity="64MiB", timeout=60)
    assert SECRET not in str(info.value)
