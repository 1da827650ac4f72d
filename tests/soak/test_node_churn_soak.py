"""Soak: a DRAM storage node SIGKILLed and restarted over and over under a put/get/clear loop.

A worker thread inserts batches, claims them, reads them back and clears them, without pause,
through the real client. The test kills one of the two storage nodes at arbitrary points of that
loop, lets the worker run into the outage, and restarts the node (same id and port, empty memory);
the last outage also catches a clear. One churn run (a module fixture) feeds the tests below:

* every operation either succeeds -- with the bytes that were put -- or raises the typed
  ``StorageUnavailable`` naming the dead node; bytes may be missing only when their node
  restarted since they were put;
* a failed insert leaves no visible sample, a cleared sample stays gone, and after each restart
  the same client works again;
* once everything is cleared, neither node holds a byte, key or pin (invariant 4).
"""

from __future__ import annotations

import gc
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.soak.helpers import LEAN_NODE_ARGS, node_stats, poll, spawn_lean_nodes, stop_nodes, use_store, wait_until
from tq_redis import TransferQueueClient
from tq_redis.backends.dram.launcher import NodeProcess, spawn_node
from tq_redis.errors import DataMissing, StorageUnavailable
from tq_redis.meta import BatchMeta
from tq_redis.server.embedded import EmbeddedServer, free_port

pytestmark = pytest.mark.soak

NAMESPACE = "churn"
CYCLES = 10
BATCH = 16
BLOB = 8192  # int64 words per sample: 64 KiB, so a batch goes through shared memory
PARTITION = "churn"
FIELDS = ["origin", "blob"]
UP_SUCCESSES = 5  # loop iterations that must succeed with the node up before the next kill
DOWN_FAILURES = 3  # operations that must fail while it is down before it restarts
PHASE_TIMEOUT_S = 60.0


def _blob(origin: torch.Tensor) -> torch.Tensor:
    return origin.unsqueeze(1) * BLOB + torch.arange(BLOB)


def _batch(first_origin: int) -> TensorDict:
    origins = torch.arange(first_origin, first_origin + BATCH)
    return TensorDict({"origin": origins, "blob": _blob(origins)}, batch_size=[BATCH])


@dataclass
class _Churn:
    """Shared between the worker thread and the test: what happened, and the node's generation."""

    generation: int = 0  # how often the churned node was restarted
    stop: threading.Event = field(default_factory=threading.Event)
    successes: int = 0  # loop iterations that completed
    outcomes: Counter = field(default_factory=Counter)  # (operation, outcome) -> count
    unexpected: list[str] = field(default_factory=list)  # failures that are neither typed nor explained
    inconsistent: list[str] = field(default_factory=list)  # metadata that contradicts what succeeded
    unavailable_messages: set[str] = field(default_factory=set)
    put_ok: set[int] = field(default_factory=set)  # ids whose insert succeeded
    cleared: set[int] = field(default_factory=set)  # ids whose clear succeeded
    pending: list[BatchMeta] = field(default_factory=list)  # batches still to clear

    @property
    def unavailable(self) -> int:
        return sum(n for (_op, outcome), n in self.outcomes.items() if outcome == "unavailable")


def _attempt(churn: _Churn, op: str, fn: Callable[[], Any], *, missing_ok_since: int | None = None) -> tuple[bool, Any]:
    """Run one operation; anything but success or a typed, explained failure is recorded as unexpected."""
    try:
        result = fn()
    except StorageUnavailable as exc:
        churn.outcomes[(op, "unavailable")] += 1
        churn.unavailable_messages.add(str(exc))
        return False, None
    except DataMissing as exc:
        churn.outcomes[(op, "missing")] += 1
        if missing_ok_since is None or churn.generation == missing_ok_since:
            churn.unexpected.append(f"{op}: bytes missing though their node did not restart: {exc}")
        return False, None
    except Exception as exc:  # noqa: BLE001 - every other failure is a finding
        churn.unexpected.append(f"{op}: {type(exc).__name__}: {exc}")
        return False, None
    churn.outcomes[(op, "ok")] += 1
    return True, result


def _check_metadata(client: Any, churn: _Churn) -> None:
    """Only samples whose insert succeeded are alive, and none whose clear succeeded."""
    alive = set(client.get_meta(FIELDS, 1, PARTITION, mode="force_fetch").global_indexes)
    unexplained = alive - (churn.put_ok - churn.cleared)
    if unexplained:
        churn.inconsistent.append(f"alive samples {sorted(unexplained)[:10]} were never inserted or were cleared")


def _clear_pending(client: Any, churn: _Churn) -> bool:
    """Clear every batch not cleared yet (a clear that failed in an outage is retried); True if all went."""
    for meta in list(churn.pending):
        done, _ = _attempt(churn, "clear", lambda meta=meta: client.clear_samples(meta))
        if not done:
            return False
        churn.pending.remove(meta)
        churn.cleared.update(meta.global_indexes)
    return True


def _iteration(client: Any, churn: _Churn, first_origin: int) -> bool:
    """Insert, claim, read and clear one batch; True if every step succeeded."""
    generation = churn.generation
    td = _batch(first_origin)
    ok, put = _attempt(churn, "put", lambda: client.put(td, partition_id=PARTITION))
    if not ok:
        _check_metadata(client, churn)  # a failed insert must not leave visible samples
        return False
    churn.put_ok.update(put.global_indexes)
    claimed = client.get_meta(FIELDS, BATCH, PARTITION, task_name="reader")
    if claimed.global_indexes != put.global_indexes:
        churn.inconsistent.append(f"claimed {claimed.global_indexes}, not the batch just put {put.global_indexes}")
        return False
    churn.pending.append(claimed)
    ok, data = _attempt(churn, "get", lambda: client.get_data(claimed), missing_ok_since=generation)
    if ok and not (torch.equal(data["origin"], td["origin"]) and torch.equal(data["blob"], td["blob"])):
        churn.unexpected.append(f"get returned other bytes for origins {td['origin'].tolist()}")
    del data
    cleared = _clear_pending(client, churn)
    _check_metadata(client, churn)
    return ok and cleared


def _worker(url: str, churn: _Churn) -> None:
    """The put/get/clear loop, until told to stop."""
    client = TransferQueueClient(url, NAMESPACE, nested_output=False)  # compares dense tensors
    try:
        first_origin = 0
        while not churn.stop.is_set():
            if _iteration(client, churn, first_origin):
                churn.successes += 1
            first_origin += BATCH
    except Exception as exc:  # noqa: BLE001 - reported by the tests
        churn.unexpected.append(f"worker stopped: {type(exc).__name__}: {exc}")
    finally:
        client.close()


def _spawn_churned(url: str, port: int) -> NodeProcess:
    return spawn_node(
        url, NAMESPACE, capacity="128MiB", node_id="node-b", listen=f"127.0.0.1:{port}", extra_args=LEAN_NODE_ARGS
    )


def _kill(node: NodeProcess) -> None:
    node.proc.send_signal(signal.SIGKILL)
    node.stop()


@dataclass
class ChurnRun:
    """What one churn run left behind, for the tests to judge."""

    churn: _Churn
    node_ids: list[str]
    alive_after: int  # samples alive once the loop stopped and its pending clears were retried
    stats: dict[str, dict[str, Any]]  # the nodes after clearing everything


def _run_churn(url: str, port: int, churn: _Churn, nodes: list[NodeProcess]) -> None:
    """Kill and restart the churned node (``nodes[1]``) ``CYCLES`` times under the worker, then once more
    around a clear."""
    worker = threading.Thread(target=_worker, args=(url, churn), name="churn-worker")

    def await_worker(condition: Callable[[], bool], what: str) -> None:
        def reached() -> bool:
            assert worker.is_alive() and not churn.unexpected, churn.unexpected[:5]
            return condition()

        wait_until(reached, PHASE_TIMEOUT_S, f"{what} (outcomes so far: {dict(churn.outcomes)})")

    def await_good_iterations(what: str) -> None:
        target = churn.successes + UP_SUCCESSES
        await_worker(lambda: churn.successes >= target, f"{UP_SUCCESSES} good iterations {what}")

    worker.start()
    try:
        for cycle in range(CYCLES):
            await_good_iterations(f"before kill {cycle}")
            failures = churn.unavailable + DOWN_FAILURES
            _kill(nodes[1])
            await_worker(lambda f=failures: churn.unavailable >= f, f"the worker to run into outage {cycle}")
            nodes[1] = _spawn_churned(url, port)
            churn.generation += 1
        await_good_iterations("after the last restart")
    finally:
        churn.stop.set()
        worker.join(PHASE_TIMEOUT_S)
    assert not worker.is_alive(), "the worker did not stop"

    # one more outage, now with a clear in it: a batch is put, then read (which fails and drops the
    # connections to the dead node, as in any outage) and cleared while the node is down
    client = TransferQueueClient(url, NAMESPACE, nested_output=False)  # compares dense tensors
    try:
        meta = client.put(_batch(-BATCH), partition_id=PARTITION)
        churn.put_ok.update(meta.global_indexes)
        _kill(nodes[1])
        read, _ = _attempt(churn, "get", lambda: client.get_data(meta))
        assert not read, "a batch spread over both nodes was read while one was down"
        cleared, _ = _attempt(churn, "clear", lambda: client.clear_samples(meta))
        if cleared:
            churn.cleared.update(meta.global_indexes)
        else:
            churn.pending.append(meta)
        nodes[1] = _spawn_churned(url, port)
        churn.generation += 1
    finally:
        client.close()


@pytest.fixture(scope="module")
def churn_run() -> Iterator[ChurnRun]:
    """One churn run on its own Valkey and two storage nodes (``node-b`` is the one churned)."""
    server = EmbeddedServer().start()
    url = server.url
    nodes: list[NodeProcess] = []
    try:
        use_store(url, NAMESPACE, "dram", {"timeout_s": 2.0})
        nodes = spawn_lean_nodes(url, NAMESPACE, n=1, capacity="128MiB")
        port = free_port()
        nodes.append(_spawn_churned(url, port))
        churn = _Churn()
        _run_churn(url, port, churn, nodes)

        client = TransferQueueClient(url, NAMESPACE, nested_output=False)  # compares dense tensors
        _clear_pending(client, churn)  # what failed in the outages succeeds now
        alive_after = client.get_meta(FIELDS, 1, PARTITION, mode="force_fetch").size
        client.clear_partition(PARTITION)
        client.close()
        gc.collect()  # drop every view of node memory: its pins go back
        stats: dict[str, dict[str, Any]] = {}

        def nodes_empty() -> bool:
            stats.update(node_stats(url, NAMESPACE))
            return all(s["used"] == 0 and s["keys"] == 0 and s["pins"] == 0 for s in stats.values())

        poll(nodes_empty, 10)  # judged by the test below; here only given time to settle
        yield ChurnRun(churn, [n.node_id for n in nodes], alive_after, dict(stats))
    finally:
        stop_nodes(nodes)
        server.stop()


def test_every_operation_succeeds_or_raises_storage_unavailable_naming_the_node(churn_run: ChurnRun) -> None:
    churn = churn_run.churn
    assert churn.unexpected == [], churn.unexpected[:10]
    assert churn.generation == CYCLES + 1
    assert churn.outcomes[("put", "unavailable")] >= CYCLES  # every outage was felt
    assert churn.outcomes[("put", "ok")] >= (CYCLES + 1) * UP_SUCCESSES
    assert churn.outcomes[("get", "ok")] >= (CYCLES + 1) * UP_SUCCESSES
    assert churn.unavailable_messages and all("'node-b'" in m for m in churn.unavailable_messages), sorted(
        churn.unavailable_messages
    )[:3]


def test_metadata_stays_consistent_and_the_client_recovers(churn_run: ChurnRun) -> None:
    churn = churn_run.churn
    assert churn.inconsistent == [], churn.inconsistent[:10]
    assert churn.pending == []  # every clear that failed in an outage succeeded once retried
    assert churn_run.alive_after == 0  # so nothing is left alive
    assert len(churn.cleared) == len(churn.put_ok)


def test_clearing_after_the_outages_frees_every_byte_on_every_node(churn_run: ChurnRun) -> None:
    assert sorted(churn_run.stats) == sorted(churn_run.node_ids)
    held = {
        node: (s["keys"], s["used"], s["pins"])
        for node, s in churn_run.stats.items()
        if s["keys"] or s["used"] or s["pins"]
    }
    assert held == {}, f"(keys, bytes, pins) still held after every sample was cleared: {held}"
