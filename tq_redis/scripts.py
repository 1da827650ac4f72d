"""Builds the Lua function library from ``lua/`` and loads it into Redis.

Each ``lua/<name>.lua`` holds one state transition as ``local function <name>(KEYS, ARGV)``,
with a header comment that is its contract; ``lua/includes/*.lua`` hold the shared helpers. The
builder concatenates the includes and the scripts into one Redis Function library
(``#!lua name=tq_redis``), registers each script as ``tq_<name>`` and adds ``tq_version``, which
returns a hash of the source so a client can tell whether the loaded library is its own.
Clients call :func:`ensure_loaded` once per connection pool; a missing function (``SCRIPT
FLUSH``/``FUNCTION FLUSH``, a restarted server without persistence) triggers a reload.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import resources

LIBRARY_NAME = "tq_redis"
# Includes that others build on come first; any other include follows in name order.
INCLUDE_ORDER = ("bits", "partition", "ready")


def _lua_dir():
    return resources.files("tq_redis.lua")


def _names(folder) -> list[str]:
    return sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".lua"))


def includes() -> list[str]:
    """Include names in load order."""
    found = _names(_lua_dir().joinpath("includes"))
    return [n for n in INCLUDE_ORDER if n in found] + [n for n in found if n not in INCLUDE_ORDER]


def script_names() -> list[str]:
    """One name per transition: ``lua/<name>.lua`` defines ``local function <name>``."""
    return _names(_lua_dir())


@lru_cache(maxsize=1)
def library() -> tuple[str, str]:
    """Return ``(source, version)`` of the function library."""
    root = _lua_dir()
    parts = [root.joinpath("includes", f"{name}.lua").read_text(encoding="utf-8") for name in includes()]
    parts += [root.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in script_names()]
    body = "\n".join(parts)
    version = hashlib.sha1(body.encode()).hexdigest()[:16]
    registrations = [f"redis.register_function('tq_{name}', {name})" for name in script_names()]
    registrations.append(f"redis.register_function('tq_version', function() return '{version}' end)")
    source = f"#!lua name={LIBRARY_NAME}\n{body}\n" + "\n".join(registrations) + "\n"
    return source, version


def is_missing_function(exc: BaseException) -> bool:
    """True when a Redis error means our function library is not (or no longer) loaded."""
    text = str(exc).lower()
    return "function not found" in text or "no such function" in text or "unknown function" in text
