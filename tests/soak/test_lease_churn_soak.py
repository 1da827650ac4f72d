"""Soak: lease consumers SIGKILLed mid-batch, over and over, for many rounds.

Each round fills a fresh partition and lets a pool of consumer processes drain it with leases
(claim, read and check the bytes, ack). The test kills consumers while they hold a lease -- between
the claim and the ack -- and starts a replacement each time, so the pool keeps churning. Every
sample must be acknowledged exactly once, by its latest delivery, with the right bytes; samples
orphaned by a killed consumer must have been handed out again; nothing may stay leased or be put
aside as poison.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_readable
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis import errors
from tq_redis.meta.keys import PartitionKeys

pytestmark = pytest.mark.soak

ROUNDS = 8
SAMPLES = 480
BATCH = 8
POOL = 8  # consumers alive at any time
KILLS_PER_ROUND = 6
KILL_SPACING = 5  # reported claims between two kills, so the kills spread over the round
LEASE_S = 0.5
TASK = "train"
ROUND_TIMEOUT_S = 90.0


def _pid(r: int) -> str:
    return f"round_{r}"


def _payload(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(1) * 100 + torch.arange(16)


def _lease_consumer(url: str, ns: str, partition: str, seed: int, conn) -> None:
    """Claim with a lease, read and check the bytes, ack; report claims and acks on ``conn``.

    Each claim is reported, at a random point between the claim and the ack (before or after
    reading the bytes), and the consumer then waits for the test's go-ahead: the test may SIGKILL
    it right there, while it holds the lease.
    """
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns, nested_output=False)  # compares dense tensors
    lease_key = PartitionKeys(ns, partition).lease(TASK)
    rng = random.Random(seed)
    while True:
        meta = client.get_meta(["x", "payload"], BATCH, partition, task_name=TASK, lease_s=LEASE_S, timeout=0.3)
        if meta.size == 0:
            if client.check_consumption_status(TASK, partition) and client.redis.zcard(lease_key) == 0:
                break
            continue
        pairs = list(zip(meta.global_indexes, meta.get_extra_info("delivery_counts")))
        read_first = rng.random() < 0.5
        if read_first:
            data = client.get_data(meta)
        conn.send(("claim", pairs))
        conn.recv()  # the go-ahead (or SIGKILL)
        if not read_first:
            data = client.get_data(meta)
        ok = torch.equal(data["payload"], _payload(data["x"])) and data["x"].tolist() == meta.global_indexes
        try:
            client.ack(meta)
            not_held = set()
        except errors.LeaseLost as lost:  # lapsed and handed out again: not acked here
            not_held = set(lost.ids)
        conn.send(("ack", [p for p in pairs if p[0] not in not_held], ok))
    client.close()


@dataclass
class _Consumer:
    """One consumer process of the pool, with what it reported."""

    proc: Any
    conn: Any
    claims: list[list[tuple[int, int]]] = field(default_factory=list)
    acks: list[tuple[int, int]] = field(default_factory=list)
    bad_batches: int = 0


@dataclass
class _Round:
    """A round's pool: starts consumers, kills some while they hold a lease, replaces them."""

    url: str
    ns: str
    partition: str
    ctx: Any = field(default_factory=mp_context)
    live: dict[Any, _Consumer] = field(default_factory=dict)  # conn -> consumer
    finished: list[_Consumer] = field(default_factory=list)
    killed: list[_Consumer] = field(default_factory=list)
    started: int = 0

    def start_one(self) -> None:
        ours, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=_lease_consumer, args=(self.url, self.ns, self.partition, self.started, theirs))
        proc.start()
        theirs.close()  # the consumer holds its end: EOF tells the test it has exited
        self.live[ours] = _Consumer(proc, ours)
        self.started += 1

    def kill(self, consumer: _Consumer) -> None:
        """SIGKILL ``consumer`` (it is waiting for its go-ahead, holding a lease) and replace it."""
        os.kill(consumer.proc.pid, signal.SIGKILL)
        consumer.proc.join(10)
        del self.live[consumer.conn]
        consumer.conn.close()
        self.killed.append(consumer)
        self.start_one()

    def run(self) -> None:
        """Churn until every consumer has exited on its own (the partition is drained).

        Every ``KILL_SPACING``-th reported claim gets its consumer killed instead of a go-ahead,
        until the round's ``KILLS_PER_ROUND`` are done.
        """
        for _ in range(POOL):
            self.start_one()
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        claims = 0
        while self.live:
            assert time.monotonic() < deadline, f"{self.partition} was not drained in {ROUND_TIMEOUT_S:.0f} s"
            for conn in wait_readable(list(self.live), timeout=5):
                consumer = self.live[conn]
                try:
                    message = conn.recv()
                except EOFError:
                    del self.live[conn]
                    conn.close()
                    consumer.proc.join(30)
                    self.finished.append(consumer)
                    continue
                if message[0] == "ack":
                    consumer.acks.extend((int(s), int(d)) for s, d in message[1])
                    consumer.bad_batches += not message[2]
                    continue
                consumer.claims.append([(int(s), int(d)) for s, d in message[1]])
                claims += 1
                if len(self.killed) < KILLS_PER_ROUND and claims % KILL_SPACING == 0:
                    self.kill(consumer)
                else:
                    conn.send("go")


def _check_round(client: Any, pool: _Round) -> None:
    """Every sample acked once, by its latest delivery, with good bytes; orphans were redelivered."""
    assert len(pool.killed) == KILLS_PER_ROUND
    assert all(c.proc.exitcode == -signal.SIGKILL for c in pool.killed)
    assert [c.proc.exitcode for c in pool.finished] == [0] * len(pool.finished)
    everyone = pool.finished + pool.killed
    assert sum(c.bad_batches for c in everyone) == 0, "bytes did not round-trip"
    acked = [pair for c in everyone for pair in c.acks]
    counts = Counter(s for s, _ in acked)
    assert sorted(counts) == list(range(SAMPLES)), "samples lost"
    assert [s for s, c in counts.items() if c > 1] == [], "samples acked twice"
    delivered = dict(acked)
    orphaned = {pair for c in pool.killed for pair in c.claims[-1]}  # deliveries whose holder died
    assert len(orphaned) == KILLS_PER_ROUND * BATCH
    assert all(delivered[s] > d for s, d in orphaned), "an orphaned sample was not handed out again"
    pk = PartitionKeys(client.namespace, pool.partition)
    server_counts = {int(k): int(v) for k, v in client.redis.hgetall(pk.deliveries(TASK)).items()}
    assert server_counts == delivered  # the successful ack was always by the latest delivery
    assert client.redis.zcard(pk.lease(TASK)) == 0
    assert client.redis.scard(pk.poison(TASK)) == 0
    assert client.check_consumption_status(TASK, pool.partition)


def test_lease_consumers_killed_repeatedly_every_sample_acked_exactly_once(real_server, namespace):
    client = make_client(real_server.url, namespace)
    total_killed = 0
    for r in range(ROUNDS):
        x = torch.arange(SAMPLES)
        client.put(TensorDict({"x": x, "payload": _payload(x)}, batch_size=[SAMPLES]), partition_id=_pid(r))
        pool = _Round(real_server.url, namespace, _pid(r))
        try:
            pool.run()
        finally:
            for consumer in pool.live.values():
                consumer.proc.kill()
                consumer.proc.join(10)
        _check_round(client, pool)
        total_killed += len(pool.killed)
        client.clear_partition(_pid(r))
    assert total_killed == ROUNDS * KILLS_PER_ROUND
    assert client.get_partition_list() == []
    client.close()
