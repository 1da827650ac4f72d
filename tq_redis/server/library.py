"""Builds the Lua function library from ``lua/`` and loads it into Redis.

Each ``lua/<name>.lua`` holds one state transition as ``local function <name>(KEYS, ARGV)``,
with a header comment that is its contract (``Input:``, ``Output:``, and ``Touches:``: every key
kind it reads or writes, ``<p>:`` standing for the partition prefix ``<ns>:{<ns>/<p>}:`` and ``<c>:``
for a channel's). ``lua/includes/<name>.lua`` hold the shared helpers, each with a header saying
what it ``Offers:``. A script or include names the includes it uses with ``-- @include <name>``
lines below its header; :func:`include_order` resolves them transitively, so each include is
loaded once and after the includes it depends on.

The builder concatenates the resolved includes and the scripts into one Redis Function library
(``#!lua name=tq_redis``), registers each script as ``tq_<name>`` and adds ``tq_version``, which
returns a hash of the source. A script whose header has a ``Flags:`` section is registered with
those Redis function flags (one per line, its reason after it): ``allow-oom`` on the scripts that
only delete or shrink (the clear path), so clearing still frees memory when Redis is full.

Every script that is not ``no-writes`` is registered through ``recorded`` (``lua/includes/requests.lua``):
a call may pass, as its last key, a request record ``<prefix of KEYS[1]>rq:<request id>``; the
first run records its reply there for two minutes and a retry with the same key gets that reply
instead of running again. The client passes one for every call of a script outside :data:`UNRECORDED`
(:func:`records`, :func:`record_key`); the retry rule is written down in ``tq_redis/client/plans.py``.

Whether a server runs *this* library is decided from its code, not from what ``tq_version``
answers (any user allowed to ``FUNCTION LOAD`` could load a library whose ``tq_version`` lies):
``FUNCTION LIST LIBRARYNAME tq_redis WITHCODE`` must return exactly :func:`library`'s source
(:func:`library_state`). The driver (``tq_redis/client/plans.py``, ``_ensure_loaded``, through
:func:`tq_redis.server.policy.node_checks`) checks this once per server and driver -- on a Redis
Cluster on every primary at first use, and on a primary it has not met before (a new one after a
failover) before its first call there -- and, with ``redis.load_library: auto`` (the default),
loads the library where it is missing or differs; with ``never`` it raises
:class:`~tq_redis.errors.LibraryNotLoaded` naming the admin command ``tq-redis load-library``
(:func:`load_everywhere`). A call that finds no function (``FUNCTION FLUSH``, a restarted server
without persistence) reloads it on the node that answered and is retried once.

Every script derives all its keys from ``KEYS[1]`` (its partition's or channel's ``meta`` key) by
cutting off ``meta``: the prefix keeps the ``{...}`` hash tag, so on a cluster a script touches a
single slot (``tests/unit/test_scripts.py`` checks this statically; the cluster tests run every
script on a cluster, which refuses a cross-slot access).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from importlib import resources
from typing import Any

from tq_redis.errors import TQError

LIBRARY_NAME = "tq_redis"
INCLUDE_LINE = re.compile(r"^--\s*@include\s+(\S+)\s*$", re.MULTILINE)
#: a header's ``Flags:`` section: the lines indented below it, up to the next section or the end
FLAGS_SECTION = re.compile(r"^([ \t]*)Flags:[ \t]*\n((?:\1[ \t]+\S.*\n?)+)", re.MULTILINE)
#: the Redis function flags a script may declare
KNOWN_FLAGS = frozenset({"allow-oom", "no-writes", "allow-stale", "no-cluster", "allow-cross-slot-keys"})
#: the include whose ``recorded`` wraps every script that writes (see the module docstring)
RECORD_INCLUDE = "requests"
#: scripts the client calls without a request record: they only read (``progress`` and ``ready_ids``
#: also drop what has expired, which a second run does the same way), so running one twice is harmless
UNRECORDED = frozenset({
    "check_visible", "kv_list", "part_read", "progress", "read_inline", "read_registry", "ready_ids", "tag_changes",
})


class IncludeError(TQError, ValueError):
    """An ``-- @include`` names no file in ``lua/includes/``, or includes include each other."""


def _lua_dir():
    return resources.files("tq_redis.lua")


def _names(folder) -> list[str]:
    return sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".lua"))


def declared_includes(source: str) -> list[str]:
    """The include names a Lua source declares with ``-- @include <name>`` lines, in order."""
    return INCLUDE_LINE.findall(source)


def include_order(wanted: Mapping[str, Sequence[str]], available: Mapping[str, Sequence[str]]) -> list[str]:
    """Order the includes the scripts need: each once, every include after those it includes.

    ``wanted`` maps a script name to the includes it declares; ``available`` maps every include
    name to the includes it declares itself. Scripts are visited in name order and each one's
    includes in declared order, so the result is deterministic. Raises :class:`IncludeError`
    naming the declaring file for an include that does not exist, and the whole loop for a cycle.
    """
    order: list[str] = []
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str, declared_by: str) -> None:
        if name in done:
            return
        if name in path:
            loop = " -> ".join([*path[path.index(name) :], name])
            raise IncludeError(f"include cycle: {loop}; an include must not (even indirectly) include itself")
        if name not in available:
            known = ", ".join(sorted(available)) or "none"
            raise IncludeError(
                f"{declared_by} has '-- @include {name}' but there is no lua/includes/{name}.lua "
                f"(known includes: {known})"
            )
        path.append(name)
        for dep in available[name]:
            visit(dep, f"lua/includes/{name}.lua")
        path.pop()
        done.add(name)
        order.append(name)

    for script in sorted(wanted):
        for name in wanted[script]:
            visit(name, f"lua/{script}.lua")
    return order


def script_names() -> list[str]:
    """One name per transition: ``lua/<name>.lua`` defines ``local function <name>``."""
    return _names(_lua_dir())


def _sources() -> tuple[dict[str, str], dict[str, str]]:
    """``(scripts, includes)``: name -> source text of every ``lua/*.lua`` and ``lua/includes/*.lua``."""
    root = _lua_dir()
    scripts = {name: root.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in script_names()}
    folder = root.joinpath("includes")
    found = {name: folder.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in _names(folder)}
    return scripts, found


def include_graph() -> dict[str, list[str]]:
    """Every script and include (includes as ``includes/<name>``) -> the includes it declares."""
    scripts, found = _sources()
    graph = {name: declared_includes(text) for name, text in scripts.items()}
    graph.update({f"includes/{name}": declared_includes(text) for name, text in found.items()})
    return graph


def _resolved() -> tuple[dict[str, str], dict[str, str], list[str]]:
    """``(scripts, includes, load order of the includes)``."""
    scripts, found = _sources()
    wanted = {name: declared_includes(text) for name, text in scripts.items()}
    wanted["(registrations)"] = [RECORD_INCLUDE]  # every registration of a script that writes uses it
    order = include_order(wanted, {name: declared_includes(text) for name, text in found.items()})
    return scripts, found, order


def includes() -> list[str]:
    """Include names in load order (only those some script needs, directly or not)."""
    return _resolved()[2]


@lru_cache(maxsize=1)
def library() -> tuple[str, str]:
    """Return ``(source, version)`` of the function library.

    Raises :class:`IncludeError` when an ``-- @include`` cannot be resolved.
    """
    scripts, found, order = _resolved()
    parts = [found[name] for name in order] + [scripts[name] for name in sorted(scripts)]
    body = "\n".join(parts)
    registrations = [_registration(name, declared_flags(scripts[name], name)) for name in sorted(scripts)]
    text = f"{body}\n" + "\n".join(registrations)
    version = hashlib.sha1(text.encode()).hexdigest()[:16]
    source = (
        f"#!lua name={LIBRARY_NAME}\n{text}\n"
        f"redis.register_function('tq_version', function() return '{version}' end)\n"
    )
    return source, version


def declared_flags(source: str, name: str = "script") -> list[str]:
    """The Redis function flags a script's header declares in its ``Flags:`` section (first word of
    each line below it). Raises :class:`IncludeError` for a flag Redis does not know."""
    m = FLAGS_SECTION.search(source.split("]]", 1)[0] + "\n")
    if m is None:
        return []
    flags = [line.split()[0] for line in m.group(2).splitlines() if line.strip()]
    unknown = sorted(set(flags) - KNOWN_FLAGS)
    if unknown:
        raise IncludeError(f"lua/{name}.lua declares unknown function flag(s) {unknown}; known: {sorted(KNOWN_FLAGS)}")
    return flags


#: scripts whose reply is recorded only when the Lua rule named here holds (``lua/includes/requests.lua``):
#: a claim that handed nothing out may run again, so it costs no record write
RECORD_WHEN = {"claim": "request_records.handed_out"}


def _registration(name: str, flags: Sequence[str]) -> str:
    # a script that writes runs through `recorded`, which answers a retried request from its record
    keep = f", {RECORD_WHEN[name]}" if name in RECORD_WHEN else ""
    callback = name if "no-writes" in flags else f"function(KEYS, ARGV) return recorded({name}, KEYS, ARGV{keep}) end"
    if not flags:
        return f"redis.register_function('tq_{name}', {callback})"
    listed = ", ".join(f"'{f}'" for f in flags)
    return f"redis.register_function{{function_name='tq_{name}', callback={callback}, flags={{{listed}}}}}"


def records(name: str) -> bool:
    """Whether the client passes a request record to script ``name`` (every script not in :data:`UNRECORDED`)."""
    return name not in UNRECORDED


def record_key(first_key: str, request_id: str) -> str:
    """The request record of a call whose ``KEYS[1]`` is ``first_key`` (a ``...meta`` key): same prefix,
    so same hash slot and namespace, ``rq:<request_id>`` in place of ``meta``."""
    return f"{first_key[:-4]}rq:{request_id}"


def function_flags() -> dict[str, list[str]]:
    """Registered function name (``tq_<script>``) -> the flags it is registered with (only flagged ones)."""
    scripts, _, _ = _resolved()
    found = {f"tq_{name}": declared_flags(text, name) for name, text in scripts.items()}
    return {name: flags for name, flags in found.items() if flags}


def source_digest(code: str | bytes) -> str:
    """A digest of a library's code, to compare what a server runs with :func:`library`."""
    raw = code.encode() if isinstance(code, str) else bytes(code)
    return hashlib.sha256(raw).hexdigest()


def _as_dict(entry: Any) -> dict[str, Any]:
    """One ``FUNCTION LIST`` entry as a dict with str keys (RESP2 gives a flat list of pairs)."""
    if isinstance(entry, Mapping):
        items = list(entry.items())
    elif isinstance(entry, list | tuple):
        items = list(zip(entry[::2], entry[1::2]))
    else:
        return {}
    return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in items}


def library_state(reply: Any) -> str:
    """What ``FUNCTION LIST LIBRARYNAME tq_redis WITHCODE`` says a server runs:

    ``"current"`` (exactly this client's :func:`library` source), ``"missing"`` (no ``tq_redis``
    library) or ``"foreign"`` (a ``tq_redis`` library with any other code: another tq-redis
    version, or a library someone else loaded under our name).
    """
    expected = source_digest(library()[0])
    state = "missing"
    for entry in reply or []:
        info = _as_dict(entry)
        name = info.get("library_name")
        if (name.decode() if isinstance(name, bytes) else name) != LIBRARY_NAME:
            continue
        code = info.get("library_code")
        if code is not None and source_digest(code) == expected:
            return "current"
        state = "foreign"
    return state


def list_command() -> tuple[str, ...]:
    """The command that returns our library's code on a server (see :func:`library_state`)."""
    return ("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY_NAME, "WITHCODE")


def load_command() -> tuple[str, ...]:
    """The command that loads (or replaces) our library on a server: an admin step on a shared Redis."""
    return ("FUNCTION", "LOAD", "REPLACE", library()[0])


def load_everywhere(client: Any) -> list[str]:
    """Load the library on every primary of ``client`` (a cluster's, or the one server): what
    ``tq-redis load-library`` does. Returns the nodes loaded (``host:port``; the URL's server as
    ``""``). Redis errors (``NOPERM`` for a user that may not ``FUNCTION LOAD``) propagate."""
    from tq_redis.server.connections import is_cluster_client

    if not is_cluster_client(client):
        client.execute_command(*load_command())
        return [""]
    done = []
    for node in client.get_primaries():
        client.execute_command(*load_command(), target_nodes=node)
        done.append(node.name)
    return done


def is_missing_function(exc: BaseException) -> bool:
    """True when a Redis error means our function library is not (or no longer) loaded."""
    text = str(exc).lower()
    return "function not found" in text or "no such function" in text or "unknown function" in text
