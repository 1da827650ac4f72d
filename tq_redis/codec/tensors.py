"""Tensor codec: one field of a batch <-> one stored value per sample.

A field of a batch (a value of a ``TensorDict``) is split into one stored value per sample, so
each (sample, field) can live under its own key in a KV store. A stored value is a list of buffer
*segments* whose concatenation is the stored bytes: a small self-describing binary header
(:mod:`tq_redis.codec.wireformat`) followed, for tensors and numeric arrays, by a ``memoryview`` of the
batch's own memory (no pickle, no copy for contiguous CPU tensors).

Kinds (:mod:`tq_redis.meta.schemas`) and what ``decode_field`` returns for them:

* ``tensor``  - dense tensor, batch dim first -> one stacked dense tensor (one copy).
* ``jagged``  - ``torch.jagged`` nested tensor, one component per sample -> jagged nested tensor.
* ``strided`` - nested tensor with the strided layout -> strided nested tensor.
* ``ndarray`` - numpy array, batch dim first (numeric, ``S``, ``U``, datetime raw; ``object``
  arrays element-wise through the safe object encoding) -> numpy array.
* ``object``  - any other per-sample Python value -> ``NonTensorStack`` (what ``TensorDict``
  itself builds from a list of non-tensor values).

Per-sample Python objects go through the safe object encoding (:mod:`tq_redis.codec.objects`): no
pickle unless the caller passes ``allow_pickle=True``. Decoding a batch whose values share one
header copies every payload into one output in a single call (:mod:`tq_redis.codec.fastcopy`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from tq_redis.codec import batchscan, buffers, fastcopy
from tq_redis.codec.batches import RowBlock, ValueTable
from tq_redis.codec.objects import decode_object, encode_samples
from tq_redis.codec.wireformat import (
    K_JAGGED,
    K_NDARRAY,
    K_OBJECT,
    K_STRIDED,
    K_TENSOR,
    ROW_HEADER_SIZE,
    Header,
    byte_view,
    header,
    ndarray_from_bytes,
    np_byte_view,
    np_dtype,
    object_array,
    parse_header,
    plain_tensor,
    prod,
    row_lengths,
    row_prefix,
    tensor_from_bytes,
)
from tq_redis.errors import EmptyBatch, StorageError, UnsupportedValue
from tq_redis.meta.dtypes import NO_DTYPE, dtype_code, dtype_from_code
from tq_redis.meta.jagged import JAGGED_CLASS, jagged_tensor, parts_of, row_offsets
from tq_redis.meta.schemas import (
    KIND_JAGGED,
    KIND_NDARRAY,
    KIND_STRIDED,
    KIND_TENSOR,
    batch_size_mismatch,
    classify,
)

__all__ = ["assemble", "decode_field", "decode_tensordict", "encode_field", "encode_tensordict"]

Buffer = bytes | bytearray | memoryview
Segments = list[bytes | memoryview]

_FORMAT = operator.attrgetter("format")
_NDIM = operator.attrgetter("ndim")


# ----------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------


def _encode_dense(name: str, t: torch.Tensor, n: int) -> RowBlock:
    t = plain_tensor(t)
    hdr = header(K_TENSOR, dtype_code(name, t.dtype), t.shape[1:])
    nb = prod(t.shape[1:]) * t.element_size()
    return RowBlock(hdr, byte_view(t), nb, n)


def _encode_jagged(name: str, nt: torch.Tensor, n: int) -> list[Segments]:
    parts = parts_of(nt)
    code = dtype_code(name, parts.values.dtype)
    if parts.ragged_idx == 1 and parts.lengths is None:
        values = plain_tensor(parts.values)
        offsets = parts.offsets.tolist()
        rest = tuple(values.shape[1:])
        row = prod(rest) * values.element_size()
        mv = byte_view(values)
        out = []
        for i in range(n):
            a, b = offsets[i], offsets[i + 1]
            out.append([header(K_JAGGED, code, (b - a, *rest)), mv[a * row:b * row]])
        return out
    # Holes (lengths) or a transposed ragged dim: fall back to per-component copies.
    parts = [plain_tensor(c) for c in nt.detach().unbind()]
    return [[header(K_JAGGED, code, c.shape), byte_view(c)] for c in parts]


def _encode_strided(name: str, nt: torch.Tensor) -> list[Segments]:
    code = dtype_code(name, nt.dtype)
    nt = nt.detach()
    if nt.device.type != "cpu":
        nt = nt.cpu()
    parts = [plain_tensor(c) for c in nt.unbind()]
    return [[header(K_STRIDED, code, c.shape), byte_view(c)] for c in parts]


def _encode_ndarray(name: str, a: np.ndarray, n: int, allow_pickle: bool) -> Sequence[Segments]:
    a = np.ascontiguousarray(a)
    shape = a.shape[1:]
    hdr = header(K_NDARRAY, NO_DTYPE, shape, a.dtype.str.encode())
    if a.dtype.kind == "O":
        flat = a.reshape(n, prod(shape))
        rows = (list(flat[i]) for i in range(n))
        return [[hdr, b] for b in encode_samples(name, rows, allow_pickle=allow_pickle, what="object array element")]
    nb = prod(shape) * a.dtype.itemsize
    return RowBlock(hdr, np_byte_view(a), nb, n)


_OBJ_HDR = header(K_OBJECT, NO_DTYPE, ())


def _encode_objects(name: str, values: Any, allow_pickle: bool) -> list[Segments]:
    items = values.tolist() if isinstance(values, NonTensorStack) else values
    return [[_OBJ_HDR, b] for b in encode_samples(name, items, allow_pickle=allow_pickle)]


def encode_field(
    name: str, value: Any, batch_size: int, *, allow_pickle: bool = False
) -> tuple[dict, Sequence[Segments]]:
    """Split one field of a batch into one stored value per sample.

    Returns ``(schema, per_sample)`` where ``schema`` is the field's JSON schema
    (:func:`tq_redis.meta.schemas.describe_field`) and ``per_sample[i]`` is a list of segments (a
    header ``bytes`` and usually a one-dimensional byte ``memoryview`` of the batch's memory, so
    ``len`` is every segment's size in bytes) whose concatenation is sample ``i``'s stored value.
    Dense fields come back as a :class:`~tq_redis.codec.batches.RowBlock` (such a sequence
    that stores can also copy as a whole). The memoryviews borrow the batch's memory: keep the
    segments (or the source) alive until they are written.

    Raises:
        EmptyBatch: ``batch_size`` is 0.
        BatchSizeMismatch: the value's first dimension is not ``batch_size``.
        UnsupportedValue: the value, or a per-sample object inside it, cannot be stored safely
            (pass ``allow_pickle=True`` to pickle objects msgpack cannot represent).
    """
    if batch_size <= 0:
        raise EmptyBatch(f"field {name!r}: batch size is {batch_size}; put at least one sample")
    schema, kind, src = classify(name, value, batch_size)
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


def _decode_one(name: str, i: int, mv: memoryview, h: Header, allow_pickle: bool) -> Any:
    """One sample's value on its own (used when a batch cannot be decoded in bulk)."""
    payload = mv[h.offset:]
    if h.kind in (K_TENSOR, K_JAGGED, K_STRIDED):
        return tensor_from_bytes(payload, dtype_from_code(h.code, name), h.shape)
    try:
        if h.kind == K_NDARRAY:
            dt = np_dtype(h.extra, name)
            if dt.kind == "O":
                return object_array(decode_object(payload, allow_pickle=allow_pickle), h.shape)
            return ndarray_from_bytes(payload, dt, h.shape)
        return decode_object(payload, allow_pickle=allow_pickle)
    except (UnsupportedValue, StorageError) as e:
        raise type(e)(f"field {name!r}, sample {i}: {e}") from None


def _jagged_from_parts(
    name: str, dtype: torch.dtype, lengths: list[int], rest: tuple[int, ...], payloads: list[memoryview]
) -> torch.Tensor:
    """The jagged tensor of rows ``lengths[i] x rest`` whose bytes are ``payloads[i]``."""
    row = prod(rest) * dtype.itemsize
    sizes = list(map(len, payloads))
    if sizes != [n * row for n in lengths]:
        i = next(i for i, (n, size) in enumerate(zip(lengths, sizes)) if size != n * row)
        raise StorageError(
            f"field {name!r}, sample {i}: stored jagged component is {sizes[i]} bytes but its header "
            f"says {lengths[i] * row}; the value is truncated or corrupt"
        )
    n = len(payloads)
    bounds = row_offsets(lengths)
    total = int(bounds[-1])
    if total * row <= JOIN_MAX_BYTES:
        values = _joined(payloads, dtype, (total, *rest))
    else:  # one native copy of every row, the GIL released for a large batch
        values = torch.empty((total, *rest), dtype=dtype)
        if row:
            fastcopy.copy_table(byte_view(values), bounds[:-1] * row, payloads, np.arange(n), np.zeros(n, np.int64),
                                np.fromiter(sizes, np.int64, n))  # fmt: skip
    # Without the bounds torch pads to_padded_tensor() to the total length, not the longest row.
    return jagged_tensor(values, torch.from_numpy(bounds), min(lengths), max(lengths))


#: Up to this many bytes in all, a field's payloads are joined into one new buffer that the
#: decoded tensor wraps: one C call, where the native copier's tables cost more for a few small
#: rows (~25 µs of a 16-row jagged field). Larger batches go to :mod:`tq_redis.codec.fastcopy`.
JOIN_MAX_BYTES = 64 << 10


def _framed_payloads(mvs: list[memoryview], prefix: bytes, size: int) -> bytearray | None:
    """The parts after ``prefix`` of every value, joined, when each is ``size`` bytes and starts
    with ``prefix`` (one native pass, :mod:`tq_redis.codec.batchscan`, where built); else ``None``."""
    if batchscan.NATIVE:
        return batchscan.join_framed(mvs, prefix, size)
    return bytearray().join([mv[len(prefix) :] for mv in mvs]) if _all_framed(mvs, prefix, size) else None


def _joined(payloads: list[memoryview], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``shape`` whose bytes are ``payloads`` one after another (they add up to it)."""
    return _wrapped(bytearray().join(payloads), dtype, shape)


def _wrapped(buf: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``shape`` whose memory is ``buf`` (no copy; an empty one for no bytes)."""
    if not buf:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=dtype)
    return flat if len(shape) == 1 else flat.reshape(shape)


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
    return jagged_tensor(t.reshape(n * length, *t.shape[2:]), _even_offsets(n, length), length, length)


@functools.lru_cache(maxsize=256)
def _even_offsets(n: int, length: int) -> torch.Tensor:
    """The offsets of ``n`` rows of ``length`` each, one tensor per shape shared by every batch of it.

    torch names a jagged tensor's ragged dimension after its offsets tensor: a shared one is
    looked up instead of registered anew for each batch (most of a tiny ``get_data``), and
    same-shaped fields can be combined (``a * b``) as torch allows only for one ragged dimension.
    """
    if not length:
        return torch.zeros(n + 1, dtype=torch.int64)
    return torch.arange(0, (n + 1) * length, length, dtype=torch.int64)


def _empty_batch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; large ones come from the warm buffer cache (see ``buffers``)."""
    nbytes = prod(shape) * dtype.itemsize
    if nbytes < buffers.MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(buffers.take(nbytes)).view(dtype).reshape(shape)


def _as_bytes_view(value: Any) -> memoryview:
    if isinstance(value, torch.Tensor):  # e.g. a uint8 receive buffer
        value = value.numpy()
    mv = value if isinstance(value, memoryview) else memoryview(value)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _bytes_views(values: Sequence[Buffer]) -> list[memoryview]:
    """``values`` as one-dimensional byte memoryviews (a store's views usually already are)."""
    types = set(map(type, values))
    if types == {bytes}:  # values read from Redis (inline)
        return list(map(memoryview, values))
    if types == {memoryview} and set(map(_FORMAT, values)) == {"B"} and set(map(_NDIM, values)) == {1}:
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
    h0 = parse_header(table[0] if table is not None else mvs[0], name, 0)

    if h0.kind == K_TENSOR or (h0.kind == K_NDARRAY and not h0.extra.startswith(b"|O")):
        # Fast path: every value has the first one's header, so copy payloads into one batch.
        hlen = h0.offset
        prefix = (table[0] if table is not None else mvs[0])[:hlen].tobytes()
        if h0.kind == K_TENSOR:
            dtype = dtype_from_code(h0.code, name)
            nb = prod(h0.shape) * dtype.itemsize
        else:
            array_dtype = np_dtype(h0.extra, name)
            nb = prod(h0.shape) * array_dtype.itemsize
        if h0.kind == K_TENSOR and table is None and n * nb <= JOIN_MAX_BYTES:
            buf = _framed_payloads(mvs, prefix, hlen + nb)
            if buf is not None:
                out: Any = _wrapped(buf, dtype, (n, *h0.shape))
                return _dense_to_jagged(out) if nested_output and out.ndim >= 2 else out
        framed = _table_framed(table, prefix, hlen + nb) if table is not None else _all_framed(mvs, prefix, hlen + nb)
        if framed:
            if h0.kind == K_TENSOR:
                out = _empty_batch((n, *h0.shape), dtype)
                dest = byte_view(out)
            else:
                out = np.empty((n, *h0.shape), dtype=array_dtype)
                dest = np_byte_view(out)
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
    if h0.kind == K_JAGGED and len(h0.shape) == 1 and not h0.extra:
        dtype = dtype_from_code(h0.code, name)
        joined = batchscan.join_rows(mvs, row_prefix(K_JAGGED, h0.code), dtype.itemsize, JOIN_MAX_BYTES)
        if joined is not None:  # the native module checked, measured and joined the rows in one pass
            buf, offsets, shortest, longest = joined
            flat = _wrapped(buf, dtype, (len(buf) // dtype.itemsize,))
            return jagged_tensor(flat, torch.frombuffer(offsets, dtype=torch.int64), shortest, longest)
        lengths = row_lengths(mvs, K_JAGGED, h0.code, dtype.itemsize)
        if lengths is not None:  # one 1-D row per sample, the usual jagged field: no header objects
            return _jagged_from_parts(name, dtype, lengths, (), [mv[ROW_HEADER_SIZE:] for mv in mvs])
    headers = [h0] + [parse_header(mv, name, i) for i, mv in enumerate(mvs[1:], 1)]
    kinds = {h.kind for h in headers}
    if kinds == {K_JAGGED} and len({h.code for h in headers}) == 1 \
            and len({h.shape[1:] for h in headers}) == 1 and len(h0.shape) >= 1:
        return _jagged_from_parts(
            name,
            dtype_from_code(h0.code, name),
            [h.shape[0] for h in headers],
            tuple(h0.shape[1:]),
            [mv[h.offset:] for mv, h in zip(mvs, headers)],
        )
    if kinds == {K_NDARRAY} and {(h.extra, h.shape) for h in headers} == {(b"|O", h0.shape)}:
        out = np.empty((n, *h0.shape), dtype=object)
        flat = out.reshape(n, prod(h0.shape))
        for i, (mv, h) in enumerate(zip(mvs, headers)):
            items = _decode_one(name, i, mv, Header(K_OBJECT, 0, (), b"", h.offset), allow_pickle)
            row = flat[i]
            if not isinstance(items, list) or len(items) != len(row):
                raise StorageError(
                    f"field {name!r}, sample {i}: stored object array does not match its shape"
                )
            for j, item in enumerate(items):
                row[j] = item
        return out
    parts = [_decode_one(name, i, mv, h, allow_pickle) for i, (mv, h) in enumerate(zip(mvs, headers))]
    if kinds <= {K_TENSOR, K_JAGGED}:
        # Shapes or dtypes differ between values, e.g. rows of two partitions.
        combined = _combine_tensors(parts)
        if nested_output and isinstance(combined, torch.Tensor) and not combined.is_nested \
                and combined.ndim >= 2:
            return _dense_to_jagged(combined)
        return combined
    if kinds == {K_STRIDED}:
        if len({p.dtype for p in parts}) == 1 and len({p.ndim for p in parts}) == 1:
            if nested_output and parts[0].ndim >= 1 and len({p.shape[1:] for p in parts}) == 1:
                # One ragged dimension: the reference's layout is jagged (len() and list() work).
                return torch.nested.as_nested_tensor(parts, layout=torch.jagged)
            return torch.nested.as_nested_tensor(parts, layout=torch.strided)
        return _stack_objects(parts)
    if kinds == {K_NDARRAY}:
        try:
            # np.stack also promotes S/U arrays of different string lengths.
            return np.stack(parts)
        except ValueError:
            return object_array(parts, (n,))
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


def assemble(columns: dict[str, Any], batch_size: int) -> TensorDict:
    """A TensorDict with ``batch_size=[batch_size]`` of decoded columns (one row per sample each).

    When every column is a tensor (dense or jagged), TensorDict's checks are skipped: the decoder
    built each with ``batch_size`` rows, and for a jagged tensor the checks re-derive its shape
    through torch's dispatcher (~50 µs a field, most of a tiny ``get_data``). A non-tensor column
    (strings, objects) goes through the checked constructor, which wraps it.
    """
    fast = _new_unsafe is not None and all(type(v) in _TENSOR_TYPES for v in columns.values())
    if fast:
        return _new_unsafe(columns, batch_size=torch.Size([batch_size]))
    return TensorDict(columns, batch_size=[batch_size])


_TENSOR_TYPES = (torch.Tensor,) if JAGGED_CLASS is None else (torch.Tensor, JAGGED_CLASS)
_new_unsafe = getattr(TensorDict, "_new_unsafe", None)


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
            raise batch_size_mismatch(name, len(values), batch_size)
        out[name] = decode_field(name, values, allow_pickle=allow_pickle, nested_output=nested_output)
    return assemble(out, batch_size)
