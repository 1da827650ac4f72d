"""What a DRAM storage node does with each request on an authenticated connection.

:class:`RequestHandlers` holds a connection's request state (its open transactions, the slab fds
it was sent, whether it uses shared memory) and serves PUT (values inline on the socket), ALLOC /
COMMIT / ABORT (the shared-memory put), GET, DEL, FDS, STATS and KEYS (the keys put under a
replicated ring, for a repair) on the
:class:`~tq_redis.backends.dram.node.StorageNode`: it checks each request's fields (a bad one is
refused with ``ST_BAD``; one whose fields break the handler raises one of :data:`MALFORMED`, and
the session closes the connection), runs it and writes the reply. The connection itself (TLS,
the HELLO, frame bounds, timeouts) is :class:`~tq_redis.backends.dram.session.Session`'s, which
extends this class.
"""

from __future__ import annotations

import mmap
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_redis.backends.dram.node import Refused, StorageNode, Txn
from tq_redis.backends.dram.protocol import (
    OP_ABORT,
    OP_ALLOC,
    OP_COMMIT,
    OP_DEL,
    OP_FDS,
    OP_GET,
    OP_KEYS,
    OP_PUT,
    OP_STATS,
    ST_BAD,
    ST_OK,
    drain,
    recv_into_buffers,
    send_frame,
)

__all__ = ["MALFORMED", "RequestHandlers"]

#: what a malformed request's fields raise when handlers use them
MALFORMED = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError)


def _keys(keys: Any, what: str = "request") -> list[str]:
    """A request's key list, checked: a list of strings."""
    if not isinstance(keys, list) or not all(type(k) is str for k in keys):
        raise Refused(ST_BAD, f"malformed {what}: keys must be a list of strings")
    return keys


def _ints(values: Any, what: str) -> list[int]:
    """A request's list of ids, checked: a list of integers."""
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise Refused(ST_BAD, f"malformed request: {what} must be a list of integers")
    return values


class RequestHandlers:
    """The request handlers of one connection (its session sets ``shm`` and ``client`` at HELLO)."""

    def __init__(self, node: StorageNode, sock: socket.socket) -> None:
        self.node, self.sock = node, sock
        self.shm = False
        self.client: str | None = None
        self.txns: dict[int, Txn] = {}
        self.sent_slabs: set[int] = set()

    def _dispatch(self, op: int, meta: dict[str, Any], plen: int) -> None:
        """Serve one request other than a HELLO (the session answers those)."""
        node = self.node
        if meta.get("unpin"):
            try:
                pins = _ints(meta["unpin"], "unpin")
            except Refused:
                drain(self.sock, plen)
                raise
            node.unpin(pins)
        if op == OP_PUT:
            return self._put(meta, plen)
        if plen:
            drain(self.sock, plen)
            raise Refused(ST_BAD, f"request {op} carries no payload")
        if op == OP_GET:
            return self._get(meta)
        if op == OP_ALLOC:
            return self._alloc(meta)
        if op in (OP_COMMIT, OP_ABORT):
            for t in _ints(meta.get("txns") or [], "txns"):
                txn = self.txns.pop(t, None)
                if txn is not None:
                    (node.commit if op == OP_COMMIT else node.abort)(txn)
                elif op == OP_COMMIT:
                    raise Refused(ST_BAD, f"unknown transaction {t} (reservation lost?)")
            return send_frame(self.sock, ST_OK)
        if op == OP_DEL:
            reply: dict[str, Any] = {"deleted": node.delete(_keys(meta.get("keys") or []))}
            if self.shm:  # lets the client unmap slabs the delete released
                reply["live"] = node.live_slabs()
            return send_frame(self.sock, ST_OK, reply)
        if op == OP_FDS:
            return self._reply_with_slabs({}, _ints(meta.get("slabs") or [], "slabs"), force=True)
        if op == OP_STATS:
            return send_frame(self.sock, ST_OK, node.stats())
        if op == OP_KEYS:
            ring = meta.get("ring")
            if not isinstance(ring, str):
                raise Refused(ST_BAD, "malformed request: KEYS takes a ring id (a string)")
            return send_frame(self.sock, ST_OK, {"keys": node.placed(ring)})
        raise Refused(ST_BAD, f"unknown request {op}")

    def _batch(self, meta: dict[str, Any]) -> tuple[list[str], np.ndarray]:
        keys = _keys(meta.get("keys"))
        raw = meta.get("sizes") or b""
        if not isinstance(raw, bytes) or len(raw) % 8:
            raise Refused(ST_BAD, "malformed put: sizes are not 8-byte integers")
        sizes = np.frombuffer(raw, dtype="<i8")
        if len(keys) != len(sizes) or (sizes < 0).any():
            raise Refused(ST_BAD, "malformed put: keys and sizes disagree")
        if len(set(keys)) != len(keys):
            raise Refused(ST_BAD, "put got the same key twice in one batch")
        place = meta.get("place")
        if place is not None:
            if not isinstance(place, str):
                raise Refused(ST_BAD, "malformed put: place must be a ring id (a string)")
            self.node.place(keys, place)
        return keys, sizes

    def _put(self, meta: dict[str, Any], plen: int) -> None:
        try:
            keys, sizes = self._batch(meta)
            if int(sizes.sum(dtype=np.uint64)) != plen or (len(sizes) and int(sizes.max()) > plen):
                raise Refused(ST_BAD, "malformed put: payload length is not the sum of the sizes")
            txn = self.node.reserve(keys, sizes)
        except Refused:
            drain(self.sock, plen)
            raise
        if txn.spilled:
            # pages are committed as bytes arrive (and returned when it is dropped)
            buf = memoryview(mmap.mmap(-1, max(plen, 1)))[:plen]
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
        t = self.node.next_txn_id()
        self.txns[t] = txn
        send_frame(self.sock, ST_OK, {"txn": t})

    def _alloc(self, meta: dict[str, Any]) -> None:
        if not self.shm:
            raise Refused(ST_BAD, "ALLOC needs a shared-memory connection")
        keys, sizes = self._batch(meta)
        txn = self.node.reserve(keys, sizes)
        if txn.spilled:  # no room in memory: the client sends these values inline (OP_PUT)
            return send_frame(self.sock, ST_OK, {"inline": True})
        t = self.node.next_txn_id()
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
        keys = _keys(meta.get("keys"), "get")
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
        except Refused:
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
