"""What the stores kept in an external system (``mooncake``, ``yuanrong``) share.

* :func:`import_client`: the system's client library, or :class:`~tq_redis.errors.BackendNotInstalled`
  saying what to install.
* The end marker: neither system stores an empty value, so every value is stored with one
  :data:`MARK` byte after it (:func:`write_marked`), which reads leave out (:func:`unmarked`).
* :func:`put_plan` and :func:`batches`: a put keeps the last value of a key given twice and is cut
  into calls of at most so many keys and bytes.
* :func:`named` and :func:`missing`: keys named in error messages, at most :data:`SHOWN` of them.
* :class:`ProcessConnection`: the client handle of this process, made again in a ``fork()``ed child;
  :func:`probe` first checks that the service listens (the libraries retry for a long while).
* :class:`OptionsStore`: ``from_config`` passes the checked options to the constructor.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, ClassVar

from tq_redis.errors import BackendNotInstalled, DataMissing, InvalidArgument, StorageError, StorageUnavailable
from tq_redis.storage.base import Buffer, Segments, StoreContext, check_options

__all__ = [
    "MARK",
    "SHOWN",
    "OptionsStore",
    "ProcessConnection",
    "as_bytes_view",
    "batches",
    "import_client",
    "missing",
    "named",
    "probe",
    "put_plan",
    "unmarked",
    "write_marked",
]

MARK = 0xA5  # the byte stored after every value
SHOWN = 10  # keys named in an error message


def import_client(module: str, store: str, what: str, install: str) -> ModuleType:
    """Import ``module`` (the system's client library) or raise ``BackendNotInstalled``.

    The message reads "the ``store`` store needs ``what`` (why); install it with: ``install``".
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendNotInstalled(f"the {store} store needs {what} ({exc}); install it with: {install}") from exc


def as_bytes_view(segment: Buffer) -> memoryview:
    """A flat byte view of one value segment (no copy)."""
    view = memoryview(segment)
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except TypeError as exc:  # not C-contiguous
        raise InvalidArgument(f"a value segment must be a contiguous buffer ({exc})") from None


def put_plan(keys: Sequence[str], values: Sequence[Segments]) -> tuple[list[int], list[list[memoryview]], list[int]]:
    """For a put: the positions kept (the last of a key given twice), their segments as byte views,
    and the stored size of each (its bytes plus the end marker)."""
    if len(keys) != len(values):
        raise InvalidArgument(f"put got {len(keys)} keys but {len(values)} values")
    last = {key: i for i, key in enumerate(keys)}
    order = list(last.values())
    views = [[as_bytes_view(s) for s in values[i]] for i in order]
    return order, views, [sum(v.nbytes for v in segs) + 1 for segs in views]


def batches(sizes: Sequence[int], max_count: int, max_bytes: int) -> Iterator[tuple[int, int, int]]:
    """``(start, end, total bytes)`` of consecutive runs of ``sizes``: at most ``max_count`` items
    and ``max_bytes`` bytes each (a single larger item goes alone)."""
    start = 0
    while start < len(sizes):
        end, total = start, 0
        while end < len(sizes) and end - start < max_count:
            if end > start and total + sizes[end] > max_bytes:
                break
            total += sizes[end]
            end += 1
        yield start, end, total
        start = end


def write_marked(dst: Any, segments: Sequence[memoryview], offset: int = 0) -> int:
    """Copy ``segments`` into ``dst`` from ``offset`` on, then the end marker; the offset after it."""
    for seg in segments:
        n = seg.nbytes
        dst[offset : offset + n] = seg
        offset += n
    dst[offset] = MARK
    return offset + 1


def unmarked(view: memoryview, store: str, key: str) -> memoryview:
    """``view`` (a stored value) without its end marker; ``StorageError`` if it has none."""
    if view.nbytes == 0 or view[-1] != MARK:
        raise StorageError(f"{store} store: the value of {key!r} was not written by tq-redis (no end marker)")
    return view[:-1]


def named(keys: Sequence[str]) -> str:
    """``'a', 'b' and 12 more``: the first :data:`SHOWN` keys of an error message."""
    shown = ", ".join(repr(k) for k in keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def missing(keys: Sequence[str], where: str) -> DataMissing:
    """The error of a read that found no value for ``keys`` in ``where`` (e.g. "the yuanrong store")."""
    return DataMissing(f"{len(keys)} value(s) missing from {where}: {named(keys)}")


class ProcessConnection:
    """This process's client handle of a store: made by ``connect`` now, and again on first use
    in a ``fork()``ed child (a parent's connection is not usable there)."""

    def __init__(self, store: str, connect: Callable[[], Any]) -> None:
        self._store, self._connect = store, connect
        self._handle: Any = connect()
        self._pid = os.getpid()
        self._closed = False

    def get(self) -> Any:
        """The handle; ``StorageError`` once :meth:`close` ran."""
        if self._closed:
            raise StorageError(f"this {self._store} store is closed")
        if self._pid != os.getpid():
            self._handle, self._pid = self._connect(), os.getpid()
        return self._handle

    def close(self) -> None:
        """Stop handing out the handle (closing it, if needed, is the caller's)."""
        self._closed = True
        self._handle = None


def probe(host: str, port: int, timeout_s: float, what: str, hint: str) -> None:
    """Raise ``StorageUnavailable`` ("``what`` is unreachable (why); ``hint``") unless something
    accepts a TCP connection at ``host:port`` within ``timeout_s``."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise StorageUnavailable(f"{what} is unreachable ({exc}); {hint}") from exc


class OptionsStore:
    """A store built from its config options alone: they are its constructor's keyword arguments."""

    name: ClassVar[str]
    OPTIONS: ClassVar[frozenset[str]]  # the options the constructor takes

    @classmethod
    def from_config(cls, options: dict[str, Any], ctx: StoreContext) -> Any:
        """Build from the options the module docstring lists (the context is not needed)."""
        check_options(cls.name, options, cls.OPTIONS)
        return cls(**options)
