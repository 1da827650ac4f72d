"""``tq-redis namespace list|drop|gc`` and ``tq-redis cleanup``: abandoned state, found and removed.

The commands are thin: :mod:`tq_redis.monitor.namespaces` does the work on Redis, :mod:`tq_redis.server.leftovers`
on this host's temp directory.
"""

from __future__ import annotations

import argparse
import sys
import time

from tq_redis.errors import TQError
from tq_redis.settings import settings
from tq_redis.units import format_size


def _url(args: argparse.Namespace, command: str) -> str | None:
    url = args.redis or settings.redis_url
    if not url:
        print(f"tq-redis {command}: pass --redis URL or set TQ_REDIS_URL", file=sys.stderr)
    return url


def _age(now_ms: int, then_ms: int | None) -> str:
    if then_ms is None:
        return "-"
    s = max(0, now_ms - then_ms) / 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


def _cmd_list(args: argparse.Namespace) -> int:
    from tq_redis.monitor import namespaces
    from tq_redis.server import connections

    url = _url(args, "namespace list")
    if not url:
        return 2
    r = connections.sync_client(url)
    try:
        sec, usec = r.time()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        infos = [namespaces.describe(r, ns, now_ms) for ns in namespaces.find(r)]
    finally:
        r.close()
    if args.json:
        print(namespaces.as_json(infos))
        return 0
    header = ("namespace", "age", "idle", "ttl", "clients", "partitions", "keys", "key bytes", "nodes (dead)",
              "node bytes")
    rows = [header]
    for i in infos:
        ttl = "-" if i.ttl_s is None else f"{i.ttl_s:g}s" + (" (expired)" if i.expired(now_ms) else "")
        rows.append((i.namespace, _age(now_ms, i.created_ms), _age(now_ms, i.touched_ms), ttl,
                     str(len(i.live_clients)), str(i.partitions), str(i.keys), format_size(i.key_bytes),
                     f"{len(i.live_nodes)} ({len(i.dead_nodes)})", format_size(i.node_bytes)))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _unknown(url: str, ns: str) -> str | None:
    """What to say when namespace ``ns`` has no keys on the server at ``url`` (None: it has). A server
    that refuses or cannot be reached raises a typed error (the one ``status`` prints)."""
    import redis

    from tq_redis.errors import ConnectionFailed
    from tq_redis.monitor.known import unknown_namespace
    from tq_redis.redact import redact
    from tq_redis.server import connections
    from tq_redis.server import policy as server_policy

    r = connections.sync_client(url, reconnect=False, socket_connect_timeout=3)  # one try, as status makes
    try:
        return unknown_namespace(r, ns)
    except redis.RedisError as exc:
        typed = server_policy.typed_error(url, exc)  # a refusal: credentials, ACL
        if typed is None and isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            typed = ConnectionFailed(f"cannot reach Redis at {redact(url)} ({exc}); check that the server is "
                                     f"running and the URL is right")
        raise (typed or server_policy.unexpected_reply(url, exc)) from exc
    finally:
        r.close()


def _cmd_drop(args: argparse.Namespace) -> int:
    url = _url(args, "namespace drop")
    if not url:
        return 2
    try:
        unknown = _unknown(url, args.namespace)
        if unknown is not None:
            print(f"tq-redis namespace drop: {unknown}; nothing dropped", file=sys.stderr)
            return 1
        # imported only now: dropping reaches the checkpoint and channel code, and so torch (seconds
        # of imports a typo or a refused password should not wait for)
        from tq_redis.monitor import namespaces

        info = namespaces.drop(url, args.namespace, force=args.force, say=lambda m: print(m, file=sys.stderr))
    except TQError as exc:
        print(f"tq-redis namespace drop: {exc}", file=sys.stderr)
        return 1
    print(f"dropped namespace {args.namespace!r}: {info.partitions} partition(s), {info.keys} key(s) "
          f"({format_size(info.key_bytes)} in Redis)")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from tq_redis.monitor import namespaces

    url = _url(args, "namespace gc")
    if not url:
        return 2
    started = time.monotonic()
    done = namespaces.gc(url, forget_after_s=args.forget_after, say=lambda m: print(m, file=sys.stderr))
    for ns in done["dropped"]:
        print(f"dropped namespace {ns!r} (its namespace_ttl ran out with no live client)")
    for node in done["forgotten"]:
        print(f"removed the registration of storage node {node} (gone)")
    print(f"namespace gc: {len(done['dropped'])} dropped, {len(done['forgotten'])} registration(s) removed "
          f"in {time.monotonic() - started:.1f} s")
    return 0


def _cmd_cleanup(args: argparse.Namespace) -> int:
    from tq_redis.server import leftovers

    found = leftovers.abandoned_dirs() if args.dry_run else leftovers.remove_abandoned()
    verb = "abandoned" if args.dry_run else "removed"
    for directory in found:
        print(f"{verb}: {directory}")
    print(f"cleanup: {len(found)} embedded-server director{'y' if len(found) == 1 else 'ies'} {verb}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``namespace`` and ``cleanup`` to the ``tq-redis`` command line."""
    from tq_redis.server.registry import DEFAULT_FORGET_AFTER_S

    ns = sub.add_parser("namespace", help="list, drop or garbage-collect the namespaces on a Redis server")
    nsub = ns.add_subparsers(dest="action", required=True)
    listing = nsub.add_parser("list", help="every namespace: age, idle time, TTL, live clients, size, storage nodes")
    listing.add_argument("--redis", default=None, help="Redis URL (default: $TQ_REDIS_URL); it SCANs the server")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=_cmd_list)
    drop = nsub.add_parser("drop", help="delete a namespace: its data on the storage nodes, then its keys")
    drop.add_argument("namespace")
    drop.add_argument("--redis", default=None, help="Redis URL (default: $TQ_REDIS_URL)")
    drop.add_argument("--force", action="store_true", help="drop it even while clients or storage nodes are live")
    drop.set_defaults(func=_cmd_drop)
    gc = nsub.add_parser("gc", help="drop namespaces past their namespace_ttl with no live client, and "
                         "remove registrations of storage nodes that are gone (run it from cron)")
    gc.add_argument("--redis", default=None, help="Redis URL (default: $TQ_REDIS_URL)")
    gc.add_argument("--forget-after", type=float, default=DEFAULT_FORGET_AFTER_S, metavar="S",
                    help=f"a node registration without a heartbeat for S seconds is removed "
                         f"(default {DEFAULT_FORGET_AFTER_S:g})")
    gc.set_defaults(func=_cmd_gc)
    cleanup = sub.add_parser("cleanup", help="remove the embedded servers' temp directories that jobs killed "
                             "with SIGKILL left on this host")
    cleanup.add_argument("--dry-run", action="store_true", help="only list them")
    cleanup.set_defaults(func=_cmd_cleanup)
