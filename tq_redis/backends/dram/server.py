"""A DRAM storage node process: serves a :class:`~tq_redis.backends.dram.node.StorageNode` over sockets.

Run one with ``python -m tq_redis.backends.dram.server --redis URL --capacity 4GiB`` (or
``tq-redis storage-unit``). It registers itself in Redis (``<ns>:storage:nodes``), heartbeats
every second with its used bytes, and deregisters on SIGTERM / SIGINT. With each heartbeat it runs
the deletes clients recorded for it while it was unreachable (``<ns>:storage:pending:<node id>``),
so a clear that ran while the node was paused or cut off frees its memory once it is back.

Same-host clients connect over an abstract Unix socket and receive slab fds (``SCM_RIGHTS``); they
write values straight into reserved extents and read them in place. Remote clients use TCP, and
the node moves payloads between the socket and its slabs with scatter/gather syscalls. The wire
protocol lives in :mod:`tq_redis.backends.dram.protocol`; each connection is a
:class:`~tq_redis.backends.dram.session.Session` served by its own thread, and its requests are
handled by :mod:`tq_redis.backends.dram.handlers`. This module is the process: the listeners,
accepting connections, the Redis registration and heartbeat, orderly stopping, the command line.

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

Spawning nodes from Python (``tq-redis up``, ``init()``, tests) is :mod:`tq_redis.backends.dram.launcher`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import secrets
import selectors
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from tq_redis.backends.dram.node import StorageNode
from tq_redis.backends.dram.protocol import MAX_HEADER, PROTOCOL_VERSION
from tq_redis.backends.dram.session import Admission, Limits, Session
from tq_redis.meta.keys import pending_deletes_key, pending_nodes_key, storage_epoch_key, storage_nodes_key
from tq_redis.redact import redact
from tq_redis.server import connections
from tq_redis.server import identity as ns_identity
from tq_redis.settings import settings
from tq_redis.units import format_size, parse_size

log = logging.getLogger(__name__)

__all__ = ["StorageNode", "main"]

#: how long a stopping node waits for its sessions to finish the requests they are serving
DRAIN_S = 5.0


class _Server:
    """A node process: listeners, sessions, the Redis registration and its heartbeat."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stop = threading.Event()
        self.token: str | None = args.token or settings.storage_token
        # what a client must present in its HELLO: a fresh random secret, published only in this
        # namespace's registry, so only users that may read the namespace's keys in Redis get in
        self.access = secrets.token_urlsafe(32)
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
        # the epoch of the namespace this node serves (tq_redis.server.identity): followed while the
        # namespace has one, kept while it has none (Redis lost it: the registration says so)
        self.epoch: str | None = None
        self._epoch_unreadable = False
        self._epoch_missing = False
        self._drain_failed = False
        self._sessions: dict[Session, threading.Thread] = {}
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
            "access": self.access,
            "auth": self.token is not None,
            "tls": self.tls is not None,
            "version": PROTOCOL_VERSION,
        }

    def beat(self) -> dict[str, Any]:
        """Write the registration (with Redis's clock, so clients on other hosts agree on staleness),
        then run the deletes recorded for this node while it was unreachable."""
        sec, usec = self.redis.time()
        self._follow_epoch()
        info = self.info(sec + usec / 1e6)
        if self.epoch is not None:
            info[ns_identity.FIELD] = self.epoch
        self.redis.hset(self.key, self.node.node_id, json.dumps(info))
        self.registered = True
        try:
            self.drain_pending()
        except redis.RedisError as exc:  # e.g. an ACL user from before pending deletes: keep beating
            if not self._drain_failed:
                log.warning("cannot run the deletes recorded for this node in Redis (%s); its cleared "
                            "values stay in memory until it restarts", exc)
            self._drain_failed = True
        return info

    def _follow_epoch(self) -> None:
        """Take the namespace's epoch from ``<ns>:storage:epoch`` when it has one (a checkpoint
        loaded after a loss gives it a new one); none there: keep the last one known."""
        try:
            epoch = ns_identity.text(self.redis.get(storage_epoch_key(self.args.namespace)))
        except redis.ResponseError as exc:  # an ACL user from before the epoch: register without it
            if not self._epoch_unreadable:
                log.warning("cannot read the namespace's epoch (%s); this node registers without it", exc)
            self._epoch_unreadable = True
            return
        if epoch is None:
            if self.epoch is not None and self.registered and not self._epoch_missing:
                self._epoch_missing = True
                log.warning("namespace %r has no epoch in Redis any more (its state was lost?): this node keeps "
                            "registering under epoch %s, so clients that attach are refused", self.args.namespace,
                            self.epoch)
            return
        self._epoch_missing = False
        if self.epoch is not None and epoch != self.epoch:
            log.warning("namespace %r has a new epoch %s (was %s): serving it", self.args.namespace, epoch, self.epoch)
        self.epoch = epoch

    def drain_pending(self) -> int:
        """Delete the keys clients could not delete here while this node was unreachable; returns
        how many were present. Each entry is taken off the list before its keys are deleted: if
        the node dies in between, its memory (and those values) is gone anyway."""
        pending = pending_deletes_key(self.args.namespace, self.node.node_id)
        deleted = 0
        while True:
            entries = self.redis.lpop(pending, PENDING_BATCH)
            if not entries:
                return deleted
            for entry in entries:
                keys = entry.decode(errors="replace").split("\n")
                deleted += self.node.delete(keys)
            if deleted:
                log.info("ran %d delete(s) recorded while this node was unreachable", deleted)

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
        """Leave the registry (if no newer run of this node id took the entry over), and drop the
        deletes recorded for this node: its memory goes with it."""
        if not self.registered:
            return
        try:
            raw = self.redis.hget(self.key, self.node.node_id)
            if raw and json.loads(raw).get("instance") == self.node.instance:
                self.redis.hdel(self.key, self.node.node_id)
                self.redis.delete(pending_deletes_key(self.args.namespace, self.node.node_id))
                self.redis.srem(pending_nodes_key(self.args.namespace), self.node.node_id)
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
        session = Session(
            self.node, conn, local, Admission(self.args.namespace, self.access, self.token),
            self.uds is not None, self.limits, tls=None if local else self.tls, peer=peer,
        )  # fmt: skip
        thread = threading.Thread(target=self._run_session, args=(session,), name="dram-session", daemon=True)
        with self._sessions_lock:
            self._sessions[session] = thread
        thread.start()

    def _run_session(self, session: Session) -> None:
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
#: entries of the pending-deletes list taken per LPOP
PENDING_BATCH = 16


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
    p.add_argument(
        "--redis", default=settings.redis_url,
        help="Redis/Valkey URL of the metadata plane (default: $TQ_REDIS_URL, which keeps a password in it "
        "off the command line, where every user of the host can read it)",
    )  # fmt: skip
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
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.redis:
        parser.error("pass --redis URL or set TQ_REDIS_URL")
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
        log.error("cannot register in Redis at %s: %s", redact(args.redis), exc)
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


if __name__ == "__main__":
    sys.exit(main())
