"""Every name is validated in one place (tq_redis.names): the alphabets, the reserved prefix, the
typed error, and the key builders that only take checked names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis.crc import key_slot

from tq_redis import names
from tq_redis.errors import InvalidArgument, InvalidName
from tq_redis.meta.keys import ChannelKeys, PartitionKeys, by_slot, check_name, partitions_key
from tq_redis.ops.context import Context, check_fields

ROOT = Path(__file__).resolve().parents[2]

# What users name things (verl, the reference's tests, RLinf, MindSpeed) must keep working.
GOOD_KEY_PARTS = ["train_0", "val", "global_step_3", "test@partition_1", "dock.abc",
                  "c9eb4eb1-679b-47bf-b793-7f1ad7ed2d93",
                  "input_ids", "old_log_prob", "a:b/c", "x*", "[ab]?", "数据", "p" * names.NAME_MAX]
BAD_KEY_PARTS = [None, "", 3, b"train", "a\tb", "a\x00b", "a\nb", "a\rb", "a b", "{p}", "a}b", "a\u00a0b",
                 "a\x7fb", "p" * (names.NAME_MAX + 1)]
KEY_PART_VALIDATORS = [names.field_name, names.task_name, names.channel_name, names.tag_name, names.partition_id]


def test_validators_cover_every_kind_of_name():
    assert set(names.VALIDATORS) == {
        "namespace", "partition_id", "field name", "task_name", "channel name", "tag name", "KV key",
    }
    assert issubclass(InvalidName, InvalidArgument) and issubclass(InvalidName, ValueError)


@pytest.mark.parametrize("validator", KEY_PART_VALIDATORS)
@pytest.mark.parametrize("value", GOOD_KEY_PARTS)
def test_key_part_names_users_use_are_accepted(validator, value):
    assert validator(value) == value


@pytest.mark.parametrize("validator", KEY_PART_VALIDATORS)
@pytest.mark.parametrize("value", BAD_KEY_PARTS)
def test_key_part_names_that_break_the_layout_are_refused(validator, value):
    with pytest.raises(InvalidName, match="printable characters except whitespace"):
        validator(value)


@pytest.mark.parametrize("value", ["tq", "t1a2b3", "job-1.v2", "A_b", "x" * names.NAMESPACE_MAX])
def test_namespaces_accepted(value):
    assert names.namespace(value) == value


@pytest.mark.parametrize("value", [None, "", 0, "a:b", "a*", "a?", "[a]", "a b", "a\tb", "a\x00", "ns{",
                                   "ns}", "a/b", "é", "x" * (names.NAMESPACE_MAX + 1)])
def test_namespaces_that_could_reach_other_keys_are_refused(value):
    with pytest.raises(InvalidName, match="ASCII letters, digits"):
        names.namespace(value)


@pytest.mark.parametrize("value", ["__chan__.c", "__chan__", "__chan__x"])
def test_channel_data_partitions_are_reserved(value):
    with pytest.raises(InvalidName, match="reserved"):
        names.partition_id(value)
    with pytest.raises(InvalidName, match="reserved"):
        PartitionKeys("ns", value)


@pytest.mark.parametrize("value", ["0_1", "c9eb4eb1-679b-47bf-b793-7f1ad7ed2d93", "a b", "{x}", "k:*", "é", "a\u00a0b"])
def test_kv_keys_take_a_wider_alphabet(value):
    assert names.kv_key(value) == value


@pytest.mark.parametrize("value", [None, "", 7, b"k", "a\x00", "a\nb", "a\tb", "\x1b[0m"])
def test_kv_keys_refuse_control_characters(value):
    with pytest.raises(InvalidName, match="without control characters"):
        names.kv_key(value)


def test_errors_name_the_kind_and_show_the_bad_character():
    with pytest.raises(InvalidName, match=r"partition_id 'a\\tb' contains U\+0009"):
        names.partition_id("a\tb")
    with pytest.raises(InvalidName, match=r"field name 'a\\x00b' contains U\+0000"):
        names.field_name("a\x00b")
    with pytest.raises(InvalidName, match="custom meta key"):  # a caller's own label is kept
        check_name("custom meta key", "a b")


def test_key_builders_take_checked_names_only():
    with pytest.raises(InvalidName):
        PartitionKeys("a:b", "p")
    with pytest.raises(InvalidName):
        PartitionKeys("ns", "a\tb")
    with pytest.raises(InvalidName):
        ChannelKeys("ns", "c\x00")
    with pytest.raises(InvalidName):
        partitions_key("")
    ck = ChannelKeys("ns", "c")
    assert ck.data_partition == "__chan__.c"
    assert ck.data_keys().prefix == "ns:{ns/__chan__.c}:"  # tq-redis's own use of the reserved prefix
    with pytest.raises(InvalidName):
        PartitionKeys.internal("ns", "__chan__.a b")


@pytest.mark.parametrize("value", [None, "", "a:b"])
def test_a_context_refuses_a_bad_namespace(value):
    with pytest.raises(InvalidName):
        Context(namespace=value, redis_url="redis://127.0.0.1:1/0")


def test_field_lists_are_checked_per_name():
    assert check_fields("input_ids") == ["input_ids"]
    with pytest.raises(InvalidName):
        check_fields(["ok", "bad\x00"])


def test_by_slot_groups_keys_as_a_cluster_routes_them():
    keys = [f"ns:{{p{i % 3}}}:d:{i}:x" for i in range(30)] + ["ns:partitions"]
    groups = by_slot(keys)
    assert sorted(k for g in groups.values() for k in g) == sorted(keys)
    for slot, group in groups.items():
        assert {key_slot(k.encode()) for k in group} == {slot}
    assert len(groups) == 4


def test_no_other_module_defines_its_own_name_rules_or_scans_by_pattern():
    """Names are checked in tq_redis/names.py only, and no key is found by a SCAN pattern."""
    sources = {p: p.read_text() for p in (ROOT / "tq_redis").rglob("*.py")}
    raisers = sorted(p.name for p, text in sources.items() if "raise InvalidName" in text)
    assert raisers == ["names.py"]
    scanners = sorted(p.relative_to(ROOT / "tq_redis").as_posix() for p, text in sources.items()
                      if re.search(r"scan_iter\(|[\"']SCAN[\"']|[\"']MATCH[\"']|match=", text))
    # ``tq-redis namespace list|gc`` finds the namespaces themselves (no registry can list those of
    # jobs that died): an admin's look at the whole server, whose patterns hold no name, only the
    # fixed namespace-level key kinds (monitor/known.py's find, which namespaces.py calls)
    assert scanners == ["monitor/known.py"]
    scanning = sources[ROOT / "tq_redis" / "monitor" / "known.py"]
    assert re.findall(r"match=([^,)]*)", scanning) == ['f"*:{marker}"']
    assert re.search(r"for marker in _MARKERS:", scanning)


@pytest.mark.parametrize("value", ["resp~0", "resp~12", "resp~parts", "resp~next", "resp~version", "~", "a~b"])
@pytest.mark.parametrize("validator", [names.field_name, names.tag_name])
def test_partial_rollouts_reserved_names_are_refused_as_fields_and_tags(validator, value):
    """``~`` marks tq-redis's own names (an appended field's parts, tags and version column)."""
    with pytest.raises(InvalidName, match=r"contains '~', which is reserved.*'<field>~parts'"):
        validator(value)
    assert names.is_reserved(value)


@pytest.mark.parametrize("kind", ["custom meta key", "tag name", "field name", "field"])
def test_reserved_names_are_refused_under_every_label(kind):
    with pytest.raises(InvalidName, match=f"{kind} 'resp~parts' contains '~'"):
        check_name(kind, "resp~parts")
    with pytest.raises(InvalidName, match="reserved"):
        check_fields(["prompt", "resp~version"])


@pytest.mark.parametrize("validator", [names.partition_id, names.task_name, names.channel_name])
def test_other_names_may_hold_a_tilde(validator):
    assert validator("a~b") == "a~b"  # only fields and tags share a namespace with the hidden parts
