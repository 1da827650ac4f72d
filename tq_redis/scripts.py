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
INCLUDES = ("bits", "partition", "ready")
SCRIPTS = (
    "reserve",
    "insert",
    "produce",
    "claim",
    "settle",
    "clear",
    "drop_partition",
    "reset_consumption",
    "set_tags",
)


def _read(relative: str) -> str:
    return resources.files("tq_redis.lua").joinpath(relative).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def library() -> tuple[str, str]:
    """Return ``(source, version)`` of the function library."""
    parts = [_read(f"includes/{name}.lua") for name in INCLUDES]
    parts += [_read(f"{name}.lua") for name in SCRIPTS]
    body = "\n".join(parts)
    version = hashlib.sha1(body.encode()).hexdigest()[:16]
    registrations = [f"redis.register_function('tq_{name}', {name})" for name in SCRIPTS]
    registrations.append(f"redis.register_function('tq_version', function() return '{version}' end)")
    source = f"#!lua name={LIBRARY_NAME}\n{body}\n" + "\n".join(registrations) + "\n"
    return source, version


def is_missing_function(exc: BaseException) -> bool:
    """True when a Redis error means our function library is not (or no longer) loaded."""
    text = str(exc).lower()
    return "function not found" in text or "no such function" in text or "unknown function" in text
