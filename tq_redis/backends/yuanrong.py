"""The ``yuanrong`` store: values kept in openYuanrong datasystem (``openyuanrong-datasystem``).

A datasystem *worker* runs on every node (``dscli start -w --worker_address HOST:PORT ...``; one
of them also runs the metastore service, or they share an etcd); clients talk to the worker of
their own node, which keeps values in shared memory and fetches remote ones from the other
workers. Options (the ``storage.options`` of the namespace's config)::

    {"worker_address": "127.0.0.1:31501",   # required: this node's worker
     "connect_timeout_ms": 5000,            # connecting to the worker
     "req_timeout_ms": 0}                   # per request (0: the same as connect_timeout_ms)

**Transfers.** A put asks the worker for one shared-memory buffer per value (``mcreate``), copies
each value's segments straight into it (no per-value join, no socket) and publishes the batch
with one ``mset_buffer``; a reader sees the old value or the new one, never a torn one. A get is
one ``get_buffers`` call and returns read-only views of the worker's shared memory (no copy); a
view stays valid after the key is overwritten or deleted.

**Keys.** The datasystem allows only ``[A-Za-z0-9-_!@#%^*()+=:;]`` and 255 characters, so every
other character (the braces of tq-redis keys, for one) is written as ``%XX`` per UTF-8 byte, ``%``
and ``#`` included; a key still longer than 255 characters keeps a 180-character prefix and ends
with ``#`` and its SHA-256 (``#`` occurs in no other stored key). **Values**: the datasystem refuses
empty values, so every value is stored with one marker byte after it, which the views leave out.

**Errors.** An unreachable worker raises :class:`~tq_redis.errors.StorageUnavailable` naming it;
a full worker :class:`~tq_redis.errors.StorageFull`; absent keys :class:`~tq_redis.errors.DataMissing`
naming them; a missing package :class:`~tq_redis.errors.BackendNotInstalled` naming
``openyuanrong-datasystem``. Thread-safe; a store used after ``fork()`` connects anew in the child.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from tq_redis.backends import external
from tq_redis.errors import ConfigError, InvalidArgument, StorageError, StorageFull, StorageUnavailable
from tq_redis.storage.base import Buffer, Segments

KVClient = external.import_client(
    "yr.datasystem", "yuanrong", "the datasystem client", "pip install openyuanrong-datasystem"
).KVClient

__all__ = ["YuanrongStore", "stored_key"]

_KEYS_PER_CALL = 1000  # mcreate / mset_buffer take fewer than 2000 keys
_BYTES_PER_CALL = 256 << 20  # shared memory reserved by one mcreate (or one larger value)
_MAX_KEY = 255
_UNSAFE = re.compile(r"[^A-Za-z0-9\-_!@^*()+=:;]+")  # the allowed set, less % and # (ours)
_STATUS = re.compile(r"code: \[([^\]]*)\]")
_OPTIONS = frozenset({"worker_address", "connect_timeout_ms", "req_timeout_ms"})


def _escape_run(match: re.Match[str]) -> str:
    return "".join(f"%{b:02X}" for b in match.group().encode())


def stored_key(key: str) -> str:
    """The datasystem key ``key`` is stored under (see the module docstring)."""
    if not key:
        raise InvalidArgument("an empty string is not a valid storage key")
    name = _UNSAFE.sub(_escape_run, key)
    if len(name) > _MAX_KEY:
        name = f"{name[:180]}#{hashlib.sha256(key.encode()).hexdigest()}"
    return name


def _status(exc: BaseException) -> str:
    match = _STATUS.search(str(exc))
    return match.group(1) if match else ""


class YuanrongStore(external.OptionsStore):
    """Stores values in an openYuanrong datasystem worker (see the module docstring).

    Args:
        worker_address: ``host:port`` of this node's datasystem worker.
        connect_timeout_ms: how long connecting to the worker may take.
        req_timeout_ms: how long one request may take (0: ``connect_timeout_ms``).
    """

    name = "yuanrong"
    OPTIONS = _OPTIONS

    def __init__(self, worker_address: str = "", connect_timeout_ms: int = 5000, req_timeout_ms: int = 0) -> None:
        host, sep, port = str(worker_address or "").rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(
                "the yuanrong store needs a 'worker_address' option: 'host:port' of this node's datasystem "
                f"worker (e.g. '127.0.0.1:31501'), not {worker_address!r}"
            )
        for name, value in (("connect_timeout_ms", connect_timeout_ms), ("req_timeout_ms", req_timeout_ms)):
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"yuanrong store option {name!r} must be a non-negative integer, not {value!r}")
        self.address = str(worker_address)
        self._host, self._port = host.strip("[]"), int(port)
        self._connect_timeout_ms = connect_timeout_ms
        self._req_timeout_ms = req_timeout_ms
        self._connection = external.ProcessConnection("yuanrong", self._connect)

    # ------------------------------------------------------------------ connection

    def _connect(self) -> Any:
        external.probe(
            self._host, self._port, self._connect_timeout_ms / 1000 or 5,
            f"the Yuanrong datasystem worker at {self.address}",
            f"start one with dscli start -w --worker_address {self.address} ...",
        )  # fmt: skip
        try:
            client = KVClient(
                self._host, self._port, connect_timeout_ms=self._connect_timeout_ms, req_timeout_ms=self._req_timeout_ms
            )
            client.init()
        except RuntimeError as exc:
            raise StorageUnavailable(
                f"cannot connect to the Yuanrong datasystem worker at {self.address}: {exc}"
            ) from exc
        return client

    @property
    def _kv(self) -> Any:
        return self._connection.get()

    def _failure(self, what: str, exc: BaseException) -> StorageError:
        status = _status(exc)
        message = f"yuanrong store (worker {self.address}): cannot {what}: {exc}"
        if status == "Out of memory":
            return StorageFull(message + " -- give the worker more memory (--shared_memory_size_mb) or delete data")
        if status.startswith("RPC") or "unavailable" in status.lower():
            return StorageUnavailable(message)
        return StorageError(message)

    # ------------------------------------------------------------------ put

    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        """Store every value (overwriting), copying segments straight into the worker's shared memory."""
        stored = [stored_key(key) for key in keys]
        order, views, sizes = external.put_plan(stored, values)  # a key given twice keeps its last value
        names = [stored[i] for i in order]
        if not names:
            return
        kv = self._kv
        for start, end, _ in external.batches(sizes, _KEYS_PER_CALL, _BYTES_PER_CALL):
            try:
                buffers = kv.mcreate(names[start:end], sizes[start:end])
                for buffer, segs in zip(buffers, views[start:end]):
                    external.write_marked(buffer.MutableData(), segs)
                kv.mset_buffer(buffers)
            except RuntimeError as exc:
                raise self._failure(f"write {end - start} value(s)", exc) from exc

    # ------------------------------------------------------------------ get

    def get(self, keys: Sequence[str]) -> list[Buffer]:
        """Views of every value in the worker's shared memory; raise ``DataMissing`` naming absent keys."""
        if not keys:
            return []
        names = [stored_key(k) for k in keys]
        unique = list(dict.fromkeys(names))
        kv = self._kv
        found: dict[str, memoryview] = {}
        for start in range(0, len(unique), _KEYS_PER_CALL):
            chunk = unique[start : start + _KEYS_PER_CALL]
            try:
                buffers = kv.get_buffers(chunk)
            except RuntimeError as exc:
                if _status(exc) == "Key not found":  # raised when none of the keys exists
                    continue
                raise self._failure(f"read {len(chunk)} value(s)", exc) from exc
            for name, buffer in zip(chunk, buffers):
                if buffer is not None:
                    found[name] = external.unmarked(memoryview(buffer), "yuanrong", name)
        absent = list(dict.fromkeys(k for k, n in zip(keys, names) if n not in found))
        if absent:
            raise external.missing(absent, f"the yuanrong store (worker {self.address})")
        return [found[n] for n in names]

    # ------------------------------------------------------------------ delete

    def delete(self, keys: Sequence[str]) -> None:
        """Remove the values of ``keys``; absent ones are ignored."""
        if not keys:
            return
        unique = list(dict.fromkeys(stored_key(k) for k in keys))
        kv = self._kv
        for start in range(0, len(unique), _KEYS_PER_CALL):
            chunk = unique[start : start + _KEYS_PER_CALL]
            try:
                failed = kv.delete(chunk)
            except RuntimeError as exc:
                raise self._failure(f"delete {len(chunk)} value(s)", exc) from exc
            if failed:
                raise StorageError(
                    f"yuanrong store (worker {self.address}): could not delete {external.named(failed)}"
                )

    def close(self) -> None:
        """Drop the connection to the worker; the values stay in the datasystem."""
        self._connection.close()

    def __repr__(self) -> str:
        return f"YuanrongStore({self.address!r})"
