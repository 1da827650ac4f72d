"""The ``redis`` store: values kept in Redis itself, next to the metadata.

Fine for small payloads and for tests; large tensors belong in the DRAM storage nodes or another
store. Values are plain Redis strings named by the data-plane key (``<ns>:{<p>}:d:<id>:<field>``),
so they share the partition's hash slot. A ``url`` option points the store at another Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from tq_redis.backends.base import Buffer, Segments, StoreContext, join_segments

from tq_redis.errors import DataMissing, StorageUnavailable

_CHUNK = 512  # keys per MSET/MGET, so one command never carries an unbounded payload


class RedisInlineStore:
    """Stores values as Redis strings (MSET / MGET / DEL in pipelined chunks)."""

    name = "redis"

    def __init__(self, url: str) -> None:
        self.url = url
        # Reconnect with backoff across a Redis restart, as the metadata plane does (tq_redis.driver):
        # bytes put next to the metadata must stay reachable whenever the metadata is.
        self._redis = redis.Redis.from_url(
            url,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=12),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )

    @classmethod
    def from_config(cls, options: dict[str, Any], ctx: StoreContext) -> RedisInlineStore:
        return cls(options.get("url") or ctx.redis_url)

    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for start in range(0, len(keys), _CHUNK):
                chunk = {keys[i]: join_segments(values[i]) for i in range(start, min(len(keys), start + _CHUNK))}
                pipe.mset(chunk)
            pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StorageUnavailable(f"redis store at {self.url} is unreachable: {exc}") from exc

    def get(self, keys: Sequence[str]) -> list[Buffer]:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for start in range(0, len(keys), _CHUNK):
                pipe.mget(keys[start : start + _CHUNK])
            values = [v for chunk in pipe.execute() for v in chunk]
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StorageUnavailable(f"redis store at {self.url} is unreachable: {exc}") from exc
        missing = [k for k, v in zip(keys, values) if v is None]
        if missing:
            raise DataMissing(f"{len(missing)} value(s) missing from the redis store, e.g. {missing[:3]}")
        return values

    def delete(self, keys: Sequence[str]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for start in range(0, len(keys), _CHUNK):
                pipe.unlink(*keys[start : start + _CHUNK])
            pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StorageUnavailable(f"redis store at {self.url} is unreachable: {exc}") from exc

    def close(self) -> None:
        self._redis.close()
