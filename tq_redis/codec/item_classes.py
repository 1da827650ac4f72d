"""Which dataclasses and NamedTuples the safe object encoding may carry: the allow rule.

The safe encoding (:mod:`tq_redis.codec.objects`) stores a dataclass or ``NamedTuple`` instance as its
class's import path (``module:QualName``) and its field values, and a reader rebuilds it only as
an allowed class, found by that path. Nothing is unpickled and no ``__init__`` or
``__post_init__`` runs: fields are set as pickle sets them. Anything else stays refused.

A class is allowed when it is

* **defined by the program** (the default; :func:`program_class_path`): a module-level class of a
  module this process has already imported whose source file lies outside the Python installation
  (the standard library, ``site-packages``/``dist-packages``, the user's site directory) and outside
  tq-redis itself, or of the program's ``__main__`` (a script, ``-c``, a notebook). Classes of
  installed packages and the standard library are not the program's: allow them explicitly.
  ``REGISTERED.program_classes = False`` turns this default off in a process.
* on :data:`REGISTERED`, this process's list: :func:`register_item_class` adds to it (usable as a class
  decorator). Every encoding and decoding of this process allows it; values put with
  ``put``/``kv_batch_put`` and read by another process need the class allowed there too.
* on a channel's list (:class:`tq_redis.Channel`): the classes the creating process had registered
  when it called ``Channel.create``, plus its ``item_classes=``, kept with the channel in Redis,
  so every process that uses the channel allows them without registering anything.

A reader applies the same rule on its side. For a class allowed only as the program's, it looks the
path up among the modules it has **already imported** and never imports one: the path comes with the
data, and importing a module runs its code, so a stored value could otherwise make a consumer run a
module it did not choose (a ``setup.py`` or ``conftest.py`` in its working directory, a library's
lazy ``__getattr__``). It walks the path through the modules' and classes' own ``__dict__`` (no
``getattr`` hooks run), and the class found must be a dataclass or NamedTuple that carries that very
path and passes the rule. Only a path on an explicit list (a registration, a channel's
``item_classes``) is imported when not loaded yet: whoever allowed it chose that module.

A class must be importable by its path: defined at module level (not inside a function).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import site
import sys
import sysconfig
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from tq_redis.errors import UnsupportedValue

__all__ = ["REGISTERED", "ItemClasses", "class_path", "program_class", "program_class_path", "record_kind",
           "register_item_class", "why_not_program"]

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


_MAIN = ("__main__", "__mp_main__")  # a spawned multiprocessing child runs the parent's main as __mp_main__
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})


def _module_names(name: str) -> tuple[str, ...]:
    """The names the module ``name`` may be loaded under in this process."""
    if name in _MAIN:
        return (name, *(other for other in _MAIN if other != name))
    return (name,)


@functools.cache
def _installed_dirs() -> tuple[str, ...]:
    """The folders whose modules are not the program's: the Python installation's library folders
    (this environment's and its base's), the site folders, and tq-redis's own package."""
    dirs = {str(Path(__file__).resolve().parent.parent)}
    for scheme_vars in (None, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme_vars) if scheme_vars else sysconfig.get_paths()
        dirs.update(paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key))
    getsitepackages = getattr(site, "getsitepackages", None)  # absent in some virtualenv site.py versions
    if getsitepackages is not None:
        dirs.update(getsitepackages())
    dirs.add(site.getusersitepackages())
    return tuple(sorted({os.path.realpath(d) for d in dirs if d}))


def _installed_file(file: str) -> bool:
    real = os.path.realpath(file)
    if _PACKAGE_DIRS.intersection(Path(real).parts):
        return True
    return any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in _installed_dirs())


def _walk(module: Any, qualname: str) -> type | None:
    """The class at ``qualname`` in ``module``, found through the objects' own ``__dict__`` (no
    module ``__getattr__``, no descriptor runs); None when there is none."""
    obj: Any = module
    for part in qualname.split("."):
        try:
            namespace = vars(obj)
        except TypeError:
            return None
        obj = namespace.get(part)
        if obj is None:
            return None
    return obj if isinstance(obj, type) else None


_PROGRAM_LOCK = threading.Lock()
_PROGRAM: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()


def why_not_program(cls: type) -> str | None:
    """None when ``cls`` is a class the program defines (see the module docstring), else why not,
    in words for an error message."""
    with _PROGRAM_LOCK:
        if cls in _PROGRAM:
            return _PROGRAM[cls]
    reason = _why_not_program(cls)
    if reason is None or "not imported" not in reason:  # an import may come later: ask again then
        with _PROGRAM_LOCK:
            _PROGRAM[cls] = reason
    return reason


def _why_not_program(cls: type) -> str | None:
    if record_kind(cls) is None:
        return "it is not a dataclass or NamedTuple class"
    module_name, qualname = cls.__module__, cls.__qualname__
    if "<locals>" in qualname:
        return "it is defined inside a function, so no other process can find it by its path"
    module = next((sys.modules[n] for n in _module_names(module_name) if n in sys.modules), None)
    if module is None:
        return f"its module {module_name} is not imported in this process"
    if _walk(module, qualname) is not cls:
        return f"{module_name}:{qualname} does not lead to it (it was redefined, renamed or made at run time)"
    file = vars(module).get("__file__")
    if not isinstance(file, str) or not file:
        if module_name in _MAIN:
            return None  # the program's own __main__: -c, a REPL, a notebook
        return f"its module {module_name} has no source file (built in, frozen or a namespace package)"
    if _installed_file(file):
        return (f"it comes from an installed package or the standard library ({file}), and only classes the "
                f"program defines are allowed by default")
    return None


def program_class_path(cls: type) -> str | None:
    """``module:QualName`` of ``cls`` when the program defines it (allowed by default), else None."""
    return class_path(cls) if why_not_program(cls) is None else None


def _loaded_class(path: str) -> tuple[type | None, str]:
    """The class at ``path`` among the modules this process has loaded (never importing one), or
    None and why not."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        return None, f"{path!r} is not a module:QualName path"
    names = _module_names(module_name)
    loaded = [sys.modules[n] for n in names if n in sys.modules]
    if not loaded:
        return None, (f"its module {module_name} is not imported in this process, and a reader imports no "
                      f"module a stored value names (import {module_name} first, or register the class)")
    for module in loaded:
        cls = _walk(module, qualname)
        if cls is not None and cls.__module__ in names and cls.__qualname__ == qualname:
            return cls, ""
    return None, f"the loaded module {module_name} has no dataclass or NamedTuple {qualname}"


def program_class(path: str) -> type | None:
    """The class at ``path`` when this process has already loaded it and the program defines it;
    None otherwise. Imports nothing."""
    cls, _ = _loaded_class(path)
    return cls if cls is not None and why_not_program(cls) is None else None


def why_not_path(path: str) -> str:
    """Why the class at ``path`` is not one the program defines, as this process sees it."""
    cls, reason = _loaded_class(path)
    if cls is None:
        return reason
    return why_not_program(cls) or "it is allowed"


def _import(path: str) -> type | None:
    """The class at ``module:QualName``, imported; None when there is none."""
    module_name, _, qualname = path.partition(":")
    for name in _module_names(module_name):
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
    ``program_classes=True`` also allows every class the program defines (:func:`why_not_program`;
    :data:`REGISTERED` does, so every list with it as parent does too); such a class is resolved
    only from a module already loaded, never imported.
    """

    def __init__(self, classes: Iterable[type | str] = (), *, parent: ItemClasses | None = None,
                 program_classes: bool = False) -> None:
        self.program_classes = program_classes
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
            listed = path in self._paths
            known = self._resolved.get(path)
        if listed:
            if known is None:  # allowed by path only: the class found there must be this one
                known = self._load(path)
            if known is cls:
                return path
        return path if self.program_classes and why_not_program(cls) is None else None

    def resolve(self, path: str) -> type | None:
        """The allowed class at ``path`` (imported on first use), or None when it is not allowed."""
        if self._parent is not None:
            found = self._parent.resolve(path)
            if found is not None:
                return found
        with self._lock:
            listed = path in self._paths
            known = self._resolved.get(path)
        if listed:
            found = known if known is not None else self._load(path)
            if found is not None:
                return found
        return program_class(path) if self.program_classes else None

    def why_not(self, cls: type) -> str:
        """Why ``cls`` is not allowed here, in words for an error message."""
        if self._allows_program():
            return why_not_program(cls) or "it is allowed"
        return "it is on no allow-list here, and this list does not allow the program's own classes"

    def why_not_path(self, path: str) -> str:
        """Why the class at ``path`` is not allowed here, in words for an error message."""
        if self._allows_program():
            return why_not_path(path)
        return "it is on no allow-list here, and this list does not allow the program's own classes"

    def _allows_program(self) -> bool:
        return self.program_classes or (self._parent is not None and self._parent._allows_program())

    def _load(self, path: str) -> type | None:
        cls = _import(path)
        if cls is None or record_kind(cls) is None:
            return None
        with self._lock:
            self._resolved[path] = cls
        return cls


REGISTERED = ItemClasses(program_classes=True)
"""This process's allow-list: every encoding and decoding here allows its classes, and the classes
the program defines (``REGISTERED.program_classes = False`` allows only what is registered)."""


def register_item_class(cls: T) -> T:
    """Allow ``cls`` (a dataclass or NamedTuple defined at module level) in this process's safe
    encoding and decoding; returns it, so it also works as a class decorator.

    Channels created afterwards by this process allow it in every process that uses them.

    Raises:
        UnsupportedValue: ``cls`` is not a dataclass or NamedTuple, or not importable by path.
    """
    REGISTERED.add(cls)
    return cls
