"""Typos say so: a claim of a partition that does not exist, or of a field no sample has, warns once.

``get_meta`` of a misspelt partition or field returns an empty batch (after its ``timeout``), as the
reference's does, which looks like "no data yet". So the first time a ``get_meta`` of a (partition,
field) is about to return empty (at once with ``timeout=0``, else when its timeout ran out),
:func:`warn_unknown` asks Redis (one pipelined round trip) whether the partition exists and which
fields it knows (a field is known once a put or ``get_meta(mode="insert")`` named
it: ``<p>:fields``), and logs ONE warning naming the known ones. Each (partition, field) is checked
at most once per client context, whatever the answer, so a consumer polling an empty partition pays
for it once; a claim that returns samples never pays at all. The return value stays empty.

A GRPOTransferDock's partition is not checked: its columns are declared by the dock, and its
consumers ask for columns before they are put as a matter of course.
"""

from __future__ import annotations

import logging

from tq_redis.meta.keys import PartitionKeys, partitions_key
from tq_redis.ops.context import Context, Op
from tq_redis.ops.effects import Cmd, Pipe
from tq_redis.ops.encoding import text

__all__ = ["MAX_CHECKED", "warn_unknown"]

log = logging.getLogger(__name__)

MAX_CHECKED = 100_000
"""(partition, field) pairs a context remembers as checked; past it, new ones are not checked."""

_SHOWN = 20  # known partitions / fields a warning lists


def _listing(names: list[str], total: int) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    more = f", ... ({total} in all)" if total > len(names[:_SHOWN]) else ""
    return f"[{shown}{more}]" if names else "none"


def warn_unknown(ctx: Context, pk: PartitionKeys, fields: list[str]) -> Op[None]:
    """After an empty claim of ``fields`` in ``pk``: warn once if the partition does not exist or
    no sample has (and no schema names) one of the fields, naming the known ones."""
    checked = ctx.checked_claims
    todo = [f for f in fields if (pk.partition, f) not in checked]
    if not todo or len(checked) >= MAX_CHECKED:
        return
    checked.update((pk.partition, f) for f in todo)
    exists, dock, known_fields, count, partitions = yield Pipe((
        Cmd(("EXISTS", pk.meta)),
        Cmd(("EXISTS", pk.dock)),
        Cmd(("HKEYS", pk.fields)),
        Cmd(("ZCARD", partitions_key(ctx.namespace))),
        Cmd(("ZRANGE", partitions_key(ctx.namespace), 0, _SHOWN - 1)),
    ))
    if dock:
        return
    if not exists:
        log.warning(
            "get_meta: partition %r does not exist in namespace %r (never put, or cleared), so there is "
            "nothing to claim of %s; known partitions: %s. A typo? (Said once per partition and field by "
            "this client; if a producer creates it later, ignore this.)",
            pk.partition, ctx.namespace, todo, _listing(sorted(map(text, partitions)), int(count)),
        )
        return
    known = sorted(map(text, known_fields))
    missing = [f for f in todo if f not in known]
    if missing:
        log.warning(
            "get_meta: no sample of partition %r has field(s) %s and no schema names them; known fields: "
            "%s. A typo? (Said once per partition and field by this client; if a producer puts them later, "
            "ignore this.)",
            pk.partition, missing, _listing(known, len(known)),
        )
