"""How the dram store reads a put batch's values (``tq_redis/backends/dram/values.py``, ``PutValues``):
sizes and bytes."""

from __future__ import annotations

import numpy as np
import pytest

from tq_redis.backends.dram.values import PutValues
from tq_redis.codec import fastcopy
from tq_redis.codec.batches import RowBlock, ValueChain
from tq_redis.errors import InvalidArgument


def _bytes_of(vals: PutValues, i: int) -> bytes:
    out = bytearray(int(vals.sizes[i]))
    vals.copy_into(memoryview(out), np.array([i]), np.array([0]))
    return bytes(out)


def test_codec_shaped_values_take_the_fast_path_and_copy_exactly() -> None:
    rows = np.arange(12, dtype=np.int64).reshape(3, 4)
    payload = memoryview(rows.reshape(-1).view(np.uint8))
    header = b"HDR!"
    values = [[header, payload[i * 32 : (i + 1) * 32]] for i in range(3)]
    vals = PutValues(values)
    assert vals.sizes.tolist() == [36, 36, 36]
    for i in range(3):
        assert _bytes_of(vals, i) == header + rows[i].tobytes()


def test_mixed_buffers_are_normalised_to_their_byte_sizes() -> None:
    wide = memoryview(np.arange(3, dtype=np.int64))  # format 'q': len 3, 24 bytes
    two_d = memoryview(np.ones((2, 2), dtype=np.uint8))
    values = [b"abc", bytearray(b"de"), [wide], [b"x", two_d], memoryview(b"")]
    vals = PutValues(values)
    assert vals.sizes.tolist() == [3, 2, 24, 5, 0]
    assert _bytes_of(vals, 2) == np.arange(3, dtype=np.int64).tobytes()
    assert _bytes_of(vals, 3) == b"x\x01\x01\x01\x01"


def test_a_non_contiguous_segment_is_refused_with_a_fix() -> None:
    strided = memoryview(np.arange(8, dtype=np.uint8)[::2])
    with pytest.raises(InvalidArgument, match="contiguous"):
        PutValues([[b"h", strided]])


@pytest.mark.parametrize("impl", ["native", "python"])
def test_row_blocks_and_lists_in_one_chain_copy_and_send_exactly(impl, monkeypatch) -> None:
    """A put of a dense field (a RowBlock) next to an object field (a list) and a sliced block."""
    if impl == "python":
        monkeypatch.setattr(fastcopy, "_native", None)
    rows = np.arange(40, dtype=np.int64).reshape(5, 8)
    block = RowBlock(b"HEAD", memoryview(rows.reshape(-1).view(np.uint8)), 64, 5)
    listed = [[b"o", b"bj0"], [b"obj1"], [memoryview(b"")]]
    chain = ValueChain([block, listed, block[2:4]])
    vals = PutValues(chain)
    expected = [b"HEAD" + r.tobytes() for r in rows] + [b"obj0", b"obj1", b""]
    expected += [b"HEAD" + rows[2].tobytes(), b"HEAD" + rows[3].tobytes()]
    assert vals.sizes.tolist() == list(map(len, expected))
    assert [_bytes_of(vals, i) for i in range(len(expected))] == expected
    # several values into one destination at once, as a node's reserved extent receives them
    pick = np.array([9, 0, 6, 4])
    offsets = np.concatenate(([0], np.cumsum(vals.sizes[pick])[:-1]))
    out = bytearray(int(vals.sizes[pick].sum()))
    vals.copy_into(memoryview(out), pick, offsets)
    assert bytes(out) == b"".join(expected[i] for i in pick.tolist())
    # the TCP path sends the same values as segment buffers
    assert b"".join(map(bytes, vals.payload(pick))) == bytes(out)
    # values that are lists of whole buffers go out as those very buffers, with no view made per segment
    listed_only = vals.payload(np.array([6, 5]))
    assert [bytes(b) for b in listed_only] == [b"obj1", b"o", b"bj0"]
    assert listed_only[0] is listed[1][0] and listed_only[1] is listed[0][0]


def test_a_list_of_codec_pairs_is_sent_as_the_callers_own_buffers() -> None:
    rows = np.arange(64, dtype=np.int64).reshape(8, 8)
    payload = memoryview(rows.reshape(-1).view(np.uint8))
    values = [[b"H", payload[i * 64 : (i + 1) * 64]] for i in range(8)]
    vals = PutValues(values)
    sent = vals.payload(np.array([3, 1]))
    assert all(a is b for a, b in zip(sent, values[3] + values[1], strict=True))
    assert b"".join(map(bytes, sent)) == b"H" + rows[3].tobytes() + b"H" + rows[1].tobytes()
