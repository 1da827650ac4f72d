"""A DRAM storage node process: serves a :class:`~tq_redis.backends.dram_node.StorageNode` over sockets.

Run one with ``python -m tq_redis.backends.dram_server --redis URL --capacity 4GiB`` (or
``tq-redis storage-unit``). It registers itself in Redis (``<ns>:storage:nodes``), heartbeats
every second with its used bytes, and deregisters on SIGTERM / SIGINT.

Same-host clients connect over an abstract Unix socket and receive slab fds (``SCM_RIGHTS``); they
write values straight into reserved extents and read them in place. Remote clients use TCP, and
the node moves payloads between the socket and its slabs with scatter/gather syscalls. The wire
protocol lives in :mod:`tq_redis.backends.dram_protocol`; each connection is a :class:`_Session`
served by its own thread.

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
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis
from tq_redis.backends.dram_node import Refused, StorageNode, Txn
from tq_redis.backends.dram_protocol import (
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
    drain,
    format_size,
    recv_header,
    recv_into_buffers,
    recv_meta,
    send_frame,
)

from tq_redis.config import parse_size
from tq_redis.keys import storage_nodes_key

log = logging.getLogger("tq_redis.dram_server")

# LocalNodes, spawn_node and start_local_nodes resolve through __getattr__ (see the end of the module)
__all__ = ["LocalNodes", "StorageNode", "main", "spawn_node", "start_local_nodes"]  # noqa: F822

#: how long a stopping node waits for its sessions to finish the requests they are serving
DRAIN_S = 5.0


class _Session:
    """One client connection, served by its own thread."""

    def __init__(self, node: StorageNode, sock: socket.socket, local: bool, token: str | None, shm: bool):
        self.node, self.sock, self.local = node, sock, local
        self.token = token
        self.shm_ok = shm and local
        self.shm = False
        self.authed = token is None
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
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on this socket

    def _begin(self) -> bool:
        with self._state:
            self._busy = not self._ending
            return self._busy

    def _done(self) -> bool:
        with self._state:
            self._busy = False
            return not self._ending

    def run(self) -> None:
        """Serve requests until the client disconnects or :meth:`end` is called."""
        sock = self.sock
        try:
            while True:
                try:
                    op, mlen, plen, _fds = recv_header(sock)
                except (ConnectionError, OSError):
                    return
                if not self._begin():
                    return
                meta = recv_meta(sock, mlen)
                try:
                    self._dispatch(op, meta, plen)
                except Refused as exc:
                    send_frame(sock, exc.code, {"msg": str(exc)})
                if not self._done():
                    return
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
            raise Refused(
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
            raise Refused(ST_BAD, f"request {op} carries no payload")
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
                    raise Refused(ST_BAD, f"unknown transaction {t} (reservation lost?)")
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
        raise Refused(ST_BAD, f"unknown request {op}")

    def _hello(self, meta: dict[str, Any]) -> None:
        node = self.node
        if meta.get("v") != PROTOCOL_VERSION:
            raise Refused(ST_BAD, f"protocol version {meta.get('v')} is not {PROTOCOL_VERSION}")
        if self.token is not None:
            given = meta.get("token") or ""
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
            self.sock, ST_OK, {"node_id": node.node_id, "instance": node.instance, "shm": self.shm}
        )

    def _batch(self, meta: dict[str, Any]) -> tuple[list[str], np.ndarray]:
        keys = meta.get("keys")
        sizes = np.frombuffer(meta.get("sizes") or b"", dtype="<i8")
        if not isinstance(keys, list) or len(keys) != len(sizes) or (sizes < 0).any():
            raise Refused(ST_BAD, "malformed put: keys and sizes disagree")
        if len(set(keys)) != len(keys):
            raise Refused(ST_BAD, "put got the same key twice in one batch")
        return keys, sizes

    def _put(self, meta: dict[str, Any], plen: int) -> None:
        try:
            keys, sizes = self._batch(meta)
            if int(sizes.sum()) != plen:
                raise Refused(ST_BAD, "malformed put: payload length is not the sum of the sizes")
            txn = self.node.reserve(keys, sizes)
        except Refused:
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
        keys = meta.get("keys")
        if not isinstance(keys, list):
            raise Refused(ST_BAD, "malformed get: no keys")
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
        self.redis = redis.Redis.from_url(args.redis, socket_timeout=5, socket_connect_timeout=5)
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
        for target, name in ((self._heartbeat_loop, "dram-heartbeat"), (self._accept_loop, "dram-accept")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)  # close() waits for these
        if parent_fd is not None:
            threading.Thread(target=self._watch_parent, args=(parent_fd,), name="dram-parent", daemon=True).start()

    def _heartbeat_loop(self) -> None:
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
                        conn, _addr = key.fileobj.accept()  # type: ignore[union-attr]
                    except OSError:
                        continue
                    self._serve(conn, local=bool(key.data))

    def _serve(self, conn: socket.socket, local: bool) -> None:
        """Start a session thread for an accepted connection."""
        if not local:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = _Session(self.node, conn, local, self.token, self.uds is not None)
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
    server.start(args.parent_fd)
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
