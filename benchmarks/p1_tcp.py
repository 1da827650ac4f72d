"""P1-TCP: the storage nodes' TCP path (what a client on another host does) against the socket limit.

Everything a client on another host would do runs here over loopback TCP with shared memory turned
off (``DramStore(shm=False)``): 64 MiB per operation, 1024 samples x 2 fields of 32 KiB values
(a small header plus the row, as the codec sends them), spread over 1, 2 and 4 storage nodes.
Put and get are timed separately.

The limit is measured in the same run with the same message sizes: plain Python sockets, one
receiver process per "node", the client moving the same 64 MiB split the same way (values of
32 KiB sent with ``sendmsg``, read with ``recv_into(MSG_WAITALL)`` into a preallocated buffer; one
thread per connection, as the store does per node). How much one send call is given changes the
speed on loopback by up to 2x, so the limit is the best of several sizes (``PIECES``: 256 KiB to
4 MiB per call, and everything in one call), each way on its own. Nothing is decoded, indexed or
stored there, so it is what loopback TCP and one Python process can do at best.

The two are timed in alternating rounds (limit then store, store then limit, ...; the sizes are
compared first), so both medians come from the same stretch of time: this machine's speed drifts
by up to 2x within minutes, and a limit timed before the store would move the share with it.

Reported per node count: GB/s (1e9 B/s) of put and get for both, and the store's share of the
limit (target >= 70%).

    python -m benchmarks.p1_tcp [--quick] [--iters 9] [--nodes 1,2,4]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks._common import parse_args, write_result

MEASURE = "p1_tcp"
N_SAMPLES, N_FIELDS, ROW = 1024, 2, 4096
VALUE = ROW * 8  # 32 KiB
HEADER = b"\0" * 16
TOTAL = N_SAMPLES * N_FIELDS * (VALUE + len(HEADER))
#: bytes per send call the limit tries (0: everything in one call); the store uses 1 MiB
PIECES = (256 << 10, 1 << 20, 2 << 20, 4 << 20, 0)
MAX_IOV = 1024  # buffers per sendmsg (Linux's IOV_MAX)


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--iters", type=int, default=None, help="timed repetitions, the median is reported (default 9, quick 2)"
    )
    parser.add_argument("--nodes", default="1,2,4", help="node counts to measure (default %(default)s)")


def _gbps(seconds: float, nbytes: int = TOTAL) -> float:
    return nbytes / seconds / 1e9


# ---------------------------------------------------------------------------- the socket limit


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _peer(port_out: Any, nbytes: int) -> None:
    """One plain "node": per round, receive ``nbytes`` (put) and acknowledge, then send ``nbytes``
    (get), until the client closes the connection."""
    server = socket.create_server(("127.0.0.1", 0))
    port_out.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    ask = bytearray(8)
    try:
        while True:
            _recv_exactly(conn, view)  # put
            conn.sendall(b"k")
            _recv_exactly(conn, memoryview(ask))  # the client asks for the get, in pieces of this size
            piece = int.from_bytes(ask, "little") or nbytes
            for start in range(0, nbytes, piece):
                conn.sendall(view[start : start + piece])
    except ConnectionError:  # the client is done
        pass
    finally:
        conn.close()
        server.close()


def _in_threads(fns: list[Callable[[], None]]) -> float:
    threads = [threading.Thread(target=fn) for fn in fns]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


class SocketLimit:
    """Plain sockets moving the same bytes as the store: one receiver process per "node", the
    client's side in one thread per connection. :meth:`put` and :meth:`get` time one 64 MiB
    round with ``piece`` bytes per send call (0: everything in one call)."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.share = TOTAL // nodes
        self.values_per_node = N_SAMPLES * N_FIELDS // nodes
        self.payload = memoryview(np.random.default_rng(0).integers(0, 255, ROW * 8, dtype=np.uint8).tobytes())
        self.procs: list[Any] = []
        self.socks: list[socket.socket] = []
        self.recv_bufs: list[memoryview] = []

    def __enter__(self) -> SocketLimit:
        ctx = mp.get_context("spawn")
        ports = ctx.Queue()
        self.procs = [ctx.Process(target=_peer, args=(ports, self.share), daemon=True) for _ in range(self.nodes)]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            s = socket.create_connection(("127.0.0.1", ports.get(timeout=60)))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(s)
        self.recv_bufs = [memoryview(bytearray(self.share)) for _ in self.socks]
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.socks:
            s.close()
        for p in self.procs:
            p.join(timeout=30)

    def put(self, piece: int) -> float:
        """Seconds to send the 64 MiB, each connection its share (``piece`` bytes per call)."""

        def put_to(sock: socket.socket) -> Callable[[], None]:
            def run() -> None:
                iov: list[memoryview | bytes] = []
                size = 0
                for _ in range(self.values_per_node):
                    iov += (HEADER, self.payload)
                    size += len(HEADER) + len(self.payload)
                    if len(iov) >= MAX_IOV or (piece and size >= piece):
                        _sendmsg_all(sock, iov)
                        iov, size = [], 0
                if iov:
                    _sendmsg_all(sock, iov)
                sock.recv(1)

            return run

        return _in_threads([put_to(s) for s in self.socks])

    def get(self, piece: int) -> float:
        """Seconds to receive the 64 MiB, the peers sending ``piece`` bytes per call."""

        def get_from(sock: socket.socket, buf: memoryview) -> Callable[[], None]:
            def run() -> None:
                sock.sendall(piece.to_bytes(8, "little"))
                _recv_exactly(sock, buf)

            return run

        return _in_threads([get_from(s, b) for s, b in zip(self.socks, self.recv_bufs, strict=True)])

    def best_pieces(self, iters: int) -> tuple[int, int, dict[str, dict[str, float]]]:
        """``(put piece, get piece, GB/s per piece)``: the send size of :data:`PIECES` with the best
        median of ``iters`` rounds (after a warm-up round), for each direction on its own."""
        by_piece: dict[int, tuple[float, float]] = {}
        for piece in PIECES:
            puts, gets = [], []
            for _ in range(iters + 1):
                puts.append(self.put(piece))
                gets.append(self.get(piece))
            by_piece[piece] = statistics.median(puts[1:]), statistics.median(gets[1:])
        put_piece = min(PIECES, key=lambda p: by_piece[p][0])
        get_piece = min(PIECES, key=lambda p: by_piece[p][1])
        table = {str(p): {"put": _gbps(t[0]), "get": _gbps(t[1])} for p, t in by_piece.items()}
        return put_piece, get_piece, table


def _sendmsg_all(sock: socket.socket, iov: list) -> None:
    """``sendmsg`` until every buffer of ``iov`` is sent (a partial send resumes mid-buffer)."""
    views = [memoryview(b).cast("B") for b in iov]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


# ---------------------------------------------------------------------------- the storage nodes


class StoreTCP:
    """``nodes`` DRAM storage nodes reached over TCP with shared memory off, holding nothing
    between rounds: :meth:`put` and :meth:`get` time one 64 MiB round each, and the next put
    starts after the values are deleted. Entering checks once that the round trip is exact."""

    def __init__(self, url: str, nodes: int) -> None:
        rng = np.random.default_rng(1)
        self.fields = [rng.integers(0, 1 << 40, (N_SAMPLES, ROW), dtype=np.int64) for _ in range(N_FIELDS)]
        self.keys: list[str] = []
        self.values: list[list] = []
        for f, data in enumerate(self.fields):
            mv = memoryview(data).cast("B")
            for i in range(N_SAMPLES):
                self.keys.append(f"p1tcp:{{p}}:d:{i}:f{f}")
                self.values.append([HEADER, mv[i * VALUE : (i + 1) * VALUE]])
        self.url, self.nodes = url, nodes
        self._stack = contextlib.ExitStack()
        self.store: Any = None

    def __enter__(self) -> StoreTCP:
        from tq_redis.backends.dram.launcher import start_local_nodes
        from tq_redis.backends.dram.store import DramStore

        namespace = f"p1tcp{self.nodes}"
        with contextlib.ExitStack() as stack:
            stack.enter_context(start_local_nodes(self.url, namespace, n=self.nodes, capacity="512MiB"))
            self.store = stack.enter_context(DramStore(self.url, namespace, shm=False))
            self.store.put(self.keys, self.values)
            back = self.store.get(self.keys)
            for f in range(N_FIELDS):
                rows = back[f * N_SAMPLES : (f + 1) * N_SAMPLES]
                got = np.stack([np.frombuffer(v, dtype=np.int64, offset=len(HEADER)) for v in rows])
                if not np.array_equal(got, self.fields[f]):
                    raise AssertionError("the TCP round trip corrupted data")
            del back
            self.store.delete(self.keys)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def put(self) -> float:
        t0 = time.perf_counter()
        self.store.put(self.keys, self.values)
        return time.perf_counter() - t0

    def get(self) -> float:
        """Seconds to read the values back; they are deleted afterwards, outside the timing."""
        t0 = time.perf_counter()
        got = self.store.get(self.keys)
        seconds = time.perf_counter() - t0
        del got
        self.store.delete(self.keys)
        return seconds


# ---------------------------------------------------------------------------- one node count


def _rates(put_s: float, get_s: float) -> dict[str, float]:
    """GB/s and milliseconds of one put and one get of the 64 MiB."""
    return {"put": _gbps(put_s), "get": _gbps(get_s), "put_ms": put_s * 1e3, "get_ms": get_s * 1e3}


def measure_nodes(url: str, nodes: int, iters: int) -> dict[str, Any]:
    """Both paths over ``nodes`` nodes, in alternating rounds.

    The limit's send sizes are compared first (:meth:`SocketLimit.best_pieces`). Then each of
    ``iters`` rounds (after a warm-up round) times the limit at its best sizes and the store, one
    after the other, in an order that alternates from round to round. Both medians come from the
    same stretch of time, so a machine that speeds up or slows down while the measure runs moves
    both of them, not their ratio.
    """
    with SocketLimit(nodes) as limit, StoreTCP(url, nodes) as store:
        put_piece, get_piece, by_piece = limit.best_pieces(max(1, iters // 3))
        rounds: dict[str, list[float]] = {"limit_put": [], "limit_get": [], "store_put": [], "store_get": []}

        def time_limit() -> None:
            rounds["limit_put"].append(limit.put(put_piece))
            rounds["limit_get"].append(limit.get(get_piece))

        def time_store() -> None:
            rounds["store_put"].append(store.put())
            rounds["store_get"].append(store.get())

        for r in range(iters + 1):
            for timed in (time_limit, time_store) if r % 2 == 0 else (time_store, time_limit):
                timed()
    med = {k: statistics.median(v[1:]) for k, v in rounds.items()}
    limit_row = {
        **_rates(med["limit_put"], med["limit_get"]),
        "put_piece": put_piece, "get_piece": get_piece, "by_piece": by_piece,
    }  # fmt: skip
    store_row = _rates(med["store_put"], med["store_get"])
    return {
        "limit": limit_row,
        "store": store_row,
        "put_share": store_row["put"] / limit_row["put"],
        "get_share": store_row["get"] / limit_row["get"],
        "rounds_ms": {k: [round(x * 1e3, 2) for x in v[1:]] for k, v in rounds.items()},
    }


def measure(node_counts: list[int], iters: int) -> dict[str, Any]:
    """Both paths for every node count (see :func:`measure_nodes`)."""
    from tq_redis.server.embedded import EmbeddedServer

    server = EmbeddedServer().start()
    out: dict[str, Any] = {}
    try:
        for nodes in node_counts:
            row = measure_nodes(server.url, nodes, iters)
            out[f"nodes_{nodes}"] = row
            store, limit = row["store"], row["limit"]
            print(
                f"[p1-tcp] {nodes} node(s): put {store['put']:.2f} GB/s of {limit['put']:.2f} "
                f"({row['put_share']:.0%}), get {store['get']:.2f} GB/s of {limit['get']:.2f} ({row['get_share']:.0%})",
                flush=True,
            )
    finally:
        server.stop()
    return out


def main() -> dict[str, Any]:
    """Measure and write the result (tq-redis against the socket limit; the reference has no TCP store path)."""
    args = parse_args(__doc__.splitlines()[0], _add_args)
    iters = args.iters or (2 if args.quick else 9)
    node_counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    params = {"iters": iters, "bytes": TOTAL, "values": N_SAMPLES * N_FIELDS, "value_bytes": VALUE + len(HEADER)}
    print(f"P1-TCP: {TOTAL / 2**20:.0f} MiB per operation over loopback TCP, nodes {node_counts}, median of {iters}")
    results = {"tq_redis": measure(node_counts, iters)} if "tq_redis" in args.systems else {}
    write_result(MEASURE, args, params, results, args.out)
    return results


if __name__ == "__main__":
    main()
