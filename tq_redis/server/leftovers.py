"""What a SIGKILLed job leaves on its host, found and removed: the embedded server's directories.

:class:`~tq_redis.server.embedded.EmbeddedServer` keeps its socket file, log and AOF in a fresh
``<tmp>/tq-valkey-*`` directory and removes it when it stops; a process killed with SIGKILL cannot
(its server dies with it, the directory stays). Each directory records who uses it in
``owner.json``: the owner's pid and the server's, each with its start time (so a reused pid is not
mistaken for it). A directory is abandoned once neither process runs and no process works in it
(a Valkey server's working directory is its data directory). :func:`remove_abandoned` removes
those of the current user; ``init()`` runs it before starting an embedded server, ``tq-redis up``
at start, and ``tq-redis cleanup`` by hand (``--dry-run`` lists them).

A directory without ``owner.json`` (an older tq-redis, or one being created right now) counts as
abandoned only when it is older than :data:`UNCLAIMED_AGE_S` and no process works in it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

__all__ = ["PREFIX", "abandoned_dirs", "claim", "remove_abandoned"]

PREFIX = "tq-valkey-"
OWNER_FILE = "owner.json"
#: a directory with no owner record is left alone for this long (it may be starting)
UNCLAIMED_AGE_S = 600.0


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot, from /proc), None if none runs
    (a zombie, killed but not reaped yet, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else fields[19]


def claim(directory: str | Path, server_pid: int | None = None) -> None:
    """Record this process (and the server it started) as the users of ``directory``."""
    owner = {"pid": os.getpid(), "start": _start_time(os.getpid())}
    if server_pid is not None:
        owner.update(server_pid=server_pid, server_start=_start_time(server_pid))
    path = Path(directory) / OWNER_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(owner))
    tmp.replace(path)


def _runs(pid: object, start: object) -> bool:
    return isinstance(pid, int) and start is not None and _start_time(pid) == start


def _working_dirs() -> set[str]:
    """The working directories of the processes this user may look at (from /proc)."""
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                found.add(os.readlink(f"/proc/{entry.name}/cwd"))
            except OSError:
                continue
    return found


def _abandoned(directory: Path, now: float, busy: set[str]) -> bool:
    if str(directory) in busy or any(cwd.startswith(f"{directory}/") for cwd in busy):
        return False
    try:
        owner = json.loads((directory / OWNER_FILE).read_text())
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError):
        owner = {}  # unreadable: judged by its processes' absence below, i.e. abandoned
    if owner is not None:
        return not (_runs(owner.get("pid"), owner.get("start")) or
                    _runs(owner.get("server_pid"), owner.get("server_start")))
    try:
        return now - directory.stat().st_mtime > UNCLAIMED_AGE_S
    except OSError:
        return False


def abandoned_dirs(tmp: str | Path | None = None) -> list[Path]:
    """The current user's embedded-server directories in ``tmp`` (the temp dir) that no running
    process uses."""
    base = Path(tmp or tempfile.gettempdir()).resolve()
    now = time.time()
    busy = _working_dirs()
    found = []
    for directory in sorted(base.glob(PREFIX + "*")):
        try:
            mine = directory.is_dir() and not directory.is_symlink() and directory.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and _abandoned(directory, now, busy):
            found.append(directory)
    return found


def remove_abandoned(tmp: str | Path | None = None) -> list[Path]:
    """Remove the abandoned directories (see :func:`abandoned_dirs`); returns those removed."""
    removed = []
    for directory in abandoned_dirs(tmp):
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            removed.append(directory)
    return removed
