"""Redis ACL rules for the users of a shared Redis: one user per namespace, one per storage node.

Every key of a namespace starts with ``<namespace>:`` (see :mod:`tq_redis.meta.keys`; a namespace holds
no ``:`` and no glob character, so ``~<ns>:*`` reaches no other namespace's keys). A namespace's
user gets that key pattern, no Pub/Sub channels, and only the commands tq-redis's clients send
(:data:`CLIENT_COMMANDS`): the library's functions (``FCALL``/``FCALL_RO``), the plain reads and
writes the operations use, and what a connection needs. Nothing else: no scripting of its own
(``EVAL``, ``EVALSHA``, ``SCRIPT``: a script of its own could run for seconds and stall every other
namespace's calls, as Redis runs one script at a time), no ``FUNCTION LOAD`` (the library is
loaded by an admin: ``tq-redis load-library``), no ``CONFIG``, ``FLUSHALL``/``FLUSHDB``,
``KEYS``/``SCAN``, ``ACL``, ``DEBUG``, ``SHUTDOWN``. Because every command a Lua function runs is
checked against the caller's rules too, a function called with a namespace's keys cannot reach
another namespace's.

A storage node (``tq-redis storage-unit``) only registers itself and runs the deletes recorded for
it: role ``storage-node`` may read and write the key ``<ns>:storage:nodes`` (``HSET``/``HGET``/
``HDEL``, ``TIME`` for the heartbeat), read the namespace's epoch ``<ns>:storage:epoch`` (``GET``;
:mod:`tq_redis.server.identity`) and take its entries off ``<ns>:storage:pending:*`` (``LPOP``,
and ``DEL``/``SREM`` of them and ``<ns>:storage:pendingnodes`` when it stops).

``tq-redis acl NAMESPACE`` prints the ``ACL SETUSER`` line; ``--apply --redis URL`` (as an admin
user) runs it on the server (every primary of a cluster). :func:`setuser_args` builds it.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections.abc import Callable, Sequence
from typing import Any

import redis

from tq_redis import names
from tq_redis.errors import ConfigError

#: commands a client of a namespace sends (lower case; ``a|b`` is subcommand ``b`` of ``a``)
CLIENT_DATA_COMMANDS: tuple[str, ...] = (
    # the function library: every state transition, and the DRAM store's registry read
    "fcall", "fcall_ro",
    # (the commands the functions run are checked against the caller's rules too: lua/*.lua's)
    # strings and keys: values of the redis store, bitmaps, counters, checkpoints
    "get", "set", "mset", "mget", "getrange", "setrange", "strlen", "del", "unlink", "exists", "type",
    "pttl", "pexpire", "persist", "incrby", "decr", "setbit", "bitfield", "bitcount", "bitop", "bitpos",
    # hashes, sets, sorted sets, lists, streams
    "hget", "hset", "hsetnx", "hmget", "hgetall", "hkeys", "hscan", "hdel", "hexists", "hlen", "hincrby",
    "hincrbyfloat", "sadd", "srem", "smembers", "sismember", "scard",
    "zadd", "zrem", "zrange", "zrevrange", "zrangebyscore", "zrevrangebyscore", "zremrangebyscore",
    "zcard", "zscore", "lrange", "llen", "rpush", "lpop", "ltrim", "blpop",
    "xadd", "xread", "xrange", "xrevrange", "xtrim",
    # durable mode (redis.durable): wait for replicas / the AOF after a write
    "wait", "waitaof",
)  # fmt: skip

#: what every connection needs: the handshake, health checks, checks of the server
CONNECTION_COMMANDS: tuple[str, ...] = (
    "auth", "hello", "ping", "select", "time", "client|setinfo", "client|setname", "client|getname",
    # cluster detection and the eviction-policy check (CONFIG GET is not granted: INFO says it)
    "info",
    # the library check reads the loaded code (never FUNCTION LOAD: an admin step)
    "function|list",
    # a Redis Cluster client: the slot map, command table and redirections
    "cluster|slots", "cluster|shards", "cluster|nodes", "cluster|myid", "command", "readonly", "asking",
)  # fmt: skip

CLIENT_COMMANDS: tuple[str, ...] = CLIENT_DATA_COMMANDS + CONNECTION_COMMANDS

#: a storage node: its registration in ``<ns>:storage:nodes``
STORAGE_NODE_COMMANDS: tuple[str, ...] = (
    "hset", "hget", "hdel", "get", "lpop", "del", "srem", *CONNECTION_COMMANDS,
)

#: never granted to a namespace's user (the unit tests check none slips in)
FORBIDDEN: frozenset[str] = frozenset({
    "function|load", "function|delete", "function|flush", "function|restore", "function", "config",
    "config|set", "config|get", "flushall", "flushdb", "keys", "scan", "acl", "debug", "shutdown", "module",
    "script", "script|load", "script|flush", "script|kill", "eval", "evalsha", "eval_ro", "evalsha_ro",
    "function|kill", "replicaof", "slaveof", "failover", "save", "bgsave", "bgrewriteaof", "migrate", "monitor",
    "cluster|reset", "cluster|failover", "client|kill", "client|list",
})

ROLES = ("client", "storage-node")


def key_patterns(namespace: str, role: str = "client") -> list[str]:
    """The key patterns of a role's user in ``namespace``."""
    ns = names.namespace(namespace)
    if role == "client":
        return [f"~{ns}:*"]
    if role == "storage-node":
        return [f"~{ns}:storage:nodes", f"~{ns}:storage:pending:*", f"~{ns}:storage:pendingnodes",
                f"%R~{ns}:storage:epoch"]
    raise ConfigError(f"ACL role {role!r} is not known: use one of {', '.join(ROLES)}")


def commands(role: str = "client") -> tuple[str, ...]:
    """The commands a role's user may run."""
    if role == "client":
        return CLIENT_COMMANDS
    if role == "storage-node":
        return STORAGE_NODE_COMMANDS
    raise ConfigError(f"ACL role {role!r} is not known: use one of {', '.join(ROLES)}")


def rules(namespace: str, role: str = "client") -> list[str]:
    """The ACL rules (after ``reset``) of a role's user in ``namespace``, password rule excluded."""
    return [*key_patterns(namespace, role), "resetchannels", "-@all", *(f"+{c}" for c in commands(role))]


def setuser_args(user: str, namespace: str, password: str, role: str = "client") -> list[str]:
    """``ACL SETUSER`` arguments: the user starts from nothing (``reset``), is enabled, has this password."""
    _check_user(user)
    if not password:
        raise ConfigError("an ACL user needs a password: pass --password (or let tq-redis acl generate one)")
    return ["ACL", "SETUSER", user, "reset", "on", f">{password}", *rules(namespace, role)]


def default_user(namespace: str, role: str = "client") -> str:
    """The user name ``tq-redis acl`` gives a namespace's user by default."""
    ns = names.namespace(namespace)
    return f"tq-{ns}" if role == "client" else f"tq-{ns}-node"


def new_password() -> str:
    """A random password (URL-safe, so it can go into a ``redis://user:password@host`` URL as it is)."""
    return secrets.token_urlsafe(24)


def _check_user(user: Any) -> str:
    if not isinstance(user, str) or not user or any(c.isspace() or c in "\"'@:/" for c in user):
        raise ConfigError(f"ACL user name {user!r} must be non-empty, without spaces, quotes, '@', ':' or '/'")
    return user


def render(args: Sequence[str]) -> str:
    """An ``ACL SETUSER`` command as a line ``redis-cli`` / ``valkey-cli`` takes."""
    return " ".join(shlex.quote(a) for a in args)


_UNKNOWN_MODIFIER = re.compile(r"modifier '(\+[^']+)'", re.IGNORECASE)


def _setuser(run: Callable[[list[str]], Any], args: list[str]) -> list[str]:
    """Send ``ACL SETUSER``, leaving out grants of commands this server does not know (Redis 7.0
    has no ``WAITAOF`` or ``CLIENT SETINFO``, and refuses the whole line for one unknown command)."""
    args = list(args)
    while True:
        try:
            run(args)
            return args
        except redis.ResponseError as exc:
            m = _UNKNOWN_MODIFIER.search(str(exc))
            if m is None or m.group(1) not in args or "unknown command" not in str(exc).lower():
                raise
            args.remove(m.group(1))


def apply(client: Any, user: str, namespace: str, password: str, role: str = "client") -> list[str]:
    """Run ``ACL SETUSER`` for the user on ``client``'s server (each primary of a cluster, as ACLs
    are per node); returns the arguments sent. Redis errors propagate."""
    from tq_redis.server.connections import is_cluster_client

    args = setuser_args(user, namespace, password, role)
    if not is_cluster_client(client):
        return _setuser(lambda a: client.execute_command(*a), args)
    for node in client.get_primaries():
        sent = _setuser(lambda a, node=node: client.execute_command(*a, target_nodes=node), args)
    return sent
