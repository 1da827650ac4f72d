"""Soak: a long multi-process pipeline over real DRAM storage-node processes.

Producer processes insert a batch into each of many partitions (one per training step); consumer
processes of two tasks drain the partitions in order and check every sample's bytes; the test
process clears each partition once both tasks have processed all of it, which lets the producers
move on (a bounded number of steps in flight, as in RL post-training). At the end every sample was
handed to each task exactly once with the bytes its producer wrote, and clearing gave everything
back: no bytes, pins, slabs or memfds on the nodes, nothing in /dev/shm, and no Redis keys beyond
the namespace's config, the node registry and the id counters that keep ids from being reused.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import memfds, mp_context, shm_entries
from tests.soak.helpers import (
    await_nodes_empty,
    kill_all,
    leftover_keys,
    spawn_lean_nodes,
    stop_nodes,
    wait_until,
)
from tq_redis.errors import SampleNotFound, UnknownPartition

pytestmark = pytest.mark.soak

PARTITIONS = 24
PRODUCERS = 4
PER_PRODUCER = 32  # one insert per producer per partition: ~1 MiB, so it goes through shared memory
PER_PARTITION = PRODUCERS * PER_PRODUCER
TASKS = ("actor", "critic")
CONSUMERS_PER_TASK = 2
CONSUME_BATCH = 16
AHEAD = 4  # partitions a producer may run ahead of the cleaner
BLOB = 4096  # int64 words per sample: 32 KiB
FIELDS = ["origin", "blob", "tokens"]
STEP_TIMEOUT_S = 120.0


def _pid(k: int) -> str:
    return f"step_{k}"


def _blob(origin: torch.Tensor) -> torch.Tensor:
    """The dense field: a row per sample that only its origin produces."""
    return origin.unsqueeze(1) * BLOB + torch.arange(BLOB)


def _tokens(origin: int) -> torch.Tensor:
    """The jagged field: 1-61 values per sample, derived from its origin."""
    return origin * 1000 + torch.arange(1 + origin % 61)


def _batch(origins: torch.Tensor) -> TensorDict:
    tokens = torch.nested.nested_tensor([_tokens(int(o)) for o in origins], layout=torch.jagged)
    return TensorDict({"origin": origins, "blob": _blob(origins), "tokens": tokens}, batch_size=[len(origins)])


def _mismatch(data: TensorDict) -> str | None:
    """What is wrong with a fetched batch, or None when every sample's bytes are the ones put."""
    origin = data["origin"]
    if not torch.equal(data["blob"], _blob(origin)):
        return f"blob of origins {origin.tolist()} differs"
    for o, row in zip(origin.tolist(), data["tokens"].unbind()):
        if not torch.equal(row, _tokens(o)):
            return f"tokens of origin {o} differ: {row.tolist()[:8]}..."
    return None


def _producer(url: str, ns: str, rank: int, credits, out) -> None:
    """Insert PER_PRODUCER samples into every partition, in order, when a credit allows it."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns, nested_output=False)  # compares dense tensors
    placed: list[tuple[int, int, int]] = []  # (partition, global index, origin)
    for k in range(PARTITIONS):
        assert credits.acquire(timeout=STEP_TIMEOUT_S), f"producer {rank}: no credit for partition {k}"
        origins = torch.arange(PER_PRODUCER) + k * PER_PARTITION + rank * PER_PRODUCER
        meta = client.put(_batch(origins), partition_id=_pid(k))
        placed.extend((k, g, int(o)) for g, o in zip(meta.global_indexes, origins))
    out.put(("producer", rank, placed, None))
    client.close()


def _partition_done(client: Any, task: str, k: int, processed) -> bool:
    """Whether ``task`` has nothing left to claim in partition ``k``."""
    if processed[k] == PER_PARTITION:
        return True
    try:
        ids, status = client.get_consumption_status(task, _pid(k))
    except UnknownPartition:
        return False  # not created yet (a cleared one has processed == PER_PARTITION)
    return len(ids) == PER_PARTITION and bool(status.all())


def _consumer(url: str, ns: str, task: str, processed, out) -> None:
    """Drain every partition for ``task`` in order, checking bytes and counting processed samples."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns, nested_output=False)  # compares dense tensors
    seen: list[tuple[int, int, int]] = []
    problem = None
    for k in range(PARTITIONS):
        while True:
            meta = client.get_meta(FIELDS, CONSUME_BATCH, _pid(k), task_name=task, timeout=0.5)
            if meta.size == 0:
                if _partition_done(client, task, k, processed):
                    break
                continue
            data = client.get_data(meta)
            problem = problem or _mismatch(data)
            seen.extend((k, g, int(o)) for g, o in zip(meta.global_indexes, data["origin"]))
            del data  # releases the zero-copy views (their pins go back with the next request)
            with processed.get_lock():
                processed[k] += meta.size
    out.put(("consumer", task, seen, problem))
    client.close()


def _check_cleared_data_is_gone(client: Any, k: int) -> None:
    """Clear partition ``k`` and check that its samples' data can no longer be read."""
    everything = client.get_meta(FIELDS, 1, _pid(k), mode="force_fetch")
    assert everything.size == PER_PARTITION
    client.clear_partition(_pid(k))
    with pytest.raises(SampleNotFound, match="cleared"):
        client.get_data(everything)


def test_pipeline_over_dram_nodes_delivers_each_sample_once_and_clears_to_zero(real_server, namespace):
    url = real_server.url
    shm_before = shm_entries()
    nodes = spawn_lean_nodes(url, namespace, n=3, capacity="128MiB")
    ctx = mp_context()
    procs: list[Any] = []
    try:
        client = make_client(url, namespace, backend="dram")
        assert leftover_keys(url, namespace, []) == set()  # only the config and the node registry so far
        processed = {task: ctx.Array("i", PARTITIONS) for task in TASKS}
        credits = [ctx.Semaphore(AHEAD) for _ in range(PRODUCERS)]
        out = ctx.Queue()
        procs = [ctx.Process(target=_producer, args=(url, namespace, r, credits[r], out)) for r in range(PRODUCERS)]
        procs += [
            ctx.Process(target=_consumer, args=(url, namespace, task, processed[task], out))
            for task in TASKS
            for _ in range(CONSUMERS_PER_TASK)
        ]
        for p in procs:
            p.start()

        def step_processed(k: int) -> bool:
            crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not crashed, f"a pipeline process failed (exit codes {crashed})"
            return all(processed[task][k] >= PER_PARTITION for task in TASKS)

        for k in range(PARTITIONS):
            wait_until(lambda k=k: step_processed(k), STEP_TIMEOUT_S, f"both tasks to process {_pid(k)}")
            assert [processed[task][k] for task in TASKS] == [PER_PARTITION] * len(TASKS)
            _check_cleared_data_is_gone(client, k)
            for credit in credits:
                credit.release()

        results = [out.get(timeout=STEP_TIMEOUT_S) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0

        placed = {(k, g): o for kind, _, rows, _ in results if kind == "producer" for k, g, o in rows}
        assert len(placed) == PARTITIONS * PER_PARTITION
        assert sorted(placed.values()) == list(range(PARTITIONS * PER_PARTITION))
        for task in TASKS:
            rows = [row for kind, t, seen, _ in results if kind == "consumer" and t == task for row in seen]
            counts = Counter((k, g) for k, g, _ in rows)
            assert [s for s, c in counts.items() if c > 1] == [], f"{task}: samples handed out twice"
            assert set(counts) == set(placed), f"{task}: samples lost"
            assert all(placed[(k, g)] == o for k, g, o in rows), f"{task}: a sample came with another's origin"
        problems = [p for kind, _, _, p in results if kind == "consumer" and p]
        assert problems == [], problems

        # clearing gave everything back (pins of released views go back as the consumers close)
        stats = await_nodes_empty(url, namespace)
        assert len(stats) == 3 and all(s["slabs"] == 0 and s["slab_bytes"] == 0 for s in stats.values()), stats
        assert all(memfds(n.proc.pid) == set() for n in nodes)
        assert client.get_partition_list() == []
        assert leftover_keys(url, namespace, [_pid(k) for k in range(PARTITIONS)]) == set()
        seqs = client.redis.mget([f"{namespace}:{{{namespace}/{_pid(k)}}}:seq" for k in range(PARTITIONS)])
        assert [int(s) for s in seqs] == [PER_PARTITION] * PARTITIONS  # ids stay reserved
        client.close()
    finally:
        kill_all(procs)
        stop_nodes(nodes)
    assert [n.proc.returncode for n in nodes] == [0, 0, 0]  # a clean exit on SIGTERM
    assert shm_entries() - shm_before == set()
