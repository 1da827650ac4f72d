"""kv_watch: the keys whose tags changed since a cursor, without polling (lua/tag_changes.lua).

Across processes a watcher sees every tag change of a concurrent writer exactly once, a resume
from a cursor included; a cursor whose changes were trimmed, or whose partition was cleared,
gets WatchCursorExpired with the cursor to go on from; clearing the partition leaves no stream.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from tensordict import TensorDict

import tq_redis as tq
from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis.errors import InvalidArgument, WatchCursorExpired
from tq_redis.ops import transitions

ROUNDS, PER_ROUND = 4, 8
ALL_KEYS = {f"traj{r}_{i}" for r in range(ROUNDS) for i in range(PER_ROUND)}


def _writer(url: str, ns: str, go) -> None:
    """Each trajectory is put running (with its prompt), then finished with its response."""
    client = make_client(url, ns)
    go.wait(60)
    for r in range(ROUNDS):
        keys = [f"traj{r}_{i}" for i in range(PER_ROUND)]
        client.kv_batch_put(keys, "rollouts", TensorDict({"prompt": torch.full((PER_ROUND, 4), r)}, [PER_ROUND]),
                            tags=[{"status": "running"}] * PER_ROUND)
        for i in reversed(range(PER_ROUND)):
            client.kv_put(keys[i], "rollouts", {"response": torch.arange(3) + i}, tag={"status": "finished", "i": i})
    client.close()


def _watcher(url: str, ns: str, cursor: str, go, out) -> None:
    """Watch finished trajectories; half way, drop the client and resume from the cursor."""
    seen: list[str] = []
    deadline = time.monotonic() + 90
    client = make_client(url, ns)
    go.set()
    resumed = False
    while len(seen) < len(ALL_KEYS) and time.monotonic() < deadline:
        changes = client.kv_watch("rollouts", cursor, timeout=5, where={"status": "finished"})
        cursor = changes.cursor
        if len(changes):
            keys = [k for k, _ in changes.items()]
            got = client.kv_batch_get(keys, "rollouts", ["response"])  # a finished key's fields are there
            assert [int(row[0]) for row in got["response"]] == [t["i"] for _, t in changes.items()]
            seen += keys
        if not resumed and len(seen) >= len(ALL_KEYS) // 2:
            client.close()
            client, resumed = make_client(url, ns), True
    late = client.kv_watch("rollouts", cursor, timeout=0.2, where={"status": "finished"})
    out.put((seen, resumed, len(late)))
    client.close()


def test_a_watcher_process_sees_each_change_of_a_writer_process_once_across_a_resume(server, namespace):
    setup = make_client(server.url, namespace)
    start = setup.kv_watch("rollouts").cursor  # before any write: nothing may be missed
    ctx = mp_context()
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_watcher, args=(server.url, namespace, start, go, out)),
             ctx.Process(target=_writer, args=(server.url, namespace, go))]
    for p in procs:
        p.start()
    seen, resumed, late = out.get(timeout=150)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert resumed
    assert len(seen) == len(set(seen)), "a change was returned twice"
    assert set(seen) == ALL_KEYS, f"missed {sorted(ALL_KEYS - set(seen))[:5]}"
    assert late == 0
    setup.close()


def test_every_tag_writer_is_watched_and_bad_input_is_refused(client):
    cursor = client.kv_watch("p", timeout=0).cursor
    assert cursor == "0-0"
    meta = client.put(TensorDict({"x": torch.zeros(3, 2)}, [3]), partition_id="p")  # no tag: no change
    assert len(client.kv_watch("p", cursor)) == 0
    meta.update_custom_meta([{"score": 1}, {}, {"score": 3}])
    client.set_custom_meta(meta)
    client.kv_put("a", "p", tag={"score": 2})
    changes = client.kv_watch("p", cursor)
    assert changes.keys == [None, None, None, "a"] and changes.global_indexes[:3] == meta.global_indexes
    assert [t.get("score") for t in changes.tags] == [1, None, 3, 2]
    assert dict(changes.items()) == {"a": {"score": 2}}
    assert len(client.kv_watch("p", changes.cursor)) == 0
    r = client.reserve_group("p", 2, policy_version=7)
    client.commit_group(r, TensorDict({"x": torch.ones(2, 2)}, [2]))
    group = client.kv_watch("p", changes.cursor, where={"policy_version": 7})
    assert group.global_indexes == r.global_indexes
    with pytest.raises(InvalidArgument, match="cursor"):
        client.kv_watch("p", "yesterday")
    with pytest.raises(InvalidArgument, match="where"):
        client.kv_watch("p", cursor, where={"score": [1]})
    with pytest.raises(InvalidArgument, match="timeout"):
        client.kv_watch("p", cursor, timeout=-1)


def test_a_trimmed_cursor_gets_the_resync_answer(server, namespace):
    client = make_client(server.url, namespace)
    client.kv_put("k", "p", tag={"n": -1})
    cursor = client.kv_watch("p", timeout=0).cursor
    pk = client.context.keys("p")
    sid = client.kv_retrieve_meta(["k"], "p").global_indexes[0]
    # Past the cap (TAGCHANGES_CAP in lua/includes/tagwatch.lua) on real servers; fakeredis runs
    # scripts too slowly for that, so there the stream is trimmed as the cap would.
    changes = 300 if server.flavour == "fakeredis" else 10_500
    client.run(transitions.pipeline(*(transitions.set_tags(pk, [sid], ["n"], [{"n": i}]) for i in range(changes))))
    if server.flavour == "fakeredis":
        client.redis.xtrim(pk.tagchanges, maxlen=100)
    assert client.redis.xlen(pk.tagchanges) < changes  # capped
    with pytest.raises(WatchCursorExpired) as info:
        client.kv_watch("p", cursor)
    assert dict(client.kv_list("p")["p"]) == {"k": {"n": changes - 1}}  # re-list, then watch on
    assert len(client.kv_watch("p", info.value.cursor)) == 0
    client.kv_put("k", "p", tag={"n": 0})
    assert client.kv_watch("p", info.value.cursor).keys == ["k"]
    client.close()


def test_clearing_the_partition_wakes_watchers_and_removes_the_stream(client):
    client.kv_put("a", "p", tag={"n": 1})
    cursor = client.kv_watch("p", timeout=0).cursor
    pk = client.context.keys("p")
    outcome: list = []
    started = threading.Event()

    def watch():
        started.set()
        t0 = time.monotonic()
        try:
            client.kv_watch("p", cursor, timeout=60)
            outcome.append(("returned", time.monotonic() - t0))
        except WatchCursorExpired as exc:
            outcome.append((exc, time.monotonic() - t0))

    other = make_client(client.redis_url, client.namespace)
    thread = threading.Thread(target=watch)
    thread.start()
    started.wait(10)
    # the watcher blocks on the stream; the clear's `dropped` entry wakes it (whenever it blocks)
    other.clear_partition("p")
    thread.join(90)
    assert isinstance(outcome[0][0], WatchCursorExpired) and outcome[0][1] < 45
    assert 0 < client.redis.pttl(pk.tagchanges) <= 60_000  # the stream expires with its marker
    assert client.redis.xlen(pk.tagchanges) == 1
    after = outcome[0][0].cursor
    other.kv_put("b", "p", tag={"n": 2})  # the partition again: the stream lives on from `after`
    assert client.redis.pttl(pk.tagchanges) == -1
    assert other.kv_watch("p", after).keys == ["b"]
    other.clear_partition("p")
    other.close()


def test_async_and_module_level_watch(real_server, namespace):
    tq.init({"redis": {"url": real_server.url}, "namespace": namespace, "storage": {"backend": "redis"}})
    try:
        cursor = tq.kv_watch("p").cursor

        async def main():
            waiting = asyncio.ensure_future(tq.async_kv_watch("p", cursor, timeout=60, where={"done": True}))
            await tq.async_kv_put("x", "p", tag={"done": False})
            await tq.async_kv_put("y", "p", tag={"done": True})
            return await waiting

        changes = asyncio.run(main())
        assert changes.keys == ["y"]
        assert tq.kv_watch("p", changes.cursor, where={"done": True}).keys == []
    finally:
        tq.close()
