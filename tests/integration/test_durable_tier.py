"""The durable tier (``storage.durable``): every store value is also written to an fsspec URL, reads
fall back to it when the node that held a value is gone, and clears delete it there too.

Real DRAM storage-node processes, real Valkey 9 and Redis 7.0 (with AOF for the whole-job kill),
producer processes SIGKILLed mid-stream, a moto S3 server for the object-store case.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import aof_server, make_client
from tests.procs import mp_context
from tq_redis import TransferQueueClient
from tq_redis.backends.dram.launcher import spawn_node
from tq_redis.errors import BackendNotInstalled, ConfigError, StorageError, StorageUnavailable
from tq_redis.meta.keys import config_key
from tq_redis.server.embedded import free_port

WIDTH = 1024  # int64 per row: 8 KiB values, past inline_max_bytes, so every value goes to the store
S3_CREDENTIALS = {"key": "testing", "secret": "testing"}


def _rows(seed: int, n: int) -> TensorDict:
    """``n`` rows whose bytes follow from ``who`` (so a reader can check every byte)."""
    who = torch.arange(seed, seed + n, dtype=torch.int64)
    return TensorDict({"who": who, "x": _expected(who)}, batch_size=[n])


def _expected(who: torch.Tensor) -> torch.Tensor:
    return who.unsqueeze(1) * 7919 + torch.arange(WIDTH, dtype=torch.int64)


def _files(root: Path) -> list[Path]:
    """Every file under ``root`` (values and any temporary file a write left)."""
    return [p for p in root.rglob("*") if p.is_file()]


def _client(url: str, ns: str, durable: dict):
    """A client of ``ns`` whose values go to the DRAM nodes and to the durable tier ``durable``."""
    client = make_client(url, ns)
    spec = {"backend": "dram", "options": {"refresh_s": 0.0}, "inline_max_bytes": 4096, "durable": durable}
    client.redis.hset(config_key(ns), "storage", json.dumps(spec))
    return client


@pytest.fixture
def nodes(real_server, namespace):
    """Spawn storage nodes of ``namespace`` on demand (stopped at the end)."""
    spawned = []

    def spawn(node_id: str, url: str | None = None):
        node = spawn_node(url or real_server.url, namespace, capacity="64MiB", node_id=node_id)
        spawned.append(node)
        return node

    yield spawn
    for node in spawned:
        node.stop()


def _kill(node) -> None:
    node.proc.kill()
    node.proc.wait()


def test_every_value_is_written_through_and_cleared_with_its_samples(real_server, namespace, nodes, tmp_path):
    nodes("n1")
    nodes("n2")
    root = tmp_path / "durable"
    client = _client(real_server.url, namespace, {"url": f"file://{root}"})
    try:
        meta = client.put(_rows(0, 16), partition_id="p")
        assert len(_files(root)) == 16 * 2, "each value (2 fields x 16 samples) is written through"
        client.clear_samples(meta.select_samples(list(range(4))))
        assert len(_files(root)) == 12 * 2
        rewritten = client.put(TensorDict({"x": _expected(torch.arange(100, 112))}, batch_size=[12]),
                               metadata=meta.select_samples(list(range(4, 16))).select_fields(["x"]))
        data = client.get_data(rewritten)
        assert torch.equal(data["x"], _expected(torch.arange(100, 112)))
        client.clear_partition("p")
        assert _files(root) == [], "a cleared partition leaves no durable file behind"
        assert list(root.iterdir()) == [], "nor its (empty) directory"
    finally:
        client.close()


def test_get_data_falls_back_to_the_tier_when_the_holding_nodes_are_gone(real_server, namespace, nodes, tmp_path):
    n1, n2 = nodes("n1"), nodes("n2")
    root = tmp_path / "durable"
    client = _client(real_server.url, namespace, {"url": str(root)})
    try:
        meta = client.put(_rows(0, 32), partition_id="p")
        _kill(n1)
        _kill(n2)
        nodes("n3")  # a fresh node with none of the values
        data = client.get_data(meta)
        assert torch.equal(data["x"], _expected(data["who"])) and data["who"].tolist() == list(range(32))
        # a reader in another client, which never saw the dead nodes alive, reads them too
        other = TransferQueueClient(real_server.url, namespace, nested_output=False)  # the recorded store
        try:
            again = other.get_data(other.get_meta(["who", "x"], 32, "p", mode="force_fetch"))
            assert torch.equal(again["x"], _expected(torch.arange(32)))
        finally:
            other.close()
        client.clear_partition("p")
        assert _files(root) == []
    finally:
        client.close()


def test_without_the_tier_a_dead_node_is_still_reported(real_server, namespace, nodes):
    """The fallback is the tier's: a namespace without one still says which values are gone."""
    nodes("n1")
    n2 = nodes("n2")
    client = make_client(real_server.url, namespace)
    spec = {"backend": "dram", "options": {"refresh_s": 0.0, "dead_after_s": 0.5}, "inline_max_bytes": 0}
    client.redis.hset(config_key(namespace), "storage", json.dumps(spec))
    try:
        meta = client.put(_rows(0, 32), partition_id="p")
        _kill(n2)
        reader = TransferQueueClient(real_server.url, namespace, nested_output=False)
        with pytest.raises((StorageError, KeyError)):
            reader.get_data(meta)
        reader.close()
    finally:
        client.close()


# ------------------------------------------------------------------ bad URLs, unreachable tiers


@pytest.mark.parametrize(
    ("durable", "error", "says"),
    [
        (42, ConfigError, "fsspec URL"),
        ("relative/dir", ConfigError, "absolute path"),
        ({"url": "file:///tmp/x", "fsync": True}, ConfigError, "not ['fsync']"),
        ({"url": ""}, ConfigError, "needs a url"),
        ("nosuchprotocol://bucket/x", ConfigError, "cannot open"),
    ],
)
def test_a_bad_durable_setting_is_refused_by_init(valkey, namespace, durable, error, says):
    import tq_redis as tq

    with pytest.raises(error) as caught:
        tq.init({"redis": {"url": valkey.url}, "namespace": namespace, "storage": {"durable": durable}})
    assert says in str(caught.value)
    with pytest.raises(tq.api.system.NotInitialized):
        tq.get_client()


def test_an_unwritable_directory_is_refused_by_init(valkey, namespace, tmp_path):
    import tq_redis as tq

    blocked = tmp_path / "file"
    blocked.write_bytes(b"not a directory")
    with pytest.raises((ConfigError, StorageError)) as caught:
        tq.init({"redis": {"url": valkey.url}, "namespace": namespace, "storage": {"durable": f"file://{blocked}/x"}})
    assert "durable" in str(caught.value) or "directory" in str(caught.value)


def test_init_records_the_tier_and_a_put_writes_through_it(valkey, namespace, tmp_path):
    import tq_redis as tq

    root = tmp_path / "tier"
    cfg = tq.init({"redis": {"url": valkey.url}, "namespace": namespace,
                   "storage": {"backend": "redis", "durable": f"file://{root}", "inline_max_bytes": 0}})
    try:
        assert cfg["storage"]["durable"] == {"url": f"file://{root}", "storage_options": {}}
        meta = tq.get_client().put(_rows(0, 4), partition_id="p")
        assert len(_files(root)) == 8
        tq.get_client().clear_partition("p")
        assert _files(root) == []
        assert meta.size == 4
    finally:
        tq.close()


# ------------------------------------------------------------------ S3 (moto)


@pytest.fixture(scope="module")
def moto_s3():
    """A moto S3 server on loopback (its own process); yields its endpoint URL."""
    pytest.importorskip("moto.server")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the moto S3 server did not start"
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def _bucket(endpoint: str) -> str:
    import boto3

    name = f"tq-durable-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=name)
    return name


def _objects(endpoint: str, bucket: str) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]


def test_an_s3_tier_keeps_the_values_of_dead_nodes(real_server, namespace, nodes, moto_s3):
    bucket = _bucket(moto_s3)
    # s3fs gets no region_name: against moto it makes requests fail
    durable = {"url": f"s3://{bucket}/job", "storage_options": {"endpoint_url": moto_s3, **S3_CREDENTIALS}}
    n1 = nodes("n1")
    client = _client(real_server.url, namespace, durable)
    try:
        meta = client.put(_rows(0, 24), partition_id="p")
        assert len(_objects(moto_s3, bucket)) == 48
        _kill(n1)
        nodes("n2")
        data = client.get_data(meta)
        assert torch.equal(data["x"], _expected(torch.arange(24)))
        client.clear_partition("p")
        assert _objects(moto_s3, bucket) == []
    finally:
        client.close()


def test_an_s3_tier_that_cannot_be_written_is_refused(valkey, namespace, moto_s3):
    import tq_redis as tq

    options = {"endpoint_url": moto_s3, **S3_CREDENTIALS}
    with pytest.raises(StorageError) as caught:
        tq.init({"redis": {"url": valkey.url}, "namespace": namespace,
                 "storage": {"durable": {"url": "s3://no-such-bucket/x", "storage_options": options}}})
    assert "no-such-bucket" in str(caught.value) and "bucket" in str(caught.value)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises((StorageUnavailable, StorageError, BackendNotInstalled)) as caught:
        tq.init({"redis": {"url": valkey.url}, "namespace": namespace, "storage": {"durable": {
            "url": "s3://b/x", "storage_options": {"endpoint_url": closed, **S3_CREDENTIALS,
                                                   "config_kwargs": {"retries": {"max_attempts": 1}}}}}})
    assert "durable tier" in str(caught.value)


# ------------------------------------------------------------------ the whole job killed and resumed


def _producer(url: str, ns: str, durable: str, who: int, log_path: str, go) -> None:
    """Put batches of 8 rows until killed, appending each committed batch (put returned) to ``log_path``."""
    import tq_redis as tq

    tq.init({"redis": {"url": url}, "namespace": ns,
             "storage": {"backend": "dram", "options": {"refresh_s": 0.0}, "durable": durable}})
    client = tq.get_client()
    go.wait(60)
    with open(log_path, "a") as log:
        for batch in range(10_000):
            seed = who * 1_000_000 + batch * 8
            meta = client.put(_rows(seed, 8), partition_id="p")
            log.write(json.dumps({"ids": meta.global_indexes, "seed": seed}) + "\n")
            log.flush()


def _committed(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # a torn last line was not committed


def _reader(url: str, ns: str, out) -> None:
    """A process of the restarted job: read every produced sample, check its bytes, clear."""
    import tq_redis as tq

    tq.init({"redis": {"url": url}, "namespace": ns})  # attaches: the namespace's recorded store and tier
    client = tq.get_client()
    meta = client.get_meta(["who", "x"], 1, "p", mode="force_fetch")
    everything = client.get_meta(["who", "x"], meta.size if meta.size else 1, "p", mode="force_fetch")
    data = client.get_data(everything)
    who = data["who"]
    wrong = int((~torch.all(data["x"] == _expected(who), dim=1)).sum())
    out.put({"ids": everything.global_indexes, "who": who.tolist(), "wrong": wrong})
    client.clear_partition("p")
    tq.close()


@pytest.mark.parametrize("flavour", ["valkey", "redis7"])
def test_a_job_killed_whole_resumes_with_every_committed_sample(flavour, namespace, tmp_path):
    """Producers (two processes), both storage nodes and Redis are SIGKILLed mid-stream; Redis
    restarts from its AOF, new nodes start, and a new process reads every committed sample
    byte-exactly from the durable tier; its final clear leaves no durable file."""
    data_dir, root = tmp_path / "redis", tmp_path / "durable"
    data_dir.mkdir()
    server = aof_server(flavour, data_dir)
    ctx = mp_context()
    go = ctx.Event()
    old_nodes = [spawn_node(server.url, namespace, capacity="64MiB", node_id=f"old{i}") for i in range(2)]
    logs = [tmp_path / f"producer{i}.log" for i in range(2)]
    producers = [ctx.Process(target=_producer, args=(server.url, namespace, f"file://{root}", i, str(logs[i]), go))
                 for i in range(2)]
    restarted = None
    new_nodes = []
    try:
        for p in producers:
            p.start()
        go.set()
        deadline = time.monotonic() + 120
        while not all(len(_committed(log)) >= 4 for log in logs):
            assert all(p.is_alive() for p in producers), "a producer died before it was killed"
            assert time.monotonic() < deadline, "the producers did not commit 4 batches each within 120 s"
            time.sleep(0.02)
        for p in producers:  # the whole job, mid-stream
            os.kill(p.pid, signal.SIGKILL)
        for node in old_nodes:
            _kill(node)
        server.kill()
        for p in producers:
            p.join(10)
        committed = {i: entry["seed"] + k for log in logs for entry in _committed(log)
                     for k, i in enumerate(entry["ids"])}
        restarted = aof_server(flavour, data_dir, port=server.port)
        new_nodes = [spawn_node(restarted.url, namespace, capacity="64MiB", node_id=f"new{i}") for i in range(2)]
        out = ctx.Queue()
        reader = ctx.Process(target=_reader, args=(restarted.url, namespace, out))
        reader.start()
        result = out.get(timeout=120)
        reader.join(60)
        assert reader.exitcode == 0
        found = dict(zip(result["ids"], result["who"]))
        lost = [i for i in committed if i not in found]
        assert not lost, f"{len(lost)} of {len(committed)} committed samples were lost: {lost[:10]}"
        assert all(found[i] == who for i, who in committed.items()), "a committed sample came back as another"
        assert result["wrong"] == 0, f"{result['wrong']} samples came back with other bytes"
        assert len(found) >= len(committed) >= 2 * 4 * 8
        assert _files(root) == [], "the final clear left durable files behind"
    finally:
        for p in producers:
            if p.is_alive():
                p.kill()
        for node in old_nodes + new_nodes:
            node.stop()
        (restarted or server).stop()


# ------------------------------------------------------------------ the CLI


CLI = [sys.executable, "-m", "tq_redis.cli.main"]


def test_up_with_durable_records_the_tier_for_every_rank(tmp_path):
    from tests.procs import up_attach

    root = tmp_path / "tier"
    proc = subprocess.Popen(CLI + ["up", "--units", "1", "--capacity", "64MiB", "--namespace", "durns",
                                   "--durable", f"file://{root}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _, url = up_attach(proc)
        client = TransferQueueClient(url, "durns", nested_output=False)
        meta = client.put(_rows(0, 4), partition_id="p")
        assert len(_files(root)) == 8
        assert torch.equal(client.get_data(meta)["x"], _expected(torch.arange(4)))
        client.clear_partition("p")
        assert _files(root) == []
        client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_up_refuses_a_bad_durable_url_before_starting_anything():
    done = subprocess.run(CLI + ["up", "--units", "1", "--durable", "relative/dir"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--durable" in done.stderr and "absolute path" in done.stderr


def test_values_a_killed_put_never_made_visible_go_with_the_partition(real_server, namespace, nodes, tmp_path):
    """A producer SIGKILLed after its bytes were written but before its insert: no bit points at
    them, and the partition's clear still deletes them from the tier (ids below its sequence)."""
    from tq_redis import ops

    nodes("n1")
    root = tmp_path / "durable"
    client = _client(real_server.url, namespace, {"url": f"file://{root}"})
    try:
        client.put(_rows(0, 4), partition_id="p")
        store = client.run(ops.storage(client.context))
        pk = client.context.keys("p")
        end = client.redis.incrby(pk.seq, 3)  # what reserve.lua does; the insert never comes
        orphans = list(range(end - 3, end))
        store.put(pk, orphans, {"x": [[b"\x01" * 8192]] * 3})
        assert len(_files(root)) == 4 * 2 + 3
        client.clear_partition("p")
        assert _files(root) == []
        later = client.put(_rows(10, 2), partition_id="p")  # the partition again: new ids, kept
        assert later.global_indexes == [end, end + 1] and len(_files(root)) == 4
        client.clear_partition("p")
        assert _files(root) == []
    finally:
        client.close()
