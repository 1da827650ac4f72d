"""A batch's segment sizes and key hashes (tq_redis.batchscan): the native module and Python agree."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from tq_redis.backends.dram_placement import Ring, key_hashes
from tq_redis.backends.dram_values import PutValues

from tq_redis import batchscan
from tq_redis.errors import InvalidArgument


@pytest.fixture(params=["native", "python"])
def impl(request, monkeypatch):
    """Run a test once through the native module and once through the Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(batchscan, "_native", None)
    return request.param


def test_the_native_module_is_built_by_the_install():
    # the README's setup compiles it; a broken build must fail here, not silently run slower
    assert batchscan.NATIVE, "tq_redis._scan did not build: is a C compiler installed?"


def test_the_fallback_is_used_when_asked_for():
    code = "from tq_redis import batchscan; print(batchscan.NATIVE)"
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
