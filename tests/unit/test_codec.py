"""Unit tests for tq_redis.codec.tensors: per-sample encoding and batch decoding of batch fields.

Over 600 lines: every kind the codec stores (and its errors) in one file, sharing the roundtrip helpers.
"""

from __future__ import annotations

import math
import struct
import urllib.parse
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tests.unit.values import Opaque, Point, assert_same, python_objects, random_tensor, tensor_bytes
from tq_redis.codec import batchscan, fastcopy, wireformat
from tq_redis.codec import tensors as codec
from tq_redis.errors import (
    BatchSizeMismatch,
    EmptyBatch,
    StorageError,
    UnsupportedValue,
)
from tq_redis.meta import dtypes, schemas

# torch's own notes about prototype/experimental features, not about this codec
pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def stored(segments: list) -> bytes:
    """What a KV store would hold: the concatenation of one sample's segments."""
    return b"".join(bytes(s) for s in segments)


def roundtrip(name: str, value: Any, n: int, **kw: Any) -> tuple[dict, Any]:
    schema, per_sample = codec.encode_field(name, value, n, **kw)
    assert len(per_sample) == n
    return schema, codec.decode_field(name, [stored(s) for s in per_sample], **kw)


@pytest.fixture(params=["native", "python"])
def scan(request, monkeypatch):
    """Decode once through the native joins (tq_redis.codec.batchscan) and once through Python."""
    if request.param == "python":
        monkeypatch.setattr(batchscan, "_native", None)
        monkeypatch.setattr(batchscan, "NATIVE", False)
    return request.param


ALL_DTYPES = sorted(dtypes.DTYPE_TO_CODE, key=str)
COMMON_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
    torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
]


# --------------------------------------------------------------------------------------------
# dense tensors
# --------------------------------------------------------------------------------------------


def _creatable(dtype: torch.dtype) -> bool:
    try:
        random_tensor(dtype, (2, 3))
        return True
    except Exception:
        return False


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if _creatable(d)], ids=str)
def test_dense_roundtrip_every_dtype_bit_exact(dtype: torch.dtype, scan) -> None:
    x = random_tensor(dtype, (4, 3, 2), seed=1)
    schema, out = roundtrip("x", x, 4)
    assert schema == {"kind": "tensor", "dtype": str(dtype).removeprefix("torch."), "shape": [3, 2]}
    assert out.dtype == dtype and out.shape == x.shape and not out.is_nested
    assert tensor_bytes(out) == tensor_bytes(x)


@pytest.mark.parametrize("impl", ["native", "python"])
def test_large_dense_batch_decodes_bit_exact_through_either_copy(impl: str, monkeypatch) -> None:
    # 24 MiB: large enough for streaming stores and several copy threads in the native module
    if impl == "python":
        monkeypatch.setattr(fastcopy, "_native", None)
    x = torch.randint(-(1 << 62), 1 << 62, (768, 4096), dtype=torch.int64, generator=torch.Generator().manual_seed(5))
    a = x.numpy().astype(np.float32)
    for name, value in (("x", x), ("a", a)):
        _, per_sample = codec.encode_field(name, value, 768)
        out = codec.decode_field(name, [stored(s) for s in per_sample])
        assert tensor_bytes(torch.as_tensor(out)) == tensor_bytes(torch.as_tensor(value))


def test_bf16_bool_complex_values() -> None:
    bf = torch.tensor([[1.5, -2.25], [float("nan"), float("inf")]], dtype=torch.bfloat16)
    _, out = roundtrip("bf", bf, 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, bf, equal_nan=True, rtol=0, atol=0)

    b = torch.tensor([True, False, True])
    _, out = roundtrip("b", b, 3)
    assert out.dtype == torch.bool and out.tolist() == [True, False, True]

    c = torch.tensor([[1 + 2j], [complex("nan+infj")]], dtype=torch.complex128)
    _, out = roundtrip("c", c, 2)
    assert out.dtype == torch.complex128 and tensor_bytes(out) == tensor_bytes(c)


def test_nan_inf_float32() -> None:
    x = torch.tensor([[float("nan"), float("inf")], [-float("inf"), -0.0]])
    _, out = roundtrip("x", x, 2)
    torch.testing.assert_close(out, x, equal_nan=True, rtol=0, atol=0)
    assert math.copysign(1.0, out[1, 1].item()) == -1.0  # -0.0 keeps its sign bit


def test_one_d_field_is_not_unsqueezed() -> None:
    x = torch.arange(5, dtype=torch.int32)
    schema, per_sample = codec.encode_field("x", x, 5)
    assert schema["shape"] == []
    # each sample is a 0-d value: header + exactly one int32
    assert all(len(stored(s)) == len(stored(per_sample[0])) for s in per_sample)
    out = codec.decode_field("x", [stored(s) for s in per_sample])
    assert out.shape == (5,) and out.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("shape", [(3, 0), (3, 2, 0), (3, 0, 4)])
def test_empty_per_sample_tensors(shape: tuple[int, ...]) -> None:
    x = torch.empty(shape, dtype=torch.float16)
    schema, out = roundtrip("x", x, 3)
    assert schema["shape"] == list(shape[1:])
    assert out.shape == x.shape and out.dtype == torch.float16


def test_non_contiguous_and_conj_views() -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    t = base.t()  # (6, 4), not contiguous
    _, out = roundtrip("t", t, 6)
    assert torch.equal(out, t)

    c = torch.randn(3, 2, dtype=torch.complex64)
    _, out = roundtrip("c", c.conj(), 3)
    assert not out.is_conj()
    assert torch.equal(out, c.conj().resolve_conj())

    g = torch.ones(2, 3, requires_grad=True) * 2
    _, out = roundtrip("g", g, 2)
    assert not out.requires_grad and torch.equal(out, torch.full((2, 3), 2.0))


def test_zero_copy_encode_of_large_int64_batch() -> None:
    x = torch.arange(1024 * 4096, dtype=torch.int64).reshape(1024, 4096)
    _, per_sample = codec.encode_field("x", x, 1024)
    row = 4096 * 8
    base = x.data_ptr()
    for i in (0, 1, 511, 1023):
        header, payload = per_sample[i]
        assert isinstance(header, bytes) and isinstance(payload, memoryview)
        arr = np.frombuffer(payload, dtype=np.uint8)
        assert arr.nbytes == row
        assert arr.ctypes.data == base + i * row
        assert np.shares_memory(arr, x.numpy())
    # A write to the tensor is visible through the segment: no copy was taken.
    x[7, 0] = -12345
    assert np.frombuffer(per_sample[7][1], dtype=np.int64)[0] == -12345


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_are_moved_to_cpu_once() -> None:
    x = torch.arange(24, dtype=torch.bfloat16, device="cuda").reshape(4, 6).t()  # non-contiguous
    nt = torch.nested.as_nested_tensor([torch.ones(2, device="cuda"), torch.ones(3, device="cuda")],
                                       layout=torch.jagged)
    _, out = roundtrip("x", x, 6)
    assert out.device.type == "cpu" and torch.equal(out, x.cpu())
    _, out = roundtrip("j", nt, 2)
    assert [p.tolist() for p in out.unbind()] == [[1.0, 1.0], [1.0, 1.0, 1.0]]


def test_dense_decode_is_writable_and_warning_free_from_readonly_bytes(scan) -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _, per_sample = codec.encode_field("x", x, 3)
    values = [stored(s) for s in per_sample]  # immutable bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = codec.decode_field("x", values)
    out += 1  # writable, owns its memory
    assert torch.equal(out, x + 1)
    assert values == [stored(s) for s in codec.encode_field("x", x, 3)[1]]


def test_decode_accepts_bytes_bytearray_memoryview_and_uint8_tensor(scan) -> None:
    x = torch.arange(6, dtype=torch.int16).reshape(3, 2)
    _, per_sample = codec.encode_field("x", x, 3)
    raw = [stored(s) for s in per_sample]
    values = [raw[0], bytearray(raw[1]), memoryview(raw[2])]
    assert torch.equal(codec.decode_field("x", values), x)
    as_tensors = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
    assert torch.equal(codec.decode_field("x", as_tensors), x)


def test_value_is_self_describing() -> None:
    x = random_tensor(torch.bfloat16, (2, 3, 5))
    _, per_sample = codec.encode_field("x", x, 2)
    one = codec.decode_field("anything", [stored(per_sample[1])])
    assert one.dtype == torch.bfloat16 and one.shape == (1, 3, 5)
    assert tensor_bytes(one[0]) == tensor_bytes(x[1])
    value = stored(per_sample[0])
    assert value[:2] == b"TQ"
    assert (len(value) - len(per_sample[0][0])) == 3 * 5 * 2  # payload is the raw bf16 bytes


def test_rows_with_different_shapes_decode_to_nested() -> None:
    a = torch.ones(2, 3)
    b = torch.zeros(1, 5)
    values = [stored(s) for s in codec.encode_field("x", a, 2)[1]]
    values += [stored(s) for s in codec.encode_field("x", b, 1)[1]]
    out = codec.decode_field("x", values)
    assert out.is_nested and out.layout == torch.jagged
    parts = out.unbind()
    assert [p.shape for p in parts] == [(3,), (3,), (5,)]
    assert torch.equal(parts[2], torch.zeros(5))


def test_nested_output_option_returns_jagged_like_reference(scan) -> None:
    x = torch.arange(12).reshape(3, 4)
    _, per_sample = codec.encode_field("x", x, 3)
    out = codec.decode_field("x", [stored(s) for s in per_sample], nested_output=True)
    assert out.is_nested and out.layout == torch.jagged
    assert all(torch.equal(p, x[i]) for i, p in enumerate(out.unbind()))
    scalar = codec.decode_field(
        "y", [stored(s) for s in codec.encode_field("y", torch.arange(3), 3)[1]], nested_output=True
    )
    assert not scalar.is_nested and scalar.tolist() == [0, 1, 2]


def test_same_shaped_nested_fields_share_their_ragged_dimension_but_not_their_values() -> None:
    # Fields of one shape come back with one offsets tensor: torch then lets them be combined,
    # which it refuses for two ragged dimensions of different names.
    ids = torch.arange(6).reshape(3, 2)
    mask = torch.tensor([[1, 0], [1, 1], [0, 1]])
    a = codec.decode_field("a", [stored(s) for s in codec.encode_field("a", ids, 3)[1]], nested_output=True)
    b = codec.decode_field("b", [stored(s) for s in codec.encode_field("b", mask, 3)[1]], nested_output=True)
    assert a.offsets() is b.offsets()
    assert torch.equal(torch.stack((a * b).unbind()), ids * mask)
    a.values().fill_(-1)  # each batch owns its values
    again = codec.decode_field("a", [stored(s) for s in codec.encode_field("a", ids, 3)[1]], nested_output=True)
    assert torch.equal(torch.stack(again.unbind()), ids)
    assert again.offsets().tolist() == [0, 2, 4, 6]
    padded = torch.nested.to_padded_tensor(again, 0)  # the seqlen bounds still size the padding
    assert padded.shape == (3, 2)


# --------------------------------------------------------------------------------------------
# nested tensors
# --------------------------------------------------------------------------------------------


def test_jagged_roundtrip() -> None:
    parts = [torch.randn(3, 4), torch.randn(0, 4), torch.randn(5, 4)]
    nt = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    schema, per_sample = codec.encode_field("resp", nt, 3)
    assert schema == {"kind": "jagged", "dtype": "float32", "shape": None}
    # each component is stored on its own: the payload is exactly that component's bytes
    assert [len(s[1]) for s in per_sample] == [3 * 4 * 4, 0, 5 * 4 * 4]
    out = codec.decode_field("resp", [stored(s) for s in per_sample])
    assert out.is_nested and out.layout == torch.jagged
    assert torch.equal(out.offsets(), torch.tensor([0, 3, 3, 8]))
    for p, q in zip(parts, out.unbind()):
        assert torch.equal(p, q)


def test_jagged_bf16_1d_components_are_zero_copy() -> None:
    parts = [random_tensor(torch.bfloat16, (n,), seed=n) for n in (4, 1, 7)]
    nt = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    _, per_sample = codec.encode_field("x", nt, 3)
    assert np.shares_memory(np.frombuffer(per_sample[2][1], np.uint8), nt.values().view(torch.uint8).numpy())
    out = codec.decode_field("x", [stored(s) for s in per_sample])
    assert out.dtype == torch.bfloat16
    assert [tensor_bytes(p) for p in out.unbind()] == [tensor_bytes(p) for p in parts]


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool])
def test_one_d_jagged_rows_decode_like_the_general_path(dtype: torch.dtype, scan) -> None:
    # rows read through row_lengths (no header per sample) must equal what per-sample headers give
    parts = [random_tensor(dtype, (n,), seed=n) for n in (5, 0, 1, 9)]
    _, per_sample = codec.encode_field("tokens", torch.nested.as_nested_tensor(parts, layout=torch.jagged), 4)
    values = [stored(s) for s in per_sample]
    mvs = [memoryview(v) for v in values]
    code = dtypes.dtype_code("tokens", dtype)
    assert wireformat.row_lengths(mvs, wireformat.K_JAGGED, code, dtype.itemsize) == [5, 0, 1, 9]
    for stored_as in (values, mvs, [bytearray(v) for v in values]):
        out = codec.decode_field("tokens", stored_as)
        assert out.layout == torch.jagged and out.dtype == dtype
        assert torch.equal(out.offsets(), torch.tensor([0, 5, 5, 6, 15]))
        assert [tensor_bytes(p) for p in out.unbind()] == [tensor_bytes(p) for p in parts]


@pytest.mark.parametrize("dtype", [d for d in COMMON_DTYPES if _creatable(d)], ids=str)
def test_small_and_large_batches_decode_alike_whether_joined_or_copied(dtype: torch.dtype, monkeypatch, scan) -> None:
    # a field up to JOIN_MAX_BYTES is joined into one new buffer, a larger one copied natively:
    # the same bytes, shapes and jagged bounds either way, in memory the output owns
    parts = [random_tensor(dtype, (n, 2), seed=n) for n in (3, 0, 1, 6)]
    jagged = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    dense = random_tensor(dtype, (4, 3), seed=7)
    stored_values = {}
    for name, value in (("j", jagged), ("d", dense)):
        _, per_sample = codec.encode_field(name, value, 4)
        stored_values[name] = [bytearray(stored(s)) for s in per_sample]
    decoded = {}
    for limit in (codec.JOIN_MAX_BYTES, 0):
        monkeypatch.setattr(codec, "JOIN_MAX_BYTES", limit)
        decoded[limit] = {name: codec.decode_field(name, values) for name, values in stored_values.items()}
    for out in decoded.values():
        assert [tensor_bytes(p) for p in out["j"].unbind()] == [tensor_bytes(p) for p in parts]
        assert torch.equal(out["j"].offsets(), torch.tensor([0, 3, 3, 4, 10]))
        assert out["d"].shape == dense.shape and tensor_bytes(out["d"]) == tensor_bytes(dense)
    joined = decoded[codec.JOIN_MAX_BYTES]
    for values in stored_values.values():  # the output is a copy: clobbering the reads leaves it intact
        for v in values:
            v[:] = bytes(len(v))
    assert tensor_bytes(joined["d"]) == tensor_bytes(dense)
    assert [tensor_bytes(p) for p in joined["j"].unbind()] == [tensor_bytes(p) for p in parts]
    joined["d"].view(torch.uint8).fill_(0)  # and writable
    assert not any(tensor_bytes(joined["d"]))


def test_a_field_of_empty_rows_decodes_through_the_join(scan) -> None:
    jagged = torch.nested.as_nested_tensor([torch.zeros(0), torch.zeros(0)], layout=torch.jagged)
    _, per_sample = codec.encode_field("j", jagged, 2)
    out = codec.decode_field("j", [stored(s) for s in per_sample])
    assert out.layout == torch.jagged and out.values().numel() == 0
    assert torch.equal(out.offsets(), torch.tensor([0, 0, 0]))


@pytest.mark.parametrize("dtype", [d for d in COMMON_DTYPES if _creatable(d)], ids=str)
@pytest.mark.parametrize("nested_output", [False, True])
def test_the_native_joins_decode_exactly_as_python_does(dtype: torch.dtype, nested_output: bool, monkeypatch) -> None:
    # a claim's small fields take batchscan's joins: same class, dtype, shape, bounds and bytes
    fields = {
        "tokens": torch.nested.as_nested_tensor(
            [random_tensor(dtype, (n,), seed=n) for n in (4, 0, 1, 7)], layout=torch.jagged
        ),
        "scalar": random_tensor(dtype, (4,), seed=2),
        "per_row": random_tensor(dtype, (4, 1), seed=3),
        "block": random_tensor(dtype, (4, 2, 3), seed=4),
    }
    values = {}
    for name, value in fields.items():
        per_sample = codec.encode_field(name, value, 4)[1]
        values[name] = [stored(s) for s in per_sample]
    native = {name: codec.decode_field(name, v, nested_output=nested_output) for name, v in values.items()}
    monkeypatch.setattr(batchscan, "_native", None)
    monkeypatch.setattr(batchscan, "NATIVE", False)
    python = {name: codec.decode_field(name, v, nested_output=nested_output) for name, v in values.items()}
    for name in fields:
        a, b = native[name], python[name]
        assert type(a) is type(b) and a.dtype == b.dtype and a.is_nested == b.is_nested, name
        if a.is_nested:
            assert torch.equal(a.offsets(), b.offsets()) and tensor_bytes(a.values()) == tensor_bytes(b.values())
            bounds = [{k: t.shape[0] for k, t in x._metadata_cache.items()} for x in (a, b)]
            assert bounds[0] == bounds[1] and bounds[0].keys() == {"min_seqlen", "max_seqlen"}
            assert [tensor_bytes(r) for r in a.unbind()] == [tensor_bytes(r) for r in b.unbind()]
        else:
            assert a.shape == b.shape and tensor_bytes(a) == tensor_bytes(b)


def test_row_lengths_declines_values_it_cannot_vouch_for() -> None:
    code = dtypes.dtype_code("t", torch.int64)
    rows = [stored(s) for s in codec.encode_field("t", torch.nested.as_nested_tensor(
        [torch.arange(3), torch.arange(2)], layout=torch.jagged), 2)[1]]  # fmt: skip
    wide = [torch.ones(3, 2, dtype=torch.int64), torch.ones(1, 2, dtype=torch.int64)]
    two_d = [stored(s) for s in codec.encode_field("t", torch.nested.as_nested_tensor(wide, layout=torch.jagged), 2)[1]]
    mvs = [memoryview(v) for v in rows]
    assert wireformat.row_lengths(mvs, wireformat.K_JAGGED, code, 8) == [3, 2]
    assert wireformat.row_lengths(mvs, wireformat.K_JAGGED, code + 1, 8) is None  # another dtype
    assert wireformat.row_lengths(mvs, wireformat.K_TENSOR, code, 8) is None  # another kind
    assert wireformat.row_lengths([memoryview(v) for v in two_d], wireformat.K_JAGGED, code, 8) is None
    assert wireformat.row_lengths([mvs[0], mvs[1][:-1]], wireformat.K_JAGGED, code, 8) is None  # truncated
    assert wireformat.row_lengths([mvs[0], memoryview(rows[1] + b"x")], wireformat.K_JAGGED, code, 8) is None
    assert wireformat.row_lengths([mvs[0], mvs[1][:4]], wireformat.K_JAGGED, code, 8) is None  # shorter than a header
    negative = rows[1][:8] + struct.pack("<q", -1) + rows[1][16:]
    assert wireformat.row_lengths([mvs[0], memoryview(negative)], wireformat.K_JAGGED, code, 8) is None


def test_a_bad_row_among_jagged_rows_is_still_named(scan) -> None:
    # the fast path declines, so the per-sample check names the sample and what is wrong
    rows = [stored(s) for s in codec.encode_field("t", torch.nested.as_nested_tensor(
        [torch.arange(3), torch.arange(2), torch.arange(4)], layout=torch.jagged), 3)[1]]  # fmt: skip
    with pytest.raises(StorageError, match="'t', sample 2.*truncated"):
        codec.decode_field("t", [rows[0], rows[1], rows[2][:-3]])
    with pytest.raises(StorageError, match="sample 1.*magic"):
        codec.decode_field("t", [rows[0], b"XX" + rows[1][2:], rows[2]])


def test_jagged_narrowed_with_holes_falls_back_and_roundtrips() -> None:
    values = torch.arange(20.0).reshape(10, 2)
    offsets = torch.tensor([0, 4, 7, 10])
    lengths = torch.tensor([2, 1, 3])
    nt = torch.nested.nested_tensor_from_jagged(values, offsets, lengths=lengths)
    expected = list(nt.unbind())
    _, out = roundtrip("x", nt, 3)
    assert out.layout == torch.jagged
    assert [p.tolist() for p in out.unbind()] == [e.tolist() for e in expected]


def test_strided_nested_roundtrip() -> None:
    parts = [torch.randn(2, 3), torch.randn(4, 1), torch.randn(0, 2)]
    nt = torch.nested.as_nested_tensor(parts)  # default strided layout
    schema, out = roundtrip("img", nt, 3)
    assert schema == {"kind": "strided", "dtype": "float32", "shape": None}
    assert out.is_nested and out.layout == torch.strided
    for p, q in zip(parts, out.unbind()):
        assert torch.equal(p, q)


def test_jagged_output_pads_to_its_longest_row() -> None:
    """The decoded jagged tensor knows its row bounds, so padding stops at the longest row."""
    nt = torch.nested.as_nested_tensor([torch.ones(2), torch.ones(5), torch.ones(1)], layout=torch.jagged)
    _, out = roundtrip("x", nt, 3)
    assert out.to_padded_tensor(0.0).shape == (3, 5)
    _, per_sample = codec.encode_field("y", torch.ones(3, 4), 3)
    dense = codec.decode_field("y", [stored(s) for s in per_sample], nested_output=True)
    assert dense.is_nested and dense.to_padded_tensor(0.0).shape == (3, 4)


def test_strided_field_with_one_ragged_dim_comes_back_jagged_with_nested_output() -> None:
    parts = [torch.randn(2, 3), torch.randn(4, 3)]
    _, per_sample = codec.encode_field("s", torch.nested.as_nested_tensor(parts), 2)
    out = codec.decode_field("s", [stored(s) for s in per_sample], nested_output=True)
    assert out.layout == torch.jagged and len(out) == 2
    assert all(torch.equal(p, q) for p, q in zip(out.unbind(), parts))
    # two ragged dims cannot be jagged: the field stays strided
    _, per_sample = codec.encode_field("s", torch.nested.as_nested_tensor([torch.ones(2, 3), torch.ones(4, 1)]), 2)
    out = codec.decode_field("s", [stored(s) for s in per_sample], nested_output=True)
    assert out.layout == torch.strided


def test_nested_batch_size_mismatch() -> None:
    nt = torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(BatchSizeMismatch, match="'x' has 2 samples"):
        codec.encode_field("x", nt, 3)


# --------------------------------------------------------------------------------------------
# numpy arrays
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arr",
    [
        np.array([b"ab", b"", b"xyz\x00q"]),
        np.array(["ab", "", "déjà-vu ✓"]),
        np.array([[1.5, np.nan], [np.inf, -0.0], [3, 4]], dtype=np.float32),
        np.array([1, 2, 3], dtype=">i4"),
        np.array(["2020-01-01", "NaT", "1999-12-31"], dtype="datetime64[ns]"),
        np.array([[True], [False], [True]]),
        np.array([[b"a", b"bc"], [b"d", b"e"], [b"", b"f"]]),
    ],
    ids=["bytes", "unicode", "float32-2d", "big-endian", "datetime", "bool", "bytes-2d"],
)
def test_ndarray_raw_roundtrip(arr: np.ndarray) -> None:
    schema, out = roundtrip("a", arr, 3)
    assert schema["kind"] == "ndarray"
    assert schema["dtype"] == arr.dtype.str and schema["shape"] == list(arr.shape[1:])
    assert isinstance(out, np.ndarray)
    assert_same(out, arr)


def test_ndarray_raw_is_zero_copy() -> None:
    arr = np.array(["alpha", "beta", "gamma"])
    _, per_sample = codec.encode_field("a", arr, 3)
    assert np.shares_memory(np.frombuffer(per_sample[1][1], np.uint8), arr)


def test_ndarray_object_roundtrip() -> None:
    arr = np.empty(4, dtype=object)
    arr[:] = [{"a": 1, "b": [1, 2]}, None, "text", np.array([1.0, 2.0, np.nan])]
    schema, out = roundtrip("o", arr, 4)
    assert schema == {"kind": "ndarray", "dtype": "|O", "shape": []}
    assert out.dtype == object and out.shape == (4,)
    assert_same(out, arr)


def test_ndarray_object_2d_with_list_elements() -> None:
    arr = np.empty((2, 2), dtype=object)
    arr[0, 0], arr[0, 1], arr[1, 0], arr[1, 1] = [1, 2], (3,), {"k": "v"}, []
    _, out = roundtrip("o", arr, 2)
    assert out.shape == (2, 2)
    assert_same(out, arr)


def test_ndarray_object_empty_per_sample() -> None:
    arr = np.empty((3, 0), dtype=object)
    schema, out = roundtrip("o", arr, 3)
    assert schema["shape"] == [0] and out.shape == (3, 0) and out.dtype == object


def test_string_arrays_of_different_lengths_are_promoted() -> None:
    v1 = [stored(s) for s in codec.encode_field("s", np.array(["a", "bb"]), 2)[1]]
    v2 = [stored(s) for s in codec.encode_field("s", np.array(["cccc"]), 1)[1]]
    out = codec.decode_field("s", v1 + v2)
    assert out.tolist() == ["a", "bb", "cccc"] and out.dtype == np.dtype("<U4")


def test_structured_ndarray_is_unsupported() -> None:
    arr = np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])
    with pytest.raises(UnsupportedValue, match="'rec'"):
        codec.encode_field("rec", arr, 3)


# --------------------------------------------------------------------------------------------
# object values (NonTensorStack, lists, dicts)
# --------------------------------------------------------------------------------------------


def test_nontensorstack_of_dicts_roundtrip() -> None:
    items = [{"id": 1, "tags": ["a", "b"]}, {"id": 2, "score": float("nan")}, {"nested": {"t": (1, 2)}}]
    nts = NonTensorStack(*items)
    schema, out = roundtrip("meta", nts, 3)
    assert schema == {"kind": "object", "dtype": None, "shape": None}
    assert isinstance(out, NonTensorStack) and out.batch_size == (3,)
    assert_same(out.tolist(), items)


def test_list_of_strings_and_ints_directly() -> None:
    _, out = roundtrip("s", ["a", "bb", "ccc"], 3)
    assert isinstance(out, NonTensorStack) and out.tolist() == ["a", "bb", "ccc"]
    _, out = roundtrip("i", [1, -2, 2**40], 3)
    assert isinstance(out, NonTensorStack) and out.tolist() == [1, -2, 2**40]
    assert [type(v) for v in out.tolist()] == [int, int, int]


def test_object_values_kinds() -> None:
    items = [
        None,
        3.5,
        float("inf"),
        float("nan"),
        np.float32(1.25),
        np.int64(-7),
        {"t": torch.tensor([1.5, 2.5], dtype=torch.bfloat16), "ok": True},
        [1, [2, (3, "x")], {"k": None}],
    ]
    _, out = roundtrip("o", items, len(items))
    assert_same(out.tolist(), items)


def test_nontensordata_broadcasts_to_every_sample() -> None:
    ntd = NonTensorData({"shared": 1}, batch_size=[3])
    schema, out = roundtrip("cfg", ntd, 3)
    assert schema["kind"] == "object"
    assert out.tolist() == [{"shared": 1}] * 3


def test_nontensordata_holding_one_value_per_sample_is_split() -> None:
    """As the reference does: a list of n values for a batch of n is one value per sample."""
    ntd = NonTensorData(["a", "b", "c"], batch_size=[3])
    _, out = roundtrip("label", ntd, 3)
    assert out.tolist() == ["a", "b", "c"]
    _, shared = roundtrip("label", NonTensorData(["a", "b"], batch_size=[3]), 3)
    assert shared.tolist() == [["a", "b"]] * 3  # another length: still one value for every sample


def test_tensordict_roundtrip_all_kinds() -> None:
    n = 4
    td = TensorDict(
        {
            "ids": torch.arange(n * 3).reshape(n, 3),
            "mask": torch.tensor([True, False, True, True]),
            "logp": random_tensor(torch.bfloat16, (n, 2)),
            "ints": [1, 2, 3, 4],  # tensordict turns this into an int64 tensor
            "prompt": ["a", "b", "c", "d"],
            # a NonTensorStack of tensors (tensordict >= 0.11 makes one of [[1], [2, 3], [], [4, 5, 6]] by itself;
            # 0.10 refuses a list holding [], so it is built as every tensordict version takes it)
            "ragged": NonTensorStack(*[NonTensorData(torch.tensor(r)) for r in ([1], [2, 3], [], [4, 5, 6])]),
            "info": [{"i": i} for i in range(n)],
            "resp": torch.nested.as_nested_tensor(
                [torch.arange(k, dtype=torch.float32) for k in (1, 3, 2, 4)], layout=torch.jagged
            ),
            "raw": np.array([b"x", b"yy", b"zzz", b""]),
            "uid": np.array(["u0", "u1", "u2", "u3"]),
            "obj": np.array([{"a": 1}, None, "s", 2], dtype=object),
        },
        batch_size=n,
    )
    encoded = codec.encode_tensordict(td)
    assert set(encoded) == set(td.keys())
    assert encoded["ints"][0] == {"kind": "tensor", "dtype": "int64", "shape": []}
    assert encoded["prompt"][0]["kind"] == "object"
    assert encoded["raw"][0]["kind"] == "ndarray"
    out = codec.decode_tensordict({k: [stored(s) for s in v[1]] for k, v in encoded.items()}, n)
    assert out.batch_size == (n,)
    for key in ("ids", "mask", "ints"):
        assert torch.equal(out[key], td[key])
    assert tensor_bytes(out["logp"]) == tensor_bytes(td["logp"])
    assert out["ints"].shape == (n,)
    for key in ("prompt", "info"):
        assert out.get(key).tolist() == td.get(key).tolist()
    assert_same(list(out.get("ragged").tolist()), list(td.get("ragged").tolist()))
    assert out["resp"].layout == torch.jagged
    for p, q in zip(out["resp"].unbind(), td["resp"].unbind()):
        assert torch.equal(p, q)
    for key in ("raw", "uid", "obj"):
        assert_same(out[key], td[key])
    # decoded rows index like the original
    assert out[2]["prompt"] == "c" and out[1]["info"] == {"i": 1}


# --------------------------------------------------------------------------------------------
# safe object encoding
# --------------------------------------------------------------------------------------------


def test_unsupported_object_names_field_type_and_escape_hatch() -> None:
    with pytest.raises(UnsupportedValue) as err:
        codec.encode_field("payload", [Opaque(1), Opaque(2)], 2)
    msg = str(err.value)
    assert "payload" in msg and "Opaque" in msg and "allow_pickle=True" in msg
    with pytest.raises(UnsupportedValue, match="'t', sample 1.*SplitResult"):  # not the program's class, and
        codec.encode_field("t", [(1, 2), urllib.parse.urlsplit("http://h/p")], 2)  # not silently flattened
    _, per_sample = codec.encode_field("t", [(1, 2), Point(1, 2)], 2)  # the program's own namedtuple
    assert [type(x) for x in codec.decode_field("t", [stored(s) for s in per_sample]).tolist()] == [tuple, Point]


def test_allow_pickle_roundtrip_and_refusal_on_decode() -> None:
    schema, per_sample = codec.encode_field("p", [Opaque(1), {"x": Opaque(2)}], 2, allow_pickle=True)
    values = [stored(s) for s in per_sample]
    out = codec.decode_field("p", values, allow_pickle=True)
    assert out.tolist() == [Opaque(1), {"x": Opaque(2)}]
    with pytest.raises(UnsupportedValue, match=r"'p', sample 0.*pickle"):
        codec.decode_field("p", values)


def test_pickle_inside_object_ndarray_refused() -> None:
    arr = np.array([Opaque(1), 2], dtype=object)
    with pytest.raises(UnsupportedValue, match="'arr', sample 0"):
        codec.encode_field("arr", arr, 2)
    _, per_sample = codec.encode_field("arr", arr, 2, allow_pickle=True)
    with pytest.raises(UnsupportedValue, match="pickle"):
        codec.decode_field("arr", [stored(s) for s in per_sample])


def test_corrupt_values_raise_storage_error() -> None:
    _, per_sample = codec.encode_field("x", torch.ones(2, 3), 2)
    good = stored(per_sample[0])
    with pytest.raises(StorageError, match="magic"):
        codec.decode_field("x", [b"XX" + good[2:]])
    with pytest.raises(StorageError, match="too short"):
        codec.decode_field("x", [b"TQ"])
    with pytest.raises(StorageError, match="truncated"):
        codec.decode_field("x", [good[:-1]])
    with pytest.raises(StorageError, match="version"):
        codec.decode_field("x", [good[:2] + bytes([99]) + good[3:]])


def _forged(kind: int, shape: tuple[int, ...], extra: bytes, payload: bytes) -> bytes:
    """A stored value built by hand (magic, version 1, kind, dtype code 0, shape, extra)."""
    head = struct.pack(f"<2sBBBBH{len(shape)}q", b"TQ", 1, kind, 0, len(shape), len(extra), *shape) + extra
    return head + b"\0" * (-len(head) % 8) + payload


def test_hostile_headers_are_rejected_before_allocating() -> None:
    # raw bytes must never be reinterpreted as object pointers: object arrays only go through msgpack
    with pytest.raises(StorageError, match="object encoding"):
        codec.decode_field("a", [_forged(wireformat.K_NDARRAY, (1,), b"|O", b"\x01" * 8)])
    with pytest.raises(StorageError, match="not allowed"):
        codec.decode_field("a", [_forged(wireformat.K_NDARRAY, (1,), b"|V8", b"\x01" * 8)])
    with pytest.raises(StorageError, match="corrupt"):
        codec.decode_field("t", [_forged(wireformat.K_TENSOR, (-2, -4), b"", b"\0" * 8)])
    # a 2**40-element header with an 8-byte payload fails the length check, not the allocator
    with pytest.raises(StorageError, match="truncated or corrupt"):
        codec.decode_field("t", [_forged(wireformat.K_NDARRAY, (2**20, 2**20), b"<f8", b"\0" * 8)])
    assert codec.decode_field("ok", [_forged(wireformat.K_NDARRAY, (2,), b"<i4", b"\1\0\0\0\2\0\0\0")]).tolist() \
        == [[1, 2]]


# --------------------------------------------------------------------------------------------
# errors: batch size, unsupported fields, empties
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        torch.ones(4, 2),
        np.zeros(4),
        ["a"] * 4,
        NonTensorStack(*range(4)),
        torch.tensor(1.0),
        np.array(3),
    ],
    ids=["tensor", "ndarray", "list", "nontensorstack", "0d-tensor", "0d-array"],
)
def test_batch_size_mismatch(value: Any) -> None:
    with pytest.raises(BatchSizeMismatch, match="'f'") as err:
        codec.encode_field("f", value, 3)
    assert "batch has 3" in str(err.value)
    with pytest.raises(BatchSizeMismatch):
        schemas.describe_field("f", value, 3)


@pytest.mark.parametrize(
    "value",
    [42, "a string", {"a": 1}, torch.ones(3, 3).to_sparse(), TensorDict({"a": torch.ones(3)}, batch_size=3)],
    ids=["int", "str", "dict", "sparse", "nested-td"],
)
def test_unsupported_field_values(value: Any) -> None:
    with pytest.raises(UnsupportedValue, match="'f'"):
        codec.encode_field("f", value, 3)


def test_empty_batches() -> None:
    with pytest.raises(EmptyBatch):
        codec.encode_tensordict(TensorDict({"x": torch.ones(0, 2)}, batch_size=0))
    with pytest.raises(EmptyBatch):
        codec.encode_tensordict(TensorDict({}, batch_size=3))
    with pytest.raises(EmptyBatch):
        codec.encode_tensordict(TensorDict({"x": torch.ones(2)}))  # no batch dimension
    with pytest.raises(EmptyBatch):
        codec.encode_field("x", torch.ones(0, 2), 0)
    with pytest.raises(EmptyBatch):
        codec.decode_field("x", [])
    with pytest.raises(EmptyBatch):
        codec.decode_tensordict({}, 3)


def test_decode_tensordict_value_count_mismatch() -> None:
    _, per_sample = codec.encode_field("x", torch.ones(2), 2)
    with pytest.raises(BatchSizeMismatch, match="'x'"):
        codec.decode_tensordict({"x": [stored(s) for s in per_sample]}, 3)


# --------------------------------------------------------------------------------------------
# schemas
# --------------------------------------------------------------------------------------------


def test_encode_field_returns_the_described_schema() -> None:
    cases = {
        "t": torch.ones(2, 3, dtype=torch.float16),
        "j": torch.nested.as_nested_tensor([torch.ones(1), torch.ones(2)], layout=torch.jagged),
        "s": torch.nested.as_nested_tensor([torch.ones(1, 2), torch.ones(2, 2)]),
        "a": np.array(["x", "yy"]),
        "o": [{"a": 1}, None],
    }
    for name, value in cases.items():
        assert codec.encode_field(name, value, 2)[0] == schemas.describe_field(name, value, 2)


# --------------------------------------------------------------------------------------------
# property tests
# --------------------------------------------------------------------------------------------

_shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(COMMON_DTYPES),
    batch=st.integers(1, 5),
    shape=_shapes,
    seed=st.integers(0, 2**31 - 1),
    transpose=st.booleans(),
)
def test_property_dense_roundtrip(
    dtype: torch.dtype, batch: int, shape: tuple[int, ...], seed: int, transpose: bool
) -> None:
    x = random_tensor(dtype, (batch, *shape), seed=seed)
    if transpose and len(shape) >= 2:
        x = x.transpose(-1, -2)
    schema, out = roundtrip("x", x, batch)
    assert schema["shape"] == list(x.shape[1:])
    assert out.dtype == dtype and out.shape == x.shape
    assert tensor_bytes(out) == tensor_bytes(x)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(COMMON_DTYPES),
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=5),
    rest=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_jagged_roundtrip(dtype: torch.dtype, lengths: list[int], rest: tuple, seed: int) -> None:
    parts = [random_tensor(dtype, (n, *rest), seed=seed + i) for i, n in enumerate(lengths)]
    nt = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    _, out = roundtrip("x", nt, len(parts))
    assert out.layout == torch.jagged and out.dtype == dtype
    assert [tensor_bytes(p) for p in out.unbind()] == [tensor_bytes(p) for p in parts]


@settings(max_examples=200, deadline=None)
@given(items=st.lists(python_objects, min_size=1, max_size=4))
def test_property_object_roundtrip(items: list) -> None:
    _, out = roundtrip("o", items, len(items))
    assert isinstance(out, NonTensorStack)
    assert_same(list(out.tolist()), items)


@pytest.mark.parametrize("lengths", [[1, 1, 1], [3, 0, 2], [0, 0], [5]])
def test_jagged_tensor_is_what_torchs_public_constructor_builds(lengths):
    from tq_redis.meta.jagged import jagged_tensor

    values = torch.arange(sum(lengths) * 2, dtype=torch.float32).reshape(sum(lengths), 2)
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    ours = jagged_tensor(values, offsets, min(lengths), max(lengths))
    theirs = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=min(lengths), max_seqlen=max(lengths))
    assert ours.layout == theirs.layout == torch.jagged and ours.shape[0] == theirs.shape[0]
    assert [a.tolist() for a in ours.unbind()] == [b.tolist() for b in theirs.unbind()]
    assert torch.equal(ours.to_padded_tensor(-1.0), theirs.to_padded_tensor(-1.0))
    assert ours.offsets().tolist() == theirs.offsets().tolist()
    # the row-length bounds, and their sizes marked dynamic for torch.compile as the class marks them
    assert (ours._min_seqlen, ours._max_seqlen) == (theirs._min_seqlen, theirs._max_seqlen)
    for key in ("min_seqlen", "max_seqlen"):
        assert ours._metadata_cache[key]._dynamo_dynamic_indices == theirs._metadata_cache[key]._dynamo_dynamic_indices


def test_assemble_skips_the_checks_only_for_tensor_columns(monkeypatch):
    """Tensor columns (dense and jagged) are assembled without TensorDict's checks and give the
    same TensorDict as the checked constructor; a non-tensor column takes the checked path."""
    dense = torch.arange(6).reshape(3, 2)
    rows = torch.nested.nested_tensor([torch.arange(k) for k in (1, 3, 2)], layout=torch.jagged)
    _schema, stored = codec.encode_field("j", rows, 3)
    jagged = codec.decode_field("j", [b"".join(bytes(seg) for seg in value) for value in stored], nested_output=True)
    assert jagged.is_nested
    checked = TensorDict({"d": dense, "j": jagged}, batch_size=[3])

    calls: list[str] = []
    real = TensorDict.__init__

    def spying_init(self, *args, **kwargs):
        calls.append("checked")
        real(self, *args, **kwargs)

    monkeypatch.setattr(TensorDict, "__init__", spying_init)
    fast = codec.assemble({"d": dense, "j": jagged}, 3)
    assert calls == [] and fast.batch_size == torch.Size([3])
    assert torch.equal(fast["d"], checked["d"])
    assert all(torch.equal(a, b) for a, b in zip(fast["j"].unbind(), checked["j"].unbind(), strict=True))
    wrapped = codec.assemble({"d": dense, "s": ["a", "b", "c"]}, 3)
    assert calls == ["checked"] and wrapped["s"] == ["a", "b", "c"]
