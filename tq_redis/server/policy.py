"""What tq-redis requires of a Redis server it shares, checked where a client first meets a server.

Two settings, per Redis URL (``init`` declares them from its config; other processes read the
environment; else the defaults):

``redis.on_eviction`` (``TQ_REDIS_ON_EVICTION``): ``error`` (default) or ``warn``
    A ``maxmemory-policy`` of ``allkeys-*`` lets Redis delete *any* key when it reaches
    ``maxmemory``: partitions vanish, a partition's id counter goes and ids are reused, all
    silently. With ``error`` a client refuses such a server with
    :class:`~tq_redis.errors.EvictionPolicyError`; ``warn`` logs and warns (:class:`EvictionWarning`)
    and goes on. ``volatile-*`` policies only evict keys that carry a TTL; the durable state of
    tq-redis carries none (only helper keys do: sampler choices a data-parallel group shares,
    waiter registrations, the group index cache), so they are accepted with a warning: under
    them, as under ``noeviction``, a write past ``maxmemory`` fails
    (:class:`~tq_redis.errors.RedisOutOfMemory`) and clearing still frees memory. The policy is
    read with ``CONFIG GET`` or, when an ACL denies that, from ``INFO memory``; it is checked once
    per server (each primary of a cluster) per process.

``redis.load_library`` (``TQ_REDIS_LOAD_LIBRARY``): ``auto`` (default) or ``never``
    ``auto``: a client loads the function library where it is missing or is not exactly its own
    code (see :mod:`tq_redis.server.library`). ``never``: it does not; a missing or foreign library is
    a :class:`~tq_redis.errors.LibraryNotLoaded` naming the admin step ``tq-redis load-library``.
    On a shared Redis, loading the library is an admin step: namespace users get no
    ``FUNCTION LOAD`` (``tq-redis acl``), so they run with ``never``.

:func:`node_checks` is the check of one server, written once as a generator of commands that
both drivers run (see :mod:`tq_redis.client.plans`); :func:`typed_error` maps Redis's refusals
(``NOPERM``, ``OOM``, a failed ``AUTH``) to tq-redis errors.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Generator
from typing import Any

import redis

from tq_redis.errors import (
    ConfigError,
    EvictionPolicyError,
    LibraryNotLoaded,
    PermissionDenied,
    RedisOutOfMemory,
    ServerBusy,
    ServerError,
    TQError,
)
from tq_redis.redact import redact
from tq_redis.server import library as scripts
from tq_redis.settings import settings

log = logging.getLogger(__name__)

ON_EVICTION_ENV = "TQ_REDIS_ON_EVICTION"
LOAD_LIBRARY_ENV = "TQ_REDIS_LOAD_LIBRARY"
CHOICES = {"on_eviction": ("error", "warn"), "load_library": ("auto", "never")}
DEFAULTS = {"on_eviction": "error", "load_library": "auto"}
_ENV = {"on_eviction": ON_EVICTION_ENV, "load_library": LOAD_LIBRARY_ENV}

ADMIN_LOAD = "tq-redis load-library --redis URL"

_lock = threading.Lock()
_declared: dict[tuple[str, str], str] = {}
_policy_checked: set[tuple[str, str]] = set()


class EvictionWarning(RuntimeWarning):
    """The Redis server may evict keys (see :mod:`tq_redis.server.policy`)."""


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


def parse(name: str, value: Any, where: str | None = None) -> str:
    """``value`` checked as setting ``name`` (``on_eviction`` or ``load_library``); raises ConfigError."""
    choices = CHOICES[name]
    text = str(value).strip().lower() if isinstance(value, str) else value
    if text not in choices:
        raise ConfigError(f"{where or 'redis.' + name}={value!r} is not understood: use one of {', '.join(choices)}")
    return text


def declare(url: str, **declared: Any) -> None:
    """Record ``init``'s settings for ``url`` (``on_eviction=``, ``load_library=``; None forgets one)."""
    with _lock:
        for name, value in declared.items():
            if value is None:
                _declared.pop((url, name), None)
            else:
                _declared[(url, name)] = parse(name, value)


def forget(url: str | None = None) -> None:
    """Drop declared settings and checked policies for ``url`` (every URL when None)."""
    with _lock:
        for table in (_declared, _policy_checked):
            for entry in [e for e in table if url is None or e[0] == url]:
                if isinstance(table, dict):
                    table.pop(entry, None)
                else:
                    table.discard(entry)


def setting(url: str, name: str) -> str:
    """The setting ``name`` for ``url``: what ``init`` declared, else the environment, else the default."""
    with _lock:
        value = _declared.get((url, name))
    if value is not None:
        return value
    env = getattr(settings, f"redis_{name}")
    return parse(name, env, _ENV[name]) if env else DEFAULTS[name]


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def typed_error(url: str, exc: BaseException) -> TQError | None:
    """The tq-redis error for a Redis refusal, or None when ``exc`` is none of these:

    ``NOPERM`` (an ACL rule) and a failed ``AUTH`` -> :class:`PermissionDenied`; ``OOM`` (used
    memory over ``maxmemory`` under ``noeviction``) -> :class:`RedisOutOfMemory`.
    """
    where = redact(url)
    if isinstance(exc, redis.exceptions.NoPermissionError) or _denied_in_script(exc):
        return PermissionDenied(
            f"Redis at {where} refused this client's user: {str(exc).rstrip('.')}. Its ACL rules do not allow it; a "
            f"namespace's user may touch only the keys '<namespace>:*' of its own namespace and run "
            f"the commands `tq-redis acl NAMESPACE` lists (an administrator applies them with --apply)"
        )
    if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.AuthorizationError):
        return PermissionDenied(
            f"Redis at {where} refused the credentials: {str(exc).rstrip('.')}. Put the user and password in the URL "
            f"(redis://USER:PASSWORD@host:port/0), or the password alone for the default user"
        )
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return RedisOutOfMemory(
            f"Redis at {where} is full: {exc} Nothing was written by the refused call. Free memory with "
            f"clear_partition / clear_samples (they still work), or raise maxmemory, then retry"
        )
    return None


def is_busy(exc: BaseException) -> bool:
    """Redis answered ``BUSY``: a script runs past ``busy-reply-threshold``; the command did not run."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("BUSY")


def busy_error(url: str, exc: BaseException, waited_s: float) -> ServerBusy:
    """The error for a server that answered ``BUSY`` to every try for ``waited_s`` seconds."""
    return ServerBusy(
        f"Redis at {redact(url)} is busy running a script and refused this call for {waited_s:.1f} s "
        f"({exc}). The refused command did not run. Some client runs a script longer than the server's "
        f"busy-reply-threshold (tq-redis's own scripts hold the server a few ms at most): wait for it, or "
        f"stop it with SCRIPT KILL / FUNCTION KILL (a script that wrote already can only be stopped by "
        f"SHUTDOWN NOSAVE), then retry"
    )


def unexpected_reply(url: str, exc: redis.ResponseError) -> ServerError:
    """A Redis error reply no more specific tq-redis error names, as a typed error quoting it."""
    return ServerError(
        f"Redis at {redact(url)} refused a tq-redis command: {exc}. Check the server's state (INFO, the "
        f"server log), and that nothing but tq-redis writes keys of this namespace"
    )


def _denied_in_script(exc: BaseException) -> bool:
    """A function's command or key refused by the caller's ACL rules (Redis reports it as a plain
    error of the script, not ``NOPERM``)."""
    if not isinstance(exc, redis.ResponseError):
        return False
    text = str(exc)
    return "user executing the script can't" in text or "no permissions to" in text.lower()


# ---------------------------------------------------------------------------------------------
# The checks of one server
# ---------------------------------------------------------------------------------------------


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def policy_from_config(reply: Any) -> str | None:
    """``maxmemory-policy`` from a ``CONFIG GET maxmemory-policy`` reply (a dict, or a flat list)."""
    if isinstance(reply, dict):
        pairs = reply.items()
    elif isinstance(reply, list | tuple):
        pairs = zip(reply[::2], reply[1::2])
    else:
        return None
    for key, value in pairs:
        if _text(key) == "maxmemory-policy":
            return _text(value)
    return None


def policy_from_info(reply: Any) -> str | None:
    """``maxmemory_policy`` from an ``INFO memory`` reply (parsed dict or raw text)."""
    if isinstance(reply, dict):
        if "maxmemory_policy" in reply:
            return _text(reply["maxmemory_policy"])
        for value in reply.values():  # a cluster client may answer per node
            if isinstance(value, dict) and "maxmemory_policy" in value:
                return _text(value["maxmemory_policy"])
        return None
    for line in (_text(reply) or "").splitlines():
        if line.startswith("maxmemory_policy:"):
            return line.split(":", 1)[1].strip()
    return None


def judge_policy(url: str, node: str, policy: str | None, mode: str) -> None:
    """Refuse (``mode="error"``) or warn about an evicting ``policy``; warn about one we could not read."""
    where = redact(url) + (f" (node {node})" if node else "")
    fix = (
        "set `maxmemory-policy noeviction` on the server (CONFIG SET maxmemory-policy noeviction, and in "
        "its config file)"
    )
    if policy is None:
        _warn(
            f"could not read maxmemory-policy of Redis at {where} (CONFIG GET and INFO were refused): "
            f"tq-redis cannot check that the server never evicts its keys; grant the user +info"
        )
    elif policy.startswith("allkeys-"):
        text = (
            f"Redis at {where} has maxmemory-policy {policy}: when it reaches maxmemory it deletes any key, "
            f"and tq-redis metadata (partitions, sample ids, consumption state) is lost without an error"
        )
        if mode == "error":
            raise EvictionPolicyError(f"{text}. {fix}; or accept the risk with redis.on_eviction: warn "
                                      f"({ON_EVICTION_ENV}=warn)")
        _warn(f"{text}. {fix}")
    elif policy.startswith("volatile-"):
        _warn(
            f"Redis at {where} has maxmemory-policy {policy}: tq-redis's durable keys have no TTL and are "
            f"never evicted, but its expiring helper keys may be (a RankAwareSampler / SeqlenBalancedSampler "
            f"choice shared by a data-parallel group, waiter registrations), so ranks of one group may get "
            f"different batches near maxmemory. {fix} to rule this out"
        )


def _warn(text: str) -> None:
    log.warning("%s", text)
    warnings.warn(text, EvictionWarning, stacklevel=3)


Check = Generator[tuple, Any, None]


def node_checks(url: str, node: str = "") -> Check:
    """Check one server (``node``: a cluster node's name, ``""`` for the URL's server).

    A generator of commands: the driver sends each yielded command to the node and sends the
    reply back in (or throws the ``redis.ResponseError`` it raised). First the eviction policy
    (once per process and node), then the function library: loaded where missing or foreign
    (``redis.load_library: auto``), else :class:`LibraryNotLoaded`.
    """
    if (url, node) not in _policy_checked:
        denied = False
        try:
            policy = policy_from_config((yield ("CONFIG", "GET", "maxmemory-policy")))
        except redis.ResponseError as exc:  # CONFIG denied by an ACL, or renamed away: INFO says it too
            denied = isinstance(exc, redis.exceptions.NoPermissionError)
            try:
                policy = policy_from_info((yield ("INFO", "memory")))
            except redis.ResponseError as again:
                denied = denied and isinstance(again, redis.exceptions.NoPermissionError)
                policy = None
        # neither refused nor told: a server without the setting (an in-process fake) never evicts
        judge_policy(url, node, None if denied and policy is None else policy or "noeviction",
                     setting(url, "on_eviction"))
        with _lock:
            _policy_checked.add((url, node))
    try:
        state = scripts.library_state((yield scripts.list_command()))
    except redis.exceptions.NoPermissionError as exc:
        raise PermissionDenied(
            f"Redis at {redact(url)} does not let this user run FUNCTION LIST ({exc}); tq-redis reads the "
            f"loaded library's code to check it is its own: grant +function|list (`tq-redis acl` includes it)"
        ) from exc
    if state == "current":
        return
    where = redact(url) + (f" (node {node})" if node else "")
    found = "is not loaded" if state == "missing" else "holds different code (another tq-redis version, or "
    if state == "foreign":
        found += "a library someone else loaded under its name)"
    if setting(url, "load_library") == "never":
        raise LibraryNotLoaded(
            f"the tq-redis function library on Redis at {where} {found}, and redis.load_library is never: "
            f"an administrator loads it with `{ADMIN_LOAD}` (with this tq-redis version)"
        )
    try:
        yield scripts.load_command()
    except redis.exceptions.NoPermissionError as exc:
        raise LibraryNotLoaded(
            f"the tq-redis function library on Redis at {where} {found}, and this user may not load it "
            f"({exc}): an administrator runs `{ADMIN_LOAD}`; set redis.load_library: never "
            f"({LOAD_LIBRARY_ENV}=never) on clients of a shared Redis"
        ) from exc


# A server busy in a long script answers BUSY to every other command, which then did not run: it is
# sent again after a pause (doubling from BUSY_PAUSE_S up to BUSY_PAUSE_MAX_S) for at most
# BUSY_WAIT_S, then ServerBusy is raised. The client's plans and the registry reader both wait this way.
BUSY_WAIT_S = 10.0
BUSY_PAUSE_S = 0.005
BUSY_PAUSE_MAX_S = 0.25


class BusyWait:
    """The pauses of one command's tries while the server answers BUSY, and when to give up."""

    __slots__ = ("started", "pause")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.pause = BUSY_PAUSE_S

    def next_pause(self, url: str, exc: BaseException) -> float:
        """Seconds to pause before the next try; raises ServerBusy once BUSY_WAIT_S are spent."""
        waited = time.monotonic() - self.started
        if waited >= BUSY_WAIT_S:
            raise busy_error(url, exc, waited) from None
        pause = min(self.pause, BUSY_WAIT_S - waited)
        self.pause = min(self.pause * 2, BUSY_PAUSE_MAX_S)
        return pause
