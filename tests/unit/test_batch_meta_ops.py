"""Unit tests for BatchMeta's operations: selection, chunking, union/concat, reorder/copy, tags, pickling."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tests.unit.batch_metas import assert_same_contents, dense, jagged, make_meta
from tq_redis.errors import BatchSizeMismatch, InvalidArgument
from tq_redis.meta import KIND_JAGGED, KIND_STRIDED, KIND_TENSOR, BatchMeta

# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------


class TestSelectSamples:
    def test_selects_in_given_order(self):
        m = make_meta(5)
        m.production_status[3] = 0
        m._custom_backend_meta[3]["a"] = "handle3"
        s = m.select_samples([3, 0])
        assert s.global_indexes == [3, 0]
        assert s.partition_ids == ["p0", "p0"]
        assert s.production_status.tolist() == [0, 1]
        assert s.custom_meta == [{"uid": "u3"}, {"uid": "u0"}]
        assert s.field_schema["tok"]["per_sample_shapes"] == [(4,), (1,)]
        assert s._custom_backend_meta == [{"a": "handle3"}, {}]

    def test_result_is_independent(self):
        m = make_meta(3)
        s = m.select_samples([0, 1])
        s.update_custom_meta([{"uid": "x"}, {"new": 1}])
        s.production_status[:] = 0
        s.set_extra_info("k", 1)
        s.field_schema["a"]["shape"] = (9,)
        assert m.custom_meta[0] == {"uid": "u0"}
        assert m.is_ready
        assert not m.has_extra_info("k")
        assert m.field_schema["a"]["shape"] == (4,)

    def test_duplicates_allowed_and_numpy_positions(self):
        m = make_meta(3)
        s = m.select_samples(np.array([2, 2]))
        assert s.global_indexes == [2, 2]

    @pytest.mark.parametrize("bad", [[0, 3], [-1]])
    def test_out_of_range(self, bad):
        with pytest.raises(InvalidArgument, match="outside"):
            make_meta(3).select_samples(bad)

    def test_empty_selection(self):
        s = make_meta(3).select_samples([])
        assert s.size == 0
        assert s.field_schema["tok"]["per_sample_shapes"] == []


class TestSelectFields:
    def test_keeps_samples_drops_other_fields(self):
        m = make_meta(3, extra={"step": 4})
        m.production_status[1] = 0
        m._custom_backend_meta[0].update({"a": 1, "tok": 2, "_loc": 3})
        s = m.select_fields(["tok"])
        assert s.field_names == ["tok"]
        assert s.global_indexes == m.global_indexes
        assert s.partition_ids == m.partition_ids
        assert s.production_status.tolist() == [1, 0, 1]
        assert s.custom_meta == m.custom_meta
        assert s.extra_info == {"step": 4}
        assert s._custom_backend_meta[0] == {"tok": 2, "_loc": 3}
        assert m.field_names == ["a", "tok"]  # original untouched

    def test_result_is_independent(self):
        m = make_meta(2)
        s = m.select_fields(["tok"])
        s.field_schema["tok"]["per_sample_shapes"][0] = (100,)
        s.custom_meta[0]["uid"] = "changed"
        assert m.field_schema["tok"]["per_sample_shapes"][0] == (1,)
        assert m.custom_meta[0]["uid"] == "u0"

    def test_unknown_field_is_left_out_like_the_reference(self):
        s = make_meta(2).select_fields(["tok", "missing_field"])
        assert s.field_names == ["tok"] and s.size == 2

    def test_on_empty_batch_returns_empty(self):
        s = BatchMeta.empty().select_fields(["anything"])
        assert s.size == 0 and s.field_names == []


class TestGetItem:
    def test_int_and_negative_int(self):
        m = make_meta(4)
        assert m[1].global_indexes == [1]
        assert m[-1].global_indexes == [3]
        assert m[-4].global_indexes == [0]
        assert m[np.int64(2)].global_indexes == [2]
        assert m[-1].custom_meta == [{"uid": "u3"}]
        assert m[-1].field_schema["tok"]["per_sample_shapes"] == [(4,)]

    @pytest.mark.parametrize("i", [4, -5])
    def test_out_of_range(self, i):
        with pytest.raises(IndexError):
            make_meta(4)[i]

    def test_slices(self):
        m = make_meta(6)
        assert m[1:4].global_indexes == [1, 2, 3]
        assert m[::2].global_indexes == [0, 2, 4]
        assert m[::-1].global_indexes == [5, 4, 3, 2, 1, 0]
        assert m[::-1].field_schema["tok"]["per_sample_shapes"] == [(6,), (5,), (4,), (3,), (2,), (1,)]
        assert m[-2:].custom_meta == [{"uid": "u4"}, {"uid": "u5"}]
        assert m[10:].size == 0

    def test_unsupported_key(self):
        with pytest.raises(TypeError):
            make_meta(2)["a"]  # type: ignore[index]

    def test_iteration_yields_single_sample_batches(self):
        assert [b.global_indexes for b in make_meta(3)] == [[0], [1], [2]]


# ---------------------------------------------------------------------------------------------
# chunking
# ---------------------------------------------------------------------------------------------


class TestChunk:
    @pytest.mark.parametrize("n,k", [(10, 3), (9, 3), (7, 4), (1, 1), (5, 5), (100, 7)])
    def test_sizes_differ_by_at_most_one_and_order_kept(self, n, k):
        m = make_meta(n)
        parts = m.chunk(k)
        assert len(parts) == k
        sizes = [p.size for p in parts]
        assert sum(sizes) == n
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # larger chunks first
        assert [i for p in parts for i in p.global_indexes] == list(range(n))
        assert [t for p in parts for t in p.get_shapes("tok")] == m.get_shapes("tok")
        assert [c for p in parts for c in p.custom_meta] == m.custom_meta

    def test_more_chunks_than_samples_gives_empty_tail(self):
        parts = make_meta(2).chunk(4)
        assert [p.size for p in parts] == [1, 1, 0, 0]
        assert parts[3].field_names == ["a", "tok"]
        assert not parts[3].is_ready

    @pytest.mark.parametrize("k", [0, -1, 1.5, "2", True])
    def test_invalid_chunk_count(self, k):
        with pytest.raises(InvalidArgument, match="positive int"):
            make_meta(4).chunk(k)  # type: ignore[arg-type]

    def test_chunks_are_independent(self):
        m = make_meta(4)
        first = m.chunk(2)[0]
        first.custom_meta[0]["uid"] = "x"
        first.production_status[0] = 0
        assert m.custom_meta[0]["uid"] == "u0"
        assert m.production_status[0] == 1

    def test_chunk_by_partition(self):
        m = BatchMeta.concat([make_meta(2, partition="a"), make_meta(2, start=2, partition="b")])
        m.reorder([2, 0, 3, 1])
        parts = m.chunk_by_partition()
        assert [p.partition_ids for p in parts] == [["b", "b"], ["a", "a"]]
        assert [p.global_indexes for p in parts] == [[2, 3], [0, 1]]
        assert [p.custom_meta for p in parts] == [
            [{"uid": "u2"}, {"uid": "u3"}],
            [{"uid": "u0"}, {"uid": "u1"}],
        ]

    def test_chunk_by_partition_single_and_empty(self):
        m = make_meta(3)
        parts = m.chunk_by_partition()
        assert len(parts) == 1 and parts[0].global_indexes == [0, 1, 2]
        assert parts[0] is not m
        assert BatchMeta.empty().chunk_by_partition() == []


# ---------------------------------------------------------------------------------------------
# union / concat
# ---------------------------------------------------------------------------------------------


class TestUnion:
    def test_merges_fields_status_and_tags(self):
        left = BatchMeta(
            [0, 1, 2, 3],
            ["p"] * 4,
            {"a": dense(), "shared": dense(torch.float32, (1,))},
            production_status=[1, 1, 0, 0],
            extra_info={"x": 1, "both": "left"},
            custom_meta=[{"l": i, "both": "left"} for i in range(4)],
        )
        right = BatchMeta(
            [0, 1, 2, 3],
            ["p"] * 4,
            {"b": dense(torch.int64), "shared": dense(torch.float64, (2,))},
            production_status=[1, 0, 1, 0],
            extra_info={"y": 2, "both": "right"},
            custom_meta=[{"r": i, "both": "right"} for i in range(4)],
        )
        u = left.union(right)
        assert u.field_names == ["a", "b", "shared"]
        assert u.field_schema["shared"]["dtype"] == torch.float64  # other wins
        assert u.field_schema["shared"]["shape"] == (2,)
        assert u.production_status.tolist() == [1, 0, 0, 0]  # AND
        assert u.custom_meta[2] == {"l": 2, "r": 2, "both": "right"}
        assert u.extra_info == {"x": 1, "y": 2, "both": "right"}
        assert u.global_indexes == [0, 1, 2, 3]
        # inputs unchanged
        assert left.field_names == ["a", "shared"]
        assert left.production_status.tolist() == [1, 1, 0, 0]
        assert left.custom_meta[2] == {"l": 2, "both": "left"}

    def test_union_is_ready_only_when_both_ready(self):
        ready = make_meta(2)
        not_ready = make_meta(2, ready=False)
        assert not ready.union(not_ready).is_ready
        assert not not_ready.union(ready).is_ready
        assert ready.union(make_meta(2)).is_ready

    def test_global_index_mismatch(self):
        with pytest.raises(InvalidArgument, match="global_indexes do not match: they differ at position 0"):
            make_meta(2).union(make_meta(2, start=5))
        with pytest.raises(ValueError):
            make_meta(2).union(make_meta(2, start=5))

    def test_partition_mismatch(self):
        with pytest.raises(InvalidArgument, match="partition_ids do not match"):
            make_meta(2).union(make_meta(2, partition="other"))

    def test_size_mismatch(self):
        with pytest.raises(BatchSizeMismatch):
            make_meta(2).union(make_meta(3))

    def test_same_ids_different_order_rejected(self):
        other = make_meta(3)
        other.reorder([2, 1, 0])
        with pytest.raises(InvalidArgument, match="same order"):
            make_meta(3).union(other)

    def test_empty_side_returns_copy(self):
        m = make_meta(2)
        u = m.union(BatchMeta.empty())
        assert u is not m
        assert_same_contents(u, m)
        u.custom_meta[0]["uid"] = "x"
        assert m.custom_meta[0]["uid"] == "u0"
        assert_same_contents(BatchMeta.empty().union(m), m)

    def test_not_a_batchmeta(self):
        with pytest.raises(InvalidArgument):
            make_meta(2).union({"global_indexes": [0, 1]})  # type: ignore[arg-type]


class TestConcat:
    def test_preserves_order_status_and_tags(self):
        a = make_meta(2, extra={"step": 1})
        b = make_meta(3, start=10, ready=False, extra={"step": 1, "more": True})
        b._custom_backend_meta[0]["a"] = "h"
        c = BatchMeta.concat([a, b])
        assert c.global_indexes == [0, 1, 10, 11, 12]
        assert c.production_status.tolist() == [1, 1, 0, 0, 0]
        assert c.custom_meta == [{"uid": f"u{i}"} for i in (0, 1, 10, 11, 12)]
        assert c._custom_backend_meta == [{}, {}, {"a": "h"}, {}, {}]
        assert c.get_shapes("tok") == [(1,), (2,), (11,), (12,), (13,)]
        assert c.extra_info == {"step": 1, "more": True}
        assert c.production_status.dtype == np.int8

    def test_round_trips_chunk(self):
        m = make_meta(7)
        assert_same_contents(BatchMeta.concat(m.chunk(3)), m)

    def test_result_is_independent(self):
        a, b = make_meta(1), make_meta(1, start=1)
        c = BatchMeta.concat([a, b])
        c.custom_meta[0]["uid"] = "x"
        assert a.custom_meta[0]["uid"] == "u0"

    def test_mixed_tagged_and_untagged(self):
        c = BatchMeta.concat([make_meta(1, tags=False), make_meta(1, start=1)])
        assert c.custom_meta == [{}, {"uid": "u1"}]

    def test_field_names_mismatch(self):
        other = make_meta(2, start=2).select_fields(["a"])
        with pytest.raises(InvalidArgument, match=r"missing \['tok'\]"):
            BatchMeta.concat([make_meta(2), other])
        with pytest.raises(ValueError):
            BatchMeta.concat([make_meta(2), other])

    def test_dtype_mismatch(self):
        x = BatchMeta([0], ["p"], {"a": dense(torch.float32)})
        y = BatchMeta([1], ["p"], {"a": dense(torch.float16)})
        with pytest.raises(InvalidArgument, match="cast"):
            BatchMeta.concat([x, y])

    def test_extra_info_conflict(self):
        with pytest.raises(InvalidArgument, match="extra_info key 'step' has conflicting values.*remove_extra_info"):
            BatchMeta.concat([make_meta(1, extra={"step": 1}), make_meta(1, start=1, extra={"step": 2})])

    def test_extra_info_tensor_values(self):
        t = torch.arange(3)
        c = BatchMeta.concat([make_meta(1, extra={"t": t}), make_meta(1, start=1, extra={"t": t.clone()})])
        assert torch.equal(c.extra_info["t"], t)
        with pytest.raises(InvalidArgument):
            BatchMeta.concat([make_meta(1, extra={"t": t}), make_meta(1, start=1, extra={"t": t + 1})])
        with pytest.raises(InvalidArgument):
            BatchMeta.concat(
                [make_meta(1, extra={"t": np.zeros(2)}), make_meta(1, start=1, extra={"t": np.ones(2)})]
            )

    def test_empty_inputs(self):
        assert BatchMeta.concat([]).size == 0
        assert BatchMeta.concat([BatchMeta.empty(), BatchMeta.empty()]).size == 0
        m = make_meta(2)
        c = BatchMeta.concat([BatchMeta.empty(), m, BatchMeta.empty()])
        assert_same_contents(c, m)

    def test_differing_dense_shapes_become_jagged(self):
        x = BatchMeta([0, 1], ["p", "p"], {"a": dense(shape=(3,))})
        y = BatchMeta([2], ["p"], {"a": dense(shape=(5,))})
        c = BatchMeta.concat([x, y])
        meta = c.field_schema["a"]
        assert meta["is_nested"] is True and meta["kind"] == KIND_JAGGED
        assert meta["per_sample_shapes"] == [(3,), (3,), (5,)]
        assert x.field_schema["a"]["kind"] == KIND_TENSOR  # inputs untouched
        assert meta["shape"] is None
        assert c.get_shapes("a") == [(3,), (3,), (5,)]

    def test_dense_with_jagged_becomes_jagged(self):
        x = BatchMeta([0], ["p"], {"t": dense(torch.int64, (2,))})
        y = BatchMeta([1, 2], ["p", "p"], {"t": jagged([(4,), (1,)])})
        c = BatchMeta.concat([x, y])
        assert c.field_schema["t"]["per_sample_shapes"] == [(2,), (4,), (1,)]
        assert c.field_schema["t"]["is_nested"] is True

    def test_strided_kind_is_kept(self):
        strided = {**jagged([(2,)]), "kind": KIND_STRIDED}
        c = BatchMeta.concat([BatchMeta([0], ["p"], {"t": strided}), BatchMeta([1], ["p"], {"t": strided})])
        assert c.field_schema["t"]["kind"] == KIND_STRIDED
        assert c.field_schema["t"]["shape"] == (2,)

    def test_same_dense_shapes_stay_dense(self):
        c = BatchMeta.concat([BatchMeta([0], ["p"], {"a": dense()}), BatchMeta([1], ["q"], {"a": dense()})])
        assert c.field_schema["a"]["kind"] == KIND_TENSOR
        assert "per_sample_shapes" not in c.field_schema["a"]
        assert c.partition_ids == ["p", "q"]

    def test_validate_false_allows_mismatched_fields(self):
        x = BatchMeta([0], ["p"], {"a": dense(), "b": dense()})
        y = BatchMeta([1], ["p"], {"a": dense()})
        c = BatchMeta.concat([x, y], validate=False)
        assert c.global_indexes == [0, 1]
        assert c.field_names == ["a", "b"]

    def test_not_a_batchmeta(self):
        with pytest.raises(InvalidArgument, match="not a BatchMeta"):
            BatchMeta.concat([make_meta(1), [0, 1]])  # type: ignore[list-item]


# ---------------------------------------------------------------------------------------------
# reorder / copy
# ---------------------------------------------------------------------------------------------


class TestReorder:
    def test_permutes_every_column_in_place(self):
        m = make_meta(3)
        m.production_status[0] = 0
        m._custom_backend_meta[0]["a"] = "h0"
        assert m.reorder([2, 0, 1]) is None
        assert m.global_indexes == [2, 0, 1]
        assert m.production_status.tolist() == [1, 0, 1]
        assert m.custom_meta == [{"uid": "u2"}, {"uid": "u0"}, {"uid": "u1"}]
        assert m._custom_backend_meta == [{}, {"a": "h0"}, {}]
        assert m.get_shapes("tok") == [(3,), (1,), (2,)]
        assert m.samples[0].fields["tok"]["shape"] == (3,)

    def test_numpy_permutation(self):
        m = make_meta(3)
        m.reorder(np.array([1, 2, 0]))
        assert m.global_indexes == [1, 2, 0]

    @pytest.mark.parametrize(
        "indices,match",
        [
            ([0, 1], "indexes length 2 does not match the batch size 3"),
            ([0, 0, 1], "Contain duplicate indexes"),
            ([0, 1, 3], "outside"),
            ([0, 1, -1], "outside"),
        ],
    )
    def test_invalid_permutation(self, indices, match):
        m = make_meta(3)
        with pytest.raises(InvalidArgument, match=match):
            m.reorder(indices)
        assert m.global_indexes == [0, 1, 2]  # unchanged

    def test_reorder_does_not_touch_shared_shape_list(self):
        m = make_meta(3)
        copy_of = m.select_samples([0, 1, 2])
        m.reorder([2, 1, 0])
        assert copy_of.get_shapes("tok") == [(1,), (2,), (3,)]


class TestCopy:
    def test_deep_copy(self):
        m = make_meta(2, extra={"nested": {"k": [1]}})
        m.custom_meta[0]["list"] = [1, 2]
        c = m.copy()
        assert_same_contents(c, m)
        c.custom_meta[0]["list"].append(3)
        c.extra_info["nested"]["k"].append(2)
        c.field_schema["tok"]["per_sample_shapes"].append((9,))
        c.production_status[0] = 0
        c.global_indexes.append(99)
        assert m.custom_meta[0]["list"] == [1, 2]
        assert m.extra_info["nested"]["k"] == [1]
        assert m.get_shapes("tok") == [(1,), (2,)]
        assert m.is_ready
        assert m.global_indexes == [0, 1]


    def test_copy_deep_copies_a_schema_value_that_is_not_immutable(self):
        # tq-redis's own entries hold dtypes, sizes and shape lists; a caller's entry may hold more
        m = BatchMeta([0, 1], ["p", "p"], {"x": {"dtype": torch.float32, "shape": (2,), "note": {"by": ["me"]},
                                              "shape_list": [2]}})  # fmt: skip
        c = m.copy()
        c.field_schema["x"]["note"]["by"].append("you")
        c.field_schema["x"]["shape_list"].append(3)
        assert m.field_schema["x"]["note"] == {"by": ["me"]}
        assert m.field_schema["x"]["shape_list"] == [2]
        assert c.field_schema["x"]["dtype"] is torch.float32


# ---------------------------------------------------------------------------------------------
# custom_meta / extra_info
# ---------------------------------------------------------------------------------------------


class TestCustomMeta:
    def test_update_merges_per_sample(self):
        m = make_meta(2)
        m.update_custom_meta([{"len": 5}, {"uid": "new"}])
        assert m.custom_meta == [{"uid": "u0", "len": 5}, {"uid": "new"}]
        m.update_custom_meta(None)
        assert m.custom_meta == [{"uid": "u0", "len": 5}, {"uid": "new"}]

    def test_update_on_untagged_batch(self):
        m = make_meta(2, tags=False)
        m.update_custom_meta([{"v": 1}, {"v": 2}])
        assert m.custom_meta == [{"v": 1}, {"v": 2}]

    def test_update_validation(self):
        m = make_meta(2)
        with pytest.raises(BatchSizeMismatch, match="one per sample"):
            m.update_custom_meta([{"len": 5}])
        with pytest.raises(InvalidArgument, match="not dicts"):
            m.update_custom_meta([{"len": 5}, 7])  # type: ignore[list-item]
        assert m.custom_meta == [{"uid": "u0"}, {"uid": "u1"}]

    def test_get_all_is_deep_copy(self):
        m = make_meta(2)
        m.update_custom_meta([{"l": [1]}, {}])
        out = m.get_all_custom_meta()
        out[0]["l"].append(2)
        out[1]["x"] = 1
        assert m.custom_meta == [{"uid": "u0", "l": [1]}, {"uid": "u1"}]
        assert make_meta(2, tags=False).get_all_custom_meta() == [{}, {}]

    def test_clear(self):
        m = make_meta(2)
        m.clear_custom_meta()
        assert m.custom_meta == [{}, {}]

    def test_assignment_checks_length(self):
        m = make_meta(2)
        m.custom_meta = [{"a": 1}, {"b": 2}]
        assert m.custom_meta == [{"a": 1}, {"b": 2}]
        with pytest.raises(BatchSizeMismatch):
            m.custom_meta = [{"a": 1}]


class TestExtraInfo:
    def test_accessors(self):
        m = make_meta(1)
        assert m.get_extra_info("k") is None
        assert m.get_extra_info("k", 5) == 5
        m.set_extra_info("k", {"v": [1]})
        assert m.has_extra_info("k")
        snapshot = m.get_all_extra_info()
        snapshot["k"]["v"].append(2)
        assert m.get_extra_info("k") == {"v": [1]}
        m.update_extra_info({"a": 1, "k": 2})
        assert m.extra_info == {"a": 1, "k": 2}
        assert m.remove_extra_info("a") == 1
        assert m.remove_extra_info("a") is None
        assert not m.has_extra_info("a")
        m.clear_extra_info()
        assert m.extra_info == {}


# ---------------------------------------------------------------------------------------------
# pickling
# ---------------------------------------------------------------------------------------------


class TestPickle:
    @pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
    def test_round_trip(self, protocol):
        m = make_meta(5, extra={"step": 3, "t": "x"})
        m.production_status[2] = 0
        m._custom_backend_meta[1]["a"] = {"node": "n1"}
        m.field_schema["s"] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
        back = pickle.loads(pickle.dumps(m, protocol=protocol))
        assert isinstance(back, BatchMeta)
        assert_same_contents(back, m)
        assert back.is_ready is False
        back.add_fields(TensorDict({"n": torch.ones(5)}, batch_size=[5]))  # still mutable
        assert back.is_ready

    def test_round_trip_untagged_and_empty(self):
        m = make_meta(3, tags=False)
        _ = m.custom_meta  # materialised empty dicts still round-trip
        assert_same_contents(pickle.loads(pickle.dumps(m)), m)
        e = BatchMeta.empty(extra_info={"r": 1})
        assert_same_contents(pickle.loads(pickle.dumps(e)), e)

    def test_read_only_status_becomes_writable(self):
        m = make_meta(2)
        state = list(m.__getstate__())  # slot values in __slots__ order, as the reference's
        at = list(BatchMeta.__slots__).index("production_status")
        frozen = state[at].copy()
        frozen.setflags(write=False)
        state[at] = frozen
        fresh = BatchMeta.__new__(BatchMeta)
        fresh.__setstate__(tuple(state))
        fresh.production_status[0] = 0
        assert fresh.production_status.tolist() == [0, 1]

    def test_setstate_accepts_a_mapping_and_rejects_a_foreign_layout(self):
        m = make_meta(2)
        by_name = dict(zip(BatchMeta.__slots__, m.__getstate__()))
        fresh = BatchMeta.__new__(BatchMeta)
        fresh.__setstate__(by_name)
        assert_same_contents(fresh, m)
        with pytest.raises(InvalidArgument, match="incompatible version"):
            BatchMeta.__new__(BatchMeta).__setstate__(m.__getstate__()[:-1])

    def test_untagged_batch_pickles_small(self):
        m = BatchMeta.from_columns(range(1024), "p", {"a": dense()}, production_status=1)
        _ = m.custom_meta, m._custom_backend_meta
        tagged = m.copy()
        tagged.update_custom_meta([{"len": i} for i in range(1024)])
        assert len(pickle.dumps(m)) < len(pickle.dumps(tagged)) / 2
