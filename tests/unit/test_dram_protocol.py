"""The DRAM wire's gathered send: pieces of bounded size, every byte once, in order."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_redis.backends.dram.protocol import MAX_IOV, SEND_PIECE, send_buffers


class _Recording:
    """A socket stand-in that records each sendmsg and accepts at most ``cap`` bytes of it."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.calls: list[list[int]] = []
        self.out = bytearray()

    def sendmsg(self, bufs, anc=None):  # noqa: ANN001 - socket.sendmsg's shape
        self.calls.append([len(b) for b in bufs])
        room = self.cap
        for b in bufs:
            part = bytes(memoryview(b)[:room])
            self.out += part
            room -= len(part)
            if not room:
                break
        return self.cap - room


def _send_and_check(sizes: list[int], cap: int) -> None:
    rng = np.random.default_rng(len(sizes))
    bufs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    sock = _Recording(cap)
    send_buffers(sock, list(bufs))
    assert bytes(sock.out) == b"".join(bufs)
    for call in sock.calls:
        assert sum(call) <= SEND_PIECE and len(call) <= MAX_IOV


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * SEND_PIECE // 2), min_size=1, max_size=12),
    cap=st.sampled_from([4093, SEND_PIECE // 3, SEND_PIECE, 1 << 30]),
)
def test_each_sendmsg_is_given_at_most_a_piece_and_the_bytes_arrive_in_order(sizes, cap) -> None:
    _send_and_check(sizes, cap)


# A socket taking a byte or a few a call resumes mid-buffer at every offset; small sends keep
# this to thousands of calls (megabytes a byte at a time took minutes).
@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 2000), min_size=1, max_size=12), cap=st.sampled_from([1, 7]))
def test_a_socket_taking_a_few_bytes_a_call_still_gets_every_byte_in_order(sizes, cap) -> None:
    _send_and_check(sizes, cap)


def test_many_small_buffers_are_cut_by_count_too() -> None:
    bufs = [bytes([i % 256]) for i in range(3 * MAX_IOV + 5)]
    sock = _Recording(1 << 30)
    send_buffers(sock, list(bufs))
    assert [len(c) for c in sock.calls] == [MAX_IOV, MAX_IOV, MAX_IOV, 5]
    assert bytes(sock.out) == b"".join(bufs)


@pytest.mark.parametrize("total", [SEND_PIECE - 1, 5 * SEND_PIECE + 17])
def test_a_large_gathered_send_arrives_whole_over_a_real_socket(total: int) -> None:
    a, b = socket.socketpair()
    data = np.random.default_rng(total).integers(0, 256, total, dtype=np.uint8).tobytes()
    bufs = [memoryview(data)[i : i + 40_000] for i in range(0, total, 40_000)]
    got = bytearray()

    def read() -> None:
        while len(got) < total:
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        send_buffers(a, bufs)
        reader.join(timeout=30)
    finally:
        a.close()
        b.close()
    assert bytes(got) == data
