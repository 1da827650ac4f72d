"""The dtypes tq-redis stores: a stable code and a name for each torch dtype, and the numpy kinds
kept as raw bytes.

The codes are written into every stored tensor's header (:mod:`tq_redis.codec.wireformat`); the names
are what field schemas (:mod:`tq_redis.meta.schemas`) and the safe object encoding
(:mod:`tq_redis.codec.objects`) record. Nothing here imports another module of ours.
"""

from __future__ import annotations

import torch

from tq_redis.errors import StorageError, UnsupportedValue

__all__ = [
    "CODE_TO_DTYPE",
    "DTYPE_TO_CODE",
    "DTYPE_TO_NAME",
    "NAME_TO_DTYPE",
    "NO_DTYPE",
    "RAW_NP_KINDS",
    "dtype_code",
    "dtype_from_code",
]

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
CODE_TO_DTYPE: dict[int, torch.dtype] = {}
DTYPE_TO_CODE: dict[torch.dtype, int] = {}
NAME_TO_DTYPE: dict[str, torch.dtype] = {}
DTYPE_TO_NAME: dict[torch.dtype, str] = {}
for _code, _name in _TORCH_DTYPE_CODES:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        CODE_TO_DTYPE[_code] = _dt
        DTYPE_TO_CODE[_dt] = _code
        NAME_TO_DTYPE[_name] = _dt
        DTYPE_TO_NAME[_dt] = _name
NO_DTYPE = 0
"""The dtype code of numpy and object values: they carry their dtype in the header's extra bytes."""

RAW_NP_KINDS = frozenset("biufcSUMm")
"""numpy dtype kinds stored as raw bytes: bool, ints, floats, complex, bytes, unicode, datetimes."""


def dtype_code(name: str, dtype: torch.dtype) -> int:
    """The stored code of ``dtype`` (for field ``name``).

    Raises:
        UnsupportedValue: ``dtype`` has no plain byte layout (quantized and the like).
    """
    code = DTYPE_TO_CODE.get(dtype)
    if code is None:
        raise UnsupportedValue(
            f"field {name!r}: tensors of dtype {dtype} cannot be stored (quantized and other "
            "dtypes without a plain byte layout are not supported); dequantize or convert it first"
        )
    return code


def dtype_from_code(code: int, name: str) -> torch.dtype:
    """The torch dtype a stored code names (for field ``name``).

    Raises:
        StorageError: the code is unknown to this torch build.
    """
    dtype = CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise StorageError(
            f"field {name!r}: stored tensor has dtype code {code}, unknown to this torch build; "
            "upgrade torch/tq-redis on the reading side"
        )
    return dtype
