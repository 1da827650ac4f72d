"""The samples-per-insert rate limiter (replay, after Reverb's ``SampleToInsertRatio``): a task's
consumers and the partition's producers are held to ``samples_per_insert`` samples per insert,
within ``error_buffer``, once ``min_size_to_sample`` samples were inserted.

The counts and the check live in the scripts that allocate ids and claim them
(``lua/includes/ratelimit.lua``), so every way in (``put``, ``kv_put``, ``get_meta(mode="insert")``,
``reserve_group``; every sampler of ``get_meta``) is held to it atomically. Here:

* :func:`set_rate_limit` / :func:`get_rate_limit` configure and read a task's limiter
  (``lua/rate_limit_config.lua``);
* :func:`admitted` runs an insert's script until the limiter admits it: a refused producer is
  registered as a waiter and sleeps on a wake token that a claim of the task pushes, up to the
  limiter's insert timeout, then raises :class:`~tq_redis.errors.RateLimited`. A held-back
  consumer finds nothing and waits for the next insert inside ``get_meta``, as for data not
  ready yet (its ``timeout``).
"""

from __future__ import annotations

import math
import numbers
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tq_redis import names
from tq_redis.errors import InvalidArgument, RateLimited
from tq_redis.meta.keys import PartitionKeys
from tq_redis.ops import arguments, transitions
from tq_redis.ops.context import Context, Op
from tq_redis.ops.effects import Cmd, WaitToken

T = TypeVar("T")

DEFAULT_INSERT_TIMEOUT_S = 600.0
"""How long an insert the limiter holds back waits for consumers by default, then raises."""

_MAX_WAIT_MS = 3_600_000
"""The longest one registered wait (a producer that may wait for ever registers again after it)."""


@dataclass(frozen=True)
class RateLimit:
    """A task's samples-per-insert rate limiter on a partition and its counts: ``inserts`` (samples
    allocated since counting began) and ``samples`` (ids handed to the task, a replayed sample
    counted each time). ``inserts * samples_per_insert - samples`` stays within
    ``samples_per_insert * min_size_to_sample ± error_buffer`` (a batch may overshoot by one batch)."""

    task: str
    samples_per_insert: float
    min_size_to_sample: int
    error_buffer: float
    insert_timeout_s: float | None
    inserts: int
    samples: int


def _positive_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a finite number > 0, got {value!r:.80}")
    return float(value)


def set_rate_limit(
    ctx: Context,
    partition_id: str,
    task_name: str,
    samples_per_insert: float | None,
    *,
    min_size_to_sample: int = 1,
    error_buffer: float | None = None,
    insert_timeout: float | None = DEFAULT_INSERT_TIMEOUT_S,
) -> Op[RateLimit | None]:
    """Hold ``task_name``'s consumers and the partition's producers to ``samples_per_insert``
    samples per insert (``None`` removes the task's limiter and returns None).

    A claim of the task waits (finds nothing, as when too little is ready) until
    ``min_size_to_sample`` samples were inserted and while it would take the task more than
    ``error_buffer`` samples behind the ratio; an insert waits while it would put the producers
    more than ``error_buffer`` ahead, up to ``insert_timeout`` seconds (None: as long as it
    takes), then raises :class:`~tq_redis.errors.RateLimited`. ``error_buffer`` (default
    ``max(1, samples_per_insert)``, the least allowed) is in samples. With
    ``samples_per_insert > 1`` each sample must be handed out more than once: sample with
    ``sampling_config={"max_times_sampled": k}`` (replay), ``k >= samples_per_insert``.
    """
    pk = ctx.keys(partition_id)
    task = names.task_name(task_name)
    if samples_per_insert is None:
        yield from transitions.rate_limit_config(pk, task, None).call()
        return None
    ratio = _positive_number(samples_per_insert, "samples_per_insert")
    min_size = arguments.count(min_size_to_sample, "min_size_to_sample")
    least = max(1.0, ratio)
    buffer = least if error_buffer is None else _positive_number(error_buffer, "error_buffer")
    if buffer < least:
        raise InvalidArgument(
            f"error_buffer must be at least max(1, samples_per_insert) = {least:g}, got {buffer:g}: a smaller "
            f"window could hold producers and consumers back at once"
        )
    timeout = arguments.seconds(insert_timeout, "insert_timeout", allow_none=True)
    timeout_ms = None if timeout is None else int(timeout * 1000)
    counts = yield from transitions.rate_limit_config(pk, task, ratio, min_size, buffer, timeout_ms).call()
    return RateLimit(task, ratio, min_size, buffer, timeout, counts.inserts, counts.samples)


def get_rate_limit(ctx: Context, partition_id: str, task_name: str) -> Op[RateLimit | None]:
    """``task_name``'s rate limiter on the partition with its counts now, or None if it has none."""
    pk = ctx.keys(partition_id)
    task = names.task_name(task_name)
    cfg, inserts, samples = yield Cmd(("HMGET", pk.ratelimit, f"cfg:{task}", "inserts", f"sampled:{task}"))
    if cfg is None:
        return None
    ratio, min_size, buffer, timeout_ms = (cfg.decode() if isinstance(cfg, bytes) else cfg).split("\t")
    return RateLimit(
        task, float(ratio), int(min_size), float(buffer), int(timeout_ms) / 1000 if timeout_ms else None,
        int(inserts or 0), int(samples or 0),
    )  # fmt: skip


def admitted(pk: PartitionKeys, attempt: Callable[[str, int], Op[T]], what: str) -> Op[T]:
    """Run ``attempt(waiter, wait_ms)`` (an insert's script, maybe pipelined) until no rate limiter
    holds it back (:class:`~tq_redis.ops.transitions.InsertHeld`).

    The first try registers nobody (no cost without a limiter); a refused insert tries again as a
    registered waiter, then sleeps on ``<p>:admitwake`` (a claim of the limited task pushes a
    token) until the limiter's insert timeout, and raises :class:`~tq_redis.errors.RateLimited`.
    """
    try:
        return (yield from attempt("", 0))
    except transitions.InsertHeld as first:
        held = first
    waiter = uuid.uuid4().hex
    started = time.monotonic()
    while True:
        limit = held.timeout_s
        remaining = math.inf if limit is None else started + limit - time.monotonic()
        if remaining <= 0:
            yield Cmd(("ZREM", pk.admitwaiters, waiter))
            raise RateLimited(
                f"{what} in partition {pk.partition!r} was held back by task {held.task!r}'s rate limiter for "
                f"{limit:g} s: {held.inserts} samples inserted, {held.samples} sampled. The task's consumers must "
                f"sample more first (are they running?); raise insert_timeout or loosen the limit (set_rate_limit)",
                held.task, held.inserts, held.samples, limit,
            )
        wait_ms = max(1, int(min(remaining * 1000, _MAX_WAIT_MS)))
        try:
            return (yield from attempt(waiter, wait_ms))
        except transitions.InsertHeld as again:
            held = again
        yield WaitToken(pk.admitwake, wait_ms / 1000)
