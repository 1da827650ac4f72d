"""The typed face of the Lua library (``tq_redis/ops/transitions.py``), checked without a server.

* Structure: every ``lua/<name>.lua`` has exactly one wrapper and every wrapper a script; no
  module but ``transitions`` builds an ``FCall``; each wrapper's KEYS/ARGV agree with the
  ``Input:`` section of its script's header (the count where the header fixes it, the exact
  list for a worked example of each).
* Readers: every reply code of every script, on hand-made replies, decoded into its named
  result or raised as the typed error every caller raises.
* The shared decoders (tags, schema pairs) and the one user-sampler claim loop
  (``ops.claim_choice``), driven by hand with scripted replies.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tq_redis import ops
from tq_redis.errors import (
    DTypeConflict,
    InvalidArgument,
    PartitionClosed,
    PartitionSealed,
    RateLimited,
    SampleComplete,
    SampleNotFound,
    UnknownPartition,
    UnsupportedValue,
)
from tq_redis.meta.keys import ChannelKeys, PartitionKeys, storage_nodes_key
from tq_redis.ops import claim as ops_claim
from tq_redis.ops import encoding, transitions
from tq_redis.ops.claim_plan import SamplerPlan
from tq_redis.ops.effects import Cmd, FCall, Pipe
from tq_redis.ops.transitions import (
    ChannelPop,
    ChannelPut,
    ClaimReply,
    Cleared,
    KeyListing,
    KeyResolution,
    Progress,
    ReadySet,
    Settled,
    TagChangesReply,
    Visibility,
)
from tq_redis.server import library as scripts

ROOT = Path(__file__).resolve().parents[2]
PK = PartitionKeys("ns", "p")
CK = ChannelKeys("ns", "c")
REGISTRY = storage_nodes_key("ns")
F32 = '{"dtype":"float32","kind":"tensor","shape":[3]}'
I64 = '{"dtype":"int64","kind":"tensor","shape":[3]}'
NOW = 1_000
PART = transitions.PartSpec("resp", I64, '{"kind":"parts"}')


# ---------------------------------------------------------------------------------------------
# Structure: one wrapper per script, no FCall elsewhere, arguments as the headers say
# ---------------------------------------------------------------------------------------------


def _fcall_names(path: Path) -> list[str | None]:
    """The first argument of every ``FCall(...)`` in a source file (None where not a literal)."""
    found: list[str | None] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name == "FCall":
                first = node.args[0] if node.args else None
                found.append(first.value if isinstance(first, ast.Constant) else None)
    return found


def test_every_script_has_exactly_one_wrapper_and_every_wrapper_a_script():
    names = scripts.script_names()
    assert sorted(transitions.BY_SCRIPT) == names
    assert all(fn.__name__ == name for name, fn in transitions.BY_SCRIPT.items())
    built = Counter(_fcall_names(ROOT / "tq_redis" / "ops" / "transitions.py"))
    assert built == Counter(names), "transitions.py must build each script's FCall once, by its literal name"


def test_no_module_but_transitions_builds_an_fcall():
    offenders = {}
    for folder in (ROOT / "tq_redis",):
        for path in folder.rglob("*.py"):
            if path.name != "transitions.py" and _fcall_names(path):
                offenders[str(path.relative_to(ROOT))] = _fcall_names(path)
    assert offenders == {}, "call the wrapper in tq_redis/ops/transitions.py instead"


def test_the_user_sampler_claim_loop_is_written_once():
    """Only ``claim_choice`` (``tq_redis/ops/claim.py``, public as ``ops.claim_choice``) reads a ready
    set and claims a choice; the dock reuses it."""
    users: set[tuple[str, str]] = set()
    for path in (ROOT / "tq_redis").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and node.attr in ("ready_ids", "claim_ids"):
                    users.add((path.relative_to(ROOT / "tq_redis").as_posix(), fn.name))
    assert users == {("ops/claim.py", "claim_choice")}
    dock = (ROOT / "tq_redis" / "dock" / "dock.py").read_text(encoding="utf-8")
    assert "ops.claim_choice(" in dock


def input_spec(name: str) -> tuple[int, int, bool]:
    """``(number of KEYS, leading fixed ARGV count, more ARGV may follow)`` from the script's header."""
    header = (ROOT / "tq_redis" / "lua" / f"{name}.lua").read_text(encoding="utf-8").split("]]", 1)[0]
    section = header.split("Input:", 1)[1].split("Output:", 1)[0]
    keys = len(re.findall(r"^\s*KEYS\[\d+\]", section, re.MULTILINE))
    fixed, variadic = 0, False
    for m in re.finditer(r"^\s*(?:ARGV\[([^\]]+)\]|then\b)", section, re.MULTILINE):
        index = m.group(1)
        if index is not None and index.isdigit() and not variadic:
            assert int(index) == fixed + 1, f"lua/{name}.lua: ARGV[{index}] follows ARGV[{fixed}]"
            fixed = int(index)
        else:
            variadic = True
    return keys, fixed, variadic


# A worked example per script: the wrapper's effect and the ARGV the header prescribes for it.
EXAMPLES: dict[str, tuple[transitions.Transition, tuple]] = {
    "reserve": (
        transitions.reserve(PK, 4, {"a": F32}, strict=True, waiter="w", wait_ms=250), (4, "w", 250, "a", "!" + F32)
    ),
    "insert": (
        transitions.insert(PK, 10, 4, {"a": F32}, now_ms=NOW, ring="r1"), (10, 4, NOW, "r1", "", 0, 1, "a", F32)
    ),
    "produce": (transitions.produce(PK, [3, 5], {"a": F32}), ("", 1, "a", F32, 2, 3, 5)),
    "read_inline": (transitions.read_inline(PK, [5, 0, 1, 2], ["a"]), ("0-2,5", "a")),
    "share_begin": (transitions.share_begin(PK, {"a": F32}), ("a", F32)),
    "share_put": (
        transitions.share_put(PK, [3, 4, 5], {"a": F32}, inline_values=[b"v"]), ("", "", "3-5", 1, "a", F32, b"v")
    ),
    "set_tags": (
        transitions.set_tags(PK, [3, 5], ["len", "uid"], [{"len": 7}, {"uid": "x"}]),
        ("1", 2, 3, 5, "len", "7", "", "uid", "", '"x"'),
    ),
    "check_visible": (transitions.check_visible(PK, [5, 0, 1, 2], ["a"], placement=True), ("0-2,5", "1", "a")),
    "claim": (
        transitions.claim(
            PK, "t", SamplerPlan("grpo", 8, (("n", "4"),)), ["a", "b"],
            lease_ms=500, max_deliveries=3, waiter="w", wait_ms=250,
        ),
        ("t", 8, 500, 3, "grpo", 1, "n", "4", 2, "a", "b", "w", 250),
    ),  # fmt: skip
    "claim_ids": (
        transitions.claim_ids(PK, "t", [5, 3], [5], ["a"], lease_ms=0),
        ("t", 0, 2, 5, 3, 1, 5, 1, "a"),
    ),
    "ready_ids": (transitions.ready_ids(PK, "t", ["a"], max_deliveries=2), ("t", 2, 1, "a")),
    "wait": (transitions.wait(PK, "t", "w", 250, "1-0"), ("t", "w", 250, "1-0")),
    "settle": (
        transitions.settle(PK, "t", "extend", [3, 4], [1, 0], 500),
        ("t", "extend", 500, 3, 1, 4, 0),
    ),
    "unclaim": (transitions.unclaim(PK, "t", [3, 4], [2, 0]), ("t", 3, 2, 4, 0)),
    "clear": (transitions.clear(PK, [3, 4]), (3, 4)),
    "drop_partition": (transitions.drop_partition(PK, now_ms=NOW), (NOW,)),
    "trash_add": (transitions.trash_add(PK, [3, 1, 2], ["a"], "r1"), ("1-3", "r1", "a")),
    "trash_done": (transitions.trash_done(PK, [7]), ("7",)),
    "reset_consumption": (transitions.reset_consumption(PK), ("",)),
    "seal_partition": (transitions.seal_partition(PK, now_ms=NOW), (NOW,)),
    "progress": (transitions.progress(PK, "t", ["a"]), ("t", 1, "a")),
    "kv_resolve": (
        transitions.kv_resolve(PK, ["k1", "k2"], True, {"a": F32}, now_ms=NOW, waiter="w", wait_ms=250),
        (1, NOW, "w", 250, 2, "k1", "k2", "a", F32),
    ),
    "kv_unmap": (transitions.kv_unmap(PK, [("k1", 3), ("k2", 4)]), ("k1", 3, "k2", 4)),
    "kv_list": (transitions.kv_list(PK, "17", 100), ("17", 100)),
    "tag_changes": (transitions.tag_changes(PK, "5-0", 64, [("done", "true")]), ("5-0", 64, "done", "true")),
    "read_registry": (transitions.read_registry("ns"), ()),
    "channel_put": (transitions.channel_put(CK, "default", b"1|x"), ("default", b"1|x")),
    "channel_pop": (transitions.channel_pop(CK, "default", 2.5), ("default", "reach", "2.5")),
    "group_reserve": (
        transitions.group_reserve(PK, "tok", 4, 500, 3, "w", 250, (1, 8)), ("tok", 4, 500, 3, "w", 250, 1, 8)
    ),
    "group_extend": (transitions.group_extend(PK, "tok", 0, "c", ["a", "b"]), ("tok", 0, "c", "a", "b")),
    "group_commit": (
        transitions.group_commit(PK, "tok", "c", {"a": F32}, end_version=5, ring="r1", now_ms=NOW),
        ("tok", "c", 5, NOW, "r1", 1, "a", F32),
    ),
    "group_abort": (transitions.group_abort(PK, "tok"), ("tok",)),
    "policy_version": (transitions.policy_version(PK, 7), (7,)),
    "admission_config": (transitions.admission_config(PK, 1, 8), (1, 8)),
    "rate_limit_config": (transitions.rate_limit_config(PK, "t", 2, 10, 4, 5000), ("t", "2.0", 10, "4.0", 5000)),
    "part_alloc": (transitions.part_alloc(PK, [3, 4], [PART]), (1, *PART, 2, 3, 4)),
    "part_append": (
        transitions.part_append(PK, [3], [PART], [16], 7, inline_values=[b"v"], complete=["resp"]),
        ("", 7, 1, "resp", 1, *PART, 1, 3, 16, "v", b"v"),
    ),
    "part_read": (transitions.part_read(PK, [3, 4, 5], "resp"), ("3-5", "resp")),
    "mark_consumed": (transitions.mark_consumed(PK, "t", [5, 3, 5], ["a"]), ("t", 3, 5, 3, 5, 1, "a")),
    "unproduce": (transitions.unproduce(PK, [4, 3, 9], ["resp", "len"]), ("3-4,9", "resp", "len")),
    "dock_shape": (transitions.dock_shape(PK, 4, 2), (4, 2)),
    "dock_cursor": (transitions.dock_cursor(PK, "requests", 3, 8), ("requests", 3, 8)),
    "dock_metric": (transitions.dock_metric(PK, b"entry"), (b"entry",)),
    "dock_reset": (transitions.dock_reset(PK), ()),
    "dock_finish": (transitions.dock_finish(PK, "roll", [2, 3], [True, False]), ("roll", 2, "1", 3, "0")),
    "dock_ready": (transitions.dock_ready(PK, 2, 8), (2, 8)),
    "dock_resort": (
        transitions.dock_resort(PK, 2, [2, 3, 0, 1], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]),
        (2, 4, "1100", "1100", 2, 3, 0, 1, 1, 1, 0, 0),
    ),
}


def test_examples_cover_every_script():
    assert sorted(EXAMPLES) == scripts.script_names()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_wrapper_builds_the_arguments_its_script_header_names(name: str):
    call, expected_args = EXAMPLES[name]
    effect = call.effect
    assert isinstance(effect, FCall) and effect.name == name
    keys, fixed, variadic = input_spec(name)
    meta = CK.meta if name.startswith("channel_") else REGISTRY if name == "read_registry" else PK.meta
    assert effect.keys == (meta,) and len(effect.keys) == keys
    if variadic:
        assert len(effect.args) >= fixed
    else:
        assert len(effect.args) == fixed, f"lua/{name}.lua takes exactly {fixed} ARGV"
    assert effect.args == expected_args


def test_input_spec_reads_fixed_and_variadic_headers():
    assert input_spec("wait") == (1, 4, False)
    assert input_spec("drop_partition") == (1, 1, False)
    assert input_spec("claim") == (1, 6, True)
    assert input_spec("reserve") == (1, 3, True)
    assert input_spec("kv_unmap") == (1, 0, True)


def test_optional_arguments_take_their_documented_defaults():
    assert transitions.reset_consumption(PK, "t").effect.args == ("t",)
    assert transitions.channel_pop(CK, "q").effect.args == ("q", "one", "")
    assert transitions.channel_pop(CK, "q", 3, fit=True).effect.args == ("q", "fit", "3")
    claim = transitions.claim(PK, "t", SamplerPlan("sequential", 2, ()), ["a"])
    assert claim.effect.args == ("t", 2, 0, 0, "sequential", 0, 1, "a")  # no lease, no waiter
    assert transitions.reserve(PK, 3).effect.args == (3, "", 0)  # no waiter
    assert transitions.insert(PK, 0, 3, now_ms=NOW).effect.args == (0, 3, NOW, "", "", 0, 0)  # no ring: not placed
    assert transitions.rate_limit_config(PK, "t", 1.5).effect.args == ("t", "1.5", 1, "1.0", "")  # no timeout
    assert transitions.rate_limit_config(PK, "t", None).effect.args == ("t", "", "", "", "")  # removed
    now = transitions.seal_partition(PK).effect.args[0]
    assert abs(now - encoding.clock_ms()) < 60_000


def test_part_replies_are_read():
    assert read("part_alloc", [1, 0, 2]) == [0, 2]
    assert read("part_append", [1]) == []
    with pytest.raises(UnknownPartition):
        read("part_alloc", [-1])
    with pytest.raises(SampleNotFound, match=r"\[3, 4\]"):
        read("part_append", [-2, 3, 4])
    with pytest.raises(SampleComplete, match="'resp'") as complete:
        read("part_append", [-3, b"resp", 3])
    assert complete.value.ids == [3]
    with pytest.raises(InvalidArgument, match="never appended"):
        read("part_append", [-4, b"resp"])
    parts = transitions.part_read(PK, [4, 3], "resp").read([0, [b"[[1, 2, 0]]", b"[[5, 1, 0], [6, 1, 1]]"],
                                                            [b"a", b"b", False]])
    assert parts.parts == [[(5, 1, 0), (6, 1, 1)], [(1, 2, 0)]]
    assert parts.values == [[b"b", None], [b"a"]]


def test_reservation_replies_are_read():
    assert read("group_reserve", [1, 0, 40, "3", 9000]) == transitions.Reserved(True, 0, 40, "3", 9000)
    refused = read("group_reserve", [-5, 1, "2", 0, 150])
    assert not refused.ok and refused.trashed == 1 and refused.capacity == 0 and refused.next_lapse_ms == 150
    with pytest.raises(PartitionSealed):
        read("group_reserve", [-3, 0])
    assert read("group_commit", [1, 0, 40]) == transitions.GroupReply(True, 0, 40)
    assert not read("group_commit", [-6, 2]).held
    assert not read("group_commit", [-7, 0]).held
    with pytest.raises(DTypeConflict, match="'a'"):
        read("group_commit", [0, b"a", I64.encode()])
    assert read("policy_version", [0, "9"]) == (False, 9)
    assert read("admission_config", ["", 0, 0]) == transitions.Admission(None, 0, 0)
    held = read("group_reserve", [-6, 2, b"train", 40, 12, b"5000"])
    assert not held.ok and held.trashed == 2 and isinstance(held.held, RateLimited)
    assert (held.held.task, held.held.inserts, held.held.samples, held.held.timeout_s) == ("train", 40, 12, 5.0)


def test_rate_limited_inserts_and_claims_are_read():
    for name in ("reserve", "insert", "kv_resolve"):
        with pytest.raises(RateLimited, match="task 'train'") as held:
            read(name, [-6, b"train", 40, 12, b""])
        assert isinstance(held.value, transitions.InsertHeld) and held.value.timeout_s is None
        assert (held.value.inserts, held.value.samples) == (40, 12)
    assert read("claim_ids", [-2]) == transitions.ClaimIdsReply(None, [], False, held_back=True)
    assert read("rate_limit_config", [40, 12]) == transitions.RateCounts(40, 12)


def test_dock_replies_are_read():
    assert read("mark_consumed", [1, 2]) == transitions.Marked(2, [])
    assert read("mark_consumed", [1, 0]).ok
    refused = read("mark_consumed", [0, 3, 5])
    assert not refused.ok and refused.not_ready == [3, 5]
    assert read("mark_consumed", [-1]) == transitions.Marked(0, [], True)
    assert read("unproduce", [1]) is None
    with pytest.raises(UnknownPartition):
        read("unproduce", [-1])
    with pytest.raises(SampleNotFound, match=r"\[3\]"):
        read("unproduce", [-2, 3])
    assert read("dock_shape", [4, 2]) == (4, 2)
    assert read("dock_cursor", 6) == 6 and read("dock_cursor", -1) is None
    assert transitions.dock_cursor(PK, "rows", 2).effect.args == ("rows", 2, "")  # no end
    with pytest.raises(InvalidArgument, match="'rows' or 'requests'"):
        transitions.dock_cursor(PK, "other", 1)
    assert read("dock_metric", 3) == 3 and read("dock_reset", 2) == 2
    assert read("dock_finish", [1, 2]) == transitions.DockFinished(1, 2)
    assert read("dock_ready", 3) == 3
    assert read("dock_resort", 4) == 4
    with pytest.raises(InvalidArgument, match="4 rows"):
        transitions.dock_resort(PK, 2, [0, 1, 2, 3], [0], [0], [0])


def test_set_tags_rejects_bad_names_and_values():
    with pytest.raises(InvalidArgument, match="custom meta key"):
        transitions.set_tags(PK, [1], ["bad name"], [{"bad name": 1}])
    with pytest.raises(UnsupportedValue, match="not JSON-serialisable"):
        transitions.set_tags(PK, [1], ["x"], [{"x": object()}])


# ---------------------------------------------------------------------------------------------
# Running a transition: alone, or in one round trip with other effects
# ---------------------------------------------------------------------------------------------


def drive(op, replies: list[Any]) -> tuple[Any, list[Any]]:
    """Run an operation by hand: answer its effects with ``replies`` in order."""
    effects: list[Any] = []
    value: Any = None
    pending = list(replies)
    try:
        while True:
            effects.append(op.send(value))
            value = pending.pop(0)
    except StopIteration as stop:
        assert not pending, f"unused replies {pending}"
        return stop.value, effects


def test_call_yields_the_effect_and_returns_the_read_reply():
    call = transitions.reserve(PK, 4)
    first, effects = drive(call.call(), [[1, 40]])
    assert first == 40 and effects == [call.effect]


def test_pipeline_sends_one_pipe_and_reads_only_the_transitions():
    zadd = Cmd(("ZADD", "ns:partitions", "NX", 1.0, "p"))
    results, effects = drive(transitions.pipeline(transitions.insert(PK, 0, 2, now_ms=NOW), zadd), [[[1, 0], 1]])
    assert effects == [Pipe((transitions.insert(PK, 0, 2, now_ms=NOW).effect, zadd))]
    assert results == [0, 1]
    with pytest.raises(PartitionSealed):
        drive(transitions.pipeline(transitions.insert(PK, 0, 2), zadd), [[[-3], 0]])


# ---------------------------------------------------------------------------------------------
# Readers: every reply code
# ---------------------------------------------------------------------------------------------


def read(name: str, reply: Any) -> Any:
    call, _ = EXAMPLES[name]
    return call.read(reply)


def test_produce_reads_the_carriers_a_rewrite_freed_and_share_put_a_member_that_has_the_field():
    assert read("produce", [1, 7, 9]) == [7, 9]
    assert read("share_put", [1, 12]) == 12
    with pytest.raises(InvalidArgument, match=r"field 'a' is produced already for samples \[4\]"):
        read("share_put", [-5, b"a", 4])


def test_reserve_reads_the_first_id_sealed_and_conflict():
    assert read("reserve", [1, 17]) == 17
    with pytest.raises(PartitionSealed, match="'p' is sealed"):
        read("reserve", [-3])
    with pytest.raises(DTypeConflict, match="'a'"):
        read("reserve", [0, b"a", I64.encode()])


def test_a_conflict_with_equal_meaning_still_raises_invalid_argument():
    reordered = '{"kind":"tensor","dtype":"float32","shape":[3]}'
    with pytest.raises(InvalidArgument, match="conflicts with registered"):
        read("reserve", [0, b"a", reordered.encode()])


def test_a_conflict_on_a_field_not_offered_is_still_an_error():
    with pytest.raises(InvalidArgument, match="'zz'"):
        transitions.reserve(PK, 1).read([0, b"zz", F32.encode()])


def test_insert_reads_first_id_sealed_and_conflict():
    assert read("insert", [1, 10]) == 10
    with pytest.raises(PartitionSealed):
        read("insert", [-3])
    with pytest.raises(PartitionClosed, match="reopen_partition"):
        read("insert", [-4])
    with pytest.raises(PartitionClosed):
        read("reserve", [-4])
    with pytest.raises(DTypeConflict):
        read("insert", [0, b"a", I64])


@pytest.mark.parametrize("name", ["produce", "set_tags"])
def test_writes_read_done_missing_partition_and_cleared_samples(name: str):
    assert read(name, [1]) == ([] if name == "produce" else None)
    with pytest.raises(UnknownPartition, match="'p' does not exist"):
        read(name, [-1])
    with pytest.raises(SampleNotFound, match=r"samples \[3, 5\] of partition 'p' were cleared"):
        read(name, [-2, 3, 5])


def test_inline_writes_append_their_values_field_major():
    insert = transitions.insert(PK, None, 2, {"a": F32, "b": F32}, values=[b"a0", b"a1", b"b0", b"b1"], now_ms=NOW)
    assert insert.effect.args == ("", 2, NOW, "", "", 0, 2, "a", F32, "b", F32, b"a0", b"a1", b"b0", b"b1")
    produce = transitions.produce(PK, [7, 9], {"a": F32}, inline_values=[b"x", b"y"])
    assert produce.effect.args == ("", 1, "a", F32, 2, 7, 9, b"x", b"y")


def test_read_inline_maps_values_to_ids_and_fields():
    call = transitions.read_inline(PK, [5, 0, 1], ["a", "b"])
    got = call.read([0, [b"a0", None, b"a5", None, b"b1", b"b5"]])  # ascending ids 0, 1, 5; field-major
    assert got.visibility.ok
    assert got.values == {"a": {0: b"a0", 5: b"a5"}, "b": {1: b"b1", 5: b"b5"}}
    assert call.read([0, []]).values == {}
    assert call.read([-1, 5]).visibility.not_alive == [5]
    assert call.read([-2, b"b", 1]).visibility == Visibility([], "b", [1])


def test_produce_reads_a_conflict():
    with pytest.raises(DTypeConflict):
        read("produce", [0, b"a", I64.encode()])


def test_a_long_list_of_cleared_samples_is_cut_to_ten():
    with pytest.raises(SampleNotFound) as caught:
        read("produce", [-2, *range(50)])
    assert "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in str(caught.value)


def test_check_visible_reads_each_code():
    assert read("check_visible", [0]) == Visibility([], None, [])
    assert read("check_visible", [0]).ok
    gone = read("check_visible", [-1, 4, 9])
    assert gone == Visibility([4, 9], None, []) and not gone.ok
    unproduced = read("check_visible", [-2, b"a", 2, 3])
    assert unproduced == Visibility([], "a", [2, 3]) and not unproduced.ok


def test_check_visible_reads_the_placement():
    none = read("check_visible", [0, [[]]]).placement
    assert none.rings == [] and none.ring_of("a", 3).tolist() == [0, 0, 0]
    placed = read("check_visible", [0, [[b"r1", b"1", b"r0", b"0"], b"\x01\x00\x00\x00\x01\x00"]]).placement
    assert placed.rings == ["r0", "r1"] and placed.ring_of("a", 3).tolist() == [1, 0, 1]
    all_first = read("check_visible", [0, [[b"r0", b"0"], None]]).placement
    assert all_first.ring_of("a", 2).tolist() == [0, 0]


CLAIM_REPLY = [
    b"5-0",
    [3, 4],
    [b"a", F32.encode(), b"b", None],
    [b"len", [b"7", None], b"uid", [None, None]],
    [1, 2],
    12345,
    1,
]
CLAIMED = ClaimReply("5-0", [3, 4], {"a": F32}, [{"len": 7}, {}], [1, 2], 12345, True)


def test_claim_reads_a_batch():
    assert read("claim", CLAIM_REPLY) == CLAIMED


def test_claim_reads_nothing_ready_and_a_reply_without_registration():
    got = read("claim", [b"6-0", [], [b"a", F32.encode()], [], [], -1, 0])
    assert got == ClaimReply("6-0", [], {"a": F32}, None, [], -1, False)
    assert read("claim", [b"6-0", [], [], [], [], -1]).registered is False


def test_claim_ids_reads_claimed_taken_and_missing_partition():
    got = read("claim_ids", [1, *CLAIM_REPLY[:6]])
    assert got.claimed == CLAIMED._replace(registered=False)
    assert (got.taken, got.partition_missing) == ([], False)
    assert read("claim_ids", [0, 3, 5]) == (None, [3, 5], False, False)
    assert read("claim_ids", [-1]) == (None, [], True, False)


def test_ready_ids_reads_the_bitmap_as_ids():
    assert read("ready_ids", [b"7-0", b"\xa0\x01", 99]) == ReadySet("7-0", [0, 2, 15], 99)
    assert read("ready_ids", [b"0-0", None, -1]) == ReadySet("0-0", [], -1)
    assert read("ready_ids", [b"0-0", b"", -1]).ids == []


def test_wait_reads_registered_or_claim_again():
    assert read("wait", 1) is True
    assert read("wait", 0) is False


def test_settle_reads_count_and_not_held():
    assert read("settle", [2, 7, 8]) == Settled(2, [7, 8])
    assert read("settle", [0]) == Settled(0, [])


def test_clear_and_drop_read_ids_fields_and_leftovers():
    assert read("clear", [[3, 4], [b"a", b"b"], 0, [b"r1"]]) == Cleared([3, 4], ["a", "b"], 0, ["r1"])
    assert read("clear", [[], [], 5, []]) == Cleared([], [], 5)
    dropped = read("drop_partition", [b"\x60", [b"a"], 2, 1, [b"r1", b"r2"]])
    assert (dropped.alive_ids(), dropped.fields, dropped.older, dropped.in_store) == ([1, 2], ["a"], 2, True)
    assert dropped.rings == ["r1", "r2"]
    unknown = read("drop_partition", [None, [], 0, 1, []])
    assert (unknown.alive_ids(), unknown.fields, unknown.older, unknown.in_store) == ([], [], 0, True)
    assert read("drop_partition", [b"\x60", [b"a"], 0, 0, []]).in_store is False


def test_counting_replies_read_as_numbers_and_flags():
    assert read("trash_add", 12) == 12
    assert read("trash_done", 0) == 0
    assert read("kv_unmap", 2) == 2
    assert read("reset_consumption", 1) is True and read("reset_consumption", 0) is False
    assert read("seal_partition", 1) is True and read("seal_partition", 0) is False


def test_progress_reads_every_count():
    state = read("progress", [b"9-1", 1, 1, 10, 4, 4])
    assert state == Progress("9-1", True, True, 10, 4, 4)
    assert state.settled and not state.drained
    assert read("progress", [b"0-0", 0, 0, 0, 0, 0]) == Progress("0-0", False, False, 0, 0, 0)


def test_kv_resolve_reads_ids_missing_partition_and_conflict():
    got = read("kv_resolve", [1, [3, -1], 0, [b"a", F32.encode()], [b"uid", [b'"x"', None]]])
    assert got == KeyResolution([3, -1], 0, {"a": F32}, [{"uid": "x"}, {}])
    assert read("kv_resolve", [-1]) is None
    with pytest.raises(DTypeConflict):
        read("kv_resolve", [0, b"a", I64.encode()])


def test_kv_list_reads_keys_ids_and_tags():
    got = read("kv_list", [b"96", [b"k2", b"k1"], [8, 7], [b"v", [b"1", b"2"]]])
    assert got == KeyListing("96", ["k2", "k1"], [8, 7], [{"v": 1}, {"v": 2}])
    assert read("kv_list", [b"0", [], [], []]) == KeyListing("0", [], [], [])


def test_tag_changes_reads_changes_and_the_expired_answer():
    got = read("tag_changes", [1, b"9-1", [b"k", None], [4, 6], [b"done", [b"true", b"true"]], 0])
    assert got == TagChangesReply(False, "9-1", ["k", None], [4, 6], [{"done": True}] * 2, False)
    assert read("tag_changes", [-1, b"12-0"]) == TagChangesReply(True, "12-0", [], [], [], False)
    assert read("tag_changes", [1, b"5-0", [], [], [], 1]).more


def test_channel_put_reads_appended_full_and_missing():
    assert read("channel_put", [1, 3]) == ChannelPut(True, False, 3, "")
    assert read("channel_put", [0, b"4-0"]) == ChannelPut(False, False, 0, "4-0")
    assert read("channel_put", [-1]) == ChannelPut(False, True, 0, "")


def test_channel_pop_reads_popped_not_enough_and_missing():
    name = "channel_pop"
    assert read(name, [1, [b"1|a", b"2|b"]]) == ChannelPop(True, False, [b"1|a", b"2|b"], "")
    assert read(name, [1, []]) == ChannelPop(True, False, [], "")
    assert read(name, [0, b"3-0"]) == ChannelPop(False, False, [], "3-0")
    assert read(name, [-1]) == ChannelPop(False, True, [], "")


# ---------------------------------------------------------------------------------------------
# The shared decoders
# ---------------------------------------------------------------------------------------------


def test_tag_rows_decode_bytes_and_str_columns_per_sample():
    flat = [b"len", [b"3", None, b"[1,2]"], "uid", ['"a"', '"b"', None], b"none", [None, None, None]]
    assert encoding.tag_rows(flat, 3) == [{"len": 3, "uid": "a"}, {"uid": "b"}, {"len": [1, 2]}]
    assert encoding.tag_rows([], 2) == [{}, {}]


def test_tag_rows_never_shift_values_between_samples():
    # A stored value that is a JSON list fragment must not be spread over two samples.
    with pytest.raises(ValueError):
        encoding.tag_rows([b"v", [b"1,2", None]], 2)


def test_schema_pairs_leave_out_unregistered_fields():
    assert encoding.schema_pairs([b"a", F32.encode(), b"b", None, "c", ""]) == {"a": F32}
    assert encoding.schema_pairs([]) == {}


def test_tags_round_trip_through_encode_and_decode():
    values = [7, 2.5, "x", [1, 2], {"k": None}, True]
    flat = [b"t", [encoding.encode_tag(v).encode() for v in values]]
    assert [row["t"] for row in encoding.tag_rows(flat, len(values))] == values


# ---------------------------------------------------------------------------------------------
# The one user-sampler claim loop (ops.claim_choice), driven by hand
# ---------------------------------------------------------------------------------------------


def _ready(*ids: int) -> list[Any]:
    bits = bytearray(4)
    for i in ids:
        bits[i // 8] |= 0x80 >> (i % 8)
    return [b"1-0", bytes(bits), -1]


def _claimed(*ids: int) -> list[Any]:
    return [1, b"2-0", list(ids), [b"a", F32.encode()], [b"uid", [b"1"] * len(ids)], [], -1]


def _first_two(ready: list[int]):
    yield from ()
    return ready[:2], ready[:2]


def test_claim_choice_claims_the_choice():
    op = ops.claim_choice(PK, "t", ["a"], 2, _first_two)
    got, effects = drive(op, [_ready(0, 1, 2), _claimed(0, 1)])
    assert [e.name for e in effects] == ["ready_ids", "claim_ids"]
    assert effects[1].args[2:6] == (2, 0, 1, 2)  # nsampled, ids, nconsumed
    assert got.meta.global_indexes == [0, 1] and got.meta.custom_meta == [{"uid": 1}, {"uid": 1}]
    assert (got.last_event_id, got.exhausted) == ("2-0", False)


def _names(effects: list[Any]) -> list[str]:
    return [e.name if isinstance(e, FCall) else type(e).__name__ for e in effects]


def test_claim_choice_pauses_then_retries_with_a_fresh_ready_set_after_losing_its_choice():
    op = ops.claim_choice(PK, "t", ["a"], 2, _first_two)
    got, effects = drive(op, [_ready(0, 1, 2, 3), [0, 1], None, _ready(2, 3), _claimed(2, 3)])
    assert _names(effects) == ["ready_ids", "claim_ids", "Pause", "ready_ids", "claim_ids"]
    assert 0 <= effects[2].seconds <= ops_claim.RETRY_PAUSE_BASE_S
    assert got.meta.global_indexes == [2, 3] and not got.exhausted


def test_claim_choice_reports_running_out_of_attempts():
    op = ops.claim_choice(PK, "t", ["a"], 2, _first_two, attempts=2)
    got, effects = drive(op, [_ready(0, 1), [0, 0, 1], None, _ready(0, 1), [0, 1]])
    assert _names(effects) == ["ready_ids", "claim_ids", "Pause", "ready_ids", "claim_ids"]
    assert (got.meta, got.exhausted, got.lost) == (None, True, [1])


def test_retry_pauses_are_random_below_a_doubling_bound_with_a_cap():
    for lost in range(1, 12):
        bound = min(ops_claim.RETRY_PAUSE_BASE_S * 2 ** (lost - 1), ops_claim.RETRY_PAUSE_CAP_S)
        pauses = [ops_claim.retry_pause(lost) for _ in range(200)]
        assert all(0 <= p <= bound for p in pauses)
        assert len(set(pauses)) > 100  # spread, so consumers that collided come back apart
    assert ops_claim.retry_pause(40) <= ops_claim.RETRY_PAUSE_CAP_S


def test_claim_choice_claims_nothing_when_too_few_are_ready_or_nothing_is_chosen():
    got, effects = drive(ops.claim_choice(PK, "t", ["a"], 3, _first_two), [_ready(0, 1)])
    assert [e.name for e in effects] == ["ready_ids"]
    assert (got.meta, got.last_event_id, got.exhausted) == (None, "1-0", False)

    def nothing(ready):
        yield from ()
        return None

    got, effects = drive(ops.claim_choice(PK, "t", ["a"], 1, nothing), [_ready(0, 1)])
    assert len(effects) == 1 and got.meta is None and not got.exhausted


def test_claim_choice_stops_when_the_partition_is_gone():
    got, effects = drive(ops.claim_choice(PK, "t", ["a"], 1, _first_two), [_ready(0), [-1]])
    assert len(effects) == 2 and got.meta is None and not got.exhausted


def test_a_chooser_may_read_redis_before_choosing():
    def by_uid(ready):
        uids = yield Cmd(("HMGET", PK.tag("uid"), *ready))
        chosen = [i for i, uid in zip(ready, uids) if uid == b"1"]
        return chosen, chosen

    op = ops.claim_choice(PK, "t", ["a"], 2, by_uid)
    got, effects = drive(op, [_ready(0, 1, 2), [b"0", b"1", b"1"], _claimed(1, 2)])
    assert effects[1] == Cmd(("HMGET", PK.tag("uid"), 0, 1, 2))
    assert effects[2].args[2:6] == (2, 1, 2, 2)
    assert got.meta.global_indexes == [1, 2]


def test_read_registry_reads_the_clock_and_every_registration():
    call = transitions.read_registry("ns")
    reply = call.read([b"1700000000", b"250000", [b"node-a", b'{"address": "h:1"}', b"node-b", b"{}"]])
    assert reply.now == 1_700_000_000.25
    assert reply.entries == [("node-a", b'{"address": "h:1"}'), ("node-b", b"{}")]
