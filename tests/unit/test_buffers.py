"""The warm buffer cache behind large decodes (``tq_redis.codec.buffers``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tq_redis.codec import buffers
from tq_redis.codec import tensors as codec
from tq_redis.codec.buffers import MIN_BYTES, BufferCache
from tq_redis.errors import ConfigError
from tq_redis.settings import settings

BIG = 3 * MIN_BYTES + 123  # not a multiple of anything in particular


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_small_buffers_bypass_the_cache() -> None:
    cache = BufferCache(1 << 30)
    a = cache.take(100)
    assert a.nbytes == 100 and a.dtype == np.uint8
    del a
    assert cache.idle == 0


def test_a_dropped_buffer_is_reused_warm() -> None:
    cache = BufferCache(1 << 30)
    a = cache.take(BIG)
    assert a.nbytes == BIG and a.flags.writeable
    a[:] = 7
    first = _addr(a)
    del a
    assert cache.idle >= BIG
    b = cache.take(BIG)
    assert _addr(b) == first
    assert cache.idle == 0


def test_a_buffer_still_viewed_by_a_tensor_is_not_reused() -> None:
    cache = BufferCache(1 << 30)
    a = cache.take(BIG)
    t = torch.from_numpy(a).view(torch.int8)
    first = _addr(a)
    del a
    b = cache.take(BIG)
    assert _addr(b) != first  # the tensor still owns that memory
    t.fill_(1)
    assert int(t.sum()) == BIG  # and it is intact
    del t
    c = cache.take(BIG)
    assert _addr(c) == first


def test_a_much_larger_idle_buffer_does_not_serve_a_small_request() -> None:
    cache = BufferCache(1 << 30)
    big = cache.take(64 * MIN_BYTES)
    first = _addr(big)
    del big
    small = cache.take(2 * MIN_BYTES)
    assert _addr(small) != first


def test_limit_bounds_idle_bytes_and_zero_disables() -> None:
    off = BufferCache(0)
    a = off.take(BIG)
    first = _addr(a)
    del a
    assert off.idle == 0
    assert _addr(off.take(BIG)) != first or off.idle == 0

    tight = BufferCache(BIG)  # smaller than one rounded-up buffer
    b = tight.take(BIG)
    del b
    assert tight.idle == 0


def test_trim_releases_idle_buffers() -> None:
    cache = BufferCache(1 << 30)
    views = [cache.take(BIG) for _ in range(3)]
    del views
    assert cache.idle > 0
    released = cache.trim()
    assert released >= 3 * BIG and cache.idle == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [(None, 1 << 30), ("", 1 << 30), ("0", 0), ("off", 0), ("512MiB", 512 << 20), ("2GB", 2 * 10**9)],
)
def test_limit_from_environment(text: str | None, expected: int, monkeypatch) -> None:
    if text is None:
        monkeypatch.delenv("TQ_BUFFER_CACHE", raising=False)
    else:
        monkeypatch.setenv("TQ_BUFFER_CACHE", text)
    assert settings.buffer_cache == expected


def test_bad_limit_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setenv("TQ_BUFFER_CACHE", "lots")
    with pytest.raises(ConfigError, match="TQ_BUFFER_CACHE: cannot read size"):
        settings.buffer_cache  # noqa: B018


def test_decode_reuses_the_memory_of_a_dropped_batch_and_writes_every_row() -> None:
    rows, width = 256, 4096  # 8 MiB of int64: large enough for the cache
    first_batch = torch.arange(rows * width, dtype=torch.int64).reshape(rows, width)
    _, values = codec.encode_field("x", first_batch, rows)
    stored = [b"".join(bytes(seg) for seg in v) for v in values]
    out = codec.decode_field("x", stored)
    assert torch.equal(out, first_batch)
    first = out.data_ptr()
    del out

    second_batch = -first_batch
    _, values = codec.encode_field("x", second_batch, rows)
    stored = [b"".join(bytes(seg) for seg in v) for v in values]
    again = codec.decode_field("x", stored)
    assert again.data_ptr() == first  # warm memory from the cache
    assert torch.equal(again, second_batch)  # fully overwritten: nothing of the old batch shows
    kept = again
    other = codec.decode_field("x", stored)
    assert other.data_ptr() != kept.data_ptr()  # a batch the caller keeps is never handed out twice
    assert torch.equal(kept, second_batch)


def test_process_wide_cache_helpers() -> None:
    a = buffers.take(BIG)
    del a
    assert buffers.trim() >= BIG


def test_threads_never_share_a_live_buffer() -> None:
    """Many threads take, fill, check and drop buffers of a few sizes: no buffer is handed to two
    owners at once (each sees only its own pattern) and returning buffers from finalisers while
    other threads take never breaks the cache."""
    import threading

    cache = BufferCache(64 * MIN_BYTES)
    errors: list[str] = []

    def worker(tag: int) -> None:
        for round_ in range(60):
            size = (1 + (tag + round_) % 3) * MIN_BYTES + 7
            a = cache.take(size)
            a[:] = tag
            b = cache.take(size)  # a second live buffer must be a different one
            b[:] = 255 - tag
            if _addr(a) == _addr(b) or a.min() != tag or a.max() != tag:
                errors.append(f"thread {tag} round {round_}: buffer shared or overwritten")
            del a, b

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert 0 < cache.idle <= 64 * MIN_BYTES
