"""A fault-injecting loopback TCP proxy: put it between clients and Redis (or a storage node).

:class:`FaultProxy` listens on ``127.0.0.1``, opens one upstream connection per client connection
and forwards bytes both ways with two threads per connection. On command it

* drops a connection after forwarding a request and before forwarding its reply
  (:meth:`FaultProxy.drop_reply_after`: the next request whose bytes contain a marker, such as
  ``b"tq_insert"``, reaches the server; its reply never reaches the client, whose connection is cut);
* delays every reply (:meth:`FaultProxy.delay_replies`);
* cuts connections mid-stream at random (:meth:`FaultProxy.cut_randomly`): each chunk, either way,
  is with some probability forwarded only in part and the connection closed.

Counters (:attr:`FaultProxy.dropped`, :attr:`FaultProxy.cuts`) say what it did, so a test can
check that the fault it asked for happened. Nothing here sleeps to synchronise: a drop is decided
by the bytes that pass.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from dataclasses import dataclass, field

CHUNK = 256 * 1024


@dataclass
class _Pair:
    client: socket.socket
    upstream: socket.socket
    doomed: bool = False  # a request was forwarded whose reply must not be
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

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


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` (``(host, port)``), injecting faults on command."""

    def __init__(self, target: tuple[str, int], seed: int = 0) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._drops: list[bytes] = []  # markers of requests whose replies are to be dropped, in order
        self._delay_s = 0.0
        self._cut_p = 0.0
        self._random = random.Random(seed)
        self._stopping = False
        self.dropped = 0
        self.cuts = 0
        self.connections = 0
        self._accepter = threading.Thread(target=self._accept, daemon=True, name="faultproxy-accept")
        self._accepter.start()

    @classmethod
    def for_url(cls, url: str, seed: int = 0) -> FaultProxy:
        """A proxy in front of the server of a ``redis://host:port[/db]`` URL."""
        hostport = url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
        host, _, port = hostport.rpartition(":")
        return cls((host, int(port)), seed)

    def url(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's."""
        scheme, rest = url.split("://", 1)
        hostport, sep, tail = rest.partition("/")
        creds = hostport.rsplit("@", 1)[0] + "@" if "@" in hostport else ""
        return f"{scheme}://{creds}127.0.0.1:{self.port}{sep}{tail}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ commands

    def drop_reply_after(self, marker: bytes, times: int = 1) -> None:
        """The next ``times`` requests containing ``marker`` reach the server; their connections are
        cut before their replies are forwarded."""
        with self._lock:
            self._drops.extend([marker] * times)

    def pending_drops(self) -> int:
        with self._lock:
            return len(self._drops)

    def delay_replies(self, seconds: float) -> None:
        """Hold every chunk from the server ``seconds`` before forwarding it (0: no delay)."""
        self._delay_s = seconds

    def cut_randomly(self, probability: float) -> None:
        """Cut each connection mid-chunk with ``probability`` per forwarded chunk (0: never)."""
        self._cut_p = probability

    def cut_all(self) -> None:
        """Close every open connection now."""
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            pair.close()

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (a close alone does not)
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut_all()
        self._accepter.join(5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ forwarding

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs = [p for p in self._pairs if not p.closed] + [pair]
                self.connections += 1
            threading.Thread(target=self._pump, args=(pair, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(pair, False), daemon=True).start()

    def _cut_at(self, n: int) -> int | None:
        """Where to cut a chunk of ``n`` bytes (None: forward it whole)."""
        if self._cut_p <= 0:
            return None
        with self._lock:
            if self._random.random() >= self._cut_p:
                return None
            self.cuts += 1
            return self._random.randrange(0, n)

    def _pump(self, pair: _Pair, to_server: bool) -> None:
        src, dst = (pair.client, pair.upstream) if to_server else (pair.upstream, pair.client)
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                if to_server:
                    with self._lock:
                        if self._drops and self._drops[0] in data:
                            self._drops.pop(0)
                            pair.doomed = True
                else:
                    if pair.doomed:  # the reply of the marked request: never forwarded
                        with self._lock:
                            self.dropped += 1
                        break
                    if self._delay_s > 0:
                        time.sleep(self._delay_s)  # the fault asked for, not a synchronisation
                cut = self._cut_at(len(data))
                if cut is not None:
                    if cut:
                        dst.sendall(data[:cut])
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            pair.close()
