"""The ``ray`` store: values in the Ray object store, for users whose jobs already run inside Ray.

The process using the store must be connected to Ray (``ray.init()`` was called, or it is a Ray
task/actor); otherwise set the ``address`` option (e.g. ``"auto"``) and the store connects.

**Key table.** One named, detached actor per tq-redis namespace (``tq_redis_store:<namespace>`` in
the Ray namespace ``tq_redis``, created with ``get_if_exists=True`` by whichever process comes
first) maps each key to the Ray object holding its value. Any process of the Ray cluster resolves
keys through it, so producers and consumers need not share object references. The actor uses no
CPU slot (``num_cpus=0``).

**Ownership.** By default (``owner="table"``) the key-table actor *adopts* every value: the
writer hands the packed buffers to the actor as call arguments and the actor ``ray.put``s them,
so values outlive the process that wrote them (one extra copy, inside Ray's shared memory). With
``owner="writer"`` the writer ``ray.put``s the values itself and the actor only holds references:
no extra copy, but Ray frees a value when the process that wrote it exits, so use it only when
writers outlive their data. Either way a value is freed when its key is deleted or overwritten
(the actor drops its reference) or when the actor is killed (:meth:`RayStore.destroy`); if the
actor dies, the namespace's values are lost with it.

**Packing.** A ``put`` packs the values smaller than 1 MiB into objects of up to 16 MiB (one
``ray.put`` for many small values instead of one each) and gives each larger value its own
object; the key table stores ``(object, start, end)``. A packed object is freed once every key
in it is deleted or overwritten. A ``get`` is one actor call and one ``ray.get`` of the distinct
objects; values come back as read-only ``memoryview`` slices of the objects (zero copy from
Ray's shared memory for objects it does not inline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from tq_redis.errors import ConfigError, DataMissing, InvalidArgument, StorageError, StorageUnavailable
from tq_redis.storage.base import Buffer, Segments, StoreContext, check_options

__all__ = ["RayStore"]

PACK_BELOW = 1 << 20  # values smaller than this share an object with others of the same put
PACK_SIZE = 16 << 20  # a packed object holds at most this many bytes (unless one value is larger)
RAY_NAMESPACE = "tq_redis"
_SHOWN = 10  # missing keys named in a DataMissing message
_OPTIONS = frozenset({"address", "actor_name", "ray_namespace", "owner"})
_OWNERS = ("table", "writer")

Entry = tuple[Any, int, int]  # (ObjectRef, start, end)


class _KeyTable:
    """Actor state: key -> (ObjectRef, start, end). Holding the reference keeps the value alive."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}

    def put(self, keys: list[str], entries: list[Entry]) -> None:
        """Record references the writer owns."""
        self._entries.update(zip(keys, entries))

    def adopt(self, keys: list[str], spans: list[tuple[int, int, int]], *buffers: np.ndarray) -> None:
        """Copy the writer's buffers into objects this actor owns; ``spans[i]`` = (buffer, start, end)."""
        refs = [ray.put(b) for b in buffers]
        self._entries.update((k, (refs[j], start, end)) for k, (j, start, end) in zip(keys, spans))

    def lookup(self, keys: list[str]) -> list[Entry | None]:
        return [self._entries.get(k) for k in keys]

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._entries.pop(key, None)

    def size(self) -> int:
        return len(self._entries)


_KeyTableActor = ray.remote(_KeyTable)


def _byte_view(segment: Buffer) -> memoryview:
    view = memoryview(segment)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _pack(
    indexes: list[int],
    views: list[list[memoryview]],
    sizes: list[int],
    spans: list[tuple[int, int, int]],
    number: int,
) -> np.ndarray:
    """Copy the values ``indexes`` into one new buffer (number ``number``), recording their spans."""
    buffer = np.empty(sum(sizes[i] for i in indexes), dtype=np.uint8)
    offset = 0
    for i in indexes:
        start = offset
        for view in views[i]:
            buffer[offset : offset + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
            offset += view.nbytes
        spans[i] = (number, start, offset)
    return buffer


class RayStore:
    """Stores values as Ray objects, indexed by a per-namespace detached actor (module docstring).

    Args:
        namespace: the tq-redis namespace (one key table per namespace).
        actor_name: name of the key-table actor; ``tq_redis_store:<namespace>`` by default.
        ray_namespace: Ray namespace the actor is registered in (``tq_redis``).
        address: Ray address to connect to when this process is not connected yet.
        owner: ``"table"`` (values outlive their writer) or ``"writer"`` (no extra copy; values die
            with the process that wrote them).
    """

    name = "ray"

    def __init__(
        self,
        namespace: str,
        *,
        actor_name: str | None = None,
        ray_namespace: str = RAY_NAMESPACE,
        address: str | None = None,
        owner: str = "table",
    ) -> None:
        if owner not in _OWNERS:
            raise ConfigError(f"the ray store's 'owner' option must be one of {list(_OWNERS)}, not {owner!r}")
        self.owner = owner
        if not ray.is_initialized():
            if address is None:
                raise ConfigError(
                    "the ray store needs a Ray connection: call ray.init() first, or set the store's "
                    "'address' option (e.g. 'auto')"
                )
            ray.init(address=address)
        self.actor_name = actor_name or f"tq_redis_store:{namespace}"
        self.ray_namespace = ray_namespace
        try:
            self._table: Any = _KeyTableActor.options(
                name=self.actor_name,
                namespace=ray_namespace,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,  # takes no CPU slot from the user's tasks
                max_restarts=0,  # a restarted table would have lost every reference
                max_concurrency=8,  # threaded: concurrent readers and writers do not queue
            ).remote()
        except Exception as exc:
            raise StorageUnavailable(f"ray store: cannot create or find actor {self.actor_name!r}: {exc}") from exc

    @classmethod
    def from_config(cls, options: dict[str, Any], ctx: StoreContext) -> RayStore:
        """Build from ``address``, ``actor_name``, ``ray_namespace`` and ``owner`` options (all optional)."""
        check_options("ray", options, _OPTIONS)
        return cls(
            ctx.namespace,
            actor_name=options.get("actor_name"),
            ray_namespace=options.get("ray_namespace") or RAY_NAMESPACE,
            address=options.get("address"),
            owner=options.get("owner") or "table",
        )

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self._table, method).remote(*args))
        except ray.exceptions.RayActorError as exc:
            raise StorageUnavailable(f"ray store: key-table actor {self.actor_name!r} is gone: {exc}") from exc
        except ray.exceptions.RayError as exc:
            raise StorageError(f"ray store: {method} on actor {self.actor_name!r} failed: {exc}") from exc

    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        """Pack the values into buffers, store them as Ray objects and record their keys."""
        if len(keys) != len(values):
            raise InvalidArgument(f"put got {len(keys)} keys but {len(values)} values")
        if not keys:
            return
        views = [[_byte_view(s) for s in segments] for segments in values]
        sizes = [sum(v.nbytes for v in segments) for segments in views]
        buffers: list[np.ndarray] = []
        spans: list[tuple[int, int, int]] = [(0, 0, 0)] * len(keys)  # key -> (buffer, start, end)
        group: list[int] = []  # indexes of the small values packed into the next buffer
        group_bytes = 0
        for i, size in enumerate(sizes):
            if size >= PACK_BELOW:
                buffers.append(_pack([i], views, sizes, spans, len(buffers)))
                continue
            if group and group_bytes + size > PACK_SIZE:
                buffers.append(_pack(group, views, sizes, spans, len(buffers)))
                group, group_bytes = [], 0
            group.append(i)
            group_bytes += size
        if group:
            buffers.append(_pack(group, views, sizes, spans, len(buffers)))
        if self.owner == "table":
            self._call("adopt", list(keys), spans, *buffers)
            return
        try:
            refs = [ray.put(b) for b in buffers]
        except ray.exceptions.RayError as exc:
            raise StorageError(f"ray store: ray.put failed: {exc}") from exc
        self._call("put", list(keys), [(refs[j], start, end) for j, start, end in spans])

    def get(self, keys: Sequence[str]) -> list[Buffer]:
        """Resolve keys with one actor call, fetch the distinct objects with one ``ray.get``."""
        if not keys:
            return []
        entries = self._call("lookup", list(keys))
        missing = [k for k, e in zip(keys, entries) if e is None]
        if missing:
            shown = ", ".join(repr(k) for k in missing[:_SHOWN])
            more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
            raise DataMissing(f"{len(missing)} value(s) missing from the ray store {self.actor_name!r}: {shown}{more}")
        refs = list({e[0]: None for e in entries})
        try:
            objects = dict(zip(refs, ray.get(refs)))
        except ray.exceptions.ObjectLostError as exc:  # e.g. a writer-owned value whose writer exited
            lost = self._lost(refs)
            named = [k for k, e in zip(keys, entries) if e[0] in lost]
            shown = ", ".join(repr(k) for k in named[:_SHOWN])
            more = f" and {len(named) - _SHOWN} more" if len(named) > _SHOWN else ""
            raise DataMissing(
                f"{len(named)} value(s) of the ray store {self.actor_name!r} were lost (their owner "
                f"exited; see the store's 'owner' option): {shown}{more}"
            ) from exc
        except ray.exceptions.RayError as exc:
            raise StorageUnavailable(f"ray store {self.actor_name!r}: ray.get failed: {exc}") from exc
        return [memoryview(objects[ref])[start:end] for ref, start, end in entries]

    @staticmethod
    def _lost(refs: list[Any]) -> set[Any]:
        lost = set()
        for ref in refs:
            try:
                ray.get(ref)
            except ray.exceptions.ObjectLostError:
                lost.add(ref)
        return lost

    def delete(self, keys: Sequence[str]) -> None:
        """Forget the keys; an object is freed when no key refers to it any more."""
        if keys:
            self._call("delete", list(keys))

    def size(self) -> int:
        """Number of keys held in this namespace's key table."""
        return int(self._call("size"))

    def destroy(self) -> None:
        """Kill the key-table actor: every value of the namespace is freed (other clients included)."""
        ray.kill(self._table, no_restart=True)

    def close(self) -> None:
        """Drop this handle; the actor and the values stay for the other processes."""

    def __repr__(self) -> str:
        return f"RayStore({self.actor_name!r})"
