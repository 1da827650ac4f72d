"""Names on real servers: bad names are refused with InvalidName before anything is written, a
user cannot reach a channel's hidden partition, and glob characters in a name touch nothing else."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.records import without_records
from tq_redis import Channel, TransferQueueClient
from tq_redis.errors import ChannelNotFound, InvalidName


def _keys(client, ns: str) -> list[str]:
    # the test's own namespace is a plain uuid-ish word, so this pattern selects exactly it
    keys = without_records(client.redis.scan_iter(match=f"{ns}:*", count=1000), client.redis)
    return sorted(k.decode() for k in keys)


def _batch(n: int = 2, field: str = "x") -> TensorDict:
    return TensorDict({field: torch.arange(n)}, [n])


@pytest.mark.parametrize("bad", [None, ""])
def test_a_missing_or_empty_namespace_is_refused(real_server, bad):
    with pytest.raises(InvalidName, match="namespace"):
        TransferQueueClient(real_server.url, namespace=bad)


def test_a_namespace_that_would_reach_another_is_refused(real_server, namespace):
    for bad in (f"{namespace}:b", f"{namespace}*", "a b", ""):
        with pytest.raises(InvalidName, match="namespace"):
            TransferQueueClient(real_server.url, namespace=bad)
        with pytest.raises(InvalidName):
            Channel.create("c", redis_url=real_server.url, namespace=bad)


@pytest.mark.parametrize("pid", ["a\tb", "a\x00b", "p\n"])
def test_control_characters_in_partition_ids_are_refused_everywhere(real_server, namespace, pid):
    client = make_client(real_server.url, namespace)
    try:
        calls = [
            lambda: client.put(_batch(), partition_id=pid),
            lambda: client.get_meta(["x"], 1, pid, task_name="t"),
            lambda: client.clear_partition(pid),
            lambda: client.kv_batch_put(["k0", "k1"], pid, _batch()),
            lambda: client.get_production_status(["x"], pid),
        ]
        for call in calls:
            with pytest.raises(InvalidName, match="partition_id"):
                call()
        assert _keys(client, namespace) == [f"{namespace}:config"]  # nothing written
    finally:
        client.close()


def test_nul_in_a_field_name_is_refused_and_nothing_is_written(real_server, namespace):
    client = make_client(real_server.url, namespace)
    try:
        with pytest.raises(InvalidName, match="field name"):
            client.put(TensorDict({"ok": torch.ones(2), "bad\x00": torch.ones(2)}, [2]), partition_id="p")
        with pytest.raises(InvalidName, match="field name"):
            client.kv_batch_put(["a", "b"], "p", _batch(field="x\x00"))
        with pytest.raises(InvalidName, match="field name"):
            client.get_meta(["x\x00"], 1, "p", task_name="t")
        with pytest.raises(InvalidName, match="task_name"):
            client.get_meta(["x"], 1, "p", task_name="t\x00")
        assert _keys(client, namespace) == [f"{namespace}:config"]
    finally:
        client.close()


def test_names_users_write_still_work(real_server, namespace):
    """The wide alphabets: verl's partition ids and fields, arbitrary KV keys."""
    client = make_client(real_server.url, namespace)
    try:
        for pid in ("train_0", "global_step_3", "val", "test@partition_1", "a:b/c*"):
            meta = client.put(TensorDict({"old_log_prob": torch.ones(2)}, [2]), partition_id=pid)
            assert client.get_data(meta)["old_log_prob"].tolist() == [1.0, 1.0]
        keys = ["0_1", "a b", "{x}", "k:*", "é"]
        client.kv_batch_put(keys, "kv", TensorDict({"input_ids": torch.arange(5)}, [5]))
        assert client.kv_batch_get(keys, "kv")["input_ids"].tolist() == [0, 1, 2, 3, 4]
        with pytest.raises(InvalidName, match="key"):
            client.kv_batch_put(["a\x00"], "kv", TensorDict({"input_ids": torch.arange(1)}, [1]))
    finally:
        client.close()


def test_a_user_partition_cannot_be_a_channels_hidden_partition(real_server, namespace):
    client = make_client(real_server.url, namespace)
    chan = Channel.create("c", redis_url=real_server.url, namespace=namespace)
    try:
        chan.put(torch.arange(3))  # a tensor item: its bytes live in partition __chan__.c
        for call in (
            lambda: client.put(_batch(), partition_id="__chan__.c"),
            lambda: client.kv_put("k", "__chan__.c", {"x": torch.ones(1)}),
            lambda: client.clear_partition("__chan__.c"),
            lambda: client.get_meta(["f0"], 1, "__chan__.c", mode="force_fetch"),
        ):
            with pytest.raises(InvalidName, match="reserved"):
                call()
        assert chan.get_nowait().tolist() == [0, 1, 2]  # the item's bytes are intact
    finally:
        chan.close()
        client.close()


def test_glob_characters_in_a_channel_name_touch_no_other_channel(real_server, namespace):
    client = make_client(real_server.url, namespace)
    star = Channel.create("a*", redis_url=real_server.url, namespace=namespace)
    other = Channel.create("ab", redis_url=real_server.url, namespace=namespace)
    try:
        star.put("mine", key="q")
        star.put(torch.ones(2))
        other.put("theirs", key="q")
        other.put(torch.zeros(2))
        star.delete()
        assert other.get_nowait(key="q") == "theirs"
        assert other.get_nowait().tolist() == [0.0, 0.0]
        with pytest.raises(ChannelNotFound):
            Channel.connect("a*", redis_url=real_server.url, namespace=namespace)
        left = [k for k in _keys(client, namespace) if "a*" in k]
        assert left == []  # the queues, streams and the tensor item's bytes are all gone
    finally:
        other.close()
        client.close()
