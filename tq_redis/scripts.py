"""Builds the Lua function library from ``lua/`` and loads it into Redis.

Each ``lua/<name>.lua`` holds one state transition as ``local function <name>(KEYS, ARGV)``,
with a header comment that is its contract (``Input:``, ``Output:``, and ``Touches:``: every key
kind it reads or writes, ``<p>:`` standing for the partition prefix ``<ns>:{<p>}:`` and ``<c>:``
for a channel's). ``lua/includes/<name>.lua`` hold the shared helpers, each with a header saying
what it ``Offers:``. A script or include names the includes it uses with ``-- @include <name>``
lines below its header; :func:`include_order` resolves them transitively, so each include is
loaded once and after the includes it depends on.

The builder concatenates the resolved includes and the scripts into one Redis Function library
(``#!lua name=tq_redis``), registers each script as ``tq_<name>`` and adds ``tq_version``, which
returns a hash of the source so a client can tell whether the loaded library is its own.
The driver (``tq_redis/driver.py``, ``ensure_loaded``) checks the version once per server and
driver -- on a Redis Cluster on every primary at first use, and on a primary it has not met before
(a new one after a failover) before its first call there -- and loads the library where it is
missing or older. A call that finds no function (``FUNCTION FLUSH``, a restarted server without
persistence) reloads it on the node that answered and is retried once.

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

from tq_redis.errors import TQError

LIBRARY_NAME = "tq_redis"
INCLUDE_LINE = re.compile(r"^--\s*@include\s+(\S+)\s*$", re.MULTILINE)


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
    order = include_order(
        {name: declared_includes(text) for name, text in scripts.items()},
        {name: declared_includes(text) for name, text in found.items()},
    )
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
    version = hashlib.sha1(body.encode()).hexdigest()[:16]
    registrations = [f"redis.register_function('tq_{name}', {name})" for name in sorted(scripts)]
    registrations.append(f"redis.register_function('tq_version', function() return '{version}' end)")
    source = f"#!lua name={LIBRARY_NAME}\n{body}\n" + "\n".join(registrations) + "\n"
    return source, version


def is_missing_function(exc: BaseException) -> bool:
    """True when a Redis error means our function library is not (or no longer) loaded."""
    text = str(exc).lower()
    return "function not found" in text or "no such function" in text or "unknown function" in text
