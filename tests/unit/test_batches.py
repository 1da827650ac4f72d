"""Batch containers (tq_redis/codec/batches.py): each behaves exactly like the plain list it stands for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tq_redis.codec import fastcopy
from tq_redis.codec import tensors as codec
from tq_redis.codec.batches import RowBlock, ValueChain, ValueTable, total_bytes
from tq_redis.errors import StorageError
from tq_redis.storage.base import join_segments


def _block(n: int = 6, width: int = 3) -> tuple[RowBlock, np.ndarray]:
    rows = np.arange(n * width, dtype=np.int32).reshape(n, width)
    return RowBlock(b"hd", memoryview(rows.reshape(-1).view(np.uint8)), width * 4, n), rows


def _as_list(block: RowBlock, rows: np.ndarray) -> list[bytes]:
    return [b"hd" + r.tobytes() for r in rows]


def test_a_row_block_is_the_list_of_its_values() -> None:
    block, rows = _block()
    want = _as_list(block, rows)
    assert len(block) == 6 and block.nbytes == sum(map(len, want)) == total_bytes(block)
    assert [join_segments(v) for v in block] == want
    assert join_segments(block[-1]) == want[-1]
    assert [join_segments(v) for v in block[1:4]] == want[1:4]
    assert isinstance(block[1:4], RowBlock)  # contiguous slices stay blocks
    assert [join_segments(v) for v in block[::2]] == want[::2]
    with pytest.raises(IndexError):
        block[6]


def test_a_row_block_checks_its_buffer_is_large_enough() -> None:
    with pytest.raises(ValueError, match="exceed"):
        RowBlock(b"", memoryview(bytes(10)), 4, 3)


def test_a_chain_is_its_parts_back_to_back() -> None:
    block, rows = _block()
    listed = [[b"a"], [b"bc", b"d"]]
    chain = ValueChain([block, listed, block[4:]])
    want = _as_list(block, rows) + [b"a", b"bcd"] + _as_list(block, rows)[4:]
    assert len(chain) == len(want) == 10
    assert [join_segments(v) for v in chain] == want
    assert [join_segments(chain[i]) for i in range(-10, 10)] == want + want
    assert [join_segments(v) for v in chain[5:9]] == want[5:9]
    assert chain.nbytes == sum(map(len, want)) == total_bytes(chain)
    assert len(ValueChain([])) == 0


def _table() -> tuple[ValueTable, list[bytes]]:
    a, b = bytes(range(100)), bytes(range(100, 200))
    table = ValueTable([memoryview(a), memoryview(b)], [1, 0, 1], [5, 0, 90], [3, 4, 10])
    return table, [b[5:8], a[0:4], b[90:100]]


def test_a_value_table_is_the_list_of_its_slices() -> None:
    table, want = _table()
    assert [bytes(v) for v in table] == want
    assert bytes(table[-1]) == want[-1] and bytes(table[0]) == want[0]
    sub = table[1:]
    assert isinstance(sub, ValueTable) and [bytes(v) for v in sub] == want[1:]
    assert [bytes(v) for v in table[::2]] == want[::2]
    assert table.nbytes == 17 == total_bytes(table)
    assert total_bytes([b"ab", memoryview(np.zeros(3, np.int64))]) == 26


def test_a_value_table_wants_columns_of_one_length() -> None:
    with pytest.raises(ValueError, match="one length"):
        ValueTable([b"x"], [0, 0], [0], [1])


@pytest.mark.parametrize("impl", ["native", "python"])
def test_a_dense_field_decodes_from_a_table_as_from_a_list(impl: str, monkeypatch) -> None:
    if impl == "python":
        monkeypatch.setattr(fastcopy, "_native", None)
    x = torch.arange(5 * 7, dtype=torch.float64).reshape(5, 7)
    _, block = codec.encode_field("x", x, 5)
    stored = [join_segments(v) for v in block]
    # lay the values out of order over two buffers, with junk between them, as nodes return them
    order = [3, 0, 4, 1, 2]
    bufs: list[bytearray] = [bytearray(b"junk"), bytearray(b"junk")]
    index, offsets = [0] * 5, [0] * 5
    for k, i in enumerate(order):
        src = k % 2
        index[i], offsets[i] = src, len(bufs[src])
        bufs[src] += stored[i] + b"--"
    table = ValueTable([memoryview(b) for b in bufs], index, offsets, [len(s) for s in stored])
    assert torch.equal(codec.decode_field("x", table), x)
    assert torch.equal(codec.decode_field("x", table[1:4]), x[1:4])
    # a value whose header differs (another shape) takes the general path and still decodes
    y = codec.encode_field("y", torch.ones(1, 9, dtype=torch.float64), 1)[1]
    other = join_segments(y[0])
    mixed = ValueTable([memoryview(bufs[index[0]]), memoryview(other)], [0, 1], [offsets[0], 0],
                       [len(stored[0]), len(other)])  # fmt: skip
    out = codec.decode_field("x", mixed)
    assert out.is_nested and torch.equal(out[0], x[0]) and torch.equal(out[1], torch.ones(9, dtype=torch.float64))


def test_a_corrupt_value_in_a_table_is_a_storage_error() -> None:
    x = torch.zeros(2, 4)
    stored = [join_segments(v) for v in codec.encode_field("x", x, 2)[1]]
    buf = bytearray(stored[0] + b"\x00" * len(stored[1]))  # second value: zeros, no header
    table = ValueTable([memoryview(buf)], [0, 0], [0, len(stored[0])], [len(stored[0]), len(stored[1])])
    with pytest.raises(StorageError):
        codec.decode_field("x", table)
