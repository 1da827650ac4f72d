"""Names holding ``~`` are tq-redis's own (partial rollout's ``<f>~<k>``, ``<f>~parts``, ``<f>~next``,
``<f>~version``): as a user's field or tag they are refused before anything is written, on Valkey and
Redis 7.0, so an appended field's parts, per-token versions and append bookkeeping cannot be touched.

Before: a plain field ``resp~0`` overwrote part 0 of the appended ``resp``, ``resp~version`` replaced
the versions ``get_data`` returns, and tags ``resp~parts`` / ``resp~next`` made the next
``append_parts`` fail with a Lua error (the rollout stuck).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.integration.conftest import key_snapshot
from tq_redis import GRPOTransferDock
from tq_redis.errors import InvalidName

RESERVED = ["resp~0", "resp~version", "resp~parts", "resp~next"]


def _appended(client):
    """Two prompts whose response ``resp`` has one part (version 0) and is still in progress."""
    meta = client.put(TensorDict({"prompt": torch.arange(2).reshape(2, 1)}, [2]), partition_id="p")
    client.append_parts(meta, {"resp": torch.tensor([[1, 2], [3, 4]])}, 0)
    return client.get_meta(["prompt"], 2, "p", mode="force_fetch")


@pytest.mark.parametrize("name", ["resp~0", "resp~version"])
def test_a_plain_field_with_a_reserved_name_is_refused_and_nothing_is_written(rclient, name):
    meta = _appended(rclient)
    before = key_snapshot(rclient)
    with pytest.raises(InvalidName, match=rf"field name '{name}' contains '~', which is reserved"):
        rclient.put(TensorDict({name: torch.tensor([[9, 9], [9, 9]])}, [2]), metadata=meta)
    with pytest.raises(InvalidName, match="reserved"):  # nor as a new sample's field
        rclient.put(TensorDict({"prompt": torch.ones(2, 1), name: torch.ones(2, 1)}, [2]), partition_id="p")
    with pytest.raises(InvalidName, match="reserved"):  # nor allocated for a later put
        rclient.get_meta(["prompt", name], 2, "p", mode="insert")
    assert key_snapshot(rclient) == before
    rclient.append_parts(meta, {"resp": torch.tensor([[5], [6]])}, 1, complete=True)
    data = rclient.get_data(rclient.get_meta(["resp"], 2, "p", task_name="t"))
    assert data["resp"].tolist() == [[1, 2, 5], [3, 4, 6]]  # part 0 is what was appended
    assert data["resp~version"].tolist() == [[0, 0, 1], [0, 0, 1]]


@pytest.mark.parametrize("name", ["resp~parts", "resp~next"])
def test_reserved_tags_are_refused_and_the_rollout_goes_on(rclient, name):
    meta = _appended(rclient)
    before = key_snapshot(rclient)
    meta.update_custom_meta([{name: 7, "score": 1}, {name: 8, "score": 2}])
    with pytest.raises(InvalidName, match=rf"custom meta key '{name}' contains '~', which is reserved"):
        rclient.set_custom_meta(meta)
    with pytest.raises(InvalidName, match="reserved"):  # a rewrite carrying it stores no byte either
        rclient.put(TensorDict({"reward": torch.ones(2)}, [2]), metadata=meta)
    with pytest.raises(InvalidName, match="reserved"):
        rclient.kv_put("k", "p", {"x": torch.ones(1)}, tag={name: 1})
    assert key_snapshot(rclient) == before
    done = rclient.append_parts(meta, {"resp": torch.tensor([[5], [6]])}, 1, complete=True)
    assert list(done.production_status) == [1, 1]
    assert rclient.get_data(rclient.get_meta(["resp"], 2, "p", task_name="t"))["resp"].tolist() == [[1, 2, 5],
                                                                                                   [3, 4, 6]]


def test_a_batch_read_and_written_back_carries_no_reserved_tag(rclient):
    """Reads leave tq-redis's own tags out of custom_meta, so get_meta -> update -> set_custom_meta
    (or a rewrite put) of samples with appended fields keeps working and never rewinds their parts."""
    meta = _appended(rclient)
    assert meta.custom_meta == [{}, {}]
    meta.update_custom_meta([{"score": 1}, {"score": 2}])
    rclient.set_custom_meta(meta)
    rclient.put(TensorDict({"reward": torch.ones(2)}, [2]), metadata=meta)
    rclient.append_parts(meta, {"resp": torch.tensor([[5], [6]])}, 1, complete=True)
    got = rclient.get_meta(["resp", "reward"], 2, "p", task_name="t")
    assert got.custom_meta == [{"score": 1}, {"score": 2}]
    assert rclient.get_data(got)["resp~version"].tolist() == [[0, 0, 1], [0, 0, 1]]


def test_a_dock_column_with_a_reserved_name_is_refused_before_the_dock_exists(real_server, namespace):
    before = make_client(real_server.url, namespace)
    try:
        with pytest.raises(InvalidName, match=r"dock column 'responses~version' contains '~'"):
            GRPOTransferDock(1, 2, addition_columns=["responses~version"], redis_url=real_server.url,
                             namespace=namespace, name="d")
        assert before.get_partition_list() == [] and key_snapshot(before) == {}
    finally:
        before.close()
