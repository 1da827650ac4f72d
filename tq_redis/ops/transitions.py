"""One typed wrapper per Lua transition: the KEYS/ARGV of each ``lua/<name>.lua`` and its reply.

(About 1,200 lines: 47 wrappers and their reply types, kept together so the shared reply
readers stay in one place.)

Every state change of the metadata plane is one script of the ``tq_redis`` function library, and
this module is the only place that builds their argument lists and reads their replies. For each
script, one function of the same name takes the partition's (or channel's) keys and Python values
and returns a :class:`Transition`: the ``FCall`` effect to yield and the reader that turns the reply
into a named result. Each script's header is its contract; each wrapper's docstring points at it.
So an ARGV change touches two files: the script and its wrapper here.

Operations (generators of effects, see :mod:`tq_redis.ops.effects`) run a transition alone::

    first_id = yield from transitions.reserve(pk, n, schemas).call()

or with other effects in one round trip (:func:`pipeline`, or by hand with ``t.effect`` in a
``Pipe`` and ``t.read(reply)`` afterwards)::

    _, added = yield from transitions.pipeline(transitions.insert(pk, first_id, n, schemas), Cmd(("ZADD", ...)))

Reply codes are decoded here, once. A code every caller answers with the same error raises it here
(a sealed partition on insert, a schema conflict, a missing partition or sample on a write); codes
that callers treat differently come back as fields of the result. The decoders shared by several
replies live here too: :func:`tag_rows` (per-sample tags) and :func:`schema_pairs` (field schemas).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, NoReturn, TypeVar

import numpy as np

from tq_redis.errors import (
    InvalidArgument,
    LibraryNotLoaded,
    PartitionClosed,
    PartitionSealed,
    RateLimited,
    SampleComplete,
    SampleNotFound,
    UnknownPartition,
)
from tq_redis.meta import bitmaps
from tq_redis.meta.keys import ChannelKeys, PartitionKeys, check_name, storage_nodes_key
from tq_redis.ops.effects import Cmd, FCall, Pipe, WaitThenCall, WaitToken
from tq_redis.ops.encoding import (
    clock_ms,
    encode_tag,
    id_ranges,
    schema_pairs,
    tag_rows,
    text,
)
from tq_redis.server.registry import Registry, decode_registry
from tq_redis.storage.manager import Placement

if TYPE_CHECKING:
    from tq_redis.ops.claim_plan import SamplerPlan

R = TypeVar("R")

NO_SCHEMAS: Mapping[str, str] = MappingProxyType({})
"""No field offered (a reserve or insert of samples without fields, a KV look-up)."""

STRICT_MARK = "!"
"""Prefix of a schema offered as strict: it must equal the registered one (lua/includes/schemas.lua)."""


class Transition(Generic[R]):
    """One call of a Lua transition: the effect to yield and how to read its reply."""

    __slots__ = ("effect", "read")

    def __init__(self, effect: FCall, read: Callable[[Any], R]) -> None:
        self.effect = effect
        self.read = read

    def __repr__(self) -> str:
        return f"Transition({self.effect!r})"

    def call(self) -> Generator[FCall, Any, R]:
        """Run it alone: ``result = yield from t.call()``."""
        return self.read((yield self.effect))

    def call_after(self, wait: WaitToken) -> Generator[WaitThenCall, Any, R]:
        """Run it the moment ``wait`` ends, in the wait's round trip where the driver can
        (:class:`~tq_redis.ops.effects.WaitThenCall`): ``result = yield from t.call_after(wait)``."""
        _, reply = yield WaitThenCall(wait, self.effect)
        return self.read(reply)


def pipeline(*calls: Transition[Any] | Cmd) -> Generator[Pipe, Any, list[Any]]:
    """Run transitions (and plain commands) in one round trip: each transition's reply is read
    (in order, so the first failing reader raises), each command's is returned as it came."""
    replies = yield Pipe(tuple(c.effect if isinstance(c, Transition) else c for c in calls))
    return [c.read(r) if isinstance(c, Transition) else r for c, r in zip(calls, replies)]


# ------------------------------------------------------------------ schemas and refusals


def _flat_schemas(schemas: Mapping[str, str], strict: bool) -> list[str]:
    """``field, schema`` pairs for a script; strict schemas carry a leading :data:`STRICT_MARK`."""
    mark = STRICT_MARK if strict else ""
    return [x for name, schema in schemas.items() for x in (name, mark + schema)]


def raise_schema_conflict(field: str, registered: Any, offered: str) -> NoReturn:
    """Raise the error of a field whose offered schema differs from the registered one."""
    from tq_redis.meta.schemas import check_compatible  # torch, imported only when a schema conflicts

    check_compatible(field, json.loads(text(registered)), json.loads(offered))
    # check_compatible raises for every real difference; equal JSON would not have conflicted
    raise InvalidArgument(f"field {field!r}: schema {offered} conflicts with registered {text(registered)}")


class InsertHeld(RateLimited):
    """A ``{-6, task, inserts, samples, timeout_ms}`` reply: a rate limiter held an insert back
    (nothing was written). The insert's caller waits for room and asks again
    (:func:`tq_redis.ops.ratelimit.admitted`); it is a :class:`RateLimited` only if it escapes."""

    @classmethod
    def from_reply(cls, partition: str, reply: Sequence[Any]) -> InsertHeld:
        task, inserts, samples = text(reply[0]), int(reply[1]), int(reply[2])
        limit = text(reply[3])
        timeout_s = int(limit) / 1000 if limit else None
        return cls(
            f"partition {partition!r}: task {task!r}'s rate limiter holds inserts back at {inserts} inserts and "
            f"{samples} samples; the task's consumers must sample more first",
            task, inserts, samples, timeout_s,
        )


def _conflict(reply: Sequence[Any], schemas: Mapping[str, str]) -> NoReturn:
    """A ``{0, field, registered}`` reply: the offered schema of ``field`` conflicts."""
    field = text(reply[1])
    offered = schemas.get(field)
    if offered is None:
        raise InvalidArgument(f"field {field!r} conflicts with its registered schema {text(reply[2])}")
    raise_schema_conflict(field, reply[2], offered)


def _sealed(partition: str) -> PartitionSealed:
    return PartitionSealed(
        f"partition {partition!r} is sealed: no more samples were promised; insert into a new partition"
    )


def _closed(partition: str) -> PartitionClosed:
    return PartitionClosed(
        f"partition {partition!r} was sealed and then cleared, so nothing may be put into it again "
        f"(a late writer would bring back data nobody clears); write to a new partition, or call "
        f"reopen_partition({partition!r}) first to create it again on purpose"
    )


def _missing_partition(partition: str) -> UnknownPartition:
    return UnknownPartition(f"partition {partition!r} does not exist (cleared, or never created)")


# ------------------------------------------------------------------ results


class ClaimReply(NamedTuple):
    """A batch handed to a task (``lua/claim.lua``, ``lua/claim_ids.lua``)."""

    last_event_id: str  # what to pass to `wait` when ids is empty
    ids: list[int]  # the batch; empty when not enough was ready
    schemas: dict[str, str]  # field -> schema JSON of the required fields
    tags: list[dict[str, Any]] | None  # per id; None when no id or no tag
    deliveries: list[int]  # delivery count per id (lease mode), else empty
    next_lapse_ms: int  # ms until the task's earliest lease lapses (server clock), -1 if none
    registered: bool  # the waiter was registered: BLPOP the task's wake list next
    inline: bool | None = None  # with ids: whether the partition keeps values inline (None: not said)
    values: dict[str, list[bytes | None]] | None = None  # with_values: field -> inline value per id (None: in a store)


class ClaimIdsReply(NamedTuple):
    """``lua/claim_ids.lua``: the claimed batch, or which chosen ids were taken meanwhile."""

    claimed: ClaimReply | None  # None: nothing was marked
    taken: list[int]  # chosen ids no longer free (when claimed is None)
    partition_missing: bool
    held_back: bool = False  # the task's rate limiter held the claim back (nothing marked)


class ReadySet(NamedTuple):
    """``lua/ready_ids.lua``: every sample ready for a task."""

    last_event_id: str
    ids: list[int]  # ascending
    next_lapse_ms: int  # ms until the task's earliest lease lapses (server clock), -1 if none


def _read_placement(fields: Sequence[str], reply: Sequence[Any]) -> Placement:
    flat = reply[0]
    rings: list[str] = [""] * (len(flat) // 2)
    for ring, index in zip(flat[::2], flat[1::2]):
        rings[int(index)] = text(ring)
    index = {f: None if raw is None else np.frombuffer(raw, "<u2") for f, raw in zip(fields, reply[1:])}
    return Placement(rings, index)


class Visibility(NamedTuple):
    """``lua/check_visible.lua``: which ids were not alive, or which lack a field."""

    not_alive: list[int]
    field: str | None  # the first field not produced for some alive id
    not_produced: list[int]  # the ids lacking ``field``
    placement: Placement | None = None  # where the values were put, when asked for

    @property
    def ok(self) -> bool:
        return not self.not_alive and self.field is None


class Settled(NamedTuple):
    """``lua/settle.lua``."""

    count: int  # samples settled
    not_held: list[int]  # ids whose lease this caller no longer held


class Cleared(NamedTuple):
    """``lua/clear.lua``: ids that were alive, the partition's fields, the trash's earlier size,
    the rings the partition's store values were put under, and the carriers of group-shared
    values the clear freed (their bytes go like the cleared ids', see ``lua/includes/shares.lua``)."""

    ids: list[int]
    fields: list[str]
    older: int
    rings: list[str] = []
    freed: list[int] = []

    @property
    def doomed(self) -> list[int]:
        """Every id whose store bytes are to be deleted now: the cleared samples and freed carriers."""
        return self.ids + self.freed if self.freed else self.ids


class Dropped(NamedTuple):
    """``lua/drop_partition.lua``: the alive bitmap as it was, the fields, the trash's earlier
    size, and whether the samples may have bytes in the store (False: every value was inline)."""

    alive: bytes | None
    fields: list[str]
    older: int
    in_store: bool
    rings: list[str] = []  # the rings its store values were put under

    def alive_ids(self) -> list[int]:
        return bitmaps.set_ids(self.alive)


@dataclass(frozen=True)
class Progress:
    """What is left of a partition for one task (``lua/progress.lua``)."""

    last_event_id: str
    exists: bool
    sealed: bool
    alive: int
    pending: int
    ready: int

    @property
    def drained(self) -> bool:
        """Sealed, and the task has consumed every sample for good."""
        return self.sealed and self.pending == 0

    @property
    def settled(self) -> bool:
        """Sealed, and every sample still pending is ready: nothing more can arrive."""
        return self.sealed and self.pending == self.ready


class KeyResolution(NamedTuple):
    """``lua/kv_resolve.lua``: user keys mapped to sample ids."""

    ids: list[int]  # per key; -1 where unknown (look-up only)
    created: int  # keys that got a fresh id
    schemas: dict[str, str]  # fields produced for every key with an id, in registration order
    tags: list[dict[str, Any]]  # per key


class KeyListing(NamedTuple):
    """``lua/kv_list.lua``: a page of the live user keys of a partition."""

    cursor: str  # where the next page starts; "0": this was the last
    keys: list[str]
    ids: list[int]
    tags: list[dict[str, Any]]


class ChannelPut(NamedTuple):
    """``lua/channel_put.lua``."""

    appended: bool
    missing: bool  # the channel does not exist
    qsize: int  # after the append
    last_gets_id: str  # when full: XREAD the `gets` stream from here


class ChannelPop(NamedTuple):
    """``lua/channel_pop.lua``."""

    popped: bool
    missing: bool  # the channel does not exist
    entries: list[bytes]  # oldest first
    last_puts_id: str  # when not enough is queued: XREAD the `puts` stream from here


# ------------------------------------------------------------------ samples: insert and write


def _read_insert(partition: str, schemas: Mapping[str, str], reply: Sequence[Any]) -> None:
    """``{1, ...}`` done, ``{0, field, registered}`` a schema conflict, ``{-3}`` sealed, ``{-4}``
    sealed and cleared, ``{-6, ...}`` held back by a rate limiter (:class:`InsertHeld`)."""
    code = int(reply[0])
    if code == -3:
        raise _sealed(partition)
    if code == -4:
        raise _closed(partition)
    if code == -6:
        raise InsertHeld.from_reply(partition, reply[1:])
    if code == 0:
        _conflict(reply, schemas)


def _read_reserve(partition: str, schemas: Mapping[str, str], reply: Sequence[Any]) -> int:
    _read_insert(partition, schemas, reply)
    return int(reply[1])


def reserve(
    pk: PartitionKeys, count: int, schemas: Mapping[str, str] = NO_SCHEMAS, strict: bool = False, *,
    waiter: str = "", wait_ms: int = 0,
) -> Transition[int]:  # fmt: skip
    """``lua/reserve.lua``: allocate ``count`` new ids (the first one is the result) after checking
    the offered ``{field: canonical schema JSON}``. Raises ``PartitionSealed`` (``PartitionClosed``
    once sealed and cleared), the conflict, or :class:`InsertHeld` (a rate limiter refused; with a
    ``waiter`` it is registered for ``wait_ms`` to be woken on ``<p>:admitwake``)."""
    args = (count, waiter, wait_ms, *_flat_schemas(schemas, strict))
    return Transition(FCall("reserve", (pk.meta,), args), partial(_read_reserve, pk.partition, schemas))


def insert(
    pk: PartitionKeys, first_id: int | None, count: int, schemas: Mapping[str, str] = NO_SCHEMAS,
    strict: bool = False, *, values: Sequence[bytes] = (), now_ms: int | None = None, ring: str | None = None,
    waiter: str = "", wait_ms: int = 0,
) -> Transition[int]:  # fmt: skip
    """``lua/insert.lua``: make ``count`` new samples alive with the fields of ``schemas`` produced;
    the first id is the result. Either ids ``first_id..`` from ``reserve`` whose bytes are stored
    already (under the store's ``ring``, if it places keys itself), or (``first_id`` None) small
    ``values`` (``count`` per field, field-major) stored inline with the bits while the ids are
    allocated, in one step. Raises ``PartitionSealed``, ``PartitionClosed``, the schema conflict or
    (inline) :class:`InsertHeld`, with ``waiter`` as :func:`reserve`'s."""
    start = "" if first_id is None else first_id
    args = (
        start, count, clock_ms(now_ms), ring or "", waiter, wait_ms, len(schemas), *_flat_schemas(schemas, strict),
        *values,
    )  # fmt: skip
    return Transition(FCall("insert", (pk.meta,), args), partial(_read_reserve, pk.partition, schemas))


def _read_write(partition: str, schemas: Mapping[str, str], reply: Sequence[Any]) -> None:
    """``{1}`` written, ``{-1}`` no partition, ``{-2, id...}`` ids not alive, ``{0, field, reg}``."""
    code = int(reply[0])
    if code == -1:
        raise _missing_partition(partition)
    if code == -2:
        raise SampleNotFound(f"samples {[int(x) for x in reply[1:11]]} of partition {partition!r} were cleared")
    if code == 0:
        _conflict(reply, schemas)


def _read_produce(partition: str, schemas: Mapping[str, str], reply: Sequence[Any]) -> list[int]:
    _read_write(partition, schemas, reply)
    return [int(i) for i in reply[1:]]


def produce(
    pk: PartitionKeys, ids: Sequence[int], schemas: Mapping[str, str], strict: bool = False,
    inline_values: Sequence[bytes] = (), ring: str | None = None,
) -> Transition[list[int]]:  # fmt: skip
    """``lua/produce.lua``: mark fields of existing samples produced: their bytes are stored (under
    the store's ``ring``, if it places keys itself), or come here as ``inline_values`` (``len(ids)``
    per field of ``schemas``, field-major). Raises ``UnknownPartition``, ``SampleNotFound`` or the
    schema conflict. The result: carriers of group-shared values the rewrite freed (their store
    bytes are in the partition's trash now, for the caller to delete; usually none)."""
    args = (ring or "", len(schemas), *_flat_schemas(schemas, strict), len(ids), *ids, *inline_values)
    return Transition(FCall("produce", (pk.meta,), args), partial(_read_produce, pk.partition, schemas))


def _read_share_begin(partition: str, schemas: Mapping[str, str], reply: Sequence[Any]) -> int:
    _read_write(partition, schemas, reply)
    return int(reply[1])


def share_begin(pk: PartitionKeys, schemas: Mapping[str, str], strict: bool = False) -> Transition[int]:
    """``lua/share_begin.lua``: the carrier id of a group-shared value about to be stored (marked
    pending until :func:`share_put` links it). Raises ``UnknownPartition`` or the schema conflict."""
    return Transition(
        FCall("share_begin", (pk.meta,), tuple(_flat_schemas(schemas, strict))),
        partial(_read_share_begin, pk.partition, schemas),
    )


def _read_share_put(partition: str, schemas: Mapping[str, str], reply: Sequence[Any]) -> int:
    if int(reply[0]) == -5:
        field, ids = text(reply[1]), [int(i) for i in reply[2:12]]
        raise InvalidArgument(
            f"field {field!r} is produced already for samples {ids} of partition {partition!r}: a shared "
            f"field is put once per group, before any member has it (put it per sample with put() instead)"
        )
    _read_write(partition, schemas, reply)
    return int(reply[1])


def share_put(
    pk: PartitionKeys, members: Sequence[int], schemas: Mapping[str, str], strict: bool = False, *,
    carrier: int | None = None, ring: str | None = None, inline_values: Sequence[bytes] = (),
) -> Transition[int]:  # fmt: skip
    """``lua/share_put.lua``: make one value per field of ``schemas`` the value of every member:
    stored under ``carrier`` (from :func:`share_begin`, under the store's ``ring``) or, with
    ``carrier`` None, the ``inline_values`` (one per field) stored with the bits. The result is the
    carrier id. Raises ``UnknownPartition``, ``SampleNotFound``, the schema conflict, or
    ``InvalidArgument`` for a member that has the field already."""
    args = ("" if carrier is None else carrier, ring or "", id_ranges(members), len(schemas),
            *_flat_schemas(schemas, strict), *inline_values)  # fmt: skip
    return Transition(FCall("share_put", (pk.meta,), args), partial(_read_share_put, pk.partition, schemas))


def set_tags(
    pk: PartitionKeys,
    ids: Sequence[int],
    names: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    *,
    notify: bool = True,
) -> Transition[None]:
    """``lua/set_tags.lua``: write tag ``names`` of samples ``ids`` from ``rows`` (one dict per id;
    a name missing from a row leaves that sample's tag unchanged) and, with ``notify``, note the
    change for ``kv_watch`` (no names and ``notify``: only note it). Raises ``UnknownPartition`` or
    ``SampleNotFound``, ``InvalidArgument`` for a bad name, ``UnsupportedValue`` for a non-JSON value."""
    args: list[Any] = ["1" if notify else "0", len(ids), *ids]
    for name in names:
        check_name("custom meta key", name)
        args.append(name)
        args.extend(encode_tag(row[name]) if name in row else "" for row in rows)
    return Transition(FCall("set_tags", (pk.meta,), tuple(args)), partial(_read_write, pk.partition, NO_SCHEMAS))


def _read_visible(reply: Sequence[Any], fields: Sequence[str] = ()) -> Visibility:
    code = int(reply[0])
    if code == -1:
        return Visibility([int(i) for i in reply[1:]], None, [])
    if code == -2:
        return Visibility([], text(reply[1]), [int(i) for i in reply[2:]])
    placement = _read_placement(fields, reply[1]) if len(reply) > 1 else None
    return Visibility([], None, [], placement)


def check_visible(
    pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str] = (), *, placement: bool = False
) -> Transition[Visibility]:
    """``lua/check_visible.lua``: whether ``ids`` are alive and have every one of ``fields``; with
    ``placement``, also where their store values were put (``Visibility.placement``, for ids in
    ascending order)."""
    args = (id_ranges(ids), "1" if placement else "", *fields)
    return Transition(FCall("check_visible", (pk.meta,), args), partial(_read_visible, fields=list(fields)))


class InlineRead(NamedTuple):
    """``lua/read_inline.lua``: the visibility check and, when it passed, the inline values."""

    visibility: Visibility
    values: dict[str, dict[int, bytes]]  # field -> {id: value} of the values kept inline
    # group-shared values kept in a store: field -> {member id: carrier id}, and where the
    # carriers' values were put (for the carriers in ascending order); empty / None when none
    shared: dict[str, dict[int, int]] = {}
    carriers: list[int] = []
    placement: Placement | None = None


def _read_inline(ids: Sequence[int], fields: Sequence[str], reply: Sequence[Any]) -> InlineRead:
    if int(reply[0]) != 0:
        return InlineRead(_read_visible(reply), {})
    flat = reply[1]
    order = sorted(set(ids))
    n = len(order)
    values: dict[str, dict[int, bytes]] = {}
    if flat:
        for k, name in enumerate(fields):
            column = flat[k * n : (k + 1) * n]
            values[name] = {i: v for i, v in zip(order, column, strict=True) if v is not None}
    if len(reply) < 5:
        return InlineRead(Visibility([], None, []), values)
    refs, carriers, where = reply[2], [int(c) for c in reply[3]], reply[4]
    shared: dict[str, dict[int, int]] = {}
    for k, name in enumerate(fields):
        column = refs[k * n : (k + 1) * n]
        found = {i: int(c) for i, c in zip(order, column, strict=True) if c}
        if found:
            shared[name] = found
    return InlineRead(Visibility([], None, []), values, shared, carriers, _read_placement(fields, where))


def read_inline(pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str]) -> Transition[InlineRead]:
    """``lua/read_inline.lua``: check that ``ids`` are alive with every one of ``fields`` and return
    the values of theirs kept inline (one round trip for small values)."""
    args = (id_ranges(ids), *fields)
    return Transition(FCall("read_inline", (pk.meta,), args), partial(_read_inline, list(ids), list(fields)))


# ------------------------------------------------------------------ parts (partial rollout)


class PartSpec(NamedTuple):
    """One field of an append: its name, the schema JSON of its parts and of the field itself."""

    name: str
    part_schema: str
    field_schema: str


class PartsRead(NamedTuple):
    """``lua/part_read.lua``: the visibility check and, when it passed, per id (in the order asked)
    its parts ``[(policy_version, length, k), ...]`` and their inline values (None: in the store)."""

    visibility: Visibility
    parts: list[list[tuple[int, int, int]]]
    values: list[list[bytes | None]]


def _flat_parts(fields: Sequence[PartSpec]) -> list[Any]:
    return [len(fields), *(x for f in fields for x in f)]


def _read_parts_write(partition: str, reply: Sequence[Any]) -> list[int]:
    """``{1, k...}`` ok, ``{-1}`` no partition, ``{-2, id...}`` gone, ``{-3, field, id...}`` complete,
    ``{-4, field}`` not an appended field."""
    code = int(reply[0])
    if code == -1:
        raise _missing_partition(partition)
    if code == -2:
        raise SampleNotFound(f"samples {[int(x) for x in reply[1:11]]} of partition {partition!r} were cleared")
    if code == -3:
        field, ids = text(reply[1]), [int(x) for x in reply[2:]]
        raise SampleComplete(
            f"field {field!r} is already complete for samples {ids[:10]} of partition {partition!r}; "
            f"append only to samples in progress",
            field, ids,
        )  # fmt: skip
    if code == -4:
        raise InvalidArgument(
            f"field {text(reply[1])!r} of partition {partition!r} was never appended to: only a field written "
            f"with append_parts is marked complete (put writes a whole field)"
        )
    return [int(x) for x in reply[1:]]


def part_alloc(pk: PartitionKeys, ids: Sequence[int], fields: Sequence[PartSpec]) -> Transition[list[int]]:
    """``lua/part_alloc.lua``: the next part index of each id for each field (field-major),
    registered before the bytes are stored. Raises ``UnknownPartition``, ``SampleNotFound``,
    ``SampleComplete``."""
    args = (*_flat_parts(fields), len(ids), *ids)
    return Transition(FCall("part_alloc", (pk.meta,), args), partial(_read_parts_write, pk.partition))


def part_append(
    pk: PartitionKeys, ids: Sequence[int], fields: Sequence[PartSpec], lengths: Sequence[int], version: int,
    *, inline_values: Sequence[bytes] = (), indexes: Sequence[int] = (), ring: str | None = None,
    complete: Sequence[str] = (),
) -> Transition[list[int]]:  # fmt: skip
    """``lua/part_append.lua``: record one part per id and field of ``fields`` (``lengths``,
    field-major) at policy ``version``, its values ``inline_values`` or stored under the
    ``indexes`` :func:`part_alloc` gave; then mark the ``complete`` fields complete. Raises
    ``UnknownPartition``, ``SampleNotFound``, ``SampleComplete``."""
    args: list[Any] = [ring or "", version, len(complete), *complete, *_flat_parts(fields), len(ids), *ids, *lengths]
    if fields:
        args += ["v", *inline_values] if not indexes else ["k", *indexes]
    return Transition(FCall("part_append", (pk.meta,), tuple(args)), partial(_read_parts_write, pk.partition))


def _read_parts(ids: Sequence[int], reply: Sequence[Any]) -> PartsRead:
    if int(reply[0]) != 0:
        return PartsRead(_read_visible(reply), [], [])
    order = sorted(set(ids))
    flat_values = list(reply[2])
    at = 0
    by_id: dict[int, tuple[list[tuple[int, int, int]], list[bytes | None]]] = {}
    for i, raw in zip(order, reply[1]):
        parts = [(int(v), int(n), int(k)) for v, n, k in json.loads(text(raw))] if raw else []
        values = [flat_values[at + j] if at + j < len(flat_values) and flat_values[at + j] else None
                  for j in range(len(parts))]  # fmt: skip
        at += len(parts)
        by_id[i] = (parts, values)
    return PartsRead(Visibility([], None, []), [by_id[i][0] for i in ids], [by_id[i][1] for i in ids])


def part_read(pk: PartitionKeys, ids: Sequence[int], field: str) -> Transition[PartsRead]:
    """``lua/part_read.lua``: check that ``ids`` are alive with ``field`` complete, and return
    their parts and the parts' inline values."""
    args = (id_ranges(ids), field)
    return Transition(FCall("part_read", (pk.meta,), args), partial(_read_parts, list(ids)))


# ------------------------------------------------------------------ claims


def _claim_reply(
    last_id: Any, ids: list, schemas: list, tags: list, deliveries: list, next_lapse: Any, registered: bool,
    inline: bool | None = None,
) -> ClaimReply:  # fmt: skip
    tag_list = tag_rows(tags, len(ids)) if tags and ids else None
    return ClaimReply(
        text(last_id), [int(i) for i in ids], schema_pairs(schemas), tag_list, [int(d) for d in deliveries],
        int(next_lapse), registered, inline,
    )  # fmt: skip


def _read_claim(reply: Sequence[Any], fields: Sequence[str] = ()) -> ClaimReply:
    last_id, ids, schemas, tags, deliveries, next_lapse, *rest = reply
    inline = bool(int(rest[1])) if len(rest) > 1 else None
    got = _claim_reply(last_id, ids, schemas, tags, deliveries, next_lapse, bool(rest and int(rest[0])), inline)
    if len(rest) > 2 and got.ids and rest[2] is not None:  # None: shared fields, read by get_data
        got = got._replace(values=_claimed_values(rest[2], len(got.ids), fields))
    return got


def _claimed_values(flat: Sequence[Any], n: int, fields: Sequence[str]) -> dict[str, list[bytes | None]]:
    """The claim's inline values (field-major over its ``n`` ids) per field; all None when the
    partition keeps nothing inline (the script then sends none)."""
    if not flat:
        return {f: [None] * n for f in fields}
    if len(flat) != n * len(fields):
        raise LibraryNotLoaded(
            f"the claim script returned {len(flat)} inline values for {n} ids x {len(fields)} fields: the "
            f"server runs another tq-redis library than this client's; run `tq-redis load-library --redis URL`"
        )
    return {f: [v if v else None for v in flat[k * n:(k + 1) * n]] for k, f in enumerate(fields)}


def claim(
    pk: PartitionKeys, task: str, plan: SamplerPlan, fields: Sequence[str], *, lease_ms: int = 0,
    max_deliveries: int = 0, waiter: str | None = None, wait_ms: int = 0, with_values: bool = False,
) -> Transition[ClaimReply]:  # fmt: skip
    """``lua/claim.lua``: a batch chosen by the built-in sampler ``plan`` from the samples with
    every one of ``fields`` that ``task`` has not consumed. With ``waiter``, a claim that hands
    out nothing registers it as waiting ``wait_ms`` (else removes it from the task's waiters).
    A lease runs ``lease_ms`` from the server's time when the script runs (no client clock).
    ``with_values``: the reply also holds the batch's inline values of ``fields``
    (:attr:`ClaimReply.values`), read in the same atomic step."""
    waiting = (waiter, wait_ms) if waiter else ()
    sampler = plan.args()
    if with_values:
        kind, nopts, *options = sampler
        sampler = (kind, nopts + 1, *options, "_values", "1")
    args = (
        task, plan.batch_size, lease_ms, max_deliveries, *sampler, len(fields), *fields, *waiting,
    )  # fmt: skip
    read = partial(_read_claim, fields=list(fields)) if with_values else _read_claim
    return Transition(FCall("claim", (pk.meta,), args), read)


def _read_claim_ids(reply: Sequence[Any]) -> ClaimIdsReply:
    code = int(reply[0])
    if code == 1:
        return ClaimIdsReply(_claim_reply(*reply[1:7], False), [], False)
    if code == -1:
        return ClaimIdsReply(None, [], True)
    if code == -2:
        return ClaimIdsReply(None, [], False, held_back=True)
    return ClaimIdsReply(None, [int(i) for i in reply[1:]], False)


def claim_ids(
    pk: PartitionKeys, task: str, sampled: Sequence[int], consumed: Sequence[int], fields: Sequence[str], *,
    lease_ms: int = 0,
) -> Transition[ClaimIdsReply]:  # fmt: skip
    """``lua/claim_ids.lua``: hand out ``sampled`` and mark ``consumed`` (leased with ``lease_ms``)
    only if every one of them is still free for ``task``."""
    args = (
        task, lease_ms, len(sampled), *sampled, len(consumed), *consumed,
        len(fields), *fields,
    )  # fmt: skip
    return Transition(FCall("claim_ids", (pk.meta,), args), _read_claim_ids)


def _read_ready(reply: Sequence[Any]) -> ReadySet:
    last_id, bitmap, next_lapse = reply
    return ReadySet(text(last_id), bitmaps.set_ids(bitmap), int(next_lapse))


def ready_ids(
    pk: PartitionKeys, task: str, fields: Sequence[str], *, max_deliveries: int = 0
) -> Transition[ReadySet]:
    """``lua/ready_ids.lua``: every sample ready for ``task`` (for a sampler running in Python)."""
    args = (task, max_deliveries, len(fields), *fields)
    return Transition(FCall("ready_ids", (pk.meta,), args), _read_ready)


def _read_flag(reply: Any) -> bool:
    return int(reply) == 1


def wait(pk: PartitionKeys, task: str, waiter: str, timeout_ms: int, last_event_id: str) -> Transition[bool]:
    """``lua/wait.lua``: register ``waiter`` unless an event came after ``last_event_id``; True
    when registered (BLPOP the task's wake list next), False: claim again at once."""
    return Transition(FCall("wait", (pk.meta,), (task, waiter, timeout_ms, last_event_id)), _read_flag)


def _read_settle(reply: Sequence[Any]) -> Settled:
    return Settled(int(reply[0]), [int(x) for x in reply[1:]])


def settle(
    pk: PartitionKeys, task: str, action: str, ids: Sequence[int], fences: Sequence[int], lease_ms: int = 1
) -> Transition[Settled]:
    """``lua/settle.lua``: ``action`` ('ack', 'nack' or 'extend' by ``lease_ms`` from the server's
    time) the leases of ``ids``, each only if still held with its delivery count in ``fences`` (0: any)."""
    pairs = [x for pair in zip(ids, fences) for x in pair]
    args = (task, action, lease_ms, *pairs)
    return Transition(FCall("settle", (pk.meta,), args), _read_settle)


def unclaim(pk: PartitionKeys, task: str, ids: Sequence[int], fences: Sequence[int]) -> Transition[int]:
    """``lua/unclaim.lua``: hand back ``ids`` a claim of ``task`` just took (``fences``: the delivery
    count each was leased with, 0 without a lease), as if the claim had not been made; the result is
    how many went back."""
    pairs = [x for pair in zip(ids, fences) for x in pair]
    return Transition(FCall("unclaim", (pk.meta,), (task, *pairs)), int)


class Marked(NamedTuple):
    """``lua/mark_consumed.lua``: the ids were marked consumed, or which were not ready."""

    marked: int  # ids the task had not consumed before (those its rate limiter counted)
    not_ready: list[int]  # ids not alive or lacking a required field (nothing was marked)
    partition_missing: bool = False

    @property
    def ok(self) -> bool:
        """Every id is consumed by the task now."""
        return not self.not_ready and not self.partition_missing


def _read_marked(reply: Sequence[Any]) -> Marked:
    code = int(reply[0])
    if code == 1:
        return Marked(int(reply[1]), [])
    if code == -1:
        return Marked(0, [], True)
    return Marked(0, [int(i) for i in reply[1:]])


def mark_consumed(pk: PartitionKeys, task: str, ids: Sequence[int], fields: Sequence[str] = ()) -> Transition[Marked]:
    """``lua/mark_consumed.lua``: mark ``ids`` (named, repeats allowed, consumed already or not)
    consumed by ``task`` if every one is alive with every one of ``fields``; the newly marked count
    as sampled by the task's rate limiter (a read by index of the dock)."""
    return Transition(FCall("mark_consumed", (pk.meta,), (task, len(ids), *ids, len(fields), *fields)), _read_marked)


def unproduce(pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str]) -> Transition[None]:
    """``lua/unproduce.lua``: mark ``fields`` of ``ids`` unwritten again (their next put makes them
    visible; the dock's rollout claim). Raises ``UnknownPartition`` or ``SampleNotFound``."""
    return Transition(
        FCall("unproduce", (pk.meta,), (id_ranges(ids), *fields)), partial(_read_write, pk.partition, NO_SCHEMAS)
    )


# ------------------------------------------------------------------ the dock's partial rollout


class DockFinished(NamedTuple):
    """``lua/dock_finish.lua``: rows newly marked consumed by the rollout task, and rows handed back."""

    marked: int
    released: int


def _read_dock_finish(reply: Sequence[Any]) -> DockFinished:
    return DockFinished(int(reply[0]), int(reply[1]))


def dock_finish(
    pk: PartitionKeys, task: str, rows: Sequence[int], finished: Sequence[bool]
) -> Transition[DockFinished]:
    """``lua/dock_finish.lua``: record which dock ``rows`` finished their rollout and hand the
    unfinished ones back to ``task`` (the one continuing rollouts)."""
    args = (task, *(x for row, done in zip(rows, finished, strict=True) for x in (row, "1" if done else "0")))
    return Transition(FCall("dock_finish", (pk.meta,), args), _read_dock_finish)


def dock_ready(pk: PartitionKeys, n_per_prompt: int, rows: int) -> Transition[int]:
    """``lua/dock_ready.lua``: refresh the dock's ready mask (rows of prompts whose rollouts all
    finished); the result is the number of such prompts."""
    return Transition(FCall("dock_ready", (pk.meta,), (n_per_prompt, rows)), int)


def _flags(values: Sequence[int]) -> str:
    return "".join("1" if v else "0" for v in values)


def dock_resort(
    pk: PartitionKeys, n_per_prompt: int, order: Sequence[int], finished: Sequence[int], ready: Sequence[int],
    ages: Sequence[int],
) -> Transition[int]:  # fmt: skip
    """``lua/dock_resort.lua``: row ``r`` of the dock takes the sample of row ``order[r]`` (its key,
    ``dock_index`` and ``uid`` tags, noted for ``kv_watch``), and the finished / ready bitmaps and
    ages become ``finished``, ``ready`` and ``ages`` (one per row, in the new order); the result is
    how many samples moved."""
    rows = len(order)
    if not len(finished) == len(ready) == len(ages) == rows:
        raise InvalidArgument(f"dock_resort: {rows} rows but {len(finished)}, {len(ready)}, {len(ages)} values")
    args = (n_per_prompt, rows, _flags(finished), _flags(ready), *(int(r) for r in order), *(int(a) for a in ages))
    return Transition(FCall("dock_resort", (pk.meta,), args), int)


def _read_shape(reply: Sequence[Any]) -> tuple[int, int]:
    return int(reply[0]), int(reply[1])


def dock_shape(pk: PartitionKeys, prompts_num: int, n_per_prompt: int) -> Transition[tuple[int, int]]:
    """``lua/dock_shape.lua``: register the dock's shape unless it has one; the result is the
    shape it has, ``(prompts_num, n_samples_per_prompt)``."""
    return Transition(FCall("dock_shape", (pk.meta,), (prompts_num, n_per_prompt)), _read_shape)


def _read_cursor(reply: Any) -> int | None:
    first = int(reply)
    return None if first < 0 else first


def dock_cursor(pk: PartitionKeys, cursor: str, count: int, end: int | None = None) -> Transition[int | None]:
    """``lua/dock_cursor.lua``: take ``count`` positions of the dock's ``cursor`` (``"rows"``: the
    next free row; ``"requests"``: MindSpeed's request index); the result is the first, or None
    when the cursor is at or past ``end`` (it does not move then)."""
    if cursor not in ("rows", "requests"):
        raise InvalidArgument(f"dock_cursor: cursor must be 'rows' or 'requests', got {cursor!r}")
    args = (cursor, count, "" if end is None else end)
    return Transition(FCall("dock_cursor", (pk.meta,), args), _read_cursor)


def dock_metric(pk: PartitionKeys, entry: str | bytes) -> Transition[int]:
    """``lua/dock_metric.lua``: append one encoded ``update_metrics`` call to the dock's log; the
    result is the log's length."""
    return Transition(FCall("dock_metric", (pk.meta,), (entry,)), int)


def dock_reset(pk: PartitionKeys) -> Transition[int]:
    """``lua/dock_reset.lua``: the dock's request cursor and metric log go (a clear starts the next step)."""
    return Transition(FCall("dock_reset", (pk.meta,), ()), int)


# ------------------------------------------------------------------ clearing and the trash


def _read_clear(reply: Sequence[Any]) -> Cleared:
    cleared, fields, older, rings, *freed = reply
    return Cleared(
        [int(i) for i in cleared], [text(f) for f in fields], int(older), [text(r) for r in rings],
        [int(i) for i in freed[0]] if freed else [],
    )  # fmt: skip


def clear(pk: PartitionKeys, ids: Sequence[int]) -> Transition[Cleared]:
    """``lua/clear.lua``: remove samples (bits first); their ids move to the trash."""
    return Transition(FCall("clear", (pk.meta,), tuple(ids)), _read_clear)


def _read_drop(reply: Sequence[Any]) -> Dropped:
    alive, fields, older, in_store, rings = reply
    return Dropped(alive or None, [text(f) for f in fields], int(older), bool(int(in_store)), [text(r) for r in rings])


def drop_partition(pk: PartitionKeys, *, now_ms: int | None = None) -> Transition[Dropped]:
    """``lua/drop_partition.lua``: delete the partition's metadata; alive samples go to the trash;
    a sealed partition stays closed (``PartitionClosed`` for later puts)."""
    return Transition(FCall("drop_partition", (pk.meta,), (clock_ms(now_ms),)), _read_drop)


def trash_add(pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str], ring: str | None = None) -> Transition[int]:
    """``lua/trash_add.lua``: record samples whose bytes (of ``fields``, put under the store's
    ``ring`` if it places keys itself) must be deleted; the result is how many ids the trash holds now."""
    return Transition(FCall("trash_add", (pk.meta,), (id_ranges(ids), ring or "", *fields)), int)


def trash_done(pk: PartitionKeys, ids: Sequence[int]) -> Transition[int]:
    """``lua/trash_done.lua``: the bytes of ``ids`` are deleted; the result is what is left."""
    return Transition(FCall("trash_done", (pk.meta,), (id_ranges(ids),)), int)


# ------------------------------------------------------------------ consumption and streaming


def reset_consumption(pk: PartitionKeys, task: str | None = None) -> Transition[bool]:
    """``lua/reset_consumption.lua``: ``task`` (None: every task) consumes from scratch; False
    when the partition does not exist."""
    return Transition(FCall("reset_consumption", (pk.meta,), (task or "",)), bool)


def seal_partition(pk: PartitionKeys, *, now_ms: int | None = None) -> Transition[bool]:
    """``lua/seal_partition.lua``: no more inserts; True if this call sealed it."""
    return Transition(FCall("seal_partition", (pk.meta,), (clock_ms(now_ms),)), bool)


def _read_progress(reply: Sequence[Any]) -> Progress:
    last, exists, sealed, alive, pending, ready = reply
    return Progress(text(last), bool(exists), bool(sealed), int(alive), int(pending), int(ready))


def progress(pk: PartitionKeys, task: str, fields: Sequence[str] = ()) -> Transition[Progress]:
    """``lua/progress.lua``: what is left of the partition for ``task`` reading ``fields``."""
    return Transition(FCall("progress", (pk.meta,), (task, len(fields), *fields)), _read_progress)


# ------------------------------------------------------------------ the KV API


def _read_resolve(partition: str, schemas: Mapping[str, str], reply: Sequence[Any]) -> KeyResolution | None:
    code = int(reply[0])
    if code == -1:
        return None
    if code == -4:
        raise _closed(partition)
    if code == -6:
        raise InsertHeld.from_reply(partition, reply[1:])
    if code == 0:
        _conflict(reply, schemas)
    _, ids, created, common, tags = reply
    return KeyResolution([int(i) for i in ids], int(created), schema_pairs(common), tag_rows(tags, len(ids)))


def kv_resolve(
    pk: PartitionKeys, keys: Sequence[str], create: bool, schemas: Mapping[str, str] = NO_SCHEMAS,
    strict: bool = False, *, now_ms: int | None = None, waiter: str = "", wait_ms: int = 0,
) -> Transition[KeyResolution | None]:  # fmt: skip
    """``lua/kv_resolve.lua``: the sample id of each user key, fresh ids for unknown keys with
    ``create`` (after checking ``schemas``); None when the partition does not exist (look-up
    only). Raises the schema conflict, ``PartitionClosed`` (creating in a sealed, cleared one) or
    :class:`InsertHeld`, with ``waiter`` as :func:`reserve`'s."""
    args = (
        1 if create else 0, clock_ms(now_ms), waiter, wait_ms, len(keys), *keys, *_flat_schemas(schemas, strict),
    )  # fmt: skip
    return Transition(FCall("kv_resolve", (pk.meta,), args), partial(_read_resolve, pk.partition, schemas))


def kv_unmap(pk: PartitionKeys, pairs: Sequence[tuple[str, int]]) -> Transition[int]:
    """``lua/kv_unmap.lua``: forget each ``(key, id)`` still mapped so; how many were removed."""
    return Transition(FCall("kv_unmap", (pk.meta,), tuple(x for pair in pairs for x in pair)), int)


def _read_kv_list(reply: Sequence[Any]) -> KeyListing:
    cursor, keys, ids, tags = reply
    return KeyListing(text(cursor), [text(k) for k in keys], [int(i) for i in ids], tag_rows(tags, len(ids)))


def kv_list(
    pk: PartitionKeys, cursor: str = "0", count: int = 256, where: Sequence[tuple[str, str]] = ()
) -> Transition[KeyListing]:
    """``lua/kv_list.lua``: a page of about ``count`` live user keys of the partition from
    ``cursor`` (none if it does not exist); with ``where`` (tag name, JSON text pairs), only the
    keys whose tags have exactly those values."""
    args = (cursor, count, *(x for pair in where for x in pair))
    return Transition(FCall("kv_list", (pk.meta,), args), _read_kv_list)


class TagChangesReply(NamedTuple):
    """``lua/tag_changes.lua``: changed samples after a cursor of the tag-change stream."""

    expired: bool  # the cursor's successors were trimmed, or the partition dropped: list again
    cursor: str  # the last entry read (expired: the newest entry now)
    keys: list[str | None]  # per id; None for a sample put without a user key
    ids: list[int]
    tags: list[dict[str, Any]]
    more: bool  # entries may follow at once (the budget was reached)


def _read_tag_changes(reply: Sequence[Any]) -> TagChangesReply:
    if int(reply[0]) == -1:
        return TagChangesReply(True, text(reply[1]), [], [], [], False)
    _, cursor, keys, ids, tags, more = reply
    return TagChangesReply(
        False,
        text(cursor),
        [None if k is None else text(k) for k in keys],
        [int(i) for i in ids],
        tag_rows(tags, len(ids)),
        bool(int(more)),
    )


def tag_changes(
    pk: PartitionKeys, cursor: str, budget: int = 256, where: Sequence[tuple[str, str]] = ()
) -> Transition[TagChangesReply]:
    """``lua/tag_changes.lua``: the alive samples whose tags changed after ``cursor`` (``""``: only
    the newest entry, to watch from now), about ``budget`` at most; with ``where`` (tag name, JSON
    text pairs) only those whose tags now have exactly those values."""
    args = (cursor, budget, *(x for pair in where for x in pair))
    return Transition(FCall("tag_changes", (pk.meta,), args), _read_tag_changes)


# ------------------------------------------------------------------ storage nodes


def read_registry(namespace: str) -> Transition[Registry]:
    """``lua/read_registry.lua``: the server's clock and every storage-node registration of the
    namespace, in one call (no ``EVAL``: a namespace's ACL user may run only the library). The
    stores read it without an operation, through :class:`tq_redis.server.registry.RegistryReader`,
    which owns the reply's reader."""
    return Transition(FCall("read_registry", (storage_nodes_key(namespace),), ()), decode_registry)


# ------------------------------------------------------------------ channels


def _read_channel_put(reply: Sequence[Any]) -> ChannelPut:
    code = int(reply[0])
    if code == 1:
        return ChannelPut(True, False, int(reply[1]), "")
    if code == -1:
        return ChannelPut(False, True, 0, "")
    return ChannelPut(False, False, 0, text(reply[1]))


def channel_put(ck: ChannelKeys, qkey: str, entry: str | bytes) -> Transition[ChannelPut]:
    """``lua/channel_put.lua``: append ``entry`` ("<weight>|<payload>") to queue ``qkey`` unless full."""
    return Transition(FCall("channel_put", (ck.meta,), (qkey, entry)), _read_channel_put)


def _read_channel_pop(reply: Sequence[Any]) -> ChannelPop:
    code = int(reply[0])
    if code == 1:
        return ChannelPop(True, False, list(reply[1]), "")
    if code == -1:
        return ChannelPop(False, True, [], "")
    return ChannelPop(False, False, [], text(reply[1]))


def channel_pop(
    ck: ChannelKeys, qkey: str, target: float | None = None, *, fit: bool = False
) -> Transition[ChannelPop]:
    """``lua/channel_pop.lua``: pop the head entry (``target`` None), the fewest head entries whose
    weights reach ``target``, or with ``fit`` RLinf's get_batch rule (head entries that fit under
    ``target``); all or nothing."""
    if target is None:
        rule, arg = "one", ""
    else:
        rule, arg = ("fit" if fit else "reach"), repr(target)
    return Transition(FCall("channel_pop", (ck.meta,), (qkey, rule, arg)), _read_channel_pop)




# ------------------------------------------------------------------ reservations and admission


class Reserved(NamedTuple):
    """``lua/group_reserve.lua``'s reply: ``ok`` with ids ``first..`` reserved until ``deadline_ms``
    (server time) on ``version`` ('' none); else refused by the staleness bound (``capacity`` the
    samples it admits at the published ``version``, ``next_lapse_ms`` until the earliest
    reservation lapses, -1 none). ``trashed``: lapsed reservations whose ids went to the trash."""

    ok: bool
    trashed: int
    first: int = -1
    version: str = ""
    deadline_ms: int = 0
    capacity: int = 0
    next_lapse_ms: int = -1
    held: InsertHeld | None = None  # refused by a rate limiter instead (includes/ratelimit.lua)


class GroupReply(NamedTuple):
    """``group_extend`` / ``group_commit`` / ``group_abort``: whether the reservation was held, how
    many reservations went to the trash, and the deadline (extend) or first id (commit)."""

    held: bool
    trashed: int
    value: int = 0


def _read_group_reserve(partition: str, reply: Sequence[Any]) -> Reserved:
    code, trashed = int(reply[0]), int(reply[1])
    if code == -3:
        raise _sealed(partition)
    if code == -4:
        raise _closed(partition)
    if code == -5:
        return Reserved(False, trashed, version=text(reply[2]), capacity=int(reply[3]), next_lapse_ms=int(reply[4]))
    if code == -6:
        return Reserved(False, trashed, held=InsertHeld.from_reply(partition, reply[2:]))
    return Reserved(True, trashed, int(reply[2]), text(reply[3]), int(reply[4]))


def group_reserve(
    pk: PartitionKeys, token: str, count: int, lease_ms: int, version: int | None = None,
    waiter: str | None = None, wait_ms: int = 0, default_bound: tuple[int, int] | None = None,
) -> Transition[Reserved]:  # fmt: skip
    """``lua/group_reserve.lua``: reserve ``count`` ids under ``token`` for ``lease_ms`` (server
    time), starting on ``version`` (None: the published one); refused by the staleness bound, it
    registers ``waiter`` for ``wait_ms``. ``default_bound`` (max_lag, batch): the namespace's bound,
    adopted by a partition that has none of its own. Raises ``PartitionSealed`` or ``PartitionClosed``."""
    lag, batch = default_bound if default_bound is not None else ("", "")
    args = (token, count, lease_ms, "" if version is None else version, waiter or "", wait_ms, lag, batch)
    return Transition(FCall("group_reserve", (pk.meta,), args), partial(_read_group_reserve, pk.partition))


def _read_group(reply: Sequence[Any]) -> GroupReply:
    return GroupReply(int(reply[0]) == 1, int(reply[1]), int(reply[2]) if len(reply) > 2 else 0)


def group_extend(
    pk: PartitionKeys, token: str, lease_ms: int = 0, committer: str = "", fields: Sequence[str] = ()
) -> Transition[GroupReply]:
    """``lua/group_extend.lua``: renew the reservation's lease (``lease_ms`` 0: keep it); with a
    ``committer`` (a commit call's id), make that call the only one that may store and commit the
    group and record the ``fields`` it stores; ``value`` is the deadline (server ms). Not ``held``:
    the reservation is gone, or another call is its committer."""
    return Transition(FCall("group_extend", (pk.meta,), (token, lease_ms, committer, *fields)), _read_group)


def _read_group_commit(partition: str, schemas: Mapping[str, str], reply: Sequence[Any]) -> GroupReply:
    code = int(reply[0])
    if code == 0:
        _conflict(reply, schemas)
    if code == -3:
        raise _sealed(partition)
    if code == -4:
        raise _closed(partition)
    return _read_group(reply)


def group_commit(
    pk: PartitionKeys, token: str, committer: str, schemas: Mapping[str, str], strict: bool = False, *,
    end_version: int | None = None, values: Sequence[bytes] = (), ring: str | None = None, now_ms: int | None = None,
) -> Transition[GroupReply]:  # fmt: skip
    """``lua/group_commit.lua``: as commit call ``committer``, make the reserved group alive with
    the fields of ``schemas`` (bytes stored, under ``ring`` if the store places keys, or ``values``
    inline, field-major), tagged with its start and ``end_version``; ``value`` is the first id. Not ``held``: nothing
    committed. Raises the schema conflict, ``PartitionSealed`` or ``PartitionClosed`` (the
    reservation is freed then, its ids in the trash if bytes were recorded for them)."""
    end = "" if end_version is None else end_version
    args = (token, committer, end, clock_ms(now_ms), ring or "", len(schemas), *_flat_schemas(schemas, strict), *values)
    return Transition(FCall("group_commit", (pk.meta,), args), partial(_read_group_commit, pk.partition, schemas))


def group_abort(pk: PartitionKeys, token: str) -> Transition[GroupReply]:
    """``lua/group_abort.lua``: free the reservation; not ``held`` if it was gone already."""
    return Transition(FCall("group_abort", (pk.meta,), (token,)), _read_group)


def _read_policy_version(reply: Sequence[Any]) -> tuple[bool, int | None]:
    value = text(reply[1])
    return int(reply[0]) == 1, int(value) if value else None


def policy_version(pk: PartitionKeys, version: int) -> Transition[tuple[bool, int | None]]:
    """``lua/policy_version.lua``: publish the trainer's ``version``; ``(published, previous or the
    higher current one)``."""
    return Transition(FCall("policy_version", (pk.meta,), (version,)), _read_policy_version)


class Admission(NamedTuple):
    """``lua/admission_config.lua``'s reply: the published version (None: none), samples admitted
    and not freed, reservations in flight."""

    version: int | None
    admitted: int
    reserved: int


def _read_admission(reply: Sequence[Any]) -> Admission:
    version = text(reply[0])
    return Admission(int(version) if version else None, int(reply[1]), int(reply[2]))


def admission_config(pk: PartitionKeys, max_lag: int | None, batch: int = 1) -> Transition[Admission]:
    """``lua/admission_config.lua``: set the staleness bound (``max_lag`` None: remove it)."""
    args = ("", "") if max_lag is None else (max_lag, batch)
    return Transition(FCall("admission_config", (pk.meta,), args), _read_admission)


class RateCounts(NamedTuple):
    """``lua/rate_limit_config.lua``: a rate limiter's counts after the change."""

    inserts: int
    samples: int


def _read_rate_counts(reply: Sequence[Any]) -> RateCounts:
    return RateCounts(int(reply[0]), int(reply[1]))


def rate_limit_config(
    pk: PartitionKeys, task: str, samples_per_insert: float | None, min_size_to_sample: int = 1,
    error_buffer: float = 1.0, insert_timeout_ms: int | None = None,
) -> Transition[RateCounts]:  # fmt: skip
    """``lua/rate_limit_config.lua``: set ``task``'s samples-per-insert rate limiter on the partition
    (``samples_per_insert`` None: remove it)."""
    if samples_per_insert is None:
        args: tuple[Any, ...] = (task, "", "", "", "")
    else:
        timeout = "" if insert_timeout_ms is None else insert_timeout_ms
        args = (task, repr(float(samples_per_insert)), min_size_to_sample, repr(float(error_buffer)), timeout)
    return Transition(FCall("rate_limit_config", (pk.meta,), args), _read_rate_counts)


BY_SCRIPT: dict[str, Callable[..., Transition[Any]]] = {
    f.__name__: f
    for f in (
        reserve, insert, produce, set_tags, check_visible, read_inline, share_begin, share_put,
        claim, claim_ids, ready_ids, wait, settle, unclaim,
        clear, drop_partition, trash_add, trash_done,
        reset_consumption, seal_partition, progress,
        kv_resolve, kv_unmap, kv_list, tag_changes,
        read_registry, channel_put, channel_pop,
        group_reserve, group_extend, group_commit, group_abort, policy_version, admission_config,
        rate_limit_config, part_alloc, part_append, part_read,
        mark_consumed, unproduce, dock_shape, dock_cursor, dock_metric, dock_reset, dock_finish, dock_ready,
        dock_resort,
    )
}  # fmt: skip
"""The wrapper of each ``lua/<name>.lua``, by script name."""
