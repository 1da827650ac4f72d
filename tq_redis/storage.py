"""The data plane: maps (partition, sample, field) to store keys and moves a batch's values.

:class:`KVStorageManager` owns the namespace's store (built from the ``storage`` config that
``init`` records in Redis, so every process attached to the namespace uses the same one). It
calls the store once per batch and leaves encoding to :mod:`tq_redis.codec`. Metadata never goes
through here: the clients write bytes first, then flip bits in Redis.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from tq_redis import metrics
from tq_redis.backends.base import Buffer, Segments, StorageClient, StoreContext, create_store
from tq_redis.backends.batches import ValueChain, total_bytes
from tq_redis.keys import PartitionKeys

DEFAULT_INLINE_MAX_BYTES = 4096
"""``storage.inline_max_bytes`` when the namespace's config does not say: values up to 4 KiB (a
reward, an id, a short token row) travel with the metadata, larger ones go to the store."""

INLINE_MAX_BATCH_BYTES = 1 << 20
"""A put carries its values inline only while the whole batch's values fit in this: one script
call must not hold the server's single thread for long."""


class KVStorageManager:
    """Routes a batch's data-plane keys to the namespace's store. Thread-safe; the store is
    created lazily on first use."""

    def __init__(
        self, backend: str, options: dict[str, Any], ctx: StoreContext, *, inline_max_bytes: int = 0
    ) -> None:
        self.backend = backend
        # values of at most this many bytes travel in the metadata plane (``ns:{p}:inline``)
        self.inline_max_bytes = inline_max_bytes
        self.options = dict(options)
        self.ctx = ctx
        self._store: StorageClient | None = None
        self._lock = threading.Lock()
        self._m = {
            d: (metrics.BYTES.labels(d, backend), metrics.VALUES.labels(d, backend),
                metrics.STORE_SECONDS.labels(d, backend))
            for d in ("put", "get", "delete")
        }

    def _record(self, direction: str, started: float, values: int, nbytes: int) -> None:
        bytes_counter, values_counter, seconds = self._m[direction]
        seconds.observe(time.perf_counter() - started)
        values_counter.inc(values)
        if nbytes:
            bytes_counter.inc(nbytes)

    @property
    def store(self) -> StorageClient:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = create_store(self.backend, self.options, self.ctx)
        return self._store

    @staticmethod
    def keys_for(pk: PartitionKeys, ids: Sequence[int], fields: Iterable[str]) -> list[str]:
        """Data keys of every (sample, field) pair, field-major."""
        keys: list[str] = []
        for f in fields:
            keys.extend(pk.data_keys(ids, f))
        return keys

    def put(self, pk: PartitionKeys, ids: Sequence[int], encoded: dict[str, Sequence[Segments]]) -> None:
        """Store each field's per-sample values (``encoded[field][j]`` belongs to ``ids[j]``)."""
        started = time.perf_counter()
        keys = self.keys_for(pk, ids, encoded)
        values = ValueChain(list(encoded.values()))  # keeps the codec's row blocks visible to the store
        self.store.put(keys, values)
        self._record("put", started, len(keys), total_bytes(values))

    def get(self, pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str]) -> dict[str, Sequence[Buffer]]:
        """Fetch values of ``fields`` for ``ids``; returns field -> values aligned with ids."""
        started = time.perf_counter()
        raw = self.store.get(self.keys_for(pk, ids, fields))
        self._record("get", started, len(raw), total_bytes(raw))
        n = len(ids)
        return {f: raw[k * n : (k + 1) * n] for k, f in enumerate(fields)}

    def delete(self, pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str]) -> None:
        """Delete values (absent ones are ignored)."""
        if ids and fields:
            started = time.perf_counter()
            keys = self.keys_for(pk, ids, fields)
            self.store.delete(keys)
            self._record("delete", started, len(keys), 0)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
