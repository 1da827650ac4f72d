"""The delaying proxy of P13 holds every byte for its delay each way and counts round trips right."""

from __future__ import annotations

import socket
import threading
import time

from benchmarks.delayproxy import Counts, DelayProxy
from benchmarks.p13_rtt import rtts, turns_between


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    """A loopback server that echoes each read back at once, until its client closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def _exchange(sock: socket.socket, payload: bytes) -> float:
    t0 = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += sock.recv(65536)
    assert got == payload
    return time.perf_counter() - t0


def test_each_round_trip_takes_at_least_twice_the_delay_and_is_counted_once():
    listener, _ = _echo_server()
    delay = 0.02  # large against scheduling noise: the floor is what is checked, never a ceiling
    with DelayProxy(listener.getsockname()[:2], delay) as proxy:
        sock = socket.create_connection(("127.0.0.1", proxy.port))
        before = proxy.counts()
        elapsed = [_exchange(sock, b"x" * n) for n in (1, 1000, 200_000)]
        assert min(elapsed) >= 2 * delay
        after = proxy.counts()
        assert (after - before).turns == 3  # a 200 kB request arrives in many reads: still one turn
        assert (after - before).bytes_up == (after - before).bytes_down == 201_001
        proxy.delay_s = 0.0
        assert _exchange(sock, b"y") < 2 * delay * 50  # the delay is off at once (and it still forwards)
        assert proxy.counts().turns == after.turns + 1
        sock.close()
    listener.close()


def test_turns_between_splits_redis_from_the_busiest_node():
    before = [Counts(10, 1, 0, 0), Counts(0, 1, 0, 0), Counts(5, 1, 0, 0), Counts(2, 1, 0, 0)]
    after = [Counts(12, 1, 0, 0), Counts(2, 1, 0, 0), Counts(6, 1, 0, 0), Counts(2, 1, 0, 0)]
    assert turns_between(before, after) == {"redis": 2, "nodes": 3, "max_node": 2, "nodes_reached": 2}
    assert rtts(0.0031, 0.0011, 0.0005) == 4.0
