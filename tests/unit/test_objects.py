"""Unit tests for tq_redis.codec.objects: the safe object encoding (msgpack plus extension types)."""

from __future__ import annotations

import collections
import dataclasses
import pstats
import struct
import subprocess
import sys
import urllib.parse
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from tests.rlinf_items import Rollout, Step, Tag, Unlisted
from tests.unit.values import Opaque, Point, assert_same, python_objects
from tq_redis.codec import item_classes as ic
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
    with pytest.raises(ItemClassNotAllowed, match="SplitResult.*standard library"):
        objects.encode_object(urllib.parse.urlsplit("http://h/p"))  # a namedtuple is not silently flattened
    out = objects.decode_object(objects.encode_object(Point(1, 2)))  # the program's own: kept as its class
    assert type(out) is Point and out == Point(1, 2)


def test_allow_pickle_roundtrip_and_refusal_on_decode() -> None:
    blob = objects.encode_object(Opaque(1), allow_pickle=True)
    assert objects.decode_object(blob, allow_pickle=True) == Opaque(1)
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
        objects.encode_object([Unlisted(1)], classes=ItemClasses([Rollout]))  # a strict list
    assert isinstance(err.value, UnsupportedValue) and err.value.path == "tests.rlinf_items.Unlisted"
    with pytest.raises(ItemClassNotAllowed, match="StatsProfile.*installed package or the standard library"):
        objects.encode_samples("f", [pstats.StatsProfile(0.5, {})])  # not the program's, not registered
    blob = objects.encode_object(pstats.StatsProfile(0.5, {}), classes=ItemClasses([pstats.StatsProfile]))
    with pytest.raises(ItemClassNotAllowed, match="pstats:StatsProfile, which is not an allowed item class"):
        objects.decode_object(blob)  # the reader has not allowed it
    pickled = objects.encode_object(pstats.StatsProfile(0.5, {}), allow_pickle=True)
    assert objects.decode_object(pickled, allow_pickle=True) == pstats.StatsProfile(0.5, {})


def test_classes_the_program_defines_round_trip_by_default() -> None:
    item = [Unlisted(1), Step(2, _rollout(2), Tag("t", 1)), Point(3, 4)]  # registered nowhere
    blob = objects.encode_object(item)
    assert b"pickle" not in blob and b"tests.rlinf_items:Unlisted" in blob
    out = objects.decode_object(blob)
    assert [type(x) for x in out] == [Unlisted, Step, Point] and out[0] == Unlisted(1) and out[2] == Point(3, 4)
    assert torch.equal(out[1].rollout.prompt_ids, item[1].rollout.prompt_ids) and out[1].tag == Tag("t", 1)
    assert ic.program_class_path(Unlisted) == "tests.rlinf_items:Unlisted"
    strict = ItemClasses()  # a list of its own allows only what it names
    with pytest.raises(ItemClassNotAllowed, match="does not allow the program's own classes"):
        objects.encode_object(Unlisted(1), classes=strict)
    with pytest.raises(ItemClassNotAllowed, match="does not allow the program's own classes"):
        objects.decode_object(blob, classes=strict)


def test_the_rule_refuses_what_the_program_does_not_define() -> None:
    @dataclasses.dataclass
    class Local:
        x: int

    assert "inside a function" in ic.why_not_program(Local)
    assert "standard library" in ic.why_not_program(pstats.StatsProfile)
    import tensordict

    records = [c for c in vars(tensordict).values() if isinstance(c, type) and ic.record_kind(c) is not None]
    assert records
    for cls in records:  # site-packages
        assert "installed package" in ic.why_not_program(cls), cls
    from tq_redis.ops.channel_rules import WeightedItem

    assert ic.record_kind(WeightedItem) and ic.program_class_path(WeightedItem) is None  # tq-redis's own
    # a class whose path leads to another class is refused: a reader would build that other one
    impostor = dataclasses.make_dataclass("Unlisted", [("x", int)])
    impostor.__module__ = "tests.rlinf_items"
    assert "does not lead to it" in ic.why_not_program(impostor) and ic.program_class_path(Unlisted)
    with pytest.raises(ItemClassNotAllowed, match="does not lead to it"):
        objects.encode_object(impostor(1))


def _record(path: str, values: object) -> bytes:
    return msgpack.packb(msgpack.ExtType(objects._EXT_RECORD, msgpack.packb([path, values])))


def test_a_reader_never_imports_a_module_a_stored_value_names(tmp_path) -> None:
    """A stored record names its class's module; a reader resolves it only among the modules it has
    loaded and only as a class the program defines, so bytes can never make it run a module's code."""
    planted = tmp_path / "tq_planted_module.py"
    marker = tmp_path / "ran"
    planted.write_text("import dataclasses, pathlib\n"
                       f"pathlib.Path({str(marker)!r}).write_text('imported')\n"
                       "@dataclasses.dataclass\nclass X:\n    a: int\n")
    sys.path.insert(0, str(tmp_path))
    try:
        for path in ("tq_planted_module:X", "os:system", "subprocess:Popen", "tests.rlinf_items:_import",
                     "tests.rlinf_items:Rollout.__post_init__", "tests.rlinf_items:dataclasses",
                     "torch:nn", "tensordict:TensorDict", "pstats:StatsProfile", ":X", "X"):
            with pytest.raises(ItemClassNotAllowed, match="not an allowed item class"):
                objects.decode_object(_record(path, {"a": 1}))
        assert not marker.exists() and "tq_planted_module" not in sys.modules
        with pytest.raises(ItemClassNotAllowed, match="not imported in this process.*imports no module"):
            objects.decode_object(_record("tq_planted_module:X", {"a": 1}))
        with pytest.raises(ItemClassNotAllowed):  # not a string path at all
            objects.decode_object(_record(7, {"a": 1}))  # type: ignore[arg-type]
    finally:
        sys.path.remove(str(tmp_path))
    assert objects.decode_object(_record("tests.rlinf_items:Tag", {"name": "a", "version": 1})) == Tag("a", 1)


def test_a_consumer_process_resolves_only_the_classes_it_has_loaded(tmp_path) -> None:
    """Another process (a consumer) decodes the program's classes from modules it has imported, and
    refuses, without importing it, one whose module it has not."""
    blob = objects.encode_object([Tag("t", 2), Point(1, 2)])
    script = (
        "import sys\n"
        "from tq_redis.codec import objects\n"
        "from tq_redis.errors import ItemClassNotAllowed\n"
        "blob = sys.stdin.buffer.read()\n"
        "try:\n    objects.decode_object(blob)\nexcept ItemClassNotAllowed as e:\n"
        "    print('refused', 'tests.rlinf_items' in sys.modules, 'not imported' in str(e))\n"
        "import tests.rlinf_items, tests.unit.values\n"
        "print(objects.decode_object(blob))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], input=blob, capture_output=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().splitlines() == ["refused False True", "[Tag(name='t', version=2), Point(x=1, y=2)]"]


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
