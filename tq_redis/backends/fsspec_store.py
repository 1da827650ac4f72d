"""The ``fsspec`` store: one object (file) per key on any fsspec filesystem — local disk, S3, GCS ...

It is the spill / cold tier: slower than the DRAM storage nodes, but as large as the disk or the
bucket. Options (the ``storage.options`` of the namespace's config)::

    {"url": "file:///var/lib/tq_redis"}                        # local disk
    {"url": "s3://bucket/prefix",
     "storage_options": {"endpoint_url": "http://...", "key": "...", "secret": "..."}}

``storage_options`` is passed to the fsspec filesystem unchanged (for S3 that is ``s3fs``, which
must be installed: ``pip install s3fs``).

**Layout.** A key is stored at ``<url>/<shard>/<name>``: ``shard`` is two hex digits of the key's
CRC-32 (256 directories, so no directory holds every value, and S3 spreads the load over key
prefixes) and ``name`` is the key with every character outside ``[A-Za-z0-9_.-]`` written as
``~XX`` (its UTF-8 bytes in hex), so ``tq:{p0}:d:7:obs`` becomes ``tq~3A~7Bp0~7D~3Ad~3A7~3Aobs``:
no braces, colons or slashes reach the filesystem and the key can be read back from the name.

**Writes.** On local disk a value is written segment by segment (no join) to a temporary file in
the same directory and renamed over the final name, so a reader sees the old value or the new
one, never a torn one (values are not fsynced: this is a cache tier, not a durable one). On
asynchronous filesystems (S3, GCS, ...) the values of one call are uploaded concurrently with
``fs.pipe``; an object PUT needs the whole body anyway, so each value is joined once. Other
filesystems get ``fs.open(path, "wb")`` and one ``write`` per segment.

**Reads** are one ``fs.cat(paths)`` per call (concurrent on asynchronous filesystems); absent keys
raise :class:`~tq_redis.errors.DataMissing` naming them. **Deletes** are one ``fs.rm(paths)``
(local disk: ``unlink`` per file); absent keys are ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import uuid
import zlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

from tq_redis.errors import (
    BackendNotInstalled,
    ConfigError,
    DataMissing,
    InvalidArgument,
    StorageError,
    StorageUnavailable,
)
from tq_redis.redact import redact
from tq_redis.storage.base import Buffer, Segments, StoreContext, check_options, join_segments

try:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
except ImportError as exc:  # fsspec comes with the [s3] extra, not with the core install
    raise BackendNotInstalled(
        f"the fsspec store needs fsspec ({exc}); install it with: pip install 'tq-redis[s3]'"
    ) from exc

__all__ = ["FsspecStore", "key_to_name", "name_to_key"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")
_ESCAPE = re.compile(r"~([0-9A-F]{2})")
_MAX_NAME = 200  # file names longer than this are shortened (most filesystems allow 255 bytes)
_SHOWN = 10  # missing keys named in a DataMissing message
_OPTIONS = frozenset({"url", "storage_options", "flat"})


def _escape_run(match: re.Match[str]) -> str:
    return "".join(f"~{b:02X}" for b in match.group().encode())


def key_to_name(key: str) -> str:
    """File name of ``key``: characters outside ``[A-Za-z0-9_.-]`` become ``~XX`` per UTF-8 byte.

    A leading ``.`` is escaped too (no hidden files, and temporary files, which start with ``.``,
    never collide with a value). Names longer than 200 characters keep a readable prefix and end
    with ``~~`` and a SHA-256 digest of the key (``~~`` never occurs in an escaped name).
    """
    if not key:
        raise InvalidArgument("an empty string is not a valid storage key")
    name = _UNSAFE.sub(_escape_run, key)
    if name.startswith("."):
        name = "~2E" + name[1:]
    if len(name) > _MAX_NAME:
        name = f"{name[:150]}~~{hashlib.sha256(key.encode()).hexdigest()}"
    return name


def name_to_key(name: str) -> str:
    """Inverse of :func:`key_to_name` (for names that were not shortened)."""
    # an escaped name holds only [A-Za-z0-9_.-] and ~XX, so ~XX -> %XX is plain percent-encoding
    return unquote(_ESCAPE.sub(r"%\1", name), errors="strict")


def _shard(key: str) -> str:
    return f"{zlib.crc32(key.encode()) & 0xFF:02x}"


class FsspecStore:
    """Stores each value as one object of an fsspec filesystem (see the module docstring).

    Args:
        url: root of the store, e.g. ``file:///data/tq`` or ``s3://bucket/prefix``.
        storage_options: keyword arguments of the fsspec filesystem (credentials, endpoint ...).
        flat: store values directly under ``url``, without the 256 shard directories.
    """

    name = "fsspec"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, flat: bool = False) -> None:
        # flat: every value directly under the root, no shard directories (the durable tier's
        # per-partition directories, where a fresh partition would otherwise make one per value)
        self.flat = bool(flat)
        if not isinstance(url, str) or not url:
            raise ConfigError("the fsspec store needs a 'url' option, e.g. 'file:///data/tq' or 's3://bucket/prefix'")
        self.url = url
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as exc:  # the protocol's implementation (s3fs, gcsfs ...) is not installed
            raise BackendNotInstalled(f"the fsspec store cannot open {redact(url)!r}: {exc}") from exc
        except (ValueError, TypeError) as exc:  # bad URL, or storage_options the filesystem rejects
            raise ConfigError(f"the fsspec store cannot open {redact(url)!r}: {exc}") from exc
        self.root = root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)
        self._async = bool(getattr(self.fs, "async_impl", False))
        if self._local:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"the fsspec store cannot create its directory {self.root!r}: {exc}") from exc

    @classmethod
    def from_config(cls, options: dict[str, Any], ctx: StoreContext) -> FsspecStore:
        """Build from ``{"url": ..., "storage_options": {...}}`` (the context is not needed)."""
        check_options("fsspec", options, _OPTIONS)
        storage_options = options.get("storage_options") or {}
        if not isinstance(storage_options, dict):
            raise ConfigError("the fsspec store's 'storage_options' must be a mapping")
        flat = options.get("flat", False)
        if not isinstance(flat, bool):
            raise ConfigError(f"the fsspec store's 'flat' option must be true or false, got {flat!r}")
        return cls(options.get("url", ""), storage_options, flat=flat)

    def path(self, key: str) -> str:
        """Where ``key``'s value is stored (a path of ``self.fs``, without the protocol)."""
        if self.flat:
            return f"{self.root}/{key_to_name(key)}"
        return f"{self.root}/{_shard(key)}/{key_to_name(key)}"

    # ------------------------------------------------------------------ put

    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        """Write every value (overwriting); local writes are atomic per value."""
        if len(keys) != len(values):
            raise InvalidArgument(f"put got {len(keys)} keys but {len(values)} values")
        if not keys:
            return
        paths = [self.path(k) for k in keys]
        try:
            if self._local:
                for path, segments in zip(paths, values):
                    self._write_local(path, segments)
            elif self._async:
                self.fs.pipe({p: join_segments(v) for p, v in zip(paths, values)})
            else:
                for path, segments in zip(paths, values):
                    self._write_file(path, segments)
        except FileNotFoundError as exc:
            raise StorageError(
                f"fsspec store at {redact(self.url)}: cannot write ({exc}); does the bucket exist?"
            ) from exc
        except Exception as exc:
            raise self._failure("write to", exc) from exc

    @staticmethod
    def _write_local(path: str, segments: Segments) -> None:
        directory = path.rpartition("/")[0]
        tmp = f"{directory}/.tmp-{uuid.uuid4().hex}"
        try:
            f = open(tmp, "wb")  # closed by the with block below
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)
            f = open(tmp, "wb")
        try:
            with f:
                for segment in segments:
                    f.write(segment)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _write_file(self, path: str, segments: Segments) -> None:
        try:
            f = self.fs.open(path, "wb")
        except FileNotFoundError:
            self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
            f = self.fs.open(path, "wb")
        with f:
            for segment in segments:
                f.write(segment)

    # ------------------------------------------------------------------ get

    def get(self, keys: Sequence[str]) -> list[Buffer]:
        """Read every value in one ``fs.cat`` call; raise ``DataMissing`` naming absent keys."""
        if not keys:
            return []
        paths = [self.path(k) for k in keys]
        try:
            found = self.fs.cat(paths, on_error="return")
        except Exception as exc:
            raise self._failure("read from", exc) from exc
        values: list[Buffer] = []
        missing: list[str] = []
        for key, path in zip(keys, paths):
            value = found.get(path)
            if value is None:
                value = found.get(self.fs._strip_protocol(path), FileNotFoundError(path))
            if isinstance(value, FileNotFoundError):
                missing.append(key)
            elif isinstance(value, BaseException):
                raise self._failure(f"read {key!r} from", value) from value
            else:
                values.append(value)
        if missing:
            shown = ", ".join(repr(k) for k in missing[:_SHOWN])
            more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
            where = redact(self.url)
            raise DataMissing(f"{len(missing)} value(s) missing from the fsspec store at {where}: {shown}{more}")
        return values

    # ------------------------------------------------------------------ delete

    def delete(self, keys: Sequence[str]) -> None:
        """Remove the values of ``keys``; absent ones are ignored."""
        if not keys:
            return
        paths = [self.path(k) for k in keys]
        try:
            if self._local:
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                return
            try:
                self.fs.rm(paths)
            except FileNotFoundError:  # some filesystems refuse a batch with absent paths
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(path)
        except Exception as exc:
            raise self._failure("delete from", exc) from exc

    def close(self) -> None:
        """Nothing to release: the filesystem instance is shared through fsspec's cache."""

    def _failure(self, what: str, exc: BaseException) -> StorageError:
        cls = StorageUnavailable if isinstance(exc, (ConnectionError, TimeoutError)) else StorageError
        return cls(f"fsspec store: cannot {what} {redact(self.url)}: {type(exc).__name__}: {exc}")

    def __repr__(self) -> str:
        return f"FsspecStore({redact(self.url)!r})"
