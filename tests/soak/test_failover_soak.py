"""Soak: the Sentinel-managed primary SIGKILLed under producer and consumer processes; what is lost.

A primary, one replica and three Sentinels (quorum 2, primary declared down after 1 s) on loopback.
Producer processes insert batches and consumer processes claim them (fetch mode) through the
``redis+sentinel://`` URL while the test SIGKILLs the primary, waits for the promotion and brings
the old primary back as a replica. Every process must ride through on its own. Measured per durable
mode (``none`` and ``replicas:1``):

* acknowledged puts missing afterwards (a put that returned, whose samples the new primary lacks);
* samples handed to the task twice (a claim the replica never saw is made again);
* samples never delivered (a claim whose reply was lost with the primary);
* recovery: from the kill to the first acknowledged put after it.

Durable mode must lose nothing it acknowledged and hand nothing out twice; ``none`` is measured
and reported (loopback replication is fast, so its window is small, not closed). The figures are
printed and, with ``TQ_FAILOVER_REPORT=path``, appended to that file as JSON lines.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import mp_context
from tests.sentinel_setup import SentinelSetup, flavour_binary, poll
from tests.soak.helpers import assert_none_crashed, kill_all

pytestmark = pytest.mark.soak

PRODUCERS = 2
CONSUMERS = 2
PUT_BATCH = 4
CLAIM_BATCH = 4
TASK = "train"
PARTITION = "p"
BEFORE_KILL = 60  # acknowledged puts before the primary is killed
AFTER_KILL = 60  # ... and after the failover
TIMEOUT_S = 120.0


def _client(url: str, ns: str, durable: str):
    from tq_redis import TransferQueueClient
    from tq_redis.server import durability

    durability.declare(url, durable, 500)
    return TransferQueueClient(url, ns, nested_output=False)


def _producer(url: str, ns: str, durable: str, rank: int, stop, acked, out) -> None:
    """Insert batches until told to stop; report (finished at, ids, outcome) per put."""
    from tq_redis.errors import TQError
    from tq_redis.server.durability import NotDurable

    client = _client(url, ns, durable)
    puts: list[tuple[float, list[int], str]] = []
    b = 0
    while not stop.is_set():
        origin = torch.arange(PUT_BATCH) + (rank * 100_000 + b) * PUT_BATCH
        b += 1
        try:
            meta = client.put(TensorDict({"origin": origin}, batch_size=[PUT_BATCH]), partition_id=PARTITION)
            puts.append((time.time(), list(meta.global_indexes), "ok"))
            with acked.get_lock():
                acked.value += 1
        except NotDurable as exc:
            puts.append((time.time(), list(exc.result.global_indexes), "not_durable"))
        except TQError as exc:
            puts.append((time.time(), [], f"error: {type(exc).__name__}: {str(exc)[:300]}"))
    out.put(("producer", puts))
    client.close()


def _consumer(url: str, ns: str, durable: str, stop, out) -> None:
    """Claim until the producers stopped and the task consumed everything; report (at, ids, outcome)."""
    from tq_redis.errors import TQError
    from tq_redis.server.durability import NotDurable

    client = _client(url, ns, durable)
    claims: list[tuple[float, list[int], str]] = []
    while True:
        try:
            meta = client.get_meta(["origin"], CLAIM_BATCH, PARTITION, task_name=TASK, timeout=0.2)
            if meta.size:
                claims.append((time.time(), list(meta.global_indexes), "ok"))
            elif stop.is_set() and client.check_consumption_status(TASK, PARTITION):
                break
        except NotDurable as exc:  # a claim is handed back at once: nothing was handed out
            assert exc.result is None or exc.result.size == 0, exc  # (or a claim that found nothing)
            claims.append((time.time(), [], "not_durable"))
        except TQError as exc:
            claims.append((time.time(), [], f"error: {type(exc).__name__}: {str(exc)[:300]}"))
    out.put(("consumer", claims))
    client.close()


def _figures(flavour: str, durable: str, killed_at: float, failover_s: float, results: list, present: set[int]
             ) -> dict[str, Any]:
    puts = [p for kind, rows in results if kind == "producer" for p in rows]
    claims = [c for kind, rows in results if kind == "consumer" for c in rows]
    acked = {i for _, ids, outcome in puts if outcome == "ok" for i in ids}
    delivered = Counter(i for _, ids, _ in claims for i in ids)
    acks = sorted(t for t, _, outcome in puts if outcome == "ok")
    # the outage producers saw: the longest time without an acknowledged put, around the kill
    gaps = [b - a for a, b in zip(acks, acks[1:]) if b > killed_at and a < killed_at + 60]
    errors = sorted({o for _, _, o in puts + claims if o.startswith("error")})
    return {
        "flavour": flavour, "durable": durable,
        "puts_acknowledged": sum(o == "ok" for _, _, o in puts),
        "puts_not_durable": sum(o == "not_durable" for _, _, o in puts),
        "puts_failed": sum(o.startswith("error") for _, _, o in puts),
        "claims_not_durable": sum(o == "not_durable" for _, _, o in claims),
        "claims_failed": sum(o.startswith("error") for _, _, o in claims),
        "acknowledged_samples_lost": len(acked - present),
        "samples_claimed_twice": sum(1 for c in delivered.values() if c > 1),
        "samples_never_delivered": len(present - set(delivered)),
        "failover_s": round(failover_s, 2),
        "recovery_s": round(max(gaps), 2) if gaps else None,
        "errors": errors,
    }


@pytest.mark.parametrize("durable", ["none", "replicas:1"])
@pytest.mark.parametrize("flavour", ["redis7", "valkey"])
def test_failover_under_load(flavour, durable, namespace, tmp_path):
    ha = SentinelSetup(flavour_binary(flavour), tmp_path, sentinels=3, quorum=2).start()
    ctx = mp_context()
    procs: list[Any] = []
    try:
        url = ha.url
        make_client(url, namespace).close()  # records the store (Redis itself) for the namespace
        stop_producers, stop_consumers, acked, out = ctx.Event(), ctx.Event(), ctx.Value("i", 0), ctx.Queue()
        producers = [ctx.Process(target=_producer, args=(url, namespace, durable, r, stop_producers, acked, out))
                     for r in range(PRODUCERS)]
        consumers = [ctx.Process(target=_consumer, args=(url, namespace, durable, stop_consumers, out))
                     for _ in range(CONSUMERS)]
        procs = producers + consumers
        for p in procs:
            p.start()

        def progressed(target: int) -> bool:
            assert_none_crashed(procs)
            return acked.value >= target

        poll(lambda: progressed(BEFORE_KILL), TIMEOUT_S, f"{BEFORE_KILL} acknowledged puts")
        killed_at = time.time()
        old = ha.kill_primary()
        ha.wait_failover(old)
        failover_s = time.time() - killed_at
        ha.restart(old)  # back as a replica of the new primary: durable writes can be confirmed again
        target = acked.value + AFTER_KILL
        poll(lambda: progressed(target), TIMEOUT_S, f"{AFTER_KILL} puts after the failover")
        stop_producers.set()
        results = [out.get(timeout=TIMEOUT_S) for _ in producers]
        stop_consumers.set()
        results += [out.get(timeout=TIMEOUT_S) for _ in consumers]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0

        client = make_client(url, namespace)
        present = set(client.get_meta(["origin"], 1, PARTITION, mode="force_fetch").global_indexes)
        client.close()
        figures = _figures(flavour, durable, killed_at, failover_s, results, present)
        print("\nfailover figures:", json.dumps(figures))
        if os.environ.get("TQ_FAILOVER_REPORT"):
            with open(os.environ["TQ_FAILOVER_REPORT"], "a") as f:
                f.write(json.dumps(figures) + "\n")
        assert figures["recovery_s"] is not None and figures["recovery_s"] < 30
        if durable != "none":
            assert figures["acknowledged_samples_lost"] == 0, figures
            assert figures["samples_claimed_twice"] == 0, figures
    finally:
        kill_all(procs)
        ha.stop()
