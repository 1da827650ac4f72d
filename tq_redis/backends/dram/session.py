"""One client connection of a DRAM storage node: its thread, the handshake guard, its limits.

A :class:`Session` serves one accepted connection on its own thread. It sets up TLS (when the
node serves it), then reads nothing but a HELLO of at most
:data:`~tq_redis.backends.dram.protocol.HELLO_MAX` bytes and no payload until the HELLO has
passed (protocol version, the namespace and its access key, the token: see :class:`Admission`),
so garbage allocates nothing and closes the connection with a logged reason. After it, every
request's lengths are checked against :class:`Limits` before anything is read, and the request
goes to the handlers it inherits from
:class:`~tq_redis.backends.dram.handlers.RequestHandlers`. Socket timeouts bound the handshake,
a stall mid-message and (if set) idling; :meth:`Session.end` lets a stopping node end it after the
request it is serving. The node process that accepts connections is
:mod:`tq_redis.backends.dram.server`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from tq_redis.backends.dram.handlers import MALFORMED, RequestHandlers
from tq_redis.backends.dram.node import Refused, StorageNode
from tq_redis.backends.dram.protocol import (
    HELLO_MAX,
    MAX_HEADER,
    OP_HELLO,
    PROTOCOL_VERSION,
    ST_AUTH,
    ST_BAD,
    ST_INTERNAL,
    ST_OK,
    IdleTimeout,
    ProtocolError,
    check_lengths,
    recv_header,
    recv_meta,
    send_frame,
    set_blocking_timeout,
)

log = logging.getLogger(__name__)

__all__ = ["Admission", "Limits", "Session"]

#: a plain socket's receive timeout expiring (SO_RCVTIMEO), or Python's (TLS sockets)
_TIMEOUTS = (BlockingIOError, TimeoutError)


@dataclass(frozen=True)
class Admission:
    """Who a node lets in: a client of its namespace presenting its access key (and its token, if set).

    The access key is random per node start and published only in the namespace's registry
    (``<ns>:storage:nodes``), so a client gets in if and only if its Redis user may read that
    namespace's keys; a token shared by the nodes of several namespaces admits no one by itself.
    """

    #: the namespace the node serves
    namespace: str
    #: the node's access key, as registered in Redis
    access: str
    #: ``--token`` / ``TQ_STORAGE_TOKEN``, also required when set (None: not asked for)
    token: str | None = None


@dataclass(frozen=True)
class Limits:
    """What a node accepts from a connection, and how long it waits for it."""

    #: largest request payload after the handshake (``--max-frame``)
    max_frame: int
    #: largest header map after the handshake
    max_header: int = MAX_HEADER
    #: a connection that has not completed TLS and HELLO by then is closed (``--handshake-timeout``)
    handshake_s: float = 10.0
    #: an authenticated connection that stops mid-message (or stops reading a reply) for this long
    #: is closed (``--io-timeout``)
    io_s: float = 30.0
    #: an authenticated connection idle between requests this long is closed; 0: never (``--idle-timeout``)
    idle_s: float = 0.0


class _Malformed(Exception):
    """A request whose header map does not have the fields its op needs (the connection is closed)."""


class Session(RequestHandlers):
    """One client connection, served by its own thread."""

    def __init__(
        self,
        node: StorageNode,
        sock: socket.socket,
        local: bool,
        admission: Admission,
        shm: bool,
        limits: Limits,
        tls: ssl.SSLContext | None = None,
        peer: str = "?",
    ):
        super().__init__(node, sock)
        self.local = local
        self.admission = admission
        self.limits = limits
        self.tls = tls
        self.peer = peer
        self.shm_ok = shm and local
        self.authed = False  # every connection starts with a HELLO (which checks the token, if any)
        self.started = time.monotonic()
        self._state = threading.Lock()
        self._busy = False  # serving a request (between its header and its reply)
        self._ending = False  # the node is stopping: end after the current request

    def end(self, now: bool = False) -> None:
        """Ask the session to end: at once if it waits for a request (or ``now``), else after its reply."""
        with self._state:
            self._ending = True
            idle = not self._busy
        if idle or now:
            with contextlib.suppress(OSError):
                # the plain socket's shutdown (a TLS socket's own would drop its state under the reader)
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # wakes the blocked thread

    def _begin(self) -> bool:
        with self._state:
            self._busy = not self._ending
            return self._busy

    def _done(self) -> bool:
        with self._state:
            self._busy = False
            return not self._ending

    def run(self) -> None:
        """Serve requests until the client disconnects, breaks the protocol or :meth:`end` is called."""
        reason: str | None = None
        try:
            reason = self._serve()
        except ProtocolError as exc:
            reason = str(exc)
        except _Malformed as exc:
            reason = f"malformed request: {exc}"
        except IdleTimeout:
            reason = "no HELLO within the handshake timeout" if not self.authed else "idle timeout"
        except ssl.SSLError as exc:
            reason = f"TLS failed: {exc}"
        except _TIMEOUTS:
            reason = "stalled in the middle of a message (timeout)"
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug: report it to the client and drop the connection
            log.exception("request failed")
            with contextlib.suppress(OSError):
                send_frame(self.sock, ST_INTERNAL, {"msg": "internal error in the storage node (see its log)"})
        finally:
            if reason is not None and not self._ending:
                log.warning("closing connection from %s: %s", self.peer, reason)
            for txn in self.txns.values():
                self.node.abort(txn)
            if self.client is not None:
                self.node.client_disconnected(self.client)
            with contextlib.suppress(OSError):
                self.sock.close()

    def _serve(self) -> str | None:
        """The request loop; returns why it closes the connection (None: the peer left)."""
        if self.tls is not None:
            self.sock.settimeout(self.limits.handshake_s)
            self.sock = self.tls.wrap_socket(self.sock, server_side=True)
        set_blocking_timeout(self.sock, self.limits.handshake_s)
        idle = 0.0
        while True:
            sock = self.sock
            try:
                op, mlen, plen, _fds = recv_header(sock)
            except IdleTimeout:
                if not self.authed or self._ending:
                    raise
                idle += self.limits.io_s  # authenticated and between requests: idle, not stuck
                if self.limits.idle_s and idle >= self.limits.idle_s:
                    raise
                continue
            except (ConnectionError, OSError):
                return None
            idle = 0.0
            if not self._begin():
                return None
            if not self.authed:
                refusal = self._check_first(op, mlen, plen)
                if refusal:
                    return refusal
            else:
                check_lengths(mlen, plen, self.limits.max_header, self.limits.max_frame, "the client")
            meta = recv_meta(sock, mlen, self.limits.max_header if self.authed else HELLO_MAX, "the client")
            was_authed = self.authed
            try:
                if op == OP_HELLO:
                    self._hello(meta)
                else:
                    self._dispatch(op, meta, plen)
            except Refused as exc:
                send_frame(sock, exc.code, {"msg": str(exc), **exc.extra})
                if not self.authed:  # a failed handshake: no second guess on this connection
                    return f"handshake refused: {exc}"
            except MALFORMED as exc:
                with contextlib.suppress(OSError):
                    send_frame(sock, ST_BAD, {"msg": f"malformed request {op}: {type(exc).__name__}"})
                raise _Malformed(f"op {op}: {type(exc).__name__}: {exc}") from None
            if self.authed and not was_authed:
                set_blocking_timeout(sock, self.limits.io_s)
            if not self._done():
                return None

    def _check_first(self, op: int, mlen: int, plen: int) -> str | None:
        """Before the handshake only a small HELLO is read; anything else closes the connection."""
        if op == OP_HELLO and mlen <= HELLO_MAX and plen == 0:
            return None
        if mlen <= HELLO_MAX and plen == 0 and op < 64:  # a well-formed request, but too early
            recv_meta(self.sock, mlen, HELLO_MAX, "the client")
            with contextlib.suppress(OSError):
                send_frame(
                    self.sock, ST_AUTH,
                    {"msg": f"DRAM storage node {self.node.node_id!r} requires a HELLO with its access key "
                     "(and its token, if it has one) before any request"},
                )  # fmt: skip
            return f"request {op} before the handshake"
        return (
            f"not a HELLO before the handshake (op {op}, header map {mlen} bytes, payload {plen} bytes; "
            f"at most {HELLO_MAX} and 0 are read before the handshake)"
        )

    def _hello(self, meta: dict[str, Any]) -> None:
        """The handshake: the protocol version, the namespace and its access key, the token (if the
        node has one); then the connection is authenticated."""
        node, admit = self.node, self.admission
        if meta.get("v") != PROTOCOL_VERSION:
            raise Refused(ST_BAD, f"protocol version {meta.get('v')!r:.40} is not {PROTOCOL_VERSION}")
        if meta.get("instance") not in (None, node.instance):  # its client saw the node's last run
            raise Refused(
                ST_AUTH, f"DRAM storage node {node.node_id!r} restarted: read its registration again",
                {"instance": node.instance},
            )  # fmt: skip
        ns, access = meta.get("ns"), meta.get("access") or ""
        if not isinstance(ns, str | None) or not isinstance(access, str):
            raise _Malformed("HELLO: the namespace or the access key is not a string")
        # both compared in constant time, and one refusal for either: nothing to guess from
        right_ns = hmac.compare_digest((ns or "").encode(), admit.namespace.encode())
        if not (hmac.compare_digest(access.encode(), admit.access.encode()) and right_ns):
            raise Refused(
                ST_AUTH,
                f"DRAM storage node {node.node_id!r} admits only clients of its namespace presenting the "
                f"access key it registered there: the dram store reads it from '<namespace>:storage:nodes' "
                f"with the namespace's Redis user (a client of another namespace cannot)",
            )
        if admit.token is not None:
            given = meta.get("token") or ""
            if not isinstance(given, str):
                raise _Malformed("HELLO: the token is not a string")
            if not hmac.compare_digest(given.encode(), admit.token.encode()):
                raise Refused(
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
            self.sock, ST_OK,
            {"node_id": node.node_id, "instance": node.instance, "shm": self.shm,
             "max_frame": self.limits.max_frame, "max_header": self.limits.max_header},
        )  # fmt: skip
