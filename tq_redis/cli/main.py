"""The ``tq-redis`` command: ``up``, ``storage-unit``, ``status``, ``demo``, and the admin steps of a shared
Redis: ``acl`` (a namespace's ACL user), ``load-library`` (the function library), ``namespace``
and ``cleanup`` (abandoned state: :mod:`tq_redis.cli.namespaces`)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import redis

from tq_redis.cli import namespaces as cli_namespaces
from tq_redis.settings import settings


def _start_redis(args: argparse.Namespace, password: str):
    """The embedded single server, or with ``--cluster N`` an N-master cluster; both require ``password``."""
    if args.cluster:
        from tq_redis.server.embedded_cluster import EmbeddedCluster

        return EmbeddedCluster(args.cluster, host=args.host, data_dir=args.data_dir,
                               appendonly=args.appendonly, password=password).start()
    from tq_redis.server.embedded import EmbeddedServer

    return EmbeddedServer(port=args.port, data_dir=args.data_dir, appendonly=args.appendonly, host=args.host,
                          password=password).start()


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _attach_file(directory: str, url: str, namespace: str) -> str:
    """Write the attach settings (the URL holds the password) to a file only this user can read."""
    import shlex

    path = os.path.join(directory, "attach.env")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"export TQ_REDIS_URL={shlex.quote(url)}\nexport TQ_NAMESPACE={shlex.quote(namespace)}\n")
    return path


def _say_what_is_reachable(args: argparse.Namespace, server, nodes, attach: str) -> None:
    """What ``up`` serves, who can reach it and what protects it; where the attach settings are."""
    from tq_redis.redact import redact

    kind = f"{args.cluster}-master cluster; any node's URL works" if args.cluster else "single server"
    print(f"tq-redis up: {redact(server.url)} namespace {args.namespace!r} ({kind})")
    ends = ", ".join(f"{n.host}:{n.port}" for n in getattr(server, "nodes", [server]))
    where = "from this host only" if args.host in _LOOPBACK else "from other hosts too (no TLS: a trusted network only)"
    print(f"  Redis: {ends}, {where}; every connection needs its password, drawn at random now")
    if nodes is not None:
        print(f"  storage nodes: {', '.join(nodes.addresses)} (TCP, from this host only) and a unix socket each "
              f"(shared memory); each admits only clients presenting the access key it registered in this Redis")
    print("  so the password is the one secret: it is in the attach file, which only this user can read")
    print(f"attach with: source {attach}   (exports TQ_REDIS_URL, password included, and TQ_NAMESPACE; "
          f"Ctrl-C stops)", flush=True)


def _clean_up_after_killed_jobs(args: argparse.Namespace, url: str) -> None:
    """What jobs killed with SIGKILL left: their embedded servers' directories on this host, and,
    on a server that keeps its data across runs, namespaces past their namespace_ttl."""
    from tq_redis.monitor import namespaces
    from tq_redis.server import leftovers

    for directory in leftovers.remove_abandoned():
        print(f"tq-redis up: removed {directory} (left by a killed job)", flush=True)
    if args.data_dir is not None:
        for ns in namespaces.gc(url)["dropped"]:
            print(f"tq-redis up: dropped namespace {ns!r} (its namespace_ttl ran out)", flush=True)


def _replicas(text: str) -> int:
    """``--replicas``: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (copies of each value), got {text!r}")
    return int(text)


def _cmd_up(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from tq_redis.backends.dram.launcher import start_local_nodes
    from tq_redis.server import acl, connections

    if args.cluster and args.port is not None:
        print("tq-redis up: --port is for the single server; the nodes of --cluster take free ports",
              file=sys.stderr)
        return 2
    durable = None
    if args.durable is not None:  # storage.durable: checked and probed before anything starts, as init does
        from tq_redis.errors import TQError
        from tq_redis.storage.base import StoreContext
        from tq_redis.storage.durable import check_durable, durable_spec

        try:
            durable = durable_spec(args.durable)
            check_durable(durable, StoreContext("", args.namespace))
        except TQError as exc:
            print(f"tq-redis up: --durable: {exc}", file=sys.stderr)
            return 2
    if args.replicas > max(args.units, 1):
        print(f"tq-redis up: --replicas {args.replicas} needs at least that many --units (got {args.units})",
              file=sys.stderr)
        return 2
    server = _start_redis(args, acl.new_password())
    private = tempfile.mkdtemp(prefix="tq-up-")  # mode 0700: the attach file's directory
    nodes = None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.units > 0:
            nodes = start_local_nodes(server.url, args.namespace, n=args.units, capacity=args.capacity,
                                      token=args.token, spill=args.spill)
        spec: dict = {"backend": "dram" if args.units else "redis", "options": {}}
        if durable is not None:
            spec["durable"] = durable
        r = connections.sync_client(server.url)
        if args.units and args.replicas > 1:
            spec["options"]["replicas"] = args.replicas
        r.hset(f"{args.namespace}:config", "storage", json.dumps(spec))
        r.close()
        _say_what_is_reachable(args, server, nodes, _attach_file(private, server.url, args.namespace))
        _clean_up_after_killed_jobs(args, server.url)
        while not stop.wait(0.5):
            if not server.alive():
                print("tq-redis up: the Redis server exited", file=sys.stderr)
                return 1
    finally:
        if nodes is not None:
            nodes.stop()
        server.stop(remove_data=args.data_dir is None)
        shutil.rmtree(private, ignore_errors=True)
        print("tq-redis up: stopped", flush=True)
    return 0


def _cmd_storage_unit(argv: list[str]) -> int:
    from tq_redis.backends.dram.server import main as node_main

    return node_main(argv)


def _one_line(command: str, error: BaseException) -> int:
    """Print ``error`` as one line on stderr (no traceback; its URL is already redacted); exit status 1."""
    print(f"tq-redis {command}: " + " ".join(str(error).split()), file=sys.stderr)
    return 1


def _redis_failure(url: str, exc: redis.RedisError) -> Exception:
    """What a Redis error means to a CLI user: a refusal (credentials, ACL) or an unreachable server."""
    from tq_redis.errors import ConnectionFailed
    from tq_redis.redact import redact
    from tq_redis.server import policy as server_policy

    typed = server_policy.typed_error(url, exc)
    if typed is not None:
        return typed
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return ConnectionFailed(
            f"cannot reach Redis at {redact(url)} ({exc}); check that the server is running, that the host "
            f"and port are right, and that this machine may connect to it"
        )
    return exc


def _open_monitor(command: str, url: str | None):
    """A short-timeout client of ``url`` for a read-only view, or the exit status of a one-line error."""
    from tq_redis.errors import TQError
    from tq_redis.server import connections

    if not url:
        print(f"tq-redis {command}: pass --redis URL or set TQ_REDIS_URL", file=sys.stderr)
        return 2
    try:
        # one try with a short timeout: a user waiting at a terminal learns at once what to check
        return connections.sync_client(url, reconnect=False, socket_connect_timeout=3, socket_timeout=10)
    except TQError as exc:
        return _one_line(command, exc)
    except redis.RedisError as exc:
        return _one_line(command, _redis_failure(url, exc))


_ALLOW_EMPTY = "; --allow-empty shows it anyway (a job not started yet)"


def _check_namespace(command: str, r, args: argparse.Namespace) -> int | None:
    """Exit status 1 with one line naming the known namespaces if ``args.namespace`` has no keys on the
    server (unless ``--allow-empty``); None to go on."""
    from tq_redis.monitor.known import unknown_namespace

    if args.allow_empty:
        return None
    message = unknown_namespace(r, args.namespace, hint=_ALLOW_EMPTY)
    if message is None:
        return None
    print(f"tq-redis {command}: {message}", file=sys.stderr)
    return 1


def _cmd_status(args: argparse.Namespace) -> int:
    from tq_redis.monitor import status_view
    from tq_redis.monitor.status import rates, snapshot

    url = args.redis or settings.redis_url
    r = _open_monitor("status", url)
    if isinstance(r, int):
        return r
    previous = None
    try:
        try:
            refused = _check_namespace("status", r, args)
        except redis.RedisError as exc:
            return _one_line("status", _redis_failure(url, exc))
        if refused is not None:
            return refused
        while True:
            try:
                snap = snapshot(r, args.namespace)
            except redis.RedisError as exc:
                return _one_line("status", _redis_failure(url, exc))
            rate = rates(previous, snap)
            if args.json:
                print(json.dumps({**snap, "rates": rate} if args.watch else snap, indent=2, sort_keys=True),
                      flush=True)
            else:
                status_view.show(snap, rate, clear=args.watch, plain=args.plain)
            if not args.watch:
                return 0
            previous = snap
            time.sleep(args.interval)  # a refresh interval for a human watching, not synchronisation
    except KeyboardInterrupt:
        return 0
    finally:
        r.close()


def _serve_view(command: str, args: argparse.Namespace, start) -> int:
    """Check that Redis answers (one typed line and exit 1 if not: said at once, not at the first
    request), then ``start(url)`` -- ``(http server, address, reader with close())`` -- and serve
    until SIGINT/SIGTERM."""
    url = args.redis or settings.redis_url
    r = _open_monitor(command, url)
    if isinstance(r, int):
        return r
    try:
        r.ping()
        refused = _check_namespace(command, r, args)
    except redis.RedisError as exc:
        return _one_line(command, _redis_failure(url, exc))
    finally:
        r.close()
    if refused is not None:
        return refused
    server, address, reader = start(url)
    print(f"tq-redis {command}: namespace {args.namespace!r} at {address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        reader.close()
    return 0


def _cmd_exporter(args: argparse.Namespace) -> int:
    """Serve one namespace's gauges at ``/metrics``."""
    from tq_redis.monitor.exporter import serve_namespace

    return _serve_view("exporter", args, lambda url: serve_namespace(url, args.namespace, args.port, args.host))


def _cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve one namespace's live page at ``/``."""
    from tq_redis.monitor.dashboard import serve

    return _serve_view("dashboard", args,
                       lambda url: serve(url, args.namespace, args.port, args.host, refresh_s=args.refresh))


def _admin_url(args: argparse.Namespace, command: str) -> str | None:
    url = args.redis or settings.redis_url
    if not url:
        print(f"tq-redis {command}: pass --redis URL (an admin user's) or set TQ_REDIS_URL", file=sys.stderr)
    return url


def _cmd_load_library(args: argparse.Namespace) -> int:
    """Load the function library on every primary (an admin step on a shared Redis)."""
    from tq_redis.errors import TQError
    from tq_redis.server import connections
    from tq_redis.server import library as scripts
    from tq_redis.server import policy as server_policy

    url = _admin_url(args, "load-library")
    if not url:
        return 2
    try:
        r = connections.sync_client(url, reconnect=False, socket_connect_timeout=5)
    except TQError as exc:
        return _one_line("load-library", exc)
    try:
        nodes = scripts.load_everywhere(r)
    except redis.RedisError as exc:
        return _one_line("load-library", _redis_failure(url, exc))
    finally:
        r.close()
    where = ", ".join(n for n in nodes if n) or server_policy.redact(url)
    print(f"tq-redis load-library: library {scripts.LIBRARY_NAME} version {scripts.library()[1]} loaded on {where}")
    return 0


def _cmd_acl(args: argparse.Namespace) -> int:
    """Print (or apply) the ACL rules of a namespace's user."""
    from tq_redis.errors import TQError
    from tq_redis.server import acl, connections

    try:
        user = args.user or acl.default_user(args.namespace, args.role)
        password = args.password or settings.acl_password or acl.new_password()
        line = acl.setuser_args(user, args.namespace, password, args.role)
    except TQError as exc:
        print(f"tq-redis acl: {exc}", file=sys.stderr)
        return 2
    if not args.apply:
        print(acl.render(line))
        if not (args.password or settings.acl_password):
            print(f"# generated password for {user}: {password}", file=sys.stderr)
        return 0
    url = _admin_url(args, "acl --apply")
    if not url:
        return 2
    try:
        r = connections.sync_client(url, reconnect=False, socket_connect_timeout=5)
        try:
            sent = acl.apply(r, user, args.namespace, password, args.role)
        finally:
            r.close()
    except redis.RedisError as exc:
        return _one_line("acl", _redis_failure(url, exc))
    except TQError as exc:
        return _one_line("acl", exc)
    left_out = [a for a in line if a not in sent]
    note = f" (this server does not know {', '.join(left_out)}: left out)" if left_out else ""
    print(f"tq-redis acl: user {user} set for namespace {args.namespace!r} ({args.role}){note}")
    if not (args.password or settings.acl_password):
        print(f"password: {password}")
    return 0


def _version_line() -> str:
    """The package version, and whether this install copies batches with the native module."""
    from importlib.metadata import PackageNotFoundError, version

    from tq_redis.codec import batchscan, fastcopy

    try:
        ver = version("tq-redis")
    except PackageNotFoundError:
        ver = "(not installed)"
    copy_config = fastcopy.configure()
    copies = (
        f"native batch copies on, up to {copy_config['threads']} thread(s)"
        if copy_config
        else "native batch copies off (Python loops; see TQ_NATIVE_COPY, or install a C compiler and reinstall)"
    )
    scans = (
        "native batch scans on"
        if batchscan.NATIVE
        else "native batch scans off (Python; see TQ_NATIVE_SCAN, or install a C compiler and reinstall)"
    )
    return f"tq-redis {ver}: {copies}; {scans}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tq-redis", description="tq-redis: controller-less RL data gateway")
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="embedded Valkey (or --cluster N) + DRAM storage nodes in the foreground, "
                        "private to this user (a random password; see docs/operations/security.md)")
    up.add_argument("--port", type=int, default=None, help="Redis port (a free one by default)")
    up.add_argument("--host", default="127.0.0.1",
                    help="address Redis listens on (default 127.0.0.1: this host only; 0.0.0.0: every "
                         "interface, a trusted network only, there is no TLS)")
    up.add_argument("--namespace", default=settings.namespace or "tq",
                    help="the namespace the storage nodes serve and the attach file names "
                         "(default: $TQ_NAMESPACE, else tq)")
    up.add_argument("--units", type=int, default=2, help="storage nodes to start (0: keep data in Redis)")
    up.add_argument("--capacity", default="4GiB", help="memory budget per storage node")
    up.add_argument("--replicas", type=_replicas, default=1,
                    help="storage nodes holding each value (storage.replicas; at most --units)")
    up.add_argument("--spill", default=None, metavar="URL",
                    help="fsspec URL (directory, s3://...) the nodes write values beyond --capacity to")
    up.add_argument("--durable", default=settings.storage_durable, metavar="URL",
                    help="storage.durable: fsspec URL (file:///dir, s3://bucket/prefix) every stored value is "
                         "also written to before a put returns, read when its node is gone "
                         "(default: $TQ_STORAGE_DURABLE)")
    up.add_argument("--data-dir", default=None, help="keep Redis data here (default: a temp dir)")
    up.add_argument("--appendonly", action="store_true", help="turn on AOF persistence")
    up.add_argument("--token", default=settings.storage_token, help="storage-node auth token")
    up.add_argument("--cluster", type=int, default=0, metavar="N",
                    help="start an N-master Redis Cluster (Valkey, cluster mode) instead of one server")
    up.set_defaults(func=_cmd_up)

    sub.add_parser("storage-unit", help="one DRAM storage node (see: tq-redis storage-unit --help)",
                   add_help=False)

    sub.add_parser("demo", help="the GRPO-shaped pipeline demo (see: tq-redis demo --help)", add_help=False)

    status = sub.add_parser("status", help="per partition: claimable, progress, leases, waiters, poison; "
                            "where bytes live; the server's memory and policy")
    status.add_argument("--redis", default=None, help="Redis URL (default: $TQ_REDIS_URL)")
    status.add_argument("--namespace", default=settings.namespace or "tq",
                        help="the job's namespace (default: $TQ_NAMESPACE, else tq); an unknown one exits 1 "
                             "naming the known ones")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--watch", action="store_true",
                        help="refresh every --interval seconds until Ctrl-C, with rates since the last refresh")
    status.add_argument("--plain", action="store_true", help="plain text even where rich is installed")
    status.add_argument("--interval", type=float, default=1.0, metavar="S",
                        help="seconds between refreshes with --watch (default 1)")
    status.add_argument("--allow-empty", action="store_true",
                        help="go on when the namespace has no keys yet (a job not started yet) instead of "
                             "exiting 1")
    status.set_defaults(func=_cmd_status)

    exporter = sub.add_parser("exporter", help="serve one namespace's Prometheus gauges at /metrics "
                              "(read from Redis once per scrape)")
    exporter.add_argument("--redis", default=None, help="Redis URL (default: $TQ_REDIS_URL)")
    exporter.add_argument("--namespace", default=settings.namespace or "tq")
    exporter.add_argument("--port", type=int, default=9464, help="HTTP port (0: a free one)")
    exporter.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    exporter.add_argument("--allow-empty", action="store_true",
                        help="go on when the namespace has no keys yet (a job not started yet) instead of "
                             "exiting 1")
    exporter.set_defaults(func=_cmd_exporter)

    dash = sub.add_parser("dashboard", help="a live, read-only web page of one namespace at /")
    dash.add_argument("--redis", default=None, help="Redis URL (default: $TQ_REDIS_URL)")
    dash.add_argument("--namespace", default=settings.namespace or "tq")
    dash.add_argument("--port", type=int, default=8265, help="HTTP port (0: a free one)")
    dash.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    dash.add_argument("--refresh", type=float, default=2.0, help="seconds between the page's refreshes")
    dash.add_argument("--allow-empty", action="store_true",
                        help="go on when the namespace has no keys yet (a job not started yet) instead of "
                             "exiting 1")
    dash.set_defaults(func=_cmd_dashboard)

    load = sub.add_parser("load-library", help="admin: load the Lua function library on every primary")
    load.add_argument("--redis", default=None, help="Redis URL of a user allowed to FUNCTION LOAD "
                      "(default: $TQ_REDIS_URL)")
    load.set_defaults(func=_cmd_load_library)

    acl_cmd = sub.add_parser("acl", help="print (or --apply) the Redis ACL rules of a namespace's user")
    acl_cmd.add_argument("namespace")
    acl_cmd.add_argument("--user", default=None, help="user name (default: tq-NAMESPACE, tq-NAMESPACE-node)")
    acl_cmd.add_argument("--password", default=None,
                         help="the user's password (default: $TQ_ACL_PASSWORD, else a generated one)")
    acl_cmd.add_argument("--role", choices=("client", "storage-node"), default="client",
                         help="client: a job's ranks; storage-node: a DRAM node (registers itself only)")
    acl_cmd.add_argument("--apply", action="store_true", help="run ACL SETUSER on the server (an admin's URL)")
    acl_cmd.add_argument("--redis", default=None, help="Redis URL for --apply (default: $TQ_REDIS_URL)")
    acl_cmd.set_defaults(func=_cmd_acl)
    cli_namespaces.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "storage-unit":
        return _cmd_storage_unit(argv[1:])
    if argv and argv[0] == "demo":
        from tq_redis.demo.main import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `tq-redis status --json | head`: the reader left; exit quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so flushing stdout at exit raises nothing more
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
