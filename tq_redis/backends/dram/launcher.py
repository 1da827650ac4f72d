"""Spawning DRAM storage-node processes from Python: ``tq-redis up``, ``init()`` without a URL, tests.

:func:`spawn_node` starts one node and returns once it has registered in Redis (it reports on a
readiness pipe); :func:`start_local_nodes` starts several in parallel. Each node also watches a
pipe to the process that spawned it and stops by itself when that process dies. The node runs
:func:`tq_redis.backends.dram.server.main` in a fresh interpreter; this module imports nothing of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tq_redis.errors import StorageUnavailable

__all__ = ["LocalNodes", "NodeProcess", "spawn_node", "start_local_nodes"]


@dataclass
class NodeProcess:
    """A spawned node process and its registration."""

    proc: subprocess.Popen
    info: dict[str, Any]
    parent_fd: int
    log_file: Any
    signalled: int | None = None  # the signal already sent

    @property
    def address(self) -> str:
        """``host:port`` that clients dial."""
        return self.info["address"]

    @property
    def node_id(self) -> str:
        """The node's id in the registry."""
        return self.info["node_id"]

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` unless the process has exited or was sent it already.

        Never twice: a node handles the first SIGTERM by shutting down, and a second one that
        arrives as its interpreter exits (signal handlers are gone by then) would kill it.
        """
        if self.signalled != sig and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            self.signalled = sig

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int:
        """Signal the process (SIGTERM: clean exit) and wait for it; SIGKILL after ``timeout``.

        A node that exits after SIGTERM has finished the requests it was serving, deregistered,
        freed its memory and removed its spill directory.
        """
        self.send_signal(sig)
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.parent_fd >= 0:
            os.close(self.parent_fd)
            self.parent_fd = -1
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None
        return self.proc.returncode


def _log_tail(f: Any) -> str:
    try:
        f.seek(0)
        return f.read().decode(errors="replace")[-2000:]
    except (OSError, ValueError):
        return ""


# Runs the node without executing ``tq_redis/__init__`` (which imports torch: seconds per node).
_BOOT = (
    "import importlib.util, sys, types\n"
    "spec = importlib.util.find_spec('tq_redis')\n"
    "pkg = types.ModuleType('tq_redis')\n"
    "pkg.__path__ = list(spec.submodule_search_locations)\n"
    "pkg.__spec__ = spec\n"
    "sys.modules['tq_redis'] = pkg\n"
    "from tq_redis.backends.dram.server import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _launch(
    redis_url: str,
    namespace: str,
    *,
    listen: str,
    capacity: str,
    token: str | None,
    node_id: str | None,
    shm: bool,
    extra_args: Sequence[str],
    log_level: str,
) -> tuple[NodeProcess, int]:
    """Start a node process; returns it with the read end of its readiness pipe."""
    ready_r, ready_w = os.pipe()
    watch_r, watch_w = os.pipe()
    args = [
        sys.executable, "-c", _BOOT,
        "--namespace", namespace, "--listen", listen, "--capacity", str(capacity),
        "--ready-fd", str(ready_w), "--parent-fd", str(watch_r), "--log-level", log_level,
        "--shm" if shm else "--no-shm", *extra_args,
    ]  # fmt: skip
    if node_id:
        args += ["--node-id", node_id]
    # the URL (it may hold a password) and the token go in the environment, which only the node's
    # user can read, not on the command line, which every user of the host can (/proc/PID/cmdline)
    env = dict(os.environ, TQ_REDIS_URL=redis_url)
    if token is not None:
        env["TQ_STORAGE_TOKEN"] = token  # not on the command line, where `ps` would show it
    else:
        env.pop("TQ_STORAGE_TOKEN", None)
    log_file = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(
            args, pass_fds=(ready_w, watch_r), stdin=subprocess.DEVNULL, stdout=log_file,
            stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    except BaseException:
        for fd in (ready_r, watch_w):
            os.close(fd)
        log_file.close()
        raise
    finally:
        os.close(ready_w)
        os.close(watch_r)
    return NodeProcess(proc, {}, watch_w, log_file), ready_r


def _await_ready(node: NodeProcess, ready_r: int, deadline: float) -> None:
    """Wait for the node's registration line on its readiness pipe (closes the pipe)."""
    try:
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([ready_r], [], [], left)[0]:
                raise StorageUnavailable(
                    f"storage node did not register in time:\n{_log_tail(node.log_file)}"
                )
            chunk = os.read(ready_r, 65536)
            if not chunk:
                node.proc.wait()
                raise StorageUnavailable(
                    f"storage node exited with status {node.proc.returncode} before registering:\n"
                    f"{_log_tail(node.log_file)}"
                )
            line += chunk
        node.info = json.loads(line)
    finally:
        os.close(ready_r)


def spawn_node(
    redis_url: str,
    namespace: str,
    *,
    listen: str = "127.0.0.1:0",
    capacity: str = "2GiB",
    token: str | None = None,
    node_id: str | None = None,
    shm: bool = True,
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
    log_level: str = "WARNING",
) -> NodeProcess:
    """Start one node process and return once it is registered (it signals readiness on a pipe)."""
    node, ready_r = _launch(
        redis_url, namespace, listen=listen, capacity=capacity, token=token, node_id=node_id,
        shm=shm, extra_args=extra_args, log_level=log_level,
    )  # fmt: skip
    try:
        _await_ready(node, ready_r, time.monotonic() + timeout)
    except BaseException:
        node.stop(timeout=5, sig=signal.SIGKILL)
        raise
    return node


class LocalNodes:
    """Handle on storage-node processes spawned by :func:`start_local_nodes`."""

    def __init__(self, nodes: list[NodeProcess]) -> None:
        self.nodes = nodes

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    @property
    def node_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    @property
    def pids(self) -> list[int]:
        return [n.proc.pid for n in self.nodes]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node cleanly (SIGTERM; SIGKILL after ``timeout``) and wait for them."""
        for n in self.nodes:  # all at once, so they shut down in parallel
            n.send_signal(signal.SIGTERM)
        for n in self.nodes:
            n.stop(timeout)

    def __enter__(self) -> LocalNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local_nodes(
    redis_url: str,
    namespace: str,
    n: int = 2,
    capacity: str = "2GiB",
    token: str | None = None,
    *,
    host: str = "127.0.0.1",
    shm: bool = True,
    timeout: float = 30.0,
    spill: str | None = None,
) -> LocalNodes:
    """Spawn ``n`` storage-node processes on ``host`` (ephemeral ports) and wait until all registered.

    The nodes also stop by themselves if this process dies. Call ``.stop()`` (or use the handle as a
    context manager) to shut them down. ``spill`` is an fsspec URL for values beyond ``capacity``
    (each node uses its own directory under it; see :mod:`tq_redis.backends.dram.spill`).
    """
    launched: list[tuple[NodeProcess, int]] = []
    waited = 0
    try:
        for _ in range(n):
            launched.append(
                _launch(
                    redis_url, namespace, listen=f"{host}:0", capacity=capacity, token=token,
                    node_id=None, shm=shm, extra_args=("--spill", spill) if spill else (), log_level="WARNING",
                )
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        for node, ready_r in launched:  # they start in parallel; collect each readiness in turn
            waited += 1  # _await_ready closes the pipe whatever happens
            _await_ready(node, ready_r, deadline)
    except BaseException:
        for _node, ready_r in launched[waited:]:
            os.close(ready_r)
        LocalNodes([nd for nd, _r in launched]).stop(timeout=5)
        raise
    return LocalNodes([nd for nd, _r in launched])
