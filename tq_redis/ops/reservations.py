"""Group reservations for asynchronous RL: a producer reserves the ids of a prompt group before it
generates, commits the whole group at once when it is done, or aborts it; and the staleness bound
that admits a reservation only while its samples cannot be trained too many policy versions after
the one they started on.

* :func:`reserve_group` takes ``n`` fresh ids with a lease on the server's clock and the policy
  version the group starts on (``lua/group_reserve.lua``). Under a staleness bound it waits for the
  trainer's next version (or a freed reservation) up to ``timeout``, woken by a token, not polling.
* :func:`commit_group` stores the group's bytes, then makes every sample of it alive in one script
  (``lua/group_commit.lua``), tagged ``policy_version`` (start) and ``policy_version_end``. A
  reservation commits at most once; a lost one raises :class:`~tq_redis.errors.ReservationLost`
  and the bytes the call stored are deleted.
* :func:`abort_group` frees it; a lease that lapses (the producer died) frees it the same way at the
  next reservation call in the partition. Before storing bytes, a commit records their fields
  (``lua/group_extend.lua``), so a freed reservation's bytes go to the trash and are deleted.
* :func:`set_policy_version` (the trainer) and :func:`set_staleness_bound` configure admission.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from tq_redis.errors import BatchSizeMismatch, InvalidArgument, RateLimited, ReservationLost, StalenessExceeded
from tq_redis.meta import BatchMeta
from tq_redis.meta.keys import PartitionKeys, config_key, partitions_key
from tq_redis.ops import arguments, script_budget, transitions
from tq_redis.ops.clear import discard_bytes, empty_trash
from tq_redis.ops.context import Context, Op, batchmeta_schema, storage
from tq_redis.ops.data import as_tensordict, encode_batch, inline_payload
from tq_redis.ops.effects import Cmd, Offload, WaitToken

MAX_GROUP = script_budget.SCRIPT_ITEMS
"""The most samples one reservation holds (its commit tags and flips them in one script)."""


@dataclass(frozen=True)
class Reservation:
    """A reserved prompt group: ids ``first_id .. first_id + size - 1`` of ``partition_id``, held
    under ``token`` until ``deadline_ms`` (the server's clock) unless extended, starting on
    ``policy_version`` (None: none published or given)."""

    partition_id: str
    token: str
    first_id: int
    size: int
    policy_version: int | None
    deadline_ms: int

    @property
    def global_indexes(self) -> list[int]:
        """The ids the group's samples get when committed."""
        return list(range(self.first_id, self.first_id + self.size))


def _version(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) or value < 0:
        raise InvalidArgument(f"{name} must be an integer >= 0 (a policy version) or None, got {value!r:.80}")
    return int(value)


def _reservation(value: Any, call: str) -> Reservation:
    if not isinstance(value, Reservation):
        raise InvalidArgument(f"{call}() takes the Reservation reserve_group returned, got {type(value).__name__}")
    return value


def _free_trashed(ctx: Context, pk: PartitionKeys, trashed: int) -> Op:
    """Delete the bytes of freed reservations a script put in the trash (``trashed`` > 0)."""
    if trashed:
        store = yield from storage(ctx)
        yield from empty_trash(store, pk)


def namespace_bound(ctx: Context) -> Op[tuple[int, int] | None]:
    """The namespace's staleness bound ``(max_lag, batch_size)`` that ``init``'s ``staleness``
    config recorded (None: none), read once per client; a partition without a bound of its own
    adopts it at its first reservation."""
    if not ctx.namespace_bound_read:
        raw = yield Cmd(("HGET", config_key(ctx.namespace), "staleness"))
        if raw:
            spec = json.loads(raw)
            ctx.namespace_bound = (int(spec["max_lag"]), int(spec["batch_size"]))
        ctx.namespace_bound_read = True
    return ctx.namespace_bound


def reserve_group(
    ctx: Context,
    partition_id: str,
    n: int,
    lease_s: float = 600.0,
    *,
    policy_version: int | None = None,
    timeout: float = 0.0,
) -> Op[Reservation]:
    """Reserve ``n`` sample ids (a prompt group) for ``lease_s`` seconds of the server's clock,
    starting on ``policy_version`` (None: the version the trainer published, if any).

    Nothing is visible to consumers until :func:`commit_group`. Under the partition's staleness
    bound (:func:`set_staleness_bound`) the reservation waits up to ``timeout`` seconds for room
    (a version bump or a freed reservation wakes it), then raises
    :class:`~tq_redis.errors.StalenessExceeded`; ``timeout=0`` raises at once. A rate limiter of
    the partition (``set_rate_limit``) holds it back the same way (a consumer's claim wakes it),
    then raises :class:`~tq_redis.errors.RateLimited`.
    """
    pk = ctx.keys(partition_id)
    count = arguments.count(n, "n (the group size)", maximum=MAX_GROUP)
    lease = arguments.seconds(lease_s, "lease_s", allow_zero=False)
    timeout = arguments.seconds(timeout, "timeout")
    version = _version(policy_version, "policy_version")
    lease_ms = max(1, int(lease * 1000))
    token = uuid.uuid4().hex
    waiter = uuid.uuid4().hex if timeout > 0 else None
    deadline = time.monotonic() + timeout
    while True:
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000)) if waiter else 0
        got = yield from transitions.group_reserve(
            pk, token, count, lease_ms, version, waiter, wait_ms, (yield from namespace_bound(ctx))
        ).call()
        yield from _free_trashed(ctx, pk, got.trashed)
        if got.ok:
            start = int(got.version) if got.version else None
            return Reservation(pk.partition, token, got.first, count, start, got.deadline_ms)
        remaining = deadline - time.monotonic()
        if remaining <= 0 and got.held is not None:
            if waiter:
                yield Cmd(("ZREM", pk.admitwaiters, waiter))
            held = got.held
            raise RateLimited(
                f"reserve_group({partition_id!r}, n={count}) was held back by task {held.task!r}'s rate limiter"
                f"{f' for {timeout:g} s' if timeout else ''}: {held.inserts} samples inserted, {held.samples} "
                f"sampled. The task's consumers must sample more first; pass timeout= to wait for them, or loosen "
                f"the limit (set_rate_limit)",
                held.task, held.inserts, held.samples, timeout,
            )
        if remaining <= 0:
            if waiter:
                yield Cmd(("ZREM", pk.admitwaiters, waiter))
            published = int(got.version) if got.version else None
            raise StalenessExceeded(
                f"reserve_group({partition_id!r}, n={count}) was refused by the staleness bound"
                f"{f' after waiting {timeout:g} s' if timeout else ''}: at policy version {published} only "
                f"{max(got.capacity, 0)} more samples are admitted. The trainer's next set_policy_version admits "
                f"more; pass timeout= to wait for it, or loosen the bound (set_staleness_bound)",
                published, got.capacity,
            )
        wait = remaining
        if got.next_lapse_ms >= 0:  # a reservation lapses sooner: its slots free up then
            wait = min(wait, max(0.001, got.next_lapse_ms / 1000))
        yield WaitToken(pk.admitwake, wait)


def _lost(r: Reservation, what: str) -> ReservationLost:
    return ReservationLost(
        f"{what}: the reservation of samples {r.first_id}..{r.first_id + r.size - 1} of partition "
        f"{r.partition_id!r} is no longer held (committed already, aborted, or its lease lapsed on the server's "
        f"clock and it was freed), or another commit_group call of it is committing it. Nothing was made "
        f"visible; reserve_group again (extend_reservation keeps a long rollout's lease alive)"
    )


def commit_group(
    ctx: Context, reservation: Reservation, data: Any, *, end_policy_version: int | None = None
) -> Op[BatchMeta]:
    """Write the reserved group's samples and make all of them visible in one atomic step, tagged
    ``policy_version`` (the version it started on) and ``policy_version_end`` (``end_policy_version``).

    ``data`` (a TensorDict or dict of fields) has one row per reserved sample. Bytes are stored
    first, then one script checks the reservation is still held and flips the bits; a reservation
    commits at most once. Raises :class:`~tq_redis.errors.ReservationLost` (nothing visible, the
    stored bytes deleted) when it is not held any more.
    """
    r = _reservation(reservation, "commit_group")
    end = _version(end_policy_version, "end_policy_version")
    pk = ctx.keys(r.partition_id)
    td = as_tensordict(data)
    if td.batch_size[0] != r.size:
        raise BatchSizeMismatch(f"commit_group() got {td.batch_size[0]} samples for a reservation of {r.size}")
    schemas, values = encode_batch(ctx, td)
    store = yield from storage(ctx)
    inline = inline_payload(values, store.inline_max_bytes)
    listed = Cmd(("ZADD", partitions_key(ctx.namespace), "NX", time.time(), pk.partition))
    committer = uuid.uuid4().hex  # this call: the only one that may store the group's bytes
    if inline is not None:  # small values go with the bits: one round trip, nothing in a store
        yield from _commit(ctx, pk, r, transitions.group_commit(
            pk, r.token, committer, schemas, ctx.strict_schema, end_version=end, values=inline), listed)
    else:
        # become the reservation's only committer and record the fields before storing any byte:
        # a second commit call stores nothing, and a lapse or abort finds the bytes to delete
        staged = yield from transitions.group_extend(pk, r.token, 0, committer, list(schemas)).call()
        yield from _free_trashed(ctx, pk, staged.trashed)
        if not staged.held:
            raise _lost(r, "commit_group() stored nothing")
        ring: str | None = None
        try:
            ring = yield Offload(store.put, (pk, r.global_indexes, values))
            yield from _commit(ctx, pk, r, transitions.group_commit(
                pk, r.token, committer, schemas, ctx.strict_schema, end_version=end, ring=ring), listed)
        except Exception as exc:
            note = yield from discard_bytes(store, pk, r.global_indexes, list(schemas), ring)
            if note:
                exc.add_note(note)
            raise
    tags = _tags(r.policy_version, end)
    return BatchMeta.from_columns(
        r.global_indexes, r.partition_id, batchmeta_schema(schemas), production_status=np.ones(r.size, dtype=np.int8),
        custom_meta=[dict(tags) for _ in range(r.size)] if tags else None,
    )


def _tags(start: int | None, end: int | None) -> dict[str, int]:
    tags = {}
    if start is not None:
        tags["policy_version"] = start
    if end is not None:
        tags["policy_version_end"] = end
    return tags


def _commit(ctx: Context, pk: PartitionKeys, r: Reservation, call: transitions.Transition, listed: Cmd) -> Op:
    """Run the commit with the partition's listing in one round trip; a refused commit takes the
    listing back if the partition does not exist, and raises."""
    try:
        done, _ = yield from transitions.pipeline(call, listed)
    except Exception:
        yield from _unlist_missing(ctx, pk)
        raise
    yield from _free_trashed(ctx, pk, done.trashed)
    if not done.held:
        yield from _unlist_missing(ctx, pk)
        raise _lost(r, "commit_group() made nothing visible")


def _unlist_missing(ctx: Context, pk: PartitionKeys) -> Op:
    if not (yield Cmd(("EXISTS", pk.meta))):
        yield Cmd(("ZREM", partitions_key(ctx.namespace), pk.partition))


def abort_group(ctx: Context, reservation: Reservation) -> Op[bool]:
    """Give the reservation up: nothing of it was ever visible, its slots are freed (the staleness
    bound admits others) and bytes a commit stored for it are deleted. False when it was not held
    any more (committed, aborted or lapsed); aborting twice is harmless."""
    r = _reservation(reservation, "abort_group")
    pk = ctx.keys(r.partition_id)
    done = yield from transitions.group_abort(pk, r.token).call()
    yield from _free_trashed(ctx, pk, done.trashed)
    return done.held


def extend_reservation(ctx: Context, reservation: Reservation, lease_s: float) -> Op[Reservation]:
    """Renew the reservation's lease for ``lease_s`` seconds from now (the server's clock); returns
    it with the new deadline. Raises :class:`~tq_redis.errors.ReservationLost` if it is not held."""
    r = _reservation(reservation, "extend_reservation")
    lease = arguments.seconds(lease_s, "lease_s", allow_zero=False)
    pk = ctx.keys(r.partition_id)
    done = yield from transitions.group_extend(pk, r.token, max(1, int(lease * 1000))).call()
    yield from _free_trashed(ctx, pk, done.trashed)
    if not done.held:
        raise _lost(r, "extend_reservation() extended nothing")
    return Reservation(r.partition_id, r.token, r.first_id, r.size, r.policy_version, done.value)


def set_policy_version(ctx: Context, partition_id: str, version: int) -> Op[int | None]:
    """Publish the policy version the trainer trains now (new reservations start on it) and wake
    every reservation blocked by the staleness bound; returns the version published before.
    Raises :class:`~tq_redis.errors.InvalidArgument` for a version lower than the published one."""
    pk = ctx.keys(partition_id)
    value = _version(version, "version")
    if value is None:
        raise InvalidArgument("set_policy_version() needs a version (an integer >= 0)")
    published, previous = yield from transitions.policy_version(pk, value).call()
    if not published:
        raise InvalidArgument(
            f"set_policy_version({partition_id!r}, {value}): version {previous} is published already; a policy "
            f"version never goes back"
        )
    return previous


def set_staleness_bound(
    ctx: Context, partition_id: str, max_lag: int | None, batch_size: int = 1
) -> Op[transitions.Admission]:
    """Admit group reservations of the partition only while the samples reserved and not freed
    (committed ones included) stay within ``(version + max_lag + 1) * batch_size``, ``version``
    being the trainer's published one: a trainer taking ``batch_size`` samples per version in
    order then trains no sample more than ``max_lag`` versions after its start. ``max_lag`` None
    removes the bound. Returns the published version, the samples admitted and the reservations
    in flight."""
    pk = ctx.keys(partition_id)
    if max_lag is not None:
        max_lag = _version(max_lag, "max_lag")
        batch_size = arguments.count(batch_size, "batch_size")
    return (yield from transitions.admission_config(pk, max_lag, batch_size).call())
