"""Every name a user gives tq-redis is checked here, and nowhere else.

Names become parts of Redis keys (see :mod:`tq_redis.meta.keys`), so a name that could break the key
layout, or reach another namespace's or partition's keys, is refused with
:class:`~tq_redis.errors.InvalidName` (a ``ValueError``) that says what is allowed. Nothing a user
names ever reaches a ``SCAN MATCH`` pattern or any other glob: keys are found through registries.

The alphabets:

==============================  ================================================================
name                            allowed
==============================  ================================================================
namespace                       1-128 ASCII letters, digits, ``_``, ``-``, ``.``. It starts every
                                key (``<ns>:...``) and every ACL key pattern (``~<ns>:*``): no
                                ``:`` (namespace ``a`` must not reach the keys of ``a:b``), no glob
                                character, no hash-tag brace.
partition id, field name,       any printable characters except whitespace, ``{`` and ``}``; at
task name, channel name,        most 1024. ``:``, ``/``, ``.``, ``@``, ``*`` and non-ASCII letters
tag name (custom meta key)      are fine (they sit inside or after the partition's ``{...}`` hash
                                tag, so they cannot reach another partition's keys). Partition ids
                                starting with ``__chan__`` are reserved: ``__chan__.<c>`` holds the
                                bytes of channel ``c``'s tensor items. Field and
                                tag names may not hold ``~``: it marks tq-redis's own
                                names (see *Reserved names* below).
KV key                          any non-empty string without control characters (a KV key is a
                                hash field, never part of a key name); at most 65536 characters.
channel queue key               any ``str`` (and, canonicalised, other hashable keys: see
                                :func:`tq_redis.ops.channel_rules.key_token`); it only ends a key name.
==============================  ================================================================

Reserved names: partial rollout (:mod:`tq_redis.ops.partial`) keeps an appended field ``f`` as
hidden fields ``f~0``, ``f~1``, ... (its parts), the per-sample tags ``f~parts`` and ``f~next`` (what
the parts are and the next part index), and ``get_data`` adds the column ``f~version``. A user's
field ``f~0`` would overwrite part 0 of ``f``, a tag ``f~parts`` would break the next append, so
every name holding :data:`RESERVED_MARK` belongs to tq-redis: :func:`field_name` and :func:`tag_name`
refuse it (before anything is written), and reads leave such tags out of ``custom_meta``
(:func:`is_reserved`).

Every validator returns the name unchanged (a plain ``str``) or raises ``InvalidName``.
:data:`VALIDATORS` lists them by kind.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import Any

from tq_redis.errors import InvalidName

#: partition ids with this prefix belong to tq-redis (a channel's hidden data partition)
RESERVED_PARTITION_PREFIX = "__chan__"
CHANNEL_DATA_PREFIX = RESERVED_PARTITION_PREFIX + "."

#: field and tag names holding this character are tq-redis's own (partial rollout's ``<f>~<k>``,
#: ``<f>~parts``, ``<f>~next``, ``<f>~version``): no user field or tag may hold it
RESERVED_MARK = "~"
RESERVED_SUFFIXES = ("~<k>", "~parts", "~next", "~version")

NAMESPACE_MAX = 128
NAME_MAX = 1024
KV_KEY_MAX = 65536

_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-]+")
_NOT_IN_NAME = re.compile(r"[\s{}]")  # with str.isprintable(): what a key-part name may not hold
_NAMESPACE_RULE = f"1-{NAMESPACE_MAX} ASCII letters, digits, '_', '-' or '.' (no ':', no glob characters)"
_NAME_RULE = f"printable characters except whitespace, '{{' and '}}' (at most {NAME_MAX})"
_KV_KEY_RULE = f"a non-empty string without control characters (at most {KV_KEY_MAX})"


def _describe(value: str) -> str:
    """The characters of ``value`` a name may not hold, spelled so they can be seen."""
    bad: list[str] = []
    for ch in value:
        if ch.isspace() or not ch.isprintable():
            label = f"U+{ord(ch):04X} ({unicodedata.name(ch, 'control character')})"
        elif ch in "{}":
            label = repr(ch)
        else:
            continue
        if label not in bad:
            bad.append(label)
    return ", ".join(bad[:4])


def _string(kind: str, value: Any, rule: str) -> str:
    if not isinstance(value, str):
        raise InvalidName(f"{kind} must be a str ({rule}), got {type(value).__name__} {value!r:.80}")
    if not value:
        raise InvalidName(f"{kind} must not be empty; use {rule}")
    return value


def namespace(value: Any, kind: str = "namespace") -> str:
    """A namespace: ASCII letters, digits, ``_``, ``-``, ``.``; 1 to 128 characters."""
    value = _string(kind, value, _NAMESPACE_RULE)
    if len(value) > NAMESPACE_MAX or not _NAMESPACE.fullmatch(value):
        raise InvalidName(f"{kind} {value!r:.160} is not allowed; use {_NAMESPACE_RULE}")
    return value


def key_part(kind: str, value: Any) -> str:
    """A name that becomes part of a key (partition, field, task, channel, tag): printable, no
    whitespace, no ``{``/``}``, at most 1024 characters."""
    value = _string(kind, value, _NAME_RULE)
    if len(value) > NAME_MAX:
        raise InvalidName(f"{kind} is {len(value)} characters long; use {_NAME_RULE}")
    if _NOT_IN_NAME.search(value) or not value.isprintable():
        raise InvalidName(f"{kind} {value!r:.160} contains {_describe(value)}; use {_NAME_RULE}")
    return value


def partition_id(value: Any, kind: str = "partition_id") -> str:
    """A user's partition id (see :func:`key_part`); ids starting with ``__chan__`` are reserved."""
    value = key_part(kind, value)
    if value.startswith(RESERVED_PARTITION_PREFIX):
        raise InvalidName(
            f"{kind} {value!r:.160} starts with {RESERVED_PARTITION_PREFIX!r}, which is reserved for "
            f"channels' data; choose another partition id"
        )
    return value


def channel_data_partition(channel: str) -> str:
    """The hidden partition holding the bytes of channel ``channel``'s tensor items."""
    return CHANNEL_DATA_PREFIX + channel_name(channel)


def internal_partition_id(value: Any) -> str:
    """A partition id tq-redis itself uses: a user's one, or a channel's hidden data partition."""
    if isinstance(value, str) and value.startswith(CHANNEL_DATA_PREFIX):
        return CHANNEL_DATA_PREFIX + channel_name(value[len(CHANNEL_DATA_PREFIX) :])
    return partition_id(value)


def is_reserved(name: str) -> bool:
    """Whether field or tag ``name`` is one of tq-redis's own (it holds :data:`RESERVED_MARK`)."""
    return RESERVED_MARK in name


def _not_reserved(kind: str, value: str) -> str:
    if RESERVED_MARK in value:
        forms = ", ".join(f"'<field>{s}'" for s in RESERVED_SUFFIXES)
        raise InvalidName(
            f"{kind} {value!r:.160} contains {RESERVED_MARK!r}, which is reserved: tq-redis names an appended "
            f"field's parts, tags and version column {forms}; choose a {kind} without {RESERVED_MARK!r}"
        )
    return value


def field_name(value: Any, kind: str = "field name") -> str:
    """A field name (see :func:`key_part`), without :data:`RESERVED_MARK`."""
    return _not_reserved(kind, key_part(kind, value))


def task_name(value: Any, kind: str = "task_name") -> str:
    """A consumer task name (see :func:`key_part`)."""
    return key_part(kind, value)


def channel_name(value: Any, kind: str = "channel name") -> str:
    """A channel name (see :func:`key_part`)."""
    return key_part(kind, value)


def tag_name(value: Any, kind: str = "tag name") -> str:
    """A per-sample tag (custom meta) name (see :func:`key_part`), without :data:`RESERVED_MARK`."""
    return _not_reserved(kind, key_part(kind, value))


def kv_key(value: Any, kind: str = "KV key") -> str:
    """A KV API key: any non-empty string without control characters."""
    value = _string(kind, value, _KV_KEY_RULE)
    if len(value) > KV_KEY_MAX:
        raise InvalidName(f"{kind} is {len(value)} characters long; use {_KV_KEY_RULE}")
    if not value.isprintable() and any(unicodedata.category(ch) == "Cc" for ch in value):
        bad = ", ".join(dict.fromkeys(f"U+{ord(ch):04X}" for ch in value if unicodedata.category(ch) == "Cc"))
        raise InvalidName(f"{kind} {value!r:.160} contains control characters ({bad}); use {_KV_KEY_RULE}")
    return value


#: every validator, by the kind of name it checks (each also takes ``kind=``: the name errors use)
VALIDATORS: dict[str, Callable[..., str]] = {
    "namespace": namespace,
    "partition_id": partition_id,
    "field name": field_name,
    "task_name": task_name,
    "channel name": channel_name,
    "tag name": tag_name,
    "KV key": kv_key,
}

_ALIASES = {"custom meta key": "tag name", "task name": "task_name", "partition id": "partition_id",
            "field": "field name", "key": "KV key"}


def check(kind: str, value: Any) -> str:
    """Validate ``value`` as a name of ``kind`` (a key of :data:`VALIDATORS`, or an alias such as
    ``"custom meta key"``, named so in errors); any other kind is checked as a key part."""
    validator = VALIDATORS.get(_ALIASES.get(kind, kind))
    if validator is None:
        return key_part(kind, value)
    return validator(value, kind)
