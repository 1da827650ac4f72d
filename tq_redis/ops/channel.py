"""The operations of a channel kept in Redis, as generators of effects, and how its items are encoded.

A queue entry is ``"<weight>|<tag><payload>"``: tag ``o`` an object in the safe encoding
(:func:`tq_redis.codec.objects.encode_object`), tag ``r`` a reference to a tensor or TensorDict item whose
bytes are samples of the hidden partition ``__chan__.<name>`` in the namespace's store
(:func:`encode_item`, :func:`store_item`, :func:`load_items`, :func:`drop_items`). The operations
(:func:`create`, :func:`connect`, :func:`put`, :func:`pop`, :func:`peek`, :func:`qsize`,
:func:`delete`) run ``lua/channel_*.lua`` through :mod:`tq_redis.ops.transitions` and yield a
:class:`~tq_redis.ops.effects.Wait` on the channel's ``puts``/``gets`` stream when they must wait; they do
no I/O themselves: :mod:`tq_redis.channel.in_redis` runs them on a channel handle's thread.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_leaf_nontensor

from tq_redis.codec import objects
from tq_redis.codec import tensors as codec
from tq_redis.codec.item_classes import ItemClasses
from tq_redis.errors import ChannelNotFound, DataMissing, InvalidArgument, ItemClassNotAllowed, TQError
from tq_redis.meta.keys import ChannelKeys, channels_key
from tq_redis.ops import transitions
from tq_redis.ops.channel_rules import FIT, ONE, WeightedItem
from tq_redis.ops.context import Context, Op, storage
from tq_redis.ops.effects import Cmd, Offload, Pipe, Wait
from tq_redis.ops.encoding import text
from tq_redis.storage.manager import Placement

WAIT_SLICE_S = 5.0  # a waiting operation re-runs its script at least this often
_OBJECT, _REF = b"o", b"r"


def _entry(weight: Any, payload: bytes) -> bytes:
    return repr(int(weight) if isinstance(weight, Integral) else float(weight)).encode() + b"|" + payload


def _entry_weight(entry: bytes) -> int | float:
    text = entry[: entry.index(b"|")].decode()
    try:
        return int(text)
    except ValueError:
        return float(text)


# ------------------------------------------------------------------ item encoding


@dataclass(frozen=True, slots=True)
class _Encoded:
    """An item encoded when the call was made: the whole payload, or a data-plane reference whose
    sample ids are assigned when it is stored, with its encoded fields."""

    payload: bytes | None
    ref: dict | None = None
    rows: int = 0
    fields: dict | None = None


def _tensor_like(item: Any) -> bool:
    if isinstance(item, TensorDictBase):
        return True
    return isinstance(item, torch.Tensor) and item.layout == torch.strided and not item.is_nested


def _leaves(td: TensorDictBase) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for path, value in td.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor):
        out.append(((path,) if isinstance(path, str) else tuple(path), value))
    return out


def encode_item(item: Any, allow_pickle: bool, classes: ItemClasses | None = None) -> _Encoded:
    """Encode ``item`` now (objects inline, tensors as fields for the data plane); ``classes``: the
    dataclasses and NamedTuples an object item may be (the channel's allow-list)."""
    if not _tensor_like(item):
        return _Encoded(_OBJECT + objects.encode_object(item, allow_pickle=allow_pickle, classes=classes))
    if isinstance(item, torch.Tensor):
        ref: dict[str, Any] = {"kind": "tensor", "bs": [], "paths": [["t"]]}
        rows, leaves = 1, [(("t",), item.unsqueeze(0))]
    else:
        bs = list(item.batch_size)
        batched = item if bs else item.unsqueeze(0)
        rows, leaves = int(batched.batch_size[0]), _leaves(batched)
        ref = {"kind": "td", "bs": bs, "paths": [list(p) for p, _ in leaves]}
        if rows == 0 or not leaves:  # nothing per sample: keep the (empty) leaves inline
            ref["kind"] = "td-inline"
            ref["values"] = [v for _, v in leaves]
            return _Encoded(_REF + objects.encode_object(ref, allow_pickle=allow_pickle))
    fields = {
        f"f{j}": codec.encode_field(f"f{j}", value, rows, allow_pickle=allow_pickle)[1]
        for j, (_, value) in enumerate(leaves)
    }
    return _Encoded(None, ref, rows, fields)


def _storage(ctx: Context) -> Op:
    """``storage``, safe when two operations of one handle resolve it at once."""
    if ctx.storage is None:
        probe = Context(namespace=ctx.namespace, redis_url=ctx.redis_url)
        manager = yield from storage(probe)
        if ctx.storage is None:  # else another operation won; the unused manager holds nothing
            ctx.storage = manager
    return ctx.storage


def store_item(ctx: Context, ck: ChannelKeys, enc: _Encoded) -> Op:
    """The queue payload of an encoded item; tensors go to the data plane first (data before entry)."""
    if enc.payload is not None:
        return enc.payload
    first = (yield Cmd(("INCRBY", ck.seq, enc.rows))) - enc.rows
    ref = dict(enc.ref, ids=list(range(first, first + enc.rows)))
    store = yield from _storage(ctx)
    ring = yield Offload(store.put, (_data_keys(ctx, ck), ref["ids"], enc.fields))
    if ring is not None:  # where a placing store put the bytes: read and deleted there, whatever joins
        ref["ring"] = ring
    return _REF + objects.encode_object(ref, allow_pickle=ctx.allow_pickle)


def _data_keys(ctx: Context, ck: ChannelKeys):
    return ck.data_keys()


def _payload(entry: bytes) -> tuple[bytes, bytes]:
    bar = entry.index(b"|")
    return entry[bar + 1 : bar + 2], entry[bar + 2 :]


def _decode_object_item(ctx: Context, ck: ChannelKeys, body: bytes, classes: ItemClasses | None) -> Op:
    """An object item; a class missing from the allow-list is looked up once more in the channel's
    list in Redis (another process may have added it since this handle read it)."""
    try:
        return objects.decode_object(body, allow_pickle=ctx.allow_pickle, classes=classes)
    except ItemClassNotAllowed:
        if classes is None or not classes.add(*(yield from item_class_paths(ck))):
            raise
    return objects.decode_object(body, allow_pickle=ctx.allow_pickle, classes=classes)


def load_items(ctx: Context, ck: ChannelKeys, entries: list[bytes], consume: bool = True,
               classes: ItemClasses | None = None) -> Op:
    """Decode entries; tensor items are read from the data plane (and deleted when ``consume``)."""
    items: list[Any] = []
    for entry in entries:
        tag, body = _payload(entry)
        if tag == _OBJECT:
            items.append((yield from _decode_object_item(ctx, ck, body, classes)))
            continue
        ref = objects.decode_object(body, allow_pickle=ctx.allow_pickle)
        if ref["kind"] == "td-inline":
            items.append(_tensordict(ref["bs"], ref["paths"], ref["values"]))
            continue
        store = yield from _storage(ctx)
        names = [f"f{j}" for j in range(len(ref["paths"]))]
        pk = _data_keys(ctx, ck)
        rings = [ref["ring"]] if ref.get("ring") else []
        got = yield Offload(store.get, (pk, ref["ids"], names, item_placement(rings)))
        if consume:
            yield Offload(store.delete, (pk, ref["ids"], names, rings))
        values = [
            codec.decode_field(n, got[n], allow_pickle=ctx.allow_pickle, nested_output=ctx.nested_output)
            for n in names
        ]
        if ref["kind"] == "tensor":
            items.append(values[0][0])
        elif ref["bs"]:
            items.append(_tensordict(ref["bs"], ref["paths"], values))
        else:  # stored as one row
            items.append(_tensordict([1], ref["paths"], values)[0])
    return items


def _tensordict(batch_size: list[int], paths: list[list[str]], values: list[Any]) -> TensorDict:
    td = TensorDict({}, batch_size=batch_size)
    for path, value in zip(paths, values):
        td.set(tuple(path), value)
    return td


def item_placement(rings: list[str]) -> Placement | None:
    """Where a placing store put an item's bytes: all of them under one ring (None: not recorded)."""
    return Placement(rings, {}) if rings else None


def without_ring(entry: bytes) -> bytes:
    """A queue entry without the ring its bytes were put under (a checkpoint's copy: loading it
    puts the bytes wherever the loading namespace's nodes are)."""
    tag, body = _payload(entry)
    if tag != _REF:
        return entry
    try:
        ref = objects.decode_object(body, allow_pickle=False)
    except TQError:
        return entry
    if not isinstance(ref, dict) or "ring" not in ref:
        return entry
    del ref["ring"]
    head = entry[: entry.index(b"|") + 1]
    return head + _REF + objects.encode_object(ref, allow_pickle=False)


def stored_parts(entry: bytes) -> tuple[list[int], list[str], list[str]]:
    """The sample ids and field names of the channel's hidden partition that a queue entry's
    bytes live under (none for an object kept in the entry itself), and the ring a placing store
    put them under (none: not recorded)."""
    tag, body = _payload(entry)
    if tag != _REF:
        return [], [], []
    try:
        ref = objects.decode_object(body, allow_pickle=False)
    except TQError:  # a "td-inline" entry holding pickled values: it has no bytes elsewhere
        return [], [], []
    if not isinstance(ref, dict) or not ref.get("ids"):
        return [], [], []
    return list(ref["ids"]), [f"f{j}" for j in range(len(ref["paths"]))], [ref["ring"]] if ref.get("ring") else []


def drop_items(ctx: Context, ck: ChannelKeys, entries: list[bytes]) -> Op:
    """Delete the data-plane bytes of entries that will never be read."""
    for entry in entries:
        ids, names, rings = stored_parts(entry)
        if ids:
            store = yield from _storage(ctx)
            yield Offload(store.delete, (_data_keys(ctx, ck), ids, names, rings))


# ------------------------------------------------------------------ operations (Redis)


_CLASS = "c:"  # a meta hash field "c:<module>:<QualName>" allows that item class


def _class_paths(meta_fields: list[Any]) -> list[str]:
    return [name[len(_CLASS):] for name in map(text, meta_fields) if name.startswith(_CLASS)]


def item_class_paths(ck: ChannelKeys) -> Op:
    """The import paths of the dataclasses and NamedTuples the channel allows as items."""
    return _class_paths((yield Cmd(("HKEYS", ck.meta))))


def create(ctx: Context, ck: ChannelKeys, maxsize: int, classes: list[str] = ()) -> Op:  # type: ignore[assignment]
    """Create the channel allowing the item classes ``classes`` (import paths), or join an existing
    one with the same ``maxsize`` (adding ``classes`` to its list). Returns ``(maxsize, the
    channel's item class paths)``."""
    allow = [Cmd(("HSET", ck.meta, *[x for path in classes for x in (_CLASS + path, 1)]))] if classes else []
    *_, current, _, fields = yield Pipe(
        (
            Cmd(("HSETNX", ck.meta, "maxsize", maxsize)),
            Cmd(("HSETNX", ck.meta, "created_ms", int(time.time() * 1000))),
            *allow,
            Cmd(("HGET", ck.meta, "maxsize")),
            Cmd(("SADD", channels_key(ck.ns), ck.name)),  # the registry checkpoints read
            Cmd(("HKEYS", ck.meta)),
        )
    )
    if int(current) != maxsize:
        raise InvalidArgument(
            f"channel {ck.name!r} exists with maxsize={int(current)}, not {maxsize}; "
            f"use Channel.connect({ck.name!r}) or another name"
        )
    return maxsize, _class_paths(fields)


def connect(ck: ChannelKeys) -> Op:
    """The existing channel's ``(maxsize, item class paths)``."""
    current, fields = yield Pipe((Cmd(("HGET", ck.meta, "maxsize")), Cmd(("HKEYS", ck.meta))))
    if current is None:
        raise ChannelNotFound(
            f"channel {ck.name!r} does not exist; create it with Channel.create({ck.name!r})"
        )
    return int(current), _class_paths(fields)


def _wait(stream: str, last_id: Any, deadline: float | None, what: str) -> Op:
    remaining = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(what)
    yield Wait(stream, last_id.decode() if isinstance(last_id, bytes) else str(last_id),
               min(remaining, WAIT_SLICE_S))


def put(ctx: Context, ck: ChannelKeys, enc: _Encoded, weight: Any, qkey: str, block: bool,
        deadline: float | None = None) -> Op:
    """Append an encoded item to queue ``qkey``; a full queue blocks (``block``) or raises
    ``asyncio.QueueFull``."""
    entry = _entry(weight, (yield from store_item(ctx, ck, enc)))
    try:
        while True:
            put = yield from transitions.channel_put(ck, qkey, entry).call()
            if put.appended:
                return
            if put.missing:
                raise ChannelNotFound(f"channel {ck.name!r} was deleted")
            if not block:
                raise asyncio.QueueFull(f"channel {ck.name!r} queue {qkey!r} is full")
            yield from _wait(ck.gets, put.last_gets_id, deadline, f"channel {ck.name!r} queue {qkey!r} stayed full")
    except Exception:
        yield from drop_items(ctx, ck, [entry])  # never queued: nobody will read its bytes
        raise


def pop(ctx: Context, ck: ChannelKeys, qkey: str, mode: str, target: float, block: bool,
        deadline: float | None = None, classes: ItemClasses | None = None) -> Op:
    """Pop one item (``mode="one"``) or head items by weight (``"fit"``: RLinf's rule; ``"exceed"``:
    the fewest that reach ``target``); FIFO. Returns the items, oldest first."""
    while True:
        if mode == FIT:
            got = yield from transitions.channel_pop(ck, qkey, target, fit=True).call()
        else:
            got = yield from transitions.channel_pop(ck, qkey, None if mode == ONE else target).call()
        if got.popped:
            return (yield from load_items(ctx, ck, got.entries, classes=classes))
        if got.missing:
            raise ChannelNotFound(f"channel {ck.name!r} does not exist (deleted?)")
        if not block:
            raise asyncio.QueueEmpty(f"channel {ck.name!r} queue {qkey!r} is empty")
        what = f"not enough arrived in channel {ck.name!r} queue {qkey!r}"
        yield from _wait(ck.puts, got.last_puts_id, deadline, what)


def peek(ctx: Context, ck: ChannelKeys, qkey: str, classes: ItemClasses | None = None) -> Op:
    """The queued items of ``qkey`` with their weights, oldest first; nothing is removed."""
    out = []
    for entry in (yield Cmd(("LRANGE", ck.queue(qkey), 0, -1))):
        try:
            (item,) = yield from load_items(ctx, ck, [entry], consume=False, classes=classes)
        except DataMissing:  # popped by another consumer meanwhile: no longer queued
            continue
        out.append(WeightedItem(_entry_weight(entry), item))
    return out


def qsize(ck: ChannelKeys, qkey: str) -> Op:
    """Number of entries in queue ``qkey``."""
    return int((yield Cmd(("LLEN", ck.queue(qkey)))))


def queue_keys(ck: ChannelKeys, meta_fields: list[Any]) -> list[str]:
    """The channel's queue keys, from its ``meta`` hash's fields: every non-empty queue ``k`` has
    a ``w:<k>`` field (its summed weights), dropped when the queue empties."""
    return [ck.queue(name[2:]) for name in map(text, meta_fields) if name.startswith("w:")]


def delete(ctx: Context, ck: ChannelKeys) -> Op:
    """Remove the channel's keys and the bytes of items still queued (its queues are found from
    its ``meta`` hash: no key pattern, so no other channel is touched)."""
    queues = queue_keys(ck, (yield Cmd(("HKEYS", ck.meta))))
    if queues:
        for entries in (yield Pipe(tuple(Cmd(("LRANGE", q, 0, -1)) for q in queues))):
            yield from drop_items(ctx, ck, entries)
    # one slot (the channel's hash tag), so one DEL works on a cluster too
    yield Pipe((Cmd(("DEL", ck.meta, ck.seq, ck.puts, ck.gets, *queues)), Cmd(("SREM", channels_key(ck.ns), ck.name))))
