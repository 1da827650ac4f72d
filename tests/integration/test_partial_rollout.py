"""Partial rollout: a response appended in parts across calls, each part with its policy version,
claimable only once marked complete, on every server flavour, with parts inline or in the store.

A producer SIGKILLed between storing a part's bytes and recording it leaves nothing visible and
nothing behind after a clear; an unfinished sample carried into the next step keeps its parts
where they are (no copy).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis.errors import InvalidArgument, SampleComplete
from tq_redis.meta.keys import PartitionKeys

DEADLINE_S = 60.0


def _data_keys(client, pk: PartitionKeys) -> list[bytes]:
    """The store's keys of the partition (the ``redis`` store keeps them in the same server)."""
    return sorted(client.redis.scan_iter(match=f"{pk.prefix}d:*", count=1000))


def _jagged(rows: list[list[int]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.int64) for r in rows], layout=torch.jagged)


def _prompts(client, n: int, pid: str = "p"):
    return client.put(TensorDict({"prompt": torch.arange(n).reshape(n, 1)}, batch_size=[n]), partition_id=pid)


def _rows(value) -> list[list[int]]:
    return [r.tolist() for r in (value.unbind() if value.is_nested else value)]


@pytest.fixture(params=["store", "inline"])
def pclient(request, server, namespace):
    c = make_client(server.url, namespace, inline_max_bytes=4096 if request.param == "inline" else 0)
    yield c
    c.close()


def test_parts_read_back_in_order_with_their_versions_and_only_once_complete(pclient):
    meta = _prompts(pclient, 3)
    pclient.append_parts(meta, {"responses": _jagged([[1, 2], [3], [4, 5, 6]])}, policy_version=0)
    # an incomplete sample is never claimable, however many parts it has
    assert pclient.get_meta(["prompt", "responses"], 1, "p", task_name="train").size == 0
    pclient.append_parts(meta, {"responses": _jagged([[7], [8, 9], [10]])}, policy_version=1)
    assert pclient.get_meta(["prompt", "responses"], 1, "p", task_name="train").size == 0
    # the last part marks two samples complete; the third keeps generating
    done = pclient.append_parts(meta[0:2], {"responses": torch.tensor([[11, 12], [13, 14]])}, 3, complete=True)
    assert list(done.production_status) == [1, 1]
    got = pclient.get_meta(["prompt", "responses"], 3, "p", task_name="train")
    assert got.size == 0  # never a partial batch: the third sample is not complete
    got = pclient.get_meta(["prompt", "responses"], 2, "p", task_name="train")
    assert list(got.global_indexes) == [0, 1]
    data = pclient.get_data(got)
    assert _rows(data["responses"]) == [[1, 2, 7, 11, 12], [3, 8, 9, 13, 14]]
    assert _rows(data["responses~version"]) == [[0, 0, 1, 3, 3], [0, 1, 1, 3, 3]]
    assert data["prompt"].tolist() == [[0], [1]]
    with pytest.raises(SampleComplete) as err:  # a completed response never changes
        pclient.append_parts(meta, {"responses": torch.ones(3, 1, dtype=torch.int64)}, 4)
    assert err.value.field == "responses" and err.value.ids == [0, 1]
    assert pclient.get_meta(["responses"], 1, "p", task_name="train").size == 0  # nothing appended to 2
    pclient.complete_parts(meta[2:3], ["responses"])
    data = pclient.get_data(pclient.get_meta(["responses"], 1, "p", task_name="train"))
    assert _rows(data["responses"]) == [[4, 5, 6, 10]] and _rows(data["responses~version"]) == [[0, 0, 0, 1]]
    # the claim that returns its inline values reads the parts too
    again, data = pclient.get_meta_and_data(["prompt", "responses"], 3, "p", task_name="again")
    assert _rows(data["responses"])[2] == [4, 5, 6, 10]


def test_bad_appends_get_typed_errors_and_write_nothing(pclient):
    meta = _prompts(pclient, 2)
    with pytest.raises(InvalidArgument, match="policy_version"):
        pclient.append_parts(meta, {"responses": torch.ones(2, 1)}, -1)
    with pytest.raises(InvalidArgument, match="~"):
        pclient.append_parts(meta, {"responses~0": torch.ones(2, 1)}, 0)
    with pytest.raises(InvalidArgument, match="never appended"):
        pclient.complete_parts(meta, ["prompt"])
    with pytest.raises(InvalidArgument):
        pclient.append_parts(meta, {"responses": torch.ones(3, 1)}, 0)
    assert pclient.get_production_status(["prompt"], "p") is not None
    assert not pclient.redis.hexists(pclient.context.keys("p").fields, "responses")


_APPENDER = textwrap.dedent("""
    import sys
    import torch
    from tests.conftest import make_client
    from tests.procs import hang_after_store_put

    client = make_client(sys.argv[1], sys.argv[2])
    meta = client.get_meta(["prompt"], 4, "p", mode="force_fetch")
    client.append_parts(meta, {"responses": torch.ones(4, 8, dtype=torch.int64)}, 0)  # part 0, recorded
    hang_after_store_put(client)  # the test SIGKILLs this process there: bytes stored, part never recorded
    client.append_parts(meta, {"responses": torch.full((4, 8), 2, dtype=torch.int64)}, 1, complete=True)
""")


def test_a_sigkilled_appender_leaves_no_visible_part_and_no_bytes_after_a_clear(valkey, namespace):
    # one real server: a process start (torch's import) is most of this test's time, and the
    # scripts it runs are covered on every flavour by the tests above
    client = make_client(valkey.url, namespace)
    try:
        pk = client.context.keys("p")
        meta = _prompts(client, 4)
        proc = subprocess.Popen(
            [sys.executable, "-c", _APPENDER, valkey.url, namespace],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
        )
        try:
            assert proc.stdout.readline().strip() == "stored"
            assert len(_data_keys(client, pk)) == 4 + 4 + 4  # prompts, part 0, the unrecorded part 1
            proc.send_signal(signal.SIGKILL)
            proc.wait(DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert client.get_meta(["responses"], 1, "p", task_name="t").size == 0  # never completed
        # the recorded state is the old one: part 0 only (the killed part is no part of any sample)
        client.complete_parts(meta, ["responses"])
        data = client.get_data(client.get_meta(["responses"], 4, "p", task_name="t"))
        assert _rows(data["responses"]) == [[1] * 8] * 4 and _rows(data["responses~version"]) == [[0] * 8] * 4
        client.clear_partition("p")
        assert _data_keys(client, pk) == []
        assert not client.redis.exists(pk.trash, pk.trash_fields)
    finally:
        client.close()


def test_an_unfinished_sample_carried_into_the_next_step_is_not_copied(real_server, namespace):
    client = make_client(real_server.url, namespace)
    try:
        pk = client.context.keys("p")
        meta = _prompts(client, 4)
        client.append_parts(meta, {"responses": torch.arange(32).reshape(4, 8)}, 0)
        client.complete_parts(meta[0:2], ["responses"])
        # step 1 trains the two complete samples and clears them; the other two stay and age
        step1 = client.get_meta(["responses"], 2, "p", task_name="train")
        assert list(step1.global_indexes) == [0, 1]
        client.get_data(step1)
        client.clear_samples(step1)
        kept = {k: client.redis.get(k) for k in _data_keys(client, pk)}
        assert len(kept) == 2 + 2  # the unfinished samples' prompts and first parts, nothing else
        # step 2 (a new policy) finishes them: the first parts stay where they were, untouched
        client.append_parts(meta[2:4], {"responses": torch.full((2, 4), -1)}, 1, complete=True)
        after = {k: client.redis.get(k) for k in _data_keys(client, pk)}
        assert len(after) == 2 + 2 + 2 and all(after[k] == v for k, v in kept.items())
        data = client.get_data(client.get_meta(["responses"], 2, "p", task_name="train"))
        assert _rows(data["responses"]) == [list(range(16, 24)) + [-1] * 4, list(range(24, 32)) + [-1] * 4]
        assert _rows(data["responses~version"]) == [[0] * 8 + [1] * 4] * 2
    finally:
        client.close()


@pytest.mark.parametrize("backend", ["redis", "dram"])
def test_appended_parts_survive_a_checkpoint(tmp_path, namespace, backend):
    import tq_redis as tq

    storage = {"backend": backend, "units": 1, "unit_capacity": "64MiB", "inline_max_bytes": 0}
    tq.init({"namespace": namespace, "storage": storage})
    try:
        client = tq.get_client()
        meta = client.put({"prompt": torch.ones(2, 2)}, partition_id="p")
        client.append_parts(meta, {"responses": _jagged([[1, 2], [3]])}, 0)
        client.append_parts(meta[0:1], {"responses": _jagged([[4]])}, 1, complete=True)
        tq.save_checkpoint(tmp_path / "ckpt")
        client.clear_partition("p")
        tq.load_checkpoint(tmp_path / "ckpt")
        data = client.get_data(client.get_meta(["responses"], 1, "p", task_name="t"))
        assert _rows(data["responses"]) == [[1, 2, 4]] and _rows(data["responses~version"]) == [[0, 0, 1]]
        client.append_parts(meta[1:2], {"responses": _jagged([[5, 6]])}, 2, complete=True)  # still in progress
        data = client.get_data(client.get_meta(["responses"], 1, "p", task_name="t"))
        assert _rows(data["responses"]) == [[3, 5, 6]] and _rows(data["responses~version"]) == [[0, 2, 2]]
    finally:
        tq.close()


_CONCURRENT_APPENDER = textwrap.dedent("""
    import sys
    import torch
    from tests.conftest import make_client

    client = make_client(sys.argv[1], sys.argv[2])
    worker = int(sys.argv[3])
    meta = client.get_meta(["prompt"], 4, "p", mode="force_fetch")
    for j in range(int(sys.argv[4])):  # every worker appends to the same samples: parts interleave
        value = worker * 1000 + j
        client.append_parts(meta, {"responses": torch.full((4, 600), value, dtype=torch.int64)}, worker)
    print("done", flush=True)
""")


@pytest.mark.soak  # two process starts: ~10 s on a quiet machine, a minute on a loaded one
def test_concurrent_appenders_of_the_same_samples_lose_and_duplicate_no_part(real_server, namespace):
    client = make_client(real_server.url, namespace)  # parts of 4.8 KB: the store path (alloc, store, record)
    try:
        meta = _prompts(client, 4)
        workers, parts = 2, 6
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _CONCURRENT_APPENDER, real_server.url, namespace, str(w), str(parts)],
                stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
            )
            for w in range(workers)
        ]
        for proc in procs:
            assert proc.stdout.readline().strip() == "done"
            assert proc.wait(DEADLINE_S) == 0
        client.complete_parts(meta, ["responses"])
        data = client.get_data(client.get_meta(["responses"], 4, "p", task_name="t"))
        for row, versions in zip(data["responses"].unbind(), data["responses~version"].unbind()):
            values = row.view(-1, 600)[:, 0].tolist()
            assert sorted(values) == sorted(w * 1000 + j for w in range(workers) for j in range(parts))
            for w in range(workers):  # each worker's parts in its own order, with its version
                mine = [v for v in values if v // 1000 == w]
                assert mine == sorted(mine)
            assert versions.tolist() == [v // 1000 for v in values for _ in range(600)]
            assert all(torch.equal(part, torch.full((600,), part[0])) for part in row.view(-1, 600))
    finally:
        client.close()


def test_the_async_client_appends_completes_and_reads(valkey, namespace):
    import asyncio

    from tq_redis import AsyncTransferQueueClient

    make_client(valkey.url, namespace, inline_max_bytes=4096).close()  # records the namespace's store
    aclient = AsyncTransferQueueClient(valkey.url, namespace, nested_output=False)

    async def main():
        meta = await aclient.async_put(TensorDict({"prompt": torch.ones(2, 1)}, [2]), partition_id="p")
        await aclient.async_append_parts(meta, {"responses": torch.ones(2, 2, dtype=torch.int64)}, 0)
        await aclient.async_complete_parts(meta, ["responses"])
        got = await aclient.async_get_meta(["responses"], 2, "p", task_name="t")
        data = await aclient.async_get_data(got)
        assert data["responses"].tolist() == [[1, 1], [1, 1]] and data["responses~version"].tolist() == [[0, 0]] * 2
        await aclient.async_close()

    asyncio.run(main())
