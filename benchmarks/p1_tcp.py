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

Reported per node count: GB/s (1e9 B/s) of put and get for both, and the store's share of the
limit (target >= 70%).

    python -m benchmarks.p1_tcp [--quick] [--iters 9] [--nodes 1,2,4]
"""

from __future__ import annotations

import argparse
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


def _peer(port_out: Any, nbytes: int, rounds: int) -> None:
    """One plain "node": per round, receive ``nbytes`` (put) and acknowledge, then send ``nbytes`` (get)."""
    server = socket.create_server(("127.0.0.1", 0))
    port_out.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    ask = bytearray(8)
    for _ in range(rounds):
        _recv_exactly(conn, view)  # put
        conn.sendall(b"k")
        _recv_exactly(conn, memoryview(ask))  # the client asks for the get, in pieces of this size
        piece = int.from_bytes(ask, "little") or nbytes
        for start in range(0, nbytes, piece):
            conn.sendall(view[start : start + piece])
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


def socket_limit(nodes: int, iters: int) -> dict[str, Any]:
    """Put and get GB/s of the same bytes over ``nodes`` plain connections (one receiver process
    each): for each direction the best median over the send sizes of :data:`PIECES`."""
    share = TOTAL // nodes
    values_per_node = N_SAMPLES * N_FIELDS // nodes
    payload = memoryview(np.random.default_rng(0).integers(0, 255, ROW * 8, dtype=np.uint8).tobytes())
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    rounds = len(PIECES) * (iters + 1)
    procs = [ctx.Process(target=_peer, args=(ports, share, rounds), daemon=True) for _ in range(nodes)]
    for p in procs:
        p.start()
    socks = []
    for _ in procs:
        s = socket.create_connection(("127.0.0.1", ports.get(timeout=60)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(s)
    recv_bufs = [memoryview(bytearray(share)) for _ in socks]

    def put_to(sock: socket.socket, piece: int) -> Callable[[], None]:
        def run() -> None:
            iov: list[memoryview | bytes] = []
            size = 0
            for _ in range(values_per_node):
                iov += (HEADER, payload)
                size += len(HEADER) + len(payload)
                if len(iov) >= MAX_IOV or (piece and size >= piece):
                    _sendmsg_all(sock, iov)
                    iov, size = [], 0
            if iov:
                _sendmsg_all(sock, iov)
            sock.recv(1)

        return run

    def get_from(sock: socket.socket, buf: memoryview, piece: int) -> Callable[[], None]:
        def run() -> None:
            sock.sendall(piece.to_bytes(8, "little"))
            _recv_exactly(sock, buf)

        return run

    by_piece: dict[int, tuple[float, float]] = {}
    try:
        for piece in PIECES:
            puts, gets = [], []
            for _ in range(iters + 1):
                puts.append(_in_threads([put_to(s, piece) for s in socks]))
                gets.append(_in_threads([get_from(s, b, piece) for s, b in zip(socks, recv_bufs, strict=True)]))
            by_piece[piece] = statistics.median(puts[1:]), statistics.median(gets[1:])
    finally:
        for s in socks:
            s.close()
        for p in procs:
            p.join(timeout=30)
    put_piece = min(PIECES, key=lambda p: by_piece[p][0])
    get_piece = min(PIECES, key=lambda p: by_piece[p][1])
    put, get = by_piece[put_piece][0], by_piece[get_piece][1]
    return {
        "put": _gbps(put), "get": _gbps(get), "put_ms": put * 1e3, "get_ms": get * 1e3,
        "put_piece": put_piece, "get_piece": get_piece,
        "by_piece": {str(p): {"put": _gbps(t[0]), "get": _gbps(t[1])} for p, t in by_piece.items()},
    }  # fmt: skip


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


def store_tcp(url: str, nodes: int, iters: int) -> dict[str, float]:
    """Put and get GB/s of 64 MiB through ``nodes`` DRAM storage nodes with shared memory off."""
    from tq_redis.backends.dram import DramStore
    from tq_redis.backends.dram_launcher import start_local_nodes

    rng = np.random.default_rng(1)
    fields = [rng.integers(0, 1 << 40, (N_SAMPLES, ROW), dtype=np.int64) for _ in range(N_FIELDS)]
    keys, values = [], []
    for f, data in enumerate(fields):
        mv = memoryview(data).cast("B")
        for i in range(N_SAMPLES):
            keys.append(f"p1tcp:{{p}}:d:{i}:f{f}")
            values.append([HEADER, mv[i * VALUE : (i + 1) * VALUE]])
    namespace = f"p1tcp{nodes}"
    with start_local_nodes(url, namespace, n=nodes, capacity="512MiB"), DramStore(url, namespace, shm=False) as store:
        store.put(keys, values)
        back = store.get(keys)
        for f in range(N_FIELDS):
            rows = back[f * N_SAMPLES : (f + 1) * N_SAMPLES]
            got = np.stack([np.frombuffer(v, dtype=np.int64, offset=len(HEADER)) for v in rows])
            if not np.array_equal(got, fields[f]):
                raise AssertionError("the TCP round trip corrupted data")
        del back
        store.delete(keys)
        puts, gets = [], []
        for _ in range(iters + 1):
            t0 = time.perf_counter()
            store.put(keys, values)
            t1 = time.perf_counter()
            got = store.get(keys)
            t2 = time.perf_counter()
            del got
            store.delete(keys)
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    put, get = statistics.median(puts[1:]), statistics.median(gets[1:])
    return {"put": _gbps(put), "get": _gbps(get), "put_ms": put * 1e3, "get_ms": get * 1e3}


def measure(node_counts: list[int], iters: int) -> dict[str, Any]:
    """Both paths for every node count, the limit first (same conditions, back to back)."""
    from tq_redis.embedded import EmbeddedServer

    server = EmbeddedServer().start()
    out: dict[str, Any] = {}
    try:
        for nodes in node_counts:
            limit = socket_limit(nodes, iters)
            store = store_tcp(server.url, nodes, iters)
            row = {
                "limit": limit,
                "store": store,
                "put_share": store["put"] / limit["put"],
                "get_share": store["get"] / limit["get"],
            }
            out[f"nodes_{nodes}"] = row
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
