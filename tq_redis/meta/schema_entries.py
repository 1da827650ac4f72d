"""``BatchMeta.field_schema``: the per-field entries a batch carries, and how batch operations change them.

Field schema entries (``BatchMeta.field_schema[name]``) hold:

``dtype``          ``torch.dtype`` of the field, ``numpy.dtype`` for numpy arrays that TensorDict
                   keeps as non-tensor data, ``None`` for other Python objects
``shape``          per-sample shape as a tuple (batch dimension excluded); ``None`` when samples
                   differ in shape, or for Python objects
``is_nested``      ``True`` for nested-tensor fields (samples may differ in shape)
``is_non_tensor``  ``True`` for values stored next to tensors (strings, dicts, numpy arrays ...)
``per_sample_shapes``  only for nested fields: one shape tuple per sample, in batch order
``kind``           one of the ``KIND_*`` constants (defined in ``tq_redis.meta.schemas``)

An entry is built from a value by :func:`tq_redis.meta.schemas.batchmeta_schema_of`; this module checks
the entries a caller hands to ``BatchMeta`` and derives the schema of a selection or a
concatenation of batches. Plain functions over dicts; depends on :mod:`tq_redis.meta.schemas` and the
errors.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from tq_redis.errors import BatchSizeMismatch, InvalidArgument
from tq_redis.meta.schemas import KIND_JAGGED, KIND_NDARRAY, KIND_OBJECT, KIND_TENSOR, batchmeta_schema_of

__all__ = [
    "FieldSchema",
    "check_concat_schemas",
    "concat_schema",
    "copy_schema",
    "extract_field_schema",
    "field_kind",
    "normalized_schema",
    "take_schema",
]

FieldSchema = dict[str, dict[str, Any]]
"""Field name -> schema entry."""


def field_kind(meta: Mapping[str, Any]) -> str:
    """Return the ``kind`` of a field schema entry, deriving it from the flags when absent."""
    kind = meta.get("kind")
    if kind is not None:
        return kind
    if meta.get("is_non_tensor"):
        return KIND_NDARRAY if isinstance(meta.get("dtype"), np.dtype) else KIND_OBJECT
    if meta.get("is_nested"):
        return KIND_JAGGED
    return KIND_TENSOR


def _normalized_field_meta(name: str, meta: Any) -> dict[str, Any]:
    if not isinstance(meta, Mapping):
        raise InvalidArgument(
            f"field_schema[{name!r}] must be a dict with keys dtype, shape, is_nested, is_non_tensor; "
            f"got {type(meta).__name__}"
        )
    out = dict(meta)
    if "kind" not in out:
        out["kind"] = field_kind(out)
    return out


def normalized_schema(field_schema: Mapping[str, Mapping[str, Any]] | None, n: int) -> FieldSchema:
    """A caller's field schema for a batch of ``n``, copied one level deep, each entry with a ``kind``.

    Raises:
        InvalidArgument: an entry is not a dict.
        BatchSizeMismatch: an entry's ``per_sample_shapes`` does not have one shape per sample.
    """
    schema: FieldSchema = {}
    for name, meta in (field_schema or {}).items():
        entry = _normalized_field_meta(name, meta)
        shapes = entry.get("per_sample_shapes")
        if shapes is not None:
            if len(shapes) != n:
                raise BatchSizeMismatch(
                    f"field_schema[{name!r}]['per_sample_shapes'] has {len(shapes)} entries "
                    f"for a batch of {n}"
                )
            entry["per_sample_shapes"] = list(shapes)
        schema[name] = entry
    return schema


_IMMUTABLE = (str, int, float, bool, type(None), torch.dtype, np.dtype)


def _immutable(value: Any) -> bool:
    if isinstance(value, tuple):  # a shape (torch.Size is a tuple)
        return all(isinstance(v, int) for v in value)
    return isinstance(value, _IMMUTABLE)


def copy_schema(schema: Mapping[str, Mapping[str, Any]]) -> FieldSchema:
    """A deep copy of ``schema``, made cheaply: the entries tq-redis builds hold only immutable
    values and a list of shape tuples, so those are copied one level deep (``copy.deepcopy`` of a
    few fields' entries was most of a small ``put(metadata=...)``); an entry holding anything else
    is deep-copied."""
    out: FieldSchema = {}
    for name, meta in schema.items():
        entry = dict(meta)
        for key, value in meta.items():
            if key == "per_sample_shapes" and isinstance(value, list) and all(map(_immutable, value)):
                entry[key] = list(value)
            elif not _immutable(value):
                entry[key] = copy.deepcopy(value)
        out[name] = entry
    return out


def take_schema(schema: Mapping[str, Mapping[str, Any]], positions: list[int] | slice) -> FieldSchema:
    """The schema of the samples at ``positions`` (validated by the caller): jagged fields keep
    only those samples' ``per_sample_shapes``; entries are copied one level deep."""
    out: FieldSchema = {}
    for name, meta in schema.items():
        entry = dict(meta)
        shapes = meta.get("per_sample_shapes")
        if shapes is not None:
            entry["per_sample_shapes"] = (
                shapes[positions] if isinstance(positions, slice) else [shapes[i] for i in positions]
            )
        out[name] = entry
    return out


def check_concat_schemas(schemas: Sequence[Mapping[str, Mapping[str, Any]]]) -> None:
    """Check that batches with these schemas can be concatenated: same field names, same dtypes.

    Raises:
        InvalidArgument: a batch's field names, or a field's dtype, differ from the first batch's.
    """
    first = schemas[0]
    names = sorted(first)
    for pos, other in enumerate(schemas[1:], start=1):
        if sorted(other) != names:
            extra = sorted(set(other) - set(names))
            missing = sorted(set(names) - set(other))
            raise InvalidArgument(
                f"concat: batch #{pos} has different fields than batch #0 (extra {extra}, "
                f"missing {missing}); select_fields() a common set first"
            )
    for name in names:
        dtype = first[name].get("dtype")
        for pos, other in enumerate(schemas[1:], start=1):
            other_dtype = other[name].get("dtype")
            if other_dtype != dtype:
                raise InvalidArgument(
                    f"concat: field {name!r} is {dtype} in batch #0 but {other_dtype} in "
                    f"batch #{pos}; cast the data to one dtype"
                )


def concat_schema(parts: Sequence[tuple[Mapping[str, Mapping[str, Any]], int]]) -> FieldSchema:
    """The schema of the concatenation of batches given as ``(field_schema, size)``, in order.

    The fields are the first batch's. A field that is jagged in any batch, or whose dense shape
    differs between batches, becomes jagged in the result (with ``per_sample_shapes``).
    """
    return {name: _concat_field_meta(name, parts) for name in parts[0][0]}


def _concat_field_meta(name: str, parts: Sequence[tuple[Mapping[str, Mapping[str, Any]], int]]) -> dict[str, Any]:
    metas = [schema.get(name) for schema, _ in parts]
    base = dict(next(m for m in metas if m is not None))
    present = [m for m in metas if m is not None]
    tensor = not base.get("is_non_tensor", False)
    dense_shapes = {m.get("shape") for m in present if not m.get("is_nested")}
    jagged = tensor and (
        any(m.get("is_nested") for m in present)
        or any(m.get("per_sample_shapes") is not None for m in present)
        or len(dense_shapes) > 1
    )
    if not jagged:
        base.pop("per_sample_shapes", None)
        return base
    shapes: list[Any] = []
    for (_, size), m in zip(parts, metas):
        if m is not None and m.get("per_sample_shapes") is not None:
            shapes.extend(m["per_sample_shapes"])
        else:
            shapes.extend([m.get("shape") if m is not None else None] * size)
    base.update(
        is_nested=True,
        # A dense field that turned ragged across batches is described as jagged.
        kind=field_kind(base) if base.get("is_nested") else KIND_JAGGED,
        shape=shapes[0] if all(s == shapes[0] for s in shapes) else None,
        per_sample_shapes=shapes,
    )
    return base


def extract_field_schema(data: TensorDictBase) -> FieldSchema:
    """Describe each field of a TensorDict as a field-schema entry (see the module docstring).

    The first batch dimension of ``data`` is the sample dimension. Dense tensors record their
    per-sample shape (a 1-D tensor has per-sample shape ``()``); nested tensors record
    ``is_nested=True`` and ``per_sample_shapes`` (``shape`` only if every sample has the same
    one); non-tensor values record ``is_non_tensor=True``. Each entry is
    :func:`tq_redis.meta.schemas.batchmeta_schema_of`'s.

    Raises:
        InvalidArgument: ``data`` has no batch dimension.
        BatchSizeMismatch: a nested tensor does not have one sample per row.
        UnsupportedValue: a field holds a sub-TensorDict (flatten it with ``data.flatten_keys()``).
    """
    if not isinstance(data, TensorDictBase):
        raise InvalidArgument(f"expected a TensorDict, got {type(data).__name__}")
    if len(data.batch_size) == 0:
        raise InvalidArgument("the TensorDict has no batch dimension; build it with batch_size=[num_samples]")
    n = int(data.batch_size[0])
    return {name: batchmeta_schema_of(name, value, n) for name, value in data.items()}
