"""The KV API: user keys, per-key tags, cumulative fields, idempotent clear, no key collisions."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tq_redis as tq
from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis.errors import DataNotReady, DTypeConflict, InvalidArgument, SampleNotFound, UnknownKey


def _data_keys(client, namespace: str) -> list[bytes]:
    return list(client.redis.scan_iter(match=f"{namespace}:*:d:*"))


def test_put_get_cumulative_fields_and_tags(server, namespace):
    client = make_client(server.url, namespace)
    meta = client.kv_put("a", "p", {"x": torch.tensor([1, 2, 3])}, tag={"score": 0.5})
    assert (meta.keys, meta.fields, meta.tags) == (["a"], ["x"], [{"score": 0.5}])
    meta = client.kv_put("a", "p", {"y": torch.tensor(7.0), "text": "hi"}, tag={"step": 2})
    assert sorted(meta.fields) == ["text", "x", "y"]
    assert meta.tags == [{"score": 0.5, "step": 2}]
    client.kv_batch_put(
        ["b", "c"], "p", TensorDict({"x": torch.arange(6).view(2, 3), "y": torch.tensor([1.0, 2.0])}, [2])
    )
    got = client.kv_batch_get(["c", "a"], "p")  # the fields both keys have, in key order
    assert sorted(got.keys()) == ["x", "y"]
    assert got["x"].tolist() == [[3, 4, 5], [1, 2, 3]]
    assert got["y"].tolist() == [2.0, 7.0]
    text = client.kv_batch_get("a", "p", select_fields="text")
    assert list(text["text"]) == ["hi"]  # a NonTensorStack column, as the reference returns it:
    assert type(text["text"]) is type(TensorDict({"t": NonTensorStack("x")}, [1])["t"])  # what td[key] gives for one
    assert isinstance(text.get("text"), NonTensorStack)
    # KV samples are ordinary samples: a consumer claims them once their fields are produced
    claimed = client.get_meta(["x", "y"], 3, "p", task_name="reader")
    assert client.kv_retrieve_keys(claimed.global_indexes, "p") == ["a", "b", "c"]
    client.close()


def test_kv_list_filters_by_tag_values_in_the_listing_script(server, namespace):
    """verl's replay buffer lists every key to find finished trajectories; ``where`` keeps only the
    keys whose tags match, filtered by the script, over pages of a listing bigger than one page."""
    client = make_client(server.url, namespace)
    n = 1300  # more than one listing page (512 keys)
    tags = [{"status": "finished" if i % 3 == 0 else "running", "step": i % 2} for i in range(n)]
    client.kv_batch_put([f"k{i}" for i in range(n)], "p", tags=tags)
    client.kv_put("nostatus", "p", tag={"step": 0})
    finished = client.kv_list("p", where={"status": "finished"})["p"]
    assert list(finished) == [f"k{i}" for i in range(0, n, 3)]
    assert finished["k3"] == {"status": "finished", "step": 1}
    both = client.kv_list("p", where={"status": "finished", "step": 0})["p"]
    assert list(both) == [f"k{i}" for i in range(0, n, 6)]
    assert client.kv_list(where={"status": "done"}) == {"p": {}}
    assert client.kv_list("p", where={"step": 1.0})["p"] == {}  # JSON text: 1.0 is not 1
    assert len(client.kv_list("p", where={})["p"]) == n + 1
    with pytest.raises(InvalidArgument):
        client.kv_list("p", where={"status": ["finished"]})
    with pytest.raises(InvalidArgument):
        client.kv_list("p", where=["status"])
    client.close()


def test_tag_only_updates_and_list(server, namespace):
    client = make_client(server.url, namespace)
    client.kv_batch_put(["k1", "k2"], "p", TensorDict({"v": torch.tensor([10, 20])}, [2]), tags=[{"t": 1}, {}])
    meta = client.kv_batch_put(["k2", "k3"], "p", tags=[{"t": 2}, {"t": 3, "u": [1, 2]}])
    assert meta.fields == []  # k3 has no field yet, so no field is common
    assert client.kv_list("p") == {"p": {"k1": {"t": 1}, "k2": {"t": 2}, "k3": {"t": 3, "u": [1, 2]}}}
    assert client.kv_batch_get("k2", "p")["v"].tolist() == [20]  # the tag update kept the data
    assert client.kv_list("nowhere") == {}
    client.kv_put("solo", "q", tag={"only": True})
    assert client.kv_list() == {
        "p": {"k1": {"t": 1}, "k2": {"t": 2}, "k3": {"t": 3, "u": [1, 2]}},
        "q": {"solo": {"only": True}},
    }
    client.close()


def test_get_errors_name_what_is_wrong(server, namespace):
    client = make_client(server.url, namespace)
    client.kv_batch_put(["a", "b"], "p", TensorDict({"x": torch.arange(2)}, [2]))
    client.kv_put("a", "p", {"y": torch.tensor(1)})
    with pytest.raises(DataNotReady, match=r"'y'.*\['b'\]"):
        client.kv_batch_get(["a", "b"], "p", select_fields=["x", "y"])
    # a field no key has is left out, as in the reference (verl selects optional fields)
    got = client.kv_batch_get(["a", "b"], "p", select_fields=["x", "nope", "ref_log_prob"])
    assert list(got.keys()) == ["x"] and got["x"].tolist() == [0, 1]
    assert client.kv_batch_get(["b"], "p", select_fields=["y"]).batch_size == (1,)  # b lacks y: nothing
    with pytest.raises(UnknownKey, match=r"\['zz'\] not found"):  # the reference drops unknown keys silently
        client.kv_batch_get(["a", "zz"], "p")
    with pytest.raises(ValueError, match="not found"):  # what the reference's callers catch
        client.kv_batch_get(["zz"], "p")
    with pytest.raises(SampleNotFound, match="does not exist"):
        client.kv_batch_get(["a"], "no_such_partition")
    with pytest.raises(InvalidArgument, match="unique"):
        client.kv_batch_put(["a", "a"], "p", tags=[{}, {}])
    with pytest.raises(InvalidArgument, match="fields=, tags="):
        client.kv_put("a", "p")
    meta = client.kv_batch_put(["a", "b"], "p", tags=[{}, {}])
    with pytest.raises(InvalidArgument, match="select_fields"):
        client.kv_batch_get_by_meta(meta, select_fields=["y"])
    assert client.kv_batch_get_by_meta(meta)["x"].tolist() == [0, 1]
    client.close()


def test_failed_put_leaves_no_half_created_keys(server, namespace):
    client = make_client(server.url, namespace, strict_schema=True)
    client.kv_put("a", "p", {"x": torch.tensor([1, 2])})
    with pytest.raises(DTypeConflict):
        client.kv_batch_put(["a", "b", "c"], "p", TensorDict({"x": torch.zeros(3, 2)}, [3]))
    assert list(client.kv_list("p")["p"]) == ["a"]
    assert client.kv_batch_get("a", "p")["x"].tolist() == [[1, 2]]
    client.close()


def test_clear_is_idempotent_frees_data_and_never_reuses_ids(server, namespace):
    client = make_client(server.url, namespace)
    client.kv_batch_put(["a", "b"], "p", TensorDict({"x": torch.arange(2)}, [2]))
    old_ids = client.kv_retrieve_meta(["a", "b"], "p").global_indexes
    assert len(_data_keys(client, namespace)) == 2
    client.kv_clear(["a", "never"], "p")
    client.kv_clear("a", "p")
    client.kv_clear("a", "no_such_partition")
    assert len(_data_keys(client, namespace)) == 1
    assert list(client.kv_list("p")["p"]) == ["b"]
    with pytest.raises(SampleNotFound):
        client.kv_batch_get("a", "p")
    client.kv_put("a", "p", {"x": torch.tensor(5)})
    new_id = client.kv_retrieve_meta("a", "p").global_indexes[0]
    assert new_id not in old_ids
    assert client.kv_batch_get(["a", "b"], "p")["x"].tolist() == [5, 1]
    client.clear_partition("p")
    assert _data_keys(client, namespace) == []
    assert client.kv_list("p") == {}
    client.close()


def test_keys_never_collide_across_partitions(server, namespace):
    client = make_client(server.url, namespace)
    client.kv_put("same", "p1", {"x": torch.tensor(1)})
    client.kv_put("same", "p2", {"x": torch.tensor(2)})
    client.kv_clear("same", "p1")
    assert client.kv_batch_get("same", "p2")["x"].tolist() == [2]
    client.close()


def test_retrieve_meta_and_keys(server, namespace):
    client = make_client(server.url, namespace)
    client.kv_batch_put(["a", "b"], "p", TensorDict({"x": torch.arange(2)}, [2]), tags=[{"s": 1}, {"s": 2}])
    meta = client.kv_retrieve_meta(["b", "missing", "a"], "p")  # as the reference: unknown keys left out
    assert meta.field_names == ["x"] and meta.custom_meta == [{"s": 2}, {"s": 1}]
    assert client.kv_retrieve_keys(meta.global_indexes, "p") == ["b", "a"]
    created = client.kv_retrieve_meta(["c"], "p", create=True)
    assert created.size == 1 and created.field_names == []
    with pytest.raises(SampleNotFound):
        client.kv_retrieve_keys([999], "p")
    assert client.kv_retrieve_meta(["a"], "no_such_partition").size == 0
    client.close()


def test_module_level_api_async_twins_and_data_parser(real_server, namespace):
    tq.init({"redis": {"url": real_server.url}, "namespace": namespace, "storage": {"backend": "redis"}})
    try:
        def parse(columns):
            columns["url"][:] = [u.upper() for u in columns["url"]]

        tq.kv_batch_put(["a", "b"], "p", TensorDict({"url": ["x://1", "x://2"]}, [2]), data_parser=parse)
        assert list(tq.kv_batch_get(["a", "b"], "p")["url"]) == ["X://1", "X://2"]  # no .tolist() on tensordict 0.10

        async def main():
            meta = await tq.async_kv_put("c", "p", {"url": "x://3"}, tag={"n": 3})
            got = await tq.async_kv_batch_get_by_meta(meta)
            listing = await tq.async_kv_list("p")
            await tq.async_kv_clear(["a", "c"], "p")
            batch = await tq.async_kv_batch_put(["d"], "p", tags=[{"n": 4}])
            return got, listing, batch, await tq.async_kv_batch_get("b", "p")

        got, listing, batch, rest = asyncio.run(main())
        assert list(got["url"]) == ["x://3"]
        assert listing["p"] == {"a": {}, "b": {}, "c": {"n": 3}}
        assert batch.tags == [{"n": 4}] and list(rest["url"]) == ["X://2"]
        assert tq.kv_list("p") == {"p": {"b": {}, "d": {"n": 4}}}
    finally:
        tq.close()


KEYS = [f"k{i}" for i in range(40)]
WRITERS = 4


def _writer(url: str, ns: str, rank: int, go) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    go.wait()
    for start in range(0, len(KEYS), 8):
        keys = KEYS[start : start + 8]
        values = torch.tensor([int(k[1:]) * 10 + rank for k in keys])
        client.kv_batch_put(keys, "p", TensorDict({f"f{rank}": values}, [len(keys)]), tags=[{f"t{rank}": 1}] * 8)
    client.close()


def test_concurrent_writers_of_different_fields_lose_nothing(real_server, namespace):
    make_client(real_server.url, namespace).close()
    ctx = mp_context()
    go = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(real_server.url, namespace, r, go)) for r in range(WRITERS)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    client = make_client(real_server.url, namespace)
    meta = client.kv_retrieve_meta(KEYS, "p")
    assert len(set(meta.global_indexes)) == len(KEYS)  # every key got exactly one sample
    assert sorted(meta.field_names) == [f"f{r}" for r in range(WRITERS)]
    data = client.kv_batch_get(KEYS, "p")
    for r in range(WRITERS):
        assert data[f"f{r}"].tolist() == [i * 10 + r for i in range(len(KEYS))]
    assert all(tags == {f"t{r}": 1 for r in range(WRITERS)} for tags in client.kv_list("p")["p"].values())
    client.close()
