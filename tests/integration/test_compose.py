"""docker-compose.yml is real: each service's command runs natively here, on loopback.

No Docker engine runs on this machine, so the test reads the compose file, interpolates the
variables it needs (``${VAR:?message}`` as compose does), maps service host names and ports to
loopback ones, and starts every service's command as a local process: Valkey with AOF and a
password (the bundled binary stands in for the image), the one-shot setup (library and the
namespace's ACL users) and the storage nodes through the installed ``tq-redis`` CLI, then the
example rank, which must finish its round trip through the nodes as the namespace's user, and
``tq-redis status`` as the rank would run it. The compose file must be secure by default: passwords
that must be set, one user per role of the namespace, no token shared across namespaces, no
published Valkey port, a never-evicting Valkey.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from tq_redis.server.embedded import free_port, valkey_binary

ROOT = Path(__file__).parents[2]


SECRETS = {"REDIS_PASSWORD": "compose-test-password", "TQ_CLIENT_PASSWORD": "compose-client-pw",
           "TQ_NODE_PASSWORD": "compose-node-pw"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::([?-])([^}]*))?\}")


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?message}`` (the last fails when unset)."""

    def one(m: re.Match) -> str:
        name, kind, rest = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if kind == "?":
            raise ValueError(f"{name}: {rest}")
        return rest if kind == "-" else ""

    return _VARIABLE.sub(one, text).replace("$$", "$")


def _translate(args: list[str], mapping: dict[str, str]) -> list[str]:
    out = []
    for a in args:
        a = _interpolate(a, SECRETS)
        for old, new in mapping.items():
            a = a.replace(old, new)
        out.append(a)
    return out


def test_compose_is_secure_by_default():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    valkey = services["valkey"]
    assert "ports" not in valkey, "Valkey must not publish its port by default"
    command = valkey["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    with pytest.raises(ValueError, match="REDIS_PASSWORD"):  # compose refuses to start without it
        _interpolate(command[command.index("--requirepass") + 1], {})
    urls = {name: services[name]["environment"]["TQ_REDIS_URL"] for name in ("setup", "storage-0", "storage-1",
                                                                              "rank")}  # fmt: skip
    users = {name: redis.connection.parse_url(_interpolate(url, SECRETS)).get("username")
             for name, url in urls.items()}  # fmt: skip
    assert users == {"setup": None, "storage-0": "tq-tq-node", "storage-1": "tq-tq-node", "rank": "tq-tq"}
    needs = (("setup", "REDIS_PASSWORD"), ("storage-0", "TQ_NODE_PASSWORD"), ("rank", "TQ_CLIENT_PASSWORD"))
    for name, needed in needs:
        with pytest.raises(ValueError, match=needed):
            _interpolate(urls[name], {})
    text = (ROOT / "docker-compose.yml").read_text()
    assert "TQ_STORAGE_TOKEN" not in text, "no node token shared across namespaces"
    for name in ("storage-0", "storage-1"):  # the URL (its password) never on a command line
        assert "--redis" not in services[name]["command"]
    assert services["rank"]["environment"]["TQ_REDIS_LOAD_LIBRARY"] == "never"


def test_compose_services_run_natively(tmp_path):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"valkey", "setup", "storage-0", "storage-1", "rank", "exporter", "dashboard",
                             "prometheus", "grafana"}
    assert "valkey-data" in compose["volumes"]
    assert "--appendonly" in services["valkey"]["command"]

    redis_port = free_port()
    mapping = {"valkey:6379": f"127.0.0.1:{redis_port}", "/data": str(tmp_path)}
    for name in ("storage-0", "storage-1"):
        cmd = services[name]["command"]
        port = cmd[cmd.index("--listen") + 1].rsplit(":", 1)[1]
        local = free_port()
        mapping[f"0.0.0.0:{port}"] = f"127.0.0.1:{local}"
        mapping[f"{name}:{port}"] = f"127.0.0.1:{local}"

    procs: list[subprocess.Popen] = []
    bin_dir = Path(sys.executable).parent
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"  # `tq-redis` as the image has it
    try:
        valkey_cmd = _translate(services["valkey"]["command"], mapping)
        assert valkey_cmd[0] == "valkey-server"
        valkey_cmd = [valkey_binary(), *valkey_cmd[1:], "--port", str(redis_port), "--bind", "127.0.0.1"]
        procs.append(subprocess.Popen(valkey_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        r = redis.Redis(port=redis_port, socket_connect_timeout=0.2, password=SECRETS["REDIS_PASSWORD"])
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.AuthenticationError:
                raise
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "valkey from the compose command did not start"
                time.sleep(0.02)  # waiting for an external process to open its port
        assert r.config_get("appendonly")["appendonly"] == "yes"
        with pytest.raises(redis.AuthenticationError):  # no password, no access
            redis.Redis(port=redis_port).ping()

        setup = services["setup"]
        assert setup["command"][:2] == ["sh", "-c"]
        setup_env = {k: _translate([str(v)], mapping)[0] for k, v in setup["environment"].items()}
        done = subprocess.run(_translate(setup["command"], mapping), env=dict(os.environ, **setup_env, PATH=path),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert SECRETS["TQ_CLIENT_PASSWORD"] not in done.stdout + done.stderr
        assert {"tq-tq", "tq-tq-node"} <= {u if isinstance(u, str) else u.decode() for u in r.acl_users()}

        for name in ("storage-0", "storage-1"):
            cmd = _translate(services[name]["command"], mapping)
            assert cmd[0] == "tq-redis"
            cmd = [str(bin_dir / "tq-redis"), *cmd[1:], "--capacity", "256MiB"]
            node_env = {k: _translate([str(v)], mapping)[0] for k, v in services[name]["environment"].items()}
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, **node_env)))
        deadline = time.monotonic() + 60
        while len(r.hgetall("tq:storage:nodes")) < 2:
            assert time.monotonic() < deadline, "storage nodes from the compose commands did not register"
            assert all(p.poll() is None for p in procs), "a compose service exited early"
            time.sleep(0.05)  # waiting for external processes to register
        registrations = [json.loads(v) for v in r.hgetall("tq:storage:nodes").values()]
        assert all(len(info["access"]) >= 40 for info in registrations), "each node needs its access key"

        rank = services["rank"]
        env = dict(os.environ, **{k: _translate([str(v)], mapping)[0] for k, v in rank["environment"].items()})
        cmd = _translate(rank["command"], mapping)
        assert cmd[0] == "python"
        out = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        assert "attach_rank OK: 256 samples" in out.stdout
        assert SECRETS["TQ_CLIENT_PASSWORD"] not in out.stdout + out.stderr
        status = subprocess.run([str(bin_dir / "tq-redis"), "status"], env=env, capture_output=True, text=True,
                                timeout=120)  # what the README runs with `docker compose run --rm rank`
        assert status.returncode == 0 and "storage nodes: 2" in status.stdout, status.stdout + status.stderr
        assert not any(info["access"] in status.stdout for info in registrations)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_dockerfile_copies_what_the_package_needs():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    copied = {line.split()[1] for line in lines if line.startswith("COPY ")} | {
        part for line in lines if line.startswith("COPY ") for part in line.split()[1:-1]
    }
    for needed in ("tq_redis", "pyproject.toml", "setup.py", "examples"):
        assert needed in copied, f"Dockerfile does not copy {needed}"
        assert (ROOT / needed).exists()
    assert any("torch==2.13.0" in line for line in lines)


def test_compose_provisions_the_operators_view():
    """The exporter and the live page log in as the namespace's user (URL in the environment), and
    Grafana gets the dashboard and the Prometheus data source from files in deploy/."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, sub in (("exporter", "exporter"), ("dashboard", "dashboard")):
        cmd = services[name]["command"]
        assert cmd[:2] == ["tq-redis", sub] and "--redis" not in cmd
        assert services[name]["environment"]["TQ_REDIS_URL"].startswith("redis://tq-tq:")
    assert services["dashboard"]["ports"] == ["127.0.0.1:8265:8265"]
    assert services["grafana"]["ports"] == ["127.0.0.1:3000:3000"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./deploy/grafana"] == "/var/lib/grafana/dashboards"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/tq-redis.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert (ROOT / "deploy/grafana/tq-redis-dashboard.json").exists()
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == ["exporter:9464"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
