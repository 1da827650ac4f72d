"""How the dram store reads a put batch's values (``backends/dram.py`` ``_Values``): sizes and bytes."""

from __future__ import annotations

import numpy as np
import pytest
from tq_redis.backends.dram import _Values

from tq_redis.errors import InvalidArgument


def _bytes_of(vals: _Values, i: int) -> bytes:
    out = bytearray(int(vals.sizes[i]))
    vals.copy_into(memoryview(out), np.array([i]), np.array([0]))
    return bytes(out)


def test_codec_shaped_values_take_the_fast_path_and_copy_exactly() -> None:
    rows = np.arange(12, dtype=np.int64).reshape(3, 4)
    payload = memoryview(rows.reshape(-1).view(np.uint8))
    header = b"HDR!"
    values = [[header, payload[i * 32 : (i + 1) * 32]] for i in range(3)]
    vals = _Values(values)
    assert vals.sizes.tolist() == [36, 36, 36]
    for i in range(3):
        assert _bytes_of(vals, i) == header + rows[i].tobytes()


def test_mixed_buffers_are_normalised_to_their_byte_sizes() -> None:
    wide = memoryview(np.arange(3, dtype=np.int64))  # format 'q': len 3, 24 bytes
    two_d = memoryview(np.ones((2, 2), dtype=np.uint8))
    values = [b"abc", bytearray(b"de"), [wide], [b"x", two_d], memoryview(b"")]
    vals = _Values(values)
    assert vals.sizes.tolist() == [3, 2, 24, 5, 0]
    assert _bytes_of(vals, 2) == np.arange(3, dtype=np.int64).tobytes()
    assert _bytes_of(vals, 3) == b"x\x01\x01\x01\x01"


def test_a_non_contiguous_segment_is_refused_with_a_fix() -> None:
    strided = memoryview(np.arange(8, dtype=np.uint8)[::2])
    with pytest.raises(InvalidArgument, match="contiguous"):
        _Values([[b"h", strided]])
