"""How much of a batch one script call may handle, so that no call holds the server for long.

Redis runs one script at a time and serves no other client meanwhile: a put of 8,192 rows x 4 small
values in one script held it 118-460 ms, and every other consumer's claim waited that long. So the
work of a call that scales with its batch is cut into script calls of at most
:data:`SCRIPT_ITEMS` items each -- a value (sample x field), a sample id, a user key -- sent one
after the other (one round trip each, never pipelined together: a pipeline's scripts would run back
to back). Each piece keeps the invariants on its own: bytes are stored before the bits that make
them visible, a clear removes bits before bytes, and a new batch of samples (an insert: a GRPO
group's unit) still becomes visible in one step, whatever its size.

What is cut, and how:

* an insert of more than :data:`SCRIPT_ITEMS` values keeps them in the store rather than inline (its
  bits flip in one short script: ranges, one per field);
* a put with metadata (a later stage's field, a rewrite), tags, ``get_data``'s checks and inline
  reads, a claim's inline values, ``clear_samples`` and KV key resolution go in pieces of at most
  :data:`SCRIPT_ITEMS` items: such a put's samples, and a clear's, change in parts (each sample's
  fields together);
* a claim is one atomic step: in fetch mode whatever its size (it marks samples in bitmap runs,
  about 0.4 µs of script time a sample), with a lease at most :data:`MAX_LEASED_CLAIM` samples;
  acks, nacks and extensions go in pieces;
* ``clear_partition`` unlinks its keys (Redis frees large values in the background).

A put may carry at most :data:`MAX_FIELDS` fields.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from tq_redis.errors import InvalidArgument, TooManyFields

T = TypeVar("T")

SCRIPT_ITEMS = 512
"""The most values (sample x field), sample ids or keys one script call handles (each such call
held the server 2-11 ms on the shared 2-core machine of ``benchmarks/p9_script_time.py``)."""

MAX_FIELDS = SCRIPT_ITEMS
"""The most fields one put, claim or read names: their schemas and bits are handled in one script."""

MAX_LEASED_CLAIM = SCRIPT_ITEMS
"""The most samples one claim with a lease takes: a claim is one atomic step, and each leased sample
is a lease entry and a delivery count written in it (a fetch claim marks bitmap runs instead)."""


def piece_size(per_item: int = 1) -> int:
    """How many items of ``per_item`` work each (a sample of ``per_item`` fields) one call takes:
    :data:`SCRIPT_ITEMS` worth, at least one."""
    return max(1, SCRIPT_ITEMS // max(1, per_item))


def slices(n: int, per_item: int = 1) -> Iterator[slice]:
    """Consecutive slices of ``n`` items, :func:`piece_size` items each (the last one shorter)."""
    size = piece_size(per_item)
    for start in range(0, n, size):
        yield slice(start, start + size)


def pieces(items: Sequence[T], per_item: int = 1) -> Iterator[Sequence[T]]:
    """``items`` in consecutive pieces of :func:`piece_size` items (``items`` itself when it fits)."""
    if len(items) <= piece_size(per_item):
        yield items
        return
    for piece in slices(len(items), per_item):
        yield items[piece]


def check_leased_claim(batch_size: int) -> None:
    """Raise :class:`~tq_redis.errors.InvalidArgument` for a leased claim of more than
    :data:`MAX_LEASED_CLAIM` samples."""
    if batch_size > MAX_LEASED_CLAIM:
        raise InvalidArgument(
            f"get_meta(..., lease_s=...) takes at most {MAX_LEASED_CLAIM} samples per call, got batch_size="
            f"{batch_size}: a claim is one atomic step and each leased sample is a lease entry written in it, "
            f"which must not hold Redis for long. Claim leased batches of at most {MAX_LEASED_CLAIM} (one "
            f"get_meta call each), or claim without a lease"
        )


def check_fields(count: int, call: str) -> None:
    """Raise :class:`TooManyFields` when ``call`` names more than :data:`MAX_FIELDS` fields."""
    if count > MAX_FIELDS:
        raise TooManyFields(
            f"{call} names {count} fields; at most {MAX_FIELDS} fields go in one call (their schemas and "
            f"bits are handled in one script, which must not hold Redis for long). Split the fields across "
            f"calls: put(td.select(*names[:{MAX_FIELDS}]), partition_id=...) and then "
            f"put(td.select(*names[{MAX_FIELDS}:]), metadata=meta) for the rest"
        )
