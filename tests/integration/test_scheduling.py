"""Scheduling inside Redis: leases with redelivery under SIGKILL, data-parallel groups, user
samplers racing, token budgets, staleness, fencing and poison samples."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from multiprocessing.connection import wait as wait_readable

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis import errors
from tq_redis.meta import BatchMeta
from tq_redis.meta.keys import PartitionKeys, config_key
from tq_redis.samplers import BaseSampler


def _put(client, n: int, partition: str = "p", **fields) -> BatchMeta:
    data = {"x": torch.arange(n)}
    data.update(fields)
    return client.put(TensorDict(data, batch_size=[n]), partition_id=partition)


def _tag(client, meta: BatchMeta, rows: list[dict]) -> None:
    meta = meta.copy()
    meta.update_custom_meta(rows)
    client.set_custom_meta(meta)


# ------------------------------------------------------------------ leases under SIGKILL

KILL_SAMPLES = 960
KILL_BATCH = 8
KILL_CONSUMERS = 16
KILLS = 5
LEASE_S = 0.5


def _lease_consumer(url, ns, idx, lock, holding, announce, go, log_path) -> None:
    """Claim with a lease, "work", ack. Announces each claimed batch (under ``lock``) so the
    test can SIGKILL it while it holds a lease; logs claims and successful acks."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    lease_key = PartitionKeys(ns, "p").lease("train")
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    rng = random.Random(idx)
    go.wait()
    while True:
        meta = client.get_meta(["x"], KILL_BATCH, "p", task_name="train", lease_s=LEASE_S, timeout=0.3)
        if meta.size == 0:
            if client.check_consumption_status("train", "p") and client.redis.zcard(lease_key) == 0:
                break
            continue
        pairs = list(zip(meta.global_indexes, meta.get_extra_info("delivery_counts")))
        with lock:
            os.write(fd, (json.dumps(["claim", pairs]) + "\n").encode())
            holding.value = 1
            announce.send(idx)
        time.sleep(rng.uniform(0.001, 0.02))  # the work a trainer would do with the batch
        with lock:
            holding.value = 0
            try:
                client.ack(meta)
                not_held = set()
            except errors.LeaseLost as lost:  # lapsed and handed out again: not acked here
                not_held = set(lost.ids)
            os.write(fd, (json.dumps(["ack", [p for p in pairs if p[0] not in not_held]]) + "\n").encode())
    os.close(fd)
    client.close()


def test_leases_survive_sigkill_each_sample_acked_once(real_server, namespace, tmp_path):
    client = make_client(real_server.url, namespace)
    _put(client, KILL_SAMPLES)
    ctx = mp_context()
    go = ctx.Event()
    locks = [ctx.Lock() for _ in range(KILL_CONSUMERS)]
    holding = [ctx.Value("i", 0) for _ in range(KILL_CONSUMERS)]
    pipes = [ctx.Pipe(duplex=False) for _ in range(KILL_CONSUMERS)]
    logs = [tmp_path / f"consumer{i}.log" for i in range(KILL_CONSUMERS)]
    procs = [
        ctx.Process(
            target=_lease_consumer,
            args=(real_server.url, namespace, i, locks[i], holding[i], pipes[i][1], go, str(logs[i])),
        )
        for i in range(KILL_CONSUMERS)
    ]
    for p in procs:
        p.start()
    for _, sender in pipes:
        sender.close()  # the consumers hold the write ends; EOF tells the test one has exited
    go.set()
    rng = random.Random(4)
    readers = {pipes[i][0]: i for i in range(KILL_CONSUMERS)}
    killed: set[int] = set()
    deadline = time.monotonic() + 60
    while readers and time.monotonic() < deadline:
        for reader in wait_readable(list(readers), timeout=5):
            idx = readers[reader]
            try:
                reader.recv()
            except EOFError:
                del readers[reader]
                continue
            if len(killed) >= KILLS or rng.random() > 0.2:
                continue
            with locks[idx]:  # the victim is between claim and ack: it holds a lease
                if holding[idx].value:
                    os.kill(procs[idx].pid, signal.SIGKILL)
                    procs[idx].join(10)
                    killed.add(idx)
                    del readers[reader]
    for p in procs:
        p.join(60)
    assert len(killed) == KILLS
    assert all(procs[i].exitcode == -signal.SIGKILL for i in killed)
    assert all(procs[i].exitcode == 0 for i in range(KILL_CONSUMERS) if i not in killed)

    acked: list[tuple[int, int]] = []
    orphaned: set[int] = set()  # claimed by a consumer that was killed before its ack
    for i, log in enumerate(logs):
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        for kind, pairs in entries:
            if kind == "ack":
                acked.extend((int(s), int(d)) for s, d in pairs)
        if i in killed:
            assert entries[-1][0] == "claim"
            orphaned.update(int(s) for s, _ in entries[-1][1])
    counts = Counter(s for s, _ in acked)
    assert set(counts) == set(range(KILL_SAMPLES))
    assert all(c == 1 for c in counts.values()), [s for s, c in counts.items() if c > 1][:10]
    delivered = dict(acked)
    assert orphaned and all(delivered[s] >= 2 for s in orphaned)
    pk = PartitionKeys(namespace, "p")
    server_counts = {int(k): int(v) for k, v in client.redis.hgetall(pk.deliveries("train")).items()}
    assert server_counts == delivered  # the successful ack was always by the latest delivery
    assert client.redis.zcard(pk.lease("train")) == 0
    assert client.redis.scard(pk.poison("train")) == 0
    client.close()


# ------------------------------------------------------------------ data-parallel groups

DP_GROUPS = 4
RANKS = 4
DP_BATCHES = 5
DP_BATCH = 6


def _dp_rank(url, ns, group, rank, go, out) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    go.wait()
    seen = []
    for b in range(DP_BATCHES):
        config = {"sampler": "RankAwareSampler", "dp_rank": group, "batch_index": b}
        meta = client.get_meta(["x"], DP_BATCH, "p", task_name="actor", sampling_config=config, timeout=30)
        seen.append(meta.global_indexes)
    out.put((group, rank, seen))
    client.close()


def test_rank_aware_groups_see_identical_batches_and_never_overlap(valkey, namespace):
    # one real server is enough here: the claim paths run on every flavour in tests/unit
    real_server = valkey
    client = make_client(real_server.url, namespace)
    total = DP_GROUPS * DP_BATCHES * DP_BATCH
    _put(client, total // 2)
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_dp_rank, args=(real_server.url, namespace, g, r, go, out))
        for g in range(DP_GROUPS)
        for r in range(RANKS)
    ]
    random.Random(1).shuffle(procs)
    for p in procs:
        p.start()
    go.set()
    _put(client, total - total // 2)  # the rest arrives while ranks wait on the event stream
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    by_group: dict[int, list[list[list[int]]]] = {}
    for group, _rank, seen in results:
        by_group.setdefault(group, []).append(seen)
    batches = []
    for group, ranks in by_group.items():
        assert len(ranks) == RANKS
        assert all(seen == ranks[0] for seen in ranks), f"ranks of group {group} disagree"
        batches.extend(ranks[0])
    assert all(len(b) == DP_BATCH for b in batches)
    ids = [i for b in batches for i in b]
    assert len(ids) == len(set(ids)) == total  # groups never overlap, nothing lost
    client.close()


# ------------------------------------------------------------------ user samplers racing


class ContendedSampler(BaseSampler):
    """Picks at random among the first few ready ids, so racing consumers collide often."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.calls = 0

    def sample(self, ready_indexes, batch_size, *args, **kwargs):
        self.calls += 1
        assert kwargs["task_name"] == "judge" and kwargs["partition_id"] == "p"
        chosen = self.rng.sample(ready_indexes[: 3 * batch_size], batch_size)
        return chosen, chosen


def _user_consumer(url, ns, seed, go, out) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    sampler = ContendedSampler(seed)
    go.wait()
    seen, batches = [], 0
    while True:
        meta = client.get_meta(["x"], 4, "p", task_name="judge", sampling_config={"sampler": sampler}, timeout=0.2)
        if meta.size:
            seen.extend(meta.global_indexes)
            batches += 1
        elif client.check_consumption_status("judge", "p"):
            break
    out.put((seen, batches, sampler.calls))
    client.close()


def test_user_sampler_processes_racing_never_share_a_sample(valkey, namespace):
    real_server = valkey
    client = make_client(real_server.url, namespace)
    total = 400
    _put(client, total)
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_user_consumer, args=(real_server.url, namespace, s, go, out)) for s in range(8)]
    for p in procs:
        p.start()
    go.set()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    ids = [i for seen, _, _ in results for i in seen]
    assert sorted(ids) == list(range(total))  # no duplicates, nothing lost
    batches = sum(b for _, b, _ in results)
    assert batches == total // 4
    client.close()


def test_user_sampler_conflicts_are_retried_then_reported(client):
    _put(client, 32)
    thief = make_client(client.redis_url, client.namespace)

    class Unlucky(BaseSampler):
        """Another consumer takes what it chose before it can claim it, every time."""

        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            chosen = ready_indexes[:1]
            thief.get_meta(["x"], 1, "p", task_name="t")
            return chosen, chosen

    with pytest.raises(errors.SamplerError, match="lost its choice"):
        client.get_meta(["x"], 1, "p", task_name="t", sampling_config={"sampler": Unlucky()})

    class Stray(BaseSampler):
        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            return [10_000], [10_000]

    with pytest.raises(errors.SamplerError, match="not in ready_indexes"):
        client.get_meta(["x"], 1, "p", task_name="u", sampling_config={"sampler": Stray})

    class SkipOne(BaseSampler):
        """Hands out one sample and marks two consumed (the reference contract allows it)."""

        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            return ready_indexes[:1], ready_indexes[:2]

    got = client.get_meta(["x"], 1, "p", task_name="v", sampling_config={"sampler": SkipOne()})
    assert got.global_indexes == [0]
    assert client.get_meta(["x"], 1, "p", task_name="v").global_indexes == [2]
    thief.close()


# ------------------------------------------------------------------ budgets and staleness


def test_token_budget_and_staleness_drain_random_partition(server, namespace):
    client = make_client(server.url, namespace)
    rng = random.Random(7)
    n = 240
    meta = _put(client, n)
    lengths = [rng.randint(1, 120) for _ in range(n)]
    versions = [rng.randint(0, 4) for _ in range(n)]
    _tag(client, meta, [{"total_lengths": ln, "policy_version": v} for ln, v in zip(lengths, versions)])
    budget, fresh = 300, 2
    eligible = {i for i in range(n) if versions[i] >= fresh}
    config = {"max_tokens": budget, "min_policy_version": fresh}
    taken: list[int] = []
    while True:
        batch = client.get_meta(["x"], 16, "p", task_name="keep", sampling_config=config)
        if batch.size == 0:
            break
        assert batch.size <= 16 and sum(lengths[i] for i in batch.global_indexes) <= budget
        assert [c["total_lengths"] for c in batch.custom_meta] == [lengths[i] for i in batch.global_indexes]
        taken.extend(batch.global_indexes)
    assert sorted(taken) == sorted(eligible)  # every fresh sample once, never a stale one
    pk = PartitionKeys(namespace, "p")
    assert client.redis.scard(pk.poison("keep")) == 0  # stale ones kept (not dropped) by default

    dropped = {**config, "drop_stale": True}
    while client.get_meta(["x"], 16, "p", task_name="drop", sampling_config=dropped).size:
        pass
    stale = {int(x) for x in client.redis.smembers(pk.poison("drop"))}
    assert stale == set(range(n)) - eligible
    assert client.check_consumption_status("drop", "p")  # dropped ones stop counting as pending

    # with groups: whole groups of 4, within budget
    grouped = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": 4, "max_tokens": 600}
    while True:
        batch = client.get_meta(["x"], 16, "p", task_name="grpo", sampling_config=grouped)
        if batch.size == 0:
            break
        ids = batch.global_indexes
        assert len(ids) % 4 == 0 and sum(lengths[i] for i in ids) <= 600
        assert all(ids[k : k + 4] == list(range(ids[k], ids[k] + 4)) and ids[k] % 4 == 0 for k in range(0, len(ids), 4))
    client.close()


def test_grpo_groups_never_straddle_prompts(client):
    a = _put(client, 4)  # prompt A x 4: ids 0-3
    _put(client, 4)  # prompt B x 4: ids 4-7
    grpo = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": 4}
    rewards = a.select_samples([2, 3])
    client.put(TensorDict({"reward": torch.ones(2)}, batch_size=[2]), metadata=rewards)
    everything = client.get_meta(["x"], 1, "p", mode="force_fetch")
    client.put(TensorDict({"reward": torch.ones(2)}, batch_size=[2]), metadata=everything.select_samples([4, 5]))
    # ready for "reward": 2, 3, 4, 5 -- four consecutive ids, but two halves of two prompts
    assert client.get_meta(["x", "reward"], 4, "p", task_name="t", sampling_config=grpo).size == 0
    client.put(TensorDict({"reward": torch.ones(4)}, batch_size=[4]), metadata=everything.select_samples([0, 1, 6, 7]))
    got = client.get_meta(["x", "reward"], 8, "p", task_name="t", sampling_config=grpo)
    assert got.global_indexes == list(range(8))


def test_grpo_groups_by_uid_tag(client):
    meta = _put(client, 10)
    _tag(client, meta, [{"uid": f"q{i % 3}"} for i in range(10)])  # q0: 0,3,6,9  q1: 1,4,7  q2: 2,5,8
    grpo = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": 4}
    got = client.get_meta(["x"], 4, "p", task_name="t", sampling_config=grpo)
    assert got.global_indexes == [0, 3, 6, 9]
    assert client.get_meta(["x"], 4, "p", task_name="t", sampling_config=grpo).size == 0
    more = _put(client, 1)
    _tag(client, more, [{"uid": "q2"}])
    assert client.get_meta(["x"], 4, "p", task_name="t", sampling_config=grpo).global_indexes == [2, 5, 8, 10]
    with pytest.raises(errors.SamplerError, match="multiple of n_samples_per_prompt"):
        client.get_meta(["x"], 6, "p", task_name="t", sampling_config=grpo)


# ------------------------------------------------------------------ fencing and poison


def test_lapsed_lease_cannot_be_settled_by_its_old_holder(client):
    _put(client, 2)
    old = client.get_meta(["x"], 2, "p", task_name="t", lease_s=0.05)
    assert old.get_extra_info("delivery_counts") == [1, 1]
    # waits on the stream only until the old lease lapses, then takes the samples over
    new = client.get_meta(["x"], 2, "p", task_name="t", lease_s=30, timeout=10)
    assert new.global_indexes == [0, 1] and new.get_extra_info("delivery_counts") == [2, 2]
    with pytest.raises(errors.LeaseLost, match=r"samples \[0, 1\] of partition 'p' were not acknowledged") as lost:
        client.ack(old)
    assert lost.value.ids == [0, 1] and lost.value.by_partition == {"p": [0, 1]}
    with pytest.raises(errors.LeaseLost, match="were not extended"):
        client.extend_lease(old, 60)
    assert client.nack(old) == [0, 1]
    assert client.extend_lease(new[1:], 60) is None  # the token follows a sample through slicing
    assert client.ack(new[1:]) is None
    assert client.ack(new) is None  # sample 1 acked already by this very holder: acking again is no error
    assert client.ack(new) is None
    with pytest.raises(errors.LeaseLost):  # the new holder's samples: not the old holder's to ack
        client.ack(old)
    assert client.check_consumption_status("t", "p")


def test_max_deliveries_moves_a_poison_sample_aside(client):
    _put(client, 2)
    config = {"max_deliveries": 2}
    for delivery in (1, 2):
        got = client.get_meta(["x"], 1, "p", task_name="t", lease_s=30, sampling_config=config)
        assert got.global_indexes == [0] and got.get_extra_info("delivery_counts") == [delivery]
        assert client.nack(got) == []
    nxt = client.get_meta(["x"], 1, "p", task_name="t", lease_s=30, sampling_config=config)
    assert nxt.global_indexes == [1]
    pk = PartitionKeys(client.namespace, "p")
    assert client.redis.smembers(pk.poison("t")) == {b"0"}
    assert client.ack(nxt) is None
    assert client.check_consumption_status("t", "p")


# ------------------------------------------------------------------ default samplers


def test_namespace_default_sampler_from_config(client):
    _put(client, 8)
    key = config_key(client.namespace)
    spec = {"name": "GRPOGroupNSampler", "params": {"n_samples_per_prompt": 4}}
    client.redis.hset(key, "sampler", json.dumps(spec))
    fresh = make_client(client.redis_url, client.namespace)
    with pytest.raises(errors.SamplerError, match="multiple of n_samples_per_prompt"):
        fresh.get_meta(["x"], 2, "p", task_name="t")
    assert fresh.get_meta(["x"], 4, "p", task_name="t").global_indexes == [0, 1, 2, 3]
    client.redis.hset(key, "sampler", json.dumps("MyOwnSampler"))
    with pytest.raises(errors.SamplerError, match="per call"):
        make_client(client.redis_url, client.namespace).get_meta(["x"], 1, "p", task_name="u")

    class Last(BaseSampler):
        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            return ready_indexes[-batch_size:], ready_indexes[-batch_size:]

    # the client's own default (init gives its client the config's; a class or an instance) wins
    # over the namespace's, and comes through its context: another client of the process keeps
    # the namespace's
    local = make_client(client.redis_url, client.namespace, sampler=Last)
    assert local.context.default_sampler is Last
    assert local.get_meta(["x"], 2, "p", task_name="v").global_indexes == [6, 7]
    with pytest.raises(errors.SamplerError, match="per call"):
        make_client(client.redis_url, client.namespace).get_meta(["x"], 1, "p", task_name="w")
    fresh.close()
    local.close()


def test_init_gives_its_client_the_configs_sampler(valkey, namespace):
    import tq_redis as tq

    class Last(BaseSampler):
        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            return ready_indexes[-batch_size:], ready_indexes[-batch_size:]

    make_client(valkey.url, namespace).close()  # records the store for the namespace
    tq.init({"redis": {"url": valkey.url}, "namespace": namespace, "sampler": Last,
             "storage": {"backend": "redis"}})
    try:
        default = tq.get_client()
        assert default.context.default_sampler is Last
        _put(default, 4)
        assert default.get_meta(["x"], 2, "p", task_name="t").global_indexes == [2, 3]
        # Redis records the class by name only: a client built apart is told to pass it per call
        other = make_client(valkey.url, namespace)
        with pytest.raises(errors.SamplerError, match="per call"):
            other.get_meta(["x"], 1, "p", task_name="u")
        other.close()
    finally:
        tq.close()


def test_async_client_runs_builtin_and_user_samplers(valkey, namespace):
    import asyncio

    from tq_redis import AsyncTransferQueueClient

    make_client(valkey.url, namespace).close()  # records the store for the namespace

    class Evens(BaseSampler):
        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            chosen = [i for i in ready_indexes if i % 2 == 0][:batch_size]
            return chosen, chosen

    async def main():
        client = AsyncTransferQueueClient(valkey.url, namespace)
        meta = await client.async_put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), partition_id="p")
        await client.async_set_custom_meta(
            BatchMeta.from_columns(meta.global_indexes, "p", {}, custom_meta=[{"uid": i // 2} for i in range(8)])
        )
        grpo = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": 2}
        pair = await client.async_get_meta(["x"], 2, "p", task_name="g", sampling_config=grpo, lease_s=30)
        assert pair.global_indexes == [0, 1] and [c["uid"] for c in pair.custom_meta] == [0, 0]
        assert await client.async_ack(pair) is None
        evens = await client.async_get_meta(["x"], 3, "p", task_name="u", sampling_config={"sampler": Evens()})
        assert evens.global_indexes == [0, 2, 4]
        await client.async_close()

    asyncio.run(main())
