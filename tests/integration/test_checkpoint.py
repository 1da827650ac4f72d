"""save_checkpoint / load_checkpoint restore metadata and bytes, with the redis and the DRAM store."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.codec import objects as tq_objects
from tq_redis.errors import SampleNotFound
from tq_redis.ops import checkpoint


def _state(client):
    meta = client.get_meta(["x", "r"], 1, "p", mode="force_fetch")
    data = client.get_data(meta)
    return (meta.global_indexes, data["x"].tolist(), [r.tolist() for r in data["r"].unbind()],
            client.get_consumption_status("train", "p")[1].tolist(), tq.kv_list())


def _fill(client):
    r = torch.nested.nested_tensor([torch.arange(i + 1) for i in range(4)], layout=torch.jagged)
    client.put(TensorDict({"x": torch.arange(4), "r": r}, [4]), partition_id="p")
    client.get_meta(["x"], 2, "p", task_name="train")
    tq.kv_put("k", "kvp", {"y": torch.tensor([1.5, 2.5])}, tag={"v": 1})
    chan = tq.Channel.create("c")
    chan.put({"hello": "world"})
    chan.close()


@pytest.mark.parametrize("backend", ["redis", "dram"])
def test_checkpoint_round_trip(tmp_path, namespace, backend):
    tq.init({"namespace": namespace, "storage": {"backend": backend, "units": 1, "unit_capacity": "64MiB"}})
    try:
        client = tq.get_client()
        _fill(client)
        before = _state(client)
        tq.save_checkpoint(tmp_path / "ckpt", metadata={"step": 3})
        tq.save_checkpoint(tmp_path / "ckpt", metadata={"step": 4})  # replaces the previous one
        client.clear_partition("p")
        tq.kv_clear("k", "kvp")
        client.put(TensorDict({"x": torch.arange(2) + 100}, [2]), partition_id="after")
        assert tq.load_checkpoint(tmp_path / "ckpt", replace=True) == {"step": 4}
        assert _state(client) == before
        assert "after" not in client.get_partition_list()  # state after the checkpoint is gone
        assert [r.tolist() for r in tq.kv_batch_get("k", "kvp")["y"].unbind()] == [[1.5, 2.5]]
        assert tq.Channel.connect("c").get_nowait() == {"hello": "world"}
        # the consumption state came back too: the task gets exactly the two samples it had not seen
        assert client.get_meta(["x"], 2, "p", task_name="train").global_indexes == [2, 3]
        with pytest.raises(SampleNotFound):
            tq.kv_batch_get("gone", "kvp")
    finally:
        tq.close()


def test_metadata_only_checkpoint_of_dram_still_saves_the_bytes(tmp_path, namespace):
    """DRAM nodes die with the job, so include_storage=False is overridden (as the reference does)."""
    tq.init({"namespace": namespace, "storage": {"backend": "dram", "units": 1, "unit_capacity": "64MiB"}})
    try:
        tq.kv_batch_put(["a", "b"], "p", TensorDict({"x": torch.tensor([[5, 6], [7, 8]])}, [2]))
        tq.save_checkpoint(tmp_path / "ckpt", include_storage=False)
        tq.kv_clear(["a", "b"], "p")
        tq.load_checkpoint(tmp_path / "ckpt", replace=True)  # "p" is still listed
        rows = tq.kv_batch_get(["a", "b"], "p")["x"].unbind()
        assert [r.tolist() for r in rows] == [[5, 6], [7, 8]]
    finally:
        tq.close()


def test_load_checkpoint_leaves_a_namespace_sharing_its_prefix_alone(tmp_path, namespace):
    """Keys of ``<ns>:b`` (written by another tq-redis version, or another app) are neither saved
    nor deleted nor rewound: keys are found through registries, never by the pattern ``<ns>:*``."""
    tq.init({"namespace": namespace, "storage": {"backend": "redis"}})
    try:
        client = tq.get_client()
        client.put(TensorDict({"x": torch.arange(2)}, [2]), partition_id="p")
        tq.save_checkpoint(tmp_path / "ckpt")
        r = client.redis
        foreign = {f"{namespace}:b:{{p}}:meta": b"newer", f"{namespace}:b:partitions": b"x",
                   f"{namespace}:b:chan:{{c}}:meta": b"y", f"{namespace}:{{p}}x": b"z"}
        for key, value in foreign.items():
            r.set(key, value)
        tq.load_checkpoint(tmp_path / "ckpt", replace=True)
        assert {key: r.get(key) for key in foreign} == foreign
        saved = tq_objects.decode_object((tmp_path / "ckpt" / "redis_keys.msgpack").read_bytes())
        assert not [suffix for suffix, *_ in saved if suffix.startswith("b:")]
    finally:
        tq.close()


def test_a_cleared_partitions_ids_and_a_channels_tensor_items_survive_a_checkpoint(tmp_path, namespace):
    """Found through ``partitions:kept`` and ``channels``: the id counter of a cleared partition (ids
    are never reused) and the redis store's bytes of a queued tensor item."""
    tq.init({"namespace": namespace, "storage": {"backend": "redis"}})
    try:
        client = tq.get_client()
        client.put(TensorDict({"x": torch.arange(3)}, [3]), partition_id="p")
        client.clear_partition("p")
        chan = tq.Channel.create("c")
        chan.put(torch.arange(4))
        chan.close()
        tq.save_checkpoint(tmp_path / "ckpt")
    finally:
        tq.close()
    tq.init({"namespace": namespace + "2", "storage": {"backend": "redis"}})
    try:
        tq.load_checkpoint(tmp_path / "ckpt")
        meta = tq.get_client().put(TensorDict({"x": torch.arange(2)}, [2]), partition_id="p")
        assert meta.global_indexes == [3, 4]
        assert tq.Channel.connect("c").get_nowait().tolist() == [0, 1, 2, 3]
    finally:
        tq.close()


def test_registries_are_rebuilt_from_the_keys_of_an_older_checkpoint():
    records = [
        ["partitions", "zset", [[b"live", 1.0]], -1],
        ["{live}:meta", "hash", {b"samples": b"1"}, -1],
        ["{gone}:seq", "string", b"7", -1],
        ["{__chan__.c}:d:0:f0", "string", b"..", -1],
        ["chan:{c}:meta", "hash", {b"maxsize": b"0"}, -1],
    ]
    out = {rec[0]: rec for rec in checkpoint.registries("ns", records)}
    assert out["partitions:kept"][2] == ["gone"]
    assert out["channels"][2] == ["c"]
    assert out["{gone}:seq"] == records[2]


def test_a_channels_tensor_items_come_back_from_a_dram_checkpoint(tmp_path, namespace):
    """Channel tensors live in the store under the channel's hidden partition, named by the queue
    entries (no bits): a checkpoint saves their bytes too, or the restored entry points at nothing."""
    tq.init({"namespace": namespace, "storage": {"backend": "dram", "units": 1, "unit_capacity": "64MiB"}})
    try:
        chan = tq.Channel.create("tensors")
        chan.put(torch.arange(6).reshape(2, 3), weight=1)
        chan.put(TensorDict({"a": torch.ones(2, 2)}, [2]), weight=1)
        tq.save_checkpoint(tmp_path / "ckpt")
        chan.get_batch(2)  # weights 1 + 1; consumed: the bytes are deleted from the nodes
        tq.load_checkpoint(tmp_path / "ckpt", replace=True)  # the channel itself is still there
        first, second = tq.Channel.connect("tensors").get_batch(2)
        assert torch.equal(first, torch.arange(6).reshape(2, 3))
        assert torch.equal(second["a"], torch.ones(2, 2))
        chan.close()
    finally:
        tq.close()
