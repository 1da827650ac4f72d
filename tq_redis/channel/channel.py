"""``Channel``: RLinf's named producer/consumer queue, kept in Redis so any process can use it.

Each ``key`` of a channel is its own FIFO queue: a Redis LIST ``<ns>:chan:{name}:q:<key>`` whose
entries are ``"<weight>|<payload>"``. ``lua/channel_put.lua`` appends unless the queue holds
``maxsize`` entries; ``lua/channel_pop.lua`` pops one entry, or the head entries that reach or
(RLinf's ``get_batch`` rule) fit a target weight, atomically, so ordering is FIFO
per key across every process. A blocked ``get`` waits on the channel's ``puts`` event stream and a
blocked ``put`` on its ``gets`` stream; nothing polls or sleeps.

**Ordering and async operations.** Every call made through one ``Channel`` object, with or without
``async_op=True``, is run by that object's own background thread (one asyncio loop), in the order
the calls were made, as RLinf's channel actor runs one caller's requests: each operation gets its
turn at the queue in issue order, and one that has to wait (an empty queue for a get, a full one
for a put) steps aside so later operations proceed, except those on the same key and of the same
kind (put, or get/get_batch), which queue behind it so they stay FIFO. Waiting operations share one
blocked ``XREAD``, so a handle uses at most ``MAX_CONNECTIONS`` (:mod:`tq_redis.channel.in_redis`) + 1
connections however many operations are in flight. A put issued with ``async_op=True`` and never
waited on still lands: on ``close()``, when the object is garbage-collected, and when the process exits (``atexit`` and
multiprocessing's exit hook), the handle first finishes every put issued through it. An operation's
error is raised by ``ChannelWork.wait()`` / ``await ChannelWork.async_wait()``; a put's error that
no handle reported is raised by ``close()`` (and logged when nobody can see it any more).

**Keys** may be any value whose equality means the same in every process: ``str`` (used as is, any
characters), numbers, ``None``, ``bytes`` and tuples/frozensets of these (``1``, ``1.0`` and ``True``
are one key, as in a dict; see :func:`key_token`). Without a key, calls use RLinf's default queue
``"default_queue"``. **Local channels** (``Channel.create(name, local=True)``) keep their queues in
this process's memory and take any hashable key; see :meth:`Channel.create`.

Items may be any value the safe object encoding (:func:`tq_redis.codec.objects.encode_object`) holds,
dataclass and NamedTuple instances of allowed classes included (the program's own and the channel's; see
:meth:`Channel.create` and :mod:`tq_redis.codec.item_classes`); pickle is used only with
``allow_pickle=True`` (it is not safe on a network). Items are encoded when the call is made, so
changing an object after an async put does not change what lands. A ``torch.Tensor`` or
``TensorDict`` item goes through the data plane instead: its bytes are stored as samples of the
hidden partition ``__chan__.<name>`` (in whatever store the namespace uses) and the queue entry
holds only the reference; the getter reads and deletes them. A getter that dies between popping and
reading leaks that item's bytes.

Differences from RLinf on purpose: ``put``/``get``/``get_batch`` take a ``timeout`` (``TimeoutError``
when it expires); ``get_batch`` takes its items atomically (RLinf pops them one by one as they
arrive) and ``allow_exceed=True`` selects "the fewest head items that reach the target";
``create`` of an existing name with another ``maxsize`` raises (RLinf logs and connects);
weights must be finite and >= 0; tensors come back on the CPU, TensorDicts as plain ``TensorDict``;
``distributed``/``node_rank``/``disable_distributed_log`` are accepted and ignored (a channel in
Redis is reachable from every node); local channels also take ``async_op=True`` and block without
spinning, and a local channel sent to another process arrives there empty (RLinf copies its items).

Modules: this one holds :class:`Channel` (it finds its server with
:func:`tq_redis.api.system.resolve_target`); :mod:`tq_redis.ops.channel_rules`
what every channel takes (keys, weights, timeouts, :class:`WeightedItem`);
:mod:`tq_redis.channel.executor` the ordered per-object executor, :class:`ChannelWork` and exit
flushing; :mod:`tq_redis.ops.channel` the Redis operations as generators and the item encoding;
:mod:`tq_redis.channel.in_redis` the bounded driver that runs them; :mod:`tq_redis.channel.local` the
in-process channel.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from tq_redis.api.system import resolve_target
from tq_redis.channel.executor import ChannelWork, Executor, Start
from tq_redis.channel.in_redis import RedisOps, open_driver
from tq_redis.channel.local import LocalCore, LocalOps, local_core, new_local_core
from tq_redis.codec.item_classes import REGISTERED, class_path
from tq_redis.errors import ChannelClosed, ItemClassNotAllowed
from tq_redis.meta.keys import ChannelKeys
from tq_redis.ops.channel_rules import (
    DEFAULT_KEY,
    EXCEED,
    FIT,
    ONE,
    WeightedItem,
    check_maxsize,
    check_target,
    check_weight,
    deadline_after,
)
from tq_redis.reprs import attrs_repr

_EXEC_LOCK = threading.Lock()


def _reset_exec_lock() -> None:
    global _EXEC_LOCK
    _EXEC_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_exec_lock)


def _first(start: Start) -> Start:
    async def first(resource: Any) -> Any:
        return (await start(resource))[0]

    return first


class Channel:
    """A named set of FIFO queues (one per ``key``) shared by every process that knows the name.

    Build one with :meth:`create` or :meth:`connect`. Weights let ``get_batch`` pop as many
    items as fit a target (e.g. a number of tokens or samples). Calls through one object run in
    the order they were made, ``async_op=True`` ones included (see the module docstring). A
    ``Channel`` pickles to its name and address, so it can be handed to worker processes.
    """

    def __init__(self, name: str, redis_url: str | None, namespace: str | None, maxsize: int, *,
                 allow_pickle: bool = False, _local: LocalCore | None = None) -> None:
        self.name = name
        self.redis_url = redis_url
        self.namespace = namespace
        self._maxsize = maxsize
        self._allow_pickle = allow_pickle
        self._local = _local
        self._closed = False
        self._exec: Executor | None = None
        if _local is None:
            self._keys = ChannelKeys(namespace, name)
            self._ops: RedisOps | LocalOps = RedisOps(self._keys, allow_pickle)
        else:
            self._ops = LocalOps()

    @classmethod
    def create(cls, name: str, maxsize: int = 0, distributed: bool = False, node_rank: int = 0,
               local: bool = False, disable_distributed_log: bool = True, *, redis_url: str | None = None,
               namespace: str | None = None, allow_pickle: bool | None = None,
               item_classes: Iterable[type] = ()) -> Channel:
        """Create the channel ``name`` (or join an existing one with the same ``maxsize``).

        ``maxsize`` bounds each key's queue (0: unbounded). Without ``redis_url`` the channel
        lives where ``tq_redis.init()`` attached (or ``TQ_REDIS_URL``/``TQ_NAMESPACE``).
        ``distributed``, ``node_rank`` and ``disable_distributed_log`` are RLinf's placement
        options and have no effect: the channel is in Redis, reachable from every node.

        Items that are dataclasses or NamedTuples travel without pickle when their class is
        allowed: by default every class the program defines (:mod:`tq_redis.codec.item_classes`;
        a reader finds it among the modules it has loaded), and on the channel's list every class
        registered in this process (``tq_redis.register_item_class``) when it calls ``create``,
        and ``item_classes``. The list is kept with the channel, so every process that uses it
        allows them too (a reader imports a listed class by its path); another class's instance
        raises :class:`~tq_redis.errors.ItemClassNotAllowed` at ``put``, before anything is queued.

        ``local=True`` makes a channel of this process only, as in RLinf: its queues live in this
        process's memory (no Redis needed), items are kept as the objects themselves (tensors stay
        on their device), ``connect`` cannot reach it, and a copy sent to another process (pickled,
        or inherited through ``fork``) is a separate, empty channel there. Within the process every
        copy shares the queues. Everything else (keys, weights, ``maxsize``, blocking, timeouts,
        ``async_op``) works as for a shared channel.
        """
        check_maxsize(maxsize)
        if isinstance(distributed, str):  # the earlier signature took redis_url third
            redis_url, distributed = distributed, False
        if local:
            return cls(name, None, None, maxsize, _local=new_local_core(name, maxsize))
        paths = sorted(REGISTERED.paths() | {class_path(c) for c in item_classes})  # checked before any write
        url, ns, pickle_default = resolve_target(redis_url, namespace)
        chan = cls(name, url, ns, maxsize, allow_pickle=pickle_default if allow_pickle is None else allow_pickle)
        _, allowed = chan._call(chan._ops.create(maxsize, paths), None, False, False)
        chan._ops.classes.add(*item_classes, *allowed)
        return chan

    @classmethod
    def connect(cls, name: str, current_worker: Any = None, *, redis_url: str | None = None,
                namespace: str | None = None, allow_pickle: bool | None = None) -> Channel:
        """Attach to an existing channel; raises :class:`ChannelNotFound` if nobody created it.

        ``current_worker`` is RLinf's worker argument and is not needed here (a ``str`` in its
        place is taken as ``redis_url``, the earlier signature).
        """
        if isinstance(current_worker, str):
            redis_url = current_worker
        url, ns, pickle_default = resolve_target(redis_url, namespace)
        chan = cls(name, url, ns, 0, allow_pickle=pickle_default if allow_pickle is None else allow_pickle)
        chan._maxsize, allowed = chan._call(chan._ops.connect(), None, False, False)
        chan._ops.classes.add(*allowed)
        return chan

    def __reduce__(self):
        if self._local is not None:
            return (_attach_local, (self._local.token, self.name, self._maxsize))
        return (_attach, (self.name, self.redis_url, self.namespace, self._maxsize, self._allow_pickle))

    def __repr__(self) -> str:
        if getattr(self, "_local", None) is not None:
            return attrs_repr(self, ("name", "_maxsize", "is_local"))
        return attrs_repr(self, ("name", "_maxsize", "namespace"))

    def __str__(self) -> str:
        """The items of the default queue with their weights, as RLinf prints a channel:
        ``[WeightedItem(weight=1, item='a'), ...]``."""
        return str(self.peek_all())

    @property
    def maxsize(self) -> int:
        """Most entries each key's queue holds (0: unbounded)."""
        return self._maxsize

    @property
    def is_local(self) -> bool:
        """True for a channel made with ``local=True``."""
        return self._local is not None

    # -- running calls

    def _executor(self) -> Executor:
        if self._local is not None:
            return self._local.executor()
        ex = self._exec
        if ex is not None and ex.pid == os.getpid():
            return ex
        with _EXEC_LOCK:
            if self._closed:
                raise ChannelClosed(
                    f"channel handle {self.name!r} is closed; Channel.connect({self.name!r}) gives a new one"
                )
            if self._exec is None or self._exec.pid != os.getpid():  # first call, or a forked child
                url, ns, keys, pickle = self.redis_url, self.namespace, self._keys, self._allow_pickle
                self._exec = Executor(f"{ns}:{self.name}", lambda: open_driver(url, ns, keys, pickle),
                                      flush_at_exit=True)
                weakref.finalize(self, self._exec.close_soon).atexit = False
            return self._exec

    def _call(self, start: Start, lane: Any, is_put: bool, async_op: bool) -> Any:
        return self._executor().call(start, lane, is_put, async_op, self)

    # -- the queue API

    def _encoded_put(self, item: Any, weight: float, qkey: str, block: bool, deadline: float | None) -> Start:
        """The put's job, its item encoded now (so a bad item raises here, in the producer). A
        dataclass the handle does not know yet is looked up once in the channel's list in Redis:
        another process may have allowed it since this handle read the list."""
        try:
            return self._ops.put(item, weight, qkey, block, deadline)
        except ItemClassNotAllowed:
            if self._local is not None or not self._ops.classes.add(*self._call(self._ops.item_classes(),
                                                                                None, False, False)):
                raise
        return self._ops.put(item, weight, qkey, block, deadline)

    def put(self, item: Any, weight: float = 0, key: Any = DEFAULT_KEY, async_op: bool = False,
            timeout: float | None = None) -> ChannelWork | None:
        """Append ``item`` to queue ``key``, blocking while it is full (``TimeoutError`` after
        ``timeout`` seconds, if given). ``async_op=True`` returns a :class:`ChannelWork` at once;
        the put lands even if nobody waits on it. An item that cannot be encoded raises here, at
        once, ``async_op=True`` or not (:class:`~tq_redis.errors.UnsupportedValue`)."""
        check_weight(weight)
        deadline, qkey = deadline_after(timeout), self._ops.qkey(key)
        return self._call(self._encoded_put(item, weight, qkey, True, deadline), ("put", qkey), True, async_op)

    def put_nowait(self, item: Any, weight: float = 0, key: Any = DEFAULT_KEY) -> None:
        """Append ``item``; raises ``asyncio.QueueFull`` if the queue holds ``maxsize`` items."""
        check_weight(weight)
        qkey = self._ops.qkey(key)
        self._call(self._encoded_put(item, weight, qkey, False, None), None, True, False)

    def get(self, key: Any = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None) -> Any:
        """Pop the oldest item of queue ``key``, waiting for one (``TimeoutError`` after ``timeout``
        seconds, if given). ``async_op=True`` returns a :class:`ChannelWork` of the item."""
        deadline, qkey = deadline_after(timeout), self._ops.qkey(key)
        return self._call(_first(self._ops.pop(qkey, ONE, 0.0, True, deadline)), ("get", qkey), False, async_op)

    def get_nowait(self, key: Any = DEFAULT_KEY) -> Any:
        """Pop the oldest item; raises ``asyncio.QueueEmpty`` if there is none."""
        qkey = self._ops.qkey(key)
        return self._call(_first(self._ops.pop(qkey, ONE, 0.0, False, None)), None, False, False)

    def get_batch(self, target_weight: float = 0, key: Any = DEFAULT_KEY, async_op: bool = False,
                  timeout: float | None = None, *, allow_exceed: bool = False) -> list[Any] | ChannelWork:
        """Pop the oldest items of queue ``key`` by weight, all at once, oldest first.

        RLinf's rule: take head items while the next one still fits (taken weight + its weight <=
        ``target_weight``), stopping once the taken weight reaches the target. It waits while every
        queued item fits and together they weigh less than the target; it returns ``[]`` (taking
        nothing) when the head item alone is heavier than the target. With the default target 0
        it returns the head item if it weighs 0. ``allow_exceed=True`` instead takes the fewest
        head items whose weights reach the target (the last may overshoot it; target > 0).
        """
        target = check_target(target_weight, allow_exceed)
        deadline, qkey = deadline_after(timeout), self._ops.qkey(key)
        start = self._ops.pop(qkey, EXCEED if allow_exceed else FIT, target, True, deadline)
        return self._call(start, ("get", qkey), False, async_op)

    def peek_all(self, key: Any = DEFAULT_KEY) -> list[WeightedItem]:
        """The items queued under ``key`` with their weights, oldest first, without taking them."""
        return self._call(self._ops.peek(self._ops.qkey(key)), None, False, False)

    def qsize(self, key: Any = DEFAULT_KEY) -> int:
        """Number of items in queue ``key``."""
        return self._call(self._ops.qsize(self._ops.qkey(key)), None, False, False)

    def empty(self, key: Any = DEFAULT_KEY) -> bool:
        """True if queue ``key`` holds no item."""
        return self.qsize(key) == 0

    def full(self, key: Any = DEFAULT_KEY) -> bool:
        """True if queue ``key`` holds ``maxsize`` items (never for an unbounded channel)."""
        return self._maxsize > 0 and self.qsize(key) >= self._maxsize

    def delete(self) -> None:
        """Remove the channel and its queued items (call once nobody uses it)."""
        self._call(self._ops.delete(), None, False, False)

    def close(self, timeout: float | None = None) -> None:
        """Land every put issued through this object, then release its thread and connections.

        Gets still waiting fail with :class:`ChannelClosed`; calls made afterwards raise it. Raises
        ``TimeoutError`` if the puts have not landed within ``timeout`` seconds (they keep trying),
        and the error of an ``async_op=True`` put that failed with nobody calling ``wait()`` on it.
        The channel itself stays. A local channel has nothing to release: ``close`` does nothing.
        """
        if self._local is not None:
            return
        with _EXEC_LOCK:
            self._closed = True
            ex = self._exec
        if ex is not None and ex.pid == os.getpid():
            ex.close(timeout)


def _attach(name: str, redis_url: str, namespace: str, maxsize: int, allow_pickle: bool) -> Channel:
    return Channel(name, redis_url, namespace, maxsize, allow_pickle=allow_pickle)


def _attach_local(token: str, name: str, maxsize: int) -> Channel:
    return Channel(name, None, None, maxsize, _local=local_core(token, name, maxsize))
