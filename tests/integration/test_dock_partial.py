"""GRPOTransferDock with MindSpeed-RL's partial rollout (``max_age > 1``).

A scripted MindSpeed-style run over two steps, in MindSpeed's call shapes (padded layout,
``is_prompt`` puts, ``rollout_completed`` with responses, -2 pad rows put back): rollouts
interrupted and re-queued, rows aged and re-sorted oldest first by ``clear``, ``max_age`` holding
the update back until the oldest rows finish, the ready mask gating other consumers, and the
incomplete count; every row, age and status asserted exactly. Then three rollout worker processes
sharing a dock: each interrupted response is continued exactly once, by whichever worker claims it
next.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_client
from tests.procs import gather, mp_context
from tq_redis import GRPOTransferDock
from tq_redis.errors import InvalidArgument

ROLLOUT = ("prompts", "responses")


@pytest.fixture
def dock(server, namespace):
    make_client(server.url, namespace).close()  # records the namespace's store
    d = GRPOTransferDock(4, 2, None, 2, 2, redis_url=server.url, namespace=namespace)  # max_age 2, GBS_train 2
    yield d
    d.close()


def _put_prompts(dock, rows, base):
    dock.put_experience({"prompts": [torch.tensor([base + r]) for r in rows],
                         "prompt_length": [torch.tensor([1]) for _ in rows]}, rows, is_prompt=True)


def _rollout(dock, count, dp_size=1):
    td, rows = dock.get_experience("actor_rollout", list(ROLLOUT), count, dp_size, get_n_samples=False)
    n = len([r for r in rows if r != -2])
    return rows, td["prompts"][:n, 0].tolist(), td["age"][:n, 0].tolist(), td["responses"][:n, 0].tolist()


def _put_responses(dock, rows, completed):
    dock.put_experience({
        "responses": [torch.tensor([7, r]) for r in rows],
        "response_length": [torch.tensor([2]) for _ in rows],
        "input_ids": [torch.tensor([r]) for r in rows],
        "rollout_completed": [torch.tensor([c]) for c in completed],
    }, rows)


def _status(dock, column):
    return dock.get_experience_status()[column].tolist()


def test_partial_rollout_over_two_steps(dock):
    # step 1: prompts for this step (rows 0-3) and the next (rows 4-7), as MindSpeed's trainer does
    _put_prompts(dock, [0, 1, 2, 3], 100)
    _put_prompts(dock, [4, 5, 6, 7], 100)
    assert _status(dock, "responses") == [1] * 8  # placeholder responses, as MindSpeed
    assert _rollout(dock, 3) == ([0, 1, 2], [100, 101, 102], [0, 0, 0], [-1, -1, -1])
    assert _status(dock, "responses") == [0, 0, 0, 1, 1, 1, 1, 1]  # a claimed rollout's response is unwritten
    _put_responses(dock, [0, 1, 2], [1, 1, 0])  # row 2 interrupted: back in actor_rollout's queue
    # fewer ready than asked: all of them, the last repeated up to a multiple of dp_size with index -2
    td, rows = dock.get_experience("actor_rollout", list(ROLLOUT), 8, 4, get_n_samples=False)
    assert rows == [2, 3, 4, 5, 6, 7, -2, -2]
    assert td["prompts"][:, 0].tolist() == [102, 103, 104, 105, 106, 107, 107, 107]
    assert td["responses"][0].tolist() == [7, 2]  # the interrupted response, to continue
    assert td["age"].tolist() == [[0]] * 8
    _put_responses(dock, rows, [1, 1, 0, 0, 1, 1, 1, 1])  # the -2 rows are dropped
    assert dock.get_incomplete_response_num().item() == 2  # rows 4, 5
    assert dock.get_consumer_status()["actor_rollout"].tolist() == [1, 1, 1, 1, 0, 0, 1, 1]

    assert dock.get_experience("actor_train", ["responses"], 2) == (None, None)  # no ready mask yet
    assert dock.all_consumed("actor_rollout")  # prompts 0, 1, 3 finished >= GBS_train
    assert dock.get_update_ready(require_max_age_all_finished=True)
    _, rows = dock.get_experience("actor_train", ["responses"], 4)
    assert rows == [0, 1, 2, 3]
    assert dock.get_experience("actor_train", ["responses"], 2) == (None, None)  # GBS_train consumed
    assert dock.all_consumed("actor_train")
    dock.clear("actor_train")

    # rows 0-3 dropped; 4-7 (age 1) moved to the front without copying, the free rows after them
    assert _status(dock, "prompts") == [1, 1, 1, 1, 0, 0, 0, 0]
    assert dock.get_consumer_status()["actor_rollout"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert dock.get_consumer_status()["actor_train"].tolist() == [0] * 8
    assert dock.get_incomplete_response_num().item() == 2

    # step 2: new prompts in the free rows; rows 0, 1 (age 1 = max_age - 1) must finish now
    _put_prompts(dock, [4, 5, 6, 7], 200)
    assert not dock.get_update_ready(True)  # only prompt 1 (rows 2, 3) finished
    assert _rollout(dock, 4) == ([0, 1, 4, 5], [104, 105, 204, 205], [1, 1, 0, 0], [7, 7, -1, -1])
    _put_responses(dock, [0, 1, 4, 5], [1, 0, 1, 1])
    assert dock.get_update_ready(require_max_age_all_finished=False)  # prompts 1, 2 finished
    assert not dock.get_update_ready(require_max_age_all_finished=True)  # row 1 is at max age, unfinished
    rows, prompts, ages, _ = _rollout(dock, 4, dp_size=2)
    assert (rows, prompts, ages) == ([1, 6, 7, -2], [105, 206, 207], [1, 0, 0])
    _put_responses(dock, [1, 6, 7, -2], [1, 0, 0, 0])
    assert dock.get_update_ready(require_max_age_all_finished=True)
    assert dock.get_incomplete_response_num().item() == 2  # rows 6, 7
    td, rows = dock.get_experience("actor_train", ["prompts"], 4)
    assert rows == [0, 1, 2, 3] and td["prompts"][:, 0].tolist() == [104, 105, 106, 107]  # oldest first
    dock.clear("actor_train")

    # rows 4, 5 (finished) and 6, 7 (not) are now rows 0-3, all age 1
    assert _status(dock, "prompts") == [1, 1, 1, 1, 0, 0, 0, 0]
    assert _rollout(dock, 4) == ([2, 3], [206, 207], [1, 1], [7, 7])
    assert dock.all_consumed("actor_rollout") is False  # one finished prompt < GBS_train


def test_kv_watch_reports_the_clears_re_sort_and_the_limiter_counts_rollout_marks(dock, server, namespace):
    """The re-sort is a tag change of every moved row (lua/dock_resort.lua), and a finished
    rollout's mark is counted by the rollout task's rate limiter (lua/dock_finish.lua)."""
    watcher = make_client(server.url, namespace)
    try:
        _put_prompts(dock, range(8), 100)
        watcher.set_rate_limit(dock.partition_id, "actor_rollout", 1.0, error_buffer=100)
        assert watcher.get_rate_limit(dock.partition_id, "actor_rollout").samples == 0
        assert _rollout(dock, 6)[0] == [0, 1, 2, 3, 4, 5]  # counted by the claim script
        assert watcher.get_rate_limit(dock.partition_id, "actor_rollout").samples == 6
        _put_responses(dock, [0, 1, 2, 3, 4, 5, 6, 7], [1, 1, 1, 1, 0, 0, 1, 0])
        # rows 0-3 stayed consumed, 4, 5 went back; row 6 finished unclaimed: marked, and counted
        assert watcher.get_rate_limit(dock.partition_id, "actor_rollout").samples == 7
        assert dock.get_consumer_status()["actor_rollout"].tolist() == [1, 1, 1, 1, 0, 0, 1, 0]
        assert dock.get_update_ready(require_max_age_all_finished=False)  # prompts 0, 1 finished
        assert dock.get_experience("actor_train", ["responses"], 4)[1] == [0, 1, 2, 3]
        moving = watcher.kv_retrieve_meta(["4", "5", "6", "7"], dock.partition_id).global_indexes
        cursor = watcher.kv_watch(dock.partition_id).cursor
        dock.clear("actor_train")
        changes = watcher.kv_watch(dock.partition_id, cursor, timeout=10)
        assert sorted(changes.global_indexes) == sorted(moving)  # the rows 4-7 are rows 0-3 now
        assert sorted((k, t["dock_index"], t["uid"]) for k, t in changes.items()) == [
            ("0", 0, 0), ("1", 1, 0), ("2", 2, 1), ("3", 3, 1),
        ]
        assert watcher.kv_retrieve_meta(["0", "1", "2", "3"], dock.partition_id).global_indexes == moving
        assert len(watcher.kv_watch(dock.partition_id, changes.cursor)) == 0  # one change, noted once
    finally:
        watcher.close()


def test_partial_rollout_refuses_what_mindspeed_refuses(server, namespace):
    make_client(server.url, namespace).close()
    with pytest.raises(InvalidArgument, match="GBS_train"):
        GRPOTransferDock(4, 2, None, 2, 0, redis_url=server.url, namespace=namespace)
    dock = GRPOTransferDock(4, 2, None, 3, 2, redis_url=server.url, namespace=namespace)
    assert (dock.max_age, dock.enable_partial_rollout) == (3, True)
    _put_prompts(dock, [0, 1], 0)
    with pytest.raises(InvalidArgument, match="rollout_completed"):
        dock.put_experience({"responses": [torch.tensor([1])]}, [0])
    with pytest.raises(InvalidArgument, match="get_n_samples"):
        dock.get_experience("actor_rollout", ["prompts"], 2)
    with pytest.raises(InvalidArgument, match="age"):
        dock.get_experience("actor_train", ["prompts", "age"], 2)
    dock.close()


ROWS, PARTS = 12, 3  # every response is written over PARTS claims: interrupted PARTS - 1 times
WORKERS = 3


def _rollout_worker(url: str, ns: str, worker: int, completed, out) -> None:
    """A rollout worker: claim rows, add one token to each interrupted response, put it back
    (complete once it has PARTS tokens); log (row, tokens it found, token it wrote)."""
    dock = GRPOTransferDock(ROWS, 1, None, 2, ROWS, redis_url=url, namespace=ns, name="partial-mp")
    log = []
    while completed.value < ROWS:
        td, rows = dock.get_experience("actor_rollout", list(ROLLOUT) + ["response_length"], 2,
                                       get_n_samples=False, timeout=0.5)
        if rows is None:
            continue
        responses, finished = [], []
        for i, row in enumerate(rows):
            found = td["responses"][i, : int(td["response_length"][i, 0])].tolist()
            token = 1000 * (worker + 1) + len(log)
            log.append((row, found, token))
            responses.append(torch.tensor(found + [token]))
            finished.append(len(found) + 1 >= PARTS)
        dock.put_experience({
            "responses": responses,
            "response_length": [torch.tensor([len(r)]) for r in responses],
            "input_ids": [torch.tensor([row]) for row in rows],
            "rollout_completed": [torch.tensor([int(f)]) for f in finished],
        }, rows)
        with completed.get_lock():
            completed.value += sum(finished)
    out.put(log)
    dock.close()


def test_rollout_workers_in_processes_continue_each_interrupted_response_exactly_once(real_server, namespace):
    """3 worker processes share a dock with max_age 2: each response is interrupted twice and
    continued by whichever worker claims it next. No row is held by two workers at once (each
    part is claimed exactly once, finding exactly the tokens before it) and no part is lost."""
    make_client(real_server.url, namespace).close()
    dock = GRPOTransferDock(ROWS, 1, None, 2, ROWS, redis_url=real_server.url, namespace=namespace,
                            name="partial-mp")
    dock.put_experience({"prompts": [torch.tensor([100 + r]) for r in range(ROWS)],
                         "prompt_length": [torch.tensor([1]) for _ in range(ROWS)]}, list(range(ROWS)),
                        is_prompt=True)
    ctx = mp_context()
    completed, out = ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_rollout_worker, args=(real_server.url, namespace, w, completed, out))
             for w in range(WORKERS)]
    logs = [entry for log in gather(procs, out) for entry in log]
    by_row: dict[int, dict[int, tuple[list[int], int]]] = {}
    for row, found, token in logs:
        assert len(found) not in by_row.setdefault(row, {}), f"row {row} part {len(found)} was claimed twice"
        by_row[row][len(found)] = (found, token)
    assert sorted(by_row) == list(range(ROWS))
    final = dock.get_experience_data()["responses"]
    for row, parts in by_row.items():
        assert sorted(parts) == list(range(PARTS)), f"row {row}: parts {sorted(parts)} claimed"
        tokens = [parts[k][1] for k in range(PARTS)]
        for k in range(PARTS):
            assert parts[k][0] == tokens[:k], f"row {row} part {k} found {parts[k][0]}, not the tokens before it"
        assert final[row][:PARTS].tolist() == tokens
    assert dock.get_incomplete_response_num().item() == 0
    assert dock.get_update_ready(require_max_age_all_finished=True)
    dock.close()
