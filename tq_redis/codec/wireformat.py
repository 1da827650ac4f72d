"""The stored byte format of one value: a self-describing header, then the raw payload.

Every per-sample value the tensor codec (:mod:`tq_redis.codec.tensors`) writes, and every tensor or
numeric array inside the safe object encoding (:mod:`tq_redis.codec.objects`), is this header followed
by its payload. This module builds and parses headers, and turns raw payloads back into tensors
and arrays; it knows nothing about batches or fields.

Header layout (little endian, padded to a multiple of 8 bytes so payloads stay aligned)::

    magic b"TQ" | version u8 | kind u8 | dtype code u8 | ndim u8 | extra length u16
    | ndim x int64 shape | extra bytes (numpy dtype string) | zero padding

The dtype code is :data:`tq_redis.meta.dtypes.DTYPE_TO_CODE`'s for tensors and
:data:`~tq_redis.meta.dtypes.NO_DTYPE` for numpy and object values, whose numpy dtype string (if any)
is the extra bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tq_redis.errors import StorageError, UnsupportedValue
from tq_redis.meta.dtypes import RAW_NP_KINDS

__all__ = [
    "K_JAGGED",
    "K_NDARRAY",
    "K_OBJECT",
    "K_STRIDED",
    "K_TENSOR",
    "ROW_HEADER_SIZE",
    "Header",
    "byte_view",
    "header",
    "ndarray_from_bytes",
    "np_byte_view",
    "np_dtype",
    "object_array",
    "parse_header",
    "plain_tensor",
    "prod",
    "row_lengths",
    "row_prefix",
    "tensor_from_bytes",
]

_MAGIC = b"TQ"
_VERSION = 1
# Kind codes in the header (stable: never renumber).
K_TENSOR, K_JAGGED, K_STRIDED, K_NDARRAY, K_OBJECT = 1, 2, 3, 4, 5
_KIND_CODES = frozenset((K_TENSOR, K_JAGGED, K_STRIDED, K_NDARRAY, K_OBJECT))

_FIXED = struct.Struct("<2sBBBBH")
_FIXED_SIZE = _FIXED.size  # 8
_SHAPE_STRUCTS: dict[int, struct.Struct] = {}


def _shape_struct(ndim: int) -> struct.Struct:
    st = _SHAPE_STRUCTS.get(ndim)
    if st is None:
        st = _SHAPE_STRUCTS[ndim] = struct.Struct(f"<{ndim}q")
    return st


def header(kind: int, code: int, shape: Sequence[int], extra: bytes = b"") -> bytes:
    """The header of a value of header kind ``kind``, dtype code ``code`` and ``shape``.

    Raises:
        UnsupportedValue: more than 255 dimensions.
    """
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


class Header:
    """A parsed header; the payload starts at ``offset``."""

    __slots__ = ("kind", "code", "shape", "extra", "offset")

    def __init__(self, kind: int, code: int, shape: tuple[int, ...], extra: bytes, offset: int):
        self.kind, self.code, self.shape, self.extra, self.offset = kind, code, shape, extra, offset


def parse_header(mv: memoryview, name: str, index: int) -> Header:
    """The header at the start of ``mv`` (sample ``index`` of field ``name``, for messages).

    Raises:
        StorageError: the bytes are too short, not a tq-redis value, of another codec version,
            or corrupt.
    """
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
    if kind not in _KIND_CODES:
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
    return Header(kind, code, shape, extra, end)


ROW_HEADER_SIZE = _FIXED_SIZE + 8
"""Header bytes of a 1-D value without extra bytes: the fixed part and one dimension."""
_ROW_LENGTH = struct.Struct("<q")


def row_prefix(kind: int, code: int) -> bytes:
    """The first bytes of every 1-D value of header kind ``kind`` and dtype code ``code`` without
    extra header bytes; its length (one little-endian int64) follows."""
    return _FIXED.pack(_MAGIC, _VERSION, kind, code, 1, 0)


def row_lengths(mvs: Sequence[memoryview], kind: int, code: int, itemsize: int) -> list[int] | None:
    """The lengths of ``mvs`` when every value is a 1-D value of header kind ``kind`` and dtype
    code ``code``, without extra header bytes, holding exactly its ``length * itemsize`` payload
    after :data:`ROW_HEADER_SIZE` bytes of header; ``None`` when any is not.

    The common jagged field (token ids, log-probs: one 1-D row per sample) read without a
    :class:`Header` per sample. ``None`` sends the caller to :func:`parse_header`, which names
    what is wrong with a value that is not well formed.
    """
    prefix = row_prefix(kind, code)
    if min(map(len, mvs), default=0) < ROW_HEADER_SIZE:
        return None
    if not all(mv[:_FIXED_SIZE] == prefix for mv in mvs):
        return None
    lengths = [_ROW_LENGTH.unpack_from(mv, _FIXED_SIZE)[0] for mv in mvs]
    if min(lengths) < 0 or list(map(len, mvs)) != [ROW_HEADER_SIZE + n * itemsize for n in lengths]:
        return None
    return lengths


def np_dtype(extra: bytes, name: str) -> np.dtype:
    """The numpy dtype a header names; only plain-bytes dtypes and ``object`` are accepted.

    Raises:
        StorageError: the dtype string is invalid or names a dtype that is not allowed.
    """
    try:
        dt = np.dtype(extra.decode("ascii"))
    except (TypeError, ValueError) as e:
        raise StorageError(f"field {name!r}: stored numpy dtype {extra!r} is invalid ({e})") from e
    # A raw payload must never be read into a dtype holding Python object pointers.
    if dt.kind not in RAW_NP_KINDS and dt != np.dtype(object):
        raise StorageError(f"field {name!r}: stored numpy dtype {dt} is not allowed")
    return dt


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def np_byte_view(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without copying (works for dtypes PEP 3118 lacks)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """Detached, conj/neg-resolved, contiguous CPU tensor: one copy at most, for the whole batch.

    Raises:
        UnsupportedValue: the tensor is on the meta device (it has no data).
    """
    if t.device.type == "meta":
        raise UnsupportedValue(
            "a tensor on the meta device has a shape but no data to store; materialise it first "
            "(e.g. torch.empty_like(t, device='cpu') and fill it)"
        )
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


def prod(shape: Sequence[int]) -> int:
    """The number of elements of ``shape`` (1 for a scalar)."""
    return math.prod(shape) if shape else 1


def _payload_size(payload: memoryview, shape: Sequence[int], dtype: Any) -> int:
    """The payload's size in bytes, checked against ``shape`` and ``dtype``."""
    # Checked before allocating, so a corrupt header cannot make us allocate a huge buffer.
    nbytes = prod(shape) * dtype.itemsize
    if len(payload) != nbytes:
        raise StorageError(
            f"stored payload is {len(payload)} bytes but its header says {tuple(shape)} {dtype} "
            f"({nbytes} bytes); the value is truncated or corrupt"
        )
    return nbytes


def tensor_from_bytes(payload: memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A fresh, writable tensor holding a copy of ``payload``.

    Raises:
        StorageError: the payload's length does not match ``shape`` and ``dtype``.
    """
    nb = _payload_size(payload, shape, dtype)
    t = torch.empty(tuple(shape), dtype=dtype)
    if nb:
        byte_view(t)[:] = payload
    return t


def ndarray_from_bytes(payload: memoryview, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """A fresh numpy array holding a copy of ``payload``.

    Raises:
        StorageError: ``dtype`` is not stored as raw bytes, or the payload's length does not match.
    """
    if dtype.kind not in RAW_NP_KINDS:
        raise StorageError(f"stored raw array has dtype {dtype}, which cannot be read from bytes")
    nb = _payload_size(payload, shape, dtype)
    a = np.empty(tuple(shape), dtype=dtype)
    if nb:
        np_byte_view(a)[:] = payload
    return a


def object_array(items: list, shape: tuple[int, ...]) -> np.ndarray:
    """An object array of ``shape`` holding ``items`` (decoded elements, in C order).

    Raises:
        StorageError: ``items`` does not fit ``shape``.
    """
    if not isinstance(items, list) or len(items) != prod(shape) or any(d < 0 for d in shape):
        raise StorageError(f"stored object array does not match its shape {tuple(shape)}; it is corrupt")
    a = np.empty(shape, dtype=object)
    flat = a.reshape(-1)
    # Element-wise assignment: a slice assignment would let numpy broadcast list elements.
    for j, item in enumerate(items):
        flat[j] = item
    return a
