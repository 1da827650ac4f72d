"""Soak: the Redis server SIGKILLed and restarted from its AOF, again and again, under load.

Producer and consumer processes stream samples (bytes in Redis itself, so they are as durable as
the metadata) while the test kills the server and restarts it on the same port from its
append-only file (``appendfsync always``). The clients must ride through every restart on their
own (reconnect with backoff), every sample a put returned must survive with its bytes, no sample
may be handed to the task twice, and the task must drain the partition.

A claim whose reply is lost in the crash is marked consumed but never reaches its consumer (fetch
mode is at most once), so at most one batch per consumer and restart may go undelivered.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import aof_server, make_client
from tests.procs import mp_context
from tests.soak.helpers import assert_none_crashed, kill_all, wait_until

pytestmark = pytest.mark.soak

RESTARTS = 5
PRODUCERS = 3
PUTS_PER_PRODUCER = 60
PUT_BATCH = 8
TOTAL = PRODUCERS * PUTS_PER_PRODUCER * PUT_BATCH
CONSUMERS = 4
CLAIM_BATCH = 8
TASK = "train"
PARTITION = "p"
TIMEOUT_S = 120.0


def _payload(origin: torch.Tensor) -> torch.Tensor:
    return origin.unsqueeze(1) * 64 + torch.arange(64)


def _producer(url: str, ns: str, rank: int, produced, out) -> None:
    """Insert PUTS_PER_PRODUCER batches; report the ids each successful put returned."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns, nested_output=False)  # compares dense tensors
    placed: list[tuple[int, int]] = []  # (global index, origin)
    for b in range(PUTS_PER_PRODUCER):
        origin = torch.arange(PUT_BATCH) + (rank * PUTS_PER_PRODUCER + b) * PUT_BATCH
        meta = client.put(TensorDict({"origin": origin, "payload": _payload(origin)}, batch_size=[PUT_BATCH]),
                          partition_id=PARTITION)
        placed.extend(zip(meta.global_indexes, origin.tolist()))
        with produced.get_lock():
            produced.value += PUT_BATCH
    out.put(("producer", placed, 0))
    client.close()


def _consumer(url: str, ns: str, producers_done, out) -> None:
    """Claim and read until the producers are done and the task has consumed everything."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns, nested_output=False)  # compares dense tensors
    seen: list[tuple[int, int]] = []
    bad = 0
    while True:
        meta = client.get_meta(["origin", "payload"], CLAIM_BATCH, PARTITION, task_name=TASK, timeout=0.3)
        if meta.size:
            data = client.get_data(meta)
            bad += int(not torch.equal(data["payload"], _payload(data["origin"])))
            seen.extend(zip(meta.global_indexes, data["origin"].tolist()))
        elif producers_done.is_set() and client.check_consumption_status(TASK, PARTITION):
            break
    out.put(("consumer", seen, bad))
    client.close()


@pytest.mark.parametrize("flavour", ["valkey", "redis7"])
def test_clients_ride_through_repeated_redis_crashes_without_losing_or_repeating(flavour, namespace, tmp_path):
    server = aof_server(flavour, tmp_path)
    ctx = mp_context()
    procs: list[Any] = []
    try:
        url = server.url
        make_client(url, namespace).close()  # records the store (Redis itself) for the namespace
        produced, producers_done, out = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
        producers = [ctx.Process(target=_producer, args=(url, namespace, r, produced, out)) for r in range(PRODUCERS)]
        consumers = [
            ctx.Process(target=_consumer, args=(url, namespace, producers_done, out)) for _ in range(CONSUMERS)
        ]
        procs = producers + consumers
        for p in procs:
            p.start()

        def progressed(target: int) -> bool:
            assert_none_crashed(procs)
            return produced.value >= target

        for i in range(RESTARTS):
            target = (i + 1) * TOTAL // (RESTARTS + 1)
            wait_until(lambda t=target: progressed(t), TIMEOUT_S, f"{target} samples put before crash {i}")
            server.kill()
            server = aof_server(flavour, tmp_path, port=server.port)
        for p in producers:
            p.join(TIMEOUT_S)
            assert p.exitcode == 0
        producers_done.set()
        results = [out.get(timeout=TIMEOUT_S) for _ in procs]
        for p in consumers:
            p.join(30)
            assert p.exitcode == 0

        placed = dict(pair for kind, rows, _ in results if kind == "producer" for pair in rows)
        assert len(placed) == TOTAL and sorted(placed.values()) == list(range(TOTAL))  # ids never reused
        delivered = [pair for kind, rows, _ in results if kind == "consumer" for pair in rows]
        counts = Counter(g for g, _ in delivered)
        assert [g for g, c in counts.items() if c > 1] == [], "a sample was handed to the task twice"
        assert all(placed.get(g) == o for g, o in delivered), "a delivered sample is not one a put returned"
        assert sum(bad for kind, _, bad in results if kind == "consumer") == 0, "bytes did not round-trip"

        client = make_client(url, namespace)
        everything = client.get_meta(["origin", "payload"], 1, PARTITION, mode="force_fetch")
        assert set(placed) <= set(everything.global_indexes), "samples a put returned were lost in a crash"
        data = client.get_data(everything)
        assert dict(zip(everything.global_indexes, data["origin"].tolist())) == placed
        assert torch.equal(data["payload"], _payload(data["origin"]))
        assert client.check_consumption_status(TASK, PARTITION)
        undelivered = set(placed) - set(counts)
        assert len(undelivered) <= RESTARTS * CONSUMERS * CLAIM_BATCH, f"{len(undelivered)} samples never delivered"
        client.close()
    finally:
        kill_all(procs)
        server.stop(remove_data=False)
