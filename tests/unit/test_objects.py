"""Unit tests for tq_redis.codec.objects: the safe object encoding (msgpack plus extension types)."""

from __future__ import annotations

import collections
import dataclasses
import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from tests.rlinf_items import Rollout, Step, Tag, Unlisted
from tests.unit.values import Opaque, Point, assert_same, python_objects
from tq_redis.codec import objects, wireformat
from tq_redis.codec.item_classes import ItemClasses, class_path, register_item_class
from tq_redis.errors import ItemClassNotAllowed, StorageError, UnsupportedValue

# torch's own note about a prototype feature, not about this encoding
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")


def test_encode_object_exact_types() -> None:
    obj = {
        "tuple": (1, (2, 3)),
        "set": {1, 2},
        "frozen": frozenset({"a"}),
        "complex": 1 - 2j,
        "big": 2**100,
        "neg_big": -(2**90),
        "huge": 7**6000,  # beyond int's 4300-digit str() limit
        "bytes": b"\x00\xff",
        "nan": float("nan"),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "np_dtype": np.dtype("<U3"),
        "np": [np.bool_(True), np.str_("s"), np.bytes_(b"b"), np.str_(""), np.datetime64("2020-01-01")],
        "arr": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "t": torch.tensor([[1, 2]], dtype=torch.int8),
        "jag": torch.nested.as_nested_tensor([torch.ones(2), torch.ones(1)], layout=torch.jagged),
        1: "int key",
        (1, 2): "tuple key",
    }
    out = objects.decode_object(objects.encode_object(obj))
    assert_same(out, obj)
    assert out["set"] == {1, 2} and type(out["frozen"]) is frozenset


def test_encode_object_container_subclasses_become_base_types() -> None:
    out = objects.decode_object(objects.encode_object(collections.OrderedDict(b=1, a=2)))
    assert type(out) is dict and list(out) == ["b", "a"]


def test_unsupported_objects_name_their_type() -> None:
    with pytest.raises(UnsupportedValue, match="Opaque") as err:
        objects.encode_object({"deep": [Opaque(3)]})
    assert str(err.value).startswith("object:") and "allow_pickle=True" in str(err.value)
    with pytest.raises(UnsupportedValue, match="Point"):
        objects.encode_object(Point(1, 2))  # a namedtuple is not silently flattened to a tuple


def test_allow_pickle_roundtrip_and_refusal_on_decode() -> None:
    blob = objects.encode_object(Point(1, 2), allow_pickle=True)
    assert objects.decode_object(blob, allow_pickle=True) == Point(1, 2)
    with pytest.raises(UnsupportedValue, match="allow_pickle"):
        objects.decode_object(blob)


def test_too_deep_object_is_unsupported() -> None:
    deep: list = []
    for _ in range(2000):
        deep = [deep]
    with pytest.raises(UnsupportedValue):
        objects.encode_object(deep)


def test_encode_samples_names_the_field_and_the_sample() -> None:
    assert [objects.decode_object(b) for b in objects.encode_samples("f", ["a", 1, None])] == ["a", 1, None]
    with pytest.raises(UnsupportedValue, match=r"^field 'f', sample 1: .*Opaque"):
        objects.encode_samples("f", [1, Opaque(2)])
    deep: list = []
    for _ in range(2000):
        deep = [deep]
    with pytest.raises(UnsupportedValue, match=r"^field 'f', sample 0: .*type row element"):
        objects.encode_samples("f", [deep], what="row element")
    with pytest.raises(UnsupportedValue, match=r"^field 'f', sample 0: .*type list"):
        objects.encode_samples("f", [deep])


def test_garbage_is_a_storage_error() -> None:
    with pytest.raises(StorageError):
        objects.decode_object(b"\xc1garbage")
    with pytest.raises(StorageError, match="extension type 99"):
        objects.decode_object(msgpack.packb(msgpack.ExtType(99, b"")))


def test_raw_array_never_reinterprets_bytes_as_object_pointers() -> None:
    head = struct.pack("<2sBBBBHq", b"TQ", 1, wireformat.K_NDARRAY, 0, 1, 2, 1) + b"|O"
    forged = head + b"\0" * (-len(head) % 8) + b"\x01" * 8
    ext = msgpack.packb(msgpack.ExtType(objects._EXT_NDARRAY, forged))
    with pytest.raises(StorageError, match="cannot be read from bytes"):
        objects.decode_object(ext)


@settings(max_examples=200, deadline=None)
@given(item=python_objects)
def test_property_object_roundtrip(item: object) -> None:
    assert_same(objects.decode_object(objects.encode_object(item)), item)


# ------------------------------------------------------------------ dataclasses and NamedTuples


def _rollout(seed: int = 0) -> Rollout:
    return Rollout(torch.arange(4) + seed, [0.5, float(seed)], {"src": "env", "ok": True}, group=seed)


def test_allowed_dataclasses_and_namedtuples_round_trip_without_pickle() -> None:
    allowed = ItemClasses([Rollout, Tag, Step])
    item = {"steps": [Step(1, _rollout(1), Tag("a", 2)), Step(2, _rollout(2))], "tag": Tag("b", 3)}
    blob = objects.encode_object(item, classes=allowed)
    assert b"pickle" not in blob and b"tests.rlinf_items:Step" in blob
    out = objects.decode_object(blob, classes=allowed)
    first = out["steps"][0]
    assert type(first) is Step and type(first.rollout) is Rollout and type(out["tag"]) is Tag
    assert torch.equal(first.rollout.prompt_ids, torch.arange(4) + 1) and first.rollout.rewards == [0.5, 1.0]
    assert first.rollout.info == {"src": "env", "ok": True} and first.tag == Tag("a", 2)
    assert out["steps"][1].tag is None and out["steps"][1].rollout.group == 2 and out["tag"] == Tag("b", 3)
    assert first.rollout.post_init_runs == 1  # fields restored as pickle does: no __post_init__ again


def test_a_class_not_allowed_is_refused_on_both_sides() -> None:
    with pytest.raises(ItemClassNotAllowed, match="Unlisted.*register_item_class") as err:
        objects.encode_object([Unlisted(1)], classes=ItemClasses([Rollout]))
    assert isinstance(err.value, UnsupportedValue) and err.value.path == "tests.rlinf_items.Unlisted"
    with pytest.raises(ItemClassNotAllowed):
        objects.encode_samples("f", [Tag("a", 1)])  # nothing registered in this process for Tag
    blob = objects.encode_object(Tag("a", 1), classes=ItemClasses([Tag]))
    with pytest.raises(ItemClassNotAllowed, match="tests.rlinf_items:Tag, which is not an allowed item class"):
        objects.decode_object(blob)  # the reader has not allowed it
    pickled = objects.encode_object(Unlisted(1), allow_pickle=True)
    assert objects.decode_object(pickled, allow_pickle=True) == Unlisted(1)


def test_registration_checks_the_class_and_allows_it_in_this_process() -> None:
    @dataclasses.dataclass
    class Local:
        x: int

    with pytest.raises(UnsupportedValue, match="inside a function"):
        register_item_class(Local)
    with pytest.raises(UnsupportedValue, match="not a dataclass or NamedTuple"):
        register_item_class(Opaque)
    assert class_path(Point) == "tests.unit.values:Point"
    allowed = ItemClasses(["tests.rlinf_items:Tag"])  # by path: imported when first needed
    assert allowed.resolve("tests.rlinf_items:Tag") is Tag and allowed.path_of(Tag) == "tests.rlinf_items:Tag"
    assert allowed.resolve("os:system") is None and allowed.path_of(Rollout) is None


def test_a_record_of_another_version_of_its_class_is_refused() -> None:
    writer = ItemClasses(["tests.rlinf_items:Tag"])
    blob = objects.encode_object(Tag("a", 1), classes=writer)
    changed = blob.replace(b"version", b"revisio")  # as if the writer's class had another field
    with pytest.raises(UnsupportedValue, match="different versions"):
        objects.decode_object(changed, classes=writer)
