"""seal_partition and StreamingDataset / StreamingDataLoader: each rank pulls its own micro-batches
and the iteration ends once the partition is sealed and drained."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis.integrations.dataloader import default_fetch_batch_fn


def _conf(server, namespace: str) -> dict:
    return {"redis": {"url": server.url}, "namespace": namespace}


def _put(client, partition: str, start: int, n: int) -> None:
    x = torch.arange(start, start + n)
    lengths = [int(i) % 3 + 1 for i in x]
    resp = torch.nested.nested_tensor([torch.full((k,), int(i)) for i, k in zip(x, lengths)], layout=torch.jagged)
    client.put(TensorDict({"x": x, "resp": resp}, batch_size=[n]), partition_id=partition)


def _check(td, meta) -> list[int]:
    """The rows' values (and that every jagged row came back intact)."""
    for value, row in zip(td["x"].tolist(), td["resp"].unbind()):
        assert row.tolist() == [value] * (value % 3 + 1)
    return td["x"].tolist()


def test_seal_partition(server, namespace):
    client = make_client(server.url, namespace)
    assert client.seal_partition("p") is True
    assert client.seal_partition("p") is False
    assert "p" in client.get_partition_list()
    assert client.redis.hget(f"{namespace}:{{{namespace}/p}}:meta", "sealed") == b"1"
    client.close()


def test_micro_batches_until_sealed_and_drained(server, namespace):
    client = make_client(server.url, namespace)
    _put(client, "p", 0, 10)
    client.seal_partition("p")
    ds = tq.StreamingDataset(_conf(server, namespace), 4, 2, ["x", "resp"], "p", "train", dp_rank=0)
    batches = [(td, meta) for td, meta in ds]
    assert [meta.size for _, meta in batches] == [2, 2, 2, 2, 2]  # 4 + 4 + the last 2 (a partial batch)
    seen = [v for td, meta in batches for v in _check(td, meta)]
    assert seen == list(range(10))
    assert all(meta.global_indexes == _check(td, meta) for td, meta in batches)  # meta rows match data
    # reset() replays the buffered batches; nothing new is claimed
    ds.reset()
    assert [v for td, _ in ds for v in td["x"].tolist()] == list(range(10))
    # drop_last leaves the tail that cannot fill a batch
    dropping = tq.StreamingDataset(_conf(server, namespace), 4, 4, ["x"], "p", "other", drop_last=True)
    assert [td["x"].tolist() for td, _ in dropping] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    ds.close()
    dropping.close()
    client.close()


def test_blocked_loader_wakes_on_data_and_ends_on_seal(real_server, namespace):
    client = make_client(real_server.url, namespace)
    ds = tq.StreamingDataset(_conf(real_server, namespace), 3, 3, ["x", "resp"], "p", "train", 0)
    got: list[int] = []
    done = threading.Event()

    def consume():
        for td, meta in ds:
            got.extend(_check(td, meta))
        done.set()

    def blocked() -> bool:
        return any(e.get("cmd") == "xread" and "b" in e.get("flags", "") for e in client.redis.client_list())

    thread = threading.Thread(target=consume)
    thread.start()
    for start in (0, 3):
        deadline = time.monotonic() + 5
        while not blocked() and time.monotonic() < deadline:
            time.sleep(0.005)  # polling an observable condition, not synchronising on time
        assert blocked(), "the loader never blocked on the event stream"
        _put(client, "p", start, 3)
    _put(client, "p", 6, 2)
    assert not done.is_set()
    client.seal_partition("p")
    thread.join(10)
    assert done.is_set() and got == list(range(8))
    ds.close()
    client.close()


def test_finite_mode_custom_fetch_and_step(server, namespace):
    client = make_client(server.url, namespace)
    _put(client, "a", 0, 4)
    _put(client, "b", 100, 2)
    calls = []

    def fetch(**kw):
        calls.append(kw["batch_index"])
        return default_fetch_batch_fn(**kw)

    ds = tq.StreamingDataset(_conf(server, namespace), 2, 2, ["x"], "a", "t", 0,
                             should_check_consumption_status=True, fetch_batch_fn=fetch)
    assert [td["x"].tolist() for td, _ in ds] == [[0, 1], [2, 3]]  # not sealed: ends once all consumed
    assert calls == [0, 1, 2]  # the third finds nothing, and the partition is consumed
    ds.step("b")
    assert [td["x"].tolist() for td, _ in ds] == [[100, 101]]
    with pytest.raises(TimeoutError):
        next(iter(tq.StreamingDataset(_conf(server, namespace), 2, 2, ["x"], "never", "t", 0, timeout=0.1)))
    ds.close()
    client.close()


def _producer(url: str, ns: str, go) -> None:
    client = tq.TransferQueueClient(url, ns)
    go.wait()
    for start in range(0, 48, 6):
        _put(client, "stream", start, 6)
    client.seal_partition("stream")
    client.close()


def _rank(url: str, ns: str, rank: int, go, out) -> None:
    ds = tq.StreamingDataset({"redis": {"url": url}, "namespace": ns}, 4, 2, ["x", "resp"], "stream", "train", rank)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    go.wait()
    seen = []
    for td, meta in loader:
        assert meta.global_indexes == _check(td, meta)
        seen.extend(meta.global_indexes)
    out.put(seen)


def test_ranks_with_worker_processes_each_sample_once(real_server, namespace):
    make_client(real_server.url, namespace).close()
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_producer, args=(real_server.url, namespace, go))]
    procs += [ctx.Process(target=_rank, args=(real_server.url, namespace, r, go, out)) for r in range(2)]
    for p in procs:
        p.start()
    go.set()
    seen = [out.get(timeout=60) for _ in range(2)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    everything = seen[0] + seen[1]
    assert sorted(everything) == list(range(48))  # at most once, and nothing lost
