"""Replay semantics (issue 34, item 4), on every server flavour: ``max_times_sampled`` hands a
sample to a task up to N times (never N + 1) across consumer processes; the prioritized sampler
draws in proportion to priority ** alpha."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis.errors import InvalidArgument
from tq_redis.samplers import SamplerError

DEADLINE_S = 120.0

SAMPLES = 30
TIMES = 3
CONSUMERS = 3


def _put(client, n: int, pid: str = "p") -> list[int]:
    return list(client.put(TensorDict({"x": torch.arange(n)}, batch_size=[n]), partition_id=pid).global_indexes)


def _replaying_consumer(url: str, ns: str, go, out) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    go.wait()
    seen: list[list[int]] = []
    while True:
        meta = client.get_meta(["x"], 2, "p", task_name="t", sampling_config={"max_times_sampled": TIMES})
        if meta.size == 0:
            break
        seen.append(list(meta.global_indexes))
    out.put(seen)
    client.close()


def test_each_sample_is_handed_to_a_task_exactly_max_times_sampled_times_across_processes(server, namespace):
    client = make_client(server.url, namespace)
    ids = _put(client, SAMPLES)
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_replaying_consumer, args=(server.url, namespace, go, out)) for _ in range(CONSUMERS)]
    for p in procs:
        p.start()
    go.set()
    batches = [b for _ in procs for b in out.get(timeout=DEADLINE_S)]
    for p in procs:
        p.join(DEADLINE_S)
        assert p.exitcode == 0
    assert all(len(set(b)) == len(b) for b in batches), "a batch held one sample twice"
    counts = Counter(i for b in batches for i in b)
    assert counts == Counter({i: TIMES for i in ids}), "not every sample was handed out exactly TIMES times"
    # consumed for good now, for this task only; another task starts afresh
    assert client.get_meta(["x"], 1, "p", task_name="t", sampling_config={"max_times_sampled": TIMES}).size == 0
    assert client.check_consumption_status("t", "p")
    assert client.get_meta(["x"], SAMPLES, "p", task_name="other").size == SAMPLES
    client.close()


def test_replay_counts_start_again_after_reset_and_go_with_cleared_samples(client):
    ids = _put(client, 2)
    replay = {"max_times_sampled": 2}
    assert list(client.get_meta(["x"], 2, "p", task_name="t", sampling_config=replay).global_indexes) == ids
    client.reset_consumption("p", "t")
    for _ in range(2):  # the count of the first claim is gone with the reset
        assert list(client.get_meta(["x"], 2, "p", task_name="t", sampling_config=replay).global_indexes) == ids
    assert client.get_meta(["x"], 1, "p", task_name="t", sampling_config=replay).size == 0
    client.clear_partition("p")
    assert not list(client.redis.scan_iter(match=f"{client.namespace}:*sampled:*"))


def test_replay_refuses_leases_user_samplers_and_shared_batches(client):
    _put(client, 2)
    with pytest.raises(InvalidArgument, match="lease_s"):
        client.get_meta(["x"], 1, "p", task_name="t", lease_s=5, sampling_config={"max_times_sampled": 2})
    with pytest.raises(SamplerError, match="max_times_sampled"):
        client.get_meta(["x"], 1, "p", task_name="t",
                        sampling_config={"max_times_sampled": 2, "sampler": "RankAwareSampler", "dp_rank": 0,
                                         "batch_index": 0})
    with pytest.raises(SamplerError, match="max_times_sampled"):
        client.get_meta(["x"], 1, "p", task_name="t", sampling_config={"max_times_sampled": 0})
