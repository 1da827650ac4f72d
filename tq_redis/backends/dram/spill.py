"""The storage node's spill tier: where values go when its memory budget is used up.

A node started with ``--spill URL`` (any fsspec URL: a local directory, ``s3://bucket/prefix``,
...) writes a put that does not fit its ``--capacity`` to files under
``URL/<node id>-<instance>/`` instead of refusing it with ``StorageFull``. The values stay
owned by the node: it serves them on ``get`` (inline on the socket, also to same-host clients),
removes each file on ``delete`` or overwrite, and removes its whole directory when it exits,
since a restarted node has lost its memory and starts empty (spilled values included). A node
that was killed (SIGKILL) cannot clean up: the next run with the same node id removes what it
left.

Spilled values are not moved back into memory when memory frees up; they live on the tier until
deleted. Files are named by a number the node allocates, never by the key, so no key can escape
the directory.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Iterator
from typing import Any

from tq_redis.errors import BackendNotInstalled, ConfigError
from tq_redis.redact import redact

log = logging.getLogger(__name__)

__all__ = ["SpillTier"]

#: how long :meth:`SpillTier.close` waits for reads and writes still running
CLOSE_WAIT_S = 30.0


class SpillTier:
    """One node's directory on an fsspec filesystem; thread-safe, :meth:`close` included."""

    def __init__(self, url: str, owner: str, storage_options: dict[str, Any] | None = None) -> None:
        try:
            import fsspec  # the [s3] extra: a node without --spill does not need it
        except ImportError as exc:
            raise BackendNotInstalled(
                f"--spill needs fsspec ({exc}); install it with: pip install 'tq-redis[s3]'"
            ) from None
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"--spill {redact(url)!r}: {exc}") from None
        self.url = url
        self.fs = fs
        self.root = f"{root.rstrip('/')}/{owner}"
        try:
            self._drop_stale(fs, root.rstrip("/"), owner)
            fs.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--spill {redact(url)!r}: cannot create {self.root!r} there: {exc}") from None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = 0  # reads / writes / removals in progress
        self._closed = False
        self.files = 0
        self.bytes = 0

    @staticmethod
    def _drop_stale(fs: Any, root: str, owner: str) -> None:
        """Remove directories an earlier run of this node left (it was killed before cleaning up):
        their values went with that run's memory index, so nothing can reach them any more."""
        node_part = owner.rsplit("-", 1)[0]
        try:
            found = fs.ls(root, detail=False)
        except FileNotFoundError:
            return
        for path in found:
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name != owner and name.rsplit("-", 1)[0] == node_part:
                log.info("removing %s, left by an earlier run of this storage node", path)
                fs.rm(path, recursive=True)

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """One file operation; refused (``OSError``) once :meth:`close` has begun."""
        with self._lock:
            if self._closed:
                raise OSError(f"the spill tier {self.root!r} is closed: the storage node is stopping")
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
                    self._idle.notify_all()

    def new_ids(self, n: int) -> list[int]:
        """``n`` fresh file ids."""
        with self._lock:
            return [next(self._ids) for _ in range(n)]

    def _path(self, file_id: int) -> str:
        return f"{self.root}/{file_id}"

    def write(self, file_id: int, data: Any) -> None:
        """Write one value; raises ``OSError`` when the tier refuses it (full, gone, ...)."""
        with self._using(), self.fs.open(self._path(file_id), "wb") as f:
            f.write(data)
        with self._lock:
            self.files += 1
            self.bytes += memoryview(data).nbytes

    def read(self, file_id: int) -> bytes:
        """One value's bytes; raises ``OSError`` when the file cannot be read."""
        with self._using():
            return self.fs.cat_file(self._path(file_id))

    def remove(self, files: list[tuple[int, int]]) -> None:
        """Remove ``(file id, length)`` files; one that is already gone is not an error."""
        for file_id, length in files:
            try:
                with self._using():
                    self.fs.rm_file(self._path(file_id))
            except FileNotFoundError:
                continue
            except OSError as exc:  # still owned by us: the directory goes when the node exits
                if not self._closed:
                    log.warning("could not remove spilled value %s: %s", self._path(file_id), exc)
                continue
            with self._lock:
                self.files -= 1
                self.bytes -= length

    def close(self) -> None:
        """Remove the node's whole directory (its values die with the node's memory).

        Operations still running finish first and later ones are refused, so no file can be
        written into (or removed from) the directory while it is being removed.
        """
        with self._lock:
            self._closed = True
            if not self._idle.wait_for(lambda: not self._running, CLOSE_WAIT_S):
                log.warning("spill tier %s: %d operation(s) still running after %.0f s; removing it anyway",
                            self.root, self._running, CLOSE_WAIT_S)  # fmt: skip
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.root, recursive=True)
