"""The ``tq-redis`` command: ``up`` in the foreground, ``status`` (text and --json), ``--version``; an
unknown namespace refused by ``status`` / ``exporter`` / ``dashboard`` / ``namespace drop``
(``--allow-empty``), ``status`` into a closed pipe, and the help texts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import redis
import torch
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client, server_binary
from tests.procs import up_attach
from tq_redis.server.embedded import EmbeddedServer

CLI = [sys.executable, "-m", "tq_redis.cli.main"]


def test_status_json_reflects_known_state(real_server, namespace):
    client = make_client(real_server.url, namespace)
    meta = client.put(TensorDict({"a": torch.arange(10)}, batch_size=[10]), partition_id="p")
    client.put(TensorDict({"b": torch.arange(4)}, batch_size=[4]), metadata=meta[0:4])
    client.get_meta(["a"], 6, "p", task_name="actor")
    client.get_meta(["a"], 2, "p", task_name="critic", lease_s=60)
    out = subprocess.run(CLI + ["status", "--json", "--redis", real_server.url, "--namespace", namespace],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    (p,) = snap["partitions"]
    assert p["id"] == "p" and p["samples"] == 10
    assert p["fields"]["a"] == {"produced": 10, "pct": 100.0}
    assert p["fields"]["b"] == {"produced": 4, "pct": 40.0}
    actor = p["tasks"]["actor"]
    assert {k: actor[k] for k in ("consumed", "in_flight", "poison", "pct")} == \
        {"consumed": 6, "in_flight": 0, "poison": 0, "pct": 60.0}
    assert p["tasks"]["critic"]["in_flight"] == 2 and p["tasks"]["critic"]["consumed"] == 0
    text = subprocess.run(CLI + ["status", "--redis", real_server.url, "--namespace", namespace],
                          capture_output=True, text=True, timeout=180).stdout
    assert "partition 'p': 10 samples" in text and "leases 2 (0 lapsed" in text
    client.close()


def test_status_needs_a_url():
    env = {k: v for k, v in os.environ.items() if k != "TQ_REDIS_URL"}
    out = subprocess.run(CLI + ["status"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "TQ_REDIS_URL" in out.stderr


def test_version_says_whether_batches_are_copied_and_scanned_natively():
    wide = {**os.environ, "COLUMNS": "200"}  # argparse wraps the version line to the terminal
    on = subprocess.run(CLI + ["--version"], capture_output=True, text=True, env=wide, timeout=60, check=True)
    assert on.stdout.startswith("tq-redis ") and "native batch copies on" in on.stdout
    assert "native batch scans on" in on.stdout
    env = {**os.environ, "TQ_NATIVE_COPY": "0", "COLUMNS": "200"}
    off = subprocess.run(CLI + ["--version"], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert "native batch copies off" in off.stdout and "TQ_NATIVE_COPY" in off.stdout
    assert "native batch scans on" in off.stdout  # each module is switched off on its own
    env = {**os.environ, "TQ_NATIVE_SCAN": "0", "COLUMNS": "200"}
    off = subprocess.run(CLI + ["--version"], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert "native batch scans off" in off.stdout and "TQ_NATIVE_SCAN" in off.stdout


def test_up_serves_until_interrupted():
    proc = subprocess.Popen(CLI + ["up", "--units", "2", "--capacity", "64MiB", "--namespace", "upns"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner, url = up_attach(proc)
        assert banner.startswith("tq-redis up: redis://:***@"), banner
        client = tq.TransferQueueClient(url, "upns")
        meta = client.put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id="p")
        assert client.get_data(meta)["x"].tolist() == [0, 1, 2]
        nodes = client.redis.hgetall("upns:storage:nodes")
        assert len(nodes) == 2
        client.close()
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, rest
        assert "stopped" in rest
        try:
            redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
            raise AssertionError("Redis still answers after up stopped")
        except redis.ConnectionError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------ typos say so (issue 44)


@pytest.fixture(params=["valkey", "redis7"])
def own_server(request):
    """A server of its own (each flavour), so the known namespaces it lists are exactly this test's."""
    server = EmbeddedServer(binary=server_binary(request.param)).start()
    yield server
    server.stop()


def _first_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert line, f"exited with {proc.wait(30)}: {proc.stderr.read()}"
    return line


def test_an_unknown_namespace_exits_1_naming_the_known_ones(own_server):
    url = own_server.url
    for ns in ("job_a", "job_b"):
        client = make_client(url, ns)
        client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
        client.close()
    for command in (["status"], ["status", "--json"], ["exporter", "--port", "0"], ["dashboard", "--port", "0"]):
        out = subprocess.run(CLI + command + ["--redis", url, "--namespace", "job_c"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 1 and out.stdout == "", (command, out.stdout)
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith(f"tq-redis {command[0]}: no namespace 'job_c' on this server"), line
        assert "known namespaces: 'job_a', 'job_b'" in line and "--allow-empty" in line, line
    # a namespace that exists is shown as before
    out = subprocess.run(CLI + ["status", "--json", "--redis", url, "--namespace", "job_a"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and [p["id"] for p in json.loads(out.stdout)["partitions"]] == ["p"]


def test_allow_empty_shows_a_namespace_not_started_yet(own_server):
    url = own_server.url
    out = subprocess.run(CLI + ["status", "--json", "--allow-empty", "--redis", url, "--namespace", "later"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["namespace"] == "later" and snap["partitions"] == [] and snap["storage_nodes"] == []
    for command, path in (("exporter", "metrics"), ("dashboard", "api/snapshot")):
        proc = subprocess.Popen(CLI + [command, "--port", "0", "--allow-empty", "--redis", url, "--namespace",
                                       "later"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = _first_line(proc)
            m = re.search(r"at (http://\S+?)/?$", line.strip())
            assert "namespace 'later'" in line and m, line
            with urllib.request.urlopen(f"{m.group(1)}/{path}", timeout=60) as resp:
                assert resp.status == 200
        finally:
            proc.terminate()
            proc.wait(30)


def test_dropping_an_unknown_namespace_exits_1_and_drops_nothing(own_server):
    url = own_server.url
    client = make_client(url, "job_a")
    client.put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id="p")
    r = redis.Redis.from_url(url)
    before = sorted(r.keys("*"))
    out = subprocess.run(CLI + ["namespace", "drop", "job_aa", "--redis", url], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "dropped namespace" not in out.stdout, out.stdout
    (line,) = out.stderr.strip().splitlines()
    assert "no namespace 'job_aa'" in line and "'job_a'" in line and line.endswith("nothing dropped"), line
    assert sorted(r.keys("*")) == before  # not a key touched
    assert client.get_data(client.get_meta(["x"], 3, "p", mode="force_fetch"))["x"].tolist() == [0, 1, 2]
    # the namespace that exists is dropped as before
    client.close()
    out = subprocess.run(CLI + ["namespace", "drop", "job_a", "--force", "--redis", url], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "dropped namespace 'job_a'" in out.stdout, out.stderr
    r.close()


def test_a_refused_drop_answers_without_importing_torch(own_server):
    """A typo'd namespace or a refused password is answered before the drop code (and torch, seconds of
    imports) is loaded."""
    client = make_client(own_server.url, "job_b")
    client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
    client.close()
    probe = ("import sys; from tq_redis.cli.main import main; rc = main(sys.argv[1:]); "
             "print('torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", probe, "namespace", "drop", "job_bb", "--redis", own_server.url],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "1"], (out.stdout, out.stderr)
    assert "nothing dropped" in out.stderr, out.stderr


# ------------------------------------------------------------------ a closed pipe, help texts


def test_status_into_a_closed_pipe_exits_quietly(real_server, namespace):
    client = make_client(real_server.url, namespace)
    for k in range(200):  # a --json snapshot far larger than a pipe's buffer, so the write meets the closed end
        client.put(TensorDict({"x": torch.arange(1)}, batch_size=[1]), partition_id=f"partition-{k:04d}")
    client.close()
    status = [*CLI, "status", "--json", "--redis", real_server.url, "--namespace", namespace]
    shell = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -c 10', "pipe", *status],
                           capture_output=True, text=True, timeout=180)
    assert len(shell.stdout) == 10 and shell.stdout.startswith("{"), shell.stdout
    assert shell.returncode == 0 and shell.stderr == "", shell.stderr  # no BrokenPipeError traceback
    # --watch keeps writing: the reader leaves after its first bytes
    proc = subprocess.Popen([*status[:-4], "--watch", "--interval", "0.05", *status[-4:]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 0 and err == "", err


def test_up_and_status_help_explain_every_option():
    wide = {**os.environ, "COLUMNS": "300"}  # argparse wraps help to the terminal
    up = subprocess.run(CLI + ["up", "--help"], capture_output=True, text=True, env=wide, timeout=60, check=True)
    status = subprocess.run(CLI + ["status", "--help"], capture_output=True, text=True, env=wide, timeout=60,
                            check=True)
    top = subprocess.run(CLI + ["--help"], capture_output=True, text=True, env=wide, timeout=60, check=True)
    assert "docs/operations/security.md" in top.stdout + up.stdout
    assert (Path(__file__).parents[2] / "docs" / "operations" / "security.md").is_file()
    assert "README's Security section" not in top.stdout + up.stdout

    def help_of(text: str, option: str) -> str:
        """The help text of ``option`` (argparse may start it on the next line)."""
        (entry,) = [e for e in re.split(r"\n  (?=-)", text) if e.startswith(option + " ")]
        return " ".join(entry.split()[2:])

    assert "address Redis listens on" in help_of(up.stdout, "--host")
    assert "namespace" in help_of(up.stdout, "--namespace") and "TQ_NAMESPACE" in help_of(up.stdout, "--namespace")
    assert "TQ_NAMESPACE" in help_of(status.stdout, "--namespace")
    assert "seconds between refreshes" in help_of(status.stdout, "--interval")
    assert "--allow-empty" in status.stdout


@pytest.mark.parametrize("flavour", ["valkey", "redis7"])
def test_a_wrong_password_is_one_line_without_a_doubled_full_stop(flavour):
    """The server's own sentence ("... or user is disabled.") is quoted without its full stop, so the
    line does not read "disabled.." before what to do."""
    server = EmbeddedServer(password="right-pw-4d2f", binary=server_binary(flavour)).start()
    try:
        wrong = f"redis://:wrong-pw-9c1a@{server.host}:{server.port}/0"
        for command in (["status"], ["namespace", "drop", "x"]):
            out = subprocess.run(CLI + command + ["--redis", wrong], capture_output=True, text=True, timeout=120)
            assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
            (line,) = out.stderr.strip().splitlines()
            assert "refused the credentials" in line and "disabled" in line, line
            assert ".." not in line and "wrong-pw-9c1a" not in line, line
    finally:
        server.stop()
    gone = subprocess.run(CLI + ["namespace", "drop", "x", "--redis", wrong], capture_output=True, text=True,
                          timeout=120)  # the server is gone now
    assert gone.returncode == 1 and "Traceback" not in gone.stderr, gone.stderr
    (line,) = gone.stderr.strip().splitlines()
    assert "cannot reach Redis" in line and "wrong-pw-9c1a" not in line, line
