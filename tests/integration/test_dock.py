"""GRPOTransferDock (MindSpeed-RL): rows by index, consumers as tasks, whole prompts, balance.

These use our options (``repeat_prompts``, ``layout="jagged"``); test_dock_mindspeed.py covers
MindSpeed-RL's own call shapes and result layout.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis import GRPOTransferDock
from tq_redis.errors import InvalidArgument

PROMPTS, N = 4, 2


def _blocked(dock: GRPOTransferDock) -> bool:
    return any(e.get("cmd") == "xread" and "b" in e.get("flags", "") for e in dock._client.redis.client_list())


def _dock(server, namespace: str, **kw) -> GRPOTransferDock:
    make_client(server.url, namespace).close()  # records the store of the namespace
    kw.setdefault("layout", "jagged")
    return GRPOTransferDock(PROMPTS, N, redis_url=server.url, namespace=namespace, **kw)


def _prompts(k: int, start: int = 0) -> dict:
    return {
        "prompts": [torch.arange(p % 3 + 2) + 100 * p for p in range(start, start + k)],
        "prompt_length": torch.tensor([[p % 3 + 2] for p in range(start, start + k)]),
    }


def test_reads_by_index_are_marked_by_a_script_the_rate_limiter_counts(server, namespace):
    """A read by index marks its rows in lua/mark_consumed.lua: counted once per row by the
    consumer's rate limiter, as the claims are."""
    dock = _dock(server, namespace)
    client = make_client(server.url, namespace)
    try:
        dock.put_experience(_prompts(4), repeat_prompts=True)
        client.set_rate_limit(dock.partition_id, "actor_train", 1.0, error_buffer=100)
        assert client.get_rate_limit(dock.partition_id, "actor_train").samples == 0
        _, rows = dock.get_experience("actor_train", ["prompts"], indexes=[1, 0, 1])
        assert rows == [1, 0, 1] and client.get_rate_limit(dock.partition_id, "actor_train").samples == 2
        dock.get_experience("actor_train", ["prompts"], indexes=[0])  # consumed already: not again
        assert client.get_rate_limit(dock.partition_id, "actor_train").samples == 2
        assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [2, 3]  # a claim: counted too
        assert client.get_rate_limit(dock.partition_id, "actor_train").samples == 4
        assert dock.get_consumer_status()["actor_train"].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    finally:
        client.close()
        dock.close()


def test_prompts_repeat_and_consumers_claim_each_row_once(server, namespace):
    dock = _dock(server, namespace)
    assert dock.put_experience(_prompts(2), repeat_prompts=True) == [0, 1, 2, 3]  # appended, repeated n times
    assert dock.put_experience(_prompts(2, 2), indexes=[2, 3], repeat_prompts=True) == [4, 5, 6, 7]
    td, idx = dock.get_experience("actor_rollout", ["prompts", "prompt_length"], 4)
    assert idx == [0, 1, 2, 3]
    assert [r.tolist() for r in td["prompts"].unbind()] == [[0, 1], [0, 1], [100, 101, 102], [100, 101, 102]]
    td, idx = dock.get_experience("actor_rollout", ["prompts"], 4)
    assert idx == [4, 5, 6, 7]
    assert dock.get_experience("actor_rollout", ["prompts"], 4) == (None, None)  # all consumed
    assert dock.all_consumed("actor_rollout") and not dock.all_consumed("ref_log_prob")
    # a later stage: responses of different lengths, written by index
    dock.put_experience({"responses": [torch.ones(i + 1) for i in range(3)]}, indexes=[5, 1, 6])
    assert dock.get_experience("ref_log_prob", ["responses", "prompt_length"], 2) == (None, None)  # no whole prompt
    td, idx = dock.get_experience("ref_log_prob", ["responses", "prompt_length"], 2, get_n_samples=False)
    assert idx == [1, 5]  # only rows with every requested column
    assert [len(r) for r in td["responses"].unbind()] == [2, 1]
    with pytest.raises(InvalidArgument, match="not dock columns"):
        dock.put_experience({"nope": torch.ones(1)}, indexes=[0])
    with pytest.raises(InvalidArgument, match="consumer"):
        dock.get_experience("nobody", ["prompts"], 2)
    with pytest.raises(InvalidArgument, match="divide"):
        dock.get_experience("actor_train", ["prompts"], 3)
    with pytest.raises(InvalidArgument, match="outside"):
        dock.put_experience({"rm_scores": torch.ones(1)}, indexes=[8])
    dock.clear()
    assert dock.get_experience("trainer", ["prompts"], 2) == (None, None)
    assert dock.put_experience(_prompts(1), repeat_prompts=True) == [0, 1]  # a fresh step starts at row 0
    dock.close()


def test_get_n_samples_hands_out_whole_prompts(server, namespace):
    dock = _dock(server, namespace, addition_consumers=["critic"])
    dock.put_experience(_prompts(PROMPTS), repeat_prompts=True)
    dock.put_experience({"responses": [torch.ones(2)] * 5}, indexes=[0, 1, 2, 4, 5])  # prompt 1 half done
    _, idx = dock.get_experience("critic", ["responses"], 4, get_n_samples=True)
    assert idx == [0, 1, 4, 5]  # prompts 0 and 2; never row 2 without row 3
    assert dock.get_experience("critic", ["responses"], 2, get_n_samples=True) == (None, None)
    dock.put_experience({"responses": [torch.ones(2)] * 3}, indexes=[3, 6, 7])
    _, idx = dock.get_experience("critic", ["responses"], 4, get_n_samples=True)
    assert sorted(idx) == [2, 3, 6, 7]
    dock.close()


def test_seqlen_balance_takes_a_balanced_part(server, namespace):
    dock = _dock(server, namespace)
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    dock.put_experience({"prompts": [torch.ones(2)] * 8, "prompt_length": torch.tensor(lengths),
                         "response_length": torch.zeros(8, dtype=torch.long)}, indexes=list(range(8)))
    chosen = []
    for _ in range(4):
        _, idx = dock.get_experience("actor_train", ["prompts"], 2, get_n_samples=False, use_batch_seqlen_balance=True)
        chosen.append(idx)
    assert sorted(i for part in chosen for i in part) == list(range(8))
    first = sum(lengths[i] for i in chosen[0])
    assert first == 10  # KK pairs the longest with the shortest: every part sums to 10
    _, idx = dock.get_experience("actor_log_prob", ["prompts"], 4, get_n_samples=True,
                                 use_batch_seqlen_balance=True)
    assert len(idx) == 4 and {i // N for i in idx} == {i // N for i in idx[::2]}  # whole prompts
    # balancing is for MindSpeed's seqlen consumers only: others take the oldest rows
    _, idx = dock.get_experience("trainer", ["prompts"], 2, get_n_samples=False, use_batch_seqlen_balance=True)
    assert idx == [0, 1]
    dock.close()


def test_seqlen_balance_without_lengths_is_an_error(server, namespace):
    dock = _dock(server, namespace)
    dock.put_experience({"prompts": [torch.ones(2)] * 4, "prompt_length": torch.ones(4, dtype=torch.long)},
                        indexes=[0, 1, 2, 3])
    with pytest.raises(InvalidArgument, match="response_length"):
        dock.get_experience("actor_train", ["prompts"], 2, get_n_samples=False, use_batch_seqlen_balance=True)
    assert dock.get_consumer_status()["actor_train"].sum() == 0  # nothing was claimed
    dock.close()


def test_get_by_indexes_waits_for_the_columns(real_server, namespace):
    dock = _dock(real_server, namespace)
    dock.put_experience(_prompts(1), repeat_prompts=True)
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=dock.get_experience("trainer", ["rm_scores"], indexes=[1])))
    thread.start()
    writer = GRPOTransferDock(PROMPTS, N, redis_url=real_server.url, namespace=namespace, name=dock.name)
    deadline = time.monotonic() + 5
    while not _blocked(writer) and time.monotonic() < deadline:
        time.sleep(0.005)  # polling an observable condition, not synchronising on time
    assert _blocked(writer) and "r" not in out, "the reader did not wait for the column"
    writer.put_experience({"rm_scores": torch.tensor([0.5])}, indexes=[1])
    thread.join(10)
    td, idx = out["r"]
    assert idx == [1] and td["rm_scores"].tolist() == [0.5]
    assert writer.get_consumer_status()["trainer"].tolist()[:2] == [0, 1]  # the read marked row 1 consumed
    with pytest.raises(TimeoutError):
        dock.get_experience("trainer", ["rm_scores"], indexes=[0], timeout=0.1)
    writer.close()
    dock.close()


def _stage(url: str, ns: str, consumer: str, out) -> None:
    dock = GRPOTransferDock(PROMPTS * 4, N, redis_url=url, namespace=ns, name="mp")
    got = []
    while not dock.all_consumed(consumer):
        td, idx = dock.get_experience(consumer, ["prompts"], 2, timeout=1)  # blocks on the event stream
        if idx is not None:
            assert [int(r[0]) // 100 for r in td["prompts"].unbind()] == [i // N for i in idx]
            got.extend(idx)
    out.put(got)
    dock.close()


def test_processes_share_the_dock_and_claim_each_row_once(real_server, namespace):
    make_client(real_server.url, namespace).close()
    ctx = mp_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_stage, args=(real_server.url, namespace, "actor_train", out)) for _ in range(3)]
    for p in procs:
        p.start()
    dock = GRPOTransferDock(PROMPTS * 4, N, redis_url=real_server.url, namespace=namespace, name="mp")
    for start in range(0, PROMPTS * 4, 4):
        dock.put_experience({"prompts": [torch.full((3,), 100 * p) for p in range(start, start + 4)]},
                            repeat_prompts=True)
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(i for g in got for i in g) == list(range(PROMPTS * 4 * N))
    dock.close()
