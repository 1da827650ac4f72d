"""Byte counts read from people and written for them: the one size parser and the one formatter.

:func:`parse_size` reads every size tq-redis takes (config, CLI flags, store options,
``TQ_BUFFER_CACHE``); :func:`format_size` writes every size it prints (status, logs, errors, the
demo's report).
"""

from __future__ import annotations

import re

from tq_redis.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
    "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")
_SIZE_EXAMPLES = "e.g. 4GiB, 512MiB, 512MB or 1048576"


def parse_size(text: str | int, *, allow_zero: bool = False) -> int:
    """A byte count from an int or a number with an optional unit: ``'4GiB'``, ``'512MB'``, ``'1024'``.

    The one size parser of tq-redis (config, CLI flags, store options, ``TQ_BUFFER_CACHE``):

    * IEC units are powers of 1024: ``KiB MiB GiB TiB`` (also ``Ki Mi Gi Ti``);
    * SI units are powers of 1000: ``kB MB GB TB`` and the bare ``k K M G T`` (so ``4G`` is
      4,000,000,000 bytes; write ``4GiB`` for 4 * 2**30);
    * ``B`` or no unit: bytes. Letter case and spaces around the unit are ignored; a fraction is
      rounded down to whole bytes (``1.5KiB`` is 1536).

    The size must be positive (zero too with ``allow_zero``). Raises :class:`ConfigError` naming
    the text and giving examples when it cannot be read.
    """
    if isinstance(text, bool):
        raise ConfigError(f"cannot read size {text!r}: give a byte count or a size, {_SIZE_EXAMPLES}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        unit = m.group(2).lower() if m else None
        try:
            if m is None or unit not in _SIZE_UNITS:
                raise ValueError(text)
            value = int(float(m.group(1)) * _SIZE_UNITS[unit])
        except (ValueError, OverflowError):  # OverflowError: a number too large for a float
            raise ConfigError(
                f"cannot read size {text!r}: write a number with an optional unit, {_SIZE_EXAMPLES} "
                f"(KiB/MiB/GiB/TiB are powers of 1024; kB/MB/GB/TB and k/M/G/T powers of 1000)"
            ) from None
    if value < 0 or (value == 0 and not allow_zero):
        least = "non-negative" if allow_zero else "positive"
        raise ConfigError(f"size {text!r} must be {least}; write {_SIZE_EXAMPLES}")
    return value


def format_size(n: int | float) -> str:
    """A byte count for people, in powers of 1024: ``1536 -> '1.5 KiB'``, ``512 -> '512 B'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
