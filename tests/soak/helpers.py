"""Helpers shared by the soak tests: storage nodes, leak checks, polling with a deadline."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from tq_redis.backends.dram.launcher import NodeProcess, spawn_node
from tq_redis.backends.dram.store import DramStore
from tq_redis.meta.keys import (
    clients_key,
    config_key,
    kept_partitions_key,
    storage_epoch_key,
    storage_nodes_key,
    storage_rings_key,
)

#: node options for leak checks: slabs are released as soon as they are empty (no warm cache)
LEAN_NODE_ARGS = ("--keep-warm", "0", "--slab-size", "4MiB")


def poll(condition: Callable[[], bool], timeout: float, poll_s: float = 0.02) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def wait_until(condition: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.02) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` once ``timeout`` seconds have passed."""
    if not poll(condition, timeout, poll_s):
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def kill_all(procs: Sequence[Any]) -> None:
    """SIGKILL and reap every process still running (cleanup after a failed test)."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def use_store(
    url: str, namespace: str, backend: str, options: dict[str, Any] | None = None, inline_max_bytes: int = 0
) -> None:
    """Record the namespace's store, as ``init`` does, so every attaching process uses it (every
    value goes to the store unless ``inline_max_bytes`` keeps small ones in Redis)."""
    spec = {"backend": backend, "options": options or {}, "inline_max_bytes": inline_max_bytes}
    with redis.Redis.from_url(url) as r:
        r.hset(config_key(namespace), "storage", json.dumps(spec))


def spawn_lean_nodes(url: str, namespace: str, n: int, capacity: str) -> list[NodeProcess]:
    """Start ``n`` storage nodes that keep no empty slabs, so leaked memory shows as slabs/memfds."""
    nodes: list[NodeProcess] = []
    try:
        for _ in range(n):
            nodes.append(spawn_node(url, namespace, capacity=capacity, extra_args=LEAN_NODE_ARGS))
    except BaseException:
        stop_nodes(nodes)
        raise
    return nodes


def stop_nodes(nodes: Sequence[NodeProcess]) -> None:
    """Stop node processes cleanly (SIGKILL after a timeout)."""
    for node in nodes:
        node.stop()


def node_stats(url: str, namespace: str) -> dict[str, dict[str, Any]]:
    """Per live node of the namespace: used bytes, keys, slabs, pins (asked of the nodes themselves)."""
    with DramStore(url, namespace, timeout_s=5.0) as store:
        return store.stats()


def await_nodes_empty(url: str, namespace: str, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """Wait until every live node of the namespace holds no bytes, keys or pins; returns their stats."""
    last: dict[str, dict[str, Any]] = {}

    def empty() -> bool:
        last.update(node_stats(url, namespace))
        return all(s["used"] == 0 and s["keys"] == 0 and s["pins"] == 0 for s in last.values())

    try:
        wait_until(empty, timeout, "the storage nodes to hold no bytes, keys or pins")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; they report {last}") from None
    return dict(last)


def namespace_keys(url: str, namespace: str) -> set[str]:
    """Every Redis key of the namespace."""
    with redis.Redis.from_url(url) as r:
        return {k.decode() for k in r.scan_iter(match=f"{namespace}:*", count=1000)}


def leftover_keys(url: str, namespace: str, partitions: Sequence[str]) -> set[str]:
    """Keys of the namespace that must not outlive a clear of ``partitions``.

    Allowed to remain: the namespace config and the copy of its epoch its storage nodes read
    (``storage:epoch``: a namespace's identity outlives its partitions), its live clients'
    heartbeats, the storage-node registry and the table of node rings values were put under, each
    partition's id counter (ids are never reused) and event counters (they never go down), a sealed partition's closed
    marker, the registry listing them (``partitions:kept``), and
    while they still have an expiry its event stream (kept a minute so that readers following it
    see the partition go) and the wait bookkeeping of consumers that started waiting after the
    clear (``waittasks``, ``waiters:*``, ``wake*:*``), and the calls' request records (``rq:*``, two
    minutes: ``lua/includes/requests.lua``).
    """
    # partitions:kept lists the cleared partitions whose seq stays (checkpoints find it there)
    allowed = {config_key(namespace), storage_nodes_key(namespace), kept_partitions_key(namespace),
               clients_key(namespace), storage_rings_key(namespace), storage_epoch_key(namespace)}
    allowed |= {f"{namespace}:{{{namespace}/{p}}}:{kind}" for p in partitions for kind in ("seq", "closed", "counters")}
    prefixes = tuple(f"{namespace}:{{{namespace}/{p}}}:" for p in partitions)
    expiring = ("events", "tagchanges", "waittasks", "waiters:", "waitneed:", "wake:", "wakebudget:", "rq:")

    def may_expire(key: str) -> bool:
        return key.startswith(prefixes) and key.split("}:", 1)[1].startswith(expiring)

    with redis.Redis.from_url(url) as r:
        return {
            key
            for key in namespace_keys(url, namespace) - allowed
            if not (may_expire(key) and r.pttl(key) > 0)
        }


def assert_none_crashed(procs: Sequence[Any]) -> None:
    """Fail as soon as a client process exited with an error (it did not ride through the outage)."""
    crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
    assert not crashed, f"a client process failed (exit codes {crashed}): it did not ride through"
