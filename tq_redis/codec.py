"""Per-sample codec: one field of a batch <-> one stored value per sample.

A field of a batch (a value of a ``TensorDict``) is split into one stored value per sample, so
each (sample, field) can live under its own key in a KV store. A stored value is a list of buffer
*segments* whose concatenation is the stored bytes: a small self-describing binary header
followed, for tensors and numeric arrays, by a ``memoryview`` of the batch's own memory (no
pickle, no copy for contiguous CPU tensors).

Header layout (little endian, padded to a multiple of 8 bytes so payloads stay aligned)::

    magic b"TQ" | version u8 | kind u8 | dtype code u8 | ndim u8 | extra length u16
    | ndim x int64 shape | extra bytes (numpy dtype string) | zero padding

Kinds and what ``decode_field`` returns for them:

* ``tensor``  - dense tensor, batch dim first -> one stacked dense tensor (one copy).
* ``jagged``  - ``torch.jagged`` nested tensor, one component per sample -> jagged nested tensor.
* ``strided`` - nested tensor with the strided layout -> strided nested tensor.
* ``ndarray`` - numpy array, batch dim first (numeric, ``S``, ``U``, datetime raw; ``object``
  arrays element-wise through the safe object encoding) -> numpy array.
* ``object``  - any other per-sample Python value -> ``NonTensorStack`` (what ``TensorDict``
  itself builds from a list of non-tensor values).

The object encoding is msgpack with extension types for tuples, tensors, arrays, numpy scalars,
sets, complex and big ints, torch dtypes and sizes. It never pickles unless the caller passes
``allow_pickle=True``, and it refuses to unpickle unless the reader passes it too.
"""

from __future__ import annotations

import math
import operator
import pickle
import struct
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import msgpack
import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tq_redis import buffers, fastcopy
from tq_redis.backends.batches import RowBlock, ValueTable
from tq_redis.errors import (
    BatchSizeMismatch,
    DTypeConflict,
    EmptyBatch,
    ShapeConflict,
    StorageError,
    TQError,
    UnsupportedValue,
)

__all__ = [
    "KINDS",
    "check_compatible",
    "decode_field",
    "decode_object",
    "decode_tensordict",
    "describe_field",
    "encode_field",
    "encode_object",
    "encode_tensordict",
    "to_batchmeta_schema",
]

Buffer = bytes | bytearray | memoryview
Segments = list[bytes | memoryview]

KIND_TENSOR = "tensor"
KIND_JAGGED = "jagged"
KIND_STRIDED = "strided"
KIND_NDARRAY = "ndarray"
KIND_OBJECT = "object"
# A field whose puts offered different kinds (the metadata plane widens it, see partition.lua);
# a widened field's dtype is "mixed" when its puts offered different dtypes.
KIND_MIXED = "mixed"
DTYPE_MIXED = "mixed"
KINDS = (KIND_TENSOR, KIND_JAGGED, KIND_STRIDED, KIND_NDARRAY, KIND_OBJECT)

_MAGIC = b"TQ"
_VERSION = 1
_K_TENSOR, _K_JAGGED, _K_STRIDED, _K_NDARRAY, _K_OBJECT = 1, 2, 3, 4, 5
_KIND_CODE = {KIND_TENSOR: _K_TENSOR, KIND_JAGGED: _K_JAGGED, KIND_STRIDED: _K_STRIDED,
              KIND_NDARRAY: _K_NDARRAY, KIND_OBJECT: _K_OBJECT}
_KIND_NAME = {v: k for k, v in _KIND_CODE.items()}

_FIXED = struct.Struct("<2sBBBBH")
_FIXED_SIZE = _FIXED.size  # 8
_SHAPE_STRUCTS: dict[int, struct.Struct] = {}

# Stable on-disk dtype codes: never renumber, only append. Names missing from the running torch
# build are skipped, so an old torch can still read everything it knows.
_TORCH_DTYPE_CODES: tuple[tuple[int, str], ...] = (
    (1, "bool"), (2, "uint8"), (3, "int8"), (4, "int16"), (5, "int32"), (6, "int64"),
    (7, "float16"), (8, "bfloat16"), (9, "float32"), (10, "float64"),
    (11, "complex32"), (12, "complex64"), (13, "complex128"),
    (14, "uint16"), (15, "uint32"), (16, "uint64"),
    (17, "float8_e4m3fn"), (18, "float8_e5m2"), (19, "float8_e4m3fnuz"), (20, "float8_e5m2fnuz"),
    (21, "float8_e8m0fnu"), (22, "float4_e2m1fn_x2"),
    (23, "bits8"), (24, "bits16"), (25, "bits1x8"), (26, "bits2x4"), (27, "bits4x2"),
    (28, "int1"), (29, "int2"), (30, "int3"), (31, "int4"), (32, "int5"), (33, "int6"), (34, "int7"),
    (35, "uint1"), (36, "uint2"), (37, "uint3"), (38, "uint4"), (39, "uint5"), (40, "uint6"),
    (41, "uint7"),
)
_CODE_TO_DTYPE: dict[int, torch.dtype] = {}
_DTYPE_TO_CODE: dict[torch.dtype, int] = {}
_NAME_TO_DTYPE: dict[str, torch.dtype] = {}
_DTYPE_TO_NAME: dict[torch.dtype, str] = {}
for _code, _name in _TORCH_DTYPE_CODES:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _CODE_TO_DTYPE[_code] = _dt
        _DTYPE_TO_CODE[_dt] = _code
        _NAME_TO_DTYPE[_name] = _dt
        _DTYPE_TO_NAME[_dt] = _name
_NO_DTYPE = 0  # numpy kinds carry their dtype string in the header's extra bytes

# numpy dtype kinds stored as raw bytes: bool, ints, floats, complex, bytes, unicode, datetimes.
_RAW_NP_KINDS = frozenset("biufcSUMm")


def _shape_struct(ndim: int) -> struct.Struct:
    st = _SHAPE_STRUCTS.get(ndim)
    if st is None:
        st = _SHAPE_STRUCTS[ndim] = struct.Struct(f"<{ndim}q")
    return st


def _header(kind: int, code: int, shape: Sequence[int], extra: bytes = b"") -> bytes:
    ndim = len(shape)
    if ndim > 255:
        raise UnsupportedValue(f"tensors with more than 255 dimensions cannot be stored (got {ndim})")
    out = _FIXED.pack(_MAGIC, _VERSION, kind, code, ndim, len(extra)) + _shape_struct(ndim).pack(*shape)
    if extra:
        out += extra
        pad = -len(out) % 8
        if pad:
            out += b"\0" * pad
    return out


class _Header:
    __slots__ = ("kind", "code", "shape", "extra", "offset")

    def __init__(self, kind: int, code: int, shape: tuple[int, ...], extra: bytes, offset: int):
        self.kind, self.code, self.shape, self.extra, self.offset = kind, code, shape, extra, offset


def _parse_header(mv: memoryview, name: str, index: int) -> _Header:
    if len(mv) < _FIXED_SIZE:
        raise StorageError(
            f"field {name!r}, sample {index}: stored value is {len(mv)} bytes, too short to be a "
            "tq-redis value; the store returned truncated or foreign data"
        )
    magic, version, kind, code, ndim, extra_len = _FIXED.unpack_from(mv, 0)
    if magic != _MAGIC:
        raise StorageError(
            f"field {name!r}, sample {index}: stored value does not start with the tq-redis magic "
            f"bytes (got {bytes(magic)!r}); it was not written by tq-redis or is corrupt"
        )
    if version != _VERSION:
        raise StorageError(
            f"field {name!r}, sample {index}: stored value has codec version {version}, this "
            f"tq-redis reads version {_VERSION}; upgrade tq-redis on the reading side"
        )
    if kind not in _KIND_NAME:
        raise StorageError(f"field {name!r}, sample {index}: unknown value kind code {kind}")
    pos = _FIXED_SIZE + 8 * ndim
    end = pos + extra_len + (-(pos + extra_len) % 8 if extra_len else 0)
    if len(mv) < end:
        raise StorageError(
            f"field {name!r}, sample {index}: stored value is {len(mv)} bytes, shorter than its "
            f"own {end}-byte header; the value is truncated or corrupt"
        )
    shape = _shape_struct(ndim).unpack_from(mv, _FIXED_SIZE) if ndim else ()
    if any(d < 0 for d in shape):
        raise StorageError(f"field {name!r}, sample {index}: stored shape {shape} is corrupt")
    extra = bytes(mv[pos:pos + extra_len]) if extra_len else b""
    return _Header(kind, code, shape, extra, end)


def _np_dtype(extra: bytes, name: str) -> np.dtype:
    """The numpy dtype a header names; only plain-bytes dtypes and ``object`` are accepted."""
    try:
        dt = np.dtype(extra.decode("ascii"))
    except (TypeError, ValueError) as e:
        raise StorageError(f"field {name!r}: stored numpy dtype {extra!r} is invalid ({e})") from e
    # A raw payload must never be read into a dtype holding Python object pointers.
    if dt.kind not in _RAW_NP_KINDS and dt != np.dtype(object):
        raise StorageError(f"field {name!r}: stored numpy dtype {dt} is not allowed")
    return dt


def _as_bytes_view(value: Any) -> memoryview:
    if isinstance(value, torch.Tensor):  # e.g. a uint8 receive buffer
        value = value.numpy()
    mv = value if isinstance(value, memoryview) else memoryview(value)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


_FORMAT = operator.attrgetter("format")
_NDIM = operator.attrgetter("ndim")


def _dtype_code(name: str, dtype: torch.dtype) -> int:
    code = _DTYPE_TO_CODE.get(dtype)
    if code is None:
        raise UnsupportedValue(
            f"field {name!r}: tensors of dtype {dtype} cannot be stored (quantized and other "
            "dtypes without a plain byte layout are not supported); dequantize or convert it first"
        )
    return code


def _dtype_from_code(code: int, name: str) -> torch.dtype:
    dtype = _CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise StorageError(
            f"field {name!r}: stored tensor has dtype code {code}, unknown to this torch build; "
            "upgrade torch/tq-redis on the reading side"
        )
    return dtype


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _np_byte_view(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without copying (works for dtypes PEP 3118 lacks)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """Detached, conj/neg-resolved, contiguous CPU tensor: one copy at most, for the whole batch."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return t


def _prod(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


# ----------------------------------------------------------------------------------------------
# Safe object encoding (msgpack + extension types)
# ----------------------------------------------------------------------------------------------

_EXT_TUPLE = 1
_EXT_TENSOR = 2
_EXT_NESTED = 3
_EXT_NDARRAY = 4
_EXT_NDARRAY_OBJ = 5
_EXT_NPSCALAR = 6
_EXT_SET = 7
_EXT_FROZENSET = 8
_EXT_COMPLEX = 9
_EXT_BIGINT = 10
_EXT_TORCH_DTYPE = 11
_EXT_TORCH_SIZE = 12
_EXT_NP_DTYPE = 13
_EXT_PICKLE = 100

_COMPLEX = struct.Struct("<dd")


class _Unencodable(Exception):
    def __init__(self, obj: Any):
        super().__init__(obj)
        self.type_name = f"{type(obj).__module__}.{type(obj).__qualname__}"


def _tensor_blob(t: torch.Tensor) -> bytes:
    t = _plain_tensor(t)
    return _header(_K_TENSOR, _DTYPE_TO_CODE[t.dtype], t.shape) + _byte_view(t).tobytes()


def _ndarray_payload(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a)
    return _header(_K_NDARRAY, _NO_DTYPE, a.shape, a.dtype.str.encode()) + _np_byte_view(a).tobytes()


def _make_packer(allow_pickle: bool):
    def pack(obj: Any) -> bytes:
        return msgpack.packb(obj, default=default, strict_types=True, use_bin_type=True)

    def default(obj: Any) -> Any:
        t = type(obj)
        if t is tuple:
            return msgpack.ExtType(_EXT_TUPLE, pack(list(obj)))
        if isinstance(obj, torch.Tensor) and (
            obj.is_nested or (obj.dtype in _DTYPE_TO_CODE and obj.layout == torch.strided)
        ):
            if obj.is_nested:
                layout = "jagged" if obj.layout == torch.jagged else "strided"
                return msgpack.ExtType(_EXT_NESTED, pack([layout, list(obj.unbind())]))
            return msgpack.ExtType(_EXT_TENSOR, _tensor_blob(obj))
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind in _RAW_NP_KINDS:
                return msgpack.ExtType(_EXT_NDARRAY, _ndarray_payload(obj))
            if obj.dtype.kind == "O":
                return msgpack.ExtType(_EXT_NDARRAY_OBJ, pack([list(obj.shape), list(obj.reshape(-1))]))
        elif isinstance(obj, np.generic):
            dt = obj.dtype
            if dt.kind in _RAW_NP_KINDS:
                return msgpack.ExtType(_EXT_NPSCALAR, pack([dt.str, obj.tobytes()]))
        elif t is int:  # only ints beyond 64 bits reach here
            raw = obj.to_bytes(obj.bit_length() // 8 + 1, "little", signed=True)
            return msgpack.ExtType(_EXT_BIGINT, raw)
        elif t is complex:
            return msgpack.ExtType(_EXT_COMPLEX, _COMPLEX.pack(obj.real, obj.imag))
        elif t is set:
            return msgpack.ExtType(_EXT_SET, pack(list(obj)))
        elif t is frozenset:
            return msgpack.ExtType(_EXT_FROZENSET, pack(list(obj)))
        elif isinstance(obj, torch.dtype) and obj in _DTYPE_TO_NAME:
            return msgpack.ExtType(_EXT_TORCH_DTYPE, _DTYPE_TO_NAME[obj].encode())
        elif isinstance(obj, torch.Size):
            return msgpack.ExtType(_EXT_TORCH_SIZE, pack(list(obj)))
        elif isinstance(obj, np.dtype) and obj.kind in _RAW_NP_KINDS | {"O"}:
            return msgpack.ExtType(_EXT_NP_DTYPE, obj.str.encode())
        # Container subclasses (tensordict's LinkedList, OrderedDict, ...) become their base type;
        # namedtuples would lose their class, so they are not silently flattened.
        elif isinstance(obj, list):
            return list(obj)
        elif isinstance(obj, dict):
            return dict(obj)
        elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return msgpack.ExtType(_EXT_TUPLE, pack(list(obj)))
        if allow_pickle:
            return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        raise _Unencodable(obj)

    return pack


def _make_unpacker(allow_pickle: bool):
    def unpack(data: Buffer) -> Any:
        return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False, use_list=True)

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_TUPLE:
            return tuple(unpack(data))
        if code == _EXT_TENSOR:
            mv = memoryview(data)
            h = _parse_header(mv, "<object>", 0)
            return _tensor_from_bytes(mv[h.offset:], _dtype_from_code(h.code, "<object>"), h.shape)
        if code == _EXT_NESTED:
            layout, parts = unpack(data)
            return torch.nested.as_nested_tensor(
                parts, layout=torch.jagged if layout == "jagged" else torch.strided
            )
        if code == _EXT_NDARRAY:
            mv = memoryview(data)
            h = _parse_header(mv, "<object>", 0)
            return _ndarray_from_bytes(mv[h.offset:], _np_dtype(h.extra, "<object>"), h.shape)
        if code == _EXT_NDARRAY_OBJ:
            shape, items = unpack(data)
            return _object_array(items, tuple(shape))
        if code == _EXT_NPSCALAR:
            dt, raw = unpack(data)
            np_dt = _np_dtype(dt.encode(), "<object>")
            if np_dt.itemsize == 0:  # np.str_("") / np.bytes_(b"")
                return np_dt.type()
            return _ndarray_from_bytes(memoryview(raw), np_dt, ())[()]
        if code == _EXT_SET:
            return set(unpack(data))
        if code == _EXT_FROZENSET:
            return frozenset(unpack(data))
        if code == _EXT_COMPLEX:
            re, im = _COMPLEX.unpack(data)
            return complex(re, im)
        if code == _EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        if code == _EXT_TORCH_DTYPE:
            return _NAME_TO_DTYPE[data.decode()]
        if code == _EXT_TORCH_SIZE:
            return torch.Size(unpack(data))
        if code == _EXT_NP_DTYPE:
            return _np_dtype(data, "<object>")
        if code == _EXT_PICKLE:
            if not allow_pickle:
                raise UnsupportedValue(
                    "the stored value contains a pickled object and allow_pickle is False; "
                    "unpickling runs arbitrary code, so pass allow_pickle=True only if you trust "
                    "every writer of this data"
                )
            return pickle.loads(data)
        raise StorageError(f"stored object uses unknown msgpack extension type {code}; upgrade tq-redis")

    return unpack


_PACK = {False: _make_packer(False), True: _make_packer(True)}
_UNPACK = {False: _make_unpacker(False), True: _make_unpacker(True)}


def _unsupported(where: str, type_name: str, detail: str = "") -> UnsupportedValue:
    return UnsupportedValue(
        f"{where}: cannot store a value of type {type_name} safely{detail}. Convert it to tensors, "
        "numpy arrays or plain Python values (None, bool, int, float, str, bytes, list, tuple, "
        "dict, set), or pass allow_pickle=True to pickle it (only if every reader trusts every "
        "writer)"
    )


def encode_object(obj: Any, *, allow_pickle: bool = False) -> bytes:
    """Encode one Python value with the safe object encoding (msgpack plus extension types).

    Supports None, bool, int (any size), float (NaN/inf too), complex, str, bytes, list, tuple,
    dict (any encodable keys), set, frozenset, tensors (any dtype, nested too), numpy arrays and
    scalars, torch dtypes and sizes. ``bytearray`` comes back as ``bytes`` and subclasses of
    ``list``/``dict`` as their base type.

    Raises:
        UnsupportedValue: the value (or something inside it) has no safe encoding and
            ``allow_pickle`` is False.
    """
    try:
        return _PACK[allow_pickle](obj)
    except _Unencodable as e:
        raise _unsupported("object", e.type_name) from None
    except (ValueError, OverflowError, RecursionError) as e:
        raise _unsupported("object", type(obj).__name__, f" ({e})") from e


def decode_object(buf: Buffer, *, allow_pickle: bool = False) -> Any:
    """Decode bytes produced by :func:`encode_object`.

    Raises:
        UnsupportedValue: the bytes hold a pickled object and ``allow_pickle`` is False.
        StorageError: the bytes are not a valid encoding (truncated or corrupt).
    """
    try:
        return _UNPACK[allow_pickle](buf)
    except TQError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError, struct.error) as e:
        # msgpack's own errors are ValueErrors; the rest come from malformed extension payloads.
        raise StorageError(f"stored object is not a valid tq-redis object encoding ({e})") from e


# ----------------------------------------------------------------------------------------------
# Field classification and schemas
# ----------------------------------------------------------------------------------------------


def _mismatch(name: str, got: int | str, batch_size: int) -> BatchSizeMismatch:
    return BatchSizeMismatch(
        f"field {name!r} has {got} samples along its first dimension but the batch has "
        f"{batch_size}; every field of a put needs the batch size as its first dimension"
    )


def _classify(name: str, value: Any, batch_size: int) -> tuple[dict, str, Any]:
    """Schema, kind and the source object the encoder works from."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            n = value.size(0)
            if n != batch_size:
                raise _mismatch(name, n, batch_size)
            dtype = _DTYPE_TO_NAME.get(value.dtype)
            _dtype_code(name, value.dtype)
            kind = KIND_JAGGED if value.layout == torch.jagged else KIND_STRIDED
            return {"kind": kind, "dtype": dtype, "shape": None}, kind, value
        if value.layout != torch.strided:
            raise UnsupportedValue(
                f"field {name!r}: tensors with layout {value.layout} cannot be stored; "
                "convert it with .to_dense() first"
            )
        if value.ndim == 0:
            raise _mismatch(name, "no batch dimension (0-d tensor), so no", batch_size)
        if value.shape[0] != batch_size:
            raise _mismatch(name, value.shape[0], batch_size)
        _dtype_code(name, value.dtype)
        schema = {"kind": KIND_TENSOR, "dtype": _DTYPE_TO_NAME[value.dtype], "shape": list(value.shape[1:])}
        return schema, KIND_TENSOR, value
    if isinstance(value, NonTensorData):
        data = value.data
        if isinstance(data, np.ndarray) and data.ndim >= 1 and data.shape[0] == batch_size:
            # TensorDict keeps non-numeric numpy arrays whole in a NonTensorData; split them per
            # sample like a numeric array would be.
            return _classify(name, data, batch_size)
        bs = value.batch_size
        if len(bs) == 0 or bs[0] != batch_size:
            raise _mismatch(name, bs[0] if len(bs) else "no batch dimension, so no", batch_size)
        if isinstance(data, list | tuple) and len(data) == batch_size:
            # A list of one value per sample (TensorDict wraps a plain list this way): split it
            # per sample, as the reference system does.
            return {"kind": KIND_OBJECT, "dtype": None, "shape": None}, KIND_OBJECT, list(data)
        # Broadcast: every sample of this NonTensorData holds the same value.
        return {"kind": KIND_OBJECT, "dtype": None, "shape": None}, KIND_OBJECT, [data] * batch_size
    if isinstance(value, NonTensorStack):
        bs = value.batch_size
        if len(bs) == 0 or bs[0] != batch_size:
            raise _mismatch(name, bs[0] if len(bs) else "no batch dimension, so no", batch_size)
        return {"kind": KIND_OBJECT, "dtype": None, "shape": None}, KIND_OBJECT, value
    if isinstance(value, TensorDictBase):
        raise UnsupportedValue(
            f"field {name!r}: nested TensorDicts are not stored as one field; flatten the batch "
            "first with td.flatten_keys(separator='.') so each leaf becomes its own field"
        )
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise _mismatch(name, "no batch dimension (0-d array), so no", batch_size)
        if value.shape[0] != batch_size:
            raise _mismatch(name, value.shape[0], batch_size)
        if value.dtype.kind not in _RAW_NP_KINDS and value.dtype.kind != "O":
            raise UnsupportedValue(
                f"field {name!r}: numpy arrays of dtype {value.dtype} (structured/void) cannot be "
                "stored; split the record fields into separate fields"
            )
        schema = {"kind": KIND_NDARRAY, "dtype": value.dtype.str, "shape": list(value.shape[1:])}
        return schema, KIND_NDARRAY, value
    if isinstance(value, (list, tuple)):
        if len(value) != batch_size:
            raise _mismatch(name, len(value), batch_size)
        return {"kind": KIND_OBJECT, "dtype": None, "shape": None}, KIND_OBJECT, value
    raise UnsupportedValue(
        f"field {name!r}: a field value of type {type(value).__module__}.{type(value).__qualname__} "
        "is not a batch; give a tensor (batch dim first), a nested tensor, a numpy array, a "
        "NonTensorStack/NonTensorData or a list with one entry per sample"
    )


def describe_field(name: str, value: Any, batch_size: int) -> dict:
    """JSON-safe schema of one field: ``{"kind", "dtype", "shape"}``.

    ``dtype`` is a torch dtype name (``"bfloat16"``) for tensor kinds, a numpy dtype string
    (``"<i8"``, ``"|S3"``, ``"<U5"``, ``"|O"``) for ``ndarray``, None for ``object``. ``shape`` is
    the per-sample shape for ``tensor``/``ndarray`` and None otherwise.

    Raises:
        BatchSizeMismatch: the value's first dimension is not ``batch_size``.
        UnsupportedValue: the value is not a batch of a supported type.
    """
    if batch_size <= 0:
        raise EmptyBatch(f"field {name!r}: batch size is {batch_size}; put at least one sample")
    return _classify(name, value, batch_size)[0]


def _dtype_family(kind: str, dtype: str | None) -> str | None:
    # Strings of different lengths are the same field: compare numpy S/U by character kind only.
    if kind == KIND_NDARRAY and dtype and dtype[1:2] in ("S", "U"):
        return dtype[:2]
    return dtype


def check_compatible(name: str, registered: dict, new: dict) -> None:
    """Raise if a put's schema ``new`` disagrees with the field's ``registered`` schema.

    Numpy byte/unicode strings of different lengths are compatible. Jagged, strided and object
    fields only need the same kind and dtype.

    Raises:
        ShapeConflict: the kind/layout differs, or the dense per-sample shape differs.
        DTypeConflict: the dtype differs.
    """
    hint = (
        "; put this data into a new partition or under a new field name, or convert it to the "
        "registered schema"
    )
    if registered.get("kind") != new.get("kind"):
        raise ShapeConflict(
            f"field {name!r} is registered as kind {registered.get('kind')!r} "
            f"(dtype {registered.get('dtype')}, shape {registered.get('shape')}) but this put offers "
            f"kind {new.get('kind')!r} (dtype {new.get('dtype')}, shape {new.get('shape')}){hint}"
        )
    kind = new["kind"]
    if _dtype_family(kind, registered.get("dtype")) != _dtype_family(kind, new.get("dtype")):
        raise DTypeConflict(
            f"field {name!r} is registered with dtype {registered.get('dtype')} but this put offers "
            f"dtype {new.get('dtype')} (kind {kind!r}){hint}"
        )
    if kind in (KIND_TENSOR, KIND_NDARRAY):
        reg_shape = list(registered.get("shape") or [])
        new_shape = list(new.get("shape") or [])
        if reg_shape != new_shape:
            raise ShapeConflict(
                f"field {name!r} is registered with per-sample shape {reg_shape} but this put "
                f"offers per-sample shape {new_shape} (dtype {new.get('dtype')}); variable-length "
                f"samples belong in a jagged nested tensor{hint}"
            )


def to_batchmeta_schema(schema: dict) -> dict:
    """Convert a JSON schema from :func:`describe_field` to the reference BatchMeta field schema.

    Returns ``{"dtype", "shape", "is_nested", "is_non_tensor", "kind"}`` where ``dtype`` is a
    ``torch.dtype`` (tensor kinds), a ``numpy.dtype`` (ndarray) or None, and ``shape`` a
    ``torch.Size`` of the per-sample shape (tensor and ndarray kinds) or None.
    """
    kind = schema["kind"]
    dtype_str = schema.get("dtype")
    shape = schema.get("shape")
    if dtype_str == DTYPE_MIXED:
        dtype: Any = None
    elif kind == KIND_NDARRAY:
        dtype = np.dtype(dtype_str) if dtype_str else None
    elif kind in (KIND_TENSOR, KIND_JAGGED, KIND_STRIDED):
        dtype = _NAME_TO_DTYPE.get(dtype_str) if dtype_str else None
    else:
        dtype = None
    return {
        "dtype": dtype,
        "shape": torch.Size(shape) if shape is not None and kind in (KIND_TENSOR, KIND_NDARRAY) else None,
        "is_nested": kind in (KIND_JAGGED, KIND_STRIDED),
        "is_non_tensor": kind in (KIND_NDARRAY, KIND_OBJECT, KIND_MIXED),
        "kind": kind,
    }


# ----------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------


def _encode_dense(name: str, t: torch.Tensor, n: int) -> RowBlock:
    t = _plain_tensor(t)
    hdr = _header(_K_TENSOR, _dtype_code(name, t.dtype), t.shape[1:])
    nb = _prod(t.shape[1:]) * t.element_size()
    return RowBlock(hdr, _byte_view(t), nb, n)


def _encode_jagged(name: str, nt: torch.Tensor, n: int) -> list[Segments]:
    code = _dtype_code(name, nt.dtype)
    if nt._ragged_idx == 1 and nt.lengths() is None:
        values = _plain_tensor(nt.values())
        offsets = nt.offsets().tolist()
        rest = tuple(values.shape[1:])
        row = _prod(rest) * values.element_size()
        mv = _byte_view(values)
        out = []
        for i in range(n):
            a, b = offsets[i], offsets[i + 1]
            out.append([_header(_K_JAGGED, code, (b - a, *rest)), mv[a * row:b * row]])
        return out
    # Holes (lengths) or a transposed ragged dim: fall back to per-component copies.
    parts = [_plain_tensor(c) for c in nt.detach().unbind()]
    return [[_header(_K_JAGGED, code, c.shape), _byte_view(c)] for c in parts]


def _encode_strided(name: str, nt: torch.Tensor) -> list[Segments]:
    code = _dtype_code(name, nt.dtype)
    nt = nt.detach()
    if nt.device.type != "cpu":
        nt = nt.cpu()
    parts = [_plain_tensor(c) for c in nt.unbind()]
    return [[_header(_K_STRIDED, code, c.shape), _byte_view(c)] for c in parts]


def _encode_ndarray(name: str, a: np.ndarray, n: int, allow_pickle: bool) -> Sequence[Segments]:
    a = np.ascontiguousarray(a)
    shape = a.shape[1:]
    hdr = _header(_K_NDARRAY, _NO_DTYPE, shape, a.dtype.str.encode())
    if a.dtype.kind == "O":
        pack = _PACK[allow_pickle]
        flat = a.reshape(n, _prod(shape))
        out = []
        for i in range(n):
            try:
                out.append([hdr, pack(list(flat[i]))])
            except _Unencodable as e:
                raise _unsupported(f"field {name!r}, sample {i}", e.type_name) from None
            except (ValueError, OverflowError, RecursionError) as e:
                raise _unsupported(f"field {name!r}, sample {i}", "object array element", f" ({e})") from e
        return out
    nb = _prod(shape) * a.dtype.itemsize
    return RowBlock(hdr, _np_byte_view(a), nb, n)


_OBJ_HDR = _header(_K_OBJECT, _NO_DTYPE, ())


def _encode_objects(name: str, values: Any, allow_pickle: bool) -> list[Segments]:
    items = values.tolist() if isinstance(values, NonTensorStack) else values
    pack = _PACK[allow_pickle]
    out = []
    for i, item in enumerate(items):
        try:
            out.append([_OBJ_HDR, pack(item)])
        except _Unencodable as e:
            raise _unsupported(f"field {name!r}, sample {i}", e.type_name) from None
        except (ValueError, OverflowError, RecursionError) as e:
            raise _unsupported(f"field {name!r}, sample {i}", type(item).__name__, f" ({e})") from e
    return out


def encode_field(
    name: str, value: Any, batch_size: int, *, allow_pickle: bool = False
) -> tuple[dict, Sequence[Segments]]:
    """Split one field of a batch into one stored value per sample.

    Returns ``(schema, per_sample)`` where ``schema`` is :func:`describe_field`'s dict and
    ``per_sample[i]`` is a list of segments (a header ``bytes`` and usually a one-dimensional
    byte ``memoryview`` of the batch's memory, so ``len`` is every segment's size in bytes) whose
    concatenation is sample ``i``'s stored value. Dense fields come back as a
    :class:`~tq_redis.backends.batches.RowBlock` (such a sequence that stores can also copy as a
    whole). The memoryviews borrow the batch's memory: keep the segments (or the source) alive
    until they are written.

    Raises:
        EmptyBatch: ``batch_size`` is 0.
        BatchSizeMismatch: the value's first dimension is not ``batch_size``.
        UnsupportedValue: the value, or a per-sample object inside it, cannot be stored safely
            (pass ``allow_pickle=True`` to pickle objects msgpack cannot represent).
    """
    if batch_size <= 0:
        raise EmptyBatch(f"field {name!r}: batch size is {batch_size}; put at least one sample")
    schema, kind, src = _classify(name, value, batch_size)
    if kind == KIND_TENSOR:
        return schema, _encode_dense(name, src, batch_size)
    if kind == KIND_JAGGED:
        return schema, _encode_jagged(name, src, batch_size)
    if kind == KIND_STRIDED:
        return schema, _encode_strided(name, src)
    if kind == KIND_NDARRAY:
        return schema, _encode_ndarray(name, src, batch_size, allow_pickle)
    return schema, _encode_objects(name, src, allow_pickle)


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------


def _check_payload(payload: memoryview, nbytes: int, shape: Sequence[int], dtype: Any) -> None:
    # Checked before allocating, so a corrupt header cannot make us allocate a huge buffer.
    if len(payload) != nbytes:
        raise StorageError(
            f"stored payload is {len(payload)} bytes but its header says {tuple(shape)} {dtype} "
            f"({nbytes} bytes); the value is truncated or corrupt"
        )


def _tensor_from_bytes(payload: memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A fresh, writable tensor holding a copy of ``payload``."""
    nb = _prod(shape) * dtype.itemsize
    _check_payload(payload, nb, shape, dtype)
    t = torch.empty(tuple(shape), dtype=dtype)
    if nb:
        _byte_view(t)[:] = payload
    return t


def _ndarray_from_bytes(payload: memoryview, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    if dtype.kind not in _RAW_NP_KINDS:
        raise StorageError(f"stored raw array has dtype {dtype}, which cannot be read from bytes")
    nb = _prod(shape) * dtype.itemsize
    _check_payload(payload, nb, shape, dtype)
    a = np.empty(tuple(shape), dtype=dtype)
    if nb:
        _np_byte_view(a)[:] = payload
    return a


def _object_array(items: list, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(items, list) or len(items) != _prod(shape) or any(d < 0 for d in shape):
        raise StorageError(f"stored object array does not match its shape {tuple(shape)}; it is corrupt")
    a = np.empty(shape, dtype=object)
    flat = a.reshape(-1)
    # Element-wise assignment: a slice assignment would let numpy broadcast list elements.
    for j, item in enumerate(items):
        flat[j] = item
    return a


def _decode_one(name: str, i: int, mv: memoryview, h: _Header, allow_pickle: bool) -> Any:
    """One sample's value on its own (used when a batch cannot be decoded in bulk)."""
    payload = mv[h.offset:]
    if h.kind in (_K_TENSOR, _K_JAGGED, _K_STRIDED):
        return _tensor_from_bytes(payload, _dtype_from_code(h.code, name), h.shape)
    try:
        if h.kind == _K_NDARRAY:
            dt = _np_dtype(h.extra, name)
            if dt.kind == "O":
                return _object_array(decode_object(payload, allow_pickle=allow_pickle), h.shape)
            return _ndarray_from_bytes(payload, dt, h.shape)
        return decode_object(payload, allow_pickle=allow_pickle)
    except (UnsupportedValue, StorageError) as e:
        raise type(e)(f"field {name!r}, sample {i}: {e}") from None


def _jagged_from_parts(dtype: torch.dtype, shapes: list[tuple[int, ...]], payloads: list[memoryview]):
    rest = shapes[0][1:]
    lengths = [s[0] for s in shapes]
    total = sum(lengths)
    values = torch.empty((total, *rest), dtype=dtype)
    row = _prod(rest) * values.element_size()
    out = _byte_view(values)
    pos = 0
    for length, p in zip(lengths, payloads):
        nb = length * row
        if len(p) != nb:
            raise StorageError(
                f"stored jagged component is {len(p)} bytes but its header says {nb}; "
                "the value is truncated or corrupt"
            )
        out[pos:pos + nb] = p
        pos += nb
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    # Without the bounds torch pads to_padded_tensor() to the total length, not the longest row.
    return torch.nested.nested_tensor_from_jagged(
        values, offsets, min_seqlen=min(lengths), max_seqlen=max(lengths)
    )


def _stack_objects(items: list) -> NonTensorStack:
    # One NonTensorData per sample (batch [n]). NonTensorStack.from_list would recurse into list
    # items and fails when samples mix lists and scalars.
    return NonTensorStack(*items)


def _combine_tensors(parts: list[torch.Tensor]) -> Any:
    """Batch per-sample tensors whose shapes or dtypes differ (e.g. rows of two partitions)."""
    dtypes = {p.dtype for p in parts}
    ndims = {p.ndim for p in parts}
    if len(dtypes) == 1 and len(ndims) == 1:
        if len({p.shape for p in parts}) == 1:
            return torch.stack(parts)
        ndim = ndims.pop()
        if ndim >= 1 and len({p.shape[1:] for p in parts}) == 1:
            return torch.nested.as_nested_tensor(parts, layout=torch.jagged)
        if ndim >= 1:
            return torch.nested.as_nested_tensor(parts, layout=torch.strided)
    return _stack_objects(parts)


def _dense_to_jagged(t: torch.Tensor) -> torch.Tensor:
    n, length = t.shape[0], t.shape[1]
    offsets = torch.arange(0, (n + 1) * length, length, dtype=torch.int64) if length else torch.zeros(
        n + 1, dtype=torch.int64
    )
    return torch.nested.nested_tensor_from_jagged(
        t.reshape(n * length, *t.shape[2:]), offsets, min_seqlen=length, max_seqlen=length
    )


def _empty_batch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; large ones come from the warm buffer cache (see ``buffers``)."""
    nbytes = _prod(shape) * dtype.itemsize
    if nbytes < buffers.MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(buffers.take(nbytes)).view(dtype).reshape(shape)


def _bytes_views(values: Sequence[Buffer]) -> list[memoryview]:
    """``values`` as one-dimensional byte memoryviews (a store's views usually already are)."""
    if set(map(type, values)) == {memoryview} and set(map(_FORMAT, values)) == {"B"} \
            and set(map(_NDIM, values)) == {1}:
        return list(values)  # type: ignore[arg-type]
    return [_as_bytes_view(v) for v in values]


def _all_framed(mvs: list[memoryview], prefix: bytes, size: int) -> bool:
    """Whether every value is ``size`` bytes long and starts with the header ``prefix``."""
    if set(map(len, mvs)) != {size}:
        return False
    heads = map(operator.getitem, mvs, repeat(slice(0, len(prefix))))
    return all(map(operator.eq, heads, repeat(prefix)))


def _table_framed(table: ValueTable, prefix: bytes, size: int) -> bool:
    """:func:`_all_framed` for a :class:`ValueTable`, checked with array arithmetic per source."""
    if not bool((table.lengths == size).all()):
        return False
    want = np.frombuffer(prefix, dtype=np.uint8)
    span = np.arange(len(prefix), dtype=np.int64)
    for k, source in enumerate(table.sources):
        mine = table.index == k
        if len(prefix) and mine.any():
            heads = np.frombuffer(source, dtype=np.uint8)[table.offsets[mine][:, None] + span]
            if not bool((heads == want).all()):
                return False
    return True


def decode_field(
    name: str, values: Sequence[Buffer], *, allow_pickle: bool = False, nested_output: bool = False
) -> Any:
    """Rebuild a batch from per-sample stored values (in batch order).

    Returns per kind: ``tensor`` -> dense ``torch.Tensor`` ``(n, *shape)`` (one copy);
    ``jagged`` -> jagged nested tensor; ``strided`` -> strided nested tensor; ``ndarray`` ->
    ``numpy.ndarray``; ``object`` -> ``NonTensorStack``. Values of differing shapes (e.g. rows of
    two partitions) come back as a nested tensor; values of differing kinds as a
    ``NonTensorStack``. With ``nested_output=True`` (the reference's layout) a field with
    per-sample dims comes back as a jagged nested tensor whenever one dimension is ragged (a
    strided field too), scalars per sample as a dense ``(n,)`` tensor.

    Raises:
        EmptyBatch: ``values`` is empty.
        UnsupportedValue: a value holds a pickled object and ``allow_pickle`` is False.
        StorageError: a value is truncated, corrupt or not a tq-redis value.
    """
    n = len(values)
    if n == 0:
        raise EmptyBatch(f"field {name!r}: no values to decode")
    table = values if isinstance(values, ValueTable) else None
    mvs = [] if table is not None else _bytes_views(values)
    h0 = _parse_header(table[0] if table is not None else mvs[0], name, 0)

    if h0.kind == _K_TENSOR or (h0.kind == _K_NDARRAY and not h0.extra.startswith(b"|O")):
        # Fast path: every value has the first one's header, so copy payloads into one batch.
        hlen = h0.offset
        prefix = (table[0] if table is not None else mvs[0])[:hlen].tobytes()
        if h0.kind == _K_TENSOR:
            dtype = _dtype_from_code(h0.code, name)
            nb = _prod(h0.shape) * dtype.itemsize
        else:
            np_dtype = _np_dtype(h0.extra, name)
            nb = _prod(h0.shape) * np_dtype.itemsize
        framed = _table_framed(table, prefix, hlen + nb) if table is not None else _all_framed(mvs, prefix, hlen + nb)
        if framed:
            if h0.kind == _K_TENSOR:
                out: Any = _empty_batch((n, *h0.shape), dtype)
                dest = _byte_view(out)
            else:
                out = np.empty((n, *h0.shape), dtype=np_dtype)
                dest = _np_byte_view(out)
            if nb and table is not None:
                rows = np.arange(n, dtype=np.int64) * nb
                fastcopy.copy_table(dest, rows, table.sources, table.index, table.offsets + hlen, np.full(n, nb))
            elif nb:
                fastcopy.gather_rows(dest, mvs, hlen, nb)
            if nested_output and isinstance(out, torch.Tensor) and out.ndim >= 2:
                return _dense_to_jagged(out)
            return out

    if table is not None:
        mvs = list(table)
    headers = [h0] + [_parse_header(mv, name, i) for i, mv in enumerate(mvs[1:], 1)]
    kinds = {h.kind for h in headers}
    if kinds == {_K_JAGGED} and len({h.code for h in headers}) == 1 \
            and len({h.shape[1:] for h in headers}) == 1 and len(h0.shape) >= 1:
        return _jagged_from_parts(
            _dtype_from_code(h0.code, name),
            [h.shape for h in headers],
            [mv[h.offset:] for mv, h in zip(mvs, headers)],
        )
    if kinds == {_K_NDARRAY} and {(h.extra, h.shape) for h in headers} == {(b"|O", h0.shape)}:
        out = np.empty((n, *h0.shape), dtype=object)
        flat = out.reshape(n, _prod(h0.shape))
        for i, (mv, h) in enumerate(zip(mvs, headers)):
            items = _decode_one(name, i, mv, _Header(_K_OBJECT, 0, (), b"", h.offset), allow_pickle)
            row = flat[i]
            if not isinstance(items, list) or len(items) != len(row):
                raise StorageError(
                    f"field {name!r}, sample {i}: stored object array does not match its shape"
                )
            for j, item in enumerate(items):
                row[j] = item
        return out
    parts = [_decode_one(name, i, mv, h, allow_pickle) for i, (mv, h) in enumerate(zip(mvs, headers))]
    if kinds <= {_K_TENSOR, _K_JAGGED}:
        # Shapes or dtypes differ between values, e.g. rows of two partitions.
        combined = _combine_tensors(parts)
        if nested_output and isinstance(combined, torch.Tensor) and not combined.is_nested \
                and combined.ndim >= 2:
            return _dense_to_jagged(combined)
        return combined
    if kinds == {_K_STRIDED}:
        if len({p.dtype for p in parts}) == 1 and len({p.ndim for p in parts}) == 1:
            if nested_output and parts[0].ndim >= 1 and len({p.shape[1:] for p in parts}) == 1:
                # One ragged dimension: the reference's layout is jagged (len() and list() work).
                return torch.nested.as_nested_tensor(parts, layout=torch.jagged)
            return torch.nested.as_nested_tensor(parts, layout=torch.strided)
        return _stack_objects(parts)
    if kinds == {_K_NDARRAY}:
        try:
            # np.stack also promotes S/U arrays of different string lengths.
            return np.stack(parts)
        except ValueError:
            return _object_array(parts, (n,))
    return _stack_objects(parts)


# ----------------------------------------------------------------------------------------------
# TensorDict wrappers
# ----------------------------------------------------------------------------------------------


def encode_tensordict(
    td: TensorDictBase, *, allow_pickle: bool = False
) -> dict[str, tuple[dict, list[Segments]]]:
    """Encode every top-level field of ``td``: ``{name: (schema, per_sample_segments)}``.

    Raises:
        EmptyBatch: ``td`` has no batch dimension, zero samples or no fields.
        plus whatever :func:`encode_field` raises for a field.
    """
    if len(td.batch_size) == 0:
        raise EmptyBatch(
            "the TensorDict has no batch dimension; build it with batch_size=[n] where n is the "
            "number of samples"
        )
    n = td.batch_size[0]
    if n == 0:
        raise EmptyBatch("the TensorDict has 0 samples; put at least one sample")
    keys = list(td.keys())
    if not keys:
        raise EmptyBatch("the TensorDict has no fields; put at least one field")
    return {k: encode_field(k, td.get(k), n, allow_pickle=allow_pickle) for k in keys}


def decode_tensordict(
    fields: dict[str, Sequence[Buffer]], batch_size: int, *, allow_pickle: bool = False,
    nested_output: bool = False,
) -> TensorDict:
    """Rebuild a ``TensorDict`` with ``batch_size=[batch_size]`` from per-field stored values.

    Raises:
        EmptyBatch: no fields or ``batch_size`` 0.
        BatchSizeMismatch: a field does not have ``batch_size`` values.
    """
    if batch_size <= 0 or not fields:
        raise EmptyBatch(f"nothing to decode: {len(fields)} fields, batch size {batch_size}")
    out = {}
    for name, values in fields.items():
        if len(values) != batch_size:
            raise _mismatch(name, len(values), batch_size)
        out[name] = decode_field(name, values, allow_pickle=allow_pickle, nested_output=nested_output)
    return TensorDict(out, batch_size=[batch_size])
