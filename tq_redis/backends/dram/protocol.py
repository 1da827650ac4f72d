"""The wire protocol between the ``dram`` store client and its storage nodes.

Both sides import this module and nothing else of each other: the client
(:mod:`tq_redis.backends.dram.store` and its modules) and the node (:mod:`tq_redis.backends.dram.server`,
:mod:`~tq_redis.backends.dram.session`, :mod:`~tq_redis.backends.dram.handlers`, ...).

A message is a 16-byte :data:`HEADER` (op or status code, flags, reserved, header-map length,
payload length), then a msgpack *header map*, then the payload: raw values, concatenated. Senders
gather the buffers into ``sendmsg`` calls straight from the caller's memory; receivers scatter
into their destination with ``recvmsg_into``. Memory-slab file descriptors travel with the first
byte of a reply as ``SCM_RIGHTS`` ancillary data (Unix sockets only).

Requests (``OP_*``) and replies (``ST_*``) are listed below; :func:`layout` is where a batch's
values sit inside a reserved extent, which the client and the node must agree on.
"""

from __future__ import annotations

import array
import os
import socket
import ssl
import struct
from collections.abc import Sequence
from itertools import islice
from typing import Any

import msgpack
import numpy as np

from tq_redis.errors import StorageUnavailable
from tq_redis.storage.base import Buffer
from tq_redis.units import format_size

__all__ = [
    "ALIGN", "HEADER", "PROTOCOL_VERSION", "OP_ABORT", "OP_ALLOC", "OP_COMMIT", "OP_DEL", "OP_FDS",
    "OP_GET", "OP_HELLO", "OP_KEYS", "OP_PUT", "OP_STATS", "ST_AUTH", "ST_BAD", "ST_FULL", "ST_INTERNAL", "ST_OK",
    "aligned", "drain", "layout", "recv_header", "recv_into", "recv_into_buffers", "recv_meta",
    "send_frame", "set_blocking_timeout", "HELLO_MAX", "MAX_HEADER", "ProtocolError", "check_lengths",
    "is_tls", "IdleTimeout", "decode_meta",
]  # fmt: skip

#: 2: a HELLO names the client's namespace and carries the node's access key (see dram_session.Admission)
PROTOCOL_VERSION = 2
#: op (request) or status (reply), flags, reserved, header-map length, payload length
HEADER = struct.Struct("<BBHIQ")

OP_HELLO, OP_PUT, OP_ALLOC, OP_COMMIT, OP_ABORT, OP_GET, OP_DEL, OP_STATS, OP_FDS, OP_KEYS = range(1, 11)
ST_OK, ST_BAD, ST_AUTH, ST_FULL, ST_INTERNAL = range(5)

#: values are laid out at this alignment inside a node's slabs (keeps tensor data aligned)
ALIGN = 64
MAX_IOV = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: the most bytes one ``sendmsg`` is given. A sender that hands the kernel far more than the
#: socket buffer holds sleeps and wakes in small steps with its receiver; measured on loopback
#: (64 MiB, one connection), 1 MiB calls moved 4.3 GB/s where one 64 MiB call moved 2.3.
SEND_PIECE = 1 << 20
MAX_FDS = 200  # per message; below the kernel's SCM_MAX_FD (253)
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_DRAIN = memoryview(bytearray(1 << 20))

#: the largest header map either side reads before the handshake (HELLO and its reply) succeeded;
#: a HELLO carries a version, a namespace, an access key, a token, a client id and a flag, so anything
#: bigger is not one
HELLO_MAX = 8 << 10
#: the largest header map of any message after the handshake (a batch's keys and sizes)
MAX_HEADER = 64 << 20

_DECODE_ERRORS = (ValueError, TypeError, msgpack.UnpackException)


class ProtocolError(StorageUnavailable):
    """A peer sent a message that breaks the storage-node protocol: an oversized length, a
    truncated or undecodable header map, or a reply that does not match its request.

    Raised to the client as a :class:`~tq_redis.errors.StorageUnavailable` naming the node (its
    connection is dropped: the stream can no longer be trusted); a node logs it and closes the
    connection.
    """


def is_tls(sock: socket.socket) -> bool:
    """Whether ``sock`` is a TLS socket (no ``sendmsg``/``recvmsg``/``MSG_WAITALL`` there)."""
    return isinstance(sock, ssl.SSLSocket)


def check_lengths(mlen: int, plen: int, max_header: int, max_payload: int, what: str) -> None:
    """Refuse a header whose announced lengths exceed the limits, before anything is allocated."""
    if mlen > max_header:
        raise ProtocolError(f"{what} announced a {mlen}-byte header map (the limit is {format_size(max_header)})")
    if plen > max_payload:
        raise ProtocolError(
            f"{what} announced a {format_size(plen)} payload (the limit is {format_size(max_payload)})"
        )


def aligned(sizes: np.ndarray) -> np.ndarray:
    """Each value's size rounded up to ``ALIGN`` (the room it takes in an extent)."""
    return (sizes + (ALIGN - 1)) & ~(ALIGN - 1)


def layout(sizes: np.ndarray) -> tuple[np.ndarray, int]:
    """Offsets of values packed at ``ALIGN`` inside one extent, and the extent's size."""
    room = aligned(sizes)
    ends = np.cumsum(room)
    total = int(ends[-1]) if len(ends) else 0
    return ends - room, total


def pack_meta(meta: dict[str, Any] | None) -> bytes:
    """The msgpack header map of a message (empty when there is nothing to say)."""
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
    if is_tls(sock):  # TLS has no sendmsg: small buffers are joined, large ones sent as they are
        for chunk in _coalesce(bufs):
            sock.sendall(chunk)
        return
    n = len(bufs)
    i = 0
    while i < n:
        chunk = _next_piece(bufs, i)
        sent = sock.sendmsg(chunk, anc) if anc else sock.sendmsg(chunk)
        anc = None
        while i < n and sent >= len(bufs[i]):
            sent -= len(bufs[i])
            i += 1
        if sent:
            bufs[i] = memoryview(bufs[i])[sent:]


def _next_piece(bufs: list[Buffer], i: int) -> list[Buffer]:
    """The buffers from ``bufs[i]`` on that one ``sendmsg`` sends: at most :data:`MAX_IOV` of them
    and :data:`SEND_PIECE` bytes (the last one cut there)."""
    chunk: list[Buffer] = []
    room = SEND_PIECE
    for b in islice(bufs, i, i + MAX_IOV):  # no copy of the list: a piece usually needs a few
        size = len(b)
        if size >= room:
            chunk.append(memoryview(b)[:room] if size > room else b)
            break
        chunk.append(b)
        room -= size
    return chunk


def _coalesce(bufs: list[Buffer], small: int = 64 << 10) -> list[Buffer]:
    """Runs of small buffers joined into one (fewer TLS records), large ones left as they are."""
    out: list[Buffer] = []
    run: list[Buffer] = []
    for b in bufs:
        if len(b) < small:
            run.append(b)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(b)
    if run:
        out.append(b"".join(run))
    return out


def recv_into_buffers(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every (byte) view in order from the socket, scattered, in as few syscalls as the kernel allows."""
    views = [v for v in views if len(v)]
    if is_tls(sock):
        for v in views:
            recv_into(sock, v)
        return
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
    flags = 0 if is_tls(sock) else socket.MSG_WAITALL
    while got < n:
        k = sock.recv_into(view[got:], 0, flags)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def set_blocking_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket whose sends/receives give up after ``seconds`` without progress.

    Kernel timeouts (SO_RCVTIMEO / SO_SNDTIMEO) instead of Python's, which make the socket
    non-blocking and so split every large send/receive into many short syscalls. A TLS socket
    gets Python's timeout (its reads must not see a kernel timeout in the middle of a record).
    """
    if is_tls(sock):
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


#: reads above this size grow with the bytes that arrive instead of being allocated up front
_GROW = 1 << 20


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """The next ``n`` bytes of the stream.

    Memory follows the bytes that actually arrive (a peer that announces more and stops costs
    only what it sent), and a freed buffer leaves no large block behind in the allocator.
    """
    if n <= _GROW:
        buf = bytearray(n)
        if n:
            recv_into(sock, memoryview(buf))
        return buf
    buf = bytearray()
    chunk = bytearray(_GROW)
    view = memoryview(chunk)
    while len(buf) < n:
        want = min(_GROW, n - len(buf))
        recv_into(sock, view[:want])
        buf += view[:want]
    return buf


def drain(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes (keeps the stream in step after a refused payload)."""
    while n:
        k = sock.recv_into(_DRAIN[: min(n, len(_DRAIN))])
        if k == 0:
            raise ConnectionError("connection closed by peer")
        n -= k


class IdleTimeout(TimeoutError):
    """No byte of a new message arrived within the socket's timeout (the peer is idle, not stuck)."""


_TIMEOUTS = (BlockingIOError, TimeoutError)  # SO_RCVTIMEO expiring / Python's (TLS) timeout


def recv_header(sock: socket.socket, want_fds: bool = False) -> tuple[int, int, int, list[int]]:
    """Read a message header: (code, header-map length, payload length, received fds).

    A timeout before the first byte raises :class:`IdleTimeout`; one after it, the socket's error.
    """
    buf = bytearray(HEADER.size)
    mv = memoryview(buf)
    got = 0
    fds: list[int] = []
    try:
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
                raise ConnectionError("connection closed by peer")
            got += k
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        if got == 0 and isinstance(exc, _TIMEOUTS):
            raise IdleTimeout(str(exc) or "timed out") from exc
        raise
    code, _flags, _res, mlen, plen = HEADER.unpack(buf)
    return code, mlen, plen, fds


def recv_meta(sock: socket.socket, mlen: int, limit: int = MAX_HEADER, what: str = "the peer") -> dict[str, Any]:
    """Read and decode a message's header map of ``mlen`` bytes (at most ``limit``).

    Anything but a map, or bytes msgpack cannot decode, raises :class:`ProtocolError`.
    """
    if mlen > limit:
        raise ProtocolError(f"{what} announced a {mlen}-byte header map (the limit is {format_size(limit)})")
    if not mlen:
        return {}
    return decode_meta(recv_exact(sock, mlen), what)


def decode_meta(data: bytes | bytearray, what: str = "the peer") -> dict[str, Any]:
    """A header map from its msgpack bytes; anything else raises :class:`ProtocolError`."""
    try:
        meta = msgpack.unpackb(data, raw=False)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"{what} sent an undecodable header map ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"{what} sent a header map that is a {type(meta).__name__}, not a map")
    return meta
