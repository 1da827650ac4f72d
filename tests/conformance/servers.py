"""Local servers of the Mooncake and Yuanrong stores, for the conformance suite (loopback, free ports).

* **Mooncake**: ``mooncake_master`` (metadata and placement) and one ``mooncake_client`` that mounts
  the memory the values live in, both from the ``mooncake-transfer-engine`` wheel, protocol TCP,
  P2P handshake (no metadata server). They are our children and die with us (``PR_SET_PDEATHSIG``).
* **Yuanrong**: one datasystem worker with its own metastore service, started with ``dscli start``
  and stopped with ``dscli stop``. ``dscli`` puts the worker in its own session, so a small watchdog
  process (in its own session too) kills it should this process die without stopping it.

Both start in a background thread as soon as collection ends (:func:`start_in_background`), so their
start overlaps the other stores' cases; :func:`stop_all` stops whatever was started.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tq_redis.server.embedded import free_port

HOST = "127.0.0.1"
MOONCAKE_SEGMENT = 512 << 20  # memory the test segment holder mounts
YUANRONG_SHM_MB = 512


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (kept across exec)


def _wait_port(port: int, proc: subprocess.Popen[bytes] | None, what: str, log: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
            return
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                status = "exited" if proc is not None and proc.poll() is not None else "timed out"
                raise RuntimeError(f"{what} did not start ({status}); log {log}:\n{_tail(log)}") from None
            time.sleep(0.05)


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


def _stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Servers:
    """Handles of started servers: the address clients use, and how to stop them."""

    address: str
    options: dict[str, Any]
    _stop: list[Callable[[], None]] = field(default_factory=list)

    def stop(self) -> None:
        while self._stop:
            self._stop.pop()()


# ------------------------------------------------------------------------------------ Mooncake


def _mooncake_binary(name: str) -> list[str]:
    """The binary shipped in the wheel (run directly, so the death signal reaches it)."""
    import mooncake

    path = os.path.join(os.path.dirname(mooncake.__file__), name)
    if os.path.isfile(path) and os.access(path, os.X_OK):
        return [path]
    script = shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)
    return [script]


def start_mooncake() -> Servers:
    """``mooncake_master`` + a ``mooncake_client`` mounting the memory; returns the store options."""
    workdir = tempfile.mkdtemp(prefix="tq-mc-")  # the servers' logs
    env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING")}
    rpc, metrics, client_port = free_port(), free_port(), free_port()
    master_log = os.path.join(workdir, "mooncake_master.log")
    servers = Servers(f"{HOST}:{rpc}", {})
    servers._stop.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
    with open(master_log, "wb") as log:
        master = subprocess.Popen(
            [*_mooncake_binary("mooncake_master"), f"--rpc_address={HOST}", f"--rpc_port={rpc}",
             f"--metrics_host={HOST}", f"--metrics_port={metrics}", "--enable_metric_reporting=false",
             "--rpc_thread_num=2"],
            stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent,
        )  # fmt: skip
    servers._stop.append(lambda: _stop_process(master))
    try:
        _wait_port(rpc, master, "mooncake_master", master_log)
        client_log = os.path.join(workdir, "mooncake_client.log")
        with open(client_log, "wb") as log:
            holder = subprocess.Popen(
                [*_mooncake_binary("mooncake_client"), f"-host={HOST}", f"-port={client_port}",
                 f"-global_segment_size={MOONCAKE_SEGMENT}", f"-master_server_address={HOST}:{rpc}",
                 "-metadata_server=P2PHANDSHAKE", "-protocol=tcp"],
                stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent,
            )  # fmt: skip
        servers._stop.append(lambda: _stop_process(holder))
        _wait_port(client_port, holder, "mooncake_client (the segment holder)", client_log)
    except BaseException:
        servers.stop()
        raise
    servers.options = {
        "master_server_address": f"{HOST}:{rpc}",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "local_hostname": HOST,
    }
    return servers


# ------------------------------------------------------------------------------------ Yuanrong

_WATCHDOG = r"""
import os, shutil, signal, sys, time
home = sys.argv[1]
sys.stdin.read()  # returns when our parent closes the pipe, or dies
for _ in range(2):  # a dscli still starting the worker is killed too (both name the home directory)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(home in a for a in args) and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    time.sleep(0.2)
shutil.rmtree(home, ignore_errors=True)
"""


class _Watchdog:
    """A process, in its own session, that kills every process naming ``home`` when our pipe closes.

    Closing the pipe after a clean ``dscli stop`` finds nothing left to kill; if this process dies
    first (killed, crashed), the kernel closes the pipe and the watchdog kills the worker (and a
    ``dscli`` still starting it). Either way it removes ``home``.
    """

    def __init__(self, home: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, home], stdin=subprocess.PIPE, start_new_session=True,
            env=_own_environment(),
        )  # fmt: skip

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def _own_environment() -> dict[str, str]:
    """A copy of the environment for a child started from a background thread. Without ``env``,
    ``subprocess`` hands the C library's ``environ`` to a vfork'ed child; a change to
    ``os.environ`` in another thread meanwhile can free that array before ``exec`` reads it, and
    the spawn fails with ``[Errno 14] Bad address`` (seen once in CI)."""
    return dict(os.environ)


def _dscli() -> str:
    path = shutil.which("dscli") or os.path.join(os.path.dirname(sys.executable), "dscli")
    if not os.path.exists(path):
        raise RuntimeError("dscli not found: pip install openyuanrong-datasystem")
    return path


def start_yuanrong() -> Servers:
    """One datasystem worker with its metastore service (``dscli start``); returns the store options."""
    # the worker's unix socket directory must stay under 80 characters: keep the home short
    home = tempfile.mkdtemp(prefix="tq-yr-")
    worker, metastore = free_port(), free_port()
    address = f"{HOST}:{worker}"
    servers = Servers(address, {"worker_address": address})
    watchdog = _Watchdog(home)
    servers._stop.append(watchdog.close)
    out = subprocess.run(
        [_dscli(), "start", "-t", "60", "-d", home, "-w",
         "--worker_address", address, "--metastore_address", f"{HOST}:{metastore}",
         "--start_metastore_service", "true", "--shared_memory_size_mb", str(YUANRONG_SHM_MB),
         "--arena_per_tenant", "1", "--enable_worker_worker_batch_get", "true", "--minloglevel", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=90, env=_own_environment(),
    )  # fmt: skip
    if out.returncode != 0 or "[  OK  ]" not in out.stdout:
        servers.stop()
        raise RuntimeError(f"dscli start failed (exit status {out.returncode}):\n{out.stdout[-4000:]}")
    pid = _worker_pid(out.stdout)

    def stop_worker() -> None:
        done = subprocess.run(
            [_dscli(), "stop", "--worker_address", address],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=_own_environment(),
        )  # fmt: skip
        if done.returncode != 0 or (pid is not None and os.path.exists(f"/proc/{pid}")):
            raise RuntimeError(f"dscli stop did not stop the worker at {address} (pid {pid}):\n{done.stdout[-2000:]}")

    servers._stop.append(stop_worker)
    return servers


def _worker_pid(text: str) -> int | None:
    for line in text.splitlines():
        if "PID:" in line:
            tail = line.rsplit("PID:", 1)[1].strip().split()[0]
            if tail.isdigit():
                return int(tail)
    return None


# ------------------------------------------------------------------------------------ background


class _Background:
    """A start function run in a thread; :meth:`result` waits for it."""

    def __init__(self, start: Callable[[], Servers]) -> None:
        self._servers: Servers | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(start,), name="store-servers", daemon=True)
        self._thread.start()

    def _run(self, start: Callable[[], Servers]) -> None:
        try:
            self._servers = start()
        except BaseException as exc:  # reported by result()
            self._error = exc
        finally:
            self._ready.set()
        # a child's PR_SET_PDEATHSIG fires when the *thread* that started it ends: live until stopped
        self._release.wait()

    def result(self) -> Servers:
        self._ready.wait()
        if self._error is not None:
            raise self._error
        assert self._servers is not None
        return self._servers

    def stop(self) -> None:
        self._ready.wait()
        try:
            if self._servers is not None:
                self._servers.stop()
        finally:
            self._release.set()
            self._thread.join()


_STARTED: dict[str, _Background] = {}
_STARTERS: dict[str, Callable[[], Servers]] = {
    "mooncake": start_mooncake,
    "yuanrong": start_yuanrong,
}
_LOCK = threading.Lock()


def start_in_background(name: str) -> None:
    """Start ``name``'s servers now, in a thread (idempotent)."""
    with _LOCK:
        if name not in _STARTED:
            _STARTED[name] = _Background(_STARTERS[name])


def servers(name: str) -> Servers:
    """``name``'s servers, started if need be (waits until they are up)."""
    start_in_background(name)
    return _STARTED[name].result()


def stop_all() -> None:
    """Stop every server started here (in parallel: ``dscli stop`` takes a few seconds)."""
    with _LOCK:
        started = list(_STARTED.values())
        _STARTED.clear()
    errors: list[BaseException] = []

    def stop(bg: _Background) -> None:
        try:
            bg.stop()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stop, args=(bg,)) for bg in started]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
