"""save_checkpoint / load_checkpoint restore metadata and bytes, with the redis and the DRAM store."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.errors import SampleNotFound


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
        assert tq.load_checkpoint(tmp_path / "ckpt") == {"step": 4}
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
        tq.load_checkpoint(tmp_path / "ckpt")
        rows = tq.kv_batch_get(["a", "b"], "p")["x"].unbind()
        assert [r.tolist() for r in rows] == [[5, 6], [7, 8]]
    finally:
        tq.close()
