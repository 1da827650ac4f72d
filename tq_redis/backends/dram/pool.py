"""The ``dram`` store client's connections to its nodes: a pool per node, mapped slabs, request exchange.

A :class:`Link` is one storage-node *instance* as a client sees it: a pool of :class:`Conn`
sockets (each used by one thread at a time), the node's memory slabs this client has mapped
(same-host shared-memory path), and the unpins it owes the node. :func:`exchange` sends one
request per node, all before reading any reply, so the nodes of a batch work in parallel; large
payloads (and, where the caller allows it, large replies) move over the sockets at the same time.
"""

from __future__ import annotations

import itertools
import mmap
import os
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tq_redis.backends.dram.parallel import PARALLEL_MIN_BYTES, concurrently
from tq_redis.backends.dram.protocol import (
    HELLO_MAX,
    MAX_HEADER,
    OP_FDS,
    OP_HELLO,
    PROTOCOL_VERSION,
    ST_AUTH,
    ST_BAD,
    ST_FULL,
    ST_OK,
    ProtocolError,
    check_lengths,
    format_size,
    pack_meta,
    recv_header,
    recv_meta,
    send_frame,
    set_blocking_timeout,
)
from tq_redis.errors import (
    InvalidArgument,
    StorageAuthError,
    StorageError,
    StorageFull,
    StorageUnavailable,
    TQError,
)
from tq_redis.storage.base import Buffer

__all__ = [
    "Conn", "Link", "LinkOwner", "MappedSlab", "Request", "Unpin",
    "check_data_reply", "check_put_size", "check_reply", "error_from", "exchange", "hold", "malformed",
    "release", "run",
]  # fmt: skip

_HOSTNAME = socket.gethostname()
#: how long a node that timed out moments ago is waited on for a new connection (see Link.unavailable)
PROBE_S = 0.1
#: a node's reply to a request of many keys or bytes is waited for longer than ``timeout_s``: this
#: much more per key (a node indexes a million keys in 5-20 s on a busy 2-core host) and per byte
SLOW_KEY_S = 50e-6
SLOW_BYTE_S = 1 / 100e6
#: below this much extra time a request waits ``timeout_s`` like any other (no socket option change)
SLOW_MIN_S = 0.1


class LinkOwner(Protocol):
    """What a link needs from the store that owns it."""

    shm: bool
    timeout_s: float
    namespace: str
    token: str | None
    client_id: str
    max_frame: int

    def tls_context(self, required: bool) -> ssl.SSLContext | None:
        """The context to wrap TCP connections in (None: plain TCP); ``required``: the node asks for TLS."""

    def _mark_stale(self) -> None:
        """The node list is out of date (a node restarted): read it again before the next operation."""


class MappedSlab:
    """A node's memory slab mapped into this process (read-write for puts, read-only for gets)."""

    __slots__ = ("id", "size", "fd", "rw", "rw_view", "ro", "__weakref__")

    def __init__(self, slab_id: int, size: int, fd: int) -> None:
        # a slab announced larger than its file would fault (SIGBUS) on first touch past the end
        if not (type(slab_id) is int and type(size) is int and 0 < size <= os.fstat(fd).st_size):
            raise ProtocolError(f"the node sent memory slab {slab_id!r:.20} with a size that does not match its file")
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

    __slots__ = ("sock", "local", "shm", "gen", "broken", "max_frame", "max_header")

    def __init__(
        self, sock: socket.socket, local: bool, shm: bool, gen: int, max_frame: int, max_header: int = MAX_HEADER
    ) -> None:
        self.sock, self.local, self.shm, self.gen = sock, local, shm, gen
        self.broken = False
        self.max_frame = max_frame  # the largest request payload the node takes (it said so in HELLO)
        self.max_header = max_header

    def closed_by_peer(self) -> bool:
        """Whether the node closed this idle connection (or sent something unasked): not reusable."""
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            # readable while idle: the node closed it (EOF, reset) or sent bytes nobody asked for
            return bool(poller.poll(0)) or (isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0)
        except (OSError, ValueError):
            return True

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
        # weakly: a store dropped without close() must be collectable (its finaliser closes the links)
        self.store = store if isinstance(store, weakref.ProxyTypes) else weakref.proxy(store)
        self.lock = threading.Lock()
        self.idle: list[Conn] = []
        self.slabs: dict[int, MappedSlab] = {}
        self.unpins: list[int] = []
        self.gen = 0
        self.local_ok: bool | None = None  # None: not tried yet
        self.closed = False
        self.down_until = 0.0  # monotonic time until which a node that just timed out is not waited on again
        self.heartbeat_age = 0.0  # seconds since its last heartbeat, by Redis's clock, at the last registry read

    @property
    def label(self) -> str:
        return f"{self.node_id!r} at {self.address}"

    @property
    def host(self) -> str:
        """The host the node registered ("" when it did not say)."""
        host = self.info.get("host")
        return host if isinstance(host, str) else ""

    @property
    def nearby(self) -> bool:
        """Whether this client reaches the node through shared memory (same host, both allow it)."""
        return bool(
            self.store.shm and self.info.get("uds") and self.info.get("shm") and self.local_ok is not False
            and self.host == _HOSTNAME
        )  # fmt: skip

    # -- connections --------------------------------------------------------------------------
    def acquire(self) -> Conn:
        with self.lock:
            if self.closed:
                raise StorageUnavailable(f"DRAM storage node {self.label} left the cluster")
            while self.idle:
                conn = self.idle.pop()
                if not conn.closed_by_peer():
                    return conn
                conn.close()  # the node dropped it while idle (its --idle-timeout): use another
            gen = self.gen
            # a node that just timed out gets a short probe, not a second full wait
            probe = self.down_until > 0 and time.monotonic() < self.down_until
        if not probe:
            return self._connect(gen, self.store.timeout_s)
        try:
            conn = self._connect(gen, min(PROBE_S, self.store.timeout_s))
        except StorageUnavailable as exc:
            raise StorageUnavailable(
                f"DRAM storage node {self.label} did not answer within {self.store.timeout_s:g} s moments "
                f"ago, nor to a {min(PROBE_S, self.store.timeout_s):g} s probe now; check that it is "
                f"running, or raise the store option timeout_s"
            ) from exc.__cause__
        set_blocking_timeout(conn.sock, self.store.timeout_s)
        self.down_until = 0.0
        return conn

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

    def _connect(self, gen: int, wait: float) -> Conn:
        """A new connection, handshake done; ``wait``: its socket timeout until then."""
        st = self.store
        uds = self.info.get("uds")
        try_local = (
            st.shm and uds and self.info.get("shm") and self.local_ok is not False
            and self.info.get("host") == _HOSTNAME
        )  # fmt: skip
        errors: list[str] = []
        if try_local:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(wait)
            try:
                s.connect("\0" + uds)
                set_blocking_timeout(s, wait)
                conn = self._hello(s, True, gen)
                self.local_ok = True
                return conn
            except (StorageAuthError, StorageUnavailable):
                raise
            except OSError as exc:
                s.close()
                errors.append(f"unix socket: {exc}")
        host, _, port = self.address.rpartition(":")
        tls = st.tls_context(bool(self.info.get("tls")))
        try:
            s = socket.create_connection((host, int(port)), timeout=wait)
        except (OSError, ValueError) as exc:
            errors.append(f"tcp: {exc}")
            self.fail(None)  # a node that is gone must not keep its memory alive through our mappings
            raise StorageUnavailable(
                f"DRAM storage node {self.label} is unreachable ({'; '.join(errors)}); "
                f"is it running? (tq-redis storage-unit ...)"
            ) from exc
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            s = self._tls(s, tls, host)
        set_blocking_timeout(s, wait)
        conn = self._hello(s, False, gen)
        if try_local:
            self.local_ok = False  # alive over TCP but not over the unix socket: another netns
        return conn

    def _tls(self, s: socket.socket, ctx: ssl.SSLContext, host: str) -> ssl.SSLSocket:
        """``s`` after a TLS handshake with the node (certificate verified as ``ctx`` says)."""
        try:
            return ctx.wrap_socket(s, server_hostname=host.strip("[]") or None)
        except ssl.SSLCertVerificationError as exc:
            s.close()
            raise StorageAuthError(
                f"DRAM storage node {self.label}: its TLS certificate did not verify ({exc.verify_message}); "
                f"set the store option tls_ca to the CA (or self-signed certificate) that issued it"
            ) from None
        except OSError as exc:  # ssl.SSLError included: e.g. the node does not speak TLS
            s.close()
            raise StorageUnavailable(
                f"DRAM storage node {self.label}: TLS handshake failed ({exc}); is the node started with "
                f"--tls-cert (and the store option tls set to match)?"
            ) from None

    def _hello(self, s: socket.socket, local: bool, gen: int) -> Conn:
        meta = {
            "v": PROTOCOL_VERSION,
            "ns": self.store.namespace,
            "access": self.info.get("access"),  # from the node's registration in the namespace
            "instance": self.instance,  # the run of the node that key belongs to
            "token": self.store.token,
            "client": self.store.client_id,
            "shm": local,
        }
        fds: list[int] = []
        try:
            send_frame(s, OP_HELLO, meta)
            code, mlen, plen, fds = recv_header(s, local)
            # the reply to a HELLO is a small map and nothing else: no trust in the lengths before it
            check_lengths(mlen, plen, HELLO_MAX, 0, f"DRAM storage node {self.label}'s HELLO reply")
            reply = recv_meta(s, mlen, HELLO_MAX, f"DRAM storage node {self.label}")
        except OSError as exc:
            s.close()
            raise self.unavailable(exc) from exc
        except ProtocolError:
            s.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        if code != ST_OK:
            s.close()
            if reply.get("instance") not in (None, self.instance):
                self.store._mark_stale()  # the node restarted: its new key is in the registry
                raise StorageUnavailable(
                    f"DRAM storage node {self.label} restarted (instance changed); retry the operation"
                )
            raise error_from(code, reply, self)
        max_frame = reply.get("max_frame", self.store.max_frame)
        if type(max_frame) is not int or max_frame < 0:
            s.close()
            raise ProtocolError(f"DRAM storage node {self.label} sent a malformed HELLO reply (max_frame)")
        if reply.get("instance") != self.instance:
            s.close()
            self.store._mark_stale()
            raise StorageUnavailable(
                f"DRAM storage node {self.label} restarted (instance changed); retry the operation"
            )
        return Conn(s, local, bool(reply.get("shm")), gen, min(max_frame, self.store.max_frame))

    def unavailable(self, exc: BaseException, work: tuple[int, int, float] | None = None) -> StorageUnavailable:
        """The error for a node whose connection failed with ``exc``; ``work``: the keys, bytes and
        extra seconds of a large request whose reply was waited for longer than ``timeout_s``.

        A node that timed out is not waited on again for ``timeout_s``: a new connection to it
        gets a short probe (``PROBE_S``) instead, so the cleanup after a failed put does not wait
        a second time for the same node, and a node that is back answers the probe.
        """
        if isinstance(exc, StorageUnavailable):
            return exc
        timeout = self.store.timeout_s
        if isinstance(exc, (TimeoutError, BlockingIOError)) and work is not None:
            self.down_until = time.monotonic() + timeout
            keys, nbytes, extra = work
            return StorageUnavailable(
                f"DRAM storage node {self.label} did not answer a request of {keys:,} key(s) and "
                f"{format_size(nbytes)} within {timeout + extra:.1f} s ({timeout:g} s, plus {extra:.1f} s "
                f"allowed for its size): it may be alive but too slow (a busy host, or too much in one "
                f"request) rather than down; split the batch, check the node's CPU, or raise the store "
                f"option timeout_s"
            )
        if isinstance(exc, (TimeoutError, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO expired
            self.down_until = time.monotonic() + timeout
            what = f"did not answer within {timeout:g} s"
        else:
            what = f"is unreachable ({exc})"
        return StorageUnavailable(
            f"DRAM storage node {self.label} {what}; check that it is running, or raise the "
            f"store option timeout_s"
        )

    # -- slabs --------------------------------------------------------------------------------
    def map_slabs(self, fds: list[int], meta: dict[str, Any]) -> None:
        """Take ownership of slab fds sent with a reply; forget slabs the node has released.

        Every fd is either mapped or closed here, whatever the reply says.
        """
        fd_slabs = meta.get("fd_slabs") or []
        live = meta.get("live")
        new: list[MappedSlab] = []
        pending = list(fds)
        try:
            if not isinstance(fd_slabs, list) or len(fd_slabs) != len(fds):
                raise ProtocolError(f"DRAM storage node {self.label} sent {len(fds)} slab fds for {fd_slabs!r:.60}")
            if live is not None and not (isinstance(live, list) and all(type(x) is int for x in live)):
                raise ProtocolError(f"DRAM storage node {self.label} sent a malformed list of live slabs")
            for entry in fd_slabs:
                if not (isinstance(entry, list) and len(entry) == 2):
                    raise ProtocolError(f"DRAM storage node {self.label} sent a malformed slab entry {entry!r:.60}")
                fd = pending.pop(0)
                if entry[0] in self.slabs:
                    os.close(fd)
                else:
                    try:
                        new.append(MappedSlab(entry[0], entry[1], fd))
                    except BaseException:
                        os.close(fd)
                        raise
        except BaseException:
            for fd in pending:
                os.close(fd)
            for m in new:
                m.drop()
            raise
        with self.lock:
            for m in new:
                self.slabs.setdefault(m.id, m)
            keep = None if live is None else set(live)
            gone = [] if keep is None else [sid for sid in self.slabs if sid not in keep]
            dropped = [self.slabs.pop(sid) for sid in gone]
        for m in dropped:
            m.drop()

    def slab(self, conn: Conn, sid: int) -> MappedSlab:
        """The mapped slab ``sid`` (asked for again on ``conn`` if this client no longer maps it)."""
        s = self.slabs.get(sid)
        if s is not None:
            return s
        # fds were sent on another connection whose mappings we dropped: ask again
        fds: list[int] = []
        try:
            send_frame(conn.sock, OP_FDS, {"slabs": [sid]})
            code, mlen, plen, fds = recv_header(conn.sock, True)
            check_lengths(mlen, plen, conn.max_header, 0, f"DRAM storage node {self.label}")
            meta = recv_meta(conn.sock, mlen, conn.max_header, f"DRAM storage node {self.label}")
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            self.fail(conn)
            raise self.unavailable(exc) from exc
        except ProtocolError:
            for fd in fds:
                os.close(fd)
            self.fail(conn)
            raise
        if code != ST_OK:
            for fd in fds:
                os.close(fd)
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
    msg = meta.get("msg")
    msg = f"{msg:.2000}" if isinstance(msg, str) and msg else f"error {code}"
    if code == ST_FULL:
        return StorageFull(msg)
    if code == ST_AUTH:
        return StorageAuthError(msg)
    if code == ST_BAD:
        return InvalidArgument(msg)
    return StorageError(f"DRAM storage node {link.label} failed: {msg}")


def malformed(link: Link, exc: BaseException) -> ProtocolError:
    """The error for a reply that could not be used (its fields did not fit the request)."""
    if isinstance(exc, ProtocolError):
        return exc
    return ProtocolError(
        f"DRAM storage node {link.label} sent a malformed reply ({type(exc).__name__}: {exc!s:.200}); "
        f"is that address really a tq-redis storage node of this version?"
    )


#: (link, connection, op, header map, payload buffers)
Request = tuple[Link, Conn, int, dict[str, Any], Sequence[Buffer]]
#: reads one reply: ``handle(i, link, conn, code, meta, plen, fds)`` -> that request's result
Handler = Callable[..., Any]


def _check_request(conn: Conn, link: Link, meta: dict[str, Any]) -> None:
    """Refuse, before sending, a header map larger than the node reads (it would drop the connection)."""
    keys = meta.get("keys")
    if not keys or len(keys) < 1024:
        return
    estimate = sum(map(len, keys)) + 9 * len(keys) + 64  # a little over msgpack's size
    if estimate > conn.max_header and len(pack_meta(meta)) > conn.max_header:
        raise InvalidArgument(
            f"a batch of {len(keys)} keys for DRAM storage node {link.label} needs a header map over "
            f"the protocol's {format_size(conn.max_header)}; split the batch"
        )


def check_put_size(conn: Conn, link: Link, nbytes: int) -> None:
    """Refuse, before sending, a put larger than the node takes in one request (its ``--max-frame``)."""
    if nbytes > conn.max_frame:
        raise InvalidArgument(
            f"a put of {format_size(nbytes)} to DRAM storage node {link.label} exceeds the "
            f"{format_size(conn.max_frame)} it accepts in one request (its --max-frame, or the store "
            f"option max_frame); split the batch or raise those limits"
        )


def exchange(
    reqs: Sequence[Request], handle: Handler, *, parallel_replies: bool = False, work: Sequence[int] | None = None
) -> tuple[list[Any], BaseException | None]:
    """Send every request, then read every reply with ``handle(i, link, conn, code, meta, plen, fds)``.

    Returns ``(results, first_error)``. A connection that breaks is closed and marked broken
    (its node's error is a ``StorageUnavailable`` naming it); after a protocol-level error the
    stream is still in step and the connection stays usable. A reply that breaks the protocol
    (lengths over the limits, an undecodable header map, fields that do not fit the request)
    is a :class:`ProtocolError` (a ``StorageUnavailable``) and its connection is dropped. Unpins a
    link owes its node ride along with the first request to it.

    Requests to several nodes whose payloads reach :data:`PARALLEL_MIN_BYTES` are sent at the same
    time, one thread per node. ``parallel_replies=True`` reads the replies at the same time too:
    only for a ``handle`` that is safe to call from several threads at once (each call gets its
    own link and connection).

    A node is given ``timeout_s`` to start its reply, plus time for the size of a large request
    (:data:`SLOW_KEY_S` per key, :data:`SLOW_BYTE_S` per byte): a live node indexing a million
    keys is slow, not dead. ``work``: the keys each request makes the node handle, where its
    header map does not list them (a commit of a reservation); by default, its ``keys``.
    """
    sent = [False] * len(reqs)
    results: list[Any] = [None] * len(reqs)
    first_err: BaseException | None = None
    framed: list[tuple[Request, list[Any]]] = []
    for link, conn, op, meta, payload in reqs:
        unpins = link.take_unpins()
        if unpins:
            meta = {**meta, "unpin": unpins}
        framed.append(((link, conn, op, meta, payload), unpins))

    sizes = [sum(map(len, req[4])) for req, _ in framed]
    counts = work if work is not None else [len(req[3].get("keys") or ()) for req, _ in framed]
    works = [_allowance(n, size) for n, size in zip(counts, sizes, strict=True)]
    sends = [_sender(req, size, w) for (req, _), size, w in zip(framed, sizes, works, strict=True)]
    large = sum(size >= PARALLEL_MIN_BYTES for size in sizes)
    outcomes = concurrently(sends) if large > 1 else [send() for send in sends]
    for i, ((link, conn, *_), unpins) in enumerate(framed):
        exc = outcomes[i]
        if exc is None:
            sent[i] = True
            continue
        link.unpins.extend(unpins)
        if isinstance(exc, OSError):
            link.fail(conn)
            first_err = first_err or link.unavailable(exc, works[i])
        else:
            first_err = first_err or exc

    receives = [_receiver(i, req, handle, works[i]) for i, (req, _) in enumerate(framed) if sent[i]]
    if parallel_replies and len(receives) > 1:
        replies = concurrently(receives)
    else:
        replies = [receive() for receive in receives]
    for i, result, exc in replies:
        results[i] = result
        if exc is not None:
            first_err = first_err or exc
    return results, first_err


def _sender(req: Request, size: int, work: tuple[int, int, float] | None = None) -> Callable[[], BaseException | None]:
    """Sending one request: returns the ``OSError`` or ``InvalidArgument`` it met, else ``None``.
    ``work``: a large request's size: the node may take longer to read it too (and the reply's
    wait keeps the longer timeout, see :func:`_receiver`)."""
    link, conn, op, meta, payload = req

    def send() -> BaseException | None:
        try:
            _check_request(conn, link, meta)
            if work is not None:
                set_blocking_timeout(conn.sock, link.store.timeout_s + work[2])
            send_frame(conn.sock, op, meta, payload, size)
        except (OSError, InvalidArgument) as exc:
            return exc
        return None

    return send


def _allowance(keys: int, nbytes: int) -> tuple[int, int, float] | None:
    """``(keys, bytes, extra seconds)`` of a request large enough to be waited on longer."""
    extra = keys * SLOW_KEY_S + nbytes * SLOW_BYTE_S
    return (keys, nbytes, extra) if extra >= SLOW_MIN_S else None


def _receiver(
    i: int, req: Request, handle: Handler, work: tuple[int, int, float] | None = None
) -> Callable[[], tuple[int, Any, BaseException | None]]:
    """Reading request ``i``'s reply: ``(i, what handle returned, the error it met or None)``.

    A broken connection (its node unreachable, or a reply that breaks the protocol) is failed
    here, so a thread reading one node's reply only touches that node's link. ``work``: a large
    request's size, whose reply is waited for longer (see :func:`exchange`)."""
    link, conn = req[0], req[1]

    def first_bytes() -> tuple[int, int, int, list[int]]:
        header = recv_header(conn.sock, conn.local)  # with the sender's longer timeout, if large
        if work is not None:
            set_blocking_timeout(conn.sock, link.store.timeout_s)
        return header

    def receive() -> tuple[int, Any, BaseException | None]:
        fds: list[int] = []
        try:
            code, mlen, plen, fds = first_bytes()
            what = f"DRAM storage node {link.label}"
            check_lengths(mlen, plen, conn.max_header, link.store.max_frame, what)
            meta = recv_meta(conn.sock, mlen, conn.max_header, what)
            got, fds = fds, []  # the handler owns them now
            return i, handle(i, link, conn, code, meta, plen, got), None
        except OSError as exc:
            link.fail(conn)
            return i, None, link.unavailable(exc, work)
        except TQError as exc:
            if isinstance(exc, ProtocolError):
                link.fail(conn)
            return i, None, exc
        except Exception as exc:  # a reply whose fields do not fit: the stream is not trusted any more
            link.fail(conn)
            return i, None, malformed(link, exc)
        finally:
            for fd in fds:
                os.close(fd)

    return receive


def run(reqs: Sequence[Request], handle: Handler, *, parallel_replies: bool = False) -> list[Any]:
    """:func:`exchange`, raising the first error."""
    results, err = exchange(reqs, handle, parallel_replies=parallel_replies)
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
    """Reply handler for requests that only return a status (and maybe slab fds): the header map.

    Such replies carry no payload (nor do refusals of any request).
    """
    if fds or "live" in meta:
        link.map_slabs(fds, meta)
    if plen:
        raise ProtocolError(f"DRAM storage node {link.label} sent a {plen}-byte payload with a reply that has none")
    if code != ST_OK:
        raise error_from(code, meta, link)
    return meta


def check_data_reply(
    i: int, link: Link, conn: Conn, code: int, meta: dict[str, Any], plen: int, fds: list[int]
) -> Any:
    """:func:`check_reply` for a reply that may carry a payload when it succeeds (GET)."""
    return check_reply(i, link, conn, code, meta, 0 if code == ST_OK else plen, fds)
