"""Unit tests for tq_redis.meta: its public names, BatchMeta construction, properties and field schemas."""

from __future__ import annotations

import importlib
import time
from types import MappingProxyType

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tests.unit.batch_metas import dense, jagged, make_meta
from tq_redis.errors import BatchSizeMismatch, InvalidArgument, UnknownField, UnsupportedValue
from tq_redis.meta import (
    KIND_JAGGED,
    KIND_NDARRAY,
    KIND_OBJECT,
    KIND_STRIDED,
    KIND_TENSOR,
    BatchMeta,
    extract_field_schema,
    field_kind,
)

# ---------------------------------------------------------------------------------------------
# public names
# ---------------------------------------------------------------------------------------------


def test_public_names_are_importable_from_metadata():
    """tq_redis.meta is the import path of record (callers and tq_redis.integrations.alias use it),
    whichever module defines each name."""
    metadata = importlib.import_module("tq_redis.meta")
    assert sorted(metadata.__all__) == sorted(
        [
            "KIND_JAGGED", "KIND_NDARRAY", "KIND_OBJECT", "KIND_STRIDED", "KIND_TENSOR",
            "BatchMeta", "KVBatchMeta", "KeyNotInBatch", "extract_field_schema", "field_kind",
        ]
    )
    missing = [name for name in metadata.__all__ if not hasattr(metadata, name)]
    assert missing == []
    assert importlib.import_module("tq_redis.meta.batch_meta").READY == 1
    compat = importlib.import_module("tq_redis.integrations.alias")
    for target in compat.ALIAS_MODULES["transfer_queue.metadata"].values():
        module, _, attr = target.partition(":")
        assert getattr(importlib.import_module(module), attr) is getattr(metadata, attr)


# ---------------------------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------------------------


class TestConstruction:
    def test_defaults(self):
        m = BatchMeta([3, 7], ["p", "p"])
        assert m.size == len(m) == 2
        assert m.field_schema == {}
        assert m.field_names == []
        assert m.production_status.dtype == np.int8
        assert m.production_status.tolist() == [0, 0]
        assert m.custom_meta == [{}, {}]
        assert m._custom_backend_meta == [{}, {}]
        assert m.extra_info == {}
        assert not m.is_ready

    def test_per_sample_default_dicts_are_distinct(self):
        m = BatchMeta([0, 1], ["p", "p"])
        m.custom_meta[0]["x"] = 1
        assert m.custom_meta == [{"x": 1}, {}]

    def test_length_mismatch_raises_typed_value_error(self):
        with pytest.raises(BatchSizeMismatch, match="partition_ids"):
            BatchMeta([0, 1, 2], ["p", "p"])
        with pytest.raises(ValueError):  # reference-style handlers keep working
            BatchMeta([0, 1, 2], ["p", "p"])

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"production_status": [1, 1, 1]},
            {"custom_meta": [{}, {}, {}]},
            {"_custom_backend_meta": [{}]},
            {"field_schema": {"t": jagged([(1,), (2,), (3,)])}},
        ],
    )
    def test_per_sample_column_length_mismatch(self, kwargs):
        with pytest.raises(BatchSizeMismatch):
            BatchMeta([0, 1], ["p", "p"], **kwargs)

    def test_bad_field_schema_entry(self):
        with pytest.raises(InvalidArgument, match="field_schema"):
            BatchMeta([0], ["p"], field_schema={"a": "float32"})

    def test_bad_extra_info(self):
        with pytest.raises(InvalidArgument, match="extra_info"):
            BatchMeta([0], ["p"], extra_info=[1, 2])

    def test_inputs_are_not_aliased(self):
        gidx, pids = [0, 1], ["p", "p"]
        schema = {"a": dense()}
        status = np.array([1, 0], dtype=np.int8)
        tags = [{"k": 1}, {"k": 2}]
        info = {"step": 1}
        m = BatchMeta(gidx, pids, schema, status, info, tags)
        gidx.append(2)
        pids[0] = "q"
        schema["a"]["shape"] = (99,)
        schema["b"] = dense()
        status[1] = 1
        tags[0]["k"] = 100
        info["step"] = 2
        assert m.global_indexes == [0, 1]
        assert m.partition_ids == ["p", "p"]
        assert m.field_schema["a"]["shape"] == (4,)
        assert m.field_names == ["a"]
        assert m.production_status.tolist() == [1, 0]
        assert m.custom_meta == [{"k": 1}, {"k": 2}]
        assert m.extra_info == {"step": 1}

    def test_kind_is_derived_when_missing(self):
        m = BatchMeta(
            [0, 1],
            ["p", "p"],
            {
                "d": dense(),
                "j": jagged([(1,), (2,)]),
                "o": {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True},
                "explicit": {**dense(), "kind": "custom"},
            },
        )
        assert m.field_schema["d"]["kind"] == KIND_TENSOR
        assert m.field_schema["j"]["kind"] == KIND_JAGGED
        assert m.field_schema["o"]["kind"] == KIND_OBJECT
        assert m.field_schema["explicit"]["kind"] == "custom"
        assert field_kind({"is_nested": True}) == KIND_JAGGED
        assert field_kind({"is_non_tensor": True, "dtype": np.dtype("<U3")}) == KIND_NDARRAY

    def test_kind_vocabulary_matches_codec(self):
        schemas = pytest.importorskip("tq_redis.meta.schemas")
        assert {KIND_TENSOR, KIND_JAGGED, KIND_STRIDED, KIND_NDARRAY, KIND_OBJECT} == set(schemas.KINDS)

    def test_numpy_global_indexes_become_python_ints(self):
        m = BatchMeta(np.arange(3, dtype=np.int64), ["p"] * 3)
        assert m.global_indexes == [0, 1, 2]
        assert all(type(i) is int for i in m.global_indexes)

    def test_empty(self):
        m = BatchMeta.empty(extra_info={"reason": "timeout"})
        assert m.size == 0 and len(m) == 0 and not m
        assert m.field_names == []
        assert not m.is_ready
        assert m.get_extra_info("reason") == "timeout"
        assert m.production_status.shape == (0,)


class TestFromColumns:
    def test_single_partition(self):
        m = BatchMeta.from_columns([5, 6, 7], "train", {"a": dense()}, production_status=1)
        assert m.partition_ids == ["train"] * 3
        assert m.global_indexes == [5, 6, 7]
        assert m.production_status.tolist() == [1, 1, 1]
        assert m.is_ready
        assert m.field_schema["a"]["kind"] == KIND_TENSOR

    def test_array_status_tags_and_extra(self):
        tags = [{"len": 3}, {"len": 5}]
        m = BatchMeta.from_columns(
            np.array([1, 2]), "p", {}, production_status=[1, 0], custom_meta=tags, extra_info={"k": "v"}
        )
        tags[0]["len"] = 0
        assert m.production_status.tolist() == [1, 0]
        assert not m.is_ready
        assert m.custom_meta == [{"len": 3}, {"len": 5}]
        assert m.extra_info == {"k": "v"}
        assert m.global_indexes == [1, 2]

    def test_defaults_not_ready(self):
        m = BatchMeta.from_columns(range(4), "p", None)
        assert m.production_status.tolist() == [0, 0, 0, 0]
        assert m.field_schema == {}

    def test_mismatched_columns_raise(self):
        with pytest.raises(BatchSizeMismatch):
            BatchMeta.from_columns([1, 2], "p", {}, production_status=[1])
        with pytest.raises(BatchSizeMismatch):
            BatchMeta.from_columns([1, 2], "p", {}, custom_meta=[{}])

    def test_construction_of_1024_samples_is_fast(self):
        gidx = list(range(1024))
        schema = {"input_ids": dense(torch.int64, (512,)), "reward": dense(torch.float32, ())}
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            BatchMeta.from_columns(gidx, "p", schema, production_status=1)
            best = min(best, time.perf_counter() - t0)
        assert best < 1e-3, f"from_columns(1024) took {best * 1e6:.0f} us"
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            BatchMeta(gidx, ["p"] * 1024, schema)
            best = min(best, time.perf_counter() - t0)
        assert best < 1e-3, f"BatchMeta(1024) took {best * 1e6:.0f} us"


# ---------------------------------------------------------------------------------------------
# properties and per-sample views
# ---------------------------------------------------------------------------------------------


class TestProperties:
    def test_field_names_sorted(self):
        m = BatchMeta([0], ["p"], {"zeta": dense(), "alpha": dense(), "mid": dense()})
        assert m.field_names == ["alpha", "mid", "zeta"]

    def test_is_ready_tracks_status(self):
        m = make_meta(3)
        assert m.is_ready
        m.production_status[1] = 0
        assert not m.is_ready
        assert not make_meta(3, ready=False).is_ready

    def test_get_dtypes_and_shapes(self):
        m = make_meta(3)
        assert m.get_dtypes("a") == [torch.float32] * 3
        assert m.get_shapes("a") == [(4,)] * 3
        assert m.get_shapes("tok") == [(1,), (2,), (3,)]

    @pytest.mark.parametrize("method", ["get_dtypes", "get_shapes"])
    def test_unknown_field_raises(self, method):
        m = make_meta(2)
        with pytest.raises(UnknownField, match="nope"):
            getattr(m, method)("nope")
        with pytest.raises(KeyError):
            getattr(m, method)("nope")

    def test_samples_view(self):
        m = make_meta(3)
        samples = m.samples
        assert len(samples) == 3
        assert [s.global_index for s in samples] == [0, 1, 2]
        last = samples[-1]
        assert last.global_index == 2
        assert last.partition_id == "p0"
        assert last.production_status == 1
        assert last.custom_meta["uid"] == "u2"
        assert last.fields["tok"]["shape"] == (3,)
        assert "per_sample_shapes" not in last.fields["tok"]
        assert last.fields["a"]["shape"] == (4,)
        assert "global_index=2" in repr(last)

    def test_samples_view_is_read_only_and_live(self):
        m = make_meta(2)
        view = m.samples[0]
        assert isinstance(view.custom_meta, MappingProxyType)
        with pytest.raises(TypeError):
            view.custom_meta["uid"] = "x"  # type: ignore[index]
        with pytest.raises(TypeError):
            view.fields["a"]["shape"] = (1,)  # type: ignore[index]
        m.update_custom_meta([{"uid": "changed"}, {}])
        assert view.custom_meta["uid"] == "changed"

    def test_samples_view_bounds(self):
        m = make_meta(2)
        with pytest.raises(IndexError):
            m.samples[2]
        with pytest.raises(IndexError):
            m.samples[-3]

    def test_repr_is_short(self):
        m = BatchMeta.from_columns(range(1024), "p", {"a": dense()}, production_status=1)
        text = repr(m)
        assert len(text) < 300
        assert "size=1024" in text and "ready=1024/1024" in text and "'a'" in text and "1023" in text
        assert str(m) == text


# ---------------------------------------------------------------------------------------------
# extract_field_schema / add_fields
# ---------------------------------------------------------------------------------------------


class TestExtractFieldSchema:
    def test_dense_1d_and_non_tensor(self):
        td = TensorDict(
            {"x": torch.zeros(3, 4, 2, dtype=torch.bfloat16), "r": torch.zeros(3), "s": ["a", "b", "c"]},
            batch_size=[3],
        )
        schema = extract_field_schema(td)
        assert schema["x"] == {
            "dtype": torch.bfloat16,
            "shape": (4, 2),
            "is_nested": False,
            "is_non_tensor": False,
            "kind": KIND_TENSOR,
        }
        assert schema["r"]["shape"] == ()
        assert schema["s"]["is_non_tensor"] is True
        assert schema["s"]["dtype"] is None
        assert schema["s"]["kind"] == KIND_OBJECT

    def test_jagged_nested_tensor(self):
        nt = torch.nested.nested_tensor(
            [torch.zeros(2, 5), torch.zeros(7, 5), torch.zeros(1, 5)], layout=torch.jagged
        )
        schema = extract_field_schema(TensorDict({"t": nt}, batch_size=[3]))
        assert schema["t"]["is_nested"] is True
        assert schema["t"]["kind"] == KIND_JAGGED
        assert schema["t"]["per_sample_shapes"] == [(2, 5), (7, 5), (1, 5)]
        assert schema["t"]["shape"] is None
        assert schema["t"]["dtype"] == torch.float32

    @pytest.mark.filterwarnings("ignore:.*nested tensors is in prototype")
    def test_strided_nested_tensor_with_uniform_shapes(self):
        nt = torch.nested.nested_tensor([torch.zeros(3, 2), torch.zeros(3, 2)])
        schema = extract_field_schema(TensorDict({"t": nt}, batch_size=[2]))
        assert schema["t"]["per_sample_shapes"] == [(3, 2), (3, 2)]
        assert schema["t"]["shape"] == (3, 2)
        assert schema["t"]["kind"] == KIND_STRIDED

    def test_numpy_string_array_is_ndarray_kind(self):
        td = TensorDict({"s": np.array(["a", "bb", "c"]), "f": np.zeros((3, 2))}, batch_size=[3])
        schema = extract_field_schema(td)
        assert schema["s"]["kind"] == KIND_NDARRAY
        assert schema["s"]["is_non_tensor"] is True
        assert schema["s"]["dtype"] == np.dtype("<U2")
        assert schema["s"]["shape"] == ()
        assert schema["f"]["kind"] == KIND_TENSOR  # numeric arrays become tensors
        assert schema["f"]["dtype"] == torch.float64

    def test_nested_tensordict_is_rejected(self):
        td = TensorDict({"sub": TensorDict({"q": torch.zeros(2)}, batch_size=[2])}, batch_size=[2])
        with pytest.raises(UnsupportedValue, match="flatten"):
            extract_field_schema(td)

    def test_no_batch_dimension(self):
        with pytest.raises(InvalidArgument, match="batch"):
            extract_field_schema(TensorDict({"x": torch.zeros(3)}, batch_size=[]))

    def test_not_a_tensordict(self):
        with pytest.raises(InvalidArgument):
            extract_field_schema({"x": torch.zeros(3)})  # type: ignore[arg-type]


class TestAddFields:
    def test_adds_schema_and_marks_ready(self):
        m = BatchMeta.from_columns([0, 1], "p", {"a": dense()})
        td = TensorDict({"b": torch.ones(2, 3, dtype=torch.int32), "a": torch.ones(2, 8)}, batch_size=[2])
        out = m.add_fields(td)
        assert out is m
        assert m.field_names == ["a", "b"]
        assert m.field_schema["a"]["shape"] == (8,)  # replaced
        assert m.field_schema["b"]["dtype"] == torch.int32
        assert m.is_ready

    def test_set_all_ready_false_keeps_status(self):
        m = BatchMeta.from_columns([0, 1], "p", {})
        m.add_fields(TensorDict({"b": torch.ones(2)}, batch_size=[2]), set_all_ready=False)
        assert m.production_status.tolist() == [0, 0]
        assert "b" in m.field_schema

    def test_batch_size_mismatch(self):
        m = BatchMeta.from_columns([0, 1], "p", {})
        with pytest.raises(BatchSizeMismatch, match="3 rows"):
            m.add_fields(TensorDict({"b": torch.ones(3)}, batch_size=[3]))
        assert m.field_schema == {}

    def test_empty_tensordict_on_nonempty_batch_raises(self):
        m = BatchMeta.from_columns([0, 1], "p", {})
        with pytest.raises(BatchSizeMismatch):
            m.add_fields(TensorDict({}, batch_size=[0]))
