"""Replay semantics (issue 34, item 4), on every server flavour: ``max_times_sampled`` hands a
sample to a task up to N times (never N + 1) across consumer processes; the prioritized sampler
draws in proportion to priority ** alpha."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis.errors import BatchSizeMismatch, InvalidArgument, SampleNotFound
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


# ------------------------------------------------------------------ the prioritized sampler

ROWS = 9  # 8 degrees of freedom: an even number, for which the chi-square tail has a closed form
DRAWS = 1000
SIGNIFICANCE = 1e-6  # a right sampler fails this test once in a million runs


def _chi_square_tail(stat: float, dof: int) -> float:
    """P(X >= stat) for X chi-square with an even number of degrees of freedom."""
    assert dof % 2 == 0
    half, term, total = stat / 2, 1.0, 0.0
    for i in range(dof // 2):
        if i:
            term *= half / i
        total += term
    return math.exp(-half) * total


def _p_value(counts: list[int], weights: list[float]) -> float:
    n, total = sum(counts), sum(weights)
    stat = sum((c - n * w / total) ** 2 / (n * w / total) for c, w in zip(counts, weights))
    return _chi_square_tail(stat, len(counts) - 1)


def _draw_counts(client, ids: list[int], config: dict) -> list[int]:
    config = {"sampler": "PrioritizedSampler", "max_times_sampled": 10**9, **config}
    got = Counter()
    for _ in range(DRAWS):
        got.update(client.get_meta(["x"], 1, "p", task_name="learner", sampling_config=config).global_indexes)
    return [got[i] for i in ids]


def test_prioritized_draws_follow_priority_to_the_alpha_and_update_priority_changes_them(client):
    ids = _put(client, ROWS)
    low_first = [float(k + 1) for k in range(ROWS)]
    client.update_priority("p", ids, low_first)
    uniform = [1.0] * ROWS
    # the test can tell: even a sampler off by the exponent (or uniform) fails with near certainty
    for wrong in (uniform, [w**2 for w in low_first]):
        expected_stat = DRAWS * sum((a / sum(wrong) - b / sum(low_first)) ** 2 / (b / sum(low_first))
                                    for a, b in zip(wrong, low_first))
        assert _chi_square_tail(expected_stat / 2, ROWS - 1) < SIGNIFICANCE

    counts = _draw_counts(client, ids, {"alpha": 1.0})
    assert _p_value(counts, low_first) > SIGNIFICANCE, counts
    assert _p_value(counts, uniform) < SIGNIFICANCE, counts

    high_first = list(reversed(low_first))
    client.update_priority("p", ids, high_first)
    squared = [w**2 for w in high_first]
    counts = _draw_counts(client, ids, {"alpha": 2})
    assert _p_value(counts, squared) > SIGNIFICANCE, counts
    assert _p_value(counts, high_first) < SIGNIFICANCE, counts  # alpha = 2 is not alpha = 1
    assert _p_value(counts, low_first) < SIGNIFICANCE, counts


def test_prioritized_draws_only_claimable_samples_each_once_by_default(client):
    ids = _put(client, 6)
    client.update_priority("p", ids, [1000.0, 1, 1, 1, 1, 1])
    config = {"sampler": "PrioritizedSampler"}
    first = client.get_meta(["x"], 2, "p", task_name="t", sampling_config=config)
    rest = client.get_meta(["x"], 4, "p", task_name="t", sampling_config=config)
    assert sorted(first.global_indexes + rest.global_indexes) == ids
    assert client.get_meta(["x"], 1, "p", task_name="t", sampling_config=config).size == 0
    assert first.get_all_custom_meta()[0]["priority"] in (1000.0, 1)  # the priority comes back as a tag


def test_prioritized_draws_from_more_claimable_samples_than_one_scan_window(client):
    ids = _put(client, 9000)  # a scan window of the bitmaps holds up to 32768 ids
    client.update_priority("p", ids[-2:], [1e9, 1e9])
    meta = client.get_meta(["x"], 2, "p", task_name="t", sampling_config={"sampler": "PrioritizedSampler"})
    assert list(meta.global_indexes) == ids[-2:]


def test_update_priority_refuses_bad_input(client):
    ids = _put(client, 2)
    with pytest.raises(InvalidArgument, match="priorities"):
        client.update_priority("p", ids, [1.0, 0.0])
    with pytest.raises(InvalidArgument, match="priorities"):
        client.update_priority("p", ids, [1.0, float("nan")])
    with pytest.raises(BatchSizeMismatch):
        client.update_priority("p", ids, [1.0])
    with pytest.raises(SampleNotFound):
        client.update_priority("p", [ids[0], 99], [1.0, 2.0])
    with pytest.raises(SamplerError, match="alpha"):
        client.get_meta(["x"], 1, "p", task_name="t", sampling_config={"sampler": "PrioritizedSampler", "alpha": -1})


def test_update_priority_of_the_async_client_and_the_module_api(server, namespace):
    import tq_redis as tq
    from tq_redis import AsyncTransferQueueClient

    client = make_client(server.url, namespace)
    ids = _put(client, 2)

    async def run():
        aclient = AsyncTransferQueueClient(server.url, namespace)
        try:
            await aclient.async_update_priority("p", ids, [3.0, 4.0])
        finally:
            await aclient.async_close()

    asyncio.run(run())
    tags = client.get_meta(["x"], 2, "p", mode="force_fetch").get_all_custom_meta()
    assert [t["priority"] for t in tags] == [3.0, 4.0]
    tq.init({"redis": {"url": server.url}, "namespace": namespace})
    try:
        tq.update_priority("p", ids, [5.0, 6.0])
    finally:
        tq.close()
    tags = client.get_meta(["x"], 2, "p", mode="force_fetch").get_all_custom_meta()
    assert [t["priority"] for t in tags] == [5.0, 6.0]
    client.close()
