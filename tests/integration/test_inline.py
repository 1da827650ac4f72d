"""Small values in the metadata plane (``storage.inline_max_bytes``): one round trip per small put
and per small get_data, the store untouched, and the invariants kept (a cleared sample's value is
never returned, a rewrite never reads back a stale copy, a dropped partition leaves nothing).

Round trips are counted from the effects an operation yields (one each: a script call, a command,
a pipeline, a store call), on real servers; the rest runs on fakeredis too.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.integration.conftest import INLINE_LIMIT
from tq_redis import ops
from tq_redis.errors import SampleNotFound
from tq_redis.meta.keys import PartitionKeys
from tq_redis.ops.effects import Cmd, FCall, Offload, Pipe, Unconfirmed

LIMIT = INLINE_LIMIT  # inline_client and counted (tests/integration/conftest.py) keep values up to it inline


def _td(n: int, width: int = 4, start: int = 0) -> TensorDict:
    x = torch.arange(start, start + n * width, dtype=torch.int64).reshape(n, width)
    return TensorDict({"x": x, "y": x.float() / 2}, batch_size=[n])


def _recorded(op, seen: list):
    """Run ``op`` as the driver does, recording every effect it yields (one per round trip)."""
    value, error = None, None
    while True:
        try:
            effect = op.throw(error) if error is not None else op.send(value)
        except StopIteration as stop:
            return stop.value
        if not isinstance(effect, Unconfirmed):  # asks the driver, not the server: no round trip
            seen.append(effect)
        try:
            value, error = (yield effect), None
        except Exception as exc:  # handed back to the operation, as the driver does
            value, error = None, exc


def _trips(effect) -> str:
    if isinstance(effect, Pipe):
        return "+".join(_trips(c) for c in effect.calls)
    if isinstance(effect, FCall):
        return effect.name
    if isinstance(effect, Cmd):
        return str(effect.args[0]).lower()
    if isinstance(effect, Offload):
        return "store"
    return type(effect).__name__


def _calls(client, op):
    """Run operation ``op``; its result and its round trips, e.g. ``["insert+zadd"]``."""
    seen: list = []
    result = client.run(_recorded(op, seen))
    return result, [_trips(e) for e in seen]


def _data_keys(client, pk: PartitionKeys) -> list:
    return [k for k in client.redis.keys(pk.prefix + "d:*")]


def test_a_small_put_is_one_round_trip_and_writes_no_store_key(counted):
    meta, calls = _calls(counted, ops.put(counted.context, _td(3), partition_id="p"))
    assert calls == ["insert+zadd"], calls  # insert: ids, values and bits; zadd: the registry
    pk = PartitionKeys(counted.namespace, "p")
    assert _data_keys(counted, pk) == []
    assert counted.redis.hlen(pk.inline) == 3 * 2


def test_a_small_claim_and_read_are_one_round_trip_each(counted):
    counted.put(_td(4), partition_id="p")
    meta, claim = _calls(counted, ops.get_meta(counted.context, ["x", "y"], 4, "p", mode="fetch", task_name="t"))
    assert claim == ["claim"], claim
    data, read = _calls(counted, ops.get_data(counted.context, meta))
    assert read == ["read_inline"], read  # the visibility check and the values
    assert torch.equal(data["x"], _td(4)["x"]) and torch.equal(data["y"], _td(4)["y"])


def test_a_small_rewrite_is_one_round_trip(counted):
    meta = counted.put(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]), partition_id="p")
    rewrite = TensorDict({"r": torch.ones(2, 1)}, batch_size=[2])
    out, calls = _calls(counted, ops.put(counted.context, rewrite, metadata=meta))
    assert calls == ["produce"], calls
    assert torch.equal(counted.get_data(out)["r"], torch.ones(2, 1))


def test_values_above_the_limit_go_to_the_store(inline_client):
    big = TensorDict({"x": torch.ones(2, LIMIT)}, batch_size=[2])  # 4096 float32 = 16 KiB a value
    meta = inline_client.put(big, partition_id="p")
    pk = PartitionKeys(inline_client.namespace, "p")
    assert len(_data_keys(inline_client, pk)) == 2
    assert not inline_client.redis.exists(pk.inline)
    assert torch.equal(inline_client.get_data(meta)["x"], big["x"])


def test_limit_zero_keeps_every_value_in_the_store(server, namespace):
    client = make_client(server.url, namespace, inline_max_bytes=0)
    try:
        meta = client.put(_td(2), partition_id="p")
        pk = PartitionKeys(namespace, "p")
        assert len(_data_keys(client, pk)) == 4 and not client.redis.exists(pk.inline)
        assert torch.equal(client.get_data(meta)["x"], _td(2)["x"])
    finally:
        client.close()


def test_mixed_sizes_in_one_read_come_back_in_order(inline_client):
    inline_client.put(TensorDict({"x": torch.full((2, 4), 1.0)}, batch_size=[2]), partition_id="p")
    big = inline_client.put(TensorDict({"x": torch.full((2, 4), 2.0)}, batch_size=[2]), partition_id="p")
    # the second batch's values rewritten big: they move to the store, the first two stay inline
    inline_client.put(TensorDict({"x": torch.full((2, 2048), 3.0)}, batch_size=[2]), metadata=big)
    meta = inline_client.get_meta(["x"], 4, "p", mode="force_fetch")
    data = inline_client.get_data(meta)
    rows = [data["x"][i] for i in range(4)]
    ids = list(meta.global_indexes)
    assert ids == [0, 1, 2, 3]
    assert all(torch.equal(r, torch.full((4,), 1.0)) for r in rows[:2])
    assert all(torch.equal(r, torch.full((2048,), 3.0)) for r in rows[2:])


def test_a_rewrite_to_the_store_leaves_no_stale_inline_copy(inline_client):
    meta = inline_client.put(TensorDict({"x": torch.zeros(1, 4)}, batch_size=[1]), partition_id="p")
    pk = PartitionKeys(inline_client.namespace, "p")
    assert inline_client.redis.hexists(pk.inline, "0:x")
    inline_client.put(TensorDict({"x": torch.ones(1, 2048)}, batch_size=[1]), metadata=meta)
    assert not inline_client.redis.hexists(pk.inline, "0:x")
    assert torch.equal(inline_client.get_data(meta)["x"], torch.ones(1, 2048))


def test_a_cleared_samples_inline_values_are_gone_and_never_returned(inline_client):
    meta = inline_client.put(_td(4), partition_id="p")
    pk = PartitionKeys(inline_client.namespace, "p")
    inline_client.clear_samples(meta.select_samples([0, 1]))
    assert sorted(inline_client.redis.hkeys(pk.inline)) == [b"2:x", b"2:y", b"3:x", b"3:y"]
    with pytest.raises(SampleNotFound):
        inline_client.get_data(meta)
    inline_client.clear_partition("p")
    assert not inline_client.redis.exists(pk.inline)


def test_a_claim_tells_get_data_where_values_live(inline_client):
    inline_client.put(TensorDict({"x": torch.ones(2, 2048)}, batch_size=[2]), partition_id="big")
    inline_client.put(_td(2), partition_id="small")
    ctx = inline_client.context
    for pid in ("big", "small"):
        meta = inline_client.get_meta(["x"], 2, pid, mode="fetch", task_name="t")
        assert ctx.inline_partitions[pid] is (pid == "small")
        assert inline_client.get_data(meta)["x"].shape[0] == 2


def test_a_partition_claimed_before_small_values_arrived_still_reads_them(inline_client):
    """The claim said "nothing inline"; a later small rewrite put values inline: the store read
    misses them and get_data falls back to read_inline instead of failing."""
    meta = inline_client.put(TensorDict({"x": torch.ones(2, 2048)}, batch_size=[2]), partition_id="p")
    claimed = inline_client.get_meta(["x"], 2, "p", mode="fetch", task_name="t")
    assert inline_client.context.inline_partitions["p"] is False
    inline_client.put(TensorDict({"r": torch.ones(2, 1)}, batch_size=[2]), metadata=meta)
    claimed = inline_client.get_meta(["x", "r"], 2, "p", mode="force_fetch")
    assert torch.equal(inline_client.get_data(claimed)["r"], torch.ones(2, 1))


def test_clearing_a_partition_that_only_ever_held_inline_values_skips_the_store(counted):
    counted.put(_td(3), partition_id="p")
    counted.put(_td(2), partition_id="p")
    pk = PartitionKeys(counted.namespace, "p")
    assert counted.redis.hget(pk.meta, "inlineonly") == b"1"
    _, calls = _calls(counted, ops.clear_partition(counted.context, "p"))
    assert calls == ["sadd+drop_partition+zrem"], calls  # no store delete, no trash to empty
    assert not counted.redis.exists(pk.inline) and not counted.redis.exists(pk.trash)
    assert counted.put(_td(1), partition_id="p").global_indexes == [5]  # ids are still never reused


@pytest.mark.parametrize("order", ["inline first, then a store put", "store put first", "inline, then a store rewrite"])
def test_a_partition_with_any_value_in_the_store_is_cleared_through_it(inline_client, order):
    big = TensorDict({"x": torch.ones(2, 2048), "y": torch.ones(2, 2048)}, batch_size=[2])
    pk = PartitionKeys(inline_client.namespace, "p")
    if order == "store put first":
        inline_client.put(big, partition_id="p")
        inline_client.put(_td(2), partition_id="p")
    else:
        small = inline_client.put(_td(2), partition_id="p")
        assert inline_client.redis.hget(pk.meta, "inlineonly") == b"1"
        if order == "inline first, then a store put":
            inline_client.put(big, partition_id="p")
        else:
            inline_client.put(big, metadata=small)
    assert inline_client.redis.hget(pk.meta, "inlineonly") is None
    assert _data_keys(inline_client, pk)
    inline_client.clear_partition("p")
    assert _data_keys(inline_client, pk) == []  # the store's bytes were deleted
    assert not inline_client.redis.exists(pk.inline)
    assert not inline_client.redis.bitcount(pk.trash)  # and taken out of the trash
