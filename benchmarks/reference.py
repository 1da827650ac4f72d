"""Start either system in-process for a benchmark, and attach other processes to it.

Both systems expose the same client API (``put`` / ``get_meta`` / ``get_data`` / ...), so a
measure is written once against a client and run against each system in turn:

    client, close = open_system("reference", num_storage_units=2, polling_mode=True)
    try:
        ...  # measure with ``client``
    finally:
        close()

For multi-process measures, the process that opened a system asks for an :func:`attach_spec`
(plain picklable data) and hands it to each worker process, which calls :func:`attach` to get a
client of the *same* running system.

The reference system (``transferqueue==0.1.11``)
--------------------------------------------------
* It runs on Ray: a ``TransferQueueController`` actor plus one actor per SimpleStorage unit.
  ``ray.init`` must be called before ``transfer_queue.init()``. On a 2-core machine Ray would
  advertise 2 CPUs and the controller + storage actors (plus their internal threads) would
  wait for resources forever, so we call ``ray.init(address="local", num_cpus=8, ...)``:
  ``address="local"`` always starts a private single-node cluster for this benchmark (without
  it ``ray.init`` may *connect* to a cluster someone else started on this machine, and then
  rejects ``num_cpus``), and ``num_cpus=8`` oversubscribes the cores on purpose.
* ``RAY_USAGE_STATS_ENABLED=0`` (no usage-stats prompt/network attempt), no dashboard, worker
  logs not forwarded to the driver, and the node IP pinned to 127.0.0.1 so every ZMQ socket
  of the reference system binds on loopback.
* Attach from another process: the reference's own way is "connect Ray to the cluster, then
  call ``transfer_queue.init()``", which finds the named controller actor and builds a client
  from the config stored in it. That costs a full Ray driver per process (seconds of CPU and a
  few hundred MB each), which 40 processes on 2 cores cannot afford. The config it reads is
  plain data (ZMQ addresses of the controller and storage units), so ``attach`` by default
  builds the same client directly from it, exactly as ``transfer_queue.interface`` does after
  reading it: ``TransferQueueClient(client_id, controller_info=conf.controller.zmq_info)``
  then ``initialize_storage_manager(conf.backend.storage_backend, conf.backend[backend])``.
  The data path afterwards is identical. ``attach_mode="ray"`` uses the Ray route instead.

tq-redis (this repository)
--------------------------
``tq.init()`` with no ``redis.url`` starts the embedded Valkey and local DRAM storage units and
returns the effective config; other processes attach with
``tq.init({"redis": {"url": ...}, "namespace": ...})``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

SYSTEMS: tuple[str, ...] = ("reference", "tq_redis")
"""Names accepted by :func:`open_system` and :func:`attach`."""

# Set before anything imports Ray or the reference, in this process and in every child it
# starts (Ray's raylet, and so the reference's actors, inherit the environment at ray.init).
# The reference reads TQ_LOGGING_LEVEL when it creates each logger; at its default (WARNING) it
# logs a line on every put on a 2-core machine, which would slow it down. Override by exporting
# TQ_LOGGING_LEVEL before running.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")

CloseFn = Callable[[], None]

# What the process that opened a system knows about it, keyed by system name; read by
# attach_spec(). Only one instance of each system is open per process at a time.
_OPEN: dict[str, dict[str, Any]] = {}


# ----------------------------------------------------------------------------------------
# Reference system
# ----------------------------------------------------------------------------------------
def _quiet_reference_logs() -> None:
    """Turn already-created loggers of the reference system down to ``TQ_LOGGING_LEVEL``."""
    import logging

    level = os.environ.get("TQ_LOGGING_LEVEL", "ERROR")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("transfer_queue"):
            logging.getLogger(name).setLevel(level)


def _open_reference(
    *,
    num_storage_units: int = 2,
    polling_mode: bool = True,
    num_cpus: int = 8,
    node_ip: str = "127.0.0.1",
    extra_conf: dict[str, Any] | None = None,
    quiet: bool = True,
) -> tuple[Any, CloseFn]:
    """Start Ray and the reference system (controller + SimpleStorage units) in this process.

    Args:
        num_storage_units: number of SimpleStorage units (Ray actors).
        polling_mode: the controller's ``polling_mode``: ``True`` makes a ``get_meta`` that
            finds too few ready samples return an empty ``BatchMeta`` at once; ``False`` makes
            the controller sleep 5 s (blocking every other request) and then raise.
        num_cpus: CPUs Ray advertises (must exceed the machine's 2 for the actors to start).
        node_ip: the IP Ray (and so every ZMQ socket of the reference) uses.
        extra_conf: merged over the reference's config after the settings above.
        quiet: lower the reference's log level to errors.

    Returns:
        ``(client, close_fn)``; ``close_fn`` shuts the system and Ray down.
    """
    import ray

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process; close the other system first")
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address=node_ip,
        configure_logging=not quiet,
    )
    import transfer_queue as ref

    if quiet:
        _quiet_reference_logs()
    conf: dict[str, Any] = {
        "controller": {"polling_mode": polling_mode},
        "backend": {
            "storage_backend": "SimpleStorage",
            "SimpleStorage": {"num_data_storage_units": num_storage_units},
        },
    }
    if extra_conf:
        from omegaconf import OmegaConf

        conf = OmegaConf.to_container(OmegaConf.merge(conf, extra_conf))  # type: ignore[assignment]
    try:
        effective = ref.init(conf)
        client = ref.get_client()
    except BaseException:
        ray.shutdown()
        raise
    gcs_address = ray.get_runtime_context().gcs_address
    _OPEN["reference"] = {"conf": pickle.dumps(effective), "gcs_address": gcs_address, "quiet": quiet}

    def close() -> None:
        _OPEN.pop("reference", None)
        try:
            ref.close()
        finally:
            ray.shutdown()

    return client, close


def _attach_reference(spec: dict[str, Any], *, attach_mode: str = "zmq") -> tuple[Any, CloseFn]:
    """Get a client of a reference system that another process opened (see module docstring)."""
    if spec.get("quiet", True):
        _quiet_reference_logs()
    if attach_mode == "ray":
        import ray
        import transfer_queue as ref

        ray.init(address=spec["gcs_address"], log_to_driver=False, configure_logging=False)
        ref.init()  # finds the named controller actor and builds a client from its stored config
        client = ref.get_client()

        def close_ray() -> None:
            # ref.close() would kill the shared controller actor (it calls ray.kill on it even
            # in a process that only attached), so close only this process's client.
            client.close()
            ray.shutdown()

        return client, close_ray
    if attach_mode != "zmq":
        raise ValueError(f"attach_mode must be 'zmq' or 'ray', got {attach_mode!r}")

    from transfer_queue import TransferQueueClient

    conf = pickle.loads(spec["conf"])
    backend = conf.backend.storage_backend
    client = TransferQueueClient(
        client_id=f"TransferQueueClient_{os.getpid()}", controller_info=conf.controller.zmq_info
    )
    client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
    return client, client.close


# ----------------------------------------------------------------------------------------
# tq-redis
# ----------------------------------------------------------------------------------------
def _open_tq_redis(*, conf: dict[str, Any] | None = None, num_storage_units: int | None = 2) -> tuple[Any, CloseFn]:
    """Start tq-redis on its embedded default (embedded Valkey + local DRAM storage units).

    Args:
        conf: config merged by ``tq.init``; a ``redis.url`` in it attaches to that server
            instead of starting the embedded one.
        num_storage_units: DRAM storage units to start (``storage.units``), ``None`` for
            the package default.

    Returns:
        ``(client, close_fn)``.
    """
    import tq_redis as tq

    full: dict[str, Any] = dict(conf or {})
    if num_storage_units is not None:
        storage = dict(full.get("storage") or {})
        storage.setdefault("units", num_storage_units)
        full["storage"] = storage
    effective = tq.init(full or None)
    client = tq.get_client()
    _OPEN["tq_redis"] = {
        "redis_url": _conf_get(effective, "redis", "url"),
        "namespace": _conf_get(effective, "namespace"),
    }

    def close() -> None:
        _OPEN.pop("tq_redis", None)
        tq.close()

    return client, close


def _attach_tq_redis(spec: dict[str, Any]) -> tuple[Any, CloseFn]:
    """Get a client of a tq-redis system that another process opened."""
    import tq_redis as tq

    conf: dict[str, Any] = {"redis": {"url": spec["redis_url"]}}
    if spec.get("namespace"):
        conf["namespace"] = spec["namespace"]
    tq.init(conf)
    return tq.get_client(), tq.close


def _conf_get(conf: Any, *path: str) -> Any:
    """Read ``conf[path[0]][path[1]]...`` from a dict or an OmegaConf node; ``None`` if absent."""
    node = conf
    for key in path:
        if node is None:
            return None
        try:
            node = node[key]
        except (KeyError, TypeError, AttributeError):
            return None
    return node


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------
def open_system(name: str, **opts: Any) -> tuple[Any, CloseFn]:
    """Start system ``name`` ("reference" or "tq_redis") in this process.

    Keyword options are passed to the system's opener (see :func:`_open_reference` and
    :func:`_open_tq_redis`); options meant for the other system are ignored, so a measure can
    pass one set of options to both.

    Returns:
        ``(client, close_fn)``: a client with the shared API, and a function that tears the
        system down (idempotent enough to call once from a ``finally``).
    """
    t0 = time.perf_counter()
    if name == "reference":
        allowed = {"num_storage_units", "polling_mode", "num_cpus", "node_ip", "extra_conf", "quiet"}
        client, close = _open_reference(**{k: v for k, v in opts.items() if k in allowed})
    elif name == "tq_redis":
        allowed = {"conf", "num_storage_units"}
        client, close = _open_tq_redis(**{k: v for k, v in opts.items() if k in allowed})
    else:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    _OPEN[name]["startup_s"] = time.perf_counter() - t0
    return client, close


@contextmanager
def opened_for(name: str, partition: str, **opts: Any) -> Iterator[Any]:
    """The client of system ``name`` (:func:`open_system` with ``opts``) for a measure that writes
    ``partition``: on the way out the partition is cleared (a failure is printed, not raised: it is
    a benchmark's teardown) and the system closed."""
    client, close = open_system(name, **opts)
    try:
        yield client
    finally:
        try:
            client.clear_partition(partition)
        except Exception as exc:  # noqa: BLE001 - teardown of a benchmark; report and go on
            print(f"[{name}] clear_partition failed: {exc}", flush=True)
        close()


@contextmanager
def hosting_workers(name: str, **opts: Any) -> Iterator[tuple[dict[str, Any], Any, list[Any]]]:
    """System ``name`` opened in this process (:func:`open_system` with ``opts``) for worker
    processes that attach to it: yields its :func:`attach_spec`, a forkserver context and the
    list of worker processes (:func:`start_workers` fills it). On the way out each worker gets
    10 s to end (then it is killed) and the system is closed."""
    _, close = open_system(name, **opts)
    procs: list[Any] = []
    try:
        yield attach_spec(name), mp.get_context("forkserver"), procs
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        close()


class Started(NamedTuple):
    """When a run of worker processes started (:func:`start_workers`)."""

    wall: float  # wall clock time the run starts at (the workers are released)
    attach_s: float  # seconds from spawning the workers until every one attached
    settled: Any  # what ``settle`` returned (None without one)


def start_workers(
    ctx: Any, procs: list[Any], target: Callable[..., Any], jobs: list[tuple[str, tuple]], barrier: Any,
    timeout_s: float, settle: Callable[[], Any] | None = None,
) -> Started:
    """Start a daemon process ``target(*args)`` named ``name`` per ``(name, args)`` of ``jobs``
    (appended to ``procs``), wait at ``barrier`` until every one attached, call ``settle`` (e.g.
    :func:`benchmarks._common.wait_until_quiet`, so that what the previous run left behind, a Ray
    cluster shutting down say, does not run in this one), then release the workers: each worker
    passes ``barrier`` twice (:func:`at_start_line`). A broken barrier is not raised here: the
    workers report why."""
    t_spawn = time.perf_counter()
    for proc_name, args in jobs:
        proc = ctx.Process(target=target, args=args, name=proc_name, daemon=True)
        proc.start()
        procs.append(proc)
    settled = None
    try:
        barrier.wait(timeout=timeout_s)
        attach_s = time.perf_counter() - t_spawn
        settled = settle() if settle is not None else None
        barrier.wait(timeout=timeout_s)
    except threading.BrokenBarrierError:
        attach_s = time.perf_counter() - t_spawn
    return Started(time.time(), attach_s, settled)


def at_start_line(barrier: Any, timeout_s: float) -> None:
    """A worker's side of :func:`start_workers`: report attached, then wait for the start."""
    barrier.wait(timeout=timeout_s)
    barrier.wait(timeout=timeout_s)


def startup_seconds(name: str) -> float | None:
    """Seconds :func:`open_system` took for the currently open system ``name``."""
    return _OPEN.get(name, {}).get("startup_s")


def attach_spec(name: str) -> dict[str, Any]:
    """Picklable description of the system ``name`` opened in this process, for :func:`attach`."""
    if name not in _OPEN:
        raise RuntimeError(f"system {name!r} is not open in this process; call open_system first")
    return {k: v for k, v in _OPEN[name].items() if k != "startup_s"}


def attach(name: str, spec: dict[str, Any], **opts: Any) -> tuple[Any, CloseFn]:
    """From another process, get a client of the running system described by ``spec``.

    Args:
        name: "reference" or "tq_redis".
        spec: what :func:`attach_spec` returned in the process that opened the system.
        opts: ``attach_mode`` ("zmq" or "ray") for the reference system.

    Returns:
        ``(client, close_fn)``; ``close_fn`` closes only this process's client.
    """
    if name == "reference":
        return _attach_reference(spec, attach_mode=opts.get("attach_mode", "zmq"))
    if name == "tq_redis":
        return _attach_tq_redis(spec)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def preload_modules(name: str) -> list[str]:
    """Modules a forkserver should import once so that workers of system ``name`` start fast."""
    common = ["numpy", "torch", "tensordict"]
    if name == "reference":
        return [*common, "transfer_queue"]
    if name == "tq_redis":
        # ``import tq_redis`` is lazy (it imports nothing more until a name is used): preload the
        # client stack that init() and TransferQueueClient use, as transfer_queue's import does its own
        return [*common, "tq_redis.preload"]
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
