"""Bad input raises a typed error that says what to fix, and leaves no partial state."""

from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.records import without_records
from tq_redis import AsyncTransferQueueClient, TransferQueueClient, errors
from tq_redis.backends.dram.launcher import spawn_node
from tq_redis.meta.keys import PartitionKeys, clients_key, config_key


def _state(client, partition: str) -> dict:
    """Every key of the partition with its type and content, to prove nothing changed (but the
    client's liveness record, which its heartbeat rewrites on its own: tq_redis.client.liveness)."""
    out = {}
    life = (clients_key(client.namespace).encode(), config_key(client.namespace).encode())
    for key in without_records(sorted(client.redis.scan_iter(f"{client.namespace}:*")), client.redis):
        if key == life[0]:
            continue
        if key == life[1]:
            out[key] = {k: v for k, v in client.redis.hgetall(key).items() if k not in (b"created_ms", b"touched_ms")}
            continue
        kind = client.redis.type(key).decode()
        if kind == "stream":
            out[key] = client.redis.xlen(key)
        elif kind == "string":
            out[key] = client.redis.get(key)
        elif kind == "hash":
            out[key] = client.redis.hgetall(key)
        elif kind == "set":
            out[key] = client.redis.smembers(key)
        elif kind == "zset":
            out[key] = client.redis.zrange(key, 0, -1)
    return out


@pytest.fixture
def seeded(server, namespace):
    # strict_schema: shape/dtype changes raise (by default they make the field jagged, as in the
    # reference; see test_reference_defaults.py)
    client = make_client(server.url, namespace, strict_schema=True)
    meta = client.put(
        TensorDict({"ids": torch.zeros(4, 3, dtype=torch.long), "resp": torch.ones(4, 2)}, batch_size=[4]),
        partition_id="p",
    )
    return client, meta


def test_dtype_conflict_on_insert_leaves_nothing(seeded):
    client, _ = seeded
    before = _state(client, "p")
    with pytest.raises(errors.DTypeConflict, match="ids"):
        client.put(TensorDict({"ids": torch.zeros(2, 3, dtype=torch.float32)}, batch_size=[2]), partition_id="p")
    assert _state(client, "p") == before


def test_shape_conflict_on_insert_leaves_nothing(seeded):
    client, _ = seeded
    before = _state(client, "p")
    with pytest.raises(errors.ShapeConflict):
        client.put(TensorDict({"ids": torch.zeros(2, 5, dtype=torch.long)}, batch_size=[2]), partition_id="p")
    assert _state(client, "p") == before


def test_dtype_conflict_on_rewrite_leaves_nothing(seeded):
    client, meta = seeded
    before = _state(client, "p")
    with pytest.raises(errors.DTypeConflict):
        client.put(TensorDict({"resp": torch.ones(4, 2, dtype=torch.float64)}, batch_size=[4]), metadata=meta)
    assert _state(client, "p") == before
    assert torch.equal(client.get_data(meta)["resp"], torch.ones(4, 2))


def test_batch_size_mismatch(seeded):
    client, meta = seeded
    with pytest.raises(errors.BatchSizeMismatch, match="4"):
        client.put(TensorDict({"x": torch.ones(3)}, batch_size=[3]), metadata=meta)
    with pytest.raises(errors.BatchSizeMismatch):
        client.put({"a": torch.ones(3), "b": torch.ones(2)}, partition_id="p")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_batch_size_must_be_positive_int(client, bad):
    with pytest.raises(errors.InvalidArgument, match="batch_size"):
        client.get_meta(["x"], bad, "p", task_name="t")


def test_empty_tensordict(client):
    with pytest.raises(errors.EmptyBatch):
        client.put(TensorDict({}, batch_size=[0]), partition_id="p")
    with pytest.raises(errors.EmptyBatch):
        client.put(TensorDict({"x": torch.ones(0, 2)}, batch_size=[0]), partition_id="p")
    with pytest.raises(errors.EmptyBatch):
        client.put({}, partition_id="p")


def test_non_tensor_where_tensor_required(client):
    with pytest.raises(errors.UnsupportedValue):
        client.put(42, partition_id="p")
    with pytest.raises(errors.UnsupportedValue):
        client.put({"x": object()}, partition_id="p")


def test_unknown_partition(client):
    with pytest.raises(errors.UnknownPartition, match="nope"):
        client.get_meta(["x"], 1, "nope", mode="force_fetch")
    # the status calls answer for a missing partition as the reference does (it has no samples)
    assert client.get_production_status(["x"], "nope")[1].numel() == 0
    assert client.check_consumption_status("t", "nope") is False


def test_unknown_field(seeded):
    client, _ = seeded
    with pytest.raises(errors.UnknownField, match="nope"):
        client.get_meta(["nope"], 1, "p", mode="force_fetch")


def test_rewrite_of_cleared_samples(seeded):
    client, meta = seeded
    client.clear_samples(meta[0:1])
    before = _state(client, "p")
    with pytest.raises(errors.SampleNotFound):
        client.put(TensorDict({"resp": torch.ones(4, 2)}, batch_size=[4]), metadata=meta)
    assert _state(client, "p") == before


def test_get_data_of_unproduced_field(seeded):
    client, meta = seeded
    ff = client.get_meta(["ids"], 4, "p", mode="force_fetch")
    ff.field_schema["later"] = dict(ff.field_schema["ids"])
    ff = type(ff)(ff.global_indexes, ff.partition_ids, ff.field_schema, ff.production_status)
    with pytest.raises(errors.DataNotReady, match="later"):
        client.get_data(ff)


def test_bad_names_and_modes(client):
    with pytest.raises(errors.InvalidArgument, match="partition_id"):
        client.put(TensorDict({"x": torch.ones(1)}, batch_size=[1]), partition_id="a{b}")
    with pytest.raises(errors.InvalidArgument, match="mode"):
        client.get_meta(["x"], 1, "p", mode="append", task_name="t")
    with pytest.raises(errors.InvalidArgument, match="task_name"):
        client.get_meta(["x"], 1, "p")
    with pytest.raises(errors.InvalidArgument, match="partition_id"):
        client.put(TensorDict({"x": torch.ones(1)}, batch_size=[1]))
    with pytest.raises(errors.LeaseError):
        client.ack(client.put(TensorDict({"x": torch.ones(1)}, batch_size=[1]), partition_id="p"))


def test_pickle_refused_by_default(client):
    class Custom:
        pass

    td = TensorDict({"x": torch.ones(2)}, batch_size=[2])
    td.set_non_tensor("obj", Custom())
    with pytest.raises(errors.UnsupportedValue, match="allow_pickle"):
        client.put(td, partition_id="p")


def test_redis_unreachable_names_the_url():
    from tq_redis.server.embedded import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    client = TransferQueueClient(url, "ns")
    client._driver.redis.connection_pool.connection_kwargs["socket_connect_timeout"] = 0.2
    client._driver.redis.set_retry(type(client._driver.redis.get_retry())(
        client._driver.redis.get_retry()._backoff, 1))
    with pytest.raises(errors.ConnectionFailed, match=url.split("/0")[0]):
        client.get_meta(["x"], 1, "p", task_name="t")
    assert isinstance(errors.ConnectionFailed("x"), ConnectionError)


def test_a_dead_storage_node_is_reported_as_the_node_not_as_redis(valkey, namespace):
    """Store errors are ``ConnectionError``s too; the drivers must not relabel them "cannot reach Redis"."""
    node = spawn_node(valkey.url, namespace, capacity="64MiB", node_id="lone")
    client = make_client(valkey.url, namespace, backend="dram")
    aclient = AsyncTransferQueueClient(valkey.url, namespace)
    try:
        meta = client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id="p")
        node.stop(sig=signal.SIGKILL)
        with pytest.raises(errors.StorageUnavailable, match="'lone'"):
            client.get_data(meta)
        with pytest.raises(errors.StorageUnavailable, match="'lone'"):
            client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id="p")
        with pytest.raises(errors.StorageUnavailable, match="'lone'"):
            asyncio.run(aclient.async_get_data(meta))
    finally:
        client.close()
        aclient.close()
        node.stop()


def test_errors_are_catchable_as_builtins():
    assert issubclass(errors.UnknownPartition, KeyError)
    assert issubclass(errors.BatchSizeMismatch, ValueError)
    assert str(errors.UnknownField("field 'a' is unknown")) == "field 'a' is unknown"
    assert issubclass(errors.DTypeConflict, TypeError)
    assert np.int8(1) == 1


def test_nothing_written_for_unknown_partition_rewrite(client):
    meta = client.put(TensorDict({"x": torch.ones(2)}, batch_size=[2]), partition_id="p")
    client.clear_partition("p")
    with pytest.raises(errors.UnknownPartition):
        client.put(TensorDict({"y": torch.ones(2)}, batch_size=[2]), metadata=meta)
    pk = PartitionKeys(client.namespace, "p")
    assert not client.redis.exists(pk.data(0, "y"))


def test_insert_into_sealed_partition_is_refused(client):
    client.put(TensorDict({"x": torch.ones(2)}, batch_size=[2]), partition_id="p")
    client.seal_partition("p")
    before = _state(client, "p")
    with pytest.raises(errors.PartitionSealed, match="sealed"):
        client.put(TensorDict({"x": torch.ones(2)}, batch_size=[2]), partition_id="p")
    assert _state(client, "p") == before
    assert client.get_meta(["x"], 2, "p", task_name="t").size == 2  # sealed data is still served


# ------------------------------------------------------------------ issue 14, items 8 and 9


@pytest.fixture
def vclient(valkey, namespace):
    """A client on the embedded Valkey (argument checks run before any Redis call: one flavour is enough)."""
    client = make_client(valkey.url, namespace)
    yield client
    client.close()


def _ns_state(client) -> dict:
    return _state(client, "")


BAD_SECONDS = [float("nan"), float("inf"), float("-inf"), "1", True, 1e300]


@pytest.mark.parametrize("bad", BAD_SECONDS)
def test_bad_timeout_and_lease_are_typed_errors(vclient, bad):
    vclient.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
    before = _ns_state(vclient)
    with pytest.raises(errors.InvalidArgument, match="timeout must be a finite number of seconds"):
        vclient.get_meta(["x"], 1, "p", task_name="t", timeout=bad)
    with pytest.raises(errors.InvalidArgument, match="lease_s must be a finite number of seconds"):
        vclient.get_meta(["x"], 1, "p", task_name="t", lease_s=bad)
    assert _ns_state(vclient) == before  # nothing claimed


@pytest.mark.parametrize("bad", [*BAD_SECONDS, 0, -1, None])
def test_bad_extend_lease_is_a_typed_error(vclient, bad):
    vclient.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
    leased = vclient.get_meta(["x"], 2, "p", task_name="t", lease_s=30)
    with pytest.raises(errors.InvalidArgument, match="extend_lease seconds must be"):
        vclient.extend_lease(leased, bad)
    assert vclient.ack(leased) is None  # the lease is intact


def test_none_where_a_batchmeta_belongs(vclient):
    for call in (vclient.clear_samples, vclient.ack, vclient.nack, vclient.set_custom_meta, vclient.get_data):
        with pytest.raises(errors.InvalidArgument, match="BatchMeta"):
            call(None)
    with pytest.raises(errors.InvalidArgument, match="BatchMeta"):
        vclient.extend_lease(None, 5)
    with pytest.raises(errors.InvalidArgument, match="BatchMeta"):
        asyncio.run(vclient.async_ack(None))
    with pytest.raises(errors.InvalidArgument, match="BatchMeta"):
        asyncio.run(vclient.async_clear_samples(None))


def test_meta_device_tensors_are_refused_before_any_write(vclient):
    before = _ns_state(vclient)
    with pytest.raises(errors.UnsupportedValue, match="meta device"):
        vclient.put(TensorDict({"x": torch.empty(2, 3, device="meta")}, batch_size=[2]), partition_id="p")
    with pytest.raises(errors.UnsupportedValue, match="meta device"):
        vclient.put(TensorDict({"x": torch.empty(2, 3)}, batch_size=[2], device="meta"), partition_id="p")
    with pytest.raises(errors.UnsupportedValue, match="meta device"):
        vclient.kv_put("k", "p", {"x": torch.empty(3, device="meta")})
    with pytest.raises(errors.UnsupportedValue, match="meta device"):
        vclient.put({"obj": [{"t": torch.empty(1, device="meta")}]}, partition_id="p")
    assert _ns_state(vclient) == before


def test_fetch_with_no_fields_is_refused_and_consumes_nothing(vclient):
    """The reference marks every unconsumed sample consumed and returns a meta with no data to read."""
    vclient.put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id="p")
    with pytest.raises(errors.InvalidArgument, match="at least one field"):
        vclient.get_meta([], 3, "p", task_name="t")
    with pytest.raises(errors.InvalidArgument, match="at least one field"):
        vclient.get_meta([], 3, "p", task_name="t", lease_s=5)
    got = vclient.get_meta(["x"], 3, "p", task_name="t")
    assert got.global_indexes == [0, 1, 2]
    # force_fetch with no fields marks nothing: it still lists the samples, as in the reference
    assert vclient.get_meta([], 3, "p", mode="force_fetch").global_indexes == [0, 1, 2]


@pytest.mark.parametrize("shape", [[2, 2], [2, 1], [1, 3, 2]])
def test_more_than_one_batch_dimension_is_refused(vclient, shape):
    td = TensorDict({"x": torch.ones(*shape, 4)}, batch_size=shape)
    before = _ns_state(vclient)
    with pytest.raises(errors.InvalidArgument, match="one batch dimension"):
        vclient.put(td, partition_id="p")
    keys = [f"k{i}" for i in range(shape[0])]
    with pytest.raises(errors.InvalidArgument, match="one batch dimension"):
        vclient.kv_batch_put(keys, "p", td)
    if shape[0] == 1:
        with pytest.raises(errors.InvalidArgument, match="one batch dimension"):
            vclient.kv_put("k", "p", td)
    assert _ns_state(vclient) == before
    # what the message suggests works, and round-trips
    meta = vclient.put(td.view(-1), partition_id="p")
    assert torch.equal(vclient.get_data(meta)["x"], td.view(-1)["x"])


@pytest.mark.parametrize(
    "bad",
    [
        {"tags": [{"t": object()}]},
        {"tags": [{"t": {(1, 2): 3}}]},
        {"tags": [{"t": b"bytes"}]},
        {"fields": {"x": torch.empty(1, 2, device="meta")}},
        {"fields": {"x": [object()]}},
        {"fields": {"bad name": torch.ones(1)}},
    ],
)
def test_kv_batch_put_validates_before_any_write(vclient, bad):
    """A refused kv_batch_put leaves no key, no id drawn from ``{p}:seq``, no partition."""
    pk = PartitionKeys(vclient.namespace, "kvp")
    kwargs = {"fields": TensorDict({"x": torch.ones(1)}, batch_size=[1])} | bad
    if isinstance(kwargs["fields"], dict):
        kwargs["fields"] = TensorDict(kwargs["fields"], batch_size=[1])
    with pytest.raises((errors.UnsupportedValue, errors.InvalidName)):
        vclient.kv_batch_put(["a"], "kvp", **kwargs)
    assert vclient.redis.get(pk.seq) is None
    assert not vclient.redis.exists(pk.meta, pk.kv)
    assert vclient.get_partition_list() == []
    vclient.kv_batch_put(["a"], "kvp", TensorDict({"x": torch.ones(1)}, batch_size=[1]))
    assert vclient.kv_retrieve_keys([0], "kvp") == ["a"]  # the first good put gets id 0


@pytest.mark.parametrize("bad", [None, "a", [1.5], [float("nan")], [-1], [2**40], [True]])
def test_kv_retrieve_keys_bad_ids(vclient, bad):
    vclient.kv_put("a", "p", {"x": torch.ones(2)})
    with pytest.raises(errors.InvalidArgument, match="global_indexes"):
        vclient.kv_retrieve_keys(bad, "p")


def test_insert_mode_batch_size_is_bounded(vclient):
    from tq_redis.ops.data import MAX_INSERT

    with pytest.raises(errors.InvalidArgument, match=f"at most {MAX_INSERT}"):
        vclient.get_meta(["x"], MAX_INSERT + 1, "p", mode="insert")
    assert vclient.get_partition_list() == []


@pytest.mark.parametrize("bad", [float("nan"), -1, "1", True])
def test_channel_and_stream_timeouts_refuse_nan_and_nonsense(server, namespace, bad):
    from tq_redis import Channel
    from tq_redis.ops.streaming import next_batch

    chan = Channel.create(f"c{namespace}", redis_url=server.url, namespace=namespace)
    try:
        with pytest.raises(errors.InvalidArgument):
            chan.get(timeout=bad)
    finally:
        chan.delete()
    client = make_client(server.url, namespace)
    try:
        with pytest.raises(errors.InvalidArgument):
            client.run(next_batch(client.context, ["x"], 1, "p", "t", timeout=bad))
    finally:
        client.close()


def test_a_redis_error_reply_comes_back_typed_never_raw(server, namespace):
    """Something else wrote a key of the namespace with another type: the script's WRONGTYPE
    comes back as ServerError quoting it, not as redis-py's ResponseError."""
    import redis

    client = make_client(server.url, namespace)
    client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="p")
    client.redis.set(PartitionKeys(namespace, "p").lease("t"), "not a sorted set")
    with pytest.raises(errors.ServerError, match="WRONGTYPE") as refused:
        client.get_meta(["x"], 1, "p", task_name="t", lease_s=30)
    assert not isinstance(refused.value, redis.RedisError)
    client.close()
