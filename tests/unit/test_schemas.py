"""Unit tests for tq_redis.meta.schemas: JSON field schemas, their compatibility, and BatchMeta entries."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tq_redis.errors import BatchSizeMismatch, DTypeConflict, SchemaConflict, ShapeConflict, UnsupportedValue
from tq_redis.meta import schemas

# torch's own note about a prototype feature, not about schemas
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")


def jagged(*lengths: int) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.ones(n) for n in lengths], layout=torch.jagged)


def test_describe_field_is_json_safe_for_every_kind() -> None:
    cases = {
        "t": (torch.ones(2, 3, dtype=torch.float16), {"kind": "tensor", "dtype": "float16", "shape": [3]}),
        "j": (jagged(1, 2), {"kind": "jagged", "dtype": "float32", "shape": None}),
        "s": (torch.nested.as_nested_tensor([torch.ones(1, 2), torch.ones(2, 2)]),
              {"kind": "strided", "dtype": "float32", "shape": None}),
        "a": (np.array(["x", "yy"]), {"kind": "ndarray", "dtype": "<U2", "shape": []}),
        "o": ([{"a": 1}, None], {"kind": "object", "dtype": None, "shape": None}),
    }
    for name, (value, expected) in cases.items():
        described = schemas.describe_field(name, value, 2)
        assert described == expected
        assert json.loads(json.dumps(described)) == described


def test_nontensordata_holding_one_value_per_row_is_split_per_row() -> None:
    schema, kind, source = schemas.classify("label", NonTensorData(["a", "b", "c"], batch_size=[3]), 3)
    assert (schema["kind"], kind, source) == ("object", "object", ["a", "b", "c"])
    _, _, shared = schemas.classify("label", NonTensorData(["a", "b"], batch_size=[3]), 3)
    assert shared == [["a", "b"]] * 3  # another length: one value broadcast to every row
    _, kind, array = schemas.classify("u", NonTensorData(np.array(["a", "b", "c"]), batch_size=[3]), 3)
    assert kind == "ndarray" and array.tolist() == ["a", "b", "c"]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_unstorable_dtypes_are_refused_by_describe_field() -> None:
    q = torch.quantize_per_tensor(torch.ones(2, 3), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedValue, match="'q'.*qint8"):
        schemas.describe_field("q", q, 2)
    with pytest.raises(UnsupportedValue, match="'rec'.*structured"):
        schemas.describe_field("rec", np.zeros(2, dtype=[("a", "i4")]), 2)


def test_check_compatible_accepts_matching_schemas() -> None:
    d = schemas.describe_field
    schemas.check_compatible("x", d("x", torch.ones(4, 8), 4), d("x", torch.zeros(2, 8), 2))
    schemas.check_compatible("r", d("r", jagged(3), 1), d("r", jagged(9), 1))
    # string lengths may differ between puts
    schemas.check_compatible("u", d("u", np.array([b"abc"]), 1), d("u", np.array([b"abcde"]), 1))
    schemas.check_compatible("o", d("o", ["a"], 1), d("o", [{"b": 1}], 1))


def test_check_compatible_dtype_conflict() -> None:
    reg = schemas.describe_field("x", torch.ones(4, 8), 4)
    new = schemas.describe_field("x", torch.ones(4, 8, dtype=torch.bfloat16), 4)
    with pytest.raises(DTypeConflict) as err:
        schemas.check_compatible("x", reg, new)
    msg = str(err.value)
    assert "float32" in msg and "bfloat16" in msg and "new partition" in msg and "'x'" in msg
    assert isinstance(err.value, SchemaConflict) and isinstance(err.value, TypeError)
    u = schemas.describe_field("u", np.array(["a"]), 1)
    b = schemas.describe_field("u", np.array([b"a"]), 1)
    with pytest.raises(DTypeConflict):
        schemas.check_compatible("u", u, b)


def test_check_compatible_shape_conflicts() -> None:
    reg = schemas.describe_field("x", torch.ones(4, 8), 4)
    with pytest.raises(ShapeConflict) as err:
        schemas.check_compatible("x", reg, schemas.describe_field("x", torch.ones(4, 9), 4))
    assert "[8]" in str(err.value) and "[9]" in str(err.value) and "new field name" in str(err.value)
    jag = schemas.describe_field("x", jagged(8), 1)
    with pytest.raises(ShapeConflict, match="'tensor'.*'jagged'"):
        schemas.check_compatible("x", reg, jag)
    strided = schemas.describe_field("x", torch.nested.as_nested_tensor([torch.ones(8)]), 1)
    with pytest.raises(ShapeConflict):
        schemas.check_compatible("x", jag, strided)


def test_to_batchmeta_schema() -> None:
    dense = schemas.to_batchmeta_schema(schemas.describe_field("x", torch.ones(2, 3, dtype=torch.bfloat16), 2))
    assert dense == {
        "dtype": torch.bfloat16, "shape": torch.Size([3]), "is_nested": False,
        "is_non_tensor": False, "kind": "tensor",
    }
    jag = schemas.to_batchmeta_schema(schemas.describe_field("j", jagged(2), 1))
    assert jag == {"dtype": torch.float32, "shape": None, "is_nested": True, "is_non_tensor": False,
                   "kind": "jagged"}
    arr = schemas.to_batchmeta_schema(schemas.describe_field("a", np.array([b"ab"]), 1))
    assert arr["dtype"] == np.dtype("S2") and arr["is_non_tensor"] and arr["kind"] == "ndarray"
    obj = schemas.to_batchmeta_schema(schemas.describe_field("o", [1], 1))
    assert obj == {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True, "kind": "object"}


def test_to_batchmeta_schema_of_widened_fields() -> None:
    """The metadata plane widens a field whose puts disagree (see lua/includes/schemas.lua)."""
    mixed = schemas.to_batchmeta_schema({"kind": schemas.KIND_MIXED, "dtype": None, "shape": None})
    assert mixed == {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True, "kind": "mixed"}
    jag = schemas.to_batchmeta_schema({"kind": "jagged", "dtype": schemas.DTYPE_MIXED, "shape": None})
    assert jag == {"dtype": None, "shape": None, "is_nested": True, "is_non_tensor": False, "kind": "jagged"}
    arr = schemas.to_batchmeta_schema({"kind": "ndarray", "dtype": schemas.DTYPE_MIXED, "shape": None})
    assert arr["dtype"] is None and arr["shape"] is None and arr["is_non_tensor"]


FIELD_VALUES = {
    "dense": lambda: torch.ones(3, 2, dtype=torch.bfloat16),
    "1d": lambda: torch.arange(3),
    "jagged": lambda: jagged(1, 0, 2),
    "strided": lambda: torch.nested.as_nested_tensor([torch.ones(2, 1), torch.ones(1, 1), torch.ones(3, 1)]),
    "unicode": lambda: np.array(["a", "bb", "c"]),
    "bytes": lambda: np.array([b"x", b"y", b"z"]),
    "strings": lambda: ["a", "b", "c"],
    "stack": lambda: NonTensorStack({"a": 1}, None, 3),
}


@pytest.mark.parametrize("case", list(FIELD_VALUES))
def test_both_schema_forms_agree(case: str) -> None:
    """A field's entry built from its value agrees with the one built from its JSON schema."""
    value = TensorDict({"f": FIELD_VALUES[case]()}, batch_size=[3]).get("f")
    from_value = schemas.batchmeta_schema_of("f", value, 3)
    from_json = schemas.to_batchmeta_schema(schemas.describe_field("f", value, 3))
    for key in ("kind", "dtype", "is_nested", "is_non_tensor"):
        assert from_value[key] == from_json[key], key
    if from_json["shape"] is not None:  # dense kinds: a tuple here, a torch.Size there
        assert type(from_value["shape"]) is tuple and from_value["shape"] == tuple(from_json["shape"])
    assert ("per_sample_shapes" in from_value) == from_json["is_nested"]


def test_batchmeta_schema_of_nested_fields_records_each_sample_shape() -> None:
    entry = schemas.batchmeta_schema_of("t", jagged(2, 7, 1), 3)
    assert entry["per_sample_shapes"] == [(2,), (7,), (1,)] and entry["shape"] is None
    with pytest.raises(BatchSizeMismatch, match="'t' is a nested tensor of 3 samples"):
        schemas.batchmeta_schema_of("t", jagged(2, 7, 1), 4)
    uniform = schemas.batchmeta_schema_of("t", jagged(2, 2), 2)
    assert uniform["shape"] == (2,)
    assert list(uniform) == ["dtype", "shape", "is_nested", "is_non_tensor", "per_sample_shapes", "kind"]


def test_batchmeta_schema_of_rejects_sub_tensordicts_and_foreign_values() -> None:
    with pytest.raises(UnsupportedValue, match="flatten"):
        schemas.batchmeta_schema_of("sub", TensorDict({"q": torch.zeros(2)}, batch_size=[2]), 2)
    with pytest.raises(UnsupportedValue, match="'x' holds an unsupported int"):
        schemas.batchmeta_schema_of("x", 3, 2)
