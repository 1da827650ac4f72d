"""Batched copies (tq_redis.codec.fastcopy): the native module and the Python loops agree, byte for byte."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from tq_redis.codec import fastcopy

IMPLS = ["native", "python"]


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Run a test once through the native module and once through the Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(fastcopy, "_native", None)
    return request.param


def test_the_native_module_is_built_by_the_install():
    # the README's setup compiles it; a broken build must fail here, not silently run slower
    assert fastcopy.NATIVE, "tq_redis.codec._copy did not build: is a C compiler installed?"
    settings = fastcopy.configure()
    assert settings is not None and settings["threads"] >= 1


def test_the_fallback_is_used_when_asked_for():
    code = "from tq_redis.codec import fastcopy; print(fastcopy.NATIVE, fastcopy.configure())"
    env = {**os.environ, "TQ_NATIVE_COPY": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "None"]


def test_a_bad_thread_count_is_a_config_error():
    code = "import tq_redis.codec.fastcopy"
    env = {**os.environ, "TQ_COPY_THREADS": "many"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "ConfigError" in out.stderr and "TQ_COPY_THREADS='many'" in out.stderr


def scatter(dst, offsets, parts) -> None:
    """Each part to its own offset: copy_table with one source per entry."""
    n = len(parts)
    lens = np.fromiter((memoryview(p).nbytes for p in parts), np.int64, n)
    fastcopy.copy_table(dst, np.asarray(offsets), parts, np.arange(n), np.zeros(n, np.int64), lens)


def _parts(rng: np.random.Generator, sizes: list[int]) -> list:
    """Buffers of every kind the data plane passes: bytes, bytearray, byte memoryviews."""
    out = []
    for i, n in enumerate(sizes):
        raw = rng.integers(0, 256, n, dtype=np.uint8)
        kind = i % 3
        out.append(raw.tobytes() if kind == 0 else bytearray(raw.tobytes()) if kind == 1 else memoryview(raw))
    return out


def _expected_scatter(size: int, offsets, parts) -> bytes:
    want = bytearray(size)
    for off, p in zip(offsets, parts):
        want[off : off + len(p)] = bytes(p)
    return bytes(want)


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([5, 0, 17, 64, 1], id="tiny"),
        pytest.param([32768 + 16] * 300 + [3, 1000, 4095], id="large-batch-unaligned"),
        pytest.param([9 << 20], id="one-huge-part"),
    ],
)
def test_scatter_places_every_part(impl, sizes):
    rng = np.random.default_rng(len(sizes))
    parts = _parts(rng, sizes)
    # odd gaps, so parts start at every alignment and threads split inside parts
    offsets, pos = [], 7
    for n in sizes:
        offsets.append(pos)
        pos += n + int(rng.integers(0, 97))
    dst = bytearray(pos + 13)
    scatter(dst, np.array(offsets, dtype=np.int64), parts)
    assert bytes(dst) == _expected_scatter(len(dst), offsets, parts)


def test_scatter_into_a_shared_mapping_with_several_threads(impl):
    """The dram store's case: a writable MAP_SHARED mapping, a batch large enough to stream."""
    saved = fastcopy.configure(threads=3)
    try:
        rng = np.random.default_rng(3)
        parts = _parts(rng, [40000] * 400)
        offsets = np.arange(400, dtype=np.int64)[::-1] * 40064  # reverse order, 64-byte aligned
        with mmap.mmap(-1, 400 * 40064, flags=mmap.MAP_SHARED) as region:
            scatter(region, offsets, parts)
            assert bytes(region) == _expected_scatter(len(region), offsets.tolist(), parts)
    finally:
        if saved is not None:
            fastcopy.configure(threads=saved["threads"])


@pytest.mark.parametrize(
    "offsets, message",
    [
        pytest.param([0, 95], "does not fit", id="past-the-end"),
        pytest.param([-1, 10], "does not fit", id="negative"),
    ],
)
def test_scatter_refuses_a_part_that_does_not_fit_and_copies_nothing(impl, offsets, message):
    dst = bytearray(100)
    with pytest.raises(ValueError, match=message):
        scatter(dst, np.array(offsets, dtype=np.int64), [b"x" * 10, b"y" * 10])
    assert dst == bytearray(100)


@pytest.mark.parametrize("rows", [5, 700])
def test_copy_table_reads_many_entries_from_few_sources(impl, rows):
    """The decoder's case: rows of values that sit at scattered offsets of two large buffers."""
    rng = np.random.default_rng(rows)
    a = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    b = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    sources = [memoryview(a), b.tobytes()]
    index = rng.integers(0, 2, rows)
    row = 4000
    limit = np.where(index == 0, len(a), len(b)) - row
    src_off = (rng.random(rows) * limit).astype(np.int64)
    out = np.zeros(rows * row, np.uint8)
    fastcopy.copy_table(out, np.arange(rows) * row, sources, index, src_off, np.full(rows, row))
    want = b"".join(bytes(sources[i])[o : o + row] for i, o in zip(index.tolist(), src_off.tolist()))
    assert out.tobytes() == want


@pytest.mark.parametrize(
    "index, src_off, length, message",
    [
        pytest.param(2, 0, 4, "source", id="no-such-source"),
        pytest.param(-1, 0, 4, "source", id="negative-source"),
        pytest.param(0, 8, 4, "source", id="reads-past-the-end"),
        pytest.param(0, 0, -1, "source", id="negative-length"),
    ],
)
def test_copy_table_refuses_entries_outside_their_source(impl, index, src_off, length, message):
    dst = bytearray(32)
    with pytest.raises(ValueError, match=message):
        fastcopy.copy_table(dst, [0, 16], [b"0123456789", b"abcdef"], [1, index], [0, src_off], [4, length])
    assert dst == bytearray(32)


def test_copy_table_wants_tables_of_one_length(impl):
    with pytest.raises(ValueError):
        fastcopy.copy_table(bytearray(8), [0, 4], [b"abcd"], [0], [0], [4])


def test_scatter_refuses_a_read_only_destination(impl):
    with pytest.raises(BufferError):
        scatter(b"\0" * 10, np.zeros(1, dtype=np.int64), [b"abc"])


@pytest.mark.parametrize("rows, row, skip", [(1, 8, 16), (4, 24, 8), (7, 24, 8), (600, 32768, 40), (3, 0, 5)])
def test_gather_rows_copies_each_payload_into_its_row(impl, rows, row, skip):
    rng = np.random.default_rng(rows)
    parts = _parts(rng, [skip + row + (i % 3) for i in range(rows)])  # trailing bytes are ignored
    dst = bytearray(rows * row + 5)
    fastcopy.gather_rows(dst, parts, skip, row)
    want = b"".join(bytes(p)[skip : skip + row] for p in parts) + b"\0" * 5
    assert bytes(dst) == want


def test_gather_rows_into_a_numpy_array(impl):
    src = np.arange(64 * 1024, dtype=np.int64).reshape(64, 1024)
    header = b"H" * 16
    parts = [header + r.tobytes() for r in src]
    out = np.zeros_like(src)
    fastcopy.gather_rows(out, parts, len(header), 1024 * 8)
    assert np.array_equal(out, src)


@pytest.mark.parametrize(
    "parts, skip, row, size, message",
    [
        pytest.param([b"abcdef", b"abc"], 1, 4, 100, "source", id="short-part"),
        pytest.param([b"abcdef", b"abcdef"], 0, 6, 11, "does not fit", id="small-destination"),
        pytest.param([b"abcdef"], -1, 2, 10, ">= 0", id="negative-skip"),
    ],
)
def test_gather_rows_refuses_bad_shapes_and_copies_nothing(impl, parts, skip, row, size, message):
    dst = bytearray(size)
    with pytest.raises(ValueError, match=message):
        fastcopy.gather_rows(dst, parts, skip, row)
    assert dst == bytearray(size)


def test_a_non_contiguous_part_is_refused(impl):
    strided = memoryview(np.arange(20, dtype=np.uint8)[::2])
    dst = bytearray(64)
    with pytest.raises(BufferError):
        scatter(dst, np.zeros(1, dtype=np.int64), [strided])
    with pytest.raises(BufferError):
        fastcopy.gather_rows(dst, [strided], 0, 4)
    assert dst == bytearray(64)
