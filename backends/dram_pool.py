"""The ``dram`` store client's connections to its nodes: a pool per node, mapped slabs, request exchange.

A :class:`Link` is one storage-node *instance* as a client sees it: a pool of :class:`Conn`
sockets (each used by one thread at a time), the node's memory slabs this client has mapped
(same-host shared-memory path), and the unpins it owes the node. :func:`exchange` sends one
request per node, all before reading any reply, so the nodes of a batch work in parallel.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tq_redis.backends.base import Buffer
from tq_redis.backends.dram_protocol import (
    OP_FDS,
    OP_HELLO,
    PROTOCOL_VERSION,
    ST_AUTH,
    ST_BAD,
    ST_FULL,
    ST_OK,
    drain,
    recv_header,
    recv_meta,
    send_frame,
    set_blocking_timeout,
)

from tq_redis.errors import InvalidArgument, StorageAuthError, StorageError, StorageFull, StorageUnavailable

__all__ = [
    "Conn", "Link", "LinkOwner", "MappedSlab", "Request", "Unpin",
    "check_reply", "error_from", "exchange", "hold", "release", "run",
]  # fmt: skip

_HOSTNAME = socket.gethostname()


class LinkOwner(Protocol):
    """What a link needs from the store that owns it."""

    shm: bool
    timeout_s: float
    token: str | None
    client_id: str

    def _mark_stale(self) -> None:
        """The node list is out of date (a node restarted): read it again before the next operation."""


class MappedSlab:
    """A node's memory slab mapped into this process (read-write for puts, read-only for gets)."""

    __slots__ = ("id", "size", "fd", "rw", "rw_view", "ro", "__weakref__")

    def __init__(self, slab_id: int, size: int, fd: int) -> None:
        self.id, self.size, self.fd = slab_id, size, fd
        self.rw = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self.rw_view = memoryview(self.rw)
        self.ro: mmap.mmap | None = None

    def readonly(self) -> mmap.mmap:
        """A read-only mapping of the slab (views handed to callers of ``get`` come from it)."""
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


class Unpin:
    """Finaliser shared by the per-slab arrays behind one get's views: queues the node-side unpin."""

    __slots__ = ("link", "pin", "total", "count")

    def __init__(self, link: Link, pin: int, total: int) -> None:
        self.link, self.pin, self.total = link, pin, total
        self.count = itertools.count(1)

    def __call__(self) -> None:
        if next(self.count) == self.total:  # next() is atomic: safe from any thread's GC
            self.link.unpins.append(self.pin)


class Conn:
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


class Link:
    """One storage-node *instance* as this client sees it: connection pool, mapped slabs, unpins."""

    def __init__(self, info: dict[str, Any], store: LinkOwner) -> None:
        self.info = info
        self.node_id: str = info["node_id"]
        self.instance: str = info["instance"]
        self.address: str = info["address"]
        self.store = store
        self.lock = threading.Lock()
        self.idle: list[Conn] = []
        self.slabs: dict[int, MappedSlab] = {}
        self.unpins: list[int] = []
        self.gen = 0
        self.local_ok: bool | None = None  # None: not tried yet
        self.closed = False

    @property
    def label(self) -> str:
        return f"{self.node_id!r} at {self.address}"

    # -- connections --------------------------------------------------------------------------
    def acquire(self) -> Conn:
        with self.lock:
            if self.closed:
                raise StorageUnavailable(f"DRAM storage node {self.label} left the cluster")
            if self.idle:
                return self.idle.pop()
            gen = self.gen
        return self._connect(gen)

    def release(self, conn: Conn) -> None:
        with self.lock:
            if not (self.closed or conn.broken) and conn.gen == self.gen and len(self.idle) < 64:
                self.idle.append(conn)
                return
        conn.close()

    def fail(self, conn: Conn | None) -> None:
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

    def _connect(self, gen: int) -> Conn:
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

    def _hello(self, s: socket.socket, local: bool, gen: int) -> Conn:
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
            raise error_from(code, reply, self)
        if reply.get("instance") != self.instance:
            s.close()
            self.store._mark_stale()
            raise StorageUnavailable(
                f"DRAM storage node {self.label} restarted (instance changed); retry the operation"
            )
        return Conn(s, local, bool(reply.get("shm")), gen)

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
                    new.append(MappedSlab(sid, size, fd))
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

    def slab(self, conn: Conn, sid: int) -> MappedSlab:
        s = self.slabs.get(sid)
        if s is None:  # fds were sent on another connection whose mappings we dropped: ask again
            send_frame(conn.sock, OP_FDS, {"slabs": [sid]})
            code, mlen, _plen, fds = recv_header(conn.sock, True)
            meta = recv_meta(conn.sock, mlen)
            if code != ST_OK:
                raise error_from(code, meta, self)
            self.map_slabs(fds, meta)
            s = self.slabs.get(sid)
            if s is None:
                raise StorageError(f"DRAM storage node {self.label} no longer has memory slab {sid}")
        return s

    def take_unpins(self) -> list[int]:
        """The unpins owed to the node, to send with the next request (the queue is emptied)."""
        if not self.unpins:
            return []
        pending, self.unpins = self.unpins, []
        return pending


def error_from(code: int, meta: dict[str, Any], link: Link) -> StorageError:
    """The typed error for a refusal (status ``code``) from ``link``'s node."""
    msg = meta.get("msg") or f"error {code}"
    if code == ST_FULL:
        return StorageFull(msg)
    if code == ST_AUTH:
        return StorageAuthError(msg)
    if code == ST_BAD:
        return InvalidArgument(msg)
    return StorageError(f"DRAM storage node {link.label} failed: {msg}")


#: (link, connection, op, header map, payload buffers)
Request = tuple[Link, Conn, int, dict[str, Any], Sequence[Buffer]]
#: reads one reply: ``handle(i, link, conn, code, meta, plen, fds)`` -> that request's result
Handler = Callable[..., Any]


def exchange(reqs: Sequence[Request], handle: Handler) -> tuple[list[Any], BaseException | None]:
    """Send every request, then read every reply with ``handle(i, link, conn, code, meta, plen, fds)``.

    Returns ``(results, first_error)``. A connection that breaks is closed and marked broken
    (its node's error is a ``StorageUnavailable`` naming it); after a protocol-level error the
    stream is still in step and the connection stays usable. Unpins a link owes its node ride
    along with the first request to it.
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


def run(reqs: Sequence[Request], handle: Handler) -> list[Any]:
    """:func:`exchange`, raising the first error."""
    results, err = exchange(reqs, handle)
    if err is not None:
        raise err
    return results


def hold(links: Sequence[Link]) -> list[Conn]:
    """One connection per link, for the duration of an operation (give them back with :func:`release`)."""
    conns: list[Conn] = []
    try:
        for link in links:
            conns.append(link.acquire())
    except BaseException:
        release(links, conns)
        raise
    return conns


def release(links: Sequence[Link], conns: Sequence[Conn]) -> None:
    """Return connections taken with :func:`hold` to their links' pools."""
    for link, conn in zip(links, conns):
        link.release(conn)


def check_reply(i: int, link: Link, conn: Conn, code: int, meta: dict[str, Any], plen: int, fds: list[int]) -> Any:
    """Reply handler for requests that only return a status (and maybe slab fds): the header map."""
    if fds or "live" in meta:
        link.map_slabs(fds, meta)
    if code != ST_OK:
        drain(conn.sock, plen)
        raise error_from(code, meta, link)
    return meta
