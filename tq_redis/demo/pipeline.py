"""The main process of ``tq-redis demo``: start tq-redis (or attach to a Redis), start one process
per stage worker, release them together, watch their events until every one is done, stop every
process it started whatever happens, and write the report (:func:`run_demo`).

Workers are forked from a forkserver that imported torch once (spawn where there is none); they
run :func:`tq_redis.demo.stages.worker_main` and talk back over one events queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tq_redis.demo.config import DemoConfig, DemoFailed, Span, partition, roles
from tq_redis.demo.report import ProgressView, plot_timeline, require_demo_extra, summarize
from tq_redis.redact import redact

__all__ = ["run_demo"]

_STOP_GRACE_S = 3.0
"""How long workers get to exit by themselves after the stop flag before they are terminated
(they check it at least every ``demo_stages.WAIT_SLICE_S``; one blocked retrying a dead Redis would not)."""


def _say(cfg: DemoConfig, text: str) -> None:
    if cfg.progress != "none":
        print(text, flush=True)


# ------------------------------------------------------------------------------- processes


def _mp_context() -> Any:
    """forkserver (torch imported once, then forked clean) where available, else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "tensordict", "tq_redis", "tq_redis.client.blocking"])
        return ctx
    return mp.get_context("spawn")


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT while starting children, so they inherit that (Ctrl-C is the main process's)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread; workers ignore it themselves
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_forkserver_early() -> None:
    """Start the forkserver now, so its torch import overlaps with starting Redis and the nodes."""
    if "forkserver" not in mp.get_all_start_methods():
        return
    _mp_context()
    from multiprocessing import forkserver

    with _sigint_ignored():  # a forkserver started with SIGINT ignored passes that on to its forks
        forkserver.ensure_running()


def _forkserver_running() -> bool:
    try:
        from multiprocessing import forkserver

        return forkserver._forkserver._forkserver_pid is not None  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return False


def _stop_forkserver() -> None:
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver

        forkserver._forkserver._stop()  # type: ignore[attr-defined]


class _Pipeline:
    """The worker processes of one run and the event loop that watches them."""

    def __init__(self, cfg: DemoConfig, url: str, namespace: str, view: ProgressView) -> None:
        from tq_redis.demo.stages import Shared, worker_main  # imports torch: not needed for --help

        self.cfg = cfg
        self.view = view
        self.ctx = _mp_context()
        self.shared = Shared(
            url=url,
            namespace=namespace,
            cfg=cfg,
            events=self.ctx.Queue(),
            go=self.ctx.Event(),
            stop=self.ctx.Event(),
            trained=self.ctx.Value("i", 0),
            cond=self.ctx.Condition(),
        )
        self.procs: dict[tuple[str, int], Any] = {
            role: self.ctx.Process(
                target=worker_main, args=(*role, self.shared), name=f"tq-demo-{role[0]}-{role[1]}", daemon=True
            )
            for role in roles(cfg)
        }
        self.spans: list[Span] = []
        self.trained: dict[int, tuple[int, int]] = {}
        self.ready: set[tuple[str, int]] = set()
        self.finished: set[tuple[str, int]] = set()

    def start(self) -> None:
        with _sigint_ignored():
            for proc in self.procs.values():
                proc.start()

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "span":
            span = Span(*event[1])
            self.spans.append(span)
            self.view.span(span)
            return
        stage, worker = event[1], event[2]
        if kind == "ready":
            self.ready.add((stage, worker))
        elif kind in ("done", "stopped"):
            self.finished.add((stage, worker))
        elif kind == "trained":
            self.trained[event[3]] = (event[4], event[5])
        elif kind == "error":
            message, tb = event[3], event[4]
            raise DemoFailed(f"the {stage} worker {worker} failed: {message}\n{tb.rstrip()}")

    def _pump(self, until: Callable[[], bool], deadline: float, what: str) -> None:
        """Handle events until ``until()``; fail on a worker error, a dead worker or the deadline."""
        while not until():
            try:
                self._handle(self.shared.events.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            for (stage, worker), proc in self.procs.items():
                if proc.exitcode is not None and (stage, worker) not in self.finished:
                    self._drain()  # its error report may still be in the pipe
                    raise DemoFailed(
                        f"the {stage} worker {worker} exited with code {proc.exitcode} before finishing (while {what})"
                    )
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {self.cfg.timeout_s:.0f}s while {what}")

    def _drain(self) -> None:
        with contextlib.suppress(queue.Empty, OSError, EOFError):
            while True:
                self._handle(self.shared.events.get(timeout=0.5))

    def run(self) -> tuple[float, float]:
        """Start the workers, release them together, wait for all to finish: (t_go, t_end)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        self.start()
        self._pump(lambda: len(self.ready) == len(self.procs), deadline, "starting the workers")
        t_go = time.time()
        self.view.start(t_go)
        self.shared.go.set()
        self._pump(lambda: len(self.finished) == len(self.procs), deadline, "running the pipeline")
        t_end = time.time()
        for proc in self.procs.values():
            proc.join(max(1.0, deadline - time.monotonic()))
        return t_go, t_end

    def shutdown(self) -> None:
        """Stop and reap every worker: ask, wait, then terminate, then kill."""
        self.shared.stop.set()
        end = time.monotonic() + _STOP_GRACE_S
        for proc in self.procs.values():
            while proc.is_alive() and time.monotonic() < end:
                with contextlib.suppress(queue.Empty, OSError, EOFError, DemoFailed):
                    self.shared.events.get(timeout=0.1)  # keep the pipe flowing so children can exit
                proc.join(0.05)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        with contextlib.suppress(Exception):
            self.shared.events.close()
            self.shared.events.join_thread()


# ------------------------------------------------------------------------------- tq-redis


def _init_conf(cfg: DemoConfig) -> dict[str, Any]:
    return {
        "redis": {"url": cfg.redis_url},
        "namespace": cfg.namespace,
        "storage": {"backend": cfg.store, "units": 2, "unit_capacity": "1GiB"},
    }


def _attached_settings(cfg: DemoConfig) -> dict[bytes, bytes]:
    """On an attached Redis: the namespace settings ``init`` will overwrite (restored afterwards),
    after checking that the DRAM store has storage nodes registered there."""
    import redis

    from tq_redis.errors import ConnectionFailed
    from tq_redis.meta.keys import config_key, storage_nodes_key
    from tq_redis.server import connections

    assert cfg.redis_url is not None
    r = connections.sync_client(cfg.redis_url, socket_connect_timeout=5)
    try:
        nodes = r.hlen(storage_nodes_key(cfg.namespace))
        settings = r.hgetall(config_key(cfg.namespace))
    except redis.ConnectionError as exc:
        raise ConnectionFailed(f"cannot reach Redis at {redact(cfg.redis_url)}: {exc}") from exc
    finally:
        r.close()
    if cfg.store == "dram" and not nodes:
        raise DemoFailed(
            f"no DRAM storage nodes are registered in namespace {cfg.namespace!r} at {redact(cfg.redis_url)}: "
            f"start them (tq-redis up, or tq-redis storage-unit) or pass --store redis"
        )
    return settings


def _restore_settings(cfg: DemoConfig, settings: dict[bytes, bytes]) -> None:
    from tq_redis.meta.keys import config_key
    from tq_redis.server import connections

    assert cfg.redis_url is not None
    r = connections.sync_client(cfg.redis_url, socket_connect_timeout=5)
    try:
        # the namespace's identity is no setting: it stays what the run found or drew (server.identity)
        epoch = r.hget(config_key(cfg.namespace), "epoch")
        with r.pipeline() as pipe:
            pipe.delete(config_key(cfg.namespace))
            if settings or epoch is not None:
                pipe.hset(config_key(cfg.namespace),
                          mapping={**settings, **({b"epoch": epoch} if epoch is not None else {})})
            pipe.execute()
    finally:
        r.close()


# ------------------------------------------------------------------------------- one run


def run_demo(config: DemoConfig | None = None, **options: Any) -> dict[str, Any]:
    """Run the pipeline once and return its summary (also written to ``<out>/summary.json``).

    Args:
        config: sizes and options; keyword ``options`` override its fields (``steps=2`` ...).

    Returns:
        A dict: ``samples``/``trained``/``trained_unique``, ``bytes_put``/``bytes_get``/
        ``bytes_moved``, per-stage ``stages`` (busy and CPU seconds, micro-batches, samples,
        tokens), ``wall_s`` (first worker released -> last one done), ``total_s`` (with startup
        and shutdown), ``busy_sum_s``, ``overlap`` (= busy_sum_s / wall_s, the speed-up over running
        the stages one after another), ``timeline_png`` and ``summary_json``.

    Raises:
        DemoFailed: a worker failed or died, the run timed out, or a check failed. Every process
            the run started is stopped first.
        ValueError: invalid sizes.
        BackendNotInstalled: the ``[demo]`` extra (rich, matplotlib) is not installed.
    """
    import tq_redis as tq
    from tq_redis.api.system import NotInitialized

    cfg = dataclasses.replace(config or DemoConfig(), **options)
    cfg.validate()
    require_demo_extra()
    try:
        tq.get_client()
    except NotInitialized:
        pass
    else:
        raise DemoFailed("run_demo starts its own tq-redis: call tq_redis.close() first")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    _say(
        cfg,
        f"tq-redis demo: {cfg.steps} steps x {cfg.batch} prompts x {cfg.n_samples} samples = {cfg.samples} "
        f"samples, {cfg.workers} rollout workers, store {cfg.store}, max_tokens {cfg.max_tokens or 'off'}",
    )
    if cfg.redis_url:
        _say(cfg, f"attaching to {redact(cfg.redis_url)}")
    else:
        _say(cfg, "starting an embedded Valkey" + (" + 2 DRAM storage nodes" if cfg.store == "dram" else ""))
    owned_forkserver = not _forkserver_running()
    view = ProgressView(cfg, cfg.progress)
    pipeline: _Pipeline | None = None
    settings: dict[bytes, bytes] | None = None
    try:
        if cfg.redis_url:
            settings = _attached_settings(cfg)
        _start_forkserver_early()
        tq_cfg = tq.init(_init_conf(cfg))
        url, ns = tq_cfg["redis"]["url"], tq_cfg["namespace"]
        client = tq.get_client()
        for step in range(cfg.steps):  # leftovers of an earlier run on an attached Redis
            client.clear_partition(partition(step))
        _say(cfg, f"metadata plane {redact(url)} (namespace {ns!r}); starting {cfg.workers + 4} worker processes")
        pipeline = _Pipeline(cfg, url, ns, view)
        t_go, t_end = pipeline.run()
        view.close()
        client.get_partition_list()  # the metadata plane is still healthy
    finally:
        view.close()
        try:
            if pipeline is not None:
                pipeline.shutdown()
        finally:
            if cfg.redis_url and settings is not None:
                with contextlib.suppress(Exception):
                    for step in range(cfg.steps):
                        tq.get_client().clear_partition(partition(step))
                with contextlib.suppress(Exception):
                    _restore_settings(cfg, settings)
            tq.close()
            if owned_forkserver:
                _stop_forkserver()
    summary = summarize(cfg, pipeline.spans, pipeline.trained, t_start, t_go, t_end, url, ns)
    summary["timeline_png"] = str(plot_timeline(cfg, pipeline.spans, t_go, summary, out / "demo_timeline.png"))
    summary["total_s"] = time.time() - t_start
    (out / "spans.json").write_text(json.dumps([dataclasses.asdict(s) for s in pipeline.spans]))
    summary["summary_json"] = str(out / "summary.json")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if summary["trained_unique"] != cfg.samples:
        raise DemoFailed(f"trained {summary['trained_unique']} distinct samples, expected {cfg.samples}")
    return summary
