"""Drivers that run operations written once as generators, synchronously or with asyncio.

Every client operation in :mod:`tq_redis.ops` is a generator that *yields effects* (a Redis
command, a function call, a pipeline, blocking store I/O, a wait on an event stream, a pause) and receives
their results. What each effect takes -- which commands go where, what is retried, how long to wait,
which error the operation is handed -- is decided once, in :mod:`tq_redis.client.plans`, as a
generator of low-level I/O requests. The drivers here only carry those requests out:
:class:`SyncDriver` with redis-py's blocking client, :class:`AsyncDriver` with ``redis.asyncio``,
moving blocking store I/O to a worker thread. So ``TransferQueueClient`` and
``AsyncTransferQueueClient`` share one implementation, and a retry rule is one edit.

Both get their Redis client from :mod:`tq_redis.server.connections`, so the same URL works for a single
server and for any node of a Redis Cluster. On a cluster a function call goes to the primary that
owns its first key (every key of a call shares that key's hash tag), a pipeline is split per node
by redis-py, and the function library is kept on every primary: loaded on all of them at first use,
its version checked once per node, and reloaded on the node that lost it (a restart without
persistence, ``FUNCTION FLUSH``, a new primary after a failover) when a call there fails with
"Function not found" -- that call is then retried once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis

from tq_redis.client.plans import Batch, Call, Plan, Plans, Sleep, Steps, Work
from tq_redis.ops.effects import Operation
from tq_redis.server import connections


class SyncDriver(Plans):
    """Runs operations with a blocking redis-py client (one connection pool per driver)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        if self.durable.enabled:  # refuse an unfit server now (a server that is down is asked at first use)
            try:
                self._wait(self._check_durable())
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                pass

    def run(self, op: Operation) -> Any:
        """Drive ``op`` to completion and return its result (durable mode: see :mod:`tq_redis.server.durability`)."""
        return self._wait(self.operation(op))

    def ensure_loaded(self, force: bool = False, nodes: list[Any] | None = None) -> None:
        """Check that the nodes run this library, loading it where allowed (:meth:`Plans._ensure_loaded`)."""
        self._wait(self._ensure_loaded(force, nodes))

    def _wait(self, plan: Plan) -> Any:
        """Carry out ``plan``'s requests one by one, blocking; its result."""
        steps = Steps(plan)
        for request in steps:
            try:
                steps.answer(self._perform(request))
            except Exception as exc:  # thrown into the plan, which decides
                steps.answer(error=exc)
        return steps.result

    def _perform(self, request: Any) -> Any:
        if isinstance(request, Call):
            return getattr(self.redis, request.method)(*request.args, **request.kwargs)
        if isinstance(request, Batch):
            return self._pipeline(request.commands).execute(raise_on_error=False)
        if isinstance(request, Sleep):
            return time.sleep(request.seconds)
        if isinstance(request, Work):
            return request.fn(*request.args)
        raise TypeError(f"unknown request {request!r}")

    def close(self) -> None:
        self.redis.close()


class AsyncDriver(Plans):
    """Runs the same operations with ``redis.asyncio``; store I/O goes to a worker thread.

    Takes the same arguments as :class:`SyncDriver`; the client connects on first use (durable mode's
    server check comes with the first wait).
    """

    _client = staticmethod(connections.async_client)
    _connects_lazily = True

    async def run(self, op: Operation) -> Any:
        """Drive ``op`` to completion and return its result (durable mode: see :mod:`tq_redis.server.durability`)."""
        return await self._wait(self.operation(op))

    async def ensure_loaded(self, force: bool = False, nodes: list[Any] | None = None) -> None:
        """As :meth:`SyncDriver.ensure_loaded`."""
        await self._wait(self._ensure_loaded(force, nodes))

    async def _wait(self, plan: Plan) -> Any:
        """Carry out ``plan``'s requests one by one, awaiting each; its result."""
        steps = Steps(plan)
        for request in steps:
            try:
                reply = await self._perform(request)
            except Exception as exc:  # thrown into the plan, which decides
                steps.answer(error=exc)
            else:
                steps.answer(reply)
        return steps.result

    async def _perform(self, request: Any) -> Any:
        """One request, awaited; a subclass may carry out some of them its own way."""
        if isinstance(request, Call):
            return await getattr(self.redis, request.method)(*request.args, **request.kwargs)
        if isinstance(request, Batch):
            return await self._pipeline(request.commands).execute(raise_on_error=False)
        if isinstance(request, Sleep):
            return await asyncio.sleep(request.seconds)
        if isinstance(request, Work):
            return await asyncio.to_thread(request.fn, *request.args)
        raise TypeError(f"unknown request {request!r}")

    async def close(self) -> None:
        await self.redis.aclose()
