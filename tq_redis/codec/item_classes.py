"""Which dataclasses and NamedTuples the safe object encoding may carry: allow-lists of classes.

The safe encoding (:mod:`tq_redis.codec.objects`) stores a dataclass or ``NamedTuple`` instance as its
class's import path (``module:QualName``) and its field values, and a reader rebuilds it only as
a class on its allow-list, found by that path. Nothing is unpickled and no ``__init__`` or
``__post_init__`` runs: fields are set as pickle sets them. Anything else stays refused.

Allow-lists:

* :data:`REGISTERED`, this process's: :func:`register_item_class` adds to it (usable as a class
  decorator). Every encoding and decoding of this process allows it; values put with
  ``put``/``kv_batch_put`` and read by another process need the class registered there too.
* a channel's (:class:`tq_redis.Channel`): the classes the creating process had registered
  when it called ``Channel.create``, plus its ``item_classes=``, kept with the channel in Redis,
  so every process that uses the channel allows them without registering anything.

A class must be importable by its path: defined at module level (not inside a function).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from collections.abc import Iterable
from typing import Any, TypeVar

from tq_redis.errors import UnsupportedValue

__all__ = ["REGISTERED", "ItemClasses", "class_path", "record_kind", "register_item_class"]

T = TypeVar("T", bound=type)

DATACLASS, NAMEDTUPLE = "d", "n"


def record_kind(cls: type) -> str | None:
    """``"d"`` for a dataclass, ``"n"`` for a ``NamedTuple`` / ``collections.namedtuple``, else None."""
    if dataclasses.is_dataclass(cls) and isinstance(cls, type):
        return DATACLASS
    if isinstance(cls, type) and issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return NAMEDTUPLE
    return None


def class_path(cls: type) -> str:
    """``module:QualName`` of a dataclass or NamedTuple class, checked to be importable by it.

    Raises:
        UnsupportedValue: not a dataclass or NamedTuple, or defined where no other process can
            import it (inside a function).
    """
    if record_kind(cls) is None:
        raise UnsupportedValue(
            f"{getattr(cls, '__qualname__', cls)!r} is not a dataclass or NamedTuple class; only those can be "
            f"allowed as item classes (other values: tensors, numpy arrays, plain Python values)"
        )
    if "<locals>" in cls.__qualname__:
        raise UnsupportedValue(
            f"{cls.__module__}.{cls.__qualname__} is defined inside a function, so no other process can import "
            f"it; define it at module level to allow it as an item class"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


def _import(path: str) -> type | None:
    """The class at ``module:QualName``, imported; None when there is none."""
    module_name, _, qualname = path.partition(":")
    candidates = [module_name]
    if module_name == "__main__":  # a spawned multiprocessing child runs the parent's main as __mp_main__
        candidates.append("__mp_main__")
    for name in candidates:
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, type):
            return obj
    return None


class ItemClasses:
    """An allow-list of dataclass and NamedTuple classes, by import path.

    ``parent``'s classes are allowed too (a channel's list has :data:`REGISTERED` as parent).
    A path may be allowed before its class is imported here; :meth:`resolve` imports it then.
    """

    def __init__(self, classes: Iterable[type | str] = (), *, parent: ItemClasses | None = None) -> None:
        self._lock = threading.Lock()
        self._paths: set[str] = set()
        self._resolved: dict[str, type] = {}
        self._parent = parent
        self.codecs: dict[bool, Any] = {}  # the safe encoding's packer/unpacker for this list (tq_redis.codec.objects)
        self.add(*classes)

    def add(self, *classes: type | str) -> list[str]:
        """Allow these classes (or import paths); returns the paths that were not allowed before."""
        added = []
        for cls in classes:
            path = cls if isinstance(cls, str) else class_path(cls)
            with self._lock:
                if path not in self._paths:
                    self._paths.add(path)
                    added.append(path)
                if not isinstance(cls, str):
                    self._resolved[path] = cls
        return added

    def paths(self) -> set[str]:
        """Every allowed path, the parent's included."""
        with self._lock:
            own = set(self._paths)
        return own | (self._parent.paths() if self._parent is not None else set())

    def path_of(self, cls: type) -> str | None:
        """The path ``cls`` is allowed under, or None when it is not allowed."""
        if self._parent is not None:
            found = self._parent.path_of(cls)
            if found is not None:
                return found
        try:
            path = class_path(cls)
        except UnsupportedValue:
            return None
        with self._lock:
            if path not in self._paths:
                return None
            known = self._resolved.get(path)
        if known is None:  # allowed by path only: the class found there must be this one
            known = self._load(path)
        return path if known is cls else None

    def resolve(self, path: str) -> type | None:
        """The allowed class at ``path`` (imported on first use), or None when it is not allowed."""
        if self._parent is not None:
            found = self._parent.resolve(path)
            if found is not None:
                return found
        with self._lock:
            if path not in self._paths:
                return None
            known = self._resolved.get(path)
        return known if known is not None else self._load(path)

    def _load(self, path: str) -> type | None:
        cls = _import(path)
        if cls is None or record_kind(cls) is None:
            return None
        with self._lock:
            self._resolved[path] = cls
        return cls


REGISTERED = ItemClasses()
"""This process's allow-list: every encoding and decoding here allows its classes."""


def register_item_class(cls: T) -> T:
    """Allow ``cls`` (a dataclass or NamedTuple defined at module level) in this process's safe
    encoding and decoding; returns it, so it also works as a class decorator.

    Channels created afterwards by this process allow it in every process that uses them.

    Raises:
        UnsupportedValue: ``cls`` is not a dataclass or NamedTuple, or not importable by path.
    """
    REGISTERED.add(cls)
    return cls
