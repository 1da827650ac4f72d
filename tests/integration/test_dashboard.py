"""``tq-redis dashboard`` as its own process against a running pipeline, rendered by headless
Chromium (Debian's ``chromium``): the page shows the namespace's partitions, tasks, leases,
waiters and nodes, follows the pipeline as it changes, never sends the Redis password, and a
screenshot is kept as an artifact (its path is printed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis.backends.dram.launcher import start_local_nodes
from tq_redis.server.embedded import EmbeddedServer, free_port

CLI = [sys.executable, "-m", "tq_redis.cli.main"]
PASSWORD = "dash-" + "s3cret-" + "7f1c9e"


def _chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        if os.environ.get("TQ_REQUIRE_CHROMIUM") == "1":  # set by .ci/run
            pytest.fail("chromium is required here (apt-get install chromium)")
        pytest.skip("chromium not installed (apt-get install chromium); CI installs it")
    return binary


def _browser(*args: str, profile: Path) -> str:
    """Run headless Chromium once (``--dump-dom`` or ``--screenshot``); the virtual time budget lets
    the page's script fetch the snapshot and draw before the DOM is dumped."""
    out = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=15000", *args],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _rendered(url: str, profile: Path) -> str:
    dom = _browser("--dump-dom", url, profile=profile)
    assert 'data-refreshed="' in dom, "the page's script never drew a snapshot:\n" + dom[-2000:]
    return dom


def _text(dom: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


def _row(dom: str, first_cell: str) -> list[str]:
    """The cells of the table row whose first cell is ``first_cell``."""
    for row in re.findall(r"<tr>(.*?)</tr>", dom, re.S):
        cells = [_text(c).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.S)]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in the page")


def _until_node_reports(url: str, namespace: str) -> int:
    """Wait (on the node's registration, a state, not a time) until the node reports bytes used; returns them."""
    import time

    from tq_redis.meta.keys import storage_nodes_key
    from tq_redis.server import connections

    r = connections.sync_client(url)
    try:
        deadline = time.monotonic() + 120
        while True:
            used = sum(json.loads(v).get("used", 0) for v in r.hgetall(storage_nodes_key(namespace)).values())
            if used:
                return used
            assert time.monotonic() < deadline, "the storage node never reported its bytes"
            time.sleep(0.05)
    finally:
        r.close()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_dashboard_in_headless_chromium(tmp_path, namespace):
    server = EmbeddedServer(password=PASSWORD).start()
    url = server.url
    assert PASSWORD in url
    nodes = start_local_nodes(url, namespace, n=1, capacity="64MiB")
    client = make_client(url, namespace, "dram", inline_max_bytes=4096)
    other = make_client(url, namespace + "x", inline_max_bytes=4096)
    other.put(TensorDict({"z": torch.arange(2)}, batch_size=[2]), partition_id="other_job")
    proc = subprocess.Popen(CLI + ["dashboard", "--namespace", namespace, "--port", str(free_port()),
                                   "--refresh", "1"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TQ_REDIS_URL": url})
    try:
        line = proc.stdout.readline()
        m = re.search(r"at (http://\S+/)", line)
        assert m, f"tq-redis dashboard printed {line!r}"
        page = m.group(1)
        profile = tmp_path / "chromium"

        # the pipeline: a producer put 8 prompts (and 8 KiB images each: on the storage node), a
        # generator produced responses for 3 of them
        meta = client.put(TensorDict({"prompt": torch.arange(8), "image": torch.zeros(8, 1024, dtype=torch.int64)},
                                     batch_size=[8]), partition_id="step_0")
        client.put(TensorDict({"response": torch.arange(3)}, batch_size=[3]), metadata=meta[0:3])
        client.get_meta(["prompt"], 2, "step_0", task_name="rollout", lease_s=600)
        dom = _rendered(page, profile)
        text = _text(dom)
        assert f"namespace {namespace}" in text and "partition step_0: 8 samples" in text
        assert "other_job" not in text  # another namespace's partition
        assert _row(dom, "prompt")[1] == "8" and _row(dom, "response")[1] == "3"
        rollout = _row(dom, "rollout")  # task, claimable, consumed, progress, leases, redelivered, poison, waiters
        assert rollout[1] == "1" and rollout[2] == "0" and rollout[4] == "2 (0 lapsed)"
        assert "Recent errors" in text and "eviction policy" in text
        node_rows = re.findall(r'<table id="node-table">(.*?)</table>', dom, re.S)
        assert node_rows and "64.0 MiB" in _text(node_rows[0])  # the node, its capacity

        # the pipeline moves on: responses for the rest, the trainer consumes 6
        client.put(TensorDict({"response": torch.arange(5)}, batch_size=[5]), metadata=meta[3:8])
        client.get_meta(["prompt", "response"], 6, "step_0", task_name="train")
        used = _until_node_reports(url, namespace)
        assert used >= 8 * 8192
        dom = _rendered(page, profile)
        assert _row(dom, "response")[1] == "8"
        train = _row(dom, "train")
        assert train[1] == "2" and train[2] == "6" and train[3] == "75.0%"
        assert _row(dom, "rollout")[1] == "6"
        node_cells = _text(re.findall(r'<table id="node-table">(.*?)</table>', dom, re.S)[0])
        assert f" {used / 1024:.1f} KiB 64.0 MiB " in node_cells  # 8 images of 8 KiB on the node, its capacity

        shot = Path(os.environ.get("TQ_TEST_ARTIFACTS", tempfile.gettempdir())) / "tq-redis-dashboard.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        _browser(f"--screenshot={shot}", "--window-size=1280,900", page, profile=profile)
        assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"dashboard screenshot: {shot}")

        # read-only, and the password never reaches the browser
        bodies = [_get(page), _get(page + "api/snapshot"), _get(page + "nope"), _get(page + "index.html")]
        assert [status for status, _ in bodies] == [200, 200, 404, 200]
        request = urllib.request.Request(page + "api/snapshot", data=b"{}", method="POST")
        try:
            urllib.request.urlopen(request, timeout=30)
            raise AssertionError("POST was accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 405
        for _, body in bodies:
            assert PASSWORD not in body
        assert PASSWORD not in dom

        # Redis goes away: the page says "Redis unreachable" and keeps the last snapshot's numbers (a
        # page opened now shows them too: the dashboard kept them), and its errors say what failed,
        # without the password
        assert "Redis unreachable" not in text
        server.stop()
        status, body = _get(page + "api/snapshot")
        assert status == 200 and "reading namespace" in body and PASSWORD not in body
        reply = json.loads(body)
        assert reply["live"] is False and reply["problem"] == "Redis unreachable"
        assert reply["snapshot"]["partitions"][0]["id"] == "step_0" and reply["as_of"] > 0
        dom = _rendered(page, profile)
        text = _text(dom)
        assert "Redis unreachable; showing the last snapshot, taken " in text, text[:2000]
        assert "loading..." not in text and PASSWORD not in dom
        assert "partition step_0: 8 samples" in text and _row(dom, "response")[1] == "8"
        assert _row(dom, "train")[2] == "6" and _row(dom, "train")[3] == "75.0%"
        assert f" {used / 1024:.1f} KiB 64.0 MiB " in _text(re.findall(r'<table id="node-table">(.*?)</table>',
                                                                     dom, re.S)[0])
    finally:
        proc.terminate()
        proc.wait(30)
        client.close()
        other.close()
        nodes.stop()
        server.stop()


def test_the_snapshot_says_unreachable_keeps_the_last_one_and_goes_live_again(namespace):
    """/api/snapshot while Redis is gone: live false, "Redis unreachable", the last snapshot and its
    time; a server back on the same port is read live again at the next request."""
    import json

    from tq_redis.monitor.dashboard import Dashboard

    port = free_port()
    server = EmbeddedServer(port=port).start()
    client = make_client(server.url, namespace)
    client.put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id="p")
    client.close()
    dashboard = Dashboard(server.url, namespace)
    try:
        first = json.loads(dashboard.snapshot_json())
        assert first["live"] and first["problem"] is None and first["snapshot"]["partitions"][0]["samples"] == 3
        server.stop()
        gone = json.loads(dashboard.snapshot_json())
        assert not gone["live"] and gone["problem"] == "Redis unreachable"
        assert gone["snapshot"] == first["snapshot"] and gone["as_of"] == first["as_of"]
        assert "reading namespace" in gone["errors"][-1]["text"]
        server = EmbeddedServer(port=port).start()  # empty: the namespace is gone with the old server
        back = json.loads(dashboard.snapshot_json())
        assert back["live"] and back["snapshot"]["partitions"] == [] and back["as_of"] > first["as_of"]
    finally:
        dashboard.close()
        server.stop()
