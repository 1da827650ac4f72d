"""How a channel kept in Redis runs its calls: the driver of one handle and the jobs it runs.

:class:`RedisOps` turns each call on a :class:`tq_redis.Channel` into a
:data:`~tq_redis.channel.executor.Start` that runs one operation of :mod:`tq_redis.ops.channel` on
the handle's :class:`RedisDriver`: an ``AsyncDriver`` with a bounded pool of ``MAX_CONNECTIONS``
connections whose ``Wait`` effects share one blocked ``XREAD`` (:class:`StreamWatch`) on the
channel's ``puts``/``gets`` streams, so a handle uses at most ``MAX_CONNECTIONS`` + 1 connections
however many operations are in flight (on a Redis Cluster, where every key of a channel lives on
one node, a semaphore keeps at most ``MAX_CONNECTIONS`` commands in flight instead).
Store I/O runs inline on the handle's thread, in issue order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from tq_redis import ops
from tq_redis.channel.executor import Start, waiting
from tq_redis.client.driver import AsyncDriver
from tq_redis.client.plans import Plan, Sleep, Work
from tq_redis.codec.item_classes import REGISTERED, ItemClasses
from tq_redis.errors import ConfigError
from tq_redis.meta.keys import ChannelKeys
from tq_redis.ops import channel as channel_ops
from tq_redis.ops.channel import WAIT_SLICE_S, encode_item
from tq_redis.ops.channel_rules import key_token
from tq_redis.ops.effects import Wait
from tq_redis.redact import redact
from tq_redis.server import connections

MAX_CONNECTIONS = 8  # command connections per handle; waiting operations share one more
_WATCH_BLOCK_MS = 5000
_WATCH_COUNT = 128

logger = logging.getLogger(__name__)


def _stream_id(value: Any) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else str(value)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _xread_entries(reply: Any) -> Iterable[tuple[Any, list]]:
    if not reply:
        return []
    return reply.items() if isinstance(reply, dict) else [(r[0], r[1]) for r in reply]


class StreamWatch:
    """Wakes a handle's waiting operations when its channel's ``puts``/``gets`` stream grows.

    One dedicated connection blocks in a single ``XREAD`` over both streams on behalf of every
    waiting operation. An operation waits from the stream id its script returned; any newer entry
    wakes it to run its script again (the script, not the wake-up, decides).
    """

    def __init__(self, url: str, streams: tuple[str, str], commands: aioredis.Redis, name: str) -> None:
        self._url = url
        self._streams = streams
        self._commands = commands
        self._name = name
        self._conn: aioredis.Redis | None = None
        self._latest: dict[str, tuple[int, int]] = {}
        self._waiters: dict[str, list[tuple[tuple[int, int], asyncio.Future]]] = {s: [] for s in streams}
        self._task: asyncio.Task | None = None
        self._positions_lock = asyncio.Lock()

    async def wait(self, stream: str, last_id: str, timeout_s: float) -> None:
        seen = _stream_id(last_id)
        await self._know_positions()
        if seen < self._latest[stream]:
            return  # something newer is there already
        self._advance(stream, seen)
        entry = (seen, asyncio.get_running_loop().create_future())
        self._waiters[stream].append(entry)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())
        try:
            await asyncio.wait_for(entry[1], timeout_s)
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError):
                self._waiters[stream].remove(entry)

    async def _know_positions(self) -> None:
        if len(self._latest) == len(self._streams):
            return
        async with self._positions_lock:
            if len(self._latest) == len(self._streams):
                return
            pipe = self._commands.pipeline(transaction=False)
            for stream in self._streams:
                pipe.xrevrange(stream, count=1)
            for stream, last in zip(self._streams, await pipe.execute()):
                self._latest[stream] = max(self._latest.get(stream, (0, 0)), _stream_id(last[0][0]) if last else (0, 0))

    def _advance(self, stream: str, newest: tuple[int, int]) -> None:
        if newest <= self._latest[stream]:
            return
        self._latest[stream] = newest
        keep = []
        for seen, fut in self._waiters[stream]:
            if seen < newest:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((seen, fut))
        self._waiters[stream] = keep

    async def _watch(self) -> None:
        try:
            while any(self._waiters.values()):
                if self._conn is None:
                    self._conn = connections.async_client(
                        self._url, single_connection_client=True, client_name=self._name, health_check_interval=0,
                    )
                positions = {s: "{}-{}".format(*self._latest[s]) for s in self._streams}
                reply = await self._conn.xread(positions, count=_WATCH_COUNT, block=_WATCH_BLOCK_MS)
                for stream, entries in _xread_entries(reply):
                    if entries:
                        name = stream.decode() if isinstance(stream, bytes) else stream
                        self._advance(name, _stream_id(entries[-1][0]))
        except Exception as exc:  # the waiters re-run their scripts when their slice ends
            logger.warning("channel %r: watching its event streams failed (%r); waiting operations retry "
                           "every %.0f s until it recovers", self._name, exc, WAIT_SLICE_S)
            if self._conn is not None:
                await self._conn.aclose()
                self._conn = None

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None:
            await self._conn.aclose()


@dataclass(frozen=True, slots=True)
class _Watch:
    """An I/O request of this driver's own: a ``Wait`` effect, carried out by :class:`StreamWatch`."""

    wait: Wait


class RedisDriver(AsyncDriver):
    """``AsyncDriver`` for one channel handle: a bounded pool, waits through :class:`StreamWatch`,
    store I/O run inline on the handle's thread (in issue order)."""

    def __init__(self, url: str, namespace: str, keys: ChannelKeys, allow_pickle: bool) -> None:
        name = f"tq-channel:{namespace}:{keys.name}"
        super().__init__(url, client_name=name, max_connections=MAX_CONNECTIONS, wait_for_connection=True)
        # a cluster client's pool fails instead of waiting when full: hold a slot per command instead
        self._bound = asyncio.Semaphore(MAX_CONNECTIONS) if self.cluster else None
        # items come back as they were put: a field whose rows share a shape as a dense tensor
        self.ctx = ops.Context(namespace=namespace, redis_url=url, allow_pickle=allow_pickle, nested_output=False)
        self.watch = StreamWatch(url, (keys.puts, keys.gets), self.redis, name)

    def _attempt(self, effect: Any, notes: list[str]) -> Plan:
        if isinstance(effect, Wait):
            return (yield _Watch(effect))
        return (yield from super()._attempt(effect, notes))

    async def _perform(self, request: Any) -> Any:
        if isinstance(request, _Watch):
            with waiting():
                await self.watch.wait(request.wait.stream, request.wait.last_id, request.wait.timeout_s)
            return None
        if isinstance(request, Work):
            return request.fn(*request.args)
        if self._bound is None or isinstance(request, Sleep):
            return await super()._perform(request)
        async with self._bound:
            return await super()._perform(request)

    async def close(self) -> None:
        await self.watch.aclose()
        await self.redis.aclose()
        if not self.cluster:
            await self.redis.connection_pool.aclose()
        if self.ctx.storage is not None:
            self.ctx.storage.close()


def open_driver(url: str, namespace: str, keys: ChannelKeys, allow_pickle: bool) -> RedisDriver:
    """A handle's driver; a URL redis-py cannot use raises :class:`~tq_redis.errors.ConfigError`."""
    try:
        return RedisDriver(url, namespace, keys, allow_pickle)
    except ValueError as exc:  # redis-py's complaint about the URL
        raise ConfigError(f"cannot use Redis URL {redact(url)!r} for channel {keys.name!r}: {exc}") from exc


class RedisOps:
    """Builds the executor jobs of a channel kept in Redis (each runs one of :mod:`tq_redis.ops.channel`)."""

    def __init__(self, keys: ChannelKeys, allow_pickle: bool) -> None:
        self.keys = keys
        self.allow_pickle = allow_pickle
        self.classes = ItemClasses(parent=REGISTERED)  # the channel's item classes, as this handle knows them

    qkey = staticmethod(key_token)

    def create(self, maxsize: int, classes: list[str]) -> Start:
        return lambda drv: drv.run(channel_ops.create(drv.ctx, self.keys, maxsize, classes))

    def connect(self) -> Start:
        return lambda drv: drv.run(channel_ops.connect(self.keys))

    def item_classes(self) -> Start:
        return lambda drv: drv.run(channel_ops.item_class_paths(self.keys))

    def put(self, item: Any, weight: Any, qkey: str, block: bool, deadline: float | None) -> Start:
        enc = encode_item(item, self.allow_pickle, self.classes)  # now: errors raise here, later changes do not count
        return lambda drv: drv.run(channel_ops.put(drv.ctx, self.keys, enc, weight, qkey, block, deadline))

    def pop(self, qkey: str, mode: str, target: float, block: bool, deadline: float | None) -> Start:
        return lambda drv: drv.run(
            channel_ops.pop(drv.ctx, self.keys, qkey, mode, target, block, deadline, self.classes))

    def peek(self, qkey: str) -> Start:
        return lambda drv: drv.run(channel_ops.peek(drv.ctx, self.keys, qkey, self.classes))

    def qsize(self, qkey: str) -> Start:
        return lambda drv: drv.run(channel_ops.qsize(self.keys, qkey))

    def delete(self) -> Start:
        return lambda drv: drv.run(channel_ops.delete(drv.ctx, self.keys))
