"""Typed errors raised by tq-redis.

Every error says what went wrong *and what to do about it*. Each class also derives from the
closest built-in exception (``ValueError``, ``KeyError``, ``ConnectionError`` ...) so code written
against the reference system's bare exceptions keeps catching them.
"""

from __future__ import annotations

from typing import Any


class TQError(Exception):
    """Base class of every error tq-redis raises on purpose."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else self.__class__.__name__


class ConfigError(TQError, ValueError):
    """The configuration passed to ``init`` or a client is invalid."""


class ConnectionFailed(TQError, ConnectionError):
    """Redis/Valkey could not be reached; the message names the URL."""


class InvalidArgument(TQError, ValueError):
    """An argument is out of range or of the wrong shape."""


class InvalidName(InvalidArgument):
    """A namespace, partition id, field, task, channel, tag or KV key name is not allowed; the
    message says which characters are (see :mod:`tq_redis.names`)."""


class BatchSizeMismatch(InvalidArgument):
    """Data and metadata disagree on how many samples there are."""


class EmptyBatch(InvalidArgument):
    """An empty TensorDict (no samples or no fields) was given where data is required."""


class TooManyFields(InvalidArgument):
    """A put, claim or read named more fields than one call may carry
    (:data:`tq_redis.ops.script_budget.MAX_FIELDS`); the message says how to split them."""


class UnknownPartition(TQError, KeyError):
    """The partition does not exist (never created, or cleared)."""


class PartitionSealed(InvalidArgument):
    """Samples were inserted into a partition its producers sealed (no more data was promised)."""


class PartitionClosed(PartitionSealed):
    """A put (or KV write) named a partition that was sealed and then cleared: its producers were
    done and its data is gone, so a late writer must not bring it back. ``reopen_partition(id)``
    lets it be created again on purpose. Nothing of the refused call was written."""


class NamespaceInUse(TQError, RuntimeError):
    """A namespace was to be dropped while a client or storage node of it is alive; the message
    names them (``tq-redis namespace drop --force`` drops it anyway)."""


class ChannelNotFound(TQError, KeyError):
    """A channel was connected to (or used) that nobody created, or that was deleted."""


class ChannelClosed(TQError, RuntimeError):
    """The ``Channel`` object was closed: create a new one with ``Channel.connect(name)``."""


class UnknownField(TQError, KeyError):
    """A field was requested that was never put in the partition."""


class SampleNotFound(TQError, KeyError):
    """A sample id does not exist in the partition (never inserted, or cleared)."""


class UnknownKey(SampleNotFound, ValueError):
    """A KV key is not in the partition (never put, or cleared).

    Also a ``ValueError`` whose message says "not found", as the reference's KV reads raise.
    """


class KeyNotInBatch(SampleNotFound, RuntimeError):
    """``KVBatchMeta.select_keys`` named a key the batch does not hold.

    A ``SampleNotFound`` (so a ``KeyError``) and, as the reference raises, a ``RuntimeError``.
    """


# The reference system's name for "a sample was cleared before its data was read": code that
# catches it to tolerate that race catches SampleNotFound, which is what a read raises here.
StorageKeyNotFoundError = SampleNotFound


class DataNotReady(TQError, ValueError):
    """Data was requested for fields that are not produced yet for some samples."""


class SchemaConflict(TQError, TypeError):
    """A put disagrees with the schema the field was registered with."""


class DTypeConflict(SchemaConflict):
    """A put uses a different dtype than the field's registered dtype."""


class ShapeConflict(SchemaConflict):
    """A put uses a different per-sample shape or layout than the field's registered one."""


class UnsupportedValue(TQError, TypeError):
    """A value cannot be stored (wrong type where tensors are required, or not safely encodable)."""


class ItemClassNotAllowed(UnsupportedValue):
    """A dataclass or NamedTuple whose class is not on the allow-list of the safe encoding
    (``tq_redis.register_item_class``, or a channel's ``item_classes``). ``path`` is its class's
    ``module:QualName``."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class StorageError(TQError):
    """Base class of data-plane (store) errors."""


class StorageUnavailable(StorageError, ConnectionError):
    """A store or storage node cannot be reached; the message names it."""


class StorageAuthError(StorageError, PermissionError):
    """A storage node rejected this client's token (set TQ_STORAGE_TOKEN or the store's ``token`` option)."""


class StorageFull(StorageError):
    """A storage node refused a write because its memory budget is exhausted."""


class DataMissing(StorageError, KeyError):
    """A key the metadata says exists is missing from its store."""


class CheckpointNotFound(StorageError, FileNotFoundError):
    """``load_checkpoint`` was given a directory that does not exist or holds no ``metadata.json``
    (a ``FileNotFoundError``, as the reference raises)."""


class CheckpointCorrupt(StorageError, ValueError):
    """A checkpoint directory holds a file that is missing, truncated, altered or not what
    ``save_checkpoint`` writes. ``file`` names it (relative to the directory). Found before the load
    wrote anything: the namespace is as it was. Save the checkpoint again, or load another one."""

    def __init__(self, message: str, file: str = "") -> None:
        super().__init__(message)
        self.file = file


class NamespaceNotEmpty(TQError, RuntimeError):
    """A checkpoint was to be loaded into a namespace that holds data (partitions, channels, docks),
    which the load would delete. Nothing was changed: clear it first, load into a new namespace, or
    pass ``replace=True`` (the old data's bytes are then deleted from every store)."""


class BackendNotInstalled(ConfigError, ImportError):
    """A storage backend's (or the demo's) optional dependency is missing; the message names the
    extra or package to install. A ``ConfigError``: the configuration asks for what is not installed."""


class SamplerError(TQError, ValueError):
    """A sampler was misconfigured or returned an invalid choice."""


class PartitioningError(SamplerError, AssertionError):
    """Items cannot be split as asked (too few, or not divisible for equal sizes).

    A ``SamplerError`` (so a ``ValueError``) and, like the reference's checks, an ``AssertionError``.
    """


class LeaseError(TQError):
    """A lease operation (ack, nack, extend) named samples not leased by this task."""


class LeaseLost(LeaseError):
    """An ``ack`` or ``extend_lease`` named samples whose lease this holder no longer holds: it
    lapsed on the server's clock and the samples were handed back or out again (or they were
    nacked). The ack did not count for them -- each sample is acknowledged once, by its current
    holder -- and the batch's other samples were settled. ``ids`` lists the lost samples,
    ``by_partition`` maps each partition id to its lost ids."""

    def __init__(self, message: str, ids: list[int] | None = None, by_partition: dict[str, list[int]] | None = None):
        super().__init__(message)
        self.ids = list(ids or [])
        self.by_partition = dict(by_partition or {})


class SampleComplete(InvalidArgument):
    """An append (``append_parts``) named a field that is already marked complete for some of its
    samples: a completed field never changes (its consumers may have read it). ``.field`` and
    ``.ids`` say which; append to samples still in progress, or put a new sample."""

    def __init__(self, message: str, field: str = "", ids: list[int] | None = None):
        super().__init__(message)
        self.field = field
        self.ids = list(ids or [])


class ReservationLost(TQError):
    """A commit (or lease extension) named a group reservation that is no longer held: it was
    committed already, aborted, or its lease lapsed on the server's clock and it was freed.
    Nothing of the call was made visible and the bytes it stored are deleted; reserve again."""


class StalenessExceeded(TQError, TimeoutError):
    """A group reservation was refused by the partition's staleness bound: admitting it would let
    samples be trained more versions after the one they started on than ``max_lag`` allows. It
    waited ``timeout`` seconds (0: not at all) for the trainer to publish a newer version or for
    reservations to be freed. ``version`` is the published policy version, ``capacity`` the
    samples admitted at it."""

    def __init__(self, message: str, version: int | None = None, capacity: int = 0):
        super().__init__(message)
        self.version = version
        self.capacity = capacity


class RateLimited(TQError, TimeoutError):
    """An insert was held back by a task's samples-per-insert rate limiter (``set_rate_limit``)
    for longer than it may wait: the task's consumers sampled too little since the last inserts.
    ``task`` names the limiter, ``inserts`` and ``samples`` are its counts when it refused, and
    ``timeout_s`` how long the insert waited. Nothing of the insert was made visible."""

    def __init__(
        self, message: str, task: str = "", inserts: int = 0, samples: int = 0, timeout_s: float | None = None
    ):
        super().__init__(message)
        self.task = task
        self.inserts = inserts
        self.samples = samples
        self.timeout_s = timeout_s


class WatchCursorExpired(TQError, LookupError):
    """A ``kv_watch`` cursor can no longer be followed: the tag changes after it were trimmed
    from the partition's capped change stream (the watcher fell too far behind), the partition
    was cleared since, or it is no cursor of this partition. List the keys again
    (``kv_list(partition_id, where=...)``) and watch on from ``cursor``, the newest change now
    (taken before that listing, so no change is missed)."""

    def __init__(self, message: str, cursor: str = "0-0"):
        super().__init__(message)
        self.cursor = cursor


class PermissionDenied(TQError, PermissionError):
    """Redis refused a command or key to this client's user (an ACL rule: ``NOPERM``), or its
    credentials. The message names the rule to grant; ``tq-redis acl NAMESPACE`` prints the rules
    a namespace's user needs."""


class RedisOutOfMemory(StorageFull):
    """Redis refused a write because its used memory is over ``maxmemory`` (policy ``noeviction``).

    Nothing was changed by the refused call. Clearing still works (``clear_partition``,
    ``clear_samples``): free memory that way, or raise ``maxmemory``, then retry.
    """


class EvictionPolicyError(ConfigError):
    """The Redis server may evict keys (``maxmemory-policy`` ``allkeys-*``), which silently loses
    tq-redis metadata: set ``maxmemory-policy noeviction`` (or ``volatile-*``), or accept the risk
    with ``redis.on_eviction: warn``."""


class LibraryNotLoaded(ConfigError):
    """The tq-redis function library on a Redis server is missing or is not this client's exact
    code, and this client may not load it (``redis.load_library: never``): an administrator runs
    ``tq-redis load-library --redis URL``."""


class ServerBusy(TQError, RuntimeError):
    """Redis kept answering ``BUSY``: it is running a script longer than its
    ``busy-reply-threshold`` (someone else's, or one stuck in a loop; tq-redis's own hold it a few
    ms at most) and runs no other command meanwhile. The call waited for it, within a bound, and
    the refused command did not run; the message says how to stop such a script."""


class ServerError(TQError, RuntimeError):
    """Redis refused a command with an error tq-redis has no more specific type for; the message
    quotes the server's reply (for instance ``WRONGTYPE``: a key of the namespace was written by
    something else than tq-redis, or ``MISCONF``: the server cannot persist and refuses writes)."""


class NotDurable(TQError, RuntimeError):
    """A write was applied by the Redis primary but not confirmed by as many replicas (or AOF
    fsyncs) as durable mode asks for within its timeout. It is *not* undone: ``result`` holds what
    the call returned; a failover before the replicas catch up can lose it. A claim is the
    exception: it is handed back at once and ``result`` is None (nothing was handed out)."""

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


class DurabilityUnsupported(ConfigError):
    """The durable mode asked for cannot work with this server (no ``WAITAOF``, AOF off, a cluster)."""


class ServerStateLost(TQError, RuntimeError):
    """The Redis this client works with no longer holds the namespace it attached to: its
    ``<ns>:config`` is gone or carries another ``epoch`` (the identity drawn when the namespace was
    created). Redis restarted without persistence, a replica without the data was promoted, or
    someone flushed or dropped the namespace. Nothing was sent: ids and metadata from before would
    name rows that no longer exist or belong to someone else. Restore a checkpoint
    (``tq_redis.load_checkpoint(dir)`` in a new process, or this client's ``load_*_checkpoint``),
    or start over in a new namespace; the client refuses every call until then."""
