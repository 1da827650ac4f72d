"""Soak: a job's life in a couple of minutes: storage nodes join, leave and restart, consumer clocks
differ, while producers and lease consumers stream (issue 30).

Two producer processes insert batches of 16 KiB rows into one partition; three consumer processes
claim with leases, read, check and ack them. Their clocks are shifted by -30 s, 0 and +30 s
(``time.time`` patched, as a host with a wrong clock): leases run on the server's clock, so the
shift must change nothing. Meanwhile the test changes the node set as the job progresses:

1. a third node joins (new writes go to it; earlier values stay where they were put);
2. a node is paused (SIGSTOP) until clients see it as dead, so it leaves the ring, then resumes;
   reads of its values fail meanwhile (the consumer hands the batch back) and succeed after;
3. a node restarts under a new id: its memory, and the values in it, are gone; a consumer that
   reads one gets ``DataMissing`` naming that node, and acks the batch as lost with it.

Then every sample must have been acked exactly once (read with the right bytes, or lost with the
restarted node and nothing else), no lease may be left, and after the final clear no node holds a
byte and no key of the partition is left but its id counter.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.procs import mp_context
from tests.soak.helpers import await_nodes_empty, leftover_keys, use_store
from tq_redis import TransferQueueClient
from tq_redis.backends.dram.launcher import spawn_node
from tq_redis.meta.keys import PartitionKeys, pending_nodes_key

pytestmark = pytest.mark.soak

PARTITION = "stream"
TASK = "train"
PRODUCERS = 2
BATCHES = 40  # per producer
BATCH = 8
WIDTH = 2048  # int64 per row: 16 KiB values, kept on the storage nodes
SHIFTS = (-30.0, 0.0, 30.0)  # the consumers' clocks
LEASE_S = 2.0
DEAD_AFTER_S = 1.0
STORE = {"dead_after_s": DEAD_AFTER_S, "timeout_s": 1.0, "refresh_s": 0.2}
NODE_ARGS = ("--heartbeat-s", "0.2")  # well inside DEAD_AFTER_S, however busy the host
TOTAL = PRODUCERS * BATCHES * BATCH
RUN_TIMEOUT_S = 150.0
# the stages' own work per batch (rollout, training): the stream lasts long enough for the node
# set to change under it (a pace, not synchronisation: nothing waits on it)
PRODUCE_S = 0.1
CONSUME_S = 0.3  # slower than the producers: a backlog on every node when it changes
PAUSE_S = 2.0  # how long the paused node stays away once clients see it as dead


def _rows(tags: torch.Tensor) -> torch.Tensor:
    return tags.unsqueeze(1) * WIDTH + torch.arange(WIDTH)


def _producer(url: str, ns: str, which: int, out) -> None:
    from tq_redis import TransferQueueClient
    from tq_redis.errors import StorageUnavailable

    client = TransferQueueClient(url, ns)
    retries = 0
    for b in range(BATCHES):
        tags = torch.arange(BATCH) + (which * BATCHES + b) * BATCH
        while True:  # a put that met a node going away left nothing visible: put it again
            try:
                meta = client.put(TensorDict({"tag": tags, "row": _rows(tags)}, batch_size=[BATCH]),
                                  partition_id=PARTITION)
                break
            except StorageUnavailable:
                retries += 1
        out.put(("put", list(meta.global_indexes), tags.tolist()))
        time.sleep(PRODUCE_S)  # generating the next batch
    out.put(("producer-done", retries))
    client.close()


def _consumer(url: str, ns: str, shift_s: float, acked, out) -> None:
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + shift_s  # this host's clock is wrong by shift_s
    time.time_ns = lambda: real_time_ns() + int(shift_s * 1e9)
    from tq_redis import TransferQueueClient
    from tq_redis.errors import DataMissing, LeaseLost, StorageUnavailable

    client = TransferQueueClient(url, ns, nested_output=False)
    pk = PartitionKeys(ns, PARTITION)
    handed_back = 0
    while True:
        meta = client.get_meta(["tag", "row"], BATCH, PARTITION, task_name=TASK, lease_s=LEASE_S, timeout=0.5)
        if meta.size == 0:
            sealed = client.redis.hexists(pk.meta, "sealed")
            if sealed and client.check_consumption_status(TASK, PARTITION) and client.redis.zcard(pk.lease(TASK)) == 0:
                break
            continue
        ids = list(meta.global_indexes)
        try:
            data = client.get_data(meta)
        except StorageUnavailable:  # its node is paused: hand the batch back for later
            client.nack(meta)
            handed_back += 1
            continue
        except DataMissing as missing:  # its node restarted: the values are gone with it
            report = ("lost", ids, str(missing))
        else:
            ok = torch.equal(data["row"], _rows(data["tag"]))
            report = ("read", ids, data["tag"].tolist(), ok)
            time.sleep(CONSUME_S)  # training on it
        try:
            client.ack(meta)
        except LeaseLost as lost:  # it lapsed and went to another consumer: that one acks it
            kept = set(lost.ids)
            report = (report[0], [i for i in ids if i not in kept], *report[2:])
        with acked.get_lock():
            acked.value += len(report[1])
        out.put(report)
    out.put(("consumer-done", handed_back))
    client.close()


def _looks_dead(r, ns: str, node_id: str) -> bool:
    raw = r.hget(f"{ns}:storage:nodes", node_id)
    if raw is None:
        return True
    sec, usec = r.time()
    return sec + usec / 1e6 - json.loads(raw)["heartbeat"] > DEAD_AFTER_S


def _churn(url: str, ns: str, nodes: dict[str, Any], acked, log: list[str], stop: threading.Event) -> None:
    """Change the node set as the consumers progress: join, pause (leave and come back), restart."""
    import redis

    r = redis.Redis.from_url(url)

    def at(share: float) -> bool:
        while acked.value < share * TOTAL:
            if stop.wait(0.05):
                return False
        return True

    if not at(0.05):
        return
    nodes["n2"] = spawn_node(url, ns, capacity="256MiB", node_id="n2", extra_args=NODE_ARGS)
    log.append("n2 joined")
    if not at(0.25):
        return
    paused = nodes["n1"]
    os.kill(paused.proc.pid, signal.SIGSTOP)
    while not _looks_dead(r, ns, "n1") and not stop.wait(0.05):
        pass
    log.append("n1 left (paused)")
    stop.wait(PAUSE_S)  # the job runs on without it a while
    os.kill(paused.proc.pid, signal.SIGCONT)
    log.append("n1 back")
    if not at(0.50):
        return
    nodes.pop("n0").stop()  # its memory goes with it
    nodes["n0b"] = spawn_node(url, ns, capacity="256MiB", node_id="n0b", extra_args=NODE_ARGS)
    log.append("n0 restarted as n0b")
    r.close()


def test_nodes_join_leave_and_restart_while_skewed_lease_consumers_stream(real_server, namespace):
    url, ns = real_server.url, namespace
    use_store(url, ns, "dram", STORE)
    nodes = {name: spawn_node(url, ns, capacity="256MiB", node_id=name, extra_args=NODE_ARGS) for name in ("n0", "n1")}
    ctx = mp_context()
    out, acked = ctx.Queue(), ctx.Value("q", 0)
    producers = [ctx.Process(target=_producer, args=(url, ns, i, out)) for i in range(PRODUCERS)]
    consumers = [ctx.Process(target=_consumer, args=(url, ns, s, acked, out)) for s in SHIFTS]
    client = TransferQueueClient(url, ns)  # (make_client would record the redis store)
    stop, log = threading.Event(), []
    churn = threading.Thread(target=_churn, args=(url, ns, nodes, acked, log, stop))
    puts, reads, lost, done = {}, [], [], Counter()
    try:
        for p in producers + consumers:
            p.start()
        churn.start()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while done["consumer-done"] < len(consumers):
            assert time.monotonic() < deadline, f"the job did not finish in {RUN_TIMEOUT_S:.0f} s ({log})"
            try:
                msg = out.get(timeout=5)
            except Exception:  # noqa: BLE001 - queue.Empty: check the deadline and the processes
                assert all(p.exitcode in (None, 0) for p in producers + consumers), "a job process failed"
                continue
            kind = msg[0]
            if kind == "put":
                puts.update(zip(msg[1], msg[2]))
            elif kind == "read":
                reads.append(msg)
            elif kind == "lost":
                lost.append(msg)
            else:
                done[kind] += 1
                done["retries" if kind == "producer-done" else "handed_back"] += msg[1]
                if kind == "producer-done" and done[kind] == PRODUCERS:
                    churn.join(RUN_TIMEOUT_S)  # the node set is final before the partition is sealed
                    client.seal_partition(PARTITION)
        for p in producers + consumers:
            p.join(30)
            assert p.exitcode == 0
    finally:
        stop.set()
        for p in producers + consumers:
            if p.is_alive():
                p.kill()
        churn.join(30)
        for node in nodes.values():
            if node.proc.poll() is None:
                os.kill(node.proc.pid, signal.SIGCONT)

    assert log == ["n2 joined", "n1 left (paused)", "n1 back", "n0 restarted as n0b"]
    print(f"{TOTAL} samples: {sum(len(m[1]) for m in reads)} read, {sum(len(m[1]) for m in lost)} lost with n0; "
          f"{done['handed_back']} batch(es) handed back while n1 was paused; {done['retries']} put(s) retried")
    assert len(puts) == TOTAL and sorted(puts.values()) == list(range(TOTAL))
    acks = Counter(i for msg in reads + lost for i in msg[1])
    assert sorted(acks) == sorted(puts), "a sample was never acked"
    assert [i for i, n in acks.items() if n > 1] == [], "a sample was acked twice"
    assert all(msg[3] for msg in reads), "a consumer read different bytes than were put"
    assert all(msg[2] == [puts[i] for i in msg[1]] for msg in reads)
    assert all("'n0'" in msg[2] for msg in lost), [msg[2] for msg in lost]  # lost only with n0
    pk = PartitionKeys(ns, PARTITION)
    assert client.redis.zcard(pk.lease(TASK)) == 0
    assert client.check_consumption_status(TASK, PARTITION)

    client.clear_partition(PARTITION)
    try:
        stats = await_nodes_empty(url, ns)
        assert sorted(stats) == ["n0b", "n1", "n2"]
        assert client.redis.scard(pending_nodes_key(ns)) == 0
        assert leftover_keys(url, ns, [PARTITION]) == set()
    finally:
        client.close()
        for node in nodes.values():
            node.stop()
