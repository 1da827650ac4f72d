"""The durable tier: a write-through copy of every store value on an fsspec filesystem.

``storage.durable`` in ``init``'s config names it (a local directory, ``file:///...``, or an
object store, ``s3://bucket/prefix``). :class:`~tq_redis.storage.manager.KVStorageManager` writes
each value to the namespace's store *and* here before a put returns (so before the bits that make
it visible flip), reads from here when the node that held a value is gone or unreachable, and
deletes here whenever it deletes from the store (clears, failed puts, rewrites' freed values).
Values at most ``storage.inline_max_bytes`` never reach a store: they live in Redis with the bits,
whose AOF keeps them.

The tier is an ``fsspec`` store (:mod:`tq_redis.backends.fsspec_store`, built through the store
registry, so this layer imports no concrete store): one object per key, under the key's own
name, which holds the namespace and the partition, so jobs and partitions never collide.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tq_redis.errors import ConfigError, DataMissing, StorageError, StorageUnavailable
from tq_redis.meta.keys import PartitionKeys
from tq_redis.redact import redact
from tq_redis.storage.base import Buffer, Segments, StoreContext, create_store

__all__ = ["WRITERS", "DurableTier", "Writes", "check_durable", "durable_spec"]

_KEYS = frozenset({"url", "storage_options"})
_PROBE_PREFIX = "tq-durable-probe:"


def durable_spec(value: Any) -> dict[str, Any] | None:
    """``storage.durable`` as recorded in the namespace's config: ``None`` (no tier) or
    ``{"url": ..., "storage_options": {...}}``. Takes a URL string or that mapping."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"url": value}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"storage.durable must be an fsspec URL (file:///dir, s3://bucket/prefix) or "
            f"{{url: ..., storage_options: {{...}}}}, got {type(value).__name__}"
        )
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ConfigError(f"storage.durable takes url and storage_options, not {unknown}")
    url = value.get("url")
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("storage.durable needs a url, e.g. 'file:///var/lib/tq-durable' or 's3://bucket/prefix'")
    if "://" not in url and not url.startswith("/"):
        raise ConfigError(
            f"storage.durable url {redact(url)!r} is neither an fsspec URL (file:///dir, s3://bucket/prefix) "
            f"nor an absolute path: every process of the job must name the same place"
        )
    options = value.get("storage_options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError("storage.durable.storage_options must be a mapping (passed to the fsspec filesystem)")
    return {"url": url, "storage_options": dict(options)}


WRITERS = 1
"""Threads writing one put's durable copies (each a share of its values)."""


class Writes:
    """The durable writes of one put, started by :meth:`DurableTier.put_async`."""

    def __init__(self, parts: list[Future[None]]) -> None:
        self._parts = parts

    def wait(self) -> None:
        """Wait until every part is done, whatever it raised."""
        futures.wait(self._parts)

    def result(self) -> None:
        """Wait for every part, then raise the first one's error, if any."""
        self.wait()
        for part in self._parts:
            part.result()


def check_durable(spec: Mapping[str, Any], ctx: StoreContext) -> None:
    """Refuse a durable tier that cannot be written now (``init`` asks before recording it):
    ``ConfigError`` / ``BackendNotInstalled`` for a URL fsspec cannot open, ``StorageUnavailable``
    for an endpoint that does not answer, ``StorageError`` for one that refuses the write."""
    tier = DurableTier(spec, ctx)
    try:
        tier.probe()
    finally:
        tier.close()


class DurableTier:
    """Every value of the namespace's store, kept on an fsspec filesystem too (write-through).

    Values of one partition live under a directory (prefix) of their own,
    ``<url>/<escaped partition prefix>/``, flat (no shard directories), named by sample id first
    (``<id>:<field>``, escaped by the fsspec store), so that :meth:`drop` can delete everything a
    partition's ids below a bound left there, values no bit ever pointed at included (a producer
    killed between its write and its insert).

    Args:
        spec: what :func:`durable_spec` returns.
        ctx: the store context (passed to the registry's ``fsspec`` store).
    """

    def __init__(self, spec: Mapping[str, Any], ctx: StoreContext) -> None:
        self.url = str(spec["url"]).rstrip("/")
        self._options = dict(spec.get("storage_options") or {})
        self._ctx = ctx
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()
        # a put's durable copy is written by these threads while the store takes the values
        self._writer = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="tq-durable")

    def _store(self, directory: str) -> Any:
        with self._lock:
            store = self._stores.get(directory)
            if store is None:
                url = f"{self.url}/{directory}" if directory else self.url
                options = {"url": url, "storage_options": self._options, "flat": True}
                store = create_store("fsspec", options, self._ctx)
                self._stores[directory] = store
            return store

    def _partition(self, pk: PartitionKeys) -> Any:
        return self._store(_directory(pk.prefix))

    @staticmethod
    def _names(pk: PartitionKeys, keys: Sequence[str]) -> list[str]:
        """The tier's name of each data key of ``pk`` (``<prefix>d:<id>:<field>`` -> ``<id>:<field>``)."""
        skip = len(pk.prefix) + 2
        return [k[skip:] for k in keys]

    def put_async(self, pk: PartitionKeys, keys: Sequence[str], values: Sequence[Segments]) -> Writes:
        """Start writing ``values`` under ``keys`` (in up to :data:`WRITERS` parts at once: file
        writes release the GIL); :meth:`Writes.result` raises what a write raised."""
        n = len(keys)
        parts = min(WRITERS, max(1, n // 8))
        bounds = [n * k // parts for k in range(parts + 1)]
        return Writes([
            self._writer.submit(self.put, pk, keys[a:b], values[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a
        ])

    def put(self, pk: PartitionKeys, keys: Sequence[str], values: Sequence[Segments]) -> None:
        """Write every value (overwriting); raises ``StorageError`` saying the durable tier failed."""
        with self._said():
            self._partition(pk).put(self._names(pk, keys), values)

    def get(self, pk: PartitionKeys, keys: Sequence[str]) -> list[Buffer]:
        """Every key's value; ``DataMissing`` names the keys the tier lacks."""
        with self._said():
            return list(self._partition(pk).get(self._names(pk, keys)))

    def delete(self, pk: PartitionKeys, keys: Sequence[str]) -> None:
        """Remove the values of ``keys`` (absent ones are ignored)."""
        with self._said():
            self._partition(pk).delete(self._names(pk, keys))

    def drop(self, pk: PartitionKeys, below: int) -> int:
        """Delete every value of the partition's ids below ``below`` (its sequence when it was
        dropped: ids are never reused, so none of those belongs to a later incarnation), and
        temporary files a killed write left; returns how many objects went."""
        store = self._partition(pk)
        with self._said():
            try:
                paths = store.fs.find(store.root)
            except FileNotFoundError:
                return 0
            except Exception as exc:
                raise StorageError(f"cannot list {exc}") from exc
            doomed = [p for p in paths if _doomed(p.rpartition("/")[2], below)]
            if doomed:
                try:
                    store.fs.rm(doomed)
                except FileNotFoundError:  # another clear took some first
                    for path in doomed:
                        with contextlib.suppress(FileNotFoundError):
                            store.fs.rm_file(path)
                except Exception as exc:
                    raise StorageError(f"cannot delete ({type(exc).__name__}: {exc})") from exc
            if len(doomed) == len(paths) and store.fs.isdir(store.root):
                # an empty directory (local disk) goes too; a later write of the partition makes it again
                with contextlib.suppress(OSError):
                    store.fs.rmdir(store.root)
        return len(doomed)

    @contextlib.contextmanager
    def _said(self) -> Iterator[None]:
        """The store's errors, said to come from the durable tier."""
        try:
            yield
        except StorageError as exc:
            raise type(exc)(f"durable tier {redact(self.url)}: {exc}") from exc

    def probe(self) -> None:
        """Write, read back and delete one small object, so that a tier that cannot be written
        (no such bucket, no permission, nothing listening) is refused before any put relies on it."""
        key = f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
        store = self._store("")
        try:
            store.put([key], [[b"tq-redis durable tier probe"]])
            store.get([key])
            store.delete([key])
        except DataMissing as exc:
            raise StorageError(
                f"durable tier {redact(self.url)} did not keep a value it was given ({exc}); check the URL"
            ) from exc
        except StorageUnavailable as exc:
            raise StorageUnavailable(
                f"durable tier {redact(self.url)} cannot be reached ({exc}); check the endpoint and that it is up"
            ) from exc
        except StorageError as exc:
            raise StorageError(
                f"durable tier {redact(self.url)} cannot be written ({exc}); check that the directory or bucket "
                f"exists and that this user may write to it"
            ) from exc

    def close(self) -> None:
        """Stop the writer thread (a write in flight finishes first)."""
        self._writer.shutdown(wait=True)
        for store in self._stores.values():
            store.close()

    def __repr__(self) -> str:
        return f"DurableTier({redact(self.url)!r})"


_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_ID = re.compile(r"([0-9]+)~3A")


def _directory(prefix: str) -> str:
    """A partition's directory in the tier: its key prefix with every character outside
    ``[A-Za-z0-9_.-]`` written ``~XX`` (a long one keeps 100 characters and a SHA-256 digest)."""
    name = _UNSAFE.sub(lambda m: "".join(f"~{b:02X}" for b in m.group().encode()), prefix)
    if len(name) > 200:
        name = f"{name[:100]}~~{hashlib.sha256(prefix.encode()).hexdigest()}"
    return name


def _doomed(name: str, below: int) -> bool:
    """Whether a file of a dropped partition goes: a value of an id below ``below`` (its name
    starts ``<id>~3A``, the escaped ``<id>:``) or a temporary file of a write that never ended."""
    if name.startswith(".tmp-"):
        return True
    match = _ID.match(name)
    return match is not None and int(match.group(1)) < below
