"""A DRAM storage node: holds data-plane values in memory for the ``dram`` store.

Run one with ``python -m tq_redis.backends.dram_server --redis URL --capacity 4GiB`` (or
``tq-redis storage-unit``). It registers itself in Redis (``<ns>:storage:nodes``), heartbeats
every second with its used bytes, and deregisters on SIGTERM / SIGINT.

Memory is a set of *slabs*: ``memfd`` files, allocated (zeroed) by the node when created and kept
mapped, so writes never take first-touch page faults. A put batch gets one contiguous *extent*
in a slab (values at 64-byte alignment, in order); the extent is reference-counted by the keys
that live in it and *pinned* while a reader may see it, and its space returns to the slab's free
list when both reach zero. Empty slabs beyond ``--keep-warm`` bytes are released at once.

Same-host clients connect over an abstract Unix socket and receive slab fds (``SCM_RIGHTS``); they
write values straight into reserved extents and read them in place. Remote clients use TCP, and
the node moves payloads between the socket and its slabs with scatter/gather syscalls. The wire
protocol lives in :mod:`tq_redis.backends.dram`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hmac
import itertools
import json
import logging
import mmap
import os
import re
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np
import redis
from tq_redis.backends.dram import (
    OP_ABORT,
    OP_ALLOC,
    OP_COMMIT,
    OP_DEL,
    OP_FDS,
    OP_GET,
    OP_HELLO,
    OP_PUT,
    OP_STATS,
    PROTOCOL_VERSION,
    ST_AUTH,
    ST_BAD,
    ST_FULL,
    ST_INTERNAL,
    ST_OK,
    drain,
    format_size,
    layout,
    parse_size,
    recv_header,
    recv_into_buffers,
    recv_meta,
    send_frame,
)
from tq_redis.backends.dram_spill import SpillTier

from tq_redis.errors import StorageUnavailable
from tq_redis.keys import storage_nodes_key

log = logging.getLogger("tq_redis.dram_server")

__all__ = ["LocalNodes", "StorageNode", "main", "spawn_node", "start_local_nodes"]

PAGE = mmap.PAGESIZE


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Refused(Exception):
    """A request the node turns down with a status code (the connection stays usable)."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


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


class _Extent:
    """A contiguous allocation holding the values of one put batch (or one value)."""

    __slots__ = ("id", "slab", "off", "size", "refs", "pins", "reserved")

    def __init__(self, eid: int, slab: _Slab, off: int, size: int) -> None:
        self.id, self.slab, self.off, self.size = eid, slab, off, size
        self.refs = 0  # keys stored in it
        self.pins = 0  # readers that may still see it
        self.reserved = True  # written but not committed


@dataclass
class _Txn:
    """Reserved, not yet visible values of one put."""

    keys: list[str]
    chunks: list[tuple[_Extent, int, int]]  # (extent, first value index, value count)
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
        self.extents: dict[int, _Extent] = {}
        self._extent_ids = itertools.count(1)
        self.slabs: dict[int, _Slab] = {}
        self.slab_bytes = 0
        self.used = 0
        self._slab_ids = itertools.count(1)
        self._pin_ids = itertools.count(1)
        self._txn_ids = itertools.count(1)
        self.pins: dict[int, tuple[str, list[_Extent]]] = {}
        self.client_pins: dict[str, set[int]] = {}
        self.client_conns: dict[str, int] = {}

    # -- allocation (lock held) ---------------------------------------------------------------
    def _alloc(self, size: int) -> _Extent | None:
        for slab in self.slabs.values():
            off = slab.take(size)
            if off is not None:
                return self._extent(slab, off, size)
        slab = self._new_slab(size)
        if slab is None:
            return None
        return self._extent(slab, slab.take(size), size)  # type: ignore[arg-type]

    def _extent(self, slab: _Slab, off: int, size: int) -> _Extent:
        self.used += size
        ext = _Extent(next(self._extent_ids), slab, off, size)
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

    def _release(self, ext: _Extent) -> None:
        """Give an extent's space back once nothing stores, reserves or pins it."""
        if ext.refs or ext.pins or ext.reserved:
            return
        slab = ext.slab
        slab.give(ext.off, ext.size)
        self.used -= ext.size
        del self.extents[ext.id]
        if slab.used == 0 and slab.id in self.slabs:
            warm = sum(s.size for s in self.slabs.values() if s.used == 0 and not s.dedicated)
            if slab.dedicated or warm > self.keep_warm:
                self._drop_slab(slab)

    def _alloc_each(self, aligned: np.ndarray) -> list[tuple[_Extent, int, int]]:
        """Fragmented memory: one extent per value, all or none."""
        chunks: list[tuple[_Extent, int, int]] = []
        for i, a in enumerate(aligned.tolist()):
            ext = self._alloc(max(a, 64))
            if ext is None:
                for e, _i, _n in chunks:
                    e.reserved = False
                    self._release(e)
                return []
            chunks.append((ext, i, 1))
        return chunks

    # -- operations ---------------------------------------------------------------------------
    def reserve(self, keys: list[str], sizes: np.ndarray) -> _Txn:
        """Reserve space for a batch (all or nothing); raises ``_Refused(ST_FULL)``."""
        aligned = (sizes + 63) & ~63
        total = max(int(aligned.sum()), 64)
        with self.lock:
            chunks: list[tuple[_Extent, int, int]] = []
            if self.used + total <= self.capacity:
                ext = self._alloc(total)
                if ext is not None:
                    chunks.append((ext, 0, len(keys)))
                else:
                    chunks = self._alloc_each(aligned)
            if not chunks and self.spill is not None:
                return self._spill_txn(keys, sizes)
            if not chunks:
                raise _Refused(
                    ST_FULL,
                    f"DRAM storage node {self.node_id!r} is full: a put of {format_size(total)} does not "
                    f"fit ({format_size(self.used)} of {format_size(self.capacity)} in use, "
                    f"{len(self.entries)} keys). Restart it with a larger --capacity, add storage nodes, "
                    f"or clear consumed partitions.",
                )
        txn = _Txn(keys, chunks)
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

    def _spill_txn(self, keys: list[str], sizes: np.ndarray) -> _Txn:
        ids = self.spill.new_ids(len(keys))  # type: ignore[union-attr]
        return _Txn(keys, [], list(zip(keys, zip(repeat(0), repeat(-1), ids, sizes.tolist()))), spilled=True)

    def spill_write(self, txn: _Txn, values: list[memoryview]) -> None:
        """Write a spilled put's values to the tier; raises ``_Refused(ST_FULL)`` if it refuses."""
        spill = self.spill
        assert spill is not None
        try:
            for (_key, ent), value in zip(txn.items, values):
                spill.write(ent[2], value)
        except OSError as exc:
            self.abort(txn)
            raise _Refused(
                ST_FULL,
                f"DRAM storage node {self.node_id!r} is full and its spill tier {spill.url!r} refused "
                f"the overflow ({exc}). Free space there, add storage nodes, or clear consumed partitions.",
            ) from None

    def value_views(self, txn: _Txn) -> list[memoryview]:
        """Writable views of every reserved value, in key order."""
        return [self.slabs[ent[1]].view[ent[2] : ent[2] + ent[3]] for _k, ent in txn.items]

    def commit(self, txn: _Txn) -> None:
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

    def abort(self, txn: _Txn) -> None:
        if txn.spilled:
            self.spill.remove([(ent[2], ent[3]) for _k, ent in txn.items])  # type: ignore[union-attr]
            return
        with self.lock:
            for ext, _start, _count in txn.chunks:
                ext.reserved = False
                self._release(ext)

    def lookup(self, keys: list[str], owner: str | None) -> tuple[list[tuple], list[int], int, list[_Extent]]:
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

    def unpin_extents(self, exts: Sequence[_Extent]) -> None:
        with self.lock:
            for x in exts:
                x.pins -= 1
                self._release(x)

    def unpin(self, pins: Sequence[int]) -> None:
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

    def delete(self, keys: list[str]) -> int:
        n = 0
        gone: list[tuple[int, int]] = []
        with self.lock:
            pop = self.entries.pop
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
                raise _Refused(
                    ST_INTERNAL, f"DRAM storage node {self.node_id!r} lost a spilled value ({exc})"
                ) from None
            if len(data) != ent[3]:
                raise _Refused(
                    ST_INTERNAL,
                    f"DRAM storage node {self.node_id!r}: a spilled value has {len(data)} bytes, not {ent[3]}",
                )
            out.append(data)
        return out

    def client_connected(self, client: str) -> None:
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
        with self.lock:
            return list(self.slabs)

    def slab_fds(self, sids: Sequence[int]) -> tuple[list[int], list[list[int]]]:
        with self.lock:
            found = [self.slabs[s] for s in sids if s in self.slabs]
            return [s.fd for s in found], [[s.id, s.size] for s in found]

    def stats(self) -> dict[str, Any]:
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

    def close(self) -> None:
        with self.lock:
            for slab in list(self.slabs.values()):
                self._drop_slab(slab)
            self.entries.clear()
            self.extents.clear()
        if self.spill is not None:
            self.spill.close()


class _Session:
    """One client connection, served by its own thread."""

    def __init__(self, node: StorageNode, sock: socket.socket, local: bool, token: str | None, shm: bool):
        self.node, self.sock, self.local = node, sock, local
        self.token = token
        self.shm_ok = shm and local
        self.shm = False
        self.authed = token is None
        self.client: str | None = None
        self.txns: dict[int, _Txn] = {}
        self.sent_slabs: set[int] = set()

    def run(self) -> None:
        sock = self.sock
        try:
            while True:
                try:
                    op, mlen, plen, _fds = recv_header(sock)
                except (ConnectionError, OSError):
                    return
                meta = recv_meta(sock, mlen)
                try:
                    self._dispatch(op, meta, plen)
                except _Refused as exc:
                    send_frame(sock, exc.code, {"msg": str(exc)})
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug: report it to the client and drop the connection
            log.exception("request failed")
            with contextlib.suppress(OSError):
                send_frame(sock, ST_INTERNAL, {"msg": "internal error in the storage node (see its log)"})
        finally:
            for txn in self.txns.values():
                self.node.abort(txn)
            if self.client is not None:
                self.node.client_disconnected(self.client)
            with contextlib.suppress(OSError):
                sock.close()

    def _dispatch(self, op: int, meta: dict[str, Any], plen: int) -> None:
        node = self.node
        if op == OP_HELLO:
            return self._hello(meta)
        if not self.authed:
            drain(self.sock, plen)
            raise _Refused(
                ST_AUTH,
                f"DRAM storage node {node.node_id!r} requires a token: set the store option "
                f"'token' or TQ_STORAGE_TOKEN to the value the node was started with",
            )
        if meta.get("unpin"):
            node.unpin(meta["unpin"])
        if op == OP_PUT:
            return self._put(meta, plen)
        if plen:
            drain(self.sock, plen)
            raise _Refused(ST_BAD, f"request {op} carries no payload")
        if op == OP_GET:
            return self._get(meta)
        if op == OP_ALLOC:
            return self._alloc(meta)
        if op in (OP_COMMIT, OP_ABORT):
            for t in meta.get("txns") or ():
                txn = self.txns.pop(t, None)
                if txn is not None:
                    (node.commit if op == OP_COMMIT else node.abort)(txn)
                elif op == OP_COMMIT:
                    raise _Refused(ST_BAD, f"unknown transaction {t} (reservation lost?)")
            return send_frame(self.sock, ST_OK)
        if op == OP_DEL:
            reply: dict[str, Any] = {"deleted": node.delete(list(meta.get("keys") or ()))}
            if self.shm:  # lets the client unmap slabs the delete released
                reply["live"] = node.live_slabs()
            return send_frame(self.sock, ST_OK, reply)
        if op == OP_FDS:
            return self._reply_with_slabs({}, list(meta.get("slabs") or ()), force=True)
        if op == OP_STATS:
            return send_frame(self.sock, ST_OK, node.stats())
        raise _Refused(ST_BAD, f"unknown request {op}")

    def _hello(self, meta: dict[str, Any]) -> None:
        node = self.node
        if meta.get("v") != PROTOCOL_VERSION:
            raise _Refused(ST_BAD, f"protocol version {meta.get('v')} is not {PROTOCOL_VERSION}")
        if self.token is not None:
            given = meta.get("token") or ""
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                raise _Refused(
                    ST_AUTH,
                    f"DRAM storage node {node.node_id!r} rejected the token: set the store option "
                    f"'token' or TQ_STORAGE_TOKEN to the value the node was started with",
                )
        self.authed = True
        if self.client is None and meta.get("client"):
            self.client = str(meta["client"])
            node.client_connected(self.client)
        self.shm = self.shm_ok and bool(meta.get("shm"))
        send_frame(
            self.sock, ST_OK, {"node_id": node.node_id, "instance": node.instance, "shm": self.shm}
        )

    def _batch(self, meta: dict[str, Any]) -> tuple[list[str], np.ndarray]:
        keys = meta.get("keys")
        sizes = np.frombuffer(meta.get("sizes") or b"", dtype="<i8")
        if not isinstance(keys, list) or len(keys) != len(sizes) or (sizes < 0).any():
            raise _Refused(ST_BAD, "malformed put: keys and sizes disagree")
        if len(set(keys)) != len(keys):
            raise _Refused(ST_BAD, "put got the same key twice in one batch")
        return keys, sizes

    def _put(self, meta: dict[str, Any], plen: int) -> None:
        try:
            keys, sizes = self._batch(meta)
            if int(sizes.sum()) != plen:
                raise _Refused(ST_BAD, "malformed put: payload length is not the sum of the sizes")
            txn = self.node.reserve(keys, sizes)
        except _Refused:
            drain(self.sock, plen)
            raise
        if txn.spilled:
            buf = memoryview(bytearray(plen))
            offs = np.concatenate(([0], np.cumsum(sizes))).tolist()
            views = list(map(buf.__getitem__, map(slice, offs[:-1], offs[1:])))
            recv_into_buffers(self.sock, views)
            self.node.spill_write(txn, views)
        else:
            try:
                recv_into_buffers(self.sock, self.node.value_views(txn))
            except BaseException:
                self.node.abort(txn)
                raise
        if meta.get("commit", True):
            self.node.commit(txn)
            return send_frame(self.sock, ST_OK)
        t = next(self.node._txn_ids)
        self.txns[t] = txn
        send_frame(self.sock, ST_OK, {"txn": t})

    def _alloc(self, meta: dict[str, Any]) -> None:
        if not self.shm:
            raise _Refused(ST_BAD, "ALLOC needs a shared-memory connection")
        keys, sizes = self._batch(meta)
        txn = self.node.reserve(keys, sizes)
        if txn.spilled:  # no room in memory: the client sends these values inline (OP_PUT)
            return send_frame(self.sock, ST_OK, {"inline": True})
        t = next(self.node._txn_ids)
        self.txns[t] = txn
        chunks = [[ext.slab.id, ext.off, start, count] for ext, start, count in txn.chunks]
        self._reply_with_slabs({"txn": t, "chunks": chunks}, [c[0] for c in chunks])

    def _reply_with_slabs(
        self, meta: dict[str, Any], sids: list[int], force: bool = False, payload: Sequence[Any] = ()
    ) -> None:
        """Reply, passing the fds of referenced slabs this connection has not been sent yet."""
        want = [s for s in dict.fromkeys(sids) if s >= 0 and (force or s not in self.sent_slabs)]
        fds, fd_slabs = self.node.slab_fds(want)
        self.sent_slabs.update(s for s, _size in fd_slabs)
        meta["fd_slabs"] = fd_slabs
        meta["live"] = self.node.live_slabs()
        if payload:
            send_frame(self.sock, ST_OK, meta, payload, sum(map(len, payload)), fds=fds)
        else:
            send_frame(self.sock, ST_OK, meta, fds=fds)

    def _get(self, meta: dict[str, Any]) -> None:
        keys = meta.get("keys")
        if not isinstance(keys, list):
            raise _Refused(ST_BAD, "malformed get: no keys")
        node = self.node
        shm = self.shm and bool(meta.get("shm"))
        present, missing, pin, exts = node.lookup(keys, self.client if shm else None)
        if present:
            _e, sids, offs, lens = zip(*present)
        else:
            sids = offs = lens = ()
        spilled = [i for i, sid in enumerate(sids) if sid < 0] if -1 in sids else []
        try:
            inline = node.read_spilled([present[i] for i in spilled])
        except _Refused:
            if pin:
                node.unpin([pin])
            else:
                node.unpin_extents(exts)
            raise
        if shm:
            offs = np.array(offs, dtype="<i8")
            if spilled:  # spilled values travel in the payload: slab -1, offset into the payload
                ends = np.cumsum([len(b) for b in inline])
                offs[spilled] = ends - np.array([len(b) for b in inline])
            reply = {
                "slabs": np.array(sids, dtype="<i4").tobytes(),
                "offs": offs.tobytes(),
                "lens": np.array(lens, dtype="<i8").tobytes(),
                "missing": missing,
                "pin": pin,
            }
            if pin == 0 and exts:
                node.unpin_extents(exts)
            return self._reply_with_slabs(reply, list(dict.fromkeys(sids)), payload=inline)
        try:
            slabs = node.slabs  # the extents are pinned: their slabs stay
            spilled_data = iter(inline)
            views = [
                next(spilled_data) if ent[1] < 0 else slabs[ent[1]].view[ent[2] : ent[2] + ent[3]] for ent in present
            ]
            reply = {"sizes": np.array(lens, dtype="<i8").tobytes(), "missing": missing}
            send_frame(self.sock, ST_OK, reply, views, int(sum(lens)))
        finally:
            node.unpin_extents(exts)


# --------------------------------------------------------------------------------------------
# Process: listeners, registration, heartbeat
# --------------------------------------------------------------------------------------------


class _Server:
    """A node process: listeners, sessions, the Redis registration and its heartbeat."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stop = threading.Event()
        self.token: str | None = args.token or os.environ.get("TQ_STORAGE_TOKEN") or None
        host, _, port = args.listen.rpartition(":")
        self.tcp = socket.create_server((host or "127.0.0.1", int(port)), reuse_port=False, backlog=128)
        bound_port = self.tcp.getsockname()[1]
        adv = args.advertise
        if not adv:
            adv_host = host if host not in ("", "0.0.0.0", "::", "[::]") else socket.gethostname()
            adv = f"{adv_host}:{bound_port}"
        self.address = adv
        node_id = args.node_id or adv
        self.node = StorageNode(
            node_id,
            parse_size(args.capacity),
            slab_size=parse_size(args.slab_size) if args.slab_size else None,
            keep_warm=parse_size(args.keep_warm) if args.keep_warm not in ("0", 0) else 0,
            spill=args.spill,
        )
        self.uds: socket.socket | None = None
        self.uds_name: str | None = None
        if args.shm:
            self.uds_name = f"tq-dram-{self.node.instance}"
            self.uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.uds.bind("\0" + self.uds_name)
            self.uds.listen(128)
        self.redis = redis.Redis.from_url(args.redis, socket_timeout=5, socket_connect_timeout=5)
        self.key = storage_nodes_key(args.namespace)
        self.started = time.time()
        self.registered = False

    def info(self, now: float) -> dict[str, Any]:
        st = self.node.stats()
        return {
            "node_id": self.node.node_id,
            "instance": self.node.instance,
            "address": self.address,
            "host": socket.gethostname(),
            "uds": self.uds_name,
            "shm": self.uds is not None,
            "pid": os.getpid(),
            "capacity": st["capacity"],
            "used": st["used"],
            "keys": st["keys"],
            "slab_bytes": st["slab_bytes"],
            "spilled_bytes": st["spilled_bytes"],
            "heartbeat": now,
            "started": self.started,
            "auth": self.token is not None,
            "version": PROTOCOL_VERSION,
        }

    def beat(self) -> dict[str, Any]:
        sec, usec = self.redis.time()  # Redis's clock, so clients on other hosts agree on staleness
        info = self.info(sec + usec / 1e6)
        self.redis.hset(self.key, self.node.node_id, json.dumps(info))
        self.registered = True
        return info

    def heartbeat_loop(self) -> None:
        failing = False
        while not self.stop.wait(self.args.heartbeat_s):
            try:
                self.beat()
                if failing:
                    log.warning("heartbeat to Redis restored")
                failing = False
            except redis.RedisError as exc:
                if not failing:
                    log.warning("heartbeat to Redis failed (will keep trying): %s", exc)
                failing = True

    def deregister(self) -> None:
        if not self.registered:
            return
        try:
            raw = self.redis.hget(self.key, self.node.node_id)
            if raw and json.loads(raw).get("instance") == self.node.instance:
                self.redis.hdel(self.key, self.node.node_id)
        except (redis.RedisError, ValueError) as exc:
            log.warning("could not deregister from Redis: %s", exc)

    def accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.tcp, selectors.EVENT_READ, False)
        if self.uds is not None:
            sel.register(self.uds, selectors.EVENT_READ, True)
        while not self.stop.is_set():
            for key, _ev in sel.select(timeout=0.5):
                try:
                    conn, _addr = key.fileobj.accept()  # type: ignore[union-attr]
                except OSError:
                    continue
                local = bool(key.data)
                if not local:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                session = _Session(self.node, conn, local, self.token, self.uds is not None)
                threading.Thread(target=session.run, name="dram-session", daemon=True).start()

    def watch_parent(self, fd: int) -> None:
        """Stop when the parent that spawned us goes away (its end of the pipe closes)."""
        with contextlib.suppress(OSError):
            while os.read(fd, 1):
                pass
        log.warning("parent process exited; stopping")
        self.stop.set()

    def close(self) -> None:
        self.stop.set()
        self.deregister()
        for s in (self.tcp, self.uds):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        self.node.close()
        self.redis.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tq-redis storage-unit",
        description="Run a tq-redis DRAM storage node that registers itself in Redis.",
    )
    p.add_argument("--redis", required=True, help="Redis/Valkey URL of the metadata plane")
    p.add_argument("--namespace", default="tq", help="tq namespace (default: tq)")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to bind (default 127.0.0.1:0)")
    p.add_argument("--advertise", default=None, help="HOST:PORT clients should dial (default: the bound one)")
    p.add_argument("--capacity", default="2GiB", help="memory budget, e.g. 4GiB, 512MB (default 2GiB)")
    p.add_argument("--node-id", default=None, help="stable id in the registry (default: the address)")
    p.add_argument("--token", default=None, help="shared secret clients must present (or TQ_STORAGE_TOKEN)")
    p.add_argument(
        "--shm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="offer same-host clients shared memory over a unix socket (default: on)",
    )
    p.add_argument("--slab-size", default=None, help="memory slab size (default: capacity/64, 64MiB-1GiB)")
    p.add_argument(
        "--spill",
        default=None,
        metavar="URL",
        help="fsspec URL (a directory, s3://bucket/prefix, ...) for values beyond --capacity; "
        "without it a full node refuses puts with StorageFull",
    )
    p.add_argument("--keep-warm", default="128MiB", help="empty slab bytes kept for reuse (default 128MiB)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period in seconds")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run a storage node in the foreground until SIGTERM / SIGINT; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s dram-node %(levelname)s %(message)s"
    )
    try:
        server = _Server(args)
    except (OSError, ValueError) as exc:
        log.error("cannot start the storage node: %s", exc)
        return 2
    try:
        info = server.beat()
    except redis.RedisError as exc:
        log.error("cannot register in Redis at %s: %s", args.redis, exc)
        server.close()
        return 2
    stop = server.stop

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Everything allocated so far (modules, the server) lives as long as the process: keep it out of
    # the garbage collector's full passes, which otherwise stall requests for tens of milliseconds.
    gc.collect()
    gc.freeze()
    threading.Thread(target=server.heartbeat_loop, name="dram-heartbeat", daemon=True).start()
    threading.Thread(target=server.accept_loop, name="dram-accept", daemon=True).start()
    if args.parent_fd is not None:
        threading.Thread(target=server.watch_parent, args=(args.parent_fd,), daemon=True).start()
    log.info(
        "storage node %s listening on %s (capacity %s, shared memory %s)",
        info["node_id"], server.address, format_size(server.node.capacity),
        "on" if server.uds is not None else "off",
    )  # fmt: skip
    if args.ready_fd is not None:
        with contextlib.suppress(OSError):
            os.write(args.ready_fd, (json.dumps(info) + "\n").encode())
            os.close(args.ready_fd)
    while not stop.is_set():
        stop.wait(1.0)
    log.info("stopping storage node %s", server.node.node_id)
    server.close()
    return 0


# --------------------------------------------------------------------------------------------
# Spawning local nodes (tq-redis up, init() without a URL, tests)
# --------------------------------------------------------------------------------------------


@dataclass
class NodeProcess:
    """A spawned node process and its registration."""

    proc: subprocess.Popen
    info: dict[str, Any]
    parent_fd: int
    log_file: Any

    @property
    def address(self) -> str:
        return self.info["address"]

    @property
    def node_id(self) -> str:
        return self.info["node_id"]

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int:
        """Signal the process (SIGTERM: clean exit) and wait for it; SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.parent_fd >= 0:
            os.close(self.parent_fd)
            self.parent_fd = -1
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None
        return self.proc.returncode


def _log_tail(f: Any) -> str:
    try:
        f.seek(0)
        return f.read().decode(errors="replace")[-2000:]
    except (OSError, ValueError):
        return ""


# Runs the node without executing ``tq_redis/__init__`` (which imports torch: seconds per node).
_BOOT = (
    "import importlib.util, sys, types\n"
    "spec = importlib.util.find_spec('tq_redis')\n"
    "pkg = types.ModuleType('tq_redis')\n"
    "pkg.__path__ = list(spec.submodule_search_locations)\n"
    "pkg.__spec__ = spec\n"
    "sys.modules['tq_redis'] = pkg\n"
    "from tq_redis.backends.dram_server import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _launch(
    redis_url: str,
    namespace: str,
    *,
    listen: str,
    capacity: str,
    token: str | None,
    node_id: str | None,
    shm: bool,
    extra_args: Sequence[str],
    log_level: str,
) -> tuple[NodeProcess, int]:
    """Start a node process; returns it with the read end of its readiness pipe."""
    ready_r, ready_w = os.pipe()
    watch_r, watch_w = os.pipe()
    args = [
        sys.executable, "-c", _BOOT, "--redis", redis_url,
        "--namespace", namespace, "--listen", listen, "--capacity", str(capacity),
        "--ready-fd", str(ready_w), "--parent-fd", str(watch_r), "--log-level", log_level,
        "--shm" if shm else "--no-shm", *extra_args,
    ]  # fmt: skip
    if node_id:
        args += ["--node-id", node_id]
    env = dict(os.environ)
    if token is not None:
        env["TQ_STORAGE_TOKEN"] = token  # not on the command line, where `ps` would show it
    else:
        env.pop("TQ_STORAGE_TOKEN", None)
    log_file = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(
            args, pass_fds=(ready_w, watch_r), stdin=subprocess.DEVNULL, stdout=log_file,
            stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    except BaseException:
        for fd in (ready_r, watch_w):
            os.close(fd)
        log_file.close()
        raise
    finally:
        os.close(ready_w)
        os.close(watch_r)
    return NodeProcess(proc, {}, watch_w, log_file), ready_r


def _await_ready(node: NodeProcess, ready_r: int, deadline: float) -> None:
    """Wait for the node's registration line on its readiness pipe (closes the pipe)."""
    try:
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([ready_r], [], [], left)[0]:
                raise StorageUnavailable(
                    f"storage node did not register in time:\n{_log_tail(node.log_file)}"
                )
            chunk = os.read(ready_r, 65536)
            if not chunk:
                node.proc.wait()
                raise StorageUnavailable(
                    f"storage node exited with status {node.proc.returncode} before registering:\n"
                    f"{_log_tail(node.log_file)}"
                )
            line += chunk
        node.info = json.loads(line)
    finally:
        os.close(ready_r)


def spawn_node(
    redis_url: str,
    namespace: str,
    *,
    listen: str = "127.0.0.1:0",
    capacity: str = "2GiB",
    token: str | None = None,
    node_id: str | None = None,
    shm: bool = True,
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
    log_level: str = "WARNING",
) -> NodeProcess:
    """Start one node process and return once it is registered (it signals readiness on a pipe)."""
    node, ready_r = _launch(
        redis_url, namespace, listen=listen, capacity=capacity, token=token, node_id=node_id,
        shm=shm, extra_args=extra_args, log_level=log_level,
    )  # fmt: skip
    try:
        _await_ready(node, ready_r, time.monotonic() + timeout)
    except BaseException:
        node.stop(timeout=5, sig=signal.SIGKILL)
        raise
    return node


class LocalNodes:
    """Handle on storage-node processes spawned by :func:`start_local_nodes`."""

    def __init__(self, nodes: list[NodeProcess]) -> None:
        self.nodes = nodes

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    @property
    def node_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    @property
    def pids(self) -> list[int]:
        return [n.proc.pid for n in self.nodes]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node cleanly (SIGTERM; SIGKILL after ``timeout``) and wait for them."""
        for n in self.nodes:
            if n.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    n.proc.terminate()
        for n in self.nodes:
            n.stop(timeout)

    def __enter__(self) -> LocalNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local_nodes(
    redis_url: str,
    namespace: str,
    n: int = 2,
    capacity: str = "2GiB",
    token: str | None = None,
    *,
    host: str = "127.0.0.1",
    shm: bool = True,
    timeout: float = 30.0,
    spill: str | None = None,
) -> LocalNodes:
    """Spawn ``n`` storage-node processes on ``host`` (ephemeral ports) and wait until all registered.

    The nodes also stop by themselves if this process dies. Call ``.stop()`` (or use the handle as a
    context manager) to shut them down. ``spill`` is an fsspec URL for values beyond ``capacity``
    (each node uses its own directory under it; see :mod:`tq_redis.backends.dram_spill`).
    """
    launched: list[tuple[NodeProcess, int]] = []
    waited = 0
    try:
        for _ in range(n):
            launched.append(
                _launch(
                    redis_url, namespace, listen=f"{host}:0", capacity=capacity, token=token,
                    node_id=None, shm=shm, extra_args=("--spill", spill) if spill else (), log_level="WARNING",
                )
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        for node, ready_r in launched:  # they start in parallel; collect each readiness in turn
            waited += 1  # _await_ready closes the pipe whatever happens
            _await_ready(node, ready_r, deadline)
    except BaseException:
        for _node, ready_r in launched[waited:]:
            os.close(ready_r)
        LocalNodes([nd for nd, _r in launched]).stop(timeout=5)
        raise
    return LocalNodes([nd for nd, _r in launched])


if __name__ == "__main__":
    sys.exit(main())
