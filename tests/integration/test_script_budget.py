"""No script call holds the server for long: every operation on a big batch cuts its script work
into calls of at most ``SCRIPT_ITEMS`` values, ids or keys (``tq_redis.ops.script_budget``), on real
servers, and stays correct. The time each call takes is measured by ``benchmarks/p9_script_time.py``
(SLOWLOG); here the work each call carries is counted from the calls themselves, so the test does
not depend on the machine's speed. And a put of more fields than one call may carry is refused
with a typed error, before anything is written."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.integration.test_inline import _recorded
from tq_redis import errors, ops
from tq_redis.meta.keys import PartitionKeys
from tq_redis.ops import kv
from tq_redis.ops.effects import FCall, Pipe
from tq_redis.ops.script_budget import MAX_FIELDS, MAX_LEASED_CLAIM, SCRIPT_ITEMS

ROWS = 8192  # as in issue 30: one inline put of 8,192 rows x 4 scalar fields held Redis 118-208 ms
FIELDS = ["f0", "f1", "f2", "f3"]


def _ids_in(ranges: str) -> int:
    """How many ids a compact id list ("0-9,12") holds."""
    count = 0
    for part in str(ranges).split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def _after(args: tuple, at: int) -> tuple[int, int]:
    """(n, index after the n items) of a count-prefixed list at ``args[at]``."""
    n = int(args[at])
    return n, at + 1 + n


def items(call: FCall) -> int:
    """The batch work of one script call: the values (sample x field), ids or keys it handles."""
    a = call.args
    if call.name == "insert":
        nfields = int(a[6])
        return int(a[1]) * nfields if a[0] == "" else nfields  # inline values, or bit ranges per field
    if call.name == "produce":
        nfields = int(a[1])
        nids = int(a[2 + 2 * nfields])
        return nids * nfields
    if call.name == "set_tags":
        nids, at = _after(a, 0)
        return nids * max(1, (len(a) - at) // (nids + 1))
    if call.name in ("read_inline", "check_visible"):
        return _ids_in(a[0]) * max(1, len(a) - 1)
    if call.name == "claim":
        nopts = int(a[5])
        opts = dict(zip(a[6 : 6 + 2 * nopts : 2], a[7 : 7 + 2 * nopts : 2]))
        nfields = int(a[6 + 2 * nopts])
        return int(a[1]) * nfields if opts.get("_values") == "1" else 0  # its marks go in bitmap runs
    if call.name == "settle":
        return len(a) - 3  # id, delivery count pairs
    if call.name == "unclaim":
        return len(a) - 1
    if call.name == "kv_list":
        return int(a[1])  # keys scanned for the page
    if call.name == "reserve":
        return (len(a) - 3) // 2  # the fields whose schemas it checks
    if call.name == "kv_resolve":
        return int(a[4])
    if call.name in ("trash_add", "trash_done"):
        return len(str(a[0]).split(","))  # id ranges, each one bitmap command
    return len(a)


def _run(client, op) -> tuple[object, list[FCall]]:
    """Run ``op``; its result and every script call it made."""
    seen: list = []
    result = client.run(_recorded(op, seen))
    calls = [c for e in seen for c in (e.calls if isinstance(e, Pipe) else (e,)) if isinstance(c, FCall)]
    return result, calls


def _assert_small(calls: list[FCall], what: str) -> None:
    worst = max(calls, key=items)
    assert items(worst) <= SCRIPT_ITEMS, f"{what}: {worst.name} handled {items(worst)} items in one script call"


def _table(n: int, first: int = 0) -> TensorDict:
    base = torch.arange(first, first + n)
    return TensorDict({f: base * (k + 1) for k, f in enumerate(FIELDS)}, batch_size=[n])


def test_every_operation_on_a_big_batch_cuts_its_script_work(real_server, namespace):
    client = make_client(real_server.url, namespace, inline_max_bytes=4096)
    ctx = client.context
    meta, calls = _run(client, ops.put(ctx, _table(ROWS), partition_id="p"))
    _assert_small(calls, "put")
    assert meta.global_indexes == list(range(ROWS))

    got, calls = _run(client, ops.get_data(ctx, meta))
    _assert_small(calls, "get_data")
    assert torch.equal(got["f3"], torch.arange(ROWS) * 4)

    tagged = meta.copy()
    tagged.update_custom_meta([{"uid": i // 8, "total_lengths": i % 97} for i in range(ROWS)])
    _, calls = _run(client, ops.set_custom_meta(ctx, tagged))
    _assert_small(calls, "set_custom_meta")

    rewrite = TensorDict({"f0": -torch.arange(ROWS)}, batch_size=[ROWS])
    _, calls = _run(client, ops.put(ctx, rewrite, metadata=meta))
    _assert_small(calls, "put with metadata")

    (claimed, data), calls = _run(client, ops.get_meta_and_data(ctx, FIELDS, ROWS, "p", task_name="t"))
    _assert_small(calls, "get_meta_and_data")
    assert claimed.global_indexes == list(range(ROWS))
    assert torch.equal(data["f0"], -torch.arange(ROWS)) and torch.equal(data["f2"], torch.arange(ROWS) * 3)
    assert [row["uid"] for row in claimed.custom_meta[:9]] == [0] * 8 + [1]

    keys = [f"k{i}" for i in range(ROWS)]
    _, calls = _run(client, kv.batch_put(ctx, keys, "kv", TensorDict({"a": torch.arange(ROWS)}, batch_size=[ROWS])))
    _assert_small(calls, "kv_batch_put")
    assert torch.equal(client.kv_batch_get(keys[-3:], "kv")["a"], torch.arange(ROWS - 3, ROWS))

    listing, calls = _run(client, kv.list_keys(ctx, "kv"))
    _assert_small(calls, "kv_list")
    assert list(listing["kv"]) == keys  # every key once, in creation order

    leased, calls = _run(client, ops.get_meta(ctx, ["a"], MAX_LEASED_CLAIM, "kv", task_name="l", lease_s=60))
    _assert_small(calls, "a leased claim")
    assert leased.size == MAX_LEASED_CLAIM
    _, calls = _run(client, ops.settle(ctx, leased, "l", "extend", 60))
    _assert_small(calls, "extend_lease")
    _, calls = _run(client, ops.settle(ctx, leased, "l", "ack"))
    _assert_small(calls, "ack")
    with pytest.raises(errors.InvalidArgument, match=f"at most {MAX_LEASED_CLAIM} samples"):
        client.get_meta(["a"], MAX_LEASED_CLAIM + 1, "kv", task_name="l", lease_s=60)

    _, calls = _run(client, ops.clear_samples(ctx, meta))
    _assert_small(calls, "clear_samples")
    assert client.get_meta(FIELDS, 1, "p", mode="force_fetch").size == 0
    pk = PartitionKeys(namespace, "p")
    assert client.redis.hlen(pk.inline) == 0 and client.redis.bitcount(pk.alive) == 0
    client.close()


def test_a_big_insert_still_becomes_visible_in_one_step(real_server, namespace):
    """Its values go to the store (not inline), and one script flips its bits: a consumer never
    sees part of it (a GRPO group is an insert)."""
    client = make_client(real_server.url, namespace, inline_max_bytes=4096)
    meta, calls = _run(client, ops.put(client.context, _table(ROWS), partition_id="p"))
    flips = [c for c in calls if c.name == "insert"]
    assert len(flips) == 1 and flips[0].args[0] == 0  # ids reserved first, bytes stored, then the bits
    grpo = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": ROWS}
    assert client.get_meta(FIELDS, ROWS, "p", task_name="g", sampling_config=grpo).size == ROWS
    client.close()


def test_more_fields_than_one_call_carries_are_refused_before_anything_is_written(server, namespace):
    client = make_client(server.url, namespace)
    wide = TensorDict({f"field_{k}": torch.tensor([k]) for k in range(10_000)}, batch_size=[1])
    with pytest.raises(errors.TooManyFields, match=f"at most {MAX_FIELDS} fields") as refused:
        client.put(wide, partition_id="wide")
    assert isinstance(refused.value, errors.InvalidArgument)
    assert client.get_partition_list() == []
    written = {k.decode() for k in client.redis.scan_iter(f"{namespace}:*")}
    assert written <= {f"{namespace}:config", f"{namespace}:clients"}  # + the client's liveness record
    client.close()


def test_the_widest_put_allowed_round_trips(real_server, namespace):
    client = make_client(real_server.url, namespace, inline_max_bytes=4096)
    wide = TensorDict({f"field_{k}": torch.tensor([k, -k]) for k in range(MAX_FIELDS)}, batch_size=[2])
    meta, calls = _run(client, ops.put(client.context, wide, partition_id="wide"))
    _assert_small(calls, "a put of MAX_FIELDS fields")
    got = client.get_data(client.get_meta(list(wide.keys()), 2, "wide", task_name="t"))
    assert int(got[f"field_{MAX_FIELDS - 1}"][1]) == -(MAX_FIELDS - 1)
    client.close()
