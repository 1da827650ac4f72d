"""Group reservations (reserve / commit / abort) and staleness admission, on every server flavour.

A producer reserves a prompt group's ids with a lease on the server's clock; nothing of it is
visible until its commit makes the whole group alive in one script; an abort or a lapsed lease
(a producer SIGKILLed mid-commit) frees it and deletes its bytes; a reservation commits at most
once. Under a staleness bound a reservation is admitted only while the samples reserved and not
freed stay within (version + max_lag + 1) * batch, and the trainer's version bump wakes blocked
reservers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis import ops
from tq_redis.errors import (
    BatchSizeMismatch,
    InvalidArgument,
    PartitionSealed,
    ReservationLost,
    StalenessExceeded,
)
from tq_redis.meta.keys import PartitionKeys
from tq_redis.ops import transitions

DEADLINE_S = 60.0  # generous: a loaded machine is slow, and nothing here waits on it unless it must


def _group(n: int, base: int = 0) -> TensorDict:
    return TensorDict({"x": torch.arange(base, base + n * 3).reshape(n, 3), "y": torch.ones(n, 2)}, batch_size=[n])


def _data_keys(client, pk: PartitionKeys) -> list[bytes]:
    """The store's keys of the partition (the ``redis`` store keeps them in the same server)."""
    return sorted(client.redis.scan_iter(match=f"{pk.prefix}d:*", count=1000))


def _server_ms(client) -> int:
    seconds, micros = client.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _until_lapsed(client, deadline_ms: int) -> None:
    """Wait until the server's clock is past ``deadline_ms`` (the server decides every lease)."""
    limit = time.monotonic() + DEADLINE_S
    while _server_ms(client) <= deadline_ms:
        assert time.monotonic() < limit, "the server's clock did not pass the lease deadline"


def _claim_all(client, pid: str, task: str = "t") -> list[int]:
    got: list[int] = []
    while True:
        meta = client.get_meta(["x"], 1, pid, task_name=task)
        if meta.size == 0:
            return got
        got += list(meta.global_indexes)


@pytest.fixture(params=["store", "inline"])
def rclient(request, server, namespace):
    c = make_client(server.url, namespace, inline_max_bytes=4096 if request.param == "inline" else 0)
    yield c
    c.close()


def test_nothing_is_visible_until_the_commit_makes_the_whole_group_visible(rclient):
    r = rclient.reserve_group("p", 4, lease_s=300, policy_version=3)
    assert r.size == 4 and r.policy_version == 3
    assert rclient.get_meta(["x"], 1, "p", task_name="t").size == 0
    assert "p" not in rclient.get_partition_list()
    meta = rclient.commit_group(r, _group(4), end_policy_version=5)
    assert list(meta.global_indexes) == r.global_indexes
    got = rclient.get_meta(["x", "y"], 4, "p", task_name="t")
    assert list(got.global_indexes) == r.global_indexes
    assert [m["policy_version"] for m in got.custom_meta] == [3] * 4
    assert [m["policy_version_end"] for m in got.custom_meta] == [5] * 4
    assert torch.equal(rclient.get_data(got)["x"], _group(4)["x"])
    assert "p" in rclient.get_partition_list()
    # consumers keep min_policy_version on the start version
    r2 = rclient.reserve_group("p", 2, policy_version=1)
    rclient.commit_group(r2, _group(2))
    fresh = {"min_policy_version": 2}
    got = rclient.get_meta(["x"], 4, "p", task_name="u", sampling_config=fresh)
    assert list(got.global_indexes) == r.global_indexes
    assert rclient.get_meta(["x"], 1, "p", task_name="u", sampling_config=fresh).size == 0


def test_a_commit_after_abort_or_lapse_fails_and_leaves_nothing(rclient):
    pk = rclient.context.keys("p")
    r = rclient.reserve_group("p", 3)
    assert rclient.abort_group(r) is True
    assert rclient.abort_group(r) is False
    with pytest.raises(ReservationLost):
        rclient.commit_group(r, _group(3))
    with pytest.raises(ReservationLost):
        rclient.extend_reservation(r, 10)
    lapsing = rclient.reserve_group("p", 3, lease_s=0.001)
    _until_lapsed(rclient, lapsing.deadline_ms)
    with pytest.raises(ReservationLost):
        rclient.commit_group(lapsing, _group(3))
    assert _claim_all(rclient, "p") == []
    assert _data_keys(rclient, pk) == []
    assert not rclient.redis.exists(pk.trash, pk.resv, pk.resvdl)
    assert "p" not in rclient.get_partition_list()


def test_abort_deletes_the_bytes_a_commit_stored(server, namespace):
    client = make_client(server.url, namespace)
    try:
        pk = client.context.keys("p")
        r = client.reserve_group("p", 4)
        # the first half of a commit: fields recorded, bytes stored, bits not flipped
        client.run(transitions.group_extend(pk, r.token, 0, "committer", ["x", "y"]).call())
        schemas, values = ops.data.encode_batch(client.context, _group(4))
        client.run(ops.storage(client.context)).put(pk, r.global_indexes, values)
        assert len(_data_keys(client, pk)) == 8
        assert client.abort_group(r) is True
        assert _data_keys(client, pk) == []
        assert not client.redis.exists(pk.trash, pk.trash_fields)
        assert _claim_all(client, "p") == []
    finally:
        client.close()


def test_extend_keeps_a_reservation_past_its_first_lease(rclient):
    r = rclient.reserve_group("p", 2, lease_s=0.5)
    r = rclient.extend_reservation(r, 300)
    first_deadline = r.deadline_ms - 300_000
    _until_lapsed(rclient, first_deadline + 1)
    rclient.commit_group(r, _group(2))
    assert _claim_all(rclient, "p") == r.global_indexes


def test_bad_input_gets_typed_errors(rclient):
    with pytest.raises(InvalidArgument):
        rclient.reserve_group("p", 0)
    with pytest.raises(InvalidArgument):
        rclient.reserve_group("p", 2, lease_s=-1)
    with pytest.raises(InvalidArgument):
        rclient.reserve_group("p", 2, policy_version=-1)
    with pytest.raises(InvalidArgument):
        rclient.commit_group("not a reservation", _group(2))
    r = rclient.reserve_group("p", 2)
    with pytest.raises(BatchSizeMismatch):
        rclient.commit_group(r, _group(3))
    with pytest.raises(InvalidArgument):
        rclient.set_staleness_bound("p", 1, 0)
    rclient.set_policy_version("p", 4)
    with pytest.raises(InvalidArgument):
        rclient.set_policy_version("p", 3)
    rclient.seal_partition("p")
    with pytest.raises(PartitionSealed):
        rclient.reserve_group("p", 2)
    with pytest.raises(PartitionSealed):
        rclient.commit_group(r, _group(2))
    with pytest.raises(ReservationLost):  # the refused commit freed it
        rclient.commit_group(r, _group(2))


def test_clearing_the_partition_frees_its_reservations(rclient):
    pk = rclient.context.keys("p")
    rclient.commit_group(rclient.reserve_group("p", 2), _group(2))
    r = rclient.reserve_group("p", 2)
    rclient.clear_partition("p")
    with pytest.raises(ReservationLost):
        rclient.commit_group(r, _group(2))
    assert not rclient.redis.exists(pk.resv, pk.resvdl, pk.trash)
    assert _data_keys(rclient, pk) == []


def test_the_async_client_reserves_commits_aborts_and_waits_for_a_bump(real_server, namespace):
    from tq_redis import AsyncTransferQueueClient

    make_client(real_server.url, namespace).close()  # records the namespace's store (the redis one)
    aclient = AsyncTransferQueueClient(real_server.url, namespace, nested_output=False)

    async def main():
        await aclient.async_set_staleness_bound("p", 0, 4)
        r = await aclient.async_reserve_group("p", 4)
        r = await aclient.async_extend_reservation(r, 60)
        meta = await aclient.async_commit_group(r, _group(4), end_policy_version=0)
        assert list(meta.global_indexes) == r.global_indexes
        waiting = asyncio.create_task(aclient.async_reserve_group("p", 4, timeout=DEADLINE_S))
        await asyncio.sleep(0)  # let it send its reservation (the bump may come before or after it)
        assert await aclient.async_set_policy_version("p", 1) is None
        second = await asyncio.wait_for(waiting, DEADLINE_S)
        assert second.policy_version == 1
        assert await aclient.async_abort_group(second) is True
        with pytest.raises(ReservationLost):
            await aclient.async_commit_group(second, _group(4))
        got = await aclient.async_get_meta(["x"], 4, "p", task_name="t")
        assert list(got.global_indexes) == r.global_indexes
        await aclient.async_close()

    asyncio.run(main())


# ------------------------------------------------------------------ concurrency


def test_two_concurrent_commits_of_one_reservation_exactly_one_wins(real_server, namespace):
    clients = [make_client(real_server.url, namespace) for _ in range(2)]
    try:
        pk = clients[0].context.keys("p")
        rounds = 20
        for k in range(rounds):
            r = clients[0].reserve_group("p", 4)
            barrier = threading.Barrier(2)
            outcomes: list[str] = []

            def commit(client, base, r=r, barrier=barrier, outcomes=outcomes):
                barrier.wait()
                try:
                    client.commit_group(r, _group(4, base))
                    outcomes.append("won")
                except ReservationLost:
                    outcomes.append("lost")

            threads = [threading.Thread(target=commit, args=(c, 1000 * i)) for i, c in enumerate(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(DEADLINE_S)
            assert sorted(outcomes) == ["lost", "won"], f"round {k}: {outcomes}"
        ids = _claim_all(clients[0], "p")
        assert len(ids) == len(set(ids)) == 4 * rounds
        # the loser's bytes are gone: exactly one value per committed sample and field
        assert len(_data_keys(clients[0], pk)) == 2 * 4 * rounds
        assert not clients[0].redis.exists(pk.trash)
    finally:
        for c in clients:
            c.close()


_PRODUCER = textwrap.dedent("""
    import sys, torch
    from tensordict import TensorDict
    from tests.conftest import make_client
    from tests.procs import hang_after_store_put

    url, ns, lease = sys.argv[1], sys.argv[2], float(sys.argv[3])
    client = make_client(url, ns)
    hang_after_store_put(client)  # the test SIGKILLs this process there: bytes stored, bits never flipped
    r = client.reserve_group("p", 4, lease_s=lease)
    print(f"reserved {r.first_id} {r.deadline_ms}", flush=True)
    client.commit_group(r, TensorDict({"x": torch.ones(4, 3), "y": torch.ones(4, 2)}, batch_size=[4]))
""")


def test_a_sigkilled_producer_frees_its_group_and_its_bytes(real_server, namespace):
    client = make_client(real_server.url, namespace)
    try:
        pk = client.context.keys("p")
        client.set_staleness_bound("p", 0, 4)  # room for exactly one group of 4 at version 0
        proc = subprocess.Popen(
            [sys.executable, "-c", _PRODUCER, real_server.url, namespace, "2"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
        )
        try:
            first, deadline_ms = map(int, proc.stdout.readline().split()[1:])
            assert proc.stdout.readline().strip() == "stored"
            assert len(_data_keys(client, pk)) == 8
            with pytest.raises(StalenessExceeded):  # the dead producer's group still holds the slots
                client.reserve_group("p", 4)
            proc.send_signal(signal.SIGKILL)
            proc.wait(DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert _claim_all(client, "p") == []
        _until_lapsed(client, deadline_ms)
        r = client.reserve_group("p", 4)  # this process frees the lapsed group and deletes its bytes
        assert r.first_id == first + 4
        assert _data_keys(client, pk) == []
        assert not client.redis.exists(pk.trash, pk.trash_fields)
        assert _claim_all(client, "p") == []
        client.commit_group(r, _group(4))
        assert _claim_all(client, "p") == r.global_indexes
    finally:
        client.close()


# ------------------------------------------------------------------ staleness admission


def test_the_bound_refuses_then_a_version_bump_wakes_a_blocked_reserver(server, namespace):
    client = make_client(server.url, namespace)
    other = make_client(server.url, namespace)
    try:
        pk = client.context.keys("p")
        client.set_staleness_bound("p", 1, 4)  # version 0 admits (0 + 1 + 1) * 4 = 8 samples
        first = [client.reserve_group("p", 4), client.reserve_group("p", 4)]
        assert [r.policy_version for r in first] == [None, None]
        with pytest.raises(StalenessExceeded) as refused:
            client.reserve_group("p", 1)
        assert refused.value.capacity == 0
        got: list = []
        blocked = threading.Thread(target=lambda: got.append(other.reserve_group("p", 4, timeout=DEADLINE_S)))
        started = time.monotonic()
        blocked.start()
        while not client.redis.zcard(pk.admitwaiters):  # registered as blocked by the bound
            assert time.monotonic() - started < DEADLINE_S
        assert not got
        client.set_policy_version("p", 1)
        blocked.join(DEADLINE_S)
        assert got and got[0].policy_version == 1
        # an abort frees its slots: room for 4 more at version 1 (16 admitted, 12 held)
        client.abort_group(first[0])
        client.reserve_group("p", 4)
        with pytest.raises(StalenessExceeded):
            client.reserve_group("p", 1)
        client.set_staleness_bound("p", None)
        client.reserve_group("p", 100)
    finally:
        client.close()
        other.close()


_ROLLOUT = textwrap.dedent("""
    import sys, torch
    from tensordict import TensorDict
    from tests.conftest import make_client
    from tq_redis.errors import StalenessExceeded

    url, ns, groups = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = make_client(url, ns)
    for k in range(groups):
        r = client.reserve_group("p", 2, timeout=120)
        if k % 3 == 2:
            client.abort_group(r)
            continue
        data = TensorDict({"x": torch.full((2, 3), r.policy_version), "y": torch.ones(2, 2)}, batch_size=[2])
        client.commit_group(r, data)
    print("done", flush=True)
""")


def test_nothing_is_admitted_past_the_bound_across_processes(real_server, namespace):
    """Three producer processes race to reserve groups of 2 (aborting every third); the trainer
    takes 4 samples per version and bumps it. Whatever the interleaving, the samples committed on
    versions <= v never exceed (v + max_lag + 1) * batch: none was admitted past the bound."""
    max_lag, batch = 1, 4
    trainer = make_client(real_server.url, namespace)
    procs = []
    try:
        trainer.set_staleness_bound("p", max_lag, batch)
        trainer.set_policy_version("p", 0)
        procs = [
            subprocess.Popen([sys.executable, "-c", _ROLLOUT, real_server.url, namespace, "6"],
                             stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
            for _ in range(3)
        ]
        committed = 3 * 4 * 2  # 4 of each producer's 6 groups of 2 are committed
        starts: list[int] = []
        version = 0
        while len(starts) < committed:
            meta = trainer.get_meta(["x"], batch, "p", task_name="train", timeout=DEADLINE_S)
            assert meta.size == batch, "the producers stalled"
            got = [m["policy_version"] for m in meta.custom_meta]
            assert torch.equal(trainer.get_data(meta)["x"][:, 0], torch.tensor(got, dtype=torch.int64))
            starts += got
            version += 1
            trainer.set_policy_version("p", version)
        for p in procs:
            assert p.stdout.readline().strip() == "done"
            assert p.wait(DEADLINE_S) == 0
        assert len(starts) == committed
        for v in range(version + 1):
            assert sum(s <= v for s in starts) <= (v + max_lag + 1) * batch, (v, sorted(starts))
        assert max(starts) >= 2  # the producers were held back and let through by the bumps
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        trainer.close()


def test_the_module_level_calls_run_on_the_default_client(real_server, namespace):
    import asyncio

    import tq_redis as tq

    tq.init({"redis": {"url": real_server.url}, "namespace": namespace, "storage": {"backend": "redis"}})
    try:
        tq.set_staleness_bound("rl", 0, 2)
        assert tq.set_policy_version("rl", 0) is None
        r = tq.reserve_group("rl", 2, 30)
        with pytest.raises(StalenessExceeded):
            tq.reserve_group("rl", 1)  # the bound: (0 + 0 + 1) * 2 samples
        r = tq.extend_reservation(r, 60)
        meta = tq.commit_group(r, _group(2), end_policy_version=0)
        assert list(meta.global_indexes) == r.global_indexes

        async def main():
            assert await tq.async_set_policy_version("rl", 1) == 0
            held = await tq.async_reserve_group("rl", 2)
            assert await tq.async_abort_group(held) is True
            return (await tq.async_set_staleness_bound("rl", None)).admitted

        assert asyncio.run(main()) == 2  # the committed group counts, the aborted one not
        assert tq.abort_group(r) is False
    finally:
        tq.close()


def test_init_sets_the_namespace_staleness_bound_every_partition_adopts(real_server, namespace):
    import tq_redis as tq
    from tq_redis.errors import ConfigError

    for bad in ({"max_lag": -1}, {"max_lag": 1, "batch_size": 0}, {"max_lag": "1"}, {"max_lag": 1, "batch": 2}):
        with pytest.raises(ConfigError, match="staleness"):
            tq.init({"redis": {"url": real_server.url}, "namespace": namespace, "staleness": bad})
    tq.init({"redis": {"url": real_server.url}, "namespace": namespace, "storage": {"backend": "redis"},
             "staleness": {"max_lag": 0, "batch_size": 2}})
    worker = make_client(real_server.url, namespace)  # another process attaching: it reads the bound
    try:
        for pid in ("a", "b"):
            worker.reserve_group(pid, 2)
            with pytest.raises(StalenessExceeded):
                worker.reserve_group(pid, 1)  # (0 + 0 + 1) * 2 samples admitted
        tq.set_policy_version("a", 1)
        tq.reserve_group("a", 2)  # the bump admits 2 more
        tq.set_staleness_bound("b", None)  # the partition's own choice wins over the namespace's
        worker.reserve_group("b", 50)
        tq.set_staleness_bound("a", 5, 1)
        assert worker.reserve_group("a", 3).size == 3  # (1 + 5 + 1) * 1 - 4 admitted
    finally:
        worker.close()
        tq.close()
    tq.init({"redis": {"url": real_server.url}, "namespace": namespace, "staleness": {"max_lag": None}})
    try:
        tq.reserve_group("c", 100)  # the namespace's bound removed
    finally:
        tq.close()
