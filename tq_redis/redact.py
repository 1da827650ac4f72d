"""Secrets kept out of what tq-redis prints: a URL's password becomes ``***``.

Every URL that goes into a message, an exception, a log line or a metric passes through
:func:`redact` first. A Redis URL carries its password (``redis://user:PASSWORD@host/0``,
``unix://:PASSWORD@/path.sock``, a Sentinel's ``?sentinel_password=...``), and so may an fsspec URL.
A storage node's registration carries its access key, which :func:`public_registration` leaves out.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["REGISTRATION_SECRETS", "public_registration", "redact"]


def redact(url: Any) -> str:
    """``url`` with its password (and any ``...password=`` query value) replaced by ``***``."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}, not a URL>"
    try:
        parts = urlsplit(url)
        password = parts.password
    except (TypeError, ValueError):
        return "<unreadable URL>"
    if not password and "password" not in parts.query:
        return url  # as given: urlunsplit would write unix:///path as unix:/path
    if parts.query and "password" in parts.query:  # a Sentinel's own login: ?sentinel_password=...
        query = "&".join(
            f"{k}=***" if k.endswith("password") else f"{k}={v}" if sep else k
            for k, sep, v in (item.partition("=") for item in parts.query.split("&"))
        )
        parts = parts._replace(query=query)
    if not password:
        return urlunsplit(parts)
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


#: the fields of a storage node's registration (``<ns>:storage:nodes``) that are secrets: its access key
REGISTRATION_SECRETS = frozenset({"access"})


def public_registration(info: dict[str, Any]) -> dict[str, Any]:
    """A storage node's registration without its secrets (what ``status``, metrics and ``nodes()`` show)."""
    return {k: v for k, v in info.items() if k not in REGISTRATION_SECRETS}
