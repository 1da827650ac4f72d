"""Client of tq-redis's own DRAM storage nodes (the ``dram`` store).

Storage nodes (``backends/dram_server.py``) register themselves in Redis under
:func:`~tq_redis.keys.storage_nodes_key`; this client needs nothing but the Redis URL and the namespace.

Design, in short:

* **Placement** is rendezvous (highest-random-weight) hashing of each key over the live nodes
  (registered, heartbeat fresh by Redis's clock), so adding a node moves ~1/(n+1) of the keys. A
  get that misses on a key's first-ranked node also asks the second-ranked one (the node that held
  the key while the first was out of the ring), and deletes go to both.
* **Transport** is a small length-prefixed binary protocol over plain sockets: a 16-byte header,
  a msgpack header map and the raw concatenated values, written with ``sendmsg`` straight from the
  caller's buffers and read with ``recv_into`` straight into the node's memory (no per-value
  syscalls, no intermediate joins). One request per node per batch; the requests of a batch are
  all sent before any reply is read, so the nodes work in parallel.
* **Same host**: a client on the node's host connects over the node's abstract Unix socket and
  receives the node's memory slabs (``memfd`` file descriptors passed with ``SCM_RIGHTS``) once, and
  keeps them mapped. A put is then ALLOC (the node reserves space) -> one memcpy per segment into
  the mapped slab -> COMMIT; a get returns read-only views into the slabs (zero copy), *pinned* on
  the node until every view is garbage-collected, so the node never reuses memory a caller can
  still see. Slabs are anonymous (``memfd``), so nothing can be left in ``/dev/shm`` even when a
  node is SIGKILLed: the kernel frees a slab when the last process mapping it lets go.
* **Socket path** (other hosts, ``shm=False``, nodes started ``--no-shm``): blocking sockets with
  kernel timeouts, so a batch moves in about one syscall per 1024 values; received values are
  views of warm buffers from :mod:`tq_redis.buffers`, recycled once the caller drops them.
* **Threads and processes**: thread-safe (connections are pooled per node, one thread at a time
  each); a store used after ``fork()`` opens its own connections in the child.
* **Failures** are typed: an unreachable or silent node raises :class:`StorageUnavailable` naming
  it after at most ``timeout_s``; a full node :class:`StorageFull`; a missing key
  :class:`DataMissing`; a wrong token :class:`StorageAuthError`. A put spread over several nodes is
  two-phase (reserve + write everywhere, then commit), so a refusal leaves nothing half-written.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import json
import logging
import mmap
import operator
import os
import re
import socket
import struct
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import redis
from tq_redis.backends.base import Buffer, Segments, StoreContext
from tq_redis.backends.batches import RowBlock, ValueChain, ValueTable

from tq_redis import buffers, fastcopy
from tq_redis.errors import (
    ConfigError,
    ConnectionFailed,
    DataMissing,
    InvalidArgument,
    StorageAuthError,
    StorageError,
    StorageFull,
    StorageUnavailable,
)
from tq_redis.keys import storage_nodes_key

log = logging.getLogger(__name__)

__all__ = ["DramStore", "StorageAuthError", "format_size", "parse_size"]

# --------------------------------------------------------------------------------------------
# Wire protocol (shared with dram_server)
# --------------------------------------------------------------------------------------------

PROTOCOL_VERSION = 1
#: op (request) or status (reply), flags, reserved, header-map length, payload length
HEADER = struct.Struct("<BBHIQ")

OP_HELLO, OP_PUT, OP_ALLOC, OP_COMMIT, OP_ABORT, OP_GET, OP_DEL, OP_STATS, OP_FDS = range(1, 10)
ST_OK, ST_BAD, ST_AUTH, ST_FULL, ST_INTERNAL = range(5)

#: values are laid out at this alignment inside a node's slabs (keeps tensor data aligned)
ALIGN = 64
MAX_IOV = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
MAX_FDS = 200  # per message; below the kernel's SCM_MAX_FD (253)
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_DRAIN = memoryview(bytearray(1 << 20))


def layout(sizes: np.ndarray) -> tuple[np.ndarray, int]:
    """Offsets of values packed at ``ALIGN`` inside one extent, and the extent's size."""
    aligned = (sizes + (ALIGN - 1)) & ~(ALIGN - 1)
    ends = np.cumsum(aligned)
    total = int(ends[-1]) if len(ends) else 0
    return ends - aligned, total


def pack_meta(meta: dict[str, Any] | None) -> bytes:
    return msgpack.packb(meta, use_bin_type=True) if meta else b""


def send_frame(
    sock: socket.socket,
    code: int,
    meta: dict[str, Any] | None = None,
    payload: Sequence[Buffer] = (),
    payload_len: int | None = None,
    fds: Sequence[int] = (),
) -> None:
    """Send one message: header, header map, payload buffers (and ``fds`` with the first byte)."""
    mb = pack_meta(meta)
    if payload_len is None:
        payload_len = sum(len(b) for b in payload)
    bufs: list[Buffer] = [HEADER.pack(code, 0, 0, len(mb), payload_len) + mb]
    bufs.extend(payload)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else None
    send_buffers(sock, bufs, anc)


def send_buffers(sock: socket.socket, bufs: list[Buffer], anc: list | None = None) -> None:
    """``sendall`` for a list of byte buffers (``len`` must be the byte length), gathered."""
    n = len(bufs)
    i = 0
    while i < n:
        chunk = bufs[i : i + MAX_IOV]
        sent = sock.sendmsg(chunk, anc) if anc else sock.sendmsg(chunk)
        anc = None
        while i < n and sent >= len(bufs[i]):
            sent -= len(bufs[i])
            i += 1
        if sent:
            bufs[i] = memoryview(bufs[i])[sent:]


def recv_into_buffers(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every (byte) view in order from the socket, scattered, in as few syscalls as the kernel allows."""
    views = [v for v in views if len(v)]
    n = len(views)
    i = 0
    while i < n:
        got = sock.recvmsg_into(views[i : i + MAX_IOV], 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("connection closed by peer")
        while i < n and got >= len(views[i]):
            got -= len(views[i])
            i += 1
        if got:
            views[i] = views[i][got:]


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from the socket."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def set_blocking_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket whose sends/receives give up after ``seconds`` without progress.

    Kernel timeouts (SO_RCVTIMEO / SO_SNDTIMEO) instead of Python's, which make the socket
    non-blocking and so split every large send/receive into many short syscalls.
    """
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    if n:
        recv_into(sock, memoryview(buf))
    return buf


def drain(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes (keeps the stream in step after a refused payload)."""
    while n:
        k = sock.recv_into(_DRAIN[: min(n, len(_DRAIN))])
        if k == 0:
            raise ConnectionError("connection closed by peer")
        n -= k


def recv_header(sock: socket.socket, want_fds: bool = False) -> tuple[int, int, int, list[int]]:
    """Read a message header: (code, header-map length, payload length, received fds)."""
    buf = bytearray(HEADER.size)
    mv = memoryview(buf)
    got = 0
    fds: list[int] = []
    while got < HEADER.size:
        if want_fds:
            k, anc, _flags, _addr = sock.recvmsg_into([mv[got:]], _ANC_SPACE)
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(data[: len(data) - len(data) % a.itemsize])
                    fds.extend(a)
        else:
            k = sock.recv_into(mv[got:])
        if k == 0:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("connection closed by peer")
        got += k
    code, _flags, _res, mlen, plen = HEADER.unpack(buf)
    return code, mlen, plen, fds


def recv_meta(sock: socket.socket, mlen: int) -> dict[str, Any]:
    return msgpack.unpackb(recv_exact(sock, mlen), raw=False) if mlen else {}


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Parse ``"4GiB"``, ``"512MB"``, ``"1.5G"`` or a plain byte count into bytes."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"cannot read size {text!r}; write e.g. 4GiB, 512MiB, 512MB or 1000000")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return value


def format_size(n: int | float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------


_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective 64-bit mixer (wrapping arithmetic is intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _C1
    x = x ^ (x >> np.uint64(27))
    x = x * _C2
    return x ^ (x >> np.uint64(31))


def _seed(node_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=8).digest(), "little")


def key_hashes(keys: Sequence[str]) -> np.ndarray:
    """Stable 64-bit hashes of keys (identical in every process, unlike ``hash``)."""
    raw = np.fromiter(map(zlib.crc32, map(str.encode, keys)), np.uint64, len(keys))
    return _mix64(raw)


def _as_bytes_view(seg: Any) -> Buffer:
    """A buffer whose ``len`` is its byte length (bytes pass through; others become 'B' views)."""
    if isinstance(seg, (bytes, bytearray)):
        return seg
    mv = seg if isinstance(seg, memoryview) else memoryview(seg)
    if mv.format == "B" and mv.ndim == 1:
        return mv
    try:
        return mv.cast("B")
    except TypeError:
        raise InvalidArgument(
            "a value segment is not C-contiguous; pass contiguous buffers (e.g. tensor.contiguous())"
        ) from None


_NBYTES = operator.attrgetter("nbytes")
_CONTIGUOUS = operator.attrgetter("c_contiguous")


_FORMAT = operator.attrgetter("format")
_NDIM = operator.attrgetter("ndim")


def _plain_sizes(segments: list) -> np.ndarray | None:
    """Sizes of segments that are all ``bytes`` or contiguous one-dimensional byte memoryviews.

    That is what the codec produces; anything else returns None (normalise it first).
    """
    kinds = set(map(type, segments))
    if not kinds <= {bytes, memoryview}:
        return None
    if kinds == {memoryview}:
        views = segments
    elif set(map(type, segments[1::2])) == {memoryview} and set(map(type, segments[::2])) == {bytes}:
        views = segments[1::2]  # the codec's usual [header, payload] pairs
    else:
        views = [x for x in segments if type(x) is memoryview]
    if views and (
        set(map(_FORMAT, views)) != {"B"} or set(map(_NDIM, views)) != {1} or not all(map(_CONTIGUOUS, views))
    ):
        return None
    return np.fromiter(map(len, segments), np.int64, len(segments))


class _Values:
    """A put batch as a segment table, plus per-value numpy bookkeeping.

    Segment ``j`` is ``seg_len[j]`` bytes of ``bufs[seg_buf[j]]`` from byte ``seg_src[j]``; value
    ``v`` is segments ``first[v] .. first[v] + nseg[v]``. A :class:`RowBlock` (the codec's dense
    fields) becomes two buffers and arithmetic, with no per-row Python objects at all.
    """

    __slots__ = ("bufs", "seg_buf", "seg_src", "seg_len", "first", "nseg", "sizes", "seg_off", "_views")

    def __init__(self, values: Sequence[Segments]) -> None:
        parts = values.parts if isinstance(values, ValueChain) else (values,)
        self.bufs: list[Buffer] = []
        cols: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for part in parts:
            if isinstance(part, RowBlock):
                cols.append(self._block(part))
            elif len(part):
                cols.append(self._listed(part))
        if cols:
            self.seg_buf, self.seg_src, self.seg_len, self.nseg = map(np.concatenate, zip(*cols))
        else:
            self.seg_buf, self.seg_src, self.seg_len, self.nseg = (np.empty(0, np.int64) for _ in range(4))
        ends = np.cumsum(self.nseg)
        self.first = ends - self.nseg
        cum = np.concatenate(([0], np.cumsum(self.seg_len)))
        self.sizes = cum[ends] - cum[self.first]
        self.seg_off = cum[:-1] - np.repeat(cum[self.first], self.nseg)  # offset within its value
        self._views: list[memoryview] | None = None

    def _block(self, block: RowBlock) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        k, n = len(self.bufs), block.n
        self.bufs += [block.header, block.base]
        seg_src = np.zeros(2 * n, np.int64)
        seg_src[1::2] = (block.start + np.arange(n, dtype=np.int64)) * block.row
        return (
            np.tile(np.array([k, k + 1], np.int64), n),
            seg_src,
            np.tile(np.array([len(block.header), block.row], np.int64), n),
            np.full(n, 2, np.int64),
        )

    def _listed(self, values: Sequence[Segments]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        # per-segment work stays in C (map/fromiter/set): this runs for every segment of every put
        if set(map(type, values)) <= {list, tuple}:
            vals = values
        else:
            vals = [(v,) if isinstance(v, (bytes, bytearray, memoryview)) else v for v in values]
        flat = list(itertools.chain.from_iterable(vals))
        nbytes = _plain_sizes(flat)
        if nbytes is None:
            flat, nbytes = self._normalised(flat)
        k = len(self.bufs)
        self.bufs += flat
        nseg = np.fromiter(map(len, vals), np.int64, len(vals))
        return np.arange(k, k + len(flat), dtype=np.int64), np.zeros(len(flat), np.int64), nbytes, nseg

    @staticmethod
    def _normalised(segments: list) -> tuple[list[Buffer], np.ndarray]:
        """Any buffers as contiguous byte views, and their sizes (raises if one is not contiguous)."""
        flat = list(map(memoryview, segments))
        nbytes = np.fromiter(map(_NBYTES, flat), np.int64, len(flat))
        try:
            lens = np.fromiter(map(len, flat), np.int64, len(flat))
        except TypeError:  # a 0-d view
            lens = np.full(len(flat), -1, dtype=np.int64)
        for i in np.flatnonzero(lens != nbytes).tolist():  # multi-byte formats, n-d views
            flat[i] = _as_bytes_view(flat[i])
        if not all(map(_CONTIGUOUS, flat)):
            raise InvalidArgument(
                "a value segment is not C-contiguous; pass contiguous buffers (e.g. tensor.contiguous())"
            )
        return flat, nbytes

    def segments_of(self, vidx: np.ndarray) -> np.ndarray:
        """Indexes (into the segment table) of the segments of values ``vidx``, in that order."""
        ns = self.nseg[vidx]
        ends = np.cumsum(ns)
        return np.repeat(self.first[vidx] - (ends - ns), ns) + np.arange(int(ends[-1]) if len(ends) else 0)

    def payload(self, vidx: np.ndarray) -> list[Buffer]:
        """The segments of values ``vidx`` as buffers, in order (for a socket's scatter/gather send)."""
        if self._views is None:
            self._views = [memoryview(b) for b in self.bufs]
        seg = self.segments_of(vidx)
        src = self.seg_src[seg]
        cuts = map(slice, src.tolist(), (src + self.seg_len[seg]).tolist())
        return list(map(memoryview.__getitem__, map(self._views.__getitem__, self.seg_buf[seg].tolist()), cuts))

    def copy_into(self, dst: memoryview, vidx: np.ndarray, offsets: np.ndarray) -> None:
        """Write values ``vidx`` at byte ``offsets`` of ``dst``, the whole batch in one copy call."""
        seg = self.segments_of(vidx)
        dst_off = np.repeat(offsets, self.nseg[vidx]) + self.seg_off[seg]
        fastcopy.copy_table(dst, dst_off, self.bufs, self.seg_buf[seg], self.seg_src[seg], self.seg_len[seg])


class _Gathered:
    """A get's values as they arrive from the nodes: source buffers and, per key, where its value is."""

    __slots__ = ("sources", "index", "offsets", "lengths")

    def __init__(self, n: int) -> None:
        self.sources: list[memoryview] = []
        self.index = np.full(n, -1, np.int64)
        self.offsets = np.zeros(n, np.int64)
        self.lengths = np.zeros(n, np.int64)

    def add(self, source: memoryview, positions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        self.index[positions] = len(self.sources)
        self.offsets[positions] = offsets
        self.lengths[positions] = lengths
        self.sources.append(source)

    def table(self) -> ValueTable:
        return ValueTable(self.sources, self.index, self.offsets, self.lengths)


def _private_copy(table: ValueTable) -> ValueTable:
    """The values copied into one buffer of this process (releasing any pins on node memory)."""
    ends = np.cumsum(table.lengths)
    starts = ends - table.lengths
    total = int(ends[-1]) if len(ends) else 0
    own = memoryview(buffers.take(total))
    fastcopy.copy_table(own, starts, table.sources, table.index, table.offsets, table.lengths)
    return ValueTable([own], np.zeros(len(table), np.int64), starts, table.lengths)


class _Slab:
    """A node's memory slab mapped into this process (read-write for puts, read-only for gets)."""

    __slots__ = ("id", "size", "fd", "rw", "rw_view", "ro", "__weakref__")

    def __init__(self, slab_id: int, size: int, fd: int) -> None:
        self.id, self.size, self.fd = slab_id, size, fd
        self.rw = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self.rw_view = memoryview(self.rw)
        self.ro: mmap.mmap | None = None

    def readonly(self) -> mmap.mmap:
        if self.ro is None:
            self.ro = mmap.mmap(
                self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
            )
        return self.ro

    def drop(self) -> None:
        """Forget the slab; mappings go away once no returned view uses them."""
        self.rw_view.release()
        try:
            self.rw.close()
        except BufferError:  # still referenced; unmapped when the last reference dies
            pass
        self.ro = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Unpin:
    """Finaliser shared by the per-slab arrays behind one get's views: queues the node-side unpin."""

    __slots__ = ("link", "pin", "total", "count")

    def __init__(self, link: _Link, pin: int, total: int) -> None:
        self.link, self.pin, self.total = link, pin, total
        self.count = itertools.count(1)

    def __call__(self) -> None:
        if next(self.count) == self.total:  # next() is atomic: safe from any thread's GC
            self.link.unpins.append(self.pin)


class _Conn:
    """One socket to a node; used by one thread at a time (taken from and returned to a pool)."""

    __slots__ = ("sock", "local", "shm", "gen", "broken")

    def __init__(self, sock: socket.socket, local: bool, shm: bool, gen: int) -> None:
        self.sock, self.local, self.shm, self.gen = sock, local, shm, gen
        self.broken = False

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass


class _Link:
    """One storage-node *instance* as this client sees it: connection pool, mapped slabs, unpins."""

    def __init__(self, info: dict[str, Any], store: DramStore) -> None:
        self.info = info
        self.node_id: str = info["node_id"]
        self.instance: str = info["instance"]
        self.address: str = info["address"]
        self.store = store
        self.lock = threading.Lock()
        self.idle: list[_Conn] = []
        self.slabs: dict[int, _Slab] = {}
        self.unpins: list[int] = []
        self.gen = 0
        self.local_ok: bool | None = None  # None: not tried yet
        self.closed = False

    @property
    def label(self) -> str:
        return f"{self.node_id!r} at {self.address}"

    # -- connections --------------------------------------------------------------------------
    def acquire(self) -> _Conn:
        with self.lock:
            if self.closed:
                raise StorageUnavailable(f"DRAM storage node {self.label} left the cluster")
            if self.idle:
                return self.idle.pop()
            gen = self.gen
        return self._connect(gen)

    def release(self, conn: _Conn) -> None:
        with self.lock:
            if not (self.closed or conn.broken) and conn.gen == self.gen and len(self.idle) < 64:
                self.idle.append(conn)
                return
        conn.close()

    def fail(self, conn: _Conn | None) -> None:
        """A connection broke: drop it, the idle ones and the slab mappings of this instance."""
        if conn is not None:
            conn.close()
        with self.lock:
            self.gen += 1
            idle, self.idle = self.idle, []
            slabs, self.slabs = self.slabs, {}
            # queued unpins stay: pin ids belong to this client, not to the broken connection
        for c in idle:
            c.close()
        for s in slabs.values():
            s.drop()

    def close(self) -> None:
        self.fail(None)
        with self.lock:
            self.closed = True

    def _connect(self, gen: int) -> _Conn:
        st = self.store
        uds = self.info.get("uds")
        try_local = (
            st.shm and uds and self.info.get("shm") and self.local_ok is not False
            and self.info.get("host") == _HOSTNAME
        )  # fmt: skip
        errors: list[str] = []
        if try_local:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(st.timeout_s)
            try:
                s.connect("\0" + uds)
                set_blocking_timeout(s, st.timeout_s)
                conn = self._hello(s, True, gen)
                self.local_ok = True
                return conn
            except (StorageAuthError, StorageUnavailable):
                raise
            except OSError as exc:
                s.close()
                errors.append(f"unix socket: {exc}")
        host, _, port = self.address.rpartition(":")
        try:
            s = socket.create_connection((host, int(port)), timeout=st.timeout_s)
        except OSError as exc:
            errors.append(f"tcp: {exc}")
            self.fail(None)  # a node that is gone must not keep its memory alive through our mappings
            raise StorageUnavailable(
                f"DRAM storage node {self.label} is unreachable ({'; '.join(errors)}); "
                f"is it running? (tq-redis storage-unit ...)"
            ) from exc
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_blocking_timeout(s, st.timeout_s)
        conn = self._hello(s, False, gen)
        if try_local:
            self.local_ok = False  # alive over TCP but not over the unix socket: another netns
        return conn

    def _hello(self, s: socket.socket, local: bool, gen: int) -> _Conn:
        meta = {
            "v": PROTOCOL_VERSION,
            "token": self.store.token,
            "client": self.store.client_id,
            "shm": local,
        }
        try:
            send_frame(s, OP_HELLO, meta)
            code, mlen, plen, fds = recv_header(s, local)
            reply = recv_meta(s, mlen)
        except OSError as exc:
            s.close()
            raise self.unavailable(exc) from exc
        for fd in fds:
            os.close(fd)
        if code != ST_OK:
            s.close()
            raise _error_from(code, reply, self)
        if reply.get("instance") != self.instance:
            s.close()
            self.store._mark_stale()
            raise StorageUnavailable(
                f"DRAM storage node {self.label} restarted (instance changed); retry the operation"
            )
        return _Conn(s, local, bool(reply.get("shm")), gen)

    def unavailable(self, exc: BaseException) -> StorageUnavailable:
        if isinstance(exc, (TimeoutError, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO expired
            what = f"did not answer within {self.store.timeout_s:g} s"
        else:
            what = f"is unreachable ({exc})"
        return StorageUnavailable(
            f"DRAM storage node {self.label} {what}; check that it is running, or raise the "
            f"store option timeout_s"
        )

    # -- slabs --------------------------------------------------------------------------------
    def map_slabs(self, fds: list[int], meta: dict[str, Any]) -> None:
        """Take ownership of slab fds sent with a reply; forget slabs the node has released."""
        fd_slabs = meta.get("fd_slabs") or []
        new = []
        try:
            for (sid, size), fd in zip(fd_slabs, fds):
                if sid in self.slabs:
                    os.close(fd)
                else:
                    new.append(_Slab(sid, size, fd))
        except BaseException:
            for fd in fds[len(new) :]:
                os.close(fd)
            raise
        live = meta.get("live")
        with self.lock:
            for s in new:
                self.slabs.setdefault(s.id, s)
            keep = None if live is None else set(live)
            gone = [] if keep is None else [sid for sid in self.slabs if sid not in keep]
            dropped = [self.slabs.pop(sid) for sid in gone]
        for s in dropped:
            s.drop()

    def slab(self, conn: _Conn, sid: int) -> _Slab:
        s = self.slabs.get(sid)
        if s is None:  # fds were sent on another connection whose mappings we dropped: ask again
            send_frame(conn.sock, OP_FDS, {"slabs": [sid]})
            code, mlen, _plen, fds = recv_header(conn.sock, True)
            meta = recv_meta(conn.sock, mlen)
            if code != ST_OK:
                raise _error_from(code, meta, self)
            self.map_slabs(fds, meta)
            s = self.slabs.get(sid)
            if s is None:
                raise StorageError(f"DRAM storage node {self.label} no longer has memory slab {sid}")
        return s

    def take_unpins(self) -> list[int]:
        if not self.unpins:
            return []
        pending, self.unpins = self.unpins, []
        return pending


def _error_from(code: int, meta: dict[str, Any], link: _Link) -> StorageError:
    msg = meta.get("msg") or f"error {code}"
    if code == ST_FULL:
        return StorageFull(msg)
    if code == ST_AUTH:
        return StorageAuthError(msg)
    if code == ST_BAD:
        return InvalidArgument(msg)
    return StorageError(f"DRAM storage node {link.label} failed: {msg}")


_HOSTNAME = socket.gethostname()


class _Ring:
    """An immutable snapshot of the live nodes, for placement."""

    __slots__ = ("links", "seeds")

    def __init__(self, links: list[_Link]) -> None:
        self.links = links
        self.seeds = np.array([_seed(lk.node_id) for lk in links], dtype=np.uint64)

    def scores(self, keys: Sequence[str]) -> np.ndarray:
        h = key_hashes(keys)
        return _mix64(h[:, None] ^ self.seeds[None, :])

    def owners(self, keys: Sequence[str]) -> np.ndarray:
        """Index (into ``links``) of each key's node: the highest-scoring one."""
        if len(self.links) == 1:
            return np.zeros(len(keys), dtype=np.intp)
        return np.argmax(self.scores(keys), axis=1)

    def ranked(self, keys: Sequence[str], depth: int = 2) -> np.ndarray:
        """The ``depth`` best nodes of each key, best first (shape ``(len(keys), depth)``)."""
        order = np.argsort(self.scores(keys), axis=1)[:, ::-1]
        return order[:, : min(depth, len(self.links))]


def _groups(owner: np.ndarray, n_nodes: int) -> list[tuple[int, np.ndarray]]:
    """(node index, positions of its keys) for every node that owns at least one key."""
    if n_nodes == 1:
        return [(0, np.arange(len(owner)))]
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=n_nodes)
    out, start = [], 0
    for node, c in enumerate(counts):
        if c:
            out.append((node, order[start : start + c]))
            start += c
    return out


class DramStore:
    """Store client for tq-redis DRAM storage nodes discovered through Redis.

    Thread-safe: connections are pooled per node and used by one thread at a time.

    Args:
        redis_url: the metadata plane's URL (nodes register there).
        namespace: the tq namespace the nodes registered under.
        token: shared secret the nodes were started with (default: env ``TQ_STORAGE_TOKEN``).
        timeout_s: bound on connecting to / waiting for one node before ``StorageUnavailable``.
        shm: use the same-host shared-memory path when a node runs on this host.
        zero_copy_get: on the shared-memory path, ``get`` returns read-only views of the node's
            memory (pinned until released) instead of private copies.
        inline_threshold: a node's share of a put smaller than this many bytes travels inline on
            the socket (one round trip) rather than through shared memory (two).
        refresh_s: how long the node list read from Redis is trusted.
        dead_after_s: a node whose heartbeat is older than this leaves the placement ring.
    """

    name = "dram"

    def __init__(
        self,
        redis_url: str,
        namespace: str = "tq",
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        shm: bool = True,
        zero_copy_get: bool = True,
        inline_threshold: int | str = 256 * 1024,
        refresh_s: float = 2.0,
        dead_after_s: float = 10.0,
    ) -> None:
        if timeout_s <= 0 or refresh_s < 0 or dead_after_s <= 0:
            raise ConfigError("timeout_s and dead_after_s must be positive and refresh_s non-negative")
        self.redis_url = redis_url
        self.namespace = namespace
        self.token = token if token is not None else os.environ.get("TQ_STORAGE_TOKEN") or None
        self.timeout_s = float(timeout_s)
        self.shm = bool(shm)
        self.zero_copy_get = bool(zero_copy_get)
        self.inline_threshold = parse_size(inline_threshold) if inline_threshold else 0
        self.refresh_s = float(refresh_s)
        self.dead_after_s = float(dead_after_s)
        self.client_id = uuid.uuid4().hex
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
        )
        self._key = storage_nodes_key(namespace)
        self._lock = threading.Lock()
        self._links: dict[tuple[str, str], _Link] = {}
        self._ring: _Ring | None = None
        self._fetched = 0.0
        self._stale = True
        self._closed = False
        self._pid = os.getpid()

    @classmethod
    def from_config(cls, options: dict[str, Any], ctx: StoreContext) -> DramStore:
        """Build from the store options of the tq config (keys: the keyword arguments of ``__init__``)."""
        allowed = {
            "token", "timeout_s", "shm", "zero_copy_get", "inline_threshold", "refresh_s",
            "dead_after_s",
        }  # fmt: skip
        unknown = set(options) - allowed
        if unknown:
            raise ConfigError(
                f"unknown option(s) {sorted(unknown)} for the dram store; known: {sorted(allowed)}"
            )
        return cls(ctx.redis_url, ctx.namespace, **options)

    # -- discovery ----------------------------------------------------------------------------
    def _mark_stale(self) -> None:
        self._stale = True

    def _read_registry(self) -> tuple[float, dict[str, dict[str, Any]]]:
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.time()
            pipe.hgetall(self._key)
            (sec, usec), raw = pipe.execute()
        except redis.RedisError as exc:
            raise ConnectionFailed(
                f"cannot read the DRAM storage nodes from Redis at {self.redis_url} ({exc}); "
                f"check that Redis is running"
            ) from exc
        nodes = {}
        for k, v in raw.items():
            try:
                info = json.loads(v)
                nodes[k.decode()] = info
            except ValueError:
                log.warning("ignoring unreadable storage-node registration %r", k)
        return sec + usec / 1e6, nodes

    def _after_fork(self) -> None:
        """In a forked child: never talk over the parent's sockets; start with fresh state."""
        for link in self._links.values():
            for conn in link.idle:
                conn.sock.close()  # close (no shutdown): the parent's connection stays intact
            link.idle = []
            link.closed = True
        self._links = {}
        self._ring = None
        self._lock = threading.Lock()
        self.client_id = uuid.uuid4().hex
        self._pid = os.getpid()

    def _current_ring(self, force: bool = False) -> _Ring:
        if self._closed:
            raise StorageError("the dram store is closed")
        if self._pid != os.getpid():
            self._after_fork()
        now = time.monotonic()
        ring = self._ring
        if ring is not None and not force and not self._stale and now - self._fetched < self.refresh_s:
            return ring
        with self._lock:
            if self._ring is not None and not force and not self._stale and (
                time.monotonic() - self._fetched < self.refresh_s
            ):
                return self._ring
            try:
                rnow, nodes = self._read_registry()
            except ConnectionFailed:
                if self._ring is not None:  # keep serving with the last known ring
                    log.warning("Redis unreachable; using the last known storage-node list")
                    return self._ring
                raise
            live: list[_Link] = []
            seen = set()
            for node_id, info in sorted(nodes.items()):
                info.setdefault("node_id", node_id)
                key = (node_id, str(info.get("instance")))
                seen.add(key)
                link = self._links.get(key)
                if link is None:
                    link = self._links[key] = _Link(info, self)
                else:
                    link.info = info
                if rnow - float(info.get("heartbeat", 0)) <= self.dead_after_s:
                    live.append(link)
            for key in [k for k in self._links if k not in seen]:
                self._links.pop(key).close()  # deregistered or restarted as a new instance
            if not live:
                raise StorageUnavailable(
                    f"no live DRAM storage node is registered in namespace {self.namespace!r} at "
                    f"{self.redis_url} (key {self._key}); start some with `tq-redis storage-unit "
                    f"--redis {self.redis_url} --namespace {self.namespace} ...` or `tq-redis up`"
                )
            self._ring = _Ring(live)
            self._fetched = time.monotonic()
            self._stale = False
            return self._ring

    def nodes(self) -> list[dict[str, Any]]:
        """Registration of every live node (address, capacity, used bytes, heartbeat ...)."""
        return [dict(lk.info) for lk in self._current_ring(force=True).links]

    def _with_retry(self, fn):
        """Run ``fn(ring)``; if a node failed because it restarted or left, retry once on a fresh ring."""
        ring = self._current_ring()
        try:
            return fn(ring)
        except StorageUnavailable as exc:
            self._mark_stale()
            before = {lk.node_id: lk.instance for lk in ring.links}
            try:
                fresh = self._current_ring(force=True)
            except (StorageUnavailable, ConnectionFailed):
                raise exc from None  # the error naming the node says more than "no nodes left"
            if {lk.node_id: lk.instance for lk in fresh.links} == before:
                raise
            return fn(fresh)

    # -- request plumbing ---------------------------------------------------------------------
    def _exchange(self, reqs: list[tuple[_Link, _Conn, int, dict[str, Any], Sequence[Buffer]]], handle):
        """Send every request, then read every reply with ``handle(i, link, conn, code, meta, plen, fds)``.

        Returns ``(results, first_error)``. A connection that breaks is closed and marked broken
        (its node's error is a ``StorageUnavailable`` naming it); after a protocol-level error the
        stream is still in step and the connection stays usable.
        """
        sent = [False] * len(reqs)
        results: list[Any] = [None] * len(reqs)
        first_err: BaseException | None = None
        for i, (link, conn, op, meta, payload) in enumerate(reqs):
            unpins = link.take_unpins()
            if unpins:
                meta = {**meta, "unpin": unpins}
            try:
                send_frame(conn.sock, op, meta, payload)
                sent[i] = True
            except OSError as exc:
                link.unpins.extend(unpins)
                link.fail(conn)
                first_err = first_err or link.unavailable(exc)
        for i, (link, conn, _op, _meta, _payload) in enumerate(reqs):
            if not sent[i]:
                continue
            try:
                code, mlen, plen, fds = recv_header(conn.sock, conn.local)
                meta = recv_meta(conn.sock, mlen)
                results[i] = handle(i, link, conn, code, meta, plen, fds)
            except OSError as exc:
                link.fail(conn)
                first_err = first_err or link.unavailable(exc)
            except Exception as exc:
                first_err = first_err or exc
        return results, first_err

    def _run(self, reqs, handle) -> list[Any]:
        results, err = self._exchange(reqs, handle)
        if err is not None:
            raise err
        return results

    def _hold(self, links: list[_Link]) -> list[_Conn]:
        """One connection per link, for the duration of an operation (see ``_free``)."""
        conns: list[_Conn] = []
        try:
            for link in links:
                conns.append(link.acquire())
        except BaseException:
            self._free(links, conns)
            raise
        return conns

    @staticmethod
    def _free(links: list[_Link], conns: list[_Conn]) -> None:
        for link, conn in zip(links, conns):
            link.release(conn)

    @staticmethod
    def _check(i, link, conn, code, meta, plen, fds):
        """Reply handler for requests that only return a status (and maybe slab fds)."""
        if fds or "live" in meta:
            link.map_slabs(fds, meta)
        if code != ST_OK:
            drain(conn.sock, plen)
            raise _error_from(code, meta, link)
        return meta

    # -- StorageClient ------------------------------------------------------------------------
    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        """Store ``values[i]`` (the concatenation of its segments) under ``keys[i]``, overwriting.

        All-or-nothing when a node refuses (``StorageFull``): nothing of the batch is stored.
        """
        if len(keys) != len(values):
            raise InvalidArgument(f"put got {len(keys)} keys but {len(values)} values")
        if not len(keys):
            return
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("put got the same key twice in one batch")
        vals = _Values(values)
        self._with_retry(lambda ring: self._put(ring, keys, vals))

    def _put(self, ring: _Ring, keys: list[str], vals: _Values) -> None:
        groups = _groups(ring.owners(keys), len(ring.links))
        links = [ring.links[n] for n, _ in groups]
        conns = self._hold(links)
        try:
            self._put_on(links, conns, groups, keys, vals)
        finally:
            self._free(links, conns)

    def _put_on(self, links, conns, groups, keys: list[str], vals: _Values) -> None:
        two_phase = len(groups) > 1
        reqs, plans = [], []
        for (_n, idx), link, conn in zip(groups, links, conns):
            gsizes = vals.sizes[idx]
            gkeys = list(map(keys.__getitem__, idx.tolist()))
            meta = {"keys": gkeys, "sizes": gsizes.astype("<i8").tobytes()}
            shm = conn.shm and int(gsizes.sum()) >= self.inline_threshold
            if shm:
                reqs.append((link, conn, OP_ALLOC, meta, ()))
            else:
                meta["commit"] = not two_phase
                reqs.append((link, conn, OP_PUT, meta, vals.payload(idx)))
            plans.append((idx, gsizes, shm))
        replies, err = self._exchange(reqs, self._check)
        txns = [
            (link, conn, r["txn"]) for (link, conn, *_), r in zip(reqs, replies) if r and r.get("txn")
        ]
        spilling = [k for k, r in enumerate(replies) if err is None and r and r.get("inline")]
        if spilling:
            # a full node that spills to its tier takes these values inline on the socket instead
            again = [(reqs[k][0], reqs[k][1], OP_PUT, {**reqs[k][3], "commit": not two_phase},
                      vals.payload(plans[k][0])) for k in spilling]  # fmt: skip
            more, err = self._exchange(again, self._check)
            txns += [(lk, c, r["txn"]) for (lk, c, *_), r in zip(again, more) if r and r.get("txn")]
            for k in spilling:
                plans[k] = (plans[k][0], plans[k][1], False)
        if err is not None:
            self._end(txns, OP_ABORT)  # the reservations that were granted hold nothing visible
            raise err
        try:
            for (idx, gsizes, shm), (link, conn, *_), reply in zip(plans, reqs, replies):
                if shm:
                    self._copy_into(link, conn, reply["chunks"], idx, gsizes, vals)
        except BaseException:
            self._end(txns, OP_ABORT)
            raise
        if txns:
            self._end(txns, OP_COMMIT, check=True)

    def _end(self, txns: list[tuple[_Link, _Conn, int]], op: int, check: bool = False) -> None:
        """Commit or abort transactions on the connections that opened them."""
        reqs = [(lk, c, op, {"txns": [t]}, ()) for lk, c, t in txns if not c.broken]
        _res, err = self._exchange(reqs, self._check)
        if check and err is not None:
            raise err

    def _copy_into(self, link: _Link, conn: _Conn, chunks, idx: np.ndarray, gsizes, vals: _Values) -> None:
        """Write each value into the node's slab at the offsets it reserved."""
        for sid, base, start, count in chunks:
            offs, _ = layout(gsizes[start : start + count])
            vals.copy_into(link.slab(conn, sid).rw_view, idx[start : start + count], offs + base)

    def get(self, keys: Sequence[str]) -> Sequence[Buffer]:
        """Return every key's value, in order; ``DataMissing`` names the keys no node holds.

        The values come back as a :class:`ValueTable`: a sequence of memoryviews that are slices
        of a few large buffers. On the same-host path those are read-only views of the node's
        memory, pinned there until every view (and the table) is released or this store is
        closed; with ``zero_copy_get=False`` they are slices of one private, writable copy.
        """
        keys = list(keys)
        if not keys:
            return []
        table = self._with_retry(lambda ring: self._get(ring, keys))
        return table if self.zero_copy_get else _private_copy(table)

    def _get(self, ring: _Ring, keys: list[str]) -> ValueTable:
        out = _Gathered(len(keys))
        owner = ring.owners(keys)
        missing = self._get_from(ring, keys, np.arange(len(keys)), owner, out)
        if len(missing) and len(ring.links) > 1:
            # placed while its first-ranked node was out of the ring? ask the runner-up too
            asked = [ring.links[owner[p]].node_id for p in missing.tolist()]
            ring = self._current_ring(force=True)
            rank = ring.ranked([keys[p] for p in missing.tolist()], 2)
            pos, alt = [], []
            for j, p in enumerate(missing.tolist()):
                for n in rank[j].tolist():
                    if ring.links[n].node_id != asked[j]:
                        pos.append(p)
                        alt.append(n)
                        break
            if pos:
                still = self._get_from(ring, keys, np.array(pos), np.array(alt, dtype=np.intp), out)
                missing = np.union1d(np.setdiff1d(missing, pos), still)
        if len(missing):
            names = [keys[i] for i in missing[:5].tolist()]
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise DataMissing(
                f"{len(missing)} of {len(keys)} key(s) are missing from the DRAM store: "
                f"{', '.join(map(repr, names))}{more}. They were deleted, or the storage node that "
                f"held them restarted and lost its memory."
            )
        return out.table()

    def _get_from(self, ring: _Ring, keys, positions: np.ndarray, owner: np.ndarray, out: _Gathered) -> np.ndarray:
        """Fetch ``keys[positions]`` from their ``owner`` nodes into ``out``; return the still missing."""
        groups = _groups(owner, len(ring.links))
        links = [ring.links[n] for n, _ in groups]
        missing: list[np.ndarray] = []
        pos_of = [positions[idx] for _n, idx in groups]

        def on_reply(i, link, conn, code, meta, plen, fds):
            self._check(i, link, conn, code, meta, plen, fds)
            pos = pos_of[i]
            miss = meta.get("missing")
            if miss:
                missing.append(pos[miss])
                pos = np.delete(pos, miss)
            if "offs" in meta:
                self._views(link, conn, meta, plen, pos, out)
                return
            mv = memoryview(buffers.take(plen))
            recv_into(conn.sock, mv)
            lens = np.frombuffer(meta["sizes"], dtype="<i8")
            out.add(mv, pos, np.cumsum(lens) - lens, lens)

        conns = self._hold(links)
        try:
            reqs = [
                (lk, c, OP_GET, {"keys": [keys[p] for p in pos.tolist()], "shm": c.shm}, ())
                for lk, c, pos in zip(links, conns, pos_of)
            ]
            self._run(reqs, on_reply)
        finally:
            self._free(links, conns)
        return np.concatenate(missing) if missing else np.empty(0, dtype=np.intp)

    def _views(
        self, link: _Link, conn: _Conn, meta: dict[str, Any], plen: int, pos: np.ndarray, out: _Gathered
    ) -> None:
        """Values of a shared-memory GET reply: read-only views into the mapped slabs.

        Values the node spilled to its tier (slab -1) come in the reply's payload instead.
        """
        sids = np.frombuffer(meta["slabs"], dtype="<i4")
        offs = np.frombuffer(meta["offs"], dtype="<i8")
        lens = np.frombuffer(meta["lens"], dtype="<i8")
        if plen:
            inline = memoryview(buffers.take(plen))
            recv_into(conn.sock, inline)
            spilled = sids < 0
            out.add(inline, pos[spilled], offs[spilled], lens[spilled])
            kept = ~spilled
            sids, offs, lens, pos = sids[kept], offs[kept], lens[kept], pos[kept]
        used = np.unique(sids).tolist()
        pin = meta.get("pin") or 0
        unpin = _Unpin(link, pin, len(used)) if pin else None
        for sid in used:
            # a fresh array per get: its finaliser fires once the last view of this get is gone
            arr = np.frombuffer(link.slab(conn, sid).readonly(), dtype=np.uint8)
            if unpin is not None:
                weakref.finalize(arr, unpin)
            mine = slice(None) if len(used) == 1 else sids == sid
            out.add(memoryview(arr), pos[mine], offs[mine], lens[mine])

    def delete(self, keys: Sequence[str]) -> None:
        """Remove keys from their nodes; absent keys are ignored (idempotent)."""
        keys = list(keys)
        if keys:
            # a fresh ring: a key put by a client that already saw a new node must be found there
            self._mark_stale()
            self._with_retry(lambda ring: self._delete(ring, keys))

    def _delete(self, ring: _Ring, keys: list[str]) -> None:
        n_nodes = len(ring.links)
        rank = ring.ranked(keys, 2) if n_nodes > 1 else np.zeros((len(keys), 1), np.intp)
        per_node: dict[int, list[str]] = {}
        for col in range(rank.shape[1]):
            for node, idx in _groups(rank[:, col], n_nodes):
                per_node.setdefault(node, []).extend(keys[i] for i in idx.tolist())
        primary = set(np.unique(rank[:, 0]).tolist())
        links, conns = [], []
        down: StorageUnavailable | None = None  # an unreachable node that is some key's home
        try:
            for node in per_node:
                try:
                    conns.append(ring.links[node].acquire())
                    links.append(ring.links[node])
                except StorageUnavailable as exc:
                    # The reachable nodes still get their deletes; a runner-up only holds keys
                    # placed during a ring change, so missing one is not an error.
                    if node in primary:
                        down = down or exc
            reqs = [
                (lk, c, OP_DEL, {"keys": per_node[ring.links.index(lk)]}, ()) for lk, c in zip(links, conns)
            ]
            _res, err = self._exchange(reqs, self._check)
            if err is not None:
                failed_primary = any(
                    c.broken and ring.links.index(lk) in primary for lk, c in zip(links, conns)
                )
                if failed_primary or not isinstance(err, StorageUnavailable):
                    raise err
            if down is not None:
                raise down
        finally:
            self._free(links, conns)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per live node: used / capacity bytes, key and slab counts, pins and open transactions."""
        ring = self._current_ring(force=True)
        conns = self._hold(ring.links)
        try:
            replies = self._run([(lk, c, OP_STATS, {}, ()) for lk, c in zip(ring.links, conns)], self._check)
        finally:
            self._free(ring.links, conns)
        return {lk.node_id: m for lk, m in zip(ring.links, replies)}

    def flush(self) -> None:
        """Send queued unpins (of released ``get`` views) now rather than with the next request."""
        with self._lock:
            links = [lk for lk in self._links.values() if lk.unpins and not lk.closed]
        for link in links:
            try:
                conn = link.acquire()
            except StorageError:
                continue
            try:
                self._exchange([(link, conn, OP_STATS, {}, ())], self._check)
            finally:
                link.release(conn)

    def close(self) -> None:
        """Release connections and mappings (views from ``get`` are unpinned); the nodes keep the data."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            with self._lock:
                links, self._links = list(self._links.values()), {}
                self._ring = None
            for link in links:
                link.close()
            self._redis.close()

    def __enter__(self) -> DramStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
