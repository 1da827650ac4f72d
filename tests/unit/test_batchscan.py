"""A batch's segment sizes and key hashes (tq_redis.codec.batchscan): the native module and Python agree."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from tq_redis.backends.dram.placement import Ring, key_hashes
from tq_redis.backends.dram.values import PutValues
from tq_redis.codec import batchscan
from tq_redis.errors import InvalidArgument


@pytest.fixture(params=["native", "python"])
def impl(request, monkeypatch):
    """Run a test once through the native module and once through the Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(batchscan, "_native", None)
    return request.param


def test_the_native_module_is_built_by_the_install():
    # the README's setup compiles it; a broken build must fail here, not silently run slower
    assert batchscan.NATIVE, "tq_redis.codec._scan did not build: is a C compiler installed?"


def test_the_fallback_is_used_when_asked_for():
    code = "from tq_redis.codec import batchscan; print(batchscan.NATIVE)"
    env = {**os.environ, "TQ_NATIVE_SCAN": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def _scanned(values):
    got = batchscan.plain_segments(values)
    if got is None:
        return None
    flat, sizes, counts = got
    return [id(s) for s in flat], sizes.tolist(), counts.tolist()


def test_codec_pairs_and_tuples_are_read_in_one_pass(impl) -> None:
    payload = memoryview(np.arange(64, dtype=np.uint8))
    values = [[b"head", payload[:10]], (b"h2", payload[10:40], b""), [], [payload[40:]]]
    ids, sizes, counts = _scanned(values)
    assert ids == [id(s) for v in values for s in v]  # the caller's own objects, in order
    assert sizes == [4, 10, 2, 30, 0, 24]
    assert counts == [2, 3, 0, 1]
    assert _scanned([]) == ([], [], [])


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(b"bare bytes", id="a value that is not a list"),
        pytest.param([bytearray(b"xy")], id="bytearray segment"),
        pytest.param([memoryview(np.arange(3, dtype=np.int64))], id="multi-byte format"),
        pytest.param([memoryview(np.ones((2, 2), np.uint8))], id="two-dimensional"),
        pytest.param([memoryview(np.arange(8, dtype=np.uint8))[::2]], id="strided"),
        pytest.param([np.arange(4, dtype=np.uint8)], id="numpy array"),
        pytest.param(["text"], id="str segment"),
    ],
)
def test_anything_else_is_left_to_the_caller(impl, odd) -> None:
    assert batchscan.plain_segments([[b"ok"], odd]) is None


def test_a_released_view_is_left_to_the_caller_who_names_it(impl) -> None:
    view = memoryview(b"abc")
    view.release()
    assert batchscan.plain_segments([[b"h", view]]) is None
    with pytest.raises(ValueError, match="released"):
        PutValues([[b"h", view]])


def test_put_values_read_alike_through_either_path(impl) -> None:
    rows = np.arange(24, dtype=np.int64).reshape(3, 8)
    payload = memoryview(rows.reshape(-1).view(np.uint8))
    values = [[b"HDR", payload[i * 64 : (i + 1) * 64]] for i in range(3)] + [b"bare", [bytearray(b"ba")]]
    vals = PutValues(values)
    assert vals.sizes.tolist() == [67, 67, 67, 4, 2]
    assert vals.nseg.tolist() == [2, 2, 2, 1, 1]
    with pytest.raises(InvalidArgument, match="contiguous"):
        PutValues([[b"h", memoryview(np.arange(8, dtype=np.uint8))[::2]]])


KEYS = ["tq:{p}:d:0:f", "", "é-ü-€", "日本語キー", "x" * 1000, "tq:{p}:d:1:f"]


def test_key_hashes_are_zlibs_crc32(impl) -> None:
    assert batchscan.crc32_keys(KEYS).tolist() == [zlib.crc32(k.encode()) for k in KEYS]
    assert batchscan.crc32_keys(tuple(KEYS)).dtype == np.uint64
    assert batchscan.crc32_keys([]).tolist() == []


def test_placement_does_not_depend_on_the_implementation(monkeypatch) -> None:
    class Node:
        def __init__(self, node_id: str) -> None:
            self.node_id = node_id

    ring = Ring([Node(f"node-{i}") for i in range(4)])
    keys = [f"ns:{{p}}:d:{i}:f{f}" for i in range(500) for f in range(2)]
    native_hashes, native_owners = key_hashes(keys), ring.owners(keys)
    monkeypatch.setattr(batchscan, "_native", None)
    assert key_hashes(keys).tolist() == native_hashes.tolist()
    assert ring.owners(keys).tolist() == native_owners.tolist()
    assert len(set(native_owners.tolist())) == 4  # the keys do spread over every node


@pytest.mark.parametrize("bad, error", [([1, "a"], TypeError), (["ok", "\udcff"], UnicodeEncodeError)])
def test_a_key_that_is_not_text_raises_the_same_error_either_way(impl, bad, error) -> None:
    with pytest.raises(error):
        batchscan.crc32_keys(bad)


def _row(prefix: bytes, items: bytes, itemsize: int) -> bytes:
    return prefix + struct.pack("<q", len(items) // itemsize) + items


ROW_PREFIX = b"TQ\x01\x02\x07\x01\x00\x00"  # any 8 bytes: join_rows compares, it does not parse


@pytest.mark.skipif(not batchscan.NATIVE, reason="the joins exist only in the native module")
def test_join_rows_joins_payloads_and_counts_offsets_in_items() -> None:
    rows = [_row(ROW_PREFIX, bytes(range(n * 4)), 4) for n in (3, 0, 1, 5)]
    mixed = [rows[0], memoryview(rows[1]), bytearray(rows[2]), memoryview(rows[3])]
    for values in (rows, mixed):
        joined, offsets, shortest, longest = batchscan.join_rows(values, ROW_PREFIX, 4, 1 << 16)
        assert bytes(joined) == b"".join(r[16:] for r in rows)
        assert np.frombuffer(offsets, np.int64).tolist() == [0, 3, 3, 4, 9]
        assert (shortest, longest) == (0, 5)
        assert isinstance(joined, bytearray) and isinstance(offsets, bytearray)  # writable, for torch


@pytest.mark.skipif(not batchscan.NATIVE, reason="the joins exist only in the native module")
def test_join_rows_declines_what_the_general_path_must_name() -> None:
    good = _row(ROW_PREFIX, bytes(8), 4)
    negative = ROW_PREFIX + struct.pack("<q", -1)
    huge = ROW_PREFIX + struct.pack("<q", 1 << 62) + bytes(8)
    for bad in (
        good[:-1],  # truncated
        good + b"x",  # longer than its length says
        good[:12],  # shorter than a header
        b"XX" + good[2:],  # another prefix (magic, kind or dtype)
        negative,
        huge,  # a length whose byte count would overflow
        bytes(good).replace(ROW_PREFIX, ROW_PREFIX[:7] + b"\x01"),
    ):
        assert batchscan.join_rows([good, bad], ROW_PREFIX, 4, 1 << 16) is None
    assert batchscan.join_rows([good, memoryview(bytes(64))[::2]], ROW_PREFIX, 4, 1 << 16) is None  # strided
    assert batchscan.join_rows([good, "text"], ROW_PREFIX, 4, 1 << 16) is None
    assert batchscan.join_rows([good, good], ROW_PREFIX, 4, 15) is None  # 16 payload bytes > max
    assert batchscan.join_rows([good, good], ROW_PREFIX, 4, 16) is not None
    assert batchscan.join_rows([], ROW_PREFIX, 4, 16) is None


@pytest.mark.skipif(not batchscan.NATIVE, reason="the joins exist only in the native module")
def test_join_framed_joins_what_follows_one_shared_header() -> None:
    head = b"HEAD1234"
    values = [head + bytes([i]) * 6 for i in range(5)]
    joined = batchscan.join_framed([values[0], memoryview(values[1]), bytearray(values[2]), *values[3:]], head, 14)
    assert joined == bytearray(b"".join(bytes([i]) * 6 for i in range(5)))
    assert batchscan.join_framed([values[0], values[1][:-1]], head, 14) is None  # another size
    assert batchscan.join_framed([values[0], b"HEAD1235" + bytes(6)], head, 14) is None  # another header
    assert batchscan.join_framed([values[0], 7], head, 14) is None
    assert batchscan.join_framed(values, head, 4) is None  # a size shorter than the header
    assert batchscan.join_framed([head, head], head, 8) == bytearray()


def test_without_the_native_module_the_joins_leave_the_work_to_the_caller(monkeypatch) -> None:
    monkeypatch.setattr(batchscan, "_native", None)
    assert batchscan.join_framed([b"HEADxx"], b"HEAD", 6) is None
    assert batchscan.join_rows([_row(ROW_PREFIX, bytes(4), 4)], ROW_PREFIX, 4, 64) is None


def test_a_stale_native_build_is_not_used(monkeypatch) -> None:
    # an editable checkout whose C module predates this Python module runs in Python, not half-native
    code = (
        "import sys, types; stale = types.ModuleType('tq_redis.codec._scan'); "
        "stale.segments = stale.crc32_keys = print; "
        "sys.modules['tq_redis.codec._scan'] = stale; from tq_redis.codec import batchscan; print(batchscan.NATIVE)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]
