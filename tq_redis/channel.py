"""``Channel``: RLinf's named producer/consumer queue, kept in Redis so any process can use it.

Each ``key`` of a channel is its own FIFO queue: a Redis LIST ``<ns>:chan:{name}:q:<key>`` whose
entries are ``"<weight>|<payload>"``. ``lua/channel_put.lua`` appends unless the queue holds
``maxsize`` entries; ``lua/channel_pop.lua`` pops one entry, or the fewest head entries whose
weights reach a target, atomically, so ordering is FIFO per key across every process. A blocked
``get`` waits on the channel's ``puts`` event stream and a blocked ``put`` on its ``gets`` stream
(XREAD BLOCK); nothing polls or sleeps.

Items may be any value the safe object encoding (:func:`tq_redis.codec.encode_object`) holds;
pickle is used only with ``allow_pickle=True`` (it is not safe on a network). A ``torch.Tensor``
or ``TensorDict`` item goes through the data plane instead: its bytes are stored as samples of the
hidden partition ``__chan__.<name>`` (in whatever store the namespace uses) and the queue entry
holds only the reference; the getter reads and deletes them. A getter that dies between popping
and reading leaks that item's bytes.

Differences from RLinf on purpose: ``maxsize`` bounds each key's queue; ``get(timeout=...)``
raises ``TimeoutError`` when it expires; tensors come back on the CPU, TensorDicts as plain
``TensorDict``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import threading
import time
from collections.abc import Callable
from numbers import Real
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_leaf_nontensor

from tq_redis import codec, ops
from tq_redis.driver import Cmd, FCall, Offload, Pipe, SyncDriver, Wait
from tq_redis.errors import ChannelNotFound, ConfigError, InvalidArgument
from tq_redis.keys import ChannelKeys, PartitionKeys, check_name

Op = ops.Op

DEFAULT_KEY = "default"
_WAIT_SLICE_S = 5.0
_OBJECT, _REF = b"o", b"r"


class ChannelWork:
    """Handle of a call made with ``async_op=True``.

    ``wait()`` blocks until the operation is done and returns its result (or raises its error);
    ``await async_wait()`` does the same without blocking the event loop.
    """

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="tq-channel-op")
        thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._future.set_result(fn())
        except BaseException as exc:  # handed to whoever waits
            self._future.set_exception(exc)

    def done(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the operation's error."""
        return self._future.result(timeout)

    async def async_wait(self) -> Any:
        """Await the result without blocking the event loop."""
        return await asyncio.wrap_future(self._future)


# ------------------------------------------------------------------ item encoding


def _tensor_like(item: Any) -> bool:
    if isinstance(item, TensorDictBase):
        return True
    return isinstance(item, torch.Tensor) and item.layout == torch.strided and not item.is_nested


def _leaves(td: TensorDictBase) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for path, value in td.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor):
        out.append(((path,) if isinstance(path, str) else tuple(path), value))
    return out


def store_item(ctx: ops.Context, ck: ChannelKeys, item: Any) -> Op:
    """Encode ``item`` as a queue payload; tensors go to the data plane first (data before entry)."""
    if not _tensor_like(item):
        return _OBJECT + codec.encode_object(item, allow_pickle=ctx.allow_pickle)
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
            return _REF + codec.encode_object(ref, allow_pickle=ctx.allow_pickle)
    encoded = {
        f"f{j}": codec.encode_field(f"f{j}", value, rows, allow_pickle=ctx.allow_pickle)[1]
        for j, (_, value) in enumerate(leaves)
    }
    first = (yield Cmd(("INCRBY", ck.seq, rows))) - rows
    ref["ids"] = list(range(first, first + rows))
    store = yield from ops.storage(ctx)
    yield Offload(store.put, (_data_keys(ctx, ck), ref["ids"], encoded))
    return _REF + codec.encode_object(ref, allow_pickle=ctx.allow_pickle)


def _data_keys(ctx: ops.Context, ck: ChannelKeys) -> PartitionKeys:
    return ctx.keys(ck.data_partition)


def _payload(entry: bytes) -> tuple[bytes, bytes]:
    bar = entry.index(b"|")
    return entry[bar + 1 : bar + 2], entry[bar + 2 :]


def load_items(ctx: ops.Context, ck: ChannelKeys, entries: list[bytes]) -> Op:
    """Decode popped entries; tensor items are read from the data plane and then deleted."""
    items: list[Any] = []
    for entry in entries:
        tag, body = _payload(entry)
        if tag == _OBJECT:
            items.append(codec.decode_object(body, allow_pickle=ctx.allow_pickle))
            continue
        ref = codec.decode_object(body, allow_pickle=ctx.allow_pickle)
        if ref["kind"] == "td-inline":
            items.append(_tensordict(ref["bs"], ref["paths"], ref["values"]))
            continue
        store = yield from ops.storage(ctx)
        names = [f"f{j}" for j in range(len(ref["paths"]))]
        pk = _data_keys(ctx, ck)
        got = yield Offload(store.get, (pk, ref["ids"], names))
        yield Offload(store.delete, (pk, ref["ids"], names))
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


def drop_items(ctx: ops.Context, ck: ChannelKeys, entries: list[bytes]) -> Op:
    """Delete the data-plane bytes of entries that will never be read."""
    for entry in entries:
        tag, body = _payload(entry)
        if tag != _REF:
            continue
        ref = codec.decode_object(body, allow_pickle=ctx.allow_pickle)
        if ref.get("ids"):
            store = yield from ops.storage(ctx)
            names = [f"f{j}" for j in range(len(ref["paths"]))]
            yield Offload(store.delete, (_data_keys(ctx, ck), ref["ids"], names))


# ------------------------------------------------------------------ operations


def _entry(weight: Any, payload: bytes) -> bytes:
    if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight) or weight < 0:
        raise InvalidArgument(f"weight must be a finite number >= 0, got {weight!r}")
    return repr(weight if isinstance(weight, int) else float(weight)).encode() + b"|" + payload


def create(ctx: ops.Context, ck: ChannelKeys, maxsize: int) -> Op:
    """Create the channel, or check an existing one has the same ``maxsize``."""
    _, _, current = yield Pipe(
        (
            Cmd(("HSETNX", ck.meta, "maxsize", maxsize)),
            Cmd(("HSETNX", ck.meta, "created_ms", int(time.time() * 1000))),
            Cmd(("HGET", ck.meta, "maxsize")),
        )
    )
    if int(current) != maxsize:
        raise InvalidArgument(
            f"channel {ck.name!r} exists with maxsize={int(current)}, not {maxsize}; "
            f"use Channel.connect({ck.name!r}) or another name"
        )
    return maxsize


def connect(ck: ChannelKeys) -> Op:
    """The existing channel's ``maxsize``."""
    current = yield Cmd(("HGET", ck.meta, "maxsize"))
    if current is None:
        raise ChannelNotFound(
            f"channel {ck.name!r} does not exist; create it with Channel.create({ck.name!r})"
        )
    return int(current)


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise InvalidArgument(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    return time.monotonic() + timeout


def _wait(stream: str, last_id: Any, deadline: float | None, what: str) -> Op:
    remaining = _WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(what)
    yield Wait(stream, last_id.decode() if isinstance(last_id, bytes) else str(last_id),
               min(remaining, _WAIT_SLICE_S))


def put(ctx: ops.Context, ck: ChannelKeys, item: Any, weight: Any, key: str, block: bool,
        timeout: float | None = None) -> Op:
    """Append ``item``; a full queue blocks (``block``) or raises ``asyncio.QueueFull``."""
    check_name("channel key", key)
    deadline = _deadline(timeout)
    _entry(weight, b"")  # validate before storing anything
    entry = _entry(weight, (yield from store_item(ctx, ck, item)))
    try:
        while True:
            reply = yield FCall("channel_put", (ck.meta,), (key, entry))
            code = int(reply[0])
            if code == 1:
                return
            if code == -1:
                raise ChannelNotFound(f"channel {ck.name!r} was deleted")
            if not block:
                raise asyncio.QueueFull(f"channel {ck.name!r} queue {key!r} is full")
            yield from _wait(ck.gets, reply[1], deadline, f"channel {ck.name!r} queue {key!r} stayed full")
    except Exception:
        yield from drop_items(ctx, ck, [entry])  # never queued: nobody will read its bytes
        raise


def pop(ctx: ops.Context, ck: ChannelKeys, key: str, target_weight: float | None, block: bool,
        timeout: float | None = None) -> Op:
    """Pop one item (``target_weight=None``) or items reaching ``target_weight``; FIFO."""
    check_name("channel key", key)
    deadline = _deadline(timeout)
    target = "" if target_weight is None else repr(float(target_weight))
    while True:
        reply = yield FCall("channel_pop", (ck.meta,), (key, target))
        code = int(reply[0])
        if code == 1:
            return (yield from load_items(ctx, ck, list(reply[1])))
        if code == -1:
            raise ChannelNotFound(f"channel {ck.name!r} does not exist (deleted?)")
        if not block:
            raise asyncio.QueueEmpty(f"channel {ck.name!r} queue {key!r} is empty")
        yield from _wait(ck.puts, reply[1], deadline, f"nothing arrived in channel {ck.name!r} queue {key!r}")


def delete(ctx: ops.Context, ck: ChannelKeys) -> Op:
    """Remove the channel's keys and the bytes of items still queued."""
    queues: list[bytes] = []
    cursor = b"0"
    while True:
        cursor, found = yield Cmd(("SCAN", cursor, "MATCH", ck.queue("*"), "COUNT", 1000))
        queues += found
        if int(cursor) == 0:
            break
    for q in queues:
        yield from drop_items(ctx, ck, (yield Cmd(("LRANGE", q, 0, -1))))
    yield Cmd(("DEL", ck.meta, ck.seq, ck.puts, ck.gets, *queues))


# ------------------------------------------------------------------ the class


def resolve_target(redis_url: str | None, namespace: str | None) -> tuple[str, str, bool]:
    """(url, namespace, allow_pickle) from the arguments, ``tq_redis.init()`` or the environment."""
    from tq_redis.runtime import NotInitialized, get_client

    try:
        client = get_client()
    except NotInitialized:
        client = None
    if redis_url is None and client is not None:
        return client.redis_url, namespace or client.namespace, client._ctx.allow_pickle
    url = redis_url or os.environ.get("TQ_REDIS_URL")
    if not url:
        raise ConfigError(
            "Channel needs the Redis URL: pass redis_url=, export TQ_REDIS_URL, or call tq_redis.init() first"
        )
    return url, namespace or os.environ.get("TQ_NAMESPACE") or "tq", False


class Channel:
    """A named set of FIFO queues (one per ``key``) shared by every process that knows the name.

    Build one with :meth:`create` or :meth:`connect`. Weights let ``get_batch`` pop as many
    items as add up to a target (e.g. a number of tokens or samples). A ``Channel`` pickles to
    its name and address, so it can be handed to worker processes.
    """

    def __init__(self, name: str, redis_url: str, namespace: str, maxsize: int, *,
                 allow_pickle: bool = False) -> None:
        self.name = name
        self.redis_url = redis_url
        self.namespace = namespace
        self._maxsize = maxsize
        self._allow_pickle = allow_pickle
        self._keys = ChannelKeys(namespace, name)
        self._ctx = ops.Context(namespace=namespace, redis_url=redis_url, allow_pickle=allow_pickle)
        self._driver = SyncDriver(redis_url)

    @classmethod
    def create(cls, name: str, maxsize: int = 0, redis_url: str | None = None, *,
               namespace: str | None = None, allow_pickle: bool | None = None) -> Channel:
        """Create the channel ``name`` (or join an existing one with the same ``maxsize``).

        ``maxsize`` bounds each key's queue (0: unbounded). Without ``redis_url`` the channel
        lives where ``tq_redis.init()`` attached (or ``TQ_REDIS_URL``/``TQ_NAMESPACE``).
        """
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise InvalidArgument(f"maxsize must be an int >= 0 (0 = unbounded), got {maxsize!r}")
        url, ns, pickle_default = resolve_target(redis_url, namespace)
        pickle = pickle_default if allow_pickle is None else allow_pickle
        chan = cls(name, url, ns, maxsize, allow_pickle=pickle)
        chan._driver.run(create(chan._ctx, chan._keys, maxsize))
        return chan

    @classmethod
    def connect(cls, name: str, redis_url: str | None = None, *, namespace: str | None = None,
                allow_pickle: bool | None = None) -> Channel:
        """Attach to an existing channel; raises :class:`ChannelNotFound` if nobody created it."""
        url, ns, pickle_default = resolve_target(redis_url, namespace)
        chan = cls(name, url, ns, 0, allow_pickle=pickle_default if allow_pickle is None else allow_pickle)
        chan._maxsize = chan._driver.run(connect(chan._keys))
        return chan

    def __reduce__(self):
        return (_attach, (self.name, self.redis_url, self.namespace, self._maxsize, self._allow_pickle))

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, maxsize={self._maxsize}, namespace={self.namespace!r})"

    @property
    def maxsize(self) -> int:
        """Most entries each key's queue holds (0: unbounded)."""
        return self._maxsize

    def _run(self, op: Op, async_op: bool) -> Any:
        if async_op:
            return ChannelWork(lambda: self._driver.run(op))
        return self._driver.run(op)

    def put(self, item: Any, weight: float = 0, key: str = DEFAULT_KEY, async_op: bool = False,
            timeout: float | None = None) -> ChannelWork | None:
        """Append ``item`` to queue ``key``, blocking while it is full (``TimeoutError`` after
        ``timeout`` seconds, if given). ``async_op=True`` returns a :class:`ChannelWork`."""
        return self._run(put(self._ctx, self._keys, item, weight, key, True, timeout), async_op)

    def put_nowait(self, item: Any, weight: float = 0, key: str = DEFAULT_KEY) -> None:
        """Append ``item``; raises ``asyncio.QueueFull`` if the queue holds ``maxsize`` items."""
        self._driver.run(put(self._ctx, self._keys, item, weight, key, False))

    def get(self, key: str = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None) -> Any:
        """Pop the oldest item of queue ``key``, waiting for one (``TimeoutError`` after ``timeout``
        seconds, if given). ``async_op=True`` returns a :class:`ChannelWork` of the item."""
        op = pop(self._ctx, self._keys, key, None, True, timeout)
        if async_op:
            return ChannelWork(lambda: self._driver.run(op)[0])
        return self._driver.run(op)[0]

    def get_nowait(self, key: str = DEFAULT_KEY) -> Any:
        """Pop the oldest item; raises ``asyncio.QueueEmpty`` if there is none."""
        return self._driver.run(pop(self._ctx, self._keys, key, None, False))[0]

    def get_batch(self, target_weight: float, key: str = DEFAULT_KEY, async_op: bool = False,
                  timeout: float | None = None) -> list[Any] | ChannelWork:
        """Pop the oldest items whose weights sum to at least ``target_weight`` (all at once),
        waiting until enough weight is queued. Returns them oldest first."""
        if isinstance(target_weight, bool) or not isinstance(target_weight, Real) or not target_weight > 0:
            raise InvalidArgument(f"target_weight must be a number > 0, got {target_weight!r}")
        return self._run(pop(self._ctx, self._keys, key, float(target_weight), True, timeout), async_op)

    def qsize(self, key: str = DEFAULT_KEY) -> int:
        """Number of items in queue ``key``."""
        return int(self._driver.redis.llen(self._keys.queue(check_name("channel key", key))))

    def empty(self, key: str = DEFAULT_KEY) -> bool:
        """True if queue ``key`` holds no item."""
        return self.qsize(key) == 0

    def full(self, key: str = DEFAULT_KEY) -> bool:
        """True if queue ``key`` holds ``maxsize`` items (never for an unbounded channel)."""
        return self._maxsize > 0 and self.qsize(key) >= self._maxsize

    def delete(self) -> None:
        """Remove the channel and its queued items (call once nobody uses it)."""
        self._driver.run(delete(self._ctx, self._keys))

    def close(self) -> None:
        """Close this handle's connections (the channel itself stays)."""
        self._driver.close()
        if self._ctx.storage is not None:
            self._ctx.storage.close()


def _attach(name: str, redis_url: str, namespace: str, maxsize: int, allow_pickle: bool) -> Channel:
    return Channel(name, redis_url, namespace, maxsize, allow_pickle=allow_pickle)
