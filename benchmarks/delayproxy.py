"""A loopback TCP proxy that delays every byte by a fixed time each way and counts round trips.

:class:`DelayProxy` listens on ``127.0.0.1``, opens one upstream connection per client connection
and forwards both ways. Each direction has a reader thread, which stamps what it reads with the
time it is due (arrival + ``delay_s``), and a writer thread, which sends it then: the link behaves
like a network path with a one-way latency of ``delay_s`` (0.25 ms each way: a 0.5 ms round trip)
and unlimited bandwidth; what is sent back to back stays back to back (a delay, not a queue).

It also counts *turns* (:attr:`DelayProxy.turns`): on each connection, a client-to-server burst
that follows a reply (or opens the connection) is one round trip, however many reads it takes
and however many commands a pipeline puts in it. Counting the turns of a proxy in front of
Redis and of each storage node around one call says how many round trips the call made to each.

Its thread wake-ups add to the delay on a loaded machine: measure the round trip it really adds
(a PING through it against one without the delay) instead of assuming ``2 * delay_s``.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from dataclasses import dataclass

__all__ = ["DelayProxy", "Counts"]

CHUNK = 1 << 20


@dataclass(frozen=True)
class Counts:
    """What a proxy has carried so far (subtract two readings to get what happened between)."""

    turns: int
    connections: int
    bytes_up: int
    bytes_down: int

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.turns - other.turns,
            self.connections - other.connections,
            self.bytes_up - other.bytes_up,
            self.bytes_down - other.bytes_down,
        )


class _Direction:
    """One direction of one connection: bytes stamped with when they are due, sent on time."""

    def __init__(self, proxy: DelayProxy, pair: _Pair, src: socket.socket, dst: socket.socket, up: bool) -> None:
        self.proxy, self.pair, self.src, self.dst, self.up = proxy, pair, src, dst, up
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.eof = False
        name = "up" if up else "down"
        self.threads = [
            threading.Thread(target=self._read, daemon=True, name=f"delayproxy-{name}-read"),
            threading.Thread(target=self._write, daemon=True, name=f"delayproxy-{name}-write"),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(CHUNK)
                if not data:
                    break
                self.proxy._count(self.pair, self.up, len(data))
                with self.cond:
                    self.queue.append((time.perf_counter() + self.proxy.delay_s, data))
                    self.cond.notify()
        except OSError:
            pass
        with self.cond:
            self.eof = True
            self.cond.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.eof:
                        self.cond.wait()
                    if not self.queue:
                        break
                    due = self.queue[0][0]
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                now = time.perf_counter()
                ready: list[bytes] = []
                with self.cond:  # everything due by now goes in one send, as a network would deliver it
                    while self.queue and self.queue[0][0] <= now:
                        ready.append(self.queue.popleft()[1])
                if ready:
                    self.dst.sendall(b"".join(ready) if len(ready) > 1 else ready[0])
            with contextlib.suppress(OSError):
                self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            self.pair.close()


class _Pair:
    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.last_up = False  # the last bytes seen went client -> server
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class DelayProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` (``(host, port)``), ``delay_s`` late each way.

    ``delay_s`` may be changed while it runs (0: forward at once, the proxy's own cost alone).
    Use it as a context manager or call :meth:`close`.
    """

    def __init__(self, target: tuple[str, int], delay_s: float = 0.25e-3, port: int = 0) -> None:
        self.target = target
        self.delay_s = float(delay_s)
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._turns = self._connections = self._up = self._down = 0
        self._stopping = False
        self._accepter = threading.Thread(target=self._accept, daemon=True, name="delayproxy-accept")
        self._accepter.start()

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``: what a client dials instead of the target."""
        return f"127.0.0.1:{self.port}"

    def url(self, url: str) -> str:
        """A ``redis://[auth@]host:port[/db]`` URL with its host and port replaced by the proxy's."""
        scheme, rest = url.split("://", 1)
        hostport, sep, tail = rest.partition("/")
        auth, at, _ = hostport.rpartition("@")
        return f"{scheme}://{auth}{at}{self.address}{sep}{tail}"

    @property
    def turns(self) -> int:
        """Round trips so far, summed over its connections (see the module docstring)."""
        return self.counts().turns

    def counts(self) -> Counts:
        """A reading of the counters."""
        with self._lock:
            return Counts(self._turns, self._connections, self._up, self._down)

    def _count(self, pair: _Pair, up: bool, nbytes: int) -> None:
        with self._lock:
            if up:
                self._up += nbytes
                if not pair.last_up:
                    self._turns += 1
            else:
                self._down += nbytes
            pair.last_up = up

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._stopping:
                client.close()
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs.append(pair)
                self._connections += 1
            _Direction(self, pair, client, upstream, up=True).start()
            _Direction(self, pair, upstream, client, up=False).start()

    def close(self) -> None:
        """Stop accepting and cut every connection."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            pair.close()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_port() -> int:
    """A TCP port on loopback that nothing listened on a moment ago (for a server started next)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]
