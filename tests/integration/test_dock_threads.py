"""Both docks as MindSpeed-RL runs them: one object in a threaded Ray actor (``max_concurrency=100``).

MindSpeed declares ``@ray.remote(max_concurrency=100)`` for its docks, so up to 100 calls run in
one dock object at once, on threads of one process. These tests make exactly that: one dock
object, rounds of 100 calls started together (a barrier releases them at once) on a pool of 100
threads -- producers putting rows, several consumers claiming or reading them, metric updates --
then clears, and a burst of clears racing status reads. Every row put is counted, and every row
each consumer got, checked against what was put (its values name its row and round): nothing
lost, nothing duplicated, nothing raised. The first round is the object's first use of the
data plane, so lazy set-up (the store, its connections) happens under the 100 threads too.

Run on both real servers with the Redis store, and on ``tq_redis.init()``'s own system (embedded
Valkey and DRAM storage nodes, nothing inline) as a MindSpeed actor finds it; and once as Ray
actors declared as MindSpeed declares them.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import tq_redis as tq
from tests.conftest import _server, make_client
from tq_redis import GRPOTransferDock, MMGRPOTransferDock

CALLS = 100  # MindSpeed's max_concurrency
ROUNDS = 3
CALL_TIMEOUT_S = 120.0  # a read waits for its rows at most this long; it never should nearly as long
PROMPTS, N = 25, 4  # the GRPO dock: 100 rows, 25 whole prompts
BIG_ROW = 1 << 16  # floats in a row of old_log_prob: 256 KiB, so a claim of 4 rows reads 1 MiB
BLOCK = 4  # rows one call of the multimodal dock puts or reads
GRPO_CONSUMERS = ("actor_log_prob", "ref_log_prob", "actor_train")
MM_CONSUMERS = ("actor_train", "ref_log_prob", "rule_reward")


def at_once(calls: list[Callable[[], Any]]) -> tuple[list[Any], list[BaseException]]:
    """Run ``calls`` on a pool of ``len(calls)`` threads, all released together; results and errors."""
    barrier = threading.Barrier(len(calls), timeout=CALL_TIMEOUT_S)

    def released(fn: Callable[[], Any]) -> Any:
        barrier.wait()
        return fn()

    results, errors = [], []
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(released, fn) for fn in calls]
        for future in futures:
            try:
                results.append(future.result(timeout=2 * CALL_TIMEOUT_S))
            except Exception as exc:  # noqa: BLE001 - every error of every call is reported below
                errors.append(exc)
    return results, errors


@pytest.fixture(params=["valkey", "redis7", "init-dram"])
def place(request, namespace) -> Iterator[dict[str, Any]]:
    """Where the docks live: a real server (each flavour) with the Redis store, or ``tq_redis.init()``'s
    own system (an embedded Valkey and two DRAM nodes, every value in the nodes)."""
    if request.param != "init-dram":
        url = _server(request.param).url
        make_client(url, namespace).close()  # records the namespace's store
        yield {"redis_url": url, "namespace": namespace}
        return
    cfg = tq.init({"namespace": namespace,
                   "storage": {"backend": "dram", "units": 2, "unit_capacity": "256MiB", "inline_max_bytes": 0}})
    try:
        yield {"redis_url": cfg["redis"]["url"], "namespace": namespace}
    finally:
        tq.close()


def _counts(calls: int, errors: int, put: list[int], got: dict[str, list[int]], rounds: int,
            rows: int) -> dict[str, int]:
    """The figures of a run: calls, rows put, rows each consumer got, duplicates and losses per
    consumer (within a round: a row comes back each round it was put), exceptions."""
    out = {"calls": calls, "exceptions": errors, "put": len(put)}
    for consumer, seen in got.items():
        per_round = [seen[i:i + rows] for i in range(0, len(seen), rows)]
        out[f"got {consumer}"] = len(seen)
        out[f"duplicated {consumer}"] = sum(len(r) - len(set(r)) for r in per_round)
        out[f"lost {consumer}"] = rounds * rows - len({(k, r) for k, part in enumerate(per_round) for r in part})
    return out


def _report(name: str, counts: dict[str, int]) -> None:
    print(f"\n{name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))


# ------------------------------------------------------------------ GRPOTransferDock


def _grpo_rows(rows: list[int], round_no: int) -> dict[str, Any]:
    """The columns a producer puts for ``rows``: each row's values name it (``[row, round]``)."""
    return {
        "prompts": torch.tensor([[r, round_no] for r in rows]),
        "prompt_length": torch.tensor([[2]] * len(rows)),
        "responses": torch.tensor([[r, round_no, r] for r in rows]),
        "response_length": torch.tensor([[3]] * len(rows)),
        "old_log_prob": torch.tensor(rows, dtype=torch.float32)[:, None].expand(-1, BIG_ROW).contiguous(),
    }


def test_grpo_dock_takes_100_concurrent_calls(place):
    dock = GRPOTransferDock(PROMPTS, N, **place)
    rows_total = PROMPTS * N
    put_rows: list[int] = []
    got: dict[str, list[int]] = {c: [] for c in GRPO_CONSUMERS}
    calls_made = errors_seen = 0
    try:
        for round_no in range(ROUNDS):
            def produce(round_no: int = round_no) -> tuple[str, list[int]]:
                rows = dock.prefetch_request_index(N)  # a whole prompt's rows, handed out once
                written = dock.put_experience(_grpo_rows(rows, round_no), indexes=rows)
                return "put", written

            def consume(consumer: str, round_no: int = round_no) -> Callable[[], tuple[str, Any]]:
                columns = ["prompts", "responses", *(["old_log_prob"] if consumer == "actor_train" else [])]

                def call() -> tuple[str, Any]:
                    td, rows = dock.get_experience(consumer, columns, N, timeout=CALL_TIMEOUT_S)
                    if rows is None:
                        return consumer, None
                    expected = torch.tensor([[r, round_no] for r in rows])
                    assert torch.equal(td["prompts"], expected), (consumer, rows, td["prompts"])
                    assert td["responses"][:, 0].tolist() == rows
                    if "old_log_prob" in columns:  # 1 MiB a claim: read through the warm-buffer cache
                        big = td["old_log_prob"]
                        assert big[:, 0].tolist() == rows and big[:, -1].tolist() == rows
                    dock.update_metrics("claims", [consumer], cumulate=True)
                    return consumer, rows
                return call

            calls = [produce] * PROMPTS + [consume(c) for c in GRPO_CONSUMERS for _ in range(PROMPTS)]
            assert len(calls) == CALLS
            results, errors = at_once(calls)
            calls_made += len(calls)
            errors_seen += len(errors)
            assert errors == []
            round_got: dict[str, list[int]] = {c: [] for c in ("put", *GRPO_CONSUMERS)}
            for kind, rows in results:
                assert rows is not None, f"a claim of {kind} found nothing within {CALL_TIMEOUT_S}s: rows were lost"
                round_got[kind].extend(rows)
            put_rows.extend(round_got.pop("put"))
            assert sorted(put_rows[-rows_total:]) == list(range(rows_total))
            for consumer, rows in round_got.items():
                assert sorted(rows) == list(range(rows_total)), consumer  # each row once: none lost or twice
                got[consumer].extend(rows)
                assert dock.all_consumed(consumer)
            assert dock.prefetch_request_index(N) is None  # the 25 producers took every row, once each
            claims = Counter(dock.get_metrics().metric["claims"])
            assert claims == Counter({c: PROMPTS for c in GRPO_CONSUMERS})  # no concurrent update lost
            dock.clear()  # between rounds: the step is over
            assert dock.get_cur_index() == 0 and not dock.get_experience_status()["prompts"].any()

        # clears racing each other and status reads of the (empty) dock: nothing raises, it stays empty
        dock.put_experience(_grpo_rows(list(range(rows_total)), ROUNDS), indexes=list(range(rows_total)))
        burst = [dock.clear] * 50 + [dock.get_consumer_status, dock.get_experience_status,
                                     lambda: dock.all_consumed("actor_train"), dock.get_update_ready,
                                     dock.get_incomplete_response_num] * 10
        _, errors = at_once(burst)
        calls_made += len(burst)
        errors_seen += len(errors)
        assert errors == []
        assert not dock.get_experience_status()["prompts"].any() and dock.get_experience("actor_train",
                                                                                         ["prompts"], N) == (None, None)
    finally:
        dock.close()
    _report("GRPOTransferDock, 100 threads", _counts(calls_made, errors_seen, put_rows, got, ROUNDS, rows_total))


# ------------------------------------------------------------------ MMGRPOTransferDock


def _mm_batch(prompts: list[int], round_no: int) -> dict[str, Any]:
    """A multimodal batch for ``prompts``: each prompt's patches are filled with ``1000*round + prompt``
    and it has ``1 + prompt % 3`` of them (rows differ in shape, as real images do)."""
    return {
        "pixel_values": [torch.full((1 + p % 3, 6), float(1000 * round_no + p)) for p in prompts],
        "image_grid_thw": [torch.tensor([[1, 1 + p % 3, 1]]) for p in prompts],
        "image_num": [torch.tensor([1]) for _ in prompts],
        "video_num": [0 for _ in prompts],
        "labels": [f"r{round_no}-p{p}" for p in prompts],
    }


def test_multimodal_dock_takes_100_concurrent_calls(place):
    n = 2
    prompts_total = 25 * BLOCK  # 100 prompts, 25 blocks of 4
    blocks = [list(range(b * BLOCK, (b + 1) * BLOCK)) for b in range(prompts_total // BLOCK)]
    dock = MMGRPOTransferDock(prompts_total, n, **place)
    put_prompts: list[int] = []
    got: dict[str, list[int]] = {c: [] for c in MM_CONSUMERS}
    calls_made = errors_seen = 0
    try:
        for round_no in range(ROUNDS):
            def produce(block: list[int], round_no: int = round_no) -> Callable[[], tuple[str, list[int]]]:
                def call() -> tuple[str, list[int]]:
                    dock.put_experience(_mm_batch(block, round_no), indexes=block)
                    return "put", block
                return call

            def consume(consumer: str, block: list[int],
                        round_no: int = round_no) -> Callable[[], tuple[str, list[int]]]:
                samples = [p * n + j for p in block for j in range(n)]  # the GRPO dock's sample indexes

                def call() -> tuple[str, list[int]]:
                    columns = dock.consumer_columns[consumer]
                    if consumer == "rule_reward":  # unmerged, as dynamic sampling reads
                        out = dock.get_experience_dict(columns, samples, True, timeout=CALL_TIMEOUT_S)
                        assert out["labels"] == [f"r{round_no}-p{p}" for p in block]
                        return consumer, [int(label.split("-p")[1]) for label in out["labels"]]
                    out = dock.get_experience(consumer, columns, samples, True, timeout=CALL_TIMEOUT_S)
                    sizes = out["image_grid_thw"][:, 1].tolist()
                    assert sizes == [1 + p % 3 for p in block] and out["image_num"].shape == (BLOCK, 1)
                    values = out["pixel_values"][:, 0].tolist()
                    expected = [float(1000 * round_no + p) for p in block for _ in range(1 + p % 3)]
                    assert values == expected, (consumer, block, values)
                    return consumer, block
                return call

            calls = [produce(b) for b in blocks]
            calls += [consume(c, b) for c in MM_CONSUMERS for b in blocks]
            assert len(calls) == CALLS
            results, errors = at_once(calls)
            calls_made += len(calls)
            errors_seen += len(errors)
            assert errors == []
            round_got: dict[str, list[int]] = {c: [] for c in ("put", *MM_CONSUMERS)}
            for kind, prompts in results:
                round_got[kind].extend(prompts)
            put_prompts.extend(round_got.pop("put"))
            for consumer, prompts in round_got.items():
                assert sorted(prompts) == list(range(prompts_total)), consumer
                got[consumer].extend(prompts)
            assert dock.get_columns("actor_train") == dock.consumer_columns["actor_train"]
            dock.clear()  # between rounds
            assert dock.get_columns("actor_train") == [] and not dock.get_experience_status()["labels"].any()

        dock.put_experience(_mm_batch(list(range(prompts_total)), ROUNDS), indexes=list(range(prompts_total)))
        burst = [dock.clear] * 50 + [lambda: dock.get_columns("actor_train"), dock.get_experience_status] * 25
        _, errors = at_once(burst)
        calls_made += len(burst)
        errors_seen += len(errors)
        assert errors == []
        assert dock.get_columns("rule_reward") == [] and not dock.get_experience_status()["pixel_values"].any()
    finally:
        dock.close()
    figures = _counts(calls_made, errors_seen, put_prompts, got, ROUNDS, prompts_total)
    _report("MMGRPOTransferDock, 100 threads", figures)


# ------------------------------------------------------------------ the same, as Ray actors


def test_both_docks_as_ray_actors_with_max_concurrency_100(ray_local, valkey, namespace):
    """MindSpeed's declaration itself: ``ray.remote(max_concurrency=100)`` actors of both docks, each
    sent 100 calls at once (the claims or reads of three consumers first, then the puts of every
    prompt they wait for: all in flight together), two rounds with a clear between; every row each
    consumer got, once."""
    ray = ray_local
    make_client(valkey.url, namespace).close()
    env = {"env_vars": {"TQ_REDIS_URL": valkey.url, "TQ_NAMESPACE": namespace}}
    grpo = ray.remote(max_concurrency=CALLS)(GRPOTransferDock).options(runtime_env=env).remote(PROMPTS, N)
    mm = ray.remote(max_concurrency=CALLS)(MMGRPOTransferDock).options(runtime_env=env).remote(CALLS, 2)
    rows_total = PROMPTS * N
    try:
        for round_no in range(2):
            prompts = [list(range(p * N, (p + 1) * N)) for p in range(PROMPTS)]
            # the claims are sent first: only an actor that runs them on threads gets to the puts
            calls = [grpo.get_experience.remote(c, ["prompts"], N, timeout=CALL_TIMEOUT_S)
                     for c in GRPO_CONSUMERS for _ in range(PROMPTS)]
            calls += [grpo.put_experience.remote(_grpo_rows(rows, round_no), rows) for rows in prompts]
            results = ray.get(calls, timeout=2 * CALL_TIMEOUT_S)
            written = [r for rows in results[-PROMPTS:] for r in rows]
            assert sorted(written) == list(range(rows_total))
            for k, consumer in enumerate(GRPO_CONSUMERS):
                claims = results[PROMPTS * k:PROMPTS * (k + 1)]
                assert all(rows is not None for _, rows in claims), consumer  # none came back empty
                got = [r for _, rows in claims for r in rows]
                assert sorted(got) == list(range(rows_total)), consumer  # each row once
                for td, rows in claims:
                    assert td["prompts"].tolist() == [[r, round_no] for r in rows]
            ray.get(grpo.clear.remote())

            blocks = [list(range(b * BLOCK, (b + 1) * BLOCK)) for b in range(CALLS // BLOCK)]
            samples = [[p * 2 + j for p in b for j in range(2)] for b in blocks]  # n = 2 samples a prompt
            calls = [mm.get_experience_dict.remote(["labels", "image_num"], s, True, timeout=CALL_TIMEOUT_S)
                     for _ in MM_CONSUMERS for s in samples]
            calls += [mm.put_experience.remote(_mm_batch(b, round_no), b) for b in blocks]
            results = ray.get(calls, timeout=2 * CALL_TIMEOUT_S)
            for k, _consumer in enumerate(MM_CONSUMERS):
                reads = results[len(blocks) * k:len(blocks) * (k + 1)]
                labels = [label for read in reads for label in read["labels"]]
                assert labels == [f"r{round_no}-p{p}" for p in range(CALLS)]  # every prompt once, in order
            ray.get(mm.clear.remote())
    finally:
        ray.kill(grpo)
        ray.kill(mm)
