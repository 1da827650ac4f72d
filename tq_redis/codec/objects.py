"""Safe object encoding: any plain Python value <-> bytes, without pickle by default.

msgpack with extension types for tuples, tensors (nested too), numpy arrays and scalars, sets,
complex and big ints, torch dtypes and sizes, and dataclass / ``NamedTuple`` instances of the
classes an allow-list names (:mod:`tq_redis.codec.item_classes`: the class's import path and its field
values; rebuilt without running ``__init__``). A tensor or numeric array inside a value is stored
in the same header-plus-raw-bytes format as a stored tensor value (:mod:`tq_redis.codec.wireformat`).
It never pickles unless the writer passes ``allow_pickle=True``, and it refuses to unpickle unless
the reader passes it too.

Used by the tensor codec for per-sample Python objects (:mod:`tq_redis.codec.tensors`), and on its own by
channels (:mod:`tq_redis.channel.channel`), the dock's key/value table and checkpoints.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import numpy as np
import torch

from tq_redis.codec import wireformat
from tq_redis.codec.item_classes import DATACLASS, REGISTERED, ItemClasses, record_kind
from tq_redis.errors import ItemClassNotAllowed, StorageError, TQError, UnsupportedValue
from tq_redis.meta.dtypes import DTYPE_TO_CODE, DTYPE_TO_NAME, NAME_TO_DTYPE, NO_DTYPE, RAW_NP_KINDS, dtype_from_code

__all__ = ["decode_object", "encode_object", "encode_samples"]

Buffer = bytes | bytearray | memoryview

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
_EXT_RECORD = 14
_EXT_PICKLE = 100

_COMPLEX = struct.Struct("<dd")


class _Unencodable(Exception):
    def __init__(self, obj: Any):
        super().__init__(obj)
        self.cls = type(obj)
        self.type_name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        self.record = record_kind(type(obj)) is not None


def _record_values(obj: Any, kind: str) -> Any:
    if kind == DATACLASS:
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return list(obj)


def _rebuild(cls: type, values: Any, path: str) -> Any:
    """An instance of an allowed record class from its field values, as pickle builds one: no
    ``__init__`` / ``__post_init__`` runs."""
    kind = record_kind(cls)
    if kind == DATACLASS:
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(values, dict) or sorted(values) != sorted(names):
            raise UnsupportedValue(
                f"stored {path} has fields {sorted(values) if isinstance(values, dict) else values!r}, but the class "
                f"here has {sorted(names)}: writer and reader use different versions of it"
            )
        obj = object.__new__(cls)
        for name in names:
            object.__setattr__(obj, name, values[name])
        return obj
    if not isinstance(values, list) or len(values) != len(cls._fields):  # type: ignore[attr-defined]
        raise UnsupportedValue(
            f"stored {path} has {len(values) if isinstance(values, list) else '?'} fields, but the class here has "
            f"{len(cls._fields)} ({', '.join(cls._fields)}): writer and reader use different versions of it"  # type: ignore[attr-defined]
        )
    return tuple.__new__(cls, values)


def _tensor_blob(t: torch.Tensor) -> bytes:
    t = wireformat.plain_tensor(t)
    return wireformat.header(wireformat.K_TENSOR, DTYPE_TO_CODE[t.dtype], t.shape) + wireformat.byte_view(t).tobytes()


def _ndarray_payload(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a)
    head = wireformat.header(wireformat.K_NDARRAY, NO_DTYPE, a.shape, a.dtype.str.encode())
    return head + wireformat.np_byte_view(a).tobytes()


def _make_packer(allow_pickle: bool, classes: ItemClasses) -> Callable[[Any], bytes]:
    def pack(obj: Any) -> bytes:
        return msgpack.packb(obj, default=default, strict_types=True, use_bin_type=True)

    def default(obj: Any) -> Any:
        t = type(obj)
        if t is tuple:
            return msgpack.ExtType(_EXT_TUPLE, pack(list(obj)))
        if isinstance(obj, torch.Tensor) and (
            obj.is_nested or (obj.dtype in DTYPE_TO_CODE and obj.layout == torch.strided)
        ):
            if obj.is_nested:
                layout = "jagged" if obj.layout == torch.jagged else "strided"
                return msgpack.ExtType(_EXT_NESTED, pack([layout, list(obj.unbind())]))
            return msgpack.ExtType(_EXT_TENSOR, _tensor_blob(obj))
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind in RAW_NP_KINDS:
                return msgpack.ExtType(_EXT_NDARRAY, _ndarray_payload(obj))
            if obj.dtype.kind == "O":
                return msgpack.ExtType(_EXT_NDARRAY_OBJ, pack([list(obj.shape), list(obj.reshape(-1))]))
        elif isinstance(obj, np.generic):
            dt = obj.dtype
            if dt.kind in RAW_NP_KINDS:
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
        elif isinstance(obj, torch.dtype) and obj in DTYPE_TO_NAME:
            return msgpack.ExtType(_EXT_TORCH_DTYPE, DTYPE_TO_NAME[obj].encode())
        elif isinstance(obj, torch.Size):
            return msgpack.ExtType(_EXT_TORCH_SIZE, pack(list(obj)))
        elif isinstance(obj, np.dtype) and obj.kind in RAW_NP_KINDS | {"O"}:
            return msgpack.ExtType(_EXT_NP_DTYPE, obj.str.encode())
        # Container subclasses (tensordict's LinkedList, OrderedDict, ...) become their base type;
        # namedtuples would lose their class, so they are not silently flattened.
        elif isinstance(obj, list):
            return list(obj)
        elif isinstance(obj, dict):
            return dict(obj)
        elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return msgpack.ExtType(_EXT_TUPLE, pack(list(obj)))
        kind = record_kind(t)
        if kind is not None:
            path = classes.path_of(t)
            if path is not None:
                return msgpack.ExtType(_EXT_RECORD, pack([path, _record_values(obj, kind)]))
        if allow_pickle:
            return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        raise _Unencodable(obj)

    return pack


def _raw_value(data: bytes) -> tuple[wireformat.Header, memoryview]:
    """The header and payload of a tensor or raw array inside an object (wireformat framing)."""
    mv = memoryview(data)
    h = wireformat.parse_header(mv, "<object>", 0)
    return h, mv[h.offset:]


def _make_unpacker(allow_pickle: bool, classes: ItemClasses) -> Callable[[Buffer], Any]:
    def unpack(data: Buffer) -> Any:
        return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False, use_list=True)

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_TUPLE:
            return tuple(unpack(data))
        if code == _EXT_TENSOR:
            h, payload = _raw_value(data)
            return wireformat.tensor_from_bytes(payload, dtype_from_code(h.code, "<object>"), h.shape)
        if code == _EXT_NESTED:
            layout, parts = unpack(data)
            return torch.nested.as_nested_tensor(
                parts, layout=torch.jagged if layout == "jagged" else torch.strided
            )
        if code == _EXT_NDARRAY:
            h, payload = _raw_value(data)
            return wireformat.ndarray_from_bytes(payload, wireformat.np_dtype(h.extra, "<object>"), h.shape)
        if code == _EXT_NDARRAY_OBJ:
            shape, items = unpack(data)
            return wireformat.object_array(items, tuple(shape))
        if code == _EXT_NPSCALAR:
            dt, raw = unpack(data)
            np_dt = wireformat.np_dtype(dt.encode(), "<object>")
            if np_dt.itemsize == 0:  # np.str_("") / np.bytes_(b"")
                return np_dt.type()
            return wireformat.ndarray_from_bytes(memoryview(raw), np_dt, ())[()]
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
            return NAME_TO_DTYPE[data.decode()]
        if code == _EXT_TORCH_SIZE:
            return torch.Size(unpack(data))
        if code == _EXT_NP_DTYPE:
            return wireformat.np_dtype(data, "<object>")
        if code == _EXT_RECORD:
            path, values = unpack(data)
            cls = classes.resolve(path) if isinstance(path, str) else None
            if cls is None:
                raise ItemClassNotAllowed(
                    f"the stored value holds an instance of {path}, which is not an allowed item class here: "
                    f"{classes.why_not_path(path) if isinstance(path, str) else 'the path is not a string'}. "
                    f"A reader allows the classes its program defines and has imported, and those registered "
                    f"with tq_redis.register_item_class (a channel also allows the classes its creator "
                    f"registered, and Channel.create(..., item_classes=[...]))", str(path)
                )
            return _rebuild(cls, values, path)
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


def _codec(allow_pickle: bool, classes: ItemClasses) -> tuple[Callable[[Any], bytes], Callable[[Buffer], Any]]:
    """The packer and unpacker for these options (made once per allow-list, kept on it)."""
    codec = classes.codecs.get(allow_pickle)
    if codec is None:
        codec = classes.codecs.setdefault(allow_pickle, (_make_packer(allow_pickle, classes),
                                                         _make_unpacker(allow_pickle, classes)))
    return codec


def _unsupported(where: str, error: _Unencodable, classes: ItemClasses, detail: str = "") -> UnsupportedValue:
    if error.record:
        return ItemClassNotAllowed(
            f"{where}: {error.type_name} is a dataclass/NamedTuple class that is not allowed here: "
            f"{classes.why_not(error.cls)}. Allow it with tq_redis.register_item_class("
            f"{error.type_name.rpartition('.')[2]}) in the processes that write and read it (a channel allows the "
            f"classes its creator registered, and Channel.create(..., item_classes=[...])), or pass "
            f"allow_pickle=True to pickle it (only if every reader trusts every writer)",
            error.type_name,
        )
    return _unsupported_type(where, error.type_name, detail)


def _unsupported_type(where: str, type_name: str, detail: str = "") -> UnsupportedValue:
    return UnsupportedValue(
        f"{where}: cannot store a value of type {type_name} safely{detail}. Convert it to tensors, "
        "numpy arrays or plain Python values (None, bool, int, float, str, bytes, list, tuple, "
        "dict, set), register it with tq_redis.register_item_class if it is a dataclass or NamedTuple, "
        "or pass allow_pickle=True to pickle it (only if every reader trusts every writer)"
    )


def encode_samples(field: str, items: Iterable[Any], *, allow_pickle: bool = False,
                   what: str | None = None, classes: ItemClasses | None = None) -> list[bytes]:
    """Encode one value per sample of field ``field``, as :func:`encode_object` does each.

    An error names the field and the sample, and ``what`` the value in an error about a value as
    a whole (default: the value's type name).

    Raises:
        UnsupportedValue: a value (or something inside it) has no safe encoding and
            ``allow_pickle`` is False.
    """
    classes = REGISTERED if classes is None else classes
    pack = _codec(allow_pickle, classes)[0]
    out = []
    for i, item in enumerate(items):
        try:
            out.append(pack(item))
        except _Unencodable as e:
            raise _unsupported(f"field {field!r}, sample {i}", e, classes) from None
        except (ValueError, OverflowError, RecursionError) as e:
            raise _unsupported_type(f"field {field!r}, sample {i}", what or type(item).__name__, f" ({e})") from e
    return out


def encode_object(obj: Any, *, allow_pickle: bool = False, classes: ItemClasses | None = None) -> bytes:
    """Encode one Python value with the safe object encoding (msgpack plus extension types).

    Supports None, bool, int (any size), float (NaN/inf too), complex, str, bytes, list, tuple,
    dict (any encodable keys), set, frozenset, tensors (any dtype, nested too), numpy arrays and
    scalars, torch dtypes and sizes, and instances of the dataclasses and NamedTuples that
    ``classes`` allows (default: this process's :data:`~tq_redis.codec.item_classes.REGISTERED`, which
    allows the registered classes and those the program defines; a channel's list has it as parent).
    ``bytearray`` comes back as ``bytes`` and subclasses of
    ``list``/``dict`` as their base type.

    Raises:
        ItemClassNotAllowed: a dataclass or NamedTuple whose class is not allowed (and
            ``allow_pickle`` is False); an :class:`~tq_redis.errors.UnsupportedValue`.
        UnsupportedValue: the value (or something inside it) has no safe encoding and
            ``allow_pickle`` is False.
    """
    classes = REGISTERED if classes is None else classes
    try:
        return _codec(allow_pickle, classes)[0](obj)
    except _Unencodable as e:
        raise _unsupported("object", e, classes) from None
    except (ValueError, OverflowError, RecursionError) as e:
        raise _unsupported_type("object", type(obj).__name__, f" ({e})") from e


def decode_object(buf: Buffer, *, allow_pickle: bool = False, classes: ItemClasses | None = None) -> Any:
    """Decode bytes produced by :func:`encode_object`.

    Raises:
        ItemClassNotAllowed: the bytes hold a dataclass or NamedTuple whose class ``classes``
            (default: :data:`~tq_redis.codec.item_classes.REGISTERED`) does not allow, or that
            cannot be found here (a class allowed only as the program's must be in a module this
            process has loaded: a reader never imports a module a stored value names).
        UnsupportedValue: the bytes hold a pickled object and ``allow_pickle`` is False.
        StorageError: the bytes are not a valid encoding (truncated or corrupt).
    """
    try:
        return _codec(allow_pickle, REGISTERED if classes is None else classes)[1](buf)
    except TQError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError, struct.error) as e:
        # msgpack's own errors are ValueErrors; the rest come from malformed extension payloads.
        raise StorageError(f"stored object is not a valid tq-redis object encoding ({e})") from e
