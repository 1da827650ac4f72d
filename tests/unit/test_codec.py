"""Unit tests for tq_redis.codec: per-sample encoding of batch fields and the safe object encoding."""

from __future__ import annotations

import collections
import json
import math
import struct
import warnings
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tq_redis import codec, fastcopy
from tq_redis.errors import (
    BatchSizeMismatch,
    DTypeConflict,
    EmptyBatch,
    SchemaConflict,
    ShapeConflict,
    StorageError,
    UnsupportedValue,
)

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


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a: Any, b: Any) -> None:
    """Deep equality that checks exact types and treats NaN as equal to NaN."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.layout == b.layout and a.is_nested == b.is_nested
        if a.is_nested:
            ua, ub = a.unbind(), b.unbind()
            assert len(ua) == len(ub)
            for x, y in zip(ua, ub):
                assert_same(x, y)
        else:
            assert a.shape == b.shape
            assert tensor_bytes(a) == tensor_bytes(b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.dtype.kind == "O":
            for x, y in zip(a.reshape(-1), b.reshape(-1)):
                assert_same(x, y)
        else:
            assert a.tobytes() == b.tobytes()
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or a == b
    elif isinstance(a, complex):
        assert_same(a.real, b.real)
        assert_same(a.imag, b.imag)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infs, denormals included) of any dtype."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = dtype.itemsize
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


class Opaque:
    """A user class msgpack cannot represent; module level so pickle can find it."""

    def __init__(self, x: int):
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.x == self.x


Point = collections.namedtuple("Point", "x y")

ALL_DTYPES = sorted(codec._DTYPE_TO_CODE, key=str)
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
def test_dense_roundtrip_every_dtype_bit_exact(dtype: torch.dtype) -> None:
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


def test_dense_decode_is_writable_and_warning_free_from_readonly_bytes() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _, per_sample = codec.encode_field("x", x, 3)
    values = [stored(s) for s in per_sample]  # immutable bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = codec.decode_field("x", values)
    out += 1  # writable, owns its memory
    assert torch.equal(out, x + 1)
    assert values == [stored(s) for s in codec.encode_field("x", x, 3)[1]]


def test_decode_accepts_bytes_bytearray_memoryview_and_uint8_tensor() -> None:
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


def test_nested_output_option_returns_jagged_like_reference() -> None:
    x = torch.arange(12).reshape(3, 4)
    _, per_sample = codec.encode_field("x", x, 3)
    out = codec.decode_field("x", [stored(s) for s in per_sample], nested_output=True)
    assert out.is_nested and out.layout == torch.jagged
    assert all(torch.equal(p, x[i]) for i, p in enumerate(out.unbind()))
    scalar = codec.decode_field(
        "y", [stored(s) for s in codec.encode_field("y", torch.arange(3), 3)[1]], nested_output=True
    )
    assert not scalar.is_nested and scalar.tolist() == [0, 1, 2]


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
            "ragged": [[1], [2, 3], [], [4, 5, 6]],  # NonTensorStack of tensors
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


def test_encode_object_exact_types() -> None:
    obj = {
        "tuple": (1, (2, 3)),
        "set": {1, 2},
        "frozen": frozenset({"a"}),
        "complex": 1 - 2j,
        "big": 2**100,
        "neg_big": -(2**90),
        "huge": 7**6000,  # beyond int's 4300-digit str() limit
        "bytes": b"\x00\xff",
        "nan": float("nan"),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "np_dtype": np.dtype("<U3"),
        "np": [np.bool_(True), np.str_("s"), np.bytes_(b"b"), np.str_(""), np.datetime64("2020-01-01")],
        "arr": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "t": torch.tensor([[1, 2]], dtype=torch.int8),
        "jag": torch.nested.as_nested_tensor([torch.ones(2), torch.ones(1)], layout=torch.jagged),
        1: "int key",
        (1, 2): "tuple key",
    }
    out = codec.decode_object(codec.encode_object(obj))
    assert_same(out, obj)
    assert out["set"] == {1, 2} and type(out["frozen"]) is frozenset


def test_encode_object_container_subclasses_become_base_types() -> None:
    out = codec.decode_object(codec.encode_object(collections.OrderedDict(b=1, a=2)))
    assert type(out) is dict and list(out) == ["b", "a"]


def test_unsupported_object_names_field_type_and_escape_hatch() -> None:
    with pytest.raises(UnsupportedValue) as err:
        codec.encode_field("payload", [Opaque(1), Opaque(2)], 2)
    msg = str(err.value)
    assert "payload" in msg and "Opaque" in msg and "allow_pickle=True" in msg
    with pytest.raises(UnsupportedValue, match="Opaque"):
        codec.encode_object({"deep": [Opaque(3)]})
    with pytest.raises(UnsupportedValue, match="Point"):
        codec.encode_object(Point(1, 2))  # a namedtuple is not silently flattened to a tuple


def test_allow_pickle_roundtrip_and_refusal_on_decode() -> None:
    schema, per_sample = codec.encode_field("p", [Opaque(1), {"x": Opaque(2)}], 2, allow_pickle=True)
    values = [stored(s) for s in per_sample]
    out = codec.decode_field("p", values, allow_pickle=True)
    assert out.tolist() == [Opaque(1), {"x": Opaque(2)}]
    with pytest.raises(UnsupportedValue, match=r"'p', sample 0.*pickle"):
        codec.decode_field("p", values)
    blob = codec.encode_object(Point(1, 2), allow_pickle=True)
    assert codec.decode_object(blob, allow_pickle=True) == Point(1, 2)
    with pytest.raises(UnsupportedValue, match="allow_pickle"):
        codec.decode_object(blob)


def test_pickle_inside_object_ndarray_refused() -> None:
    arr = np.array([Opaque(1), 2], dtype=object)
    with pytest.raises(UnsupportedValue, match="'arr', sample 0"):
        codec.encode_field("arr", arr, 2)
    _, per_sample = codec.encode_field("arr", arr, 2, allow_pickle=True)
    with pytest.raises(UnsupportedValue, match="pickle"):
        codec.decode_field("arr", [stored(s) for s in per_sample])


def test_too_deep_object_is_unsupported() -> None:
    deep: list = []
    for _ in range(2000):
        deep = [deep]
    with pytest.raises(UnsupportedValue):
        codec.encode_object(deep)


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
    with pytest.raises(StorageError):
        codec.decode_object(b"\xc1garbage")


def _forged(kind: int, shape: tuple[int, ...], extra: bytes, payload: bytes) -> bytes:
    """A stored value built by hand (magic, version 1, kind, dtype code 0, shape, extra)."""
    head = struct.pack(f"<2sBBBBH{len(shape)}q", b"TQ", 1, kind, 0, len(shape), len(extra), *shape) + extra
    return head + b"\0" * (-len(head) % 8) + payload


def test_hostile_headers_are_rejected_before_allocating() -> None:
    # raw bytes must never be reinterpreted as object pointers: object arrays only go through msgpack
    with pytest.raises(StorageError, match="object encoding"):
        codec.decode_field("a", [_forged(codec._K_NDARRAY, (1,), b"|O", b"\x01" * 8)])
    forged = _forged(codec._K_NDARRAY, (1,), b"|O", b"\x01" * 8)
    ext = msgpack.packb(msgpack.ExtType(codec._EXT_NDARRAY, forged))
    with pytest.raises(StorageError, match="cannot be read from bytes"):
        codec.decode_object(ext)
    with pytest.raises(StorageError, match="not allowed"):
        codec.decode_field("a", [_forged(codec._K_NDARRAY, (1,), b"|V8", b"\x01" * 8)])
    with pytest.raises(StorageError, match="corrupt"):
        codec.decode_field("t", [_forged(codec._K_TENSOR, (-2, -4), b"", b"\0" * 8)])
    # a 2**40-element header with an 8-byte payload fails the length check, not the allocator
    with pytest.raises(StorageError, match="truncated or corrupt"):
        codec.decode_field("t", [_forged(codec._K_NDARRAY, (2**20, 2**20), b"<f8", b"\0" * 8)])
    assert codec.decode_field("ok", [_forged(codec._K_NDARRAY, (2,), b"<i4", b"\1\0\0\0\2\0\0\0")]).tolist() \
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
        codec.describe_field("f", value, 3)


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


def test_describe_field_matches_encode_and_is_json_safe() -> None:
    cases = {
        "t": torch.ones(2, 3, dtype=torch.float16),
        "j": torch.nested.as_nested_tensor([torch.ones(1), torch.ones(2)], layout=torch.jagged),
        "s": torch.nested.as_nested_tensor([torch.ones(1, 2), torch.ones(2, 2)]),
        "a": np.array(["x", "yy"]),
        "o": [{"a": 1}, None],
    }
    for name, value in cases.items():
        described = codec.describe_field(name, value, 2)
        assert described == codec.encode_field(name, value, 2)[0]
        assert json.loads(json.dumps(described)) == described


def test_check_compatible_accepts_matching_schemas() -> None:
    reg = codec.describe_field("x", torch.ones(4, 8), 4)
    codec.check_compatible("x", reg, codec.describe_field("x", torch.zeros(2, 8), 2))
    jag = codec.describe_field("r", torch.nested.as_nested_tensor([torch.ones(3)], layout=torch.jagged), 1)
    jag2 = codec.describe_field("r", torch.nested.as_nested_tensor([torch.ones(9)], layout=torch.jagged), 1)
    codec.check_compatible("r", jag, jag2)
    s3 = codec.describe_field("u", np.array([b"abc"]), 1)
    s5 = codec.describe_field("u", np.array([b"abcde"]), 1)
    codec.check_compatible("u", s3, s5)  # string lengths may differ between puts
    codec.check_compatible("o", codec.describe_field("o", ["a"], 1), codec.describe_field("o", [{"b": 1}], 1))


def test_check_compatible_dtype_conflict() -> None:
    reg = codec.describe_field("x", torch.ones(4, 8), 4)
    new = codec.describe_field("x", torch.ones(4, 8, dtype=torch.bfloat16), 4)
    with pytest.raises(DTypeConflict) as err:
        codec.check_compatible("x", reg, new)
    msg = str(err.value)
    assert "float32" in msg and "bfloat16" in msg and "new partition" in msg and "'x'" in msg
    assert isinstance(err.value, SchemaConflict) and isinstance(err.value, TypeError)
    u = codec.describe_field("u", np.array(["a"]), 1)
    b = codec.describe_field("u", np.array([b"a"]), 1)
    with pytest.raises(DTypeConflict):
        codec.check_compatible("u", u, b)


def test_check_compatible_shape_conflicts() -> None:
    reg = codec.describe_field("x", torch.ones(4, 8), 4)
    with pytest.raises(ShapeConflict) as err:
        codec.check_compatible("x", reg, codec.describe_field("x", torch.ones(4, 9), 4))
    assert "[8]" in str(err.value) and "[9]" in str(err.value) and "new field name" in str(err.value)
    jag = codec.describe_field("x", torch.nested.as_nested_tensor([torch.ones(8)], layout=torch.jagged), 1)
    with pytest.raises(ShapeConflict, match="'tensor'.*'jagged'"):
        codec.check_compatible("x", reg, jag)
    strided = codec.describe_field("x", torch.nested.as_nested_tensor([torch.ones(8)]), 1)
    with pytest.raises(ShapeConflict):
        codec.check_compatible("x", jag, strided)


def test_to_batchmeta_schema() -> None:
    dense = codec.to_batchmeta_schema(codec.describe_field("x", torch.ones(2, 3, dtype=torch.bfloat16), 2))
    assert dense == {
        "dtype": torch.bfloat16, "shape": torch.Size([3]), "is_nested": False,
        "is_non_tensor": False, "kind": "tensor",
    }
    jag = codec.to_batchmeta_schema(
        codec.describe_field("j", torch.nested.as_nested_tensor([torch.ones(2)], layout=torch.jagged), 1)
    )
    assert jag == {"dtype": torch.float32, "shape": None, "is_nested": True, "is_non_tensor": False,
                   "kind": "jagged"}
    arr = codec.to_batchmeta_schema(codec.describe_field("a", np.array([b"ab"]), 1))
    assert arr["dtype"] == np.dtype("S2") and arr["is_non_tensor"] and arr["kind"] == "ndarray"
    obj = codec.to_batchmeta_schema(codec.describe_field("o", [1], 1))
    assert obj == {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True, "kind": "object"}


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


_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.binary(max_size=8) | st.complex_numbers(allow_nan=True)
)
_objects = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(_objects, min_size=1, max_size=4))
def test_property_object_roundtrip(items: list) -> None:
    for item in items:
        assert_same(codec.decode_object(codec.encode_object(item)), item)
    _, out = roundtrip("o", items, len(items))
    assert isinstance(out, NonTensorStack)
    assert_same(list(out.tolist()), items)
