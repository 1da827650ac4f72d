"""RLinf's local channel: queues in this process's memory, run by the same ordered executor.

``Channel.create(name, local=True)`` builds a :class:`LocalCore`: the channel's :class:`_LocalState`
(a deque of :class:`~tq_redis.ops.channel_rules.WeightedItem` per key, the items kept as the objects
themselves, touched only on the executor's thread) and its :class:`~tq_redis.channel.executor.Executor`.
Every copy of the channel in the process shares the core (found again by its token when unpickled);
in another process, or in a forked child, the token finds a fresh, empty one. :class:`LocalOps` turns
each call into the executor's job, as :class:`tq_redis.channel.in_redis.RedisOps` does for a channel in
Redis; a pop takes the head items the Lua scripts would (:func:`take_count`).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

from tq_redis.channel.executor import Executor, Start, waiting
from tq_redis.errors import InvalidArgument
from tq_redis.ops.channel_rules import FIT, ONE, WeightedItem


def take_count(weights: Iterable[float], mode: str, target: float) -> int | None:
    """How many head items a pop takes (the Lua scripts' rules), or None: wait for more."""
    taken, total = 0, 0.0
    for weight in weights:
        if mode == ONE:
            return 1
        if mode == FIT and total + weight > target:
            return taken
        taken += 1
        total += weight
        if total >= target:
            return taken
    return None


def _local_key(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise InvalidArgument(f"channel key must be hashable, got {type(key).__name__} {key!r}") from None
    return key


class _LocalState:
    """A local channel's queues: items kept as they are; touched only on its executor's thread."""

    def __init__(self, name: str, maxsize: int) -> None:
        self.name = name
        self.maxsize = maxsize
        self.queues: dict[Any, deque[WeightedItem]] = {}
        self._changed: asyncio.Future | None = None

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def _wait(self, deadline: float | None, what: str) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(what)
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        with waiting():
            try:
                await asyncio.wait_for(asyncio.shield(self._changed), remaining)
            except TimeoutError:
                raise TimeoutError(what) from None

    async def put(self, item: Any, weight: Any, key: Any, block: bool, deadline: float | None) -> None:
        while True:
            queue = self.queues.setdefault(key, deque())
            if self.maxsize <= 0 or len(queue) < self.maxsize:
                queue.append(WeightedItem(weight, item))
                self._notify()
                return
            if not block:
                raise asyncio.QueueFull(f"local channel {self.name!r} queue {key!r} is full")
            await self._wait(deadline, f"local channel {self.name!r} queue {key!r} stayed full")

    async def pop(self, key: Any, mode: str, target: float, block: bool, deadline: float | None) -> list[Any]:
        while True:
            queue = self.queues.get(key, ())
            count = take_count((w.weight for w in queue), mode, target)
            if count is not None:
                items = [queue.popleft().item for _ in range(count)]
                if items:
                    self._notify()
                return items
            if not block:
                raise asyncio.QueueEmpty(f"local channel {self.name!r} queue {key!r} is empty")
            await self._wait(deadline, f"not enough arrived in local channel {self.name!r} queue {key!r}")

    async def peek(self, key: Any) -> list[WeightedItem]:
        return list(self.queues.get(key, ()))

    async def qsize(self, key: Any) -> int:
        return len(self.queues.get(key, ()))

    async def clear(self) -> None:
        self.queues.clear()
        self._notify()

    async def close(self) -> None:
        self._notify()


class LocalCore:
    """A local channel in this process: its state and executor (a fresh, empty pair after a fork)."""

    def __init__(self, name: str, maxsize: int, token: str) -> None:
        self.name = name
        self.maxsize = maxsize
        self.token = token
        self._executor: Executor | None = None

    def executor(self) -> Executor:
        if self._executor is None or self._executor.pid != os.getpid():
            state = _LocalState(self.name, self.maxsize)
            self._executor = Executor(f"local:{self.name}", lambda: state, flush_at_exit=False)
            weakref.finalize(self, self._executor.close_soon).atexit = False
        return self._executor


class LocalOps:
    """Builds the executor jobs of a local channel."""

    qkey = staticmethod(_local_key)

    def put(self, item: Any, weight: Any, qkey: Any, block: bool, deadline: float | None) -> Start:
        return lambda st: st.put(item, weight, qkey, block, deadline)

    def pop(self, qkey: Any, mode: str, target: float, block: bool, deadline: float | None) -> Start:
        return lambda st: st.pop(qkey, mode, target, block, deadline)

    def peek(self, qkey: Any) -> Start:
        return lambda st: st.peek(qkey)

    def qsize(self, qkey: Any) -> Start:
        return lambda st: st.qsize(qkey)

    def delete(self) -> Start:
        return lambda st: st.clear()


_LOCAL_CORES: weakref.WeakValueDictionary[str, LocalCore] = weakref.WeakValueDictionary()


def new_local_core(name: str, maxsize: int) -> LocalCore:
    """A new local channel of this process, found again by its token when a copy is unpickled."""
    if not isinstance(name, str):
        raise InvalidArgument(f"channel name must be a str, got {name!r}")
    core = LocalCore(name, maxsize, uuid.uuid4().hex)
    _LOCAL_CORES[core.token] = core
    return core


def local_core(token: str, name: str, maxsize: int) -> LocalCore:
    """The local channel of ``token`` in this process; in another process its own, empty one."""
    core = _LOCAL_CORES.get(token)
    if core is None:
        core = LocalCore(name, maxsize, token)
        _LOCAL_CORES[token] = core
    return core
