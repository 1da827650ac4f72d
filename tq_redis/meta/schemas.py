"""Field schemas: what kind of batch a field holds, and whether two puts of it agree.

A field is described in two forms:

* the JSON schema :func:`describe_field` returns, ``{"kind", "dtype", "shape"}``, which the
  metadata plane stores per partition and :func:`check_compatible` compares across puts;
* the reference's ``BatchMeta`` field-schema entry, ``{"dtype", "shape", "is_nested",
  "is_non_tensor", "kind"}`` with torch/numpy dtypes, built from a JSON schema by
  :func:`to_batchmeta_schema` or from a value by :func:`batchmeta_schema_of` (what
  :func:`tq_redis.meta.extract_field_schema` returns per field).

The kind vocabulary (``KIND_*``) is shared by both forms and by the tensor codec
(:mod:`tq_redis.codec.tensors`), which encodes each kind its own way. Depends only on
:mod:`tq_redis.meta.dtypes` (dtype names) and the errors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase, is_non_tensor

from tq_redis.errors import BatchSizeMismatch, DTypeConflict, EmptyBatch, ShapeConflict, UnsupportedValue
from tq_redis.meta.dtypes import DTYPE_TO_NAME, NAME_TO_DTYPE, RAW_NP_KINDS, dtype_code
from tq_redis.meta.jagged import JaggedParts, jagged_parts

__all__ = [
    "DTYPE_MIXED",
    "KINDS",
    "KIND_JAGGED",
    "KIND_MIXED",
    "KIND_NDARRAY",
    "KIND_OBJECT",
    "KIND_STRIDED",
    "KIND_TENSOR",
    "batch_size_mismatch",
    "batchmeta_schema_of",
    "check_compatible",
    "classify",
    "describe_field",
    "to_batchmeta_schema",
]

KIND_TENSOR = "tensor"
"""A regular (dense) tensor field: every sample has the same shape."""
KIND_JAGGED = "jagged"
"""A nested tensor with ``torch.jagged`` layout; see ``per_sample_shapes``."""
KIND_STRIDED = "strided"
"""A nested tensor with the older ``torch.strided`` nested layout; see ``per_sample_shapes``."""
KIND_NDARRAY = "ndarray"
"""A numpy array that TensorDict keeps as non-tensor data (strings, objects)."""
KIND_OBJECT = "object"
"""A field of arbitrary Python objects (strings, dicts, ...)."""
KIND_MIXED = "mixed"
"""A field whose puts offered different kinds (the metadata plane widens it, see lua/includes/schemas.lua)."""
KIND_PARTS = "parts"
"""A field written in parts (``append_parts``, partial rollout): its bytes are those of its hidden
fields ``<field>~<k>``, one per part (see :mod:`tq_redis.ops.partial`)."""
DTYPE_MIXED = "mixed"
"""The dtype of a widened field whose puts offered different dtypes."""
KINDS = (KIND_TENSOR, KIND_JAGGED, KIND_STRIDED, KIND_NDARRAY, KIND_OBJECT)
"""The kinds a put can offer (every kind but :data:`KIND_MIXED`)."""

_NESTED_KINDS = (KIND_JAGGED, KIND_STRIDED)
_NON_TENSOR_KINDS = (KIND_NDARRAY, KIND_OBJECT, KIND_MIXED)


# ----------------------------------------------------------------------------------------------
# Kinds of values
# ----------------------------------------------------------------------------------------------


def batch_size_mismatch(name: str, got: int | str, batch_size: int) -> BatchSizeMismatch:
    """The error for a field whose first dimension (``got``) is not the batch size."""
    return BatchSizeMismatch(
        f"field {name!r} has {got} samples along its first dimension but the batch has "
        f"{batch_size}; every field of a put needs the batch size as its first dimension"
    )


def _nested_kind(value: torch.Tensor) -> str:
    return KIND_JAGGED if value.layout == torch.jagged else KIND_STRIDED


def _batch_array(value: Any, batch_size: int) -> np.ndarray | None:
    """The numpy array a ``NonTensorData`` keeps whole, if it has one row per sample.

    TensorDict keeps non-numeric numpy arrays whole in a ``NonTensorData``; such a field is an
    ``ndarray`` field split per sample, like a numeric array would be.
    """
    data = getattr(value, "data", None)
    if isinstance(data, np.ndarray) and data.ndim >= 1 and data.shape[0] == batch_size:
        return data
    return None


def _object_schema() -> dict:
    return {"kind": KIND_OBJECT, "dtype": None, "shape": None}


def _on_meta_device(name: str) -> UnsupportedValue:
    return UnsupportedValue(
        f"field {name!r}: a tensor on the meta device has a shape but no data to store; "
        "materialise it first (e.g. torch.empty_like(t, device='cpu') and fill it)"
    )


def _classify_tensor(name: str, value: torch.Tensor, batch_size: int) -> dict:
    parts = jagged_parts(value)
    if parts is not None:  # the common nested case, without torch's per-attribute dispatch
        return _classify_jagged(name, parts, batch_size)
    if value.device.type == "meta":
        raise _on_meta_device(name)
    if value.is_nested:
        n = value.size(0)
        if n != batch_size:
            raise batch_size_mismatch(name, n, batch_size)
        dtype = DTYPE_TO_NAME.get(value.dtype)
        dtype_code(name, value.dtype)
        return {"kind": _nested_kind(value), "dtype": dtype, "shape": None}
    if value.layout != torch.strided:
        raise UnsupportedValue(
            f"field {name!r}: tensors with layout {value.layout} cannot be stored; "
            "convert it with .to_dense() first"
        )
    if value.ndim == 0:
        raise batch_size_mismatch(name, "no batch dimension (0-d tensor), so no", batch_size)
    if value.shape[0] != batch_size:
        raise batch_size_mismatch(name, value.shape[0], batch_size)
    dtype_code(name, value.dtype)
    return {"kind": KIND_TENSOR, "dtype": DTYPE_TO_NAME[value.dtype], "shape": list(value.shape[1:])}


def _classify_jagged(name: str, parts: JaggedParts, batch_size: int) -> dict:
    if parts.values.device.type == "meta":
        raise _on_meta_device(name)
    if parts.rows != batch_size:
        raise batch_size_mismatch(name, parts.rows, batch_size)
    dtype = parts.values.dtype
    dtype_code(name, dtype)
    return {"kind": KIND_JAGGED, "dtype": DTYPE_TO_NAME.get(dtype), "shape": None}


def _classify_ndarray(name: str, value: np.ndarray, batch_size: int) -> dict:
    if value.ndim == 0:
        raise batch_size_mismatch(name, "no batch dimension (0-d array), so no", batch_size)
    if value.shape[0] != batch_size:
        raise batch_size_mismatch(name, value.shape[0], batch_size)
    if value.dtype.kind not in RAW_NP_KINDS and value.dtype.kind != "O":
        raise UnsupportedValue(
            f"field {name!r}: numpy arrays of dtype {value.dtype} (structured/void) cannot be "
            "stored; split the record fields into separate fields"
        )
    return {"kind": KIND_NDARRAY, "dtype": value.dtype.str, "shape": list(value.shape[1:])}


def _check_batch_dim(name: str, value: NonTensorData | NonTensorStack, batch_size: int) -> None:
    bs = value.batch_size
    if len(bs) == 0 or bs[0] != batch_size:
        raise batch_size_mismatch(name, bs[0] if len(bs) else "no batch dimension, so no", batch_size)


def classify(name: str, value: Any, batch_size: int) -> tuple[dict, str, Any]:
    """The JSON schema and kind of field ``name``, and the source object an encoder works from.

    The source is ``value`` itself, the numpy array a ``NonTensorData`` holds, or a list of one
    Python object per sample (a ``NonTensorData`` holding one value per sample, or one value
    broadcast to every sample).

    Raises:
        BatchSizeMismatch: the value's first dimension is not ``batch_size``.
        UnsupportedValue: the value is not a batch of a supported type.
    """
    if isinstance(value, torch.Tensor):
        schema = _classify_tensor(name, value, batch_size)
        return schema, schema["kind"], value
    if isinstance(value, NonTensorData):
        array = _batch_array(value, batch_size)
        if array is not None:
            return classify(name, array, batch_size)
        _check_batch_dim(name, value, batch_size)
        data = value.data
        if isinstance(data, list | tuple) and len(data) == batch_size:
            # A list of one value per sample (TensorDict wraps a plain list this way): split it
            # per sample, as the reference system does.
            return _object_schema(), KIND_OBJECT, list(data)
        # Broadcast: every sample of this NonTensorData holds the same value.
        return _object_schema(), KIND_OBJECT, [data] * batch_size
    if isinstance(value, NonTensorStack):
        _check_batch_dim(name, value, batch_size)
        return _object_schema(), KIND_OBJECT, value
    if isinstance(value, TensorDictBase):
        raise UnsupportedValue(
            f"field {name!r}: nested TensorDicts are not stored as one field; flatten the batch "
            "first with td.flatten_keys(separator='.') so each leaf becomes its own field"
        )
    if isinstance(value, np.ndarray):
        return _classify_ndarray(name, value, batch_size), KIND_NDARRAY, value
    if isinstance(value, (list, tuple)):
        if len(value) != batch_size:
            raise batch_size_mismatch(name, len(value), batch_size)
        return _object_schema(), KIND_OBJECT, value
    raise UnsupportedValue(
        f"field {name!r}: a field value of type {type(value).__module__}.{type(value).__qualname__} "
        "is not a batch; give a tensor (batch dim first), a nested tensor, a numpy array, a "
        "NonTensorStack/NonTensorData or a list with one entry per sample"
    )


# ----------------------------------------------------------------------------------------------
# JSON schemas
# ----------------------------------------------------------------------------------------------


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
    return classify(name, value, batch_size)[0]


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


# ----------------------------------------------------------------------------------------------
# BatchMeta field-schema entries
# ----------------------------------------------------------------------------------------------


def _entry(kind: str, dtype: Any, shape: tuple[int, ...] | None, **extra: Any) -> dict:
    """A ``BatchMeta`` field-schema entry; the flags follow from the kind."""
    return {
        "dtype": dtype,
        "shape": shape,
        "is_nested": kind in _NESTED_KINDS,
        "is_non_tensor": kind in _NON_TENSOR_KINDS,
        **extra,
        "kind": kind,
    }


def to_batchmeta_schema(schema: dict) -> dict:
    """Convert a JSON schema from :func:`describe_field` to the reference BatchMeta field schema.

    Returns ``{"dtype", "shape", "is_nested", "is_non_tensor", "kind"}`` where ``dtype`` is a
    ``torch.dtype`` (tensor kinds), a ``numpy.dtype`` (ndarray) or None, and ``shape`` a
    ``torch.Size`` of the per-sample shape (tensor and ndarray kinds) or None. A widened field
    (kind :data:`KIND_MIXED` or dtype :data:`DTYPE_MIXED`) has dtype None.
    """
    kind = schema["kind"]
    dtype_str = schema.get("dtype")
    shape = schema.get("shape")
    if dtype_str == DTYPE_MIXED:
        dtype: Any = None
    elif kind == KIND_NDARRAY:
        dtype = np.dtype(dtype_str) if dtype_str else None
    elif kind in (KIND_TENSOR, KIND_JAGGED, KIND_STRIDED):
        dtype = NAME_TO_DTYPE.get(dtype_str) if dtype_str else None
    else:
        dtype = None
    dense = shape is not None and kind in (KIND_TENSOR, KIND_NDARRAY)
    return _entry(kind, dtype, torch.Size(shape) if dense else None)


def _per_sample_shapes(value: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of the samples of a nested tensor, without materialising each sample if avoidable."""
    if value.layout == torch.jagged and getattr(value, "_ragged_idx", None) == 1:
        # One ragged dim right after the batch dim: lengths are the offsets' differences.
        lengths = value.offsets().diff().tolist()
        tail = tuple(value.shape[2:])
        return [(n, *tail) for n in lengths]
    if value.layout == torch.strided:
        return [tuple(s) for s in value._nested_tensor_size().tolist()]
    return [tuple(t.shape) for t in value.unbind()]


def batchmeta_schema_of(name: str, value: Any, batch_size: int) -> dict:
    """The ``BatchMeta`` field-schema entry of field ``name`` of a TensorDict of ``batch_size`` rows.

    Dense tensors record their per-sample shape as a tuple (a 1-D tensor has per-sample shape
    ``()``); nested tensors record ``per_sample_shapes`` (``shape`` only if every sample has the
    same one); non-tensor values record ``is_non_tensor=True``, with the numpy dtype and
    per-sample shape of an array TensorDict keeps whole. Unlike :func:`describe_field` it does not
    check that the dtype can be stored.

    Raises:
        BatchSizeMismatch: a nested tensor does not have ``batch_size`` samples.
        UnsupportedValue: the value is a sub-TensorDict or not a tensor or non-tensor data.
    """
    if is_non_tensor(value):
        array = _batch_array(value, batch_size)
        if array is not None:
            return _entry(KIND_NDARRAY, array.dtype, tuple(array.shape[1:]))
        return _entry(KIND_OBJECT, None, None)
    if isinstance(value, torch.Tensor) and value.is_nested:
        shapes = _per_sample_shapes(value)
        if len(shapes) != batch_size:
            raise BatchSizeMismatch(
                f"field {name!r} is a nested tensor of {len(shapes)} samples but the batch has {batch_size}"
            )
        uniform = shapes[0] if shapes and all(s == shapes[0] for s in shapes) else None
        return _entry(_nested_kind(value), value.dtype, uniform, per_sample_shapes=shapes)
    if isinstance(value, torch.Tensor):
        return _entry(KIND_TENSOR, value.dtype, tuple(value.shape[1:]))
    if isinstance(value, TensorDictBase):
        raise UnsupportedValue(
            f"field {name!r} is a nested TensorDict; flatten it first with td.flatten_keys('.')"
        )
    raise UnsupportedValue(f"field {name!r} holds an unsupported {type(value).__name__}")
