"""A DRAM storage node's memory and key index (:class:`StorageNode`), without any networking.

Memory is a set of *slabs*: ``memfd`` files, allocated (zeroed) by the node when created and kept
mapped, so writes never take first-touch page faults. A put batch gets one contiguous *extent*
in a slab (values at :data:`~tq_redis.backends.dram.protocol.ALIGN`-byte alignment, in order); the
extent is reference-counted by the keys that live in it and *pinned* while a reader may see it,
and its space returns to the slab's free list when both reach zero. When no extent fits the whole
batch, each value gets its own (all or none). Empty slabs, batch-sized ones included, stay mapped
for reuse up to ``keep_warm`` bytes; beyond that they are released at once. A node with a spill
tier (:mod:`tq_redis.backends.dram.spill`) writes a batch that does not fit its capacity there
instead of refusing it.

:mod:`tq_redis.backends.dram.server` serves a node over sockets; tests drive one in-process.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re
import threading
import uuid
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from tq_redis.backends.dram.protocol import ALIGN, ST_FULL, ST_INTERNAL, aligned, layout
from tq_redis.backends.dram.spill import SpillTier
from tq_redis.redact import redact
from tq_redis.units import format_size

log = logging.getLogger(__name__)

__all__ = ["Extent", "Refused", "StorageNode", "Txn"]

PAGE = mmap.PAGESIZE


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Refused(Exception):
    """A request the node turns down with a status code (the connection stays usable)."""

    def __init__(self, code: int, msg: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(msg)
        self.code = code
        self.extra = extra or {}  # more fields of the reply's header map


class _Slab:
    """One memfd-backed region of node memory with a first-fit free list."""

    __slots__ = ("id", "size", "fd", "mm", "view", "free", "used", "dedicated")

    def __init__(self, sid: int, size: int, dedicated: bool) -> None:
        self.id, self.size, self.dedicated = sid, size, dedicated
        self.fd = os.memfd_create(f"tq-dram-slab-{sid}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            # allocate the pages now: a client's first write must not pay for zero-filling them
            os.posix_fallocate(self.fd, 0, size)
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError:
            os.close(self.fd)
            raise
        self.view = memoryview(self.mm)
        self.free: list[list[int]] = [[0, size]]  # sorted [offset, length] blocks
        self.used = 0

    def take(self, size: int) -> int | None:
        for j, block in enumerate(self.free):
            off, length = block
            if length >= size:
                if length == size:
                    del self.free[j]
                else:
                    block[0] += size
                    block[1] -= size
                self.used += size
                return off
        return None

    def give(self, off: int, size: int) -> None:
        free = self.free
        j = bisect_left(free, [off, 0])
        if j and free[j - 1][0] + free[j - 1][1] == off:  # merge with the block before
            j -= 1
            free[j][1] += size
        else:
            free.insert(j, [off, size])
        if j + 1 < len(free) and free[j][0] + free[j][1] == free[j + 1][0]:  # and after
            free[j][1] += free.pop(j + 1)[1]
        self.used -= size

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a stray view: unmapped when it is collected
            self.mm.close()
        os.close(self.fd)


class Extent:
    """A contiguous allocation holding the values of one put batch (or one value)."""

    __slots__ = ("id", "slab", "off", "size", "refs", "pins", "reserved")

    def __init__(self, eid: int, slab: _Slab, off: int, size: int) -> None:
        self.id, self.slab, self.off, self.size = eid, slab, off, size
        self.refs = 0  # keys stored in it
        self.pins = 0  # readers that may still see it
        self.reserved = True  # written but not committed


@dataclass
class Txn:
    """Reserved, not yet visible values of one put."""

    keys: list[str]
    chunks: list[tuple[Extent, int, int]]  # (extent, first value index, value count)
    items: list[tuple[str, tuple]] = field(default_factory=list)
    spilled: bool = False  # the values go to the spill tier (entries (0, -1, file id, length))


class StorageNode:
    """The node's memory and index; every method is thread-safe."""

    def __init__(
        self,
        node_id: str,
        capacity: int,
        *,
        slab_size: int | None = None,
        keep_warm: int = 128 << 20,
        spill: str | None = None,
    ) -> None:
        self.node_id = node_id
        self.instance = uuid.uuid4().hex
        self.capacity = capacity
        self.slab_limit = _round_up(capacity, PAGE)
        auto = min(max(64 << 20, capacity // 64), 1 << 30)
        self.slab_size = _round_up(min(slab_size or auto, self.slab_limit), PAGE)
        self.keep_warm = keep_warm
        owner = re.sub(r"[^A-Za-z0-9._-]", "_", node_id) + "-" + self.instance[:12]
        self.spill = SpillTier(spill, owner) if spill else None
        self.lock = threading.Lock()
        # key -> (extent id, slab id, offset, length): ints only, so the garbage collector stops
        # tracking these tuples and a node holding millions of keys has no long GC pauses.
        # A spilled value is (0, -1, file id, length).
        self.entries: dict[str, tuple[int, int, int, int]] = {}
        # key -> the replicated ring it was put under (only keys of replicated puts): what a
        # repair lists when a node that held copies of them died
        self.places: dict[str, str] = {}
        self.extents: dict[int, Extent] = {}
        self._extent_ids = itertools.count(1)
        self.slabs: dict[int, _Slab] = {}
        self.slab_bytes = 0
        self.used = 0
        self._slab_ids = itertools.count(1)
        self._pin_ids = itertools.count(1)
        self._txn_ids = itertools.count(1)
        self.pins: dict[int, tuple[str, list[Extent]]] = {}
        self.client_pins: dict[str, set[int]] = {}
        self.client_conns: dict[str, int] = {}

    # -- allocation (lock held) ---------------------------------------------------------------
    def _alloc(self, size: int) -> Extent | None:
        for slab in self.slabs.values():
            off = slab.take(size)
            if off is not None:
                return self._extent(slab, off, size)
        slab = self._new_slab(size)
        if slab is None:
            return None
        return self._extent(slab, slab.take(size), size)  # type: ignore[arg-type]

    def _extent(self, slab: _Slab, off: int, size: int) -> Extent:
        self.used += size
        ext = Extent(next(self._extent_ids), slab, off, size)
        self.extents[ext.id] = ext
        return ext

    def _new_slab(self, size: int) -> _Slab | None:
        dedicated = size > self.slab_size
        want = _round_up(size, PAGE) if dedicated else self.slab_size
        if self.slab_bytes + want > self.slab_limit:
            for s in [s for s in self.slabs.values() if s.used == 0]:  # make room: drop empty slabs
                self._drop_slab(s)
                if self.slab_bytes + want <= self.slab_limit:
                    break
        room = self.slab_limit - self.slab_bytes
        if want > room:
            want = room // PAGE * PAGE
            if want < size:
                return None
        try:
            slab = _Slab(next(self._slab_ids), want, dedicated)
        except OSError as exc:
            log.warning("could not allocate a %s memory slab: %s", format_size(want), exc)
            return None
        self.slabs[slab.id] = slab
        self.slab_bytes += want
        return slab

    def _drop_slab(self, slab: _Slab) -> None:
        del self.slabs[slab.id]
        self.slab_bytes -= slab.size
        slab.close()

    def _release(self, ext: Extent) -> None:
        """Give an extent's space back once nothing stores, reserves or pins it."""
        if ext.refs or ext.pins or ext.reserved:
            return
        slab = ext.slab
        slab.give(ext.off, ext.size)
        self.used -= ext.size
        del self.extents[ext.id]
        if slab.used == 0 and slab.id in self.slabs:
            # Dedicated (batch-sized) slabs stay warm too: a client that puts and clears the same
            # large batch shape again would otherwise pay for zeroing fresh pages every time.
            warm = sum(s.size for s in self.slabs.values() if s.used == 0)
            if warm > self.keep_warm:
                self._drop_slab(slab)

    def _alloc_each(self, room: np.ndarray) -> list[tuple[Extent, int, int]]:
        """Fragmented memory: one extent per value, all or none."""
        chunks: list[tuple[Extent, int, int]] = []
        for i, a in enumerate(room.tolist()):
            ext = self._alloc(max(a, ALIGN))
            if ext is None:
                for e, _i, _n in chunks:
                    e.reserved = False
                    self._release(e)
                return []
            chunks.append((ext, i, 1))
        return chunks

    # -- operations ---------------------------------------------------------------------------
    def reserve(self, keys: list[str], sizes: np.ndarray) -> Txn:
        """Reserve space for a batch (all or nothing); raises ``Refused(ST_FULL)``."""
        room = aligned(sizes)
        total = max(int(room.sum()), ALIGN)
        with self.lock:
            chunks: list[tuple[Extent, int, int]] = []
            if self.used + total <= self.capacity:
                ext = self._alloc(total)
                if ext is not None:
                    chunks.append((ext, 0, len(keys)))
                else:
                    chunks = self._alloc_each(room)
            if not chunks and self.spill is not None:
                return self._spill_txn(keys, sizes)
            if not chunks:
                raise Refused(
                    ST_FULL,
                    f"DRAM storage node {self.node_id!r} is full: a put of {format_size(total)} does not "
                    f"fit ({format_size(self.used)} of {format_size(self.capacity)} in use, "
                    f"{len(self.entries)} keys). Restart it with a larger --capacity, add storage nodes, "
                    f"or clear consumed partitions.",
                )
        txn = Txn(keys, chunks)
        for ext, start, count in chunks:
            offs, _ = layout(sizes[start : start + count])
            txn.items.extend(
                zip(
                    keys[start : start + count],
                    zip(repeat(ext.id), repeat(ext.slab.id), (offs + ext.off).tolist(),
                        sizes[start : start + count].tolist()),
                )
            )  # fmt: skip
        return txn

    def _spill_txn(self, keys: list[str], sizes: np.ndarray) -> Txn:
        ids = self.spill.new_ids(len(keys))  # type: ignore[union-attr]
        return Txn(keys, [], list(zip(keys, zip(repeat(0), repeat(-1), ids, sizes.tolist()))), spilled=True)

    def spill_write(self, txn: Txn, values: list[memoryview]) -> None:
        """Write a spilled put's values to the tier; raises ``Refused(ST_FULL)`` if it refuses."""
        spill = self.spill
        assert spill is not None
        try:
            for (_key, ent), value in zip(txn.items, values):
                spill.write(ent[2], value)
        except OSError as exc:
            self.abort(txn)
            raise Refused(
                ST_FULL,
                f"DRAM storage node {self.node_id!r} is full and its spill tier {redact(spill.url)!r} refused "
                f"the overflow ({exc}). Free space there, add storage nodes, or clear consumed partitions.",
            ) from None

    def value_views(self, txn: Txn) -> list[memoryview]:
        """Writable views of every reserved value, in key order."""
        return [self.slabs[ent[1]].view[ent[2] : ent[2] + ent[3]] for _k, ent in txn.items]

    def commit(self, txn: Txn) -> None:
        """Make a reserved put visible; the values it overwrites are released."""
        gone: list[tuple[int, int]] = []
        with self.lock:
            for ext, _start, count in txn.chunks:
                ext.reserved = False
                ext.refs += count
            entries = self.entries
            for k in entries.keys() & set(txn.keys):  # overwrites release the old values
                self._forget(entries[k], gone)
            entries.update(txn.items)
        if gone:
            self.spill.remove(gone)  # type: ignore[union-attr]

    def _forget(self, ent: tuple[int, int, int, int], spilled: list[tuple[int, int]]) -> None:
        """Drop one stored value's claim on its memory (lock held); spilled files are collected."""
        if ent[0] == 0:
            spilled.append((ent[2], ent[3]))
            return
        ext = self.extents[ent[0]]
        ext.refs -= 1
        self._release(ext)

    def abort(self, txn: Txn) -> None:
        """Drop a reserved put: its space (or its spilled files) is given back."""
        if txn.spilled:
            self.spill.remove([(ent[2], ent[3]) for _k, ent in txn.items])  # type: ignore[union-attr]
            return
        with self.lock:
            for ext, _start, _count in txn.chunks:
                ext.reserved = False
                self._release(ext)

    def lookup(self, keys: list[str], owner: str | None) -> tuple[list[tuple], list[int], int, list[Extent]]:
        """Entries of present keys, indexes of missing ones, and a pin on their extents.

        With ``owner`` the pin is registered (id > 0) until ``unpin``; otherwise the caller
        must ``unpin_extents`` the returned extents itself.
        """
        with self.lock:
            ents = list(map(self.entries.get, keys))
            missing = [i for i, e in enumerate(ents) if e is None] if None in ents else []
            present = [e for e in ents if e is not None] if missing else ents
            exts = [self.extents[i] for i in {e[0] for e in present} - {0}]  # 0: spilled, unpinned
            for x in exts:
                x.pins += 1
            pin = 0
            if owner is not None and exts:
                pin = next(self._pin_ids)
                self.pins[pin] = (owner, exts)
                self.client_pins.setdefault(owner, set()).add(pin)
        return present, missing, pin, exts  # type: ignore[return-value]

    def unpin_extents(self, exts: Sequence[Extent]) -> None:
        """Release an unregistered pin taken by :meth:`lookup` (``owner=None``)."""
        with self.lock:
            for x in exts:
                x.pins -= 1
                self._release(x)

    def unpin(self, pins: Sequence[int]) -> None:
        """Release registered pins by id; unknown ids are ignored (a pin is released once)."""
        with self.lock:
            for pin in pins:
                rec = self.pins.pop(pin, None)
                if rec is None:
                    continue
                owner, exts = rec
                self.client_pins.get(owner, set()).discard(pin)
                for x in exts:
                    x.pins -= 1
                    self._release(x)

    def place(self, keys: list[str], ring: str) -> None:
        """Note that ``keys`` were put under the replicated ring ``ring`` (before their commit: a
        note whose value is never committed is not listed)."""
        with self.lock:
            self.places.update(dict.fromkeys(keys, ring))

    def placed(self, ring: str) -> list[str]:
        """The keys held that were put (or copied by a repair) under replicated ring ``ring``."""
        with self.lock:
            return [k for k, r in self.places.items() if r == ring and k in self.entries]

    def delete(self, keys: list[str]) -> int:
        """Remove keys (absent ones are ignored); returns how many were present."""
        n = 0
        gone: list[tuple[int, int]] = []
        with self.lock:
            pop = self.entries.pop
            if self.places:
                for k in keys:
                    self.places.pop(k, None)
            for k in keys:
                ent = pop(k, None)
                if ent is not None:
                    n += 1
                    self._forget(ent, gone)
        if gone:
            self.spill.remove(gone)  # type: ignore[union-attr]
        return n

    def read_spilled(self, entries: Sequence[tuple[int, int, int, int]]) -> list[bytes]:
        """The bytes of spilled values; a file that vanished is reported, not papered over."""
        out = []
        for ent in entries:
            try:
                data = self.spill.read(ent[2])  # type: ignore[union-attr]
            except OSError as exc:
                raise Refused(
                    ST_INTERNAL, f"DRAM storage node {self.node_id!r} lost a spilled value ({exc})"
                ) from None
            if len(data) != ent[3]:
                raise Refused(
                    ST_INTERNAL,
                    f"DRAM storage node {self.node_id!r}: a spilled value has {len(data)} bytes, not {ent[3]}",
                )
            out.append(data)
        return out

    def client_connected(self, client: str) -> None:
        """Count one more connection of ``client`` (its pins live until its last one closes)."""
        with self.lock:
            self.client_conns[client] = self.client_conns.get(client, 0) + 1

    def client_disconnected(self, client: str) -> None:
        """When a client's last connection closes, its pins go with it."""
        with self.lock:
            left = self.client_conns.get(client, 1) - 1
            if left > 0:
                self.client_conns[client] = left
                return
            self.client_conns.pop(client, None)
            pins = list(self.client_pins.pop(client, ()))
        self.unpin(pins)

    def live_slabs(self) -> list[int]:
        """Ids of the slabs the node still has (clients unmap the others)."""
        with self.lock:
            return list(self.slabs)

    def slab_fds(self, sids: Sequence[int]) -> tuple[list[int], list[list[int]]]:
        """File descriptors and ``[id, size]`` of those of ``sids`` the node still has."""
        with self.lock:
            found = [self.slabs[s] for s in sids if s in self.slabs]
            return [s.fd for s in found], [[s.id, s.size] for s in found]

    def stats(self) -> dict[str, Any]:
        """Used and capacity bytes, key, slab, pin and client counts, spilled keys and bytes."""
        with self.lock:
            return {
                "node_id": self.node_id,
                "instance": self.instance,
                "used": self.used,
                "capacity": self.capacity,
                "keys": len(self.entries),
                "slabs": len(self.slabs),
                "slab_bytes": self.slab_bytes,
                "pins": len(self.pins),
                "clients": len(self.client_conns),
                "pinned_extents": sum(1 for _o, ex in self.pins.values() for _ in ex),
                "spill": self.spill.url if self.spill else None,
                "spilled_keys": self.spill.files if self.spill else 0,
                "spilled_bytes": self.spill.bytes if self.spill else 0,
            }

    def next_txn_id(self) -> int:
        """A fresh id for a put that waits for its commit."""
        return next(self._txn_ids)

    def close(self) -> None:
        """Free the memory and remove the spill tier's files (the node's values die with it).

        Call it once no request is being served any more (see ``dram_server``): a request still
        running could otherwise touch released memory or spill files being removed.
        """
        with self.lock:
            for slab in list(self.slabs.values()):
                self._drop_slab(slab)
            self.entries.clear()
            self.extents.clear()
        if self.spill is not None:
            self.spill.close()
