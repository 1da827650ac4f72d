"""``repr`` of the public objects, safe on a half-built one.

A constructor that raises leaves an object without some of its attributes; Ray (and a debugger,
and a log line) still calls ``repr`` on it, and a ``repr`` that raises ``AttributeError`` then hides
the constructor's real error behind "unexpected internal error". :func:`attrs_repr` shows the
attributes an object has and leaves out the ones it does not have yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_MISSING = object()


def attrs_repr(obj: Any, names: Iterable[str], *, shown: dict[str, str] | None = None) -> str:
    """``Type(name=value, ...)`` over ``names`` that ``obj`` has; ``shown`` renames an attribute
    (``{"_maxsize": "maxsize"}``). Never raises: an attribute whose own ``repr`` fails shows as
    ``<unprintable>``, and an object with none of them shows as ``Type(<not initialized>)``."""
    shown = shown or {}
    parts = []
    for name in names:
        try:
            value = object.__getattribute__(obj, name)
        except Exception:  # noqa: BLE001 - not set yet (or a property that cannot answer yet)
            continue
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001 - a repr must not fail because a member's repr does
            text = "<unprintable>"
        parts.append(f"{shown.get(name, name.lstrip('_'))}={text}")
    return f"{type(obj).__name__}({', '.join(parts) if parts else '<not initialized>'})"
