"""Unit tests for KVBatchMeta (imported from tq_redis.meta, as users do)."""

from __future__ import annotations

import pickle

import pytest

from tq_redis.errors import BatchSizeMismatch, InvalidArgument, SampleNotFound
from tq_redis.meta import KeyNotInBatch, KVBatchMeta


def make_kv(keys: list[str], partition: str = "p", fields: list[str] | None = None, **extra) -> KVBatchMeta:
    return KVBatchMeta(
        keys=keys,
        tags=[{"k": k} for k in keys],
        partition_id=partition,
        fields=fields if fields is not None else ["x", "y"],
        extra_info=extra,
    )


class TestKVBatchMeta:
    def test_defaults(self):
        kv = KVBatchMeta()
        assert kv.size == len(kv) == 0
        assert kv.keys == [] and kv.tags == [] and kv.extra_info == {}
        assert kv.partition_id is None and kv.fields is None
        assert KVBatchMeta(extra_info=None).extra_info == {}

    def test_validation(self):
        with pytest.raises(BatchSizeMismatch, match="keys and tags must have same length, but got 2 and 1; give one"):
            KVBatchMeta(keys=["a", "b"], tags=[{}])
        with pytest.raises(InvalidArgument, match=r"Got duplicated keys \['a'\]"):
            KVBatchMeta(keys=["a", "b", "a"], tags=[{}, {}, {}])
        with pytest.raises(InvalidArgument, match=r"Got duplicated fields \['x'\]; fields must be unique"):
            KVBatchMeta(keys=["a"], tags=[{}], fields=["x", "x"])
        with pytest.raises(InvalidArgument, match="single string"):
            KVBatchMeta(keys="ab", tags=[{}, {}])  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="dicts"):
            KVBatchMeta(keys=["a"], tags=["t"])  # type: ignore[list-item]
        with pytest.raises(ValueError):
            KVBatchMeta(keys=["a", "a"], tags=[{}, {}])

    def test_inputs_not_aliased(self):
        tags = [{"v": 1}]
        keys = ["a"]
        kv = KVBatchMeta(keys=keys, tags=tags)
        tags[0]["v"] = 2
        keys.append("b")
        assert kv.tags == [{"v": 1}]
        assert kv.keys == ["a"]

    def test_select_keys(self):
        kv = make_kv(["a", "b", "c"], step=1)
        s = kv.select_keys(["c", "a"])
        assert s.keys == ["c", "a"]
        assert s.tags == [{"k": "c"}, {"k": "a"}]
        assert s.partition_id == "p" and s.fields == ["x", "y"] and s.extra_info == {"step": 1}
        s.tags[0]["k"] = "changed"
        assert kv.tags[2] == {"k": "c"}

    def test_select_unknown_key_raises(self):
        kv = make_kv(["a", "b"])
        with pytest.raises(KeyNotInBatch, match=r"\['zz'\] not found in current batch"):
            kv.select_keys(["a", "zz"])
        # the reference raises RuntimeError; code written against ours catches SampleNotFound/KeyError
        for caught in (RuntimeError, SampleNotFound, KeyError):
            with pytest.raises(caught):
                kv.select_keys(["zz"])

    def test_select_duplicate_keys_raises(self):
        with pytest.raises(InvalidArgument, match=r"Contain duplicate keys \['a'\]"):
            make_kv(["a", "b"]).select_keys(["a", "a"])

    def test_tags_and_extra_info_are_deep_copied(self):
        tags = [{"data": [1, 2, 3]}]
        extra = {"nested": {"value": 1}}
        kv = KVBatchMeta(keys=["a"], tags=tags, extra_info=extra)
        kv.tags[0]["data"].append(4)
        kv.extra_info["nested"]["value"] = 999
        assert tags == [{"data": [1, 2, 3]}] and extra == {"nested": {"value": 1}}
        # nor do batches derived from one another share nested values
        chunked = kv.chunk(1)[0]
        chunked.tags[0]["data"].append(5)
        chunked.extra_info["nested"]["value"] = 7
        assert kv.tags[0]["data"] == [1, 2, 3, 4] and kv.extra_info["nested"]["value"] == 999

    def test_reorder(self):
        kv = make_kv(["a", "b", "c"])
        kv.reorder([2, 0, 1])
        assert kv.keys == ["c", "a", "b"]
        assert kv.tags == [{"k": "c"}, {"k": "a"}, {"k": "b"}]

    @pytest.mark.parametrize("indexes", [[0, 1], [0, 0, 1], [0, 1, 5], [-1, 0, 1]])
    def test_reorder_invalid(self, indexes):
        kv = make_kv(["a", "b", "c"])
        with pytest.raises(InvalidArgument):
            kv.reorder(indexes)
        assert kv.keys == ["a", "b", "c"]

    @pytest.mark.parametrize("n,k", [(10, 3), (3, 5), (4, 4), (0, 2)])
    def test_chunk(self, n, k):
        kv = make_kv([f"k{i}" for i in range(n)], step=7)
        parts = kv.chunk(k)
        sizes = [p.size for p in parts]
        assert len(parts) == k and sum(sizes) == n
        assert max(sizes) - min(sizes) <= 1
        assert [key for p in parts for key in p.keys] == kv.keys
        assert all(p.partition_id == "p" and p.extra_info == {"step": 7} for p in parts)

    @pytest.mark.parametrize("k", [0, -2, 2.0])
    def test_chunk_invalid(self, k):
        with pytest.raises(InvalidArgument):
            make_kv(["a"]).chunk(k)  # type: ignore[arg-type]

    def test_concat(self):
        c = KVBatchMeta.concat([make_kv(["a", "b"], step=1), KVBatchMeta(), make_kv(["c"], step=1, more=2)])
        assert c.keys == ["a", "b", "c"]
        assert c.tags == [{"k": "a"}, {"k": "b"}, {"k": "c"}]
        assert c.partition_id == "p"
        assert c.fields == ["x", "y"]
        assert c.extra_info == {"step": 1, "more": 2}

    def test_concat_round_trips_chunk(self):
        kv = make_kv([f"k{i}" for i in range(7)])
        assert KVBatchMeta.concat(kv.chunk(3)) == kv

    def test_concat_empty(self):
        assert KVBatchMeta.concat([]) == KVBatchMeta()
        assert KVBatchMeta.concat([KVBatchMeta(), KVBatchMeta()]).size == 0

    def test_concat_partition_mismatch(self):
        with pytest.raises(InvalidArgument, match="Partition do not match for concatenation: batch #1 .*'q'"):
            KVBatchMeta.concat([make_kv(["a"], partition="p"), make_kv(["b"], partition="q")])

    def test_concat_fields_mismatch(self):
        with pytest.raises(InvalidArgument, match=r"Field names do not match for concatenation: .*\['x', 'z'\]"):
            KVBatchMeta.concat([make_kv(["a"], fields=["x"]), make_kv(["b"], fields=["x", "z"])])
        # Same set in another order is fine; unknown (None) fields match anything.
        c = KVBatchMeta.concat(
            [
                KVBatchMeta(keys=["a"], tags=[{}], partition_id="p", fields=None),
                make_kv(["b"], fields=["y", "x"]),
                make_kv(["c"], fields=["x", "y"]),
            ]
        )
        assert c.fields == ["y", "x"]

    def test_concat_extra_info_conflict(self):
        with pytest.raises(InvalidArgument, match="extra_info key 'step' has conflicting values across chunks"):
            KVBatchMeta.concat([make_kv(["a"], step=1), make_kv(["b"], step=2)])

    def test_concat_duplicate_keys(self):
        with pytest.raises(InvalidArgument, match="unique"):
            KVBatchMeta.concat([make_kv(["a", "b"]), make_kv(["b"])])

    def test_pickle_round_trip(self):
        kv = make_kv(["a", "b"], step=3)
        back = pickle.loads(pickle.dumps(kv))
        assert back == kv
        assert back is not kv
        assert back.size == 2

    def test_str(self):
        text = str(make_kv([f"k{i}" for i in range(100)]))
        assert "size=100" in text and "'p'" in text and len(text) < 300
