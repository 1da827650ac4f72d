"""How the ``dram`` store client checks a node's replies: no length or position is trusted unchecked.

A storage node may be broken or hostile. Every column, id and position a PUT / ALLOC or GET reply
carries is checked here before the client reads a payload, writes into a slab or slices a value:
packed integer columns must have the announced count and stay in range, positions must name keys
of the request, values must lie inside the payload or the slab they point into. A reply that does
not is a :class:`~tq_redis.backends.dram.protocol.ProtocolError` naming the node (the exchange
then drops its connection). Header-map and payload bounds are
:func:`~tq_redis.backends.dram.pool.check_reply`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_redis.backends.dram.pool import Conn, Link, MappedSlab, check_reply
from tq_redis.backends.dram.protocol import ProtocolError

__all__ = ["check_in_slabs", "inline_sizes", "int_table", "missing_of", "pin_of", "put_reply", "slab_columns"]

#: offsets and lengths in replies stay below this (so their sums cannot overflow int64)
_MAX_OFFSET = 1 << 48


def int_table(raw: Any, dtype: str, n: int, link: Link, allow_negative: bool = False) -> np.ndarray:
    """A reply's packed integer column of ``n`` entries, checked (``ProtocolError`` if it is not one)."""
    width = np.dtype(dtype).itemsize
    if not isinstance(raw, bytes) or len(raw) != n * width:
        raise ProtocolError(f"DRAM storage node {link.label} sent a malformed reply: a column is not {n} integers")
    col = np.frombuffer(raw, dtype=dtype)
    if n and (int(col.max()) > _MAX_OFFSET or (not allow_negative and int(col.min()) < 0)):
        raise ProtocolError(f"DRAM storage node {link.label} sent an offset or length out of range")
    return col


def put_reply(i: int, link: Link, conn: Conn, code: int, meta: dict[str, Any], plen: int, fds: list[int]) -> Any:
    """Reply handler of PUT / ALLOC: the header map, its transaction id and reservation checked."""
    meta = check_reply(i, link, conn, code, meta, plen, fds)
    txn = meta.get("txn")
    if txn is not None and type(txn) is not int:
        raise ProtocolError(f"DRAM storage node {link.label} sent a malformed transaction id {txn!r:.40}")
    chunks = meta.get("chunks")
    if chunks is not None and not (
        isinstance(chunks, list)
        and all(isinstance(c, list) and len(c) == 4 and all(type(x) is int for x in c) for c in chunks)
    ):
        raise ProtocolError(f"DRAM storage node {link.label} sent a malformed reservation {chunks!r:.60}")
    return meta


def missing_of(meta: dict[str, Any], n: int, link: Link) -> Any:
    """The positions (among the request's ``n`` keys) a GET reply says the node does not hold, checked."""
    miss = meta.get("missing") or []
    if miss:
        if (
            not (isinstance(miss, list) and all(type(m) is int for m in miss))
            or len(set(miss)) != len(miss)
            or min(miss) < 0
            or max(miss) >= n
        ):
            raise ProtocolError(f"DRAM storage node {link.label} sent a malformed list of missing keys")
    return miss


def inline_sizes(meta: dict[str, Any], n: int, plen: int, link: Link) -> np.ndarray:
    """The ``n`` value sizes of a GET reply whose values travel in its payload; they must add up to ``plen``."""
    lens = int_table(meta.get("sizes"), "<i8", n, link)
    if int(lens.sum()) != plen:
        raise ProtocolError(f"DRAM storage node {link.label} sent {plen} bytes for values of {int(lens.sum())}")
    return lens


def slab_columns(
    meta: dict[str, Any], n: int, plen: int, link: Link
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Slab ids, offsets, lengths and the spilled mask of a shared-memory GET reply's ``n`` values.

    Spilled values (slab -1) travel in the payload: they must fill its ``plen`` bytes exactly.
    """
    sids = int_table(meta.get("slabs"), "<i4", n, link, allow_negative=True)
    offs = int_table(meta.get("offs"), "<i8", n, link)
    lens = int_table(meta.get("lens"), "<i8", n, link)
    spilled = sids < 0
    if int(lens[spilled].sum()) != plen or bool((offs[spilled] + lens[spilled] > plen).any()):
        raise ProtocolError(f"DRAM storage node {link.label} sent {plen} inline bytes that do not hold its values")
    return sids, offs, lens, spilled


def pin_of(meta: dict[str, Any], link: Link) -> int:
    """The pin a shared-memory GET reply holds on the node for its views (0: none)."""
    pin = meta.get("pin") or 0
    if type(pin) is not int:
        raise ProtocolError(f"DRAM storage node {link.label} sent a malformed pin {pin!r:.40}")
    return pin


def check_in_slabs(
    slabs: Sequence[MappedSlab], sids: np.ndarray, offs: np.ndarray, lens: np.ndarray, link: Link
) -> None:
    """Every value a reply places in one of the mapped ``slabs`` ends inside it."""
    for slab in slabs:
        mine = sids == slab.id
        if bool((offs[mine] + lens[mine] > slab.size).any()):
            raise ProtocolError(f"DRAM storage node {link.label} sent values past the end of slab {slab.id}")
