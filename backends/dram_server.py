"""A DRAM storage node process: serves a :class:`~tq_redis.backends.dram_node.StorageNode` over sockets.

Run one with ``python -m tq_redis.backends.dram_server --redis URL --capacity 4GiB`` (or
``tq-redis storage-unit``). It registers itself in Redis (``<ns>:storage:nodes``), heartbeats
every second with its used bytes, and deregisters on SIGTERM / SIGINT.

Same-host clients connect over an abstract Unix socket and receive slab fds (``SCM_RIGHTS``); they
write values straight into reserved extents and read them in place. Remote clients use TCP, and
the node moves payloads between the socket and its slabs with scatter/gather syscalls. The wire
protocol lives in :mod:`tq_redis.backends.dram_protocol`; each connection is a :class:`_Session`
served by its own thread.

**Wire safety.** Every connection starts with a HELLO; until it succeeds the node reads only a
header map of at most 8 KiB and no payload, so garbage (an HTTP request, random bytes) allocates
nothing and the connection is closed with a logged reason. After it, a request's header map is
bounded by 64 MiB and its payload by ``--max-frame`` (default: the capacity, at least 64 MiB),
checked before anything is allocated; large reads commit memory only as bytes arrive. A
connection that has not completed TLS and HELLO within ``--handshake-timeout`` is closed (also one
that trickles bytes), as is an authenticated one that stalls mid-message for ``--io-timeout`` or,
if set, idles for ``--idle-timeout``; TCP keepalive notices peers whose host vanished. With
``--tls-cert``/``--tls-key`` the TCP listener speaks TLS (the same-host Unix socket stays local).

**Stopping** (SIGTERM, SIGINT, or the parent that spawned the node exiting) is orderly: the node
stops accepting, lets every session finish the request it is serving (idle ones end at once),
waits for those threads and for the heartbeat, deregisters, and only then frees its memory and
removes its spill directory, so no request can still be using them.

Spawning nodes from Python (``tq-redis up``, ``init()``, tests) is :mod:`tq_redis.backends.dram_launcher`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hmac
import json
import logging
import mmap
import os
import selectors
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
from tq_redis.backends.dram_node import Refused, StorageNode, Txn
from tq_redis.backends.dram_protocol import (
    HELLO_MAX,
    MAX_HEADER,
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
    ST_INTERNAL,
    ST_OK,
    IdleTimeout,
    ProtocolError,
    check_lengths,
    drain,
    format_size,
    recv_header,
    recv_into_buffers,
    recv_meta,
    send_frame,
    set_blocking_timeout,
)

from tq_redis import connections
from tq_redis.config import parse_size
from tq_redis.keys import storage_nodes_key

log = logging.getLogger("tq_redis.dram_server")

# LocalNodes, spawn_node and start_local_nodes resolve through __getattr__ (see the end of the module)
__all__ = ["LocalNodes", "StorageNode", "main", "spawn_node", "start_local_nodes"]  # noqa: F822

#: how long a stopping node waits for its sessions to finish the requests they are serving
DRAIN_S = 5.0
#: a plain socket's receive timeout expiring (SO_RCVTIMEO), or Python's (TLS sockets)
_TIMEOUTS = (BlockingIOError, TimeoutError)


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


#: what a malformed request's fields raise when handlers use them
_MALFORMED = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError)


class _Malformed(Exception):
    """A request whose header map does not have the fields its op needs (the connection is closed)."""


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


class _Session:
    """One client connection, served by its own thread."""

    def __init__(
        self,
        node: StorageNode,
        sock: socket.socket,
        local: bool,
        token: str | None,
        shm: bool,
        limits: Limits,
        tls: ssl.SSLContext | None = None,
        peer: str = "?",
    ):
        self.node, self.sock, self.local = node, sock, local
        self.token = token
        self.limits = limits
        self.tls = tls
        self.peer = peer
        self.shm_ok = shm and local
        self.shm = False
        self.authed = False  # every connection starts with a HELLO (which checks the token, if any)
        self.started = time.monotonic()
        self.client: str | None = None
        self.txns: dict[int, Txn] = {}
        self.sent_slabs: set[int] = set()
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
                self._dispatch(op, meta, plen)
            except Refused as exc:
                send_frame(sock, exc.code, {"msg": str(exc)})
                if not self.authed:  # a failed handshake: no second guess on this connection
                    return f"handshake refused: {exc}"
            except _MALFORMED as exc:
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
                    {"msg": f"DRAM storage node {self.node.node_id!r} requires a HELLO (and its token, "
                     "if it has one) before any request"},
                )  # fmt: skip
            return f"request {op} before the handshake"
        return (
            f"not a HELLO before the handshake (op {op}, header map {mlen} bytes, payload {plen} bytes; "
            f"at most {HELLO_MAX} and 0 are read before the handshake)"
        )

    def _dispatch(self, op: int, meta: dict[str, Any], plen: int) -> None:
        node = self.node
        if op == OP_HELLO:
            return self._hello(meta)
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
        raise Refused(ST_BAD, f"unknown request {op}")

    def _hello(self, meta: dict[str, Any]) -> None:
        node = self.node
        if meta.get("v") != PROTOCOL_VERSION:
            raise Refused(ST_BAD, f"protocol version {meta.get('v')!r:.40} is not {PROTOCOL_VERSION}")
        if self.token is not None:
            given = meta.get("token") or ""
            if not isinstance(given, str):
                raise _Malformed("HELLO: the token is not a string")
            if not hmac.compare_digest(given.encode(), self.token.encode()):
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
        self.uds: socket.socket | None = None
        self.uds_name: str | None = None
        self._wake_r, self._wake_w = socket.socketpair()  # wakes the accept loop when stopping
        node: StorageNode | None = None
        try:
            bound_port = self.tcp.getsockname()[1]
            adv = args.advertise
            if not adv:
                adv_host = host if host not in ("", "0.0.0.0", "::", "[::]") else socket.gethostname()
                adv = f"{adv_host}:{bound_port}"
            self.address = adv
            node = StorageNode(
                args.node_id or adv,
                parse_size(args.capacity),
                slab_size=parse_size(args.slab_size) if args.slab_size else None,
                keep_warm=parse_size(args.keep_warm, allow_zero=True),
                spill=args.spill,
            )
            self.limits = _limits(args, node.capacity)
            self.tls = _tls_context(args)
            if args.shm:
                self.uds_name = f"tq-dram-{node.instance}"
                self.uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.uds.bind("\0" + self.uds_name)
                self.uds.listen(128)
        except BaseException:
            self._close_sockets()
            if node is not None:
                node.close()  # removes the spill directory it made
            raise
        self.node = node
        # a cluster client on a Redis Cluster; no reconnect loop: the heartbeat retries by itself
        self.redis = connections.sync_client(args.redis, reconnect=False, socket_timeout=5, socket_connect_timeout=5)
        self.key = storage_nodes_key(args.namespace)
        self.started = time.time()
        self.registered = False
        self._sessions: dict[_Session, threading.Thread] = {}
        self._sessions_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def info(self, now: float) -> dict[str, Any]:
        """The registration written to Redis: address, capacity and usage, heartbeat time, ..."""
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
            "tls": self.tls is not None,
            "version": PROTOCOL_VERSION,
        }

    def beat(self) -> dict[str, Any]:
        """Write the registration (with Redis's clock, so clients on other hosts agree on staleness)."""
        sec, usec = self.redis.time()
        info = self.info(sec + usec / 1e6)
        self.redis.hset(self.key, self.node.node_id, json.dumps(info))
        self.registered = True
        return info

    def start(self, parent_fd: int | None = None) -> None:
        """Start the heartbeat and accept threads (and the parent watch when ``parent_fd`` is given)."""
        loops = ((self._heartbeat_loop, "dram-heartbeat"), (self._accept_loop, "dram-accept"),
                 (self._reap_loop, "dram-reaper"))  # fmt: skip
        for target, name in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)  # close() waits for these
        if parent_fd is not None:
            threading.Thread(target=self._watch_parent, args=(parent_fd,), name="dram-parent", daemon=True).start()

    def _heartbeat_loop(self) -> None:
        """Beat every ``--heartbeat-s``; while Redis is unreachable, retry every ``RETRY_S``.

        So the node is back in the registry within ``RETRY_S`` of Redis returning (even after
        an outage longer than the clients' liveness window, or a restart that lost the registry),
        rather than a whole heartbeat period later.
        """
        failing = False
        while not self.stop.wait(min(RETRY_S, self.args.heartbeat_s) if failing else self.args.heartbeat_s):
            try:
                self.beat()
                if failing:
                    log.warning("heartbeat to Redis restored")
                failing = False
            except redis.RedisError as exc:
                if not failing:
                    log.warning("heartbeat to Redis failed (will keep trying): %s", exc)
                failing = True

    def _reap_loop(self) -> None:
        """Close connections that have not completed their handshake within ``--handshake-timeout``.

        The socket timeout bounds each wait for bytes; this bounds the whole handshake, so a peer
        that trickles a byte at a time cannot hold a session thread.
        """
        period = max(0.05, min(1.0, self.limits.handshake_s / 4))
        while not self.stop.wait(period):
            cutoff = time.monotonic() - self.limits.handshake_s
            with self._sessions_lock:
                late = [s for s in self._sessions if not s.authed and s.started < cutoff]
            for session in late:
                log.warning("closing connection from %s: no HELLO within the handshake timeout", session.peer)
                session.end(now=True)

    def _deregister(self) -> None:
        if not self.registered:
            return
        try:
            raw = self.redis.hget(self.key, self.node.node_id)
            if raw and json.loads(raw).get("instance") == self.node.instance:
                self.redis.hdel(self.key, self.node.node_id)
        except (redis.RedisError, ValueError) as exc:
            log.warning("could not deregister from Redis: %s", exc)

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        sel.register(self.tcp, selectors.EVENT_READ, False)
        if self.uds is not None:
            sel.register(self.uds, selectors.EVENT_READ, True)
        with sel:
            while not self.stop.is_set():
                for key, _ev in sel.select():
                    if key.data is None or self.stop.is_set():
                        return
                    try:
                        conn, addr = key.fileobj.accept()  # type: ignore[union-attr]
                    except OSError:
                        continue
                    self._serve(conn, local=bool(key.data), peer=_peer(addr, bool(key.data)))

    def _serve(self, conn: socket.socket, local: bool, peer: str = "?") -> None:
        """Start a session thread for an accepted connection (TLS, if on, is set up in that thread)."""
        if not local:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(conn)
        session = _Session(
            self.node, conn, local, self.token, self.uds is not None, self.limits,
            tls=None if local else self.tls, peer=peer,
        )  # fmt: skip
        thread = threading.Thread(target=self._run_session, args=(session,), name="dram-session", daemon=True)
        with self._sessions_lock:
            self._sessions[session] = thread
        thread.start()

    def _run_session(self, session: _Session) -> None:
        try:
            session.run()
        finally:
            with self._sessions_lock:
                self._sessions.pop(session, None)

    def _watch_parent(self, fd: int) -> None:
        """Stop when the parent that spawned us goes away (its end of the pipe closes)."""
        with contextlib.suppress(OSError):
            while os.read(fd, 1):
                pass
        log.warning("parent process exited; stopping")
        self.stop.set()

    def _end_sessions(self) -> None:
        """Let every session finish the request it is serving, then wait for its thread."""
        with self._sessions_lock:
            running = dict(self._sessions)
        for session in running:
            session.end()
        deadline = time.monotonic() + DRAIN_S
        for thread in running.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [s for s, t in running.items() if t.is_alive()]
        if late:
            log.warning("%d request(s) still running after %.0f s; closing their connections", len(late), DRAIN_S)
            for session in late:
                session.end(now=True)
            for session in late:
                running[session].join(1.0)

    def _close_sockets(self) -> None:
        for s in (self.tcp, self.uds, self._wake_r, self._wake_w):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        """Stop in order: accepting, sessions, heartbeat, registration; then free memory and spill files."""
        self.stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        for thread in self._threads:  # accept returns on the wake byte, heartbeat on the event
            thread.join()
        self._close_sockets()  # no new connections from here on
        self._end_sessions()
        self._deregister()  # after the heartbeat's last beat, which would register the node again
        self.node.close()  # no request is using the memory or the spill tier any more
        self.redis.close()


#: while Redis is unreachable, the heartbeat is retried this often
RETRY_S = 0.1


def _peer(addr: Any, local: bool) -> str:
    """How logs name a connection's peer."""
    if local:
        return "a local client (unix socket)"
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)


def _keepalive(conn: socket.socket) -> None:
    """TCP keepalive, so a peer whose host vanished (a half-open connection) is noticed in ~1 min."""
    with contextlib.suppress(OSError, AttributeError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def default_max_frame(capacity: int) -> int:
    """``--max-frame`` by default: the node's capacity (no put can be larger), at least 64 MiB."""
    return max(capacity, 64 << 20)


def _limits(args: argparse.Namespace, capacity: int) -> Limits:
    """The connection limits from the command line (sizes parsed, timeouts checked)."""
    max_frame = parse_size(args.max_frame) if args.max_frame else default_max_frame(capacity)
    for name in ("handshake_timeout", "io_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if not args.idle_timeout >= 0:
        raise ValueError("--idle-timeout must be >= 0 seconds (0: never)")
    return Limits(
        max_frame=max_frame,
        max_header=MAX_HEADER,
        handshake_s=args.handshake_timeout,
        io_s=args.io_timeout,
        idle_s=args.idle_timeout,
    )


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The TCP listener's TLS context, from ``--tls-cert``/``--tls-key`` (None: plain TCP)."""
    if not args.tls_cert and not args.tls_key:
        return None
    if not args.tls_cert:
        raise ValueError("--tls-key needs --tls-cert (the certificate chain, PEM)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(args.tls_cert, args.tls_key or None)
    ctx.num_tickets = 0  # no session resumption: nothing unasked on an idle connection
    return ctx


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
    p.add_argument(
        "--max-frame",
        default=None,
        help="largest request payload accepted from an authenticated client (default: --capacity, "
        "at least 64MiB); before its HELLO a connection may send only a HELLO of at most 8 KiB",
    )
    p.add_argument(
        "--handshake-timeout", type=float, default=10.0,
        help="seconds a connection has to complete TLS and its HELLO (default 10)",
    )  # fmt: skip
    p.add_argument(
        "--io-timeout", type=float, default=30.0,
        help="seconds an authenticated connection may stall mid-message before it is closed (default 30)",
    )  # fmt: skip
    p.add_argument(
        "--idle-timeout", type=float, default=0.0,
        help="close authenticated connections idle this many seconds between requests (default 0: never)",
    )  # fmt: skip
    p.add_argument("--tls-cert", default=None, help="PEM certificate (chain): serve TCP clients over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (if not in that file)")
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
    server.start(args.parent_fd)
    log.info(
        "storage node %s listening on %s (capacity %s, shared memory %s, TLS %s, max frame %s)",
        info["node_id"], server.address, format_size(server.node.capacity),
        "on" if server.uds is not None else "off", "on" if server.tls is not None else "off",
        format_size(server.limits.max_frame),
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


# The launcher lived in this module; its names stay importable from here without this module
# (which runs inside every node process) importing it.
_LAUNCHER_NAMES = frozenset({"LocalNodes", "NodeProcess", "spawn_node", "start_local_nodes"})


def __getattr__(name: str) -> Any:
    if name in _LAUNCHER_NAMES:
        from tq_redis.backends import dram_launcher

        return getattr(dram_launcher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
