"""``AsyncTransferQueueClient``: the asyncio client.

The blocking ``TransferQueueClient`` (:mod:`tq_redis.client.blocking`) subclasses it, as the reference
system's does, so one client object offers both ``put`` and ``await async_put``. Both run the
same operations from :mod:`tq_redis.ops`; only the driver differs.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from tensordict import TensorDict

from tq_redis import ops
from tq_redis.client import checkpoint, liveness
from tq_redis.client.driver import AsyncDriver, SyncDriver
from tq_redis.client.methods import awaiting
from tq_redis.errors import LeaseError
from tq_redis.meta import BatchMeta, KVBatchMeta
from tq_redis.ops import arguments, identity, kv, partial, ratelimit, replay, reservations, shared, streaming, watch
from tq_redis.reprs import attrs_repr
from tq_redis.server.identity import Identity

R = TypeVar("R")


def lease_task(metadata: BatchMeta) -> str:
    """The task a leased batch belongs to (recorded by ``get_meta``)."""
    arguments.batch_meta(metadata, "ack/nack/extend_lease")
    task = metadata.get_extra_info("task_name")
    if task is None or metadata.get_extra_info("delivery_counts") is None:
        raise LeaseError("this BatchMeta holds no lease; get_meta(..., lease_s=S) hands out leased batches")
    return task


def make_context(redis_url: str, namespace: str, options: dict[str, Any]) -> ops.Context:
    """The context a client's operations run with: its namespace and its options (``allow_pickle``,
    ``nested_output``, ``strict_schema``, ``sampler``: the default sampler, see the client's ``sampler``)."""
    return ops.Context(
        namespace=namespace,
        redis_url=redis_url,
        allow_pickle=bool(options.get("allow_pickle", False)),
        nested_output=bool(options.get("nested_output", True)),
        strict_schema=bool(options.get("strict_schema", False)),
        default_sampler=options.get("sampler"),
    )


class _CheckpointView:
    """What :mod:`tq_redis.client.checkpoint` needs of a client
    (:class:`~tq_redis.client.checkpoint.CheckpointClient`), for the asyncio client: its namespace and
    context (so its store), and a blocking driver of its own, opened for one checkpoint in the worker
    thread that runs it and closed after (redis.asyncio connections cannot be used from there)."""

    def __init__(self, client: AsyncTransferQueueClient) -> None:
        self.namespace = client.namespace
        self._ctx = client.context
        self._identity = client._identity
        self._driver = SyncDriver(client.redis_url)

    @property
    def redis(self) -> Any:
        """The view's own redis-py client."""
        return self._driver.redis

    @property
    def context(self) -> ops.Context:
        """The client's context: its namespace, options and store."""
        return self._ctx

    def run(self, op: ops.Op[R]) -> R:
        """Run an operation to its result, blocking."""
        return self._driver.run(op)

    def _restore_identity(self) -> None:
        """A checkpoint is loaded: the client takes up the namespace's epoch (drawn if it has none)."""
        self._driver.run(identity.restore(self._identity))

    def close(self) -> None:
        """Close the view's Redis connections."""
        self._driver.close()


class AsyncTransferQueueClient:
    """Asyncio client of one namespace. Stateless apart from its connection pool.

    Args:
        redis_url: the metadata plane, e.g. ``redis://host:6379/0``.
        namespace: key prefix; clients of one job share it, other jobs use another.
        client_id: a name for logs and metrics (random by default).
        allow_pickle: pickle values the safe encoding cannot represent (and unpickle them on read).
        nested_output: True (the default, the reference's layout): every tensor field whose
            samples have dimensions comes back as a jagged nested tensor. False: a field whose
            samples share one shape comes back dense.
        strict_schema: raise ``ShapeConflict``/``DTypeConflict`` when a put's shape or dtype
            differs from the field's first put, instead of making the field jagged (the
            reference's behaviour, the default).
        live: count this process as a live client of the namespace while the client is open
            (a heartbeat thread per process and namespace, see :mod:`tq_redis.client.liveness`);
            False for admin tools that must not keep a namespace in use.
        sampler: the default sampler of this client's ``get_meta`` (a built-in's name, a
            :class:`~tq_redis.samplers.BaseSampler` subclass or an instance); None (the default):
            the one ``init`` recorded for the namespace (``<ns>:config``). ``init``'s own client
            gets the config's ``sampler``; ``sampling_config["sampler"]`` wins over both.
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str = "tq",
        client_id: str | None = None,
        *,
        allow_pickle: bool = False,
        nested_output: bool = True,
        strict_schema: bool = False,
        live: bool = True,
        sampler: Any = None,
    ) -> None:
        self.redis_url = redis_url
        self.namespace = namespace
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:8]}"
        # the namespace's epoch, learned before the first call and checked on every new connection
        # and heartbeat: a server that lost the namespace is refused (tq_redis.server.identity)
        self._identity = Identity(redis_url, namespace)
        self._ctx = make_context(redis_url, namespace, {
            "allow_pickle": allow_pickle, "nested_output": nested_output, "strict_schema": strict_schema,
            "sampler": sampler,
        })
        self._ctx.identity = self._identity
        # redis.asyncio connections belong to the loop that opened them: one driver per loop.
        self._async_drivers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncDriver] = (
            weakref.WeakKeyDictionary()
        )
        self._open()
        # this process counts as a live client of the namespace while a client is open (a
        # heartbeat thread per process and namespace: tq-redis namespace list / drop read it),
        # from its first operation that succeeded: a refused server (eviction policy, credentials)
        # gets nothing written
        self._attached = False
        self._unattached = live
        self._attach_lock = threading.Lock()

    def _open(self) -> None:
        """Open the connections this client needs before its first call: none here (a driver is
        opened per event loop on first use); the blocking client opens its own driver."""

    def __repr__(self) -> str:
        return attrs_repr(self, ("namespace", "client_id"))

    @property
    def context(self) -> ops.Context:
        """What operations of :mod:`tq_redis.ops` (and the facades' own) run against: the
        namespace, this client's options and its data plane. Pass it to an operation and run
        that with :meth:`arun` (or ``TransferQueueClient.run``)."""
        return self._ctx

    async def arun(self, op: ops.Op[R]) -> R:
        """Run one operation (a generator of effects, see :mod:`tq_redis.client.driver`) on this loop."""
        self._identity.check()
        if self._identity.epoch is None:  # the first call learns the namespace's epoch first
            op = identity.learned_first(self._identity, op)
        result = await self._async_driver().run(op)
        if self._unattached:
            self._attach()
        return result

    def _attach(self) -> None:
        """Count this process as a live client of the namespace (once per client)."""
        with self._attach_lock:
            if self._unattached:
                self._unattached = False
                self._attached = True
                liveness.attach(self.redis_url, self.namespace, self._identity)

    def _async_driver(self) -> AsyncDriver:
        loop = asyncio.get_running_loop()
        driver = self._async_drivers.get(loop)
        if driver is None:
            driver = self._async_drivers[loop] = AsyncDriver(
                self.redis_url, on_connect=self._identity.check_connection_async
            )
        return driver

    # the parameters and result types of these are their operations' (written once, there)
    async_get_meta = awaiting(ops.get_meta, doc="See :meth:`tq_redis.TransferQueueClient.get_meta`.")

    async_put = awaiting(ops.put, doc="See :meth:`tq_redis.TransferQueueClient.put`.")

    async def async_get_data(self, metadata: BatchMeta) -> TensorDict:
        return await self.arun(ops.get_data(self._ctx, metadata))

    async_get_meta_and_data = awaiting(
        ops.get_meta_and_data, doc="See :meth:`tq_redis.TransferQueueClient.get_meta_and_data`."
    )

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        await self.arun(ops.set_custom_meta(self._ctx, metadata))

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        await self.arun(ops.clear_samples(self._ctx, metadata))

    async def async_clear_partition(self, partition_id: str) -> None:
        await self.arun(ops.clear_partition(self._ctx, partition_id))

    async def async_get_production_status(
        self, data_fields: Sequence[str], partition_id: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return await self.arun(ops.production_status(self._ctx, data_fields, partition_id))

    async def async_get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return await self.arun(ops.consumption_status(self._ctx, task_name, partition_id))

    async def async_check_production_status(self, data_fields: Sequence[str], partition_id: str) -> bool:
        _, status = await self.async_get_production_status(data_fields, partition_id)
        return bool(len(status) and status.all())

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        _, status = await self.async_get_consumption_status(task_name, partition_id)
        return bool(len(status) and status.all())

    async def async_reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        return await self.arun(ops.reset_consumption(self._ctx, partition_id, task_name))

    async def async_get_partition_list(self) -> list[str]:
        return await self.arun(ops.get_partition_list(self._ctx))

    async def async_ack(self, metadata: BatchMeta) -> None:
        """As :meth:`TransferQueueClient.ack`."""
        return await self.arun(ops.settle(self._ctx, metadata, lease_task(metadata), "ack"))

    async def async_nack(self, metadata: BatchMeta) -> list[int]:
        """As :meth:`TransferQueueClient.nack`."""
        return await self.arun(ops.settle(self._ctx, metadata, lease_task(metadata), "nack"))

    async def async_extend_lease(self, metadata: BatchMeta, seconds: float) -> None:
        """As :meth:`TransferQueueClient.extend_lease`."""
        return await self.arun(ops.settle(self._ctx, metadata, lease_task(metadata), "extend", seconds))

    # -- KV API (tq_redis.ops.kv) and streaming (tq_redis.ops.streaming) --------------------------------

    async def async_kv_put(self, key: str, partition_id: str, fields: Any = None,
                           tag: dict[str, Any] | None = None,
                           data_parser: kv.DataParser | None = None) -> KVBatchMeta:
        """See :meth:`tq_redis.TransferQueueClient.kv_put`."""
        tags = None if tag is None else [tag]
        return await self.arun(kv.batch_put(self._ctx, [key], partition_id, fields, tags, data_parser,
                                                   single=True))

    async def async_kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None,
                                 tags: list[dict[str, Any]] | None = None,
                                 data_parser: kv.DataParser | None = None) -> KVBatchMeta:
        """See :meth:`tq_redis.TransferQueueClient.kv_batch_put`."""
        return await self.arun(kv.batch_put(self._ctx, keys, partition_id, fields, tags, data_parser))

    async def async_kv_batch_get(self, keys: list[str] | str, partition_id: str,
                                 select_fields: list[str] | str | None = None) -> TensorDict:
        """See :meth:`tq_redis.TransferQueueClient.kv_batch_get`."""
        return await self.arun(kv.batch_get(self._ctx, keys, partition_id, select_fields))

    async def async_kv_batch_get_by_meta(self, meta: KVBatchMeta,
                                         select_fields: list[str] | str | None = None) -> TensorDict:
        """See :meth:`tq_redis.TransferQueueClient.kv_batch_get_by_meta`."""
        return await self.arun(kv.batch_get_by_meta(self._ctx, meta, select_fields))

    async def async_kv_list(
        self, partition_id: str | None = None, *, where: dict[str, Any] | None = None
    ) -> dict[str, dict[str, dict[str, Any]]]:
        """See :meth:`tq_redis.TransferQueueClient.kv_list`."""
        return await self.arun(kv.list_keys(self._ctx, partition_id, where))

    async_kv_watch = awaiting(watch.kv_watch, doc="See :meth:`tq_redis.TransferQueueClient.kv_watch`.")

    async def async_kv_clear(self, keys: list[str] | str, partition_id: str) -> None:
        """See :meth:`tq_redis.TransferQueueClient.kv_clear`."""
        await self.arun(kv.clear(self._ctx, keys, partition_id))

    async def async_kv_retrieve_meta(self, keys: list[str] | str, partition_id: str,
                                     create: bool = False) -> BatchMeta:
        """See :meth:`tq_redis.TransferQueueClient.kv_retrieve_meta`."""
        return await self.arun(kv.retrieve_meta(self._ctx, keys, partition_id, create))

    async def async_kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        """See :meth:`tq_redis.TransferQueueClient.kv_retrieve_keys`."""
        return await self.arun(kv.retrieve_keys(self._ctx, global_indexes, partition_id))

    async def async_seal_partition(self, partition_id: str) -> bool:
        """See :meth:`tq_redis.TransferQueueClient.seal_partition`."""
        return await self.arun(streaming.seal_partition(self._ctx, partition_id))

    async def async_reopen_partition(self, partition_id: str) -> bool:
        """See :meth:`tq_redis.TransferQueueClient.reopen_partition`."""
        return await self.arun(streaming.reopen_partition(self._ctx, partition_id))

    async_reserve_group = awaiting(
        reservations.reserve_group, doc="See :meth:`tq_redis.TransferQueueClient.reserve_group`."
    )
    async_put_shared = awaiting(shared.put_shared, doc="See :meth:`tq_redis.TransferQueueClient.put_shared`.")
    async_commit_group = awaiting(
        reservations.commit_group, doc="See :meth:`tq_redis.TransferQueueClient.commit_group`."
    )
    async_abort_group = awaiting(reservations.abort_group, doc="See :meth:`tq_redis.TransferQueueClient.abort_group`.")
    async_extend_reservation = awaiting(
        reservations.extend_reservation, doc="See :meth:`tq_redis.TransferQueueClient.extend_reservation`."
    )
    async_set_policy_version = awaiting(
        reservations.set_policy_version, doc="See :meth:`tq_redis.TransferQueueClient.set_policy_version`."
    )
    async_set_staleness_bound = awaiting(
        reservations.set_staleness_bound, doc="See :meth:`tq_redis.TransferQueueClient.set_staleness_bound`."
    )
    async_update_priority = awaiting(
        replay.update_priority, doc="See :meth:`tq_redis.TransferQueueClient.update_priority`."
    )
    async_set_rate_limit = awaiting(
        ratelimit.set_rate_limit, doc="See :meth:`tq_redis.TransferQueueClient.set_rate_limit`."
    )
    async_get_rate_limit = awaiting(
        ratelimit.get_rate_limit, doc="See :meth:`tq_redis.TransferQueueClient.get_rate_limit`."
    )

    async_append_parts = awaiting(partial.append_parts, doc="See :meth:`tq_redis.TransferQueueClient.append_parts`.")
    async_complete_parts = awaiting(
        partial.complete_parts, doc="See :meth:`tq_redis.TransferQueueClient.complete_parts`."
    )

    # -- the reference client's checkpoint calls (as in TransferQueueClient: with no controller state
    # outside Redis, each writes or reads a whole checkpoint of the namespace; tq_redis.client.checkpoint).
    # The checkpoint's I/O is blocking (Redis, the store, the files): it runs in a worker thread.

    def _run_checkpoint(self, step: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run ``step`` (:func:`tq_redis.client.checkpoint.save` or ``load``) blocking, for this
        client: with a blocking driver opened for it and closed after (the blocking client uses its own)."""
        view = _CheckpointView(self)
        try:
            return step(view, *args, **kwargs)
        finally:
            view.close()

    async def async_save_controller_checkpoint(self, path: str) -> None:
        """Save the namespace's metadata to the directory ``path`` (a store's bytes left out where the
        store allows), off the event loop. See :meth:`TransferQueueClient.save_controller_checkpoint`."""
        await asyncio.to_thread(self._run_checkpoint, checkpoint.save, path, include_storage=False)

    async def async_load_controller_checkpoint(self, path: str, *, replace: bool = False) -> None:
        """Load the checkpoint in ``path`` into the namespace, off the event loop. See
        :meth:`TransferQueueClient.load_controller_checkpoint` (``replace``)."""
        await asyncio.to_thread(self._run_checkpoint, checkpoint.load, path, replace=replace)

    async def async_save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        """Save the namespace, its stored bytes included, to the directory ``checkpoint_dir``, off the
        event loop. See :meth:`TransferQueueClient.save_storage_checkpoint`."""
        await asyncio.to_thread(self._run_checkpoint, checkpoint.save, checkpoint_dir)

    async def async_load_storage_checkpoint(self, checkpoint_dir: str, *, replace: bool = False) -> None:
        """Load the checkpoint in ``checkpoint_dir`` (bytes included) into the namespace, off the
        event loop. See :meth:`TransferQueueClient.load_controller_checkpoint` (``replace``)."""
        await asyncio.to_thread(self._run_checkpoint, checkpoint.load, checkpoint_dir, replace=replace)

    async def async_close(self) -> None:
        """Close this event loop's Redis pool and the store connections."""
        driver = self._async_drivers.pop(asyncio.get_running_loop(), None)
        if driver is not None:
            await driver.close()
        if self._ctx.storage is not None:
            self._ctx.storage.close()
        self._detach()

    def close(self) -> None:
        """Drop the store connections (each Redis pool closes with its event loop)."""
        self._async_drivers.clear()
        if self._ctx.storage is not None:
            self._ctx.storage.close()
        self._detach()

    def _detach(self) -> None:
        """This client closed: it no longer keeps the process a live client of the namespace."""
        with self._attach_lock:
            self._unattached = False
            if self._attached:
                self._attached = False
                liveness.detach(self.redis_url, self.namespace, self._identity)
