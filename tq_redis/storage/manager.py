"""The data plane: maps (partition, sample, field) to store keys and moves a batch's values.

:class:`KVStorageManager` owns the namespace's store (built from the ``storage`` config that
``init`` records in Redis, so every process attached to the namespace uses the same one). It
calls the store once per batch and leaves encoding to :mod:`tq_redis.codec.tensors`. Metadata never goes
through here: the clients write bytes first, then flip bits in Redis.

A store that places keys itself (``places_keys``: the DRAM store hashes keys over its live nodes)
says which ring a put used; the operations record it with the bits, and reads and deletes take
that record back (:class:`Placement`), so a value is found on the node it
was put on whatever nodes joined or left since. Other stores ignore it.

With a durable tier (``storage.durable``, :mod:`tq_redis.storage.durable`) every value the store
takes is written there too before ``put`` returns, reads fall back to it where the store lost a
value or cannot be reached, and deletes remove it there as well.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tq_redis import instruments
from tq_redis.codec.batches import ValueChain, ValueTable, total_bytes
from tq_redis.errors import DataMissing, StorageUnavailable
from tq_redis.meta.keys import PartitionKeys
from tq_redis.storage.base import Buffer, Segments, StorageClient, StoreContext, create_store
from tq_redis.storage.durable import DurableTier
from tq_redis.units import format_size

log = logging.getLogger(__name__)


class Placement(NamedTuple):
    """Where a batch's store values were put (``lua/includes/placement.lua``): the rings of the
    partition by index, and per field the ring index of each id (ascending ids; None: every value
    of the field went to ring 0). No rings: nothing was recorded (not a placing store)."""

    rings: list[str]  # ring id by index
    index: dict[str, np.ndarray | None]  # field -> ring index per id (uint16), None: all 0

    def ring_of(self, field: str, n: int) -> np.ndarray:
        """The ring index of each of ``n`` ids' value of ``field`` (ascending ids)."""
        column = self.index.get(field)
        return np.zeros(n, np.uint16) if column is None else column


DEFAULT_INLINE_MAX_BYTES = 4096
"""``storage.inline_max_bytes`` when the namespace's config does not say: values up to 4 KiB (a
reward, an id, a short token row) travel with the metadata, larger ones go to the store."""

INLINE_MAX_BATCH_BYTES = 1 << 20
"""A put carries its values inline only while the whole batch's values fit in this: one script
call must not hold the server's single thread for long."""


class StoreRead(NamedTuple):
    """A first read of a batch (:meth:`KVStorageManager.read`), before the bits and the recorded
    placement prove it: values (field-major; a missing one is empty), the ring they were asked
    under (placing stores), the positions missing, or the store's own error (other stores)."""

    values: Sequence[Buffer] | None
    ring: str | None
    missing: np.ndarray
    error: DataMissing | None = None


class KVStorageManager:
    """Routes a batch's data-plane keys to the namespace's store. Thread-safe; the store is
    created lazily on first use."""

    def __init__(
        self, backend: str, options: dict[str, Any], ctx: StoreContext, *, inline_max_bytes: int = 0,
        durable: dict[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        # storage.durable (tq_redis.storage.durable.durable_spec): a write-through copy of every value
        self.durable_spec = durable
        self._durable: DurableTier | None = None
        # values of at most this many bytes travel in the metadata plane (``ns:{p}:inline``)
        self.inline_max_bytes = inline_max_bytes
        self.options = dict(options)
        self.ctx = ctx
        self._store: StorageClient | None = None
        self._lock = threading.Lock()
        self._m = {
            d: (instruments.BYTES.labels(d, backend), instruments.VALUES.labels(d, backend),
                instruments.STORE_SECONDS.labels(d, backend))
            for d in ("put", "get", "delete")
        }
        self._inline = {d: (instruments.BYTES.labels(d, "inline"), instruments.VALUES.labels(d, "inline"))
                        for d in ("put", "get")}

    def count_inline(self, direction: str, values: Iterable[Any]) -> None:
        """Count values moved inline (in the metadata plane, store label ``inline``): ``put`` or
        ``get``; ``None`` entries (values that live in a store) are skipped."""
        bytes_counter, values_counter = self._inline[direction]
        count = nbytes = 0
        for value in values:
            if value is not None:
                count += 1
                nbytes += len(value)
        if count:
            values_counter.inc(count)
            bytes_counter.inc(nbytes)

    def _record(self, direction: str, pk: PartitionKeys, started: float, values: int, nbytes: int) -> None:
        bytes_counter, values_counter, seconds = self._m[direction]
        took = time.perf_counter() - started
        seconds.observe(took)
        values_counter.inc(values)
        if nbytes:
            bytes_counter.inc(nbytes)
        log.debug("store %s %s %s: %d value(s), %s in %.2f ms", self.backend, direction, pk.partition, values,
                  format_size(nbytes), took * 1000)

    @property
    def store(self) -> StorageClient:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = create_store(self.backend, self.options, self.ctx)
        return self._store

    @property
    def durable(self) -> DurableTier | None:
        """The namespace's durable tier (``storage.durable``), or None."""
        if self._durable is None and self.durable_spec is not None:
            with self._lock:
                if self._durable is None:
                    self._durable = DurableTier(self.durable_spec, self.ctx)
        return self._durable

    @staticmethod
    def keys_for(pk: PartitionKeys, ids: Sequence[int], fields: Iterable[str]) -> list[str]:
        """Data keys of every (sample, field) pair, field-major."""
        keys: list[str] = []
        for f in fields:
            keys.extend(pk.data_keys(ids, f))
        return keys

    @property
    def places_keys(self) -> bool:
        """Whether the store places keys itself (its puts name a ring to record with the bits)."""
        return bool(getattr(self.store, "places_keys", False))

    def put(self, pk: PartitionKeys, ids: Sequence[int], encoded: dict[str, Sequence[Segments]]) -> str | None:
        """Store each field's per-sample values (``encoded[field][j]`` belongs to ``ids[j]``).

        Returns the ring the store put them under (None: the store does not place keys itself).
        """
        started = time.perf_counter()
        keys = self.keys_for(pk, ids, encoded)
        values = ValueChain(list(encoded.values()))  # keeps the codec's row blocks visible to the store
        durable = self.durable
        if durable is None:
            ring = self.store.put(keys, values)
        else:  # write-through: the durable copy is written while the store takes the values
            copy = durable.put_async(pk, keys, values)
            try:
                ring = self.store.put(keys, values)
            except BaseException:
                copy.wait()  # the values' memory is the caller's again only once both are done
                raise
            copy.result()  # raises the tier's error (the caller deletes what either wrote)
        self._record("put", pk, started, len(keys), total_bytes(values))
        return ring if isinstance(ring, str) else None

    def get(
        self, pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str], placement: Placement | None = None
    ) -> dict[str, Sequence[Buffer]]:
        """Fetch values of ``fields`` for ``ids``; returns field -> values aligned with ids.

        With ``placement`` (what the metadata plane recorded), a placing store reads each value
        from the node it was put on.
        """
        started = time.perf_counter()
        keys = self.keys_for(pk, ids, fields)
        try:
            if placement is not None and placement.rings and self.places_keys:
                raw = self.store.get_placed(keys, placement.rings, key_rings(ids, fields, placement))
            else:
                raw = self.store.get(keys)
        except (DataMissing, StorageUnavailable) as exc:
            raw = self._from_durable(pk, keys, exc)
        self._record("get", pk, started, len(raw), total_bytes(raw))
        return by_field(raw, fields, len(ids))

    def read(self, pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str]) -> StoreRead:
        """The first read of a batch whose bits (and recorded placement) are checked afterwards:
        a placing store asks its live ring and reports what it lacked; another store's
        ``DataMissing`` comes back as ``error`` (raised by :meth:`settle` if nothing else is wrong)."""
        started = time.perf_counter()
        keys = self.keys_for(pk, ids, fields)
        if self.places_keys:
            try:
                raw, ring, missing = self.store.read(keys)
            except StorageUnavailable:
                if self.durable is None:
                    raise
                # no node is live: every value is read where it was put, or from the durable tier
                return StoreRead([b""] * len(keys), None, np.arange(len(keys)))
        else:
            try:
                raw, ring, missing = self.store.get(keys), None, np.empty(0, np.intp)
            except DataMissing as exc:
                return StoreRead(None, None, np.arange(len(keys)), exc)
        self._record("get", pk, started, len(raw), total_bytes(raw))
        return StoreRead(raw, ring, missing)

    @staticmethod
    def settled(first: StoreRead, placement: Placement | None) -> bool:
        """Whether ``first`` read every value from where it was put (nothing missing, and every
        value recorded under the ring it was read from, or nothing recorded): no further read."""
        if len(first.missing):
            return False
        return placement is None or all(ring == first.ring for ring in placement.rings)

    def settle(
        self, pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str], first: StoreRead,
        placement: Placement | None,
    ) -> dict[str, Sequence[Buffer]]:  # fmt: skip
        """The values of a first read (:meth:`read`) once the bits proved them, with those it did
        not get from the node they were put on read again from that node.

        Raises the store's ``DataMissing`` (naming keys, node and cause) for values no longer there.
        """
        if first.error is not None:
            if self.durable is None:
                raise first.error
            keys = self.keys_for(pk, ids, fields)
            return by_field(self._from_durable(pk, keys, first.error), fields, len(ids))
        if placement is None or not placement.rings:
            # nothing recorded (put before placement was recorded): the store's own look-up
            return self.get(pk, ids, fields) if len(first.missing) else by_field(first.values, fields, len(ids))
        keys = self.keys_for(pk, ids, fields)
        index = key_rings(ids, fields, placement)
        if first.ring is None:  # no live ring was read (read() found no node live)
            redo = np.arange(len(keys))
        else:
            redo = np.union1d(first.missing, self.store.misplaced(keys, first.ring, placement.rings, index))
        if not len(redo):
            return by_field(first.values, fields, len(ids))
        started = time.perf_counter()
        redo_keys = [keys[p] for p in redo.tolist()]
        try:
            again = self.store.get_placed(redo_keys, placement.rings, index[redo])
        except (DataMissing, StorageUnavailable) as exc:
            again = self._from_durable(pk, redo_keys, exc)
        self._record("get", pk, started, len(again), total_bytes(again))
        return by_field(replaced(first.values, redo, again), fields, len(ids))

    def delete(self, pk: PartitionKeys, ids: Sequence[int], fields: Sequence[str], rings: Sequence[str] = ()) -> None:
        """Delete values (absent ones are ignored); ``rings``: where a placing store put them."""
        if ids and fields:
            started = time.perf_counter()
            keys = self.keys_for(pk, ids, fields)
            durable = self.durable
            try:
                if self.places_keys:
                    self.store.delete(keys, rings)
                else:
                    self.store.delete(keys)
            finally:  # the durable copies go too, whatever the store said (deletes are idempotent)
                if durable is not None:
                    durable.delete(pk, keys)
            self._record("delete", pk, started, len(keys), 0)

    def drop(self, pk: PartitionKeys, below: int) -> None:
        """After a partition was dropped with its sequence at ``below``: delete whatever its ids
        below that left in the durable tier (values of puts that never flipped their bits too)."""
        durable = self.durable
        if durable is not None:
            durable.drop(pk, below)

    def _from_durable(
        self, pk: PartitionKeys, keys: list[str], exc: DataMissing | StorageUnavailable
    ) -> Sequence[Buffer]:
        """``keys``' values from the durable tier, where the store lost them or cannot be reached
        (``exc``, raised as it is when there is no tier; noted on the tier's own ``DataMissing``)."""
        durable = self.durable
        if durable is None:
            raise exc
        try:
            return durable.get(pk, keys)
        except DataMissing as missing:
            missing.add_note(f"the store could not give them either: {exc}")
            raise

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._durable is not None:
            self._durable.close()
            self._durable = None


def by_field(raw: Sequence[Buffer], fields: Sequence[str], n: int) -> dict[str, Sequence[Buffer]]:
    """Field-major values of ``n`` samples as field -> values."""
    return {f: raw[k * n : (k + 1) * n] for k, f in enumerate(fields)}


def key_rings(ids: Sequence[int], fields: Sequence[str], placement: Placement) -> np.ndarray:
    """The ring index of each (field-major) key of ``ids`` x ``fields``, from a placement recorded
    for the ids in ascending order."""
    order = np.unique(np.asarray(ids, dtype=np.int64))
    at = np.searchsorted(order, np.asarray(ids, dtype=np.int64))
    return np.concatenate([placement.ring_of(f, len(order))[at].astype(np.intp) for f in fields])


def replaced(values: Sequence[Buffer], positions: np.ndarray, others: Sequence[Buffer]) -> Sequence[Buffer]:
    """``values`` with ``values[positions[j]]`` replaced by ``others[j]`` (tables stay tables)."""
    if isinstance(values, ValueTable) and isinstance(others, ValueTable):
        index = values.index.copy()
        offsets = values.offsets.copy()
        lengths = values.lengths.copy()
        index[positions] = others.index + len(values.sources)
        offsets[positions] = others.offsets
        lengths[positions] = others.lengths
        return ValueTable(list(values.sources) + list(others.sources), index, offsets, lengths)
    out = list(values)
    for p, v in zip(positions.tolist(), others):
        out[p] = v
    return out
