"""Soak at scale on a 3-master Redis Cluster: 128 independent rank processes, 12 partitions spread
over the 3 shards, two tasks, leases and acks, ranks SIGKILLed while they hold a lease.

A producer process inserts the samples into every partition in rounds and seals them. Rank
processes, started in waves so that at most ``CONCURRENCY`` run at once on this 2-core machine,
each attach through one node's URL with nothing but that URL and the namespace, and claim leased
batches for their task from the partitions in their own order: read and check the bytes, then ack.
Most ranks do ``QUOTA`` batches and leave (a job's short-lived workers); the last wave stays until
the task is drained. Every claim is reported to the test before it is acked, and the rank waits
for the go-ahead: the test SIGKILLs some ranks right there (their leases lapse and the samples are
handed out again) and tells others to nack (hand the batch back at once).

At the end, from the ranks' records and the servers' own state: for each task every sample was
acked exactly once, by its latest delivery, with the right bytes; every delivery the servers
counted was handed to exactly one rank; orphaned and nacked deliveries were handed out again;
nothing is left leased or put aside as poison; and every shard served claims.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_readable
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.cluster import cluster  # noqa: F401  (the session's 3-master cluster fixture)
from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis import errors
from tq_redis.meta.keys import PartitionKeys

pytestmark = pytest.mark.soak

PARTITIONS = tuple(f"p{i}" for i in range(12))  # 3 on one shard, 3 on another, 6 on the third
TASKS = ("reward", "train")
SAMPLES = 64  # per partition
PUT_CHUNK = 16  # the producer's insert size: 4 rounds over every partition
BATCH = 4
FIELDS = ["x", "payload"]
RANKS = 128
CONCURRENCY = 12  # rank processes alive at once
QUOTA = 2  # batches a rank of the early waves does before leaving
KILL_EVERY = 9  # ranks 4, 13, 22, ... (both tasks) are SIGKILLed at their first claim, holding the lease
NACK_EVERY = 15  # ranks 7, 22, 37, ... (both tasks) hand their first batch back (nack), unless killed
LEASE_S = 2.0
WAIT_S = 1.0  # a rank's longest single get_meta wait before it looks at the other partitions
DEADLINE_S = 200.0


def _payload(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(1) * 100 + torch.arange(8)


def _victim(rank: int) -> bool:
    return rank % KILL_EVERY == 4 and rank < RANKS - CONCURRENCY


def _nacker(rank: int) -> bool:
    return rank % NACK_EVERY == 7 and rank < RANKS - CONCURRENCY and not _victim(rank)


# ------------------------------------------------------------------ the processes


def _producer(url: str, ns: str) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    for start in range(0, SAMPLES, PUT_CHUNK):
        for k, p in enumerate(PARTITIONS):
            x = torch.arange(start, start + PUT_CHUNK) + 1000 * k
            client.put(TensorDict({"x": x, "payload": _payload(x)}, batch_size=[PUT_CHUNK]), partition_id=p)
    for p in PARTITIONS:
        client.seal_partition(p)
    client.close()


def _claim(client: Any, task: str, order: list[str], drained: set[str]) -> tuple[str, Any] | None:
    """A leased batch from the first partition that has one ready; else wait on one still pending.

    None once the task has drained every partition (sealed, and every sample acked).
    """
    from tq_redis.ops import streaming

    for p in order:
        if p not in drained:
            meta = client.get_meta(FIELDS, BATCH, p, task_name=task, lease_s=LEASE_S)
            if meta.size:
                return p, meta
    for p in order:
        if p not in drained and client.run(streaming.progress(client.context, p, task, FIELDS)).drained:
            drained.add(p)
    waiting = [p for p in order if p not in drained]
    if not waiting:
        return None
    p = random.choice(waiting)  # blocks on that partition's shard until a put, a nack or a lapse
    meta = client.get_meta(FIELDS, BATCH, p, task_name=task, lease_s=LEASE_S, timeout=WAIT_S)
    return (p, meta) if meta.size else ("", None)


def _rank(url: str, ns: str, rank: int, quota: int | None, conn) -> None:
    """One rank: claim leased batches for its task, report each claim, then ack (or nack) on the go-ahead."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns, nested_output=False)
    task = TASKS[rank % len(TASKS)]
    order = list(PARTITIONS[rank % len(PARTITIONS):] + PARTITIONS[: rank % len(PARTITIONS)])
    drained: set[str] = set()
    done = 0
    while quota is None or done < quota:
        got = _claim(client, task, order, drained)
        if got is None:
            break
        p, meta = got
        if meta is None:
            continue
        pairs = list(zip(meta.global_indexes, meta.get_extra_info("delivery_counts")))
        conn.send(("claim", p, task, pairs))
        if conn.recv() == "nack":  # (or SIGKILL right here, holding the lease)
            lapsed = set(client.nack(meta))  # a lease that lapsed meanwhile is handed out again anyway
            conn.send(("nacked", p, task, [pair for pair in pairs if pair[0] not in lapsed]))
            continue
        data = client.get_data(meta)
        ok = torch.equal(data["payload"], _payload(data["x"])) and [
            int(v) % 1000 for v in data["x"]] == meta.global_indexes
        try:
            client.ack(meta)
            not_held = set()
        except errors.LeaseLost as lost:  # lapsed and handed out again: not acked here
            not_held = set(lost.ids)
        conn.send(("ack", p, task, [pair for pair in pairs if pair[0] not in not_held], ok))
        done += 1
    client.close()


# ------------------------------------------------------------------ the test's side


@dataclass
class _Rank:
    """One rank process and what it reported."""

    rank: int
    proc: Any
    conn: Any
    claims: list[tuple[str, str, int, int]] = field(default_factory=list)  # (partition, task, id, delivery)
    acks: list[tuple[str, str, int, int]] = field(default_factory=list)
    nacked: list[tuple[str, str, int, int]] = field(default_factory=list)
    bad_batches: int = 0
    killed: bool = False
    told_to_nack: bool = False


@dataclass
class _Pool:
    """Starts the ranks in waves (at most ``CONCURRENCY`` alive), answers their claims, kills victims."""

    urls: list[str]
    ns: str
    ctx: Any = field(default_factory=mp_context)
    live: dict[Any, _Rank] = field(default_factory=dict)  # conn -> rank
    done: list[_Rank] = field(default_factory=list)
    started: int = 0
    max_alive: int = 0

    def start_next(self) -> None:
        rank = self.started
        quota = None if rank >= RANKS - CONCURRENCY else QUOTA
        ours, theirs = self.ctx.Pipe()
        url = self.urls[rank % len(self.urls)]  # every node's URL serves the whole cluster
        proc = self.ctx.Process(target=_rank, args=(url, self.ns, rank, quota, theirs))
        proc.start()
        theirs.close()  # the rank holds its end: EOF tells the test it has exited
        self.live[ours] = _Rank(rank, proc, ours)
        self.started += 1
        self.max_alive = max(self.max_alive, len(self.live))

    def _finish(self, rank: _Rank) -> None:
        del self.live[rank.conn]
        rank.conn.close()
        rank.proc.join(30)
        self.done.append(rank)

    def _answer(self, rank: _Rank, message: tuple) -> None:
        kind, p, task, pairs = message[:4]
        rows = [(p, task, int(s), int(d)) for s, d in pairs]
        if kind == "ack":
            rank.acks.extend(rows)
            rank.bad_batches += not message[4]
        elif kind == "nacked":
            rank.nacked.extend(rows)
        else:  # a claim: the rank holds the lease and waits for the go-ahead
            first = not rank.claims
            rank.claims.extend(rows)
            if first and _victim(rank.rank):
                os.kill(rank.proc.pid, signal.SIGKILL)
                rank.killed = True
                self._finish(rank)
            else:
                rank.told_to_nack |= first and _nacker(rank.rank)
                rank.conn.send("nack" if first and _nacker(rank.rank) else "go")

    def run(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while self.live or self.started < RANKS:
            while self.started < RANKS and len(self.live) < CONCURRENCY:
                self.start_next()
            assert time.monotonic() < deadline, f"not drained in {DEADLINE_S:.0f} s ({self.started} ranks started)"
            for conn in wait_readable(list(self.live), timeout=5):
                rank = self.live.get(conn)
                if rank is None:  # killed while handling an earlier message of this round
                    continue
                try:
                    message = conn.recv()
                except EOFError:
                    self._finish(rank)
                    continue
                self._answer(rank, message)

    def stop(self) -> None:
        for rank in self.live.values():
            rank.proc.kill()
            rank.proc.join(10)


def _fcalls(cluster) -> dict[str, int]:  # noqa: F811  (the fixture's name, as a parameter)
    """Per master, the function calls it has served so far (``INFO commandstats``)."""
    out = {}
    for url in cluster.urls:
        node = cluster.node_client(url)
        try:
            out[url] = int(node.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0))
        finally:
            node.close()
    return out


def _check_records(ranks: list[_Rank]) -> dict[tuple[str, str, int], int]:
    """Every sample acked exactly once per task, by its latest delivery; every delivery handed to one rank.

    Returns the acked delivery of each (partition, task, id).
    """
    assert sum(r.bad_batches for r in ranks) == 0, "bytes did not round-trip"
    acked = [a for r in ranks for a in r.acks]
    counts = Counter((p, t, s) for p, t, s, _ in acked)
    everything = {(p, t, s) for p in PARTITIONS for t in TASKS for s in range(SAMPLES)}
    assert set(counts) == everything, f"lost: {sorted(everything - set(counts))[:10]}"
    assert [k for k, c in counts.items() if c > 1] == [], "samples acked twice"
    final = {(p, t, s): d for p, t, s, d in acked}
    deliveries: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for r in ranks:
        for p, t, s, d in r.claims:
            deliveries[(p, t, s)].append(d)
    for key, got in deliveries.items():  # each delivery went to one rank, none skipped, the last one acked
        assert sorted(got) == list(range(1, final[key] + 1)), f"{key}: deliveries {sorted(got)}, acked {final[key]}"
    handed_back = [(p, t, s, d) for r in ranks if r.killed for p, t, s, d in r.claims]
    handed_back += [n for r in ranks for n in r.nacked]
    assert all(final[(p, t, s)] > d for p, t, s, d in handed_back), "an orphaned or nacked sample was not redelivered"
    return final


def _check_servers(client: Any, final: dict[tuple[str, str, int], int]) -> None:
    """The servers agree: delivery counts match the records, nothing leased, poisoned or pending."""
    from tq_redis.ops import streaming

    r = client.redis
    for p in PARTITIONS:
        pk = PartitionKeys(client.namespace, p)
        for t in TASKS:
            server = {int(k): int(v) for k, v in r.hgetall(pk.deliveries(t)).items()}
            assert server == {s: final[(p, t, s)] for s in range(SAMPLES)}, (p, t)
            assert r.zcard(pk.lease(t)) == 0 and r.scard(pk.poison(t)) == 0, (p, t)
            assert client.check_consumption_status(t, p), (p, t)
            assert client.run(streaming.progress(client.context, p, t, FIELDS)).drained, (p, t)


def test_128_ranks_on_a_3_master_cluster_ack_every_sample_exactly_once(cluster, namespace):  # noqa: F811
    client = make_client(cluster.url, namespace)  # records the namespace's store (redis inline)
    owners = {p: cluster.owner_url(PartitionKeys(namespace, p).meta) for p in PARTITIONS}
    assert set(owners.values()) == set(cluster.urls), f"the partitions must cover all 3 shards: {owners}"
    before = _fcalls(cluster)
    started = time.monotonic()
    ctx = mp_context()
    producer = ctx.Process(target=_producer, args=(cluster.urls[1], namespace))
    pool = _Pool(cluster.urls, namespace, ctx)
    try:
        producer.start()
        pool.run()
        producer.join(30)
    finally:
        pool.stop()
        if producer.is_alive():
            producer.kill()
    elapsed = time.monotonic() - started
    assert producer.exitcode == 0

    ranks = pool.done
    assert len(ranks) == RANKS and len({r.proc.pid for r in ranks}) == RANKS, "128 distinct rank processes"
    assert pool.max_alive <= CONCURRENCY
    killed = [r for r in ranks if r.killed]
    assert len(killed) == sum(_victim(k) for k in range(RANKS)) > 0
    assert all(r.proc.exitcode == -signal.SIGKILL for r in killed)
    assert [r.rank for r in ranks if not r.killed and r.proc.exitcode != 0] == []
    assert sum(r.told_to_nack for r in ranks) == sum(_nacker(k) for k in range(RANKS)) > 0
    assert sum(len(r.nacked) for r in ranks) > 0, "no nack handed a batch back"
    final = _check_records(ranks)
    _check_servers(client, final)
    after = _fcalls(cluster)
    served = {url: after[url] - before[url] for url in cluster.urls}
    assert all(n > 0 for n in served.values()), f"every shard serves claims: {served}"
    working = sum(1 for r in ranks if r.claims)
    claims = sum(len(r.claims) for r in ranks) // BATCH
    print(f"\n[cluster soak {cluster.flavour}] {RANKS} ranks ({working} claimed, {len(killed)} SIGKILLed, "
          f"at most {pool.max_alive} at once), {len(PARTITIONS)} partitions on 3 shards, "
          f"{len(final)} samples acked once each ({len(TASKS)} tasks), {claims} leased claims, "
          f"{claims / elapsed:.0f} claims/s with process start-up, duplicates 0, "
          f"function calls per shard {sorted(served.values())}, {elapsed:.1f} s")
    assert working >= RANKS * 3 // 4, f"only {working} of {RANKS} ranks got a batch"
    client.close()
