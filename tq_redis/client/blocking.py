"""``TransferQueueClient``: the blocking client, a thin driver of the operations in :mod:`tq_redis.ops`.

It subclasses :class:`~tq_redis.client.aio.AsyncTransferQueueClient` (as the reference system's
client does), so the same object also offers every ``async_*`` coroutine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from tensordict import TensorDict

from tq_redis import ops
from tq_redis.client import checkpoint
from tq_redis.client.aio import AsyncTransferQueueClient, lease_task
from tq_redis.client.driver import SyncDriver
from tq_redis.client.methods import blocking
from tq_redis.meta import BatchMeta, KVBatchMeta
from tq_redis.ops import identity, kv, partial, ratelimit, replay, reservations, shared, streaming, watch

R = TypeVar("R")


class TransferQueueClient(AsyncTransferQueueClient):
    """Blocking client of one namespace; safe to share between threads.

    Any number of processes, on any number of machines, may each hold one: they need only the
    Redis URL and the namespace. There is no controller process. The ``async_*`` coroutines of
    :class:`AsyncTransferQueueClient` work on it too (one Redis pool per event loop).

    Args:
        redis_url: the metadata plane, e.g. ``redis://host:6379/0``.
        namespace: key prefix; clients of one job share it, other jobs use another.
        client_id: a name for logs and metrics (random by default).
        allow_pickle: pickle values the safe encoding cannot represent (and unpickle them on read).
        nested_output: True (default, the reference's layout): tensor fields with per-sample
            dimensions come back as jagged nested tensors; False: a field whose samples share
            one shape comes back dense.
        strict_schema: raise on a put whose shape/dtype differs from the field's first put
            instead of making the field jagged (the default, as the reference does).
        live: count this process as a live client of the namespace while the client is open
            (see :mod:`tq_redis.client.liveness`); False for admin tools.
        sampler: the default sampler of ``get_meta`` (a built-in's name, a class or an instance);
            None: the namespace's, recorded by ``init``. ``init``'s own client gets the config's.
    """

    def _open(self) -> None:
        """Open the blocking driver, shared by every thread."""
        self._driver = SyncDriver(self.redis_url, on_connect=self._identity.check_connection)

    def run(self, op: ops.Op[R]) -> R:
        """Run one operation (a generator of effects, see :mod:`tq_redis.client.driver`) to its result,
        blocking. Facades (dock, channel, data loader, checkpoints) build their own operations
        on :attr:`context` and run them here. Raises ``ServerStateLost`` once the server was found
        to have lost the namespace (:mod:`tq_redis.server.identity`)."""
        self._identity.check()
        if self._identity.epoch is None:  # the first call learns the namespace's epoch first
            op = identity.learned_first(self._identity, op)
        result = self._driver.run(op)
        if self._unattached:  # the first operation that succeeded: a live client from here on
            self._attach()
        return result

    @property
    def redis(self):
        """The underlying redis-py client (for inspection and tools)."""
        return self._driver.redis

    # -- the reference client's checkpoint calls. tq-redis keeps no controller state apart from
    # Redis, so each writes (or reads) a whole checkpoint of this client's namespace in a directory
    # (tq_redis.client.checkpoint): the "controller" ones without a store's bytes where the store allows.

    def save_controller_checkpoint(self, path: str) -> None:
        """Save the namespace's metadata to the directory ``path`` (``include_storage=False``)."""
        checkpoint.save(self, path, include_storage=False)

    def load_controller_checkpoint(self, path: str, *, replace: bool = False) -> None:
        """Load the checkpoint in ``path`` into the namespace (all or nothing: every file is checked
        before the first write). A namespace holding data is refused with ``NamespaceNotEmpty``
        unless ``replace=True``, which clears it first (its bytes leave every store)."""
        checkpoint.load(self, path, replace=replace)

    def save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        """Save the namespace, its stored bytes included, to the directory ``checkpoint_dir``."""
        checkpoint.save(self, checkpoint_dir)

    def load_storage_checkpoint(self, checkpoint_dir: str, *, replace: bool = False) -> None:
        """Load the checkpoint in ``checkpoint_dir`` (bytes included) into the namespace; as
        :meth:`load_controller_checkpoint` (``replace``)."""
        checkpoint.load(self, checkpoint_dir, replace=replace)

    def _restore_identity(self) -> None:
        """A checkpoint is loaded: this client takes up the namespace's epoch (drawn if it has none)
        and stops refusing calls (:mod:`tq_redis.server.identity`)."""
        self._driver.run(identity.restore(self._identity))

    def _run_checkpoint(self, step: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """The ``async_*`` checkpoint calls (inherited) run ``step`` with this client's own driver."""
        return step(self, *args, **kwargs)

    # the parameters and result types of get_meta, put and get_meta_and_data are their operations'
    # (written once, there; type checkers see them through blocking's ParamSpec)
    get_meta = blocking(ops.get_meta, doc="""
        Get the metadata of a batch.

        ``mode="fetch"``: ``batch_size`` samples whose ``data_fields`` are all produced and which
        ``task_name`` has not consumed, marked consumed atomically (or leased for ``lease_s``
        seconds: then ``ack``/``nack``/``extend_lease`` it). Never a partial batch: if too few are
        ready, wait up to ``timeout`` seconds on the partition's event stream, then return an
        empty ``BatchMeta``. ``mode="force_fetch"``: every sample of the partition with its
        production status; nothing is marked.
        """)

    put = blocking(ops.put, doc="""
        Without metadata: insert new samples into ``partition_id`` (fresh, never-reused ids).
        With metadata: write (or overwrite) these fields of those samples. Bytes are stored before
        the samples become visible. Returns the metadata with the fields added.""")

    def get_data(self, metadata: BatchMeta) -> TensorDict:
        """The fields of ``metadata`` as a TensorDict in ``metadata.global_indexes`` order."""
        return self.run(ops.get_data(self._ctx, metadata))

    get_meta_and_data = blocking(ops.get_meta_and_data, doc="""
        Claim a batch and read it: ``get_meta(mode="fetch")`` with these arguments, then
        ``get_data`` of what it claimed, returned as ``(meta, data)``. Values kept inline (at most
        ``storage.inline_max_bytes`` each) come back with the claim itself, so a batch of small
        samples costs one round trip instead of two. An empty claim returns an empty
        ``BatchMeta`` and an empty TensorDict.
        """)

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store ``metadata.custom_meta`` as per-sample tags (e.g. ``total_lengths``)."""
        self.run(ops.set_custom_meta(self._ctx, metadata))

    def clear_samples(self, metadata: BatchMeta) -> None:
        """Remove these samples and their bytes. Idempotent."""
        self.run(ops.clear_samples(self._ctx, metadata))

    def clear_partition(self, partition_id: str) -> None:
        """Remove the partition and its bytes. Idempotent; ids are not reused afterwards."""
        self.run(ops.clear_partition(self._ctx, partition_id))

    def get_production_status(self, data_fields: Sequence[str], partition_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(global_indexes, status)``; status is 1 where every field is produced."""
        return self.run(ops.production_status(self._ctx, data_fields, partition_id))

    def get_consumption_status(self, task_name: str, partition_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(global_indexes, status)``; status is 1 where ``task_name`` consumed the sample."""
        return self.run(ops.consumption_status(self._ctx, task_name, partition_id))

    def check_production_status(self, data_fields: Sequence[str], partition_id: str) -> bool:
        """True when the partition has samples and every one has all ``data_fields``."""
        _, status = self.get_production_status(data_fields, partition_id)
        return bool(len(status) and status.all())

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """True when the partition has samples and ``task_name`` consumed every one."""
        _, status = self.get_consumption_status(task_name, partition_id)
        return bool(len(status) and status.all())

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Let ``task_name`` (or every task) consume the partition again. False if it does not exist."""
        return self.run(ops.reset_consumption(self._ctx, partition_id, task_name))

    def get_partition_list(self) -> list[str]:
        """Partition ids of the namespace, oldest first."""
        return self.run(ops.get_partition_list(self._ctx))

    def ack(self, metadata: BatchMeta) -> None:
        """Mark a leased batch consumed for good. Samples whose lease this holder lost (it lapsed
        on the server's clock and they were handed out again) do not count: the rest is acked, then
        :class:`~tq_redis.errors.LeaseLost` names them. Sending the same ack again is no error."""
        return self.run(ops.settle(self._ctx, metadata, lease_task(metadata), "ack"))

    def nack(self, metadata: BatchMeta) -> list[int]:
        """Hand a leased batch back now, so the task can claim it again. Returns the ids whose lease
        this holder no longer held (handed back or out again already: nothing to do for them)."""
        return self.run(ops.settle(self._ctx, metadata, lease_task(metadata), "nack"))

    def extend_lease(self, metadata: BatchMeta, seconds: float) -> None:
        """Keep a leased batch for ``seconds`` more from now on the server's clock. Raises
        :class:`~tq_redis.errors.LeaseLost` (after extending the rest) for samples no longer held."""
        return self.run(ops.settle(self._ctx, metadata, lease_task(metadata), "extend", seconds))

    # -- KV API (tq_redis.ops.kv) and streaming (tq_redis.ops.streaming) --------------------------------

    def kv_put(self, key: str, partition_id: str, fields: Any = None, tag: dict[str, Any] | None = None,
               data_parser: kv.DataParser | None = None) -> KVBatchMeta:
        """Put one key's fields (one sample's values) and/or tag; see :func:`tq_redis.kv_put`."""
        tags = None if tag is None else [tag]
        return self.run(kv.batch_put(self._ctx, [key], partition_id, fields, tags, data_parser,
                                             single=True))

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None,
                     tags: list[dict[str, Any]] | None = None,
                     data_parser: kv.DataParser | None = None) -> KVBatchMeta:
        """Put a batch by keys; see :func:`tq_redis.kv_batch_put`."""
        return self.run(kv.batch_put(self._ctx, keys, partition_id, fields, tags, data_parser))

    def kv_batch_get(self, keys: list[str] | str, partition_id: str,
                     select_fields: list[str] | str | None = None) -> TensorDict:
        """Fields of keys in key order; see :func:`tq_redis.kv_batch_get`."""
        return self.run(kv.batch_get(self._ctx, keys, partition_id, select_fields))

    def kv_batch_get_by_meta(self, meta: KVBatchMeta,
                             select_fields: list[str] | str | None = None) -> TensorDict:
        """:meth:`kv_batch_get` of a :class:`KVBatchMeta`."""
        return self.run(kv.batch_get_by_meta(self._ctx, meta, select_fields))

    def kv_list(
        self, partition_id: str | None = None, *, where: dict[str, Any] | None = None
    ) -> dict[str, dict[str, dict[str, Any]]]:
        """``{partition_id: {key: tags}}`` of one partition or all of them; ``where={tag: value}``
        lists only the keys whose tags have those values (filtered on the server; values compare
        as their JSON text, so ``1`` matches ``1`` but not ``1.0``)."""
        return self.run(kv.list_keys(self._ctx, partition_id, where))

    kv_watch = blocking(watch.kv_watch, doc="""
        The keys of ``partition_id`` whose tags changed after ``cursor`` (None: from now), waiting
        up to ``timeout`` seconds for one; with ``where={tag: value}`` only those whose tags now have
        those values. Returns ``TagChanges`` (``keys``, ``tags``, ``global_indexes`` and the
        ``cursor`` to go on from), empty after the timeout. Going on from each returned cursor, every
        change is seen exactly once. Raises ``WatchCursorExpired`` (carrying the newest cursor) for
        a cursor whose changes were trimmed or whose partition was cleared: list again, watch on.""")

    def kv_clear(self, keys: list[str] | str, partition_id: str) -> None:
        """Remove keys, their samples and bytes. Idempotent."""
        self.run(kv.clear(self._ctx, keys, partition_id))

    def kv_retrieve_meta(self, keys: list[str] | str, partition_id: str, create: bool = False) -> BatchMeta:
        """``BatchMeta`` of the keys found (unknown keys are created with ``create=True``, else left out)."""
        return self.run(kv.retrieve_meta(self._ctx, keys, partition_id, create))

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        """The user key of each sample id."""
        return self.run(kv.retrieve_keys(self._ctx, global_indexes, partition_id))

    def seal_partition(self, partition_id: str) -> bool:
        """Say no more samples will be inserted: streaming loaders end once they drained it.
        Returns True if this call sealed it (False: it was sealed already)."""
        return self.run(streaming.seal_partition(self._ctx, partition_id))

    def reopen_partition(self, partition_id: str) -> bool:
        """Let a partition that was sealed and then cleared be created again: until this call, a
        put into it raises ``PartitionClosed`` (a late writer must not bring its data back).
        Returns True if it was closed."""
        return self.run(streaming.reopen_partition(self._ctx, partition_id))

    # -- group reservations and staleness admission (tq_redis.ops.reservations) ------------------

    reserve_group = blocking(reservations.reserve_group, doc="""
        Reserve ``n`` sample ids (a prompt group) in ``partition_id`` for ``lease_s`` seconds of the
        server's clock, starting on ``policy_version`` (None: the trainer's published version).
        Nothing is visible to consumers until ``commit_group``; ``abort_group`` or the lease's lapse
        (a crashed producer) frees it. Under the partition's staleness bound it waits up to
        ``timeout`` seconds for room, then raises ``StalenessExceeded``. Returns a ``Reservation``.""")

    commit_group = blocking(reservations.commit_group, doc="""
        Store the reserved group's ``data`` (one row per reserved sample) and make every sample
        visible in one atomic step, tagged ``policy_version`` (start) and ``policy_version_end``.
        A reservation commits at most once: one no longer held raises ``ReservationLost`` (nothing
        visible, the stored bytes deleted). Returns the group's ``BatchMeta``.""")

    abort_group = blocking(reservations.abort_group, doc="""
        Free a reservation: nothing of it is ever visible, its slots are freed and bytes stored for
        it are deleted. False if it was not held any more.""")

    extend_reservation = blocking(reservations.extend_reservation, doc="""
        Renew a reservation's lease for ``lease_s`` seconds from now (server time); returns it with
        the new deadline. Raises ``ReservationLost`` if it is not held any more.""")

    set_policy_version = blocking(reservations.set_policy_version, doc="""
        Publish the policy version the trainer trains now: new reservations start on it and
        reservations blocked by the staleness bound are woken. Returns the previous version.""")

    set_staleness_bound = blocking(reservations.set_staleness_bound, doc="""
        Admit reservations of ``partition_id`` only while the samples reserved and not freed stay
        within ``(version + max_lag + 1) * batch_size`` (``max_lag=None`` removes the bound).""")

    # -- partial rollout (tq_redis.ops.partial) ---------------------------------------------------

    append_parts = blocking(partial.append_parts, doc="""
        Append one part to each field of ``data`` (one row per sample of ``metadata``: its new
        tokens, first dimension), recorded with the ``policy_version`` that generated it.
        ``complete=True`` marks those fields complete: only then can a task needing them claim the
        samples. ``get_data`` returns the parts joined, in order, and a ``"<field>~version"``
        column with each row's policy version. Raises ``SampleComplete`` for a completed field.""")

    complete_parts = blocking(partial.complete_parts, doc="""
        Mark appended ``fields`` complete for the samples of ``metadata`` (no new part): tasks
        needing them can claim the samples from now on.""")

    # -- replay (tq_redis.ops.replay) ------------------------------------------------------------

    update_priority = blocking(replay.update_priority, doc="""
        Set the priorities (finite numbers > 0, one per id) of samples ``global_indexes`` of
        ``partition_id``: ``PrioritizedSampler`` draws them in proportion to ``priority ** alpha``.
        Raises ``SampleNotFound`` for ids that do not exist.""")

    set_rate_limit = blocking(ratelimit.set_rate_limit, doc="""
        Hold ``task_name``'s consumers and ``partition_id``'s producers to ``samples_per_insert``
        samples per insert, within ``error_buffer`` samples, once ``min_size_to_sample`` were
        inserted (``None`` removes the limiter). A held-back ``get_meta`` finds nothing and waits
        for an insert (its ``timeout``); a held-back insert (``put``, ``kv_put``, ``reserve_group``)
        waits for the task's claims up to ``insert_timeout`` seconds, then raises ``RateLimited``.
        Returns the ``RateLimit`` with its counts.""")

    get_rate_limit = blocking(ratelimit.get_rate_limit, doc="""
        ``task_name``'s rate limiter on ``partition_id`` and its counts now (inserts, samples),
        or None.""")

    # -- group-shared fields (tq_redis.ops.shared) -------------------------------------------------

    put_shared = blocking(shared.put_shared, doc="""
        Put ``data``'s fields (a TensorDict or dict of **one** row) once for every sample of
        ``metadata`` (a group of one partition, e.g. a GRPO group's n samples sharing a prompt or
        image): the bytes are stored once, each member's ``get_data`` returns the value, and it is
        deleted when the group's last member is cleared. The members must not have these fields
        yet. Returns the metadata with the fields added.""")

    def close(self) -> None:
        """Close the Redis pools and store connections."""
        self._driver.close()
        super().close()
