"""Fixtures of the store conformance suite: one real, running instance of every store we ship.

Each store is described by a :class:`StoreSetup` (registry name, options, context) built once per
session by a function in :data:`SETUPS`; the ``store_setup`` fixture is parametrized over them, so
every test in ``test_stores.py`` runs against every store. To add a store, write a setup function
and add it to :data:`SETUPS` (and drop its name from ``PENDING`` in ``test_stores.py``).

Nothing is skipped: a store whose test dependency is missing fails with the package to install.
The slow starts are hidden: the moto S3 server and Ray (10-20 s on a busy machine) start in the
background as soon as collection ends, and the cases run grouped by store with Ray's last; every
server lives for the whole session.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conformance import servers as store_servers
from tests.ray_start import init_local_ray
from tq_redis.server.embedded import EmbeddedServer, free_port
from tq_redis.storage.base import StorageClient, StoreContext, create_store

S3_BUCKET = "tq-conformance"
S3_CREDENTIALS = {"key": "testing", "secret": "testing"}


@dataclass
class StoreSetup:
    """How to build one store: ``create_store(backend, options, StoreContext(url, namespace))``."""

    id: str
    backend: str
    options: dict[str, Any]
    url: str
    namespace: str
    stop: Callable[[], None] | None = None
    #: how many keys a "many keys" case uses (fewer for slow emulators, so the suite stays short)
    many: int = 300

    @property
    def ctx(self) -> StoreContext:
        return StoreContext(self.url, self.namespace)

    def create(self) -> StorageClient:
        return create_store(self.backend, self.options, self.ctx)


def _need(store_id: str, modules: list[str], install: str) -> None:
    """Fail (never skip) when a store's test dependency is missing, naming what to install."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            pytest.fail(
                f"the {store_id!r} conformance store needs {install!r} ({exc}); "
                f"pip install -e '.[test]' (or: pip install {install})",
                pytrace=False,
            )


def _import_tq_redis() -> None:
    import tq_redis.backends.ray_store  # noqa: F401


class _Session:
    """Servers shared by the whole session, started on first use and stopped at the end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._valkey: EmbeddedServer | None = None
        self.setups: dict[str, StoreSetup] = {}
        self._namespaces: dict[str, str] = {}
        self._moto: tuple[subprocess.Popen[bytes], int] | None = None
        self.ray_thread: threading.Thread | None = None
        self.ray_error: BaseException | None = None
        self.ray_ready = threading.Event()
        self.ray_release = threading.Event()

    @property
    def redis_url(self) -> str:
        with self._lock:
            if self._valkey is None:
                self._valkey = EmbeddedServer().start()
            return self._valkey.url

    def namespace(self, store_id: str) -> str:
        """The namespace (metadata and data) of one store's cases; fixed for the session."""
        with self._lock:
            return self._namespaces.setdefault(store_id, f"conf-{store_id}-{uuid.uuid4().hex[:6]}")

    def setup(self, store_id: str, tmp_root: str) -> StoreSetup:
        if store_id not in self.setups:
            self.setups[store_id] = SETUPS[store_id](self, self.namespace(store_id), tmp_root)
        return self.setups[store_id]

    # ------------------------------------------------------------------ moto and Ray, started early

    def start_moto(self) -> tuple[subprocess.Popen[bytes], int]:
        """The moto S3 server, in its own process (here it would compete with the tests for the GIL)."""
        with self._lock:
            if self._moto is None:
                port = free_port()
                proc = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                )  # fmt: skip
                self._moto = (proc, port)
            return self._moto

    def start_ray_in_background(self) -> None:
        if self.ray_thread is None:
            # import here, in the main thread: a test importing ray while the background thread is
            # still importing it could see a half-initialised module ("no attribute 'remote'")
            try:
                _import_tq_redis()
            except ImportError:
                pass  # the ray cases fail naming what to install (_need)
            self.ray_thread = threading.Thread(target=self._start_ray, name="ray-init", daemon=True)
            self.ray_thread.start()

    def _start_ray(self) -> None:
        try:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            import ray

            if not ray.is_initialized():
                init_local_ray(
                    num_cpus=2, include_dashboard=False, log_to_driver=False,
                    object_store_memory=512 << 20,
                )  # fmt: skip
            from tq_redis.backends.ray_store import RayStore

            RayStore(self.namespace("ray")).size()  # start the key-table actor now, too
            # and have idle workers import tq-redis, so the cases' own Ray actors start fast
            ray.get([ray.remote(_import_tq_redis).options(num_cpus=0).remote() for _ in range(2)])
        except BaseException as exc:  # reported by the first ray case
            self.ray_error = exc
        finally:
            self.ray_ready.set()
        # Ray's server processes die with the *thread* that started them (PR_SET_PDEATHSIG), so this
        # thread lives until the session ends
        self.ray_release.wait()

    def wait_for_ray(self) -> None:
        self.start_ray_in_background()
        self.ray_ready.wait()
        if self.ray_error is not None:
            pytest.fail(f"Ray did not start: {self.ray_error!r}", pytrace=False)

    def stop(self) -> None:
        for setup in reversed(list(self.setups.values())):
            if setup.stop is not None:
                setup.stop()
        self.setups.clear()
        store_servers.stop_all()  # Mooncake and Yuanrong servers
        if self.ray_thread is not None:
            self.ray_ready.wait()
            if self.ray_error is None:
                import ray

                ray.shutdown()
            self.ray_release.set()
            self.ray_thread.join()
        if self._moto is not None:
            proc = self._moto[0]
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._valkey is not None:
            self._valkey.stop()
            self._valkey = None


# ---------------------------------------------------------------------------- one setup per store


def _redis(session: _Session, namespace: str, tmp_root: str) -> StoreSetup:
    return StoreSetup("redis", "redis", {}, session.redis_url, namespace)


def _dram(session: _Session, namespace: str, tmp_root: str) -> StoreSetup:
    from tq_redis.backends.dram.launcher import start_local_nodes

    nodes = start_local_nodes(session.redis_url, namespace, n=2, capacity="256MiB")
    return StoreSetup("dram", "dram", {}, session.redis_url, namespace, stop=nodes.stop)


def _fsspec_local(session: _Session, namespace: str, tmp_root: str) -> StoreSetup:
    url = f"file://{tmp_root}/fsspec-local"
    return StoreSetup("fsspec-local", "fsspec", {"url": url}, session.redis_url, namespace)


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no orphaned server if pytest is killed


def _fsspec_s3(session: _Session, namespace: str, tmp_root: str) -> StoreSetup:
    _need("fsspec-s3", ["s3fs", "boto3", "moto.server", "flask", "flask_cors"], "moto[server] s3fs")
    import boto3

    proc, port = session.start_moto()
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the moto S3 server did not start (exit status {proc.poll()})", pytrace=False)
            time.sleep(0.05)
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id=S3_CREDENTIALS["key"], aws_secret_access_key=S3_CREDENTIALS["secret"],
    ).create_bucket(Bucket=S3_BUCKET)  # fmt: skip
    # s3fs gets no region_name: against moto it makes requests fail
    options = {"url": f"s3://{S3_BUCKET}/{namespace}", "storage_options": {"endpoint_url": endpoint, **S3_CREDENTIALS}}
    return StoreSetup("fsspec-s3", "fsspec", options, session.redis_url, namespace, many=40)


def _mooncake(session: _Session, namespace: str, tmp_root: str) -> StoreSetup:
    _need("mooncake", ["mooncake.store"], "mooncake-transfer-engine-non-cuda")
    try:
        servers = store_servers.servers("mooncake")  # mooncake_master + a segment holder
    except Exception as exc:
        pytest.fail(f"the Mooncake servers did not start: {exc}", pytrace=False)
    return StoreSetup("mooncake", "mooncake", dict(servers.options), session.redis_url, namespace)


def _yuanrong(session: _Session, namespace: str, tmp_root: str) -> StoreSetup:
    _need("yuanrong", ["yr.datasystem"], "openyuanrong-datasystem")
    try:
        servers = store_servers.servers("yuanrong")  # one worker with its metastore (dscli start)
    except Exception as exc:
        pytest.fail(f"the Yuanrong datasystem worker did not start: {exc}", pytrace=False)
    return StoreSetup("yuanrong", "yuanrong", dict(servers.options), session.redis_url, namespace)


def _ray(session: _Session, namespace: str, tmp_root: str) -> StoreSetup:
    _need("ray", ["ray"], "ray")
    session.wait_for_ray()

    def destroy() -> None:
        from tq_redis.backends.ray_store import RayStore

        RayStore(namespace).destroy()

    return StoreSetup("ray", "ray", {}, session.redis_url, namespace, stop=destroy)


def _ray_writer_owned(session: _Session, namespace: str, tmp_root: str) -> StoreSetup:
    setup = session.setup("ray", tmp_root)  # the same key-table actor, writer-owned values
    options = {"owner": "writer", "actor_name": f"tq_redis_store:{setup.namespace}"}
    return StoreSetup("ray-writer", "ray", options, session.redis_url, namespace)


#: store id -> setup; the suite runs every test against each, in this order (slow starts last)
SETUPS: dict[str, Callable[[_Session, str, str], StoreSetup]] = {
    "redis": _redis,
    "dram": _dram,
    "fsspec-local": _fsspec_local,
    "fsspec-s3": _fsspec_s3,
    "mooncake": _mooncake,
    "yuanrong": _yuanrong,
    "ray": _ray,
    "ray-writer": _ray_writer_owned,
}
#: store id -> registry name
STORE_BACKENDS = {
    "redis": "redis",
    "dram": "dram",
    "fsspec-local": "fsspec",
    "fsspec-s3": "fsspec",
    "mooncake": "mooncake",
    "yuanrong": "yuanrong",
    "ray": "ray",
    "ray-writer": "ray",
}

_SESSION = _Session()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run this suite's cases grouped by store, in ``SETUPS`` order, so Ray's start overlaps the rest."""
    order = {name: n for n, name in enumerate(SETUPS)}
    mine = [n for n, item in enumerate(items) if _store_id(item) is not None]
    ranked = sorted((items[n] for n in mine), key=lambda item: order.get(_store_id(item) or "", len(order)))
    for n, item in zip(mine, ranked):
        items[n] = item


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # each worker collects every case but runs a share: its servers start when a case needs them
    ids = {_store_id(item) for item in session.items}
    if "fsspec-s3" in ids and importlib.util.find_spec("moto") is not None:
        _SESSION.start_moto()
    if any(str(i).startswith("ray") for i in ids):
        _SESSION.start_ray_in_background()
    for name, module in (("mooncake", "mooncake.store"), ("yuanrong", "yr.datasystem")):
        if name in ids and importlib.util.find_spec(module.partition(".")[0]) is not None:
            store_servers.start_in_background(name)


def stop_store_servers() -> None:
    """Stop Mooncake's and Yuanrong's servers (they poll busily) and forget the setups that name them;
    a later case starts them again."""
    for store_id in ("mooncake", "yuanrong"):
        _SESSION.setups.pop(store_id, None)
    store_servers.stop_all()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the Mooncake / Yuanrong servers started at collection even if no case ran (e.g. a collection error)."""
    store_servers.stop_all()


def _store_id(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("store_setup") if callspec is not None else None


@pytest.fixture(scope="session", autouse=True)
def _conformance_servers() -> Iterator[None]:
    yield
    _SESSION.stop()


@pytest.fixture(scope="session")
def conformance_tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("conformance"))


@pytest.fixture(params=list(SETUPS))
def store_setup(request: pytest.FixtureRequest, conformance_tmp: str) -> StoreSetup:
    """Every store in turn (its servers start once per session)."""
    return _SESSION.setup(request.param, conformance_tmp)


@pytest.fixture
def store(store_setup: StoreSetup) -> Iterator[StorageClient]:
    """A fresh client of the store, built through the registry like the storage manager does."""
    client = store_setup.create()
    yield client
    client.close()


@pytest.fixture
def redis_url() -> str:
    """The session's Valkey (metadata plane of the end-to-end cases)."""
    return _SESSION.redis_url


@pytest.fixture
def setup_of(conformance_tmp: str) -> Callable[[str], StoreSetup]:
    """The setup of a store named by id, for store-specific tests."""
    return lambda store_id: _SESSION.setup(store_id, conformance_tmp)


@pytest.fixture
def ray_setup(conformance_tmp: str) -> StoreSetup:
    """The ``ray`` store's setup, for Ray-only tests."""
    return _SESSION.setup("ray", conformance_tmp)
