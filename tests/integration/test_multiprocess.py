"""Invariants 1-4 with independent OS processes that know only the Redis URL and namespace."""

from __future__ import annotations

from collections import Counter

import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import drain, mp_context

PRODUCERS = 8
BATCHES_PER_PRODUCER = 6
BATCH = 16
TOTAL = PRODUCERS * BATCHES_PER_PRODUCER * BATCH
TASKS = ("actor", "critic")
CONSUMERS_PER_TASK = 4


def _payload(origin: torch.Tensor) -> torch.Tensor:
    return origin.unsqueeze(1) * 1000 + torch.arange(8)


def _producer(url: str, ns: str, rank: int, go) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    go.wait()
    for b in range(BATCHES_PER_PRODUCER):
        origin = torch.arange(BATCH) + (rank * BATCHES_PER_PRODUCER + b) * BATCH
        client.put(TensorDict({"origin": origin, "payload": _payload(origin)}, batch_size=[BATCH]),
                   partition_id="train")
    client.close()


def _consumer(url: str, ns: str, task: str, go, producers_done, out) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    go.wait()
    seen: list[int] = []
    bad = 0
    while True:
        meta = client.get_meta(["origin", "payload"], 8, "train", task_name=task, timeout=0.5)
        if meta.size:
            data = client.get_data(meta)
            # the default layout: per-sample rows come back as a jagged nested tensor
            bad += int(not torch.equal(data["payload"].to_padded_tensor(0), _payload(data["origin"])))
            seen.extend(meta.global_indexes)
        elif producers_done.is_set() and client.check_consumption_status(task, "train"):
            break
    out.put((task, seen, bad))
    client.close()


def test_many_producers_and_consumers_each_sample_once_per_task(real_server, namespace):
    make_client(real_server.url, namespace).close()  # records the store for the namespace
    ctx = mp_context()
    go, producers_done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    producers = [ctx.Process(target=_producer, args=(real_server.url, namespace, r, go)) for r in range(PRODUCERS)]
    consumers = [
        ctx.Process(target=_consumer, args=(real_server.url, namespace, task, go, producers_done, out))
        for task in TASKS
        for _ in range(CONSUMERS_PER_TASK)
    ]
    results = drain(producers, consumers, go, producers_done, out)

    for task in TASKS:
        ids = [i for t, seen, _ in results if t == task for i in seen]
        counts = Counter(ids)
        assert [i for i, c in counts.items() if c > 1] == [], f"{task}: samples handed out twice"
        assert sorted(counts) == list(range(TOTAL)), f"{task}: samples lost"
    assert sum(bad for _, _, bad in results) == 0, "bytes did not round-trip"


def _field_writer(url: str, ns: str, field: str, go, out) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    go.wait()
    meta = client.get_meta(["prompt"], 1, "p", mode="force_fetch")
    for chunk in meta.chunk(4):
        values = torch.tensor(chunk.global_indexes) * 10 + int(field[1:])
        client.put(TensorDict({field: values}, batch_size=[chunk.size]), metadata=chunk)
    out.put(field)
    client.close()


def test_concurrent_writers_of_different_fields_all_land(real_server, namespace):
    client = make_client(real_server.url, namespace)
    client.put(TensorDict({"prompt": torch.zeros(64, 2)}, batch_size=[64]), partition_id="p")
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    fields = [f"f{i}" for i in range(4)]
    writers = [ctx.Process(target=_field_writer, args=(real_server.url, namespace, f, go, out)) for f in fields]
    for w in writers:
        w.start()
    go.set()
    assert sorted(out.get(timeout=120) for _ in writers) == fields
    for w in writers:
        w.join(30)
        assert w.exitcode == 0
    assert client.check_production_status(["prompt", *fields], "p")
    meta = client.get_meta(["prompt", *fields], 64, "p", task_name="t")
    data = client.get_data(meta)
    ids = torch.tensor(meta.global_indexes)
    for f in fields:
        assert torch.equal(data[f], ids * 10 + int(f[1:]))
    client.close()
