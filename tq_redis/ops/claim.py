"""Claims: ``get_meta`` hands a task a batch of ready samples, waiting for one if asked to, and
``settle`` acks, nacks or extends the leases of what was handed out.

A built-in sampler runs inside the ``claim`` script (one round trip; with nothing to claim the
same script registers the waiter). Any other sampler runs here, on the ready set, and
:func:`claim_choice` claims its choice only if every id is still free; it is the one loop that
reads a ready set and claims a choice, and facades with their own choosers (the dock's balanced
claim) reuse it. A consumer that finds nothing waits for a wake token on the task's wake list:
each event wakes one waiting consumer, who passes the token on if it got something.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tq_redis import samplers
from tq_redis.errors import InvalidArgument, LeaseLost, NotDurable
from tq_redis.meta import BatchMeta
from tq_redis.meta.keys import PartitionKeys, check_name, config_key
from tq_redis.ops import arguments, encoding, script_budget, transitions, typos
from tq_redis.ops.claim_plan import SamplerPlan, builtin_plan
from tq_redis.ops.context import Context, Op, batchmeta_schema, check_fields, group_by_partition
from tq_redis.ops.data import allocate
from tq_redis.ops.effects import Cmd, Pause, Unconfirmed, WaitToken
from tq_redis.ops.status import describe_partition
from tq_redis.ops.transitions import ClaimReply
from tq_redis.redact import redact
from tq_redis.server import durability

log = logging.getLogger(__name__)

MODES = ("fetch", "force_fetch", "insert")

# A user sampler whose choice keeps being taken by other consumers gives up after this many tries.
USER_SAMPLER_ATTEMPTS = 16

# After the k-th lost choice a consumer pauses a random time below min(BASE * 2**(k-1), CAP)
# before it reads the ready set again: consumers that lost to each other come back at different
# times instead of colliding again in step (at most about 0.2 s over all attempts).
RETRY_PAUSE_BASE_S = 0.0005
RETRY_PAUSE_CAP_S = 0.02

# Built-in samplers whose batch the ranks of a data-parallel group share: the first rank's claim
# stores it and the others get it back (lua/claim.lua), so a claim cannot take it back from them.
SHARED_BATCH_SAMPLERS = ("rank", "balance")

# The script work of settling (or handing back) one leased sample, in items (tq_redis.ops.script_budget):
# its lease entry and its delivery count.
SETTLE_COST = 2

# The per-sample key of the delivery count a sample was handed out with (its fencing token).
_DELIVERY = "_delivery"

# ------------------------------------------------------------------ get_meta


def get_meta(
    ctx: Context,
    data_fields: Sequence[str],
    batch_size: int,
    partition_id: str,
    mode: str = "fetch",
    task_name: str | None = None,
    sampling_config: dict[str, Any] | None = None,
    *,  # tq-redis's additions to the reference's parameters
    timeout: float = 0.0,
    lease_s: float | None = None,
    max_deliveries: int | None = None,
) -> Op[BatchMeta]:
    """Claim a batch for ``task_name`` (fetch) or describe every sample (force_fetch).

    The sampler is ``sampling_config["sampler"]`` or the namespace default. A built-in runs
    inside the ``claim`` script (one round trip); any other sampler runs here on the ready list
    and its choice is claimed with ``claim_ids`` only if still free (see :mod:`tq_redis.samplers`).
    ``max_deliveries`` (or ``sampling_config["max_deliveries"]``) bounds redeliveries of a leased
    sample; past it the sample goes to the task's poison set.
    """
    fields = check_fields(data_fields)
    if mode not in MODES:
        raise InvalidArgument(f"mode must be one of {MODES}, got {mode!r}")
    pk = ctx.keys(partition_id)
    if mode == "force_fetch":
        return (yield from describe_partition(ctx, pk, fields))
    batch_size = arguments.count(batch_size, "batch_size")
    if mode == "insert":
        return (yield from allocate(ctx, pk, fields, batch_size))
    return (yield from fetch(ctx, fields, batch_size, pk, task_name, sampling_config, timeout, lease_s, max_deliveries))


def fetch(
    ctx: Context,
    fields: list[str],
    batch_size: int,
    pk: PartitionKeys,
    task_name: str | None,
    sampling_config: dict[str, Any] | None = None,
    timeout: float = 0.0,
    lease_s: float | None = None,
    max_deliveries: int | None = None,
    values: dict[str, list[bytes | None]] | None = None,
) -> Op:
    """``get_meta(mode="fetch")`` of checked ``fields`` and ``batch_size``. ``values``: a dict
    that receives the claimed batch's inline values (field -> value per sample, None where a
    value lives in a store), read in the claim's own atomic step; a claim by a user sampler
    leaves it empty."""
    if task_name is None:
        raise InvalidArgument("get_meta(mode='fetch') needs task_name= (the consumer whose progress is tracked)")
    check_name("task_name", task_name)
    if not fields:
        raise InvalidArgument(
            "get_meta(mode='fetch') needs at least one field in data_fields: with none, every sample would "
            "count as ready and be marked consumed with no data to read; name the fields the task reads"
        )
    timeout = arguments.seconds(timeout, "timeout")
    lease_s = arguments.seconds(lease_s, "lease_s", allow_zero=False, allow_none=True)
    if sampling_config is not None and not isinstance(sampling_config, dict):
        raise InvalidArgument(f"sampling_config must be a dict, got {type(sampling_config).__name__}")
    config = dict(sampling_config or {})
    lease_ms = max(1, int(lease_s * 1000)) if lease_s else 0
    if max_deliveries is None:
        max_deliveries = config.get("max_deliveries", 0)
    if isinstance(max_deliveries, bool) or not isinstance(max_deliveries, int) or max_deliveries < 0:
        raise InvalidArgument(f"max_deliveries must be an integer >= 0 (0 = unlimited), got {max_deliveries!r}")
    spec = config.get("sampler")
    sampler = samplers.resolve_sampler(spec) if spec is not None else (yield from _default_sampler(ctx))
    if config.get("max_times_sampled", 1) != 1:
        _check_replay(sampler, lease_ms)
    shared = False  # a batch the ranks of a data-parallel group share (stored by the first rank's claim)
    if samplers.is_builtin(sampler):
        plan = builtin_plan(sampler, config, batch_size)
        shared = plan.kind in SHARED_BATCH_SAMPLERS
        if plan.kind == "priority" and lease_ms and max_deliveries:
            raise samplers.SamplerError("max_deliveries does not combine with PrioritizedSampler; drop one of them")
        if lease_ms:  # the balanced sampler's first rank claims every rank's part
            script_budget.check_leased_claim(batch_size * int(dict(plan.options).get("dp_size", 1)))
        attempt = _builtin_claim(pk, plan, task_name, lease_ms, max_deliveries, fields, ctx.inline_partitions, values)
    else:
        attempt = _user_claim(pk, sampler, config, batch_size, task_name, lease_ms, max_deliveries, fields)
    # Waiting is for a wake token, not for any event: each event wakes one waiting consumer of
    # the task (who wakes the next if it got something), never all of them at once.
    deadline = time.monotonic() + timeout
    waiter = uuid.uuid4().hex if timeout > 0 else None
    user_registered = False  # whether the user-sampler path registered the waiter
    wake: WaitToken | None = None  # the wait the next attempt runs first
    while True:
        wait_ms = int((deadline - time.monotonic()) * 1000) if waiter else 0
        meta, last_id, next_lapse, registered = yield from attempt(waiter, max(wait_ms, 0), wake)
        wake = None
        remaining = deadline - time.monotonic()
        if meta is not None or remaining <= 0:
            # Stop counting as a waiter, so no token is spent on us: the user-sampler path
            # registered itself; a claim sent behind a wait registered us for the time left
            # before that wait.
            if user_registered or registered:
                yield Cmd(("ZREM", pk.waiters(task_name), waiter))
            if meta is None:
                # only a get_meta about to come back empty checks for a typo (ops.typos): a
                # consumer woken with its batch pays nothing, and its wait stays one round trip
                yield from typos.warn_unknown(ctx, pk, fields)
                if waiter:
                    log.debug("claim %s/%s: nothing ready after waiting %.1f s", pk.partition, task_name, timeout)
                return BatchMeta.empty()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("claim %s/%s: %d of %d sample(s), ids %s%s", pk.partition, task_name, meta.size, batch_size,
                          encoding.id_ranges(meta.global_indexes), f", leased {lease_s} s" if lease_ms else "")
            unconfirmed = yield Unconfirmed()
            if unconfirmed:  # durable mode could not confirm the claim: see not_durable_claim
                raise (yield from not_durable_claim(ctx, pk, task_name, meta, unconfirmed[0], shared))
            meta.set_extra_info("task_name", task_name)
            return meta
        if not registered:  # the user-sampler path: register unless something changed meanwhile
            wait_ms = max(1, int(remaining * 1000))
            registered = yield from transitions.wait(pk, task_name, waiter, wait_ms, last_id).call()
            user_registered = user_registered or registered
        if next_lapse >= 0:  # a lease of this task lapses sooner (the server says when): re-check then
            remaining = min(remaining, max(0.001, next_lapse / 1000))
        log.debug("claim %s/%s: nothing ready for %d sample(s) of %s; waiting up to %.1f s",
                  pk.partition, task_name, batch_size, fields, remaining)
        if registered:
            # the next claim rides behind the wait; its lease runs from the server's time when it
            # runs, so a leasing claim may wait and claim in one round trip too
            wake = WaitToken(pk.wake(task_name), remaining)


def _check_replay(sampler: samplers.BaseSampler, lease_ms: int) -> None:
    """``max_times_sampled`` (replay) runs in the claim script, in fetch mode: refuse the rest."""
    if lease_ms:
        raise InvalidArgument(
            "sampling_config['max_times_sampled'] replays samples in fetch mode and does not combine with lease_s: "
            "a leased sample is acknowledged exactly once. Drop lease_s, or max_times_sampled"
        )
    if not samplers.is_builtin(sampler):
        raise samplers.SamplerError(
            f"sampling_config['max_times_sampled'] needs a built-in sampler (it runs in the claim script); "
            f"{type(sampler).__name__} runs in the client"
        )


def not_durable_claim(
    ctx: Context, pk: PartitionKeys, task: str, meta: BatchMeta, missing: str, shared: bool
) -> Op:
    """The ``NotDurable`` of a claim durable mode could not confirm (``missing`` says what was not).

    A failover before the replicas catch up could lose the claim and hand its samples to another
    consumer while this one works on them: then a sample would be handed to the task twice, and
    with leases both holders' acks would count (the delivery count starts again). So the claim is
    handed back at once (``lua/unclaim.lua``) and nothing is handed out: ``result`` is None and the
    caller claims again later. A batch the ranks of a data-parallel group share (RankAwareSampler,
    SeqlenBalancedSampler: the group's other ranks get the same stored batch) cannot be taken back
    from them: it comes in ``result``, the caller owns it, and a failover may deliver it again.
    """
    setting = durability.for_url(ctx.redis_url)
    where = f"Redis primary at {redact(ctx.redis_url)}"
    if shared:
        return NotDurable(
            f"get_meta claimed samples {meta.global_indexes[:20]} of partition {pk.partition!r} for task {task!r} on "
            f"the {where}, but durable mode {setting} could not confirm it ({missing} within "
            f"{setting.timeout_ms} ms). The batch is shared with the other ranks of its data-parallel group, so "
            f"it is not handed back: it is on this error's .result and yours, and a failover before the replicas "
            f"catch up may deliver it again",
            meta,
        )
    fences = _fences(meta)
    for piece in script_budget.slices(meta.size, SETTLE_COST):
        yield from transitions.unclaim(pk, task, meta.global_indexes[piece], fences[piece]).call()
    return NotDurable(
        f"get_meta claimed {meta.size} samples of partition {pk.partition!r} for task {task!r} on the {where}, "
        f"but durable mode {setting} could not confirm it ({missing} within {setting.timeout_ms} ms), so a "
        f"failover could hand them to another consumer as well. They were handed back at once: nothing is "
        f"handed out (.result is None). Claim again once the replicas catch up (INFO replication), or raise "
        f"redis.durable_timeout_ms"
    )


def _default_sampler(ctx: Context) -> Op:
    """The client's default sampler: its context's ``default_sampler`` (what the client was built
    with: ``init`` gives its client the config's, class or instance included), else the spec
    ``init`` recorded in ``<ns>:config``; resolved once per context."""
    if ctx.resolved_sampler is not None:
        return ctx.resolved_sampler
    spec = ctx.default_sampler
    if spec is not None:
        sampler = samplers.resolve_sampler(spec)
    else:
        raw = yield Cmd(("HGET", config_key(ctx.namespace), "sampler"))
        sampler = samplers.sampler_from_spec(raw)
    ctx.resolved_sampler = sampler
    return sampler


def _builtin_claim(
    pk: PartitionKeys, plan: SamplerPlan, task: str, lease_ms: int, max_deliveries: int, fields: list[str],
    inline_hints: dict[str, bool], values: dict[str, list[bytes | None]] | None = None,
):  # fmt: skip
    """One claim with a built-in sampler: an attempt ``(waiter, wait_ms, wake=None)`` yielding
    ``(meta|None, last_id, next_lapse_ms, registered)``; with nothing to claim the script registers the
    waiter itself. With ``wake`` the claim goes out behind that wait, in its round trip.
    A claim also says whether the partition keeps values inline (``inline_hints``, for get_data);
    with ``values`` it also returns the batch's inline values, which go there."""

    # The values come with the claim only while one script call may carry them (a bigger batch
    # is read afterwards, in pieces: tq_redis.ops.script_budget).
    with_values = values is not None and plan.batch_size * len(fields) <= script_budget.SCRIPT_ITEMS

    def attempt(waiter: str | None, wait_ms: int, wake: WaitToken | None = None) -> Op:
        claim = transitions.claim(
            pk, task, plan, fields, lease_ms=lease_ms, max_deliveries=max_deliveries, waiter=waiter, wait_ms=wait_ms,
            with_values=with_values,
        )
        got = yield from (claim.call() if wake is None else claim.call_after(wake))
        if got.inline is not None:
            inline_hints[pk.partition] = got.inline
        if with_values and got.values is not None:
            values.update(got.values)
        meta = _claimed_meta(pk.partition, got) if got.ids else None
        return meta, got.last_event_id, got.next_lapse_ms, got.registered

    return attempt


def _checked_choice(name: str, chosen: Any, ready: set[int], sampler: samplers.BaseSampler) -> list[int]:
    try:
        ids = [int(i) for i in chosen]
    except (TypeError, ValueError):
        raise samplers.SamplerError(
            f"{type(sampler).__name__}.sample() must return two lists of sample ids; {name} is {chosen!r}"
        ) from None
    if len(set(ids)) != len(ids):
        raise samplers.SamplerError(f"{type(sampler).__name__}.sample() returned duplicate ids in {name}: {ids[:10]}")
    strays = [i for i in ids if i not in ready]
    if strays:
        raise samplers.SamplerError(
            f"{type(sampler).__name__}.sample() chose ids {strays[:10]} in {name} that were not in ready_indexes"
        )
    return ids


Chooser = Callable[[list[int]], Op]
"""Picks from a task's ready ids (ascending): a generator, which may yield effects, returning
``(sampled, consumed)`` (see :meth:`tq_redis.samplers.BaseSampler.sample`) or None to take nothing."""


class ChoiceClaim(NamedTuple):
    """What :func:`claim_choice` got."""

    meta: BatchMeta | None  # the claimed batch, None if nothing was claimed
    last_event_id: str  # what to wait from when nothing was claimed
    next_lapse_ms: int  # ms until the task's earliest lease lapses (server clock), -1 if none
    exhausted: bool  # every attempt's choice was taken by other consumers first
    lost: list[int]  # then: the ids the last attempt lost


def retry_pause(lost: int) -> float:
    """Seconds to pause after the ``lost``-th lost choice in a row: random, within a doubling bound."""
    return random.uniform(0.0, min(RETRY_PAUSE_BASE_S * 2 ** (lost - 1), RETRY_PAUSE_CAP_S))


def claim_choice(
    pk: PartitionKeys,
    task: str,
    fields: list[str],
    batch_size: int,
    choose: Chooser,
    *,
    lease_ms: int = 0,
    max_deliveries: int = 0,
    attempts: int = 0,
) -> Op:
    """Claim for ``task`` what ``choose`` picks from the samples ready for it, if still free.

    Reads the ready set (``lua/ready_ids.lua``); with fewer than ``batch_size`` ready, or a
    choice of nothing, claims nothing. The choice is claimed only if every id is still free
    (``lua/claim_ids.lua``); when another consumer took one first, the loop pauses
    (:func:`retry_pause`) and starts over with a fresh ready set, at most ``attempts`` times
    (0: :data:`USER_SAMPLER_ATTEMPTS`). Returns a
    :class:`ChoiceClaim`; the caller decides what running out of attempts means.
    """
    last_id, next_lapse, lost = "", -1, []
    for attempt in range(attempts or USER_SAMPLER_ATTEMPTS):
        if attempt:
            yield Pause(retry_pause(attempt))
        ready = yield from transitions.ready_ids(pk, task, fields, max_deliveries=max_deliveries).call()
        last_id, next_lapse = ready.last_event_id, ready.next_lapse_ms
        if len(ready.ids) < batch_size:
            break
        choice = yield from choose(ready.ids)
        if choice is None or not choice[0]:
            break
        sampled, consumed = choice
        got = yield from transitions.claim_ids(pk, task, sampled, consumed, fields, lease_ms=lease_ms).call()
        if got.claimed is not None:
            done = got.claimed
            return ChoiceClaim(_claimed_meta(pk.partition, done), done.last_event_id, done.next_lapse_ms, False, [])
        if got.partition_missing or got.held_back:  # held back by a rate limiter: wait for an insert
            break
        lost = got.taken
    else:
        return ChoiceClaim(None, last_id, next_lapse, True, lost)
    return ChoiceClaim(None, last_id, next_lapse, False, [])


def _user_claim(
    pk: PartitionKeys,
    sampler: samplers.BaseSampler,
    config: dict[str, Any],
    batch_size: int,
    task: str,
    lease_ms: int,
    max_deliveries: int,
    fields: list[str],
):
    """One claim with a user's Python sampler (:func:`claim_choice`): read the ready set, let the
    sampler choose, and claim the choice only if every id is still free; on a conflict, try
    again with a fresh ready set, up to :data:`USER_SAMPLER_ATTEMPTS` times, then raise."""
    kwargs = {k: v for k, v in config.items() if k not in ("sampler", "max_deliveries")}
    kwargs.update(task_name=task, partition_id=pk.partition)

    def choose(ready: list[int]) -> Op:
        yield from ()  # the sampler runs here, with no Redis call
        sampled, consumed = sampler.sample(ready, batch_size, **kwargs)
        ready_set = set(ready)
        sampled = _checked_choice("sampled", sampled, ready_set, sampler)
        consumed = _checked_choice("consumed", consumed, ready_set, sampler)
        if lease_ms:
            script_budget.check_leased_claim(len(consumed))
        return sampled, consumed

    def attempt(waiter: str | None, wait_ms: int, wake: WaitToken | None = None) -> Op:
        # waiting is registered by get_meta (`wait`); its wait runs here, before the ready set is read
        if wake is not None:
            yield wake
        got = yield from claim_choice(
            pk, task, fields, batch_size, choose, lease_ms=lease_ms, max_deliveries=max_deliveries
        )
        if got.exhausted:
            raise samplers.SamplerError(
                f"{type(sampler).__name__} lost its choice to other consumers {USER_SAMPLER_ATTEMPTS} times in a "
                f"row (last taken: {got.lost[:10]}); make it pick less contended samples, e.g. spread choices at "
                f"random"
            )
        return got.meta, got.last_event_id, got.next_lapse_ms, False

    return attempt


def _claimed_meta(partition_id: str, claimed: ClaimReply) -> BatchMeta:
    n = len(claimed.ids)
    # Every container here is new and ours (ids and tag rows decoded from the reply, schema
    # entries copied), so the batch adopts them instead of validating and copying them again.
    meta = BatchMeta._adopt(
        claimed.ids, [partition_id] * n, batchmeta_schema(claimed.schemas), np.ones(n, dtype=np.int8),
        claimed.tags or None, None, {},
    )  # fmt: skip
    if claimed.deliveries:
        counts = claimed.deliveries
        meta.set_extra_info("delivery_counts", counts)
        # Per sample too, so the fencing token follows a sample through select/chunk/concat.
        meta._custom_backend_meta = [{_DELIVERY: d} for d in counts]
    return meta


# ------------------------------------------------------------------ leases and consumption


def _fences(metadata: BatchMeta) -> list[int]:
    """The delivery count each sample was handed out with (0 where unknown: settle unfenced)."""
    n = metadata.size
    rows = metadata._custom_backend_meta
    fences = [int(row.get(_DELIVERY, 0)) for row in rows]
    if not any(fences):
        counts = metadata.get_extra_info("delivery_counts")
        if isinstance(counts, list) and len(counts) == n:
            fences = [int(c) for c in counts]
    return fences


def settle(ctx: Context, metadata: BatchMeta, task_name: str, action: str, lease_s: float = 0.0) -> Op:
    """ack / nack / extend the leases of ``metadata``'s samples.

    Each sample's delivery count is sent along as a fencing token (``lua/settle.lua``): once a
    lapsed lease was handed back or out again, its old holder can no longer settle it, so a
    sample is acknowledged exactly once. ``ack`` and ``extend`` settle what is still held and then
    raise :class:`~tq_redis.errors.LeaseLost` naming the samples that were not (their work was
    or will be done by another consumer); ``nack`` returns those ids (handing back what is no
    longer yours changes nothing). Deadlines are the server's time; no client clock takes part.
    """
    check_name("task_name", task_name)
    if action not in ("ack", "nack", "extend"):
        raise InvalidArgument(f"settle action must be 'ack', 'nack' or 'extend', got {action!r}")
    metadata = arguments.batch_meta(metadata, action if action != "extend" else "extend_lease")
    if action == "extend":
        lease_s = arguments.seconds(lease_s, "extend_lease seconds", allow_zero=False)
    fences = _fences(metadata)
    lost: dict[str, list[int]] = {}
    lease_ms = max(1, int(lease_s * 1000))
    for pid, positions in group_by_partition(metadata).items():
        pk = ctx.keys(pid)
        ids = [metadata.global_indexes[i] for i in positions]
        held_with = [fences[i] for i in positions]
        for piece in script_budget.slices(len(ids), SETTLE_COST):  # a big batch in pieces
            call = transitions.settle(pk, task_name, action, ids[piece], held_with[piece], lease_ms)
            settled = yield from call.call()
            if settled.not_held:
                lost.setdefault(pid, []).extend(settled.not_held)
    if action == "nack":
        return [i for ids in lost.values() for i in ids]
    if lost:
        raise lease_lost(task_name, action, lost)
    return None


def lease_lost(task: str, action: str, lost: dict[str, list[int]]) -> LeaseLost:
    """The error for an ack or extension of samples whose lease this holder no longer held."""
    where = "; ".join(f"samples {ids[:20]}{' ...' if len(ids) > 20 else ''} of partition {pid!r}"
                      for pid, ids in lost.items())
    verb = "acknowledged" if action == "ack" else "extended"
    return LeaseLost(
        f"{where} were not {verb}: task {task!r} no longer leases them to this holder (the lease lapsed on "
        f"the server's clock and they were handed out again or back, or they were nacked or never leased). "
        f"Another consumer gets or got them: drop this holder's results for them. The other samples of "
        f"the batch were {verb}. Keep leases alive with extend_lease() while working, or take a longer lease_s",
        [i for ids in lost.values() for i in ids], dict(lost),
    )


def reset_consumption(ctx: Context, partition_id: str, task_name: str | None = None) -> Op:
    """``task_name`` (None: every task) consumes the partition from scratch; False when the
    partition does not exist."""
    pk = ctx.keys(partition_id)
    if task_name is not None:
        check_name("task_name", task_name)
    return (yield from transitions.reset_consumption(pk, task_name).call())
