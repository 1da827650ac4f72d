"""The ``redis`` store: values kept in Redis itself, next to the metadata.

Fine for small payloads and for tests; large tensors belong in the DRAM storage nodes or another
store. Values are plain Redis strings named by the data-plane key (``<ns>:{<ns>/<p>}:d:<id>:<field>``),
so they share the partition's hash slot. A ``url`` option points the store at another Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from tq_redis.errors import DataMissing, StorageUnavailable
from tq_redis.meta.keys import by_slot
from tq_redis.redact import redact
from tq_redis.server import connections
from tq_redis.storage.base import Buffer, Segments, StoreContext, join_segments

_CHUNK = 512  # keys per MSET/MGET, so one command never carries an unbounded payload


class RedisInlineStore:
    """Stores values as Redis strings (MSET / MGET / UNLINK in pipelined chunks).

    On a Redis Cluster (a ``RedisCluster`` client) each chunk holds keys of one hash slot, so every
    multi-key command stays on one node; on a single server chunks are consecutive keys.
    """

    name = "redis"

    def __init__(self, url: str, client: Any = None, **options: Any) -> None:
        self.url = url
        # The project's client (single server or cluster), reconnecting with backoff across a Redis
        # restart as the metadata plane does: bytes put next to the metadata must stay reachable
        # whenever the metadata is. ``options``: those of connections.sync_client.
        self._redis = client if client is not None else connections.sync_client(url, **options)
        self._cluster = connections.is_cluster_client(self._redis)

    @classmethod
    def from_config(cls, options: dict[str, Any], ctx: StoreContext) -> RedisInlineStore:
        if options.get("url"):
            return cls(options["url"])
        # beside the metadata: each new connection checks the namespace's epoch as the client's do
        # (tq_redis.server.identity), so metadata from before a loss never reads another's bytes
        return cls(ctx.redis_url, on_connect=ctx.extra.get("on_connect"))

    def _chunks(self, keys: Sequence[str]) -> list[list[int]]:
        """Positions of ``keys`` in the groups one command each takes."""
        if not self._cluster:
            return [list(range(s, min(len(keys), s + _CHUNK))) for s in range(0, len(keys), _CHUNK)]
        groups = by_slot(range(len(keys)), key=keys.__getitem__)
        return [g[s : s + _CHUNK] for g in groups.values() for s in range(0, len(g), _CHUNK)]

    def _run(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StorageUnavailable(f"redis store at {redact(self.url)} is unreachable: {exc}") from exc

    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        commands = []
        for chunk in self._chunks(keys):
            flat: list[Any] = ["MSET"]
            for i in chunk:
                flat += (keys[i], join_segments(values[i]))
            commands.append(tuple(flat))
        self._run(commands)

    def get(self, keys: Sequence[str]) -> list[Buffer]:
        chunks = self._chunks(keys)
        replies = self._run([("MGET", *(keys[i] for i in chunk)) for chunk in chunks])
        values: list[Any] = [None] * len(keys)
        for chunk, got in zip(chunks, replies):
            for i, value in zip(chunk, got):
                values[i] = value
        missing = [k for k, v in zip(keys, values) if v is None]
        if missing:
            raise DataMissing(f"{len(missing)} value(s) missing from the redis store, e.g. {missing[:3]}")
        return values

    def delete(self, keys: Sequence[str]) -> None:
        self._run([("UNLINK", *(keys[i] for i in chunk)) for chunk in self._chunks(keys)])

    def close(self) -> None:
        self._redis.close()
