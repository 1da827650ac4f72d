"""The storage-client interface every data-plane store implements, and the store registry.

A store is a flat key/value space of byte values. The :class:`~tq_redis.storage.manager.KVStorageManager`
maps (partition, sample, field) to keys, encodes tensors to values and groups a batch per store;
a store only moves bytes. Keep implementations small: ``put``, ``get`` and ``delete`` of *many*
keys in as few round trips as the store allows.

Values are handed to ``put`` as a sequence of buffer *segments* (typically a small header and a
zero-copy view of a tensor's memory); the stored value is their concatenation. Stores that can
write segments directly (shared memory, multipart sockets) avoid the join copy; the others call
:func:`join_segments`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tq_redis.errors import BackendNotInstalled, ConfigError

Buffer = bytes | bytearray | memoryview
Segments = Sequence[Buffer]


@dataclass(frozen=True)
class StoreContext:
    """What a store may need to find its servers: the metadata plane's URL and namespace."""

    redis_url: str
    namespace: str
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class StorageClient(Protocol):
    """The small interface a data-plane store implements (sync, thread-safe)."""

    name: str

    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        """Store ``values[i]`` (the concatenation of its segments) under ``keys[i]``, overwriting."""

    def get(self, keys: Sequence[str]) -> list[Buffer]:
        """Return the value of every key, in order; raise ``DataMissing`` naming absent keys."""

    def delete(self, keys: Sequence[str]) -> None:
        """Remove keys; absent keys are ignored (idempotent)."""

    def close(self) -> None:
        """Release connections; the store's data is left in place."""


def check_options(store: str, options: dict[str, Any], known: set[str] | frozenset[str]) -> None:
    """Raise ``ConfigError`` naming any option ``store`` does not know, and the ones it does."""
    unknown = set(options) - set(known)
    if unknown:
        raise ConfigError(f"unknown {store} store option(s) {sorted(unknown)}; known: {sorted(known)}")


def join_segments(segments: Segments) -> bytes:
    """Concatenate a value's segments into one ``bytes`` (one copy)."""
    if len(segments) == 1 and isinstance(segments[0], bytes):
        return segments[0]
    return b"".join(segments)


# name -> ("module:Class", pip package that provides its dependency)
_REGISTRY: dict[str, tuple[str, str | None]] = {
    "redis": ("tq_redis.backends.redis_inline:RedisInlineStore", None),
    "dram": ("tq_redis.backends.dram.store:DramStore", None),
    "mooncake": ("tq_redis.backends.mooncake:MooncakeStore", "mooncake-transfer-engine"),
    "yuanrong": ("tq_redis.backends.yuanrong:YuanrongStore", "openyuanrong-datasystem"),
    "fsspec": ("tq_redis.backends.fsspec_store:FsspecStore", "'tq-redis[s3]'"),
    "ray": ("tq_redis.backends.ray_store:RayStore", "ray"),
}


def register_store(name: str, target: str, package: str | None = None) -> None:
    """Register a store class by dotted ``"module:Class"`` path under ``name`` (imported lazily)."""
    _REGISTRY[name] = (target, package)


def registered_stores() -> list[str]:
    """Names of every registered store."""
    return sorted(_REGISTRY)


def store_class(name: str) -> type:
    """Import and return the class registered as ``name``."""
    try:
        target, package = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown storage backend {name!r}; choose one of {registered_stores()} "
            f"or register your own with tq_redis.backends.register_store()"
        ) from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except BackendNotInstalled:
        raise  # the store's module said what to install
    except ImportError as exc:
        hint = f"pip install {package}" if package else "reinstall tq-redis"
        raise BackendNotInstalled(
            f"storage backend {name!r} could not be imported ({exc}); install it with: {hint}"
        ) from exc
    return getattr(module, class_name)


def create_store(name: str, options: dict[str, Any], ctx: StoreContext) -> StorageClient:
    """Build the store registered as ``name`` from its options (``cls.from_config(options, ctx)``)."""
    cls = store_class(name)
    return cls.from_config(dict(options or {}), ctx)
