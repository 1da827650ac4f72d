"""What ``tq-redis demo`` shows: live per-stage progress while it runs (:class:`ProgressView`), then
the run's summary (:func:`summarize`, printed by :func:`format_summary`) and the timeline figure
(:func:`plot_timeline`), all computed from the workers' :class:`~tq_redis.demo.config.Span` records.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from tq_redis.demo.config import STAGE_LABELS, STAGES, DemoConfig, Span, roles
from tq_redis.errors import BackendNotInstalled
from tq_redis.units import format_size

__all__ = ["ProgressView", "format_summary", "plot_timeline", "require_demo_extra", "summarize"]

#: what the demo shows with: the ``[demo]`` extra (a training rank installs neither)
DEMO_LIBRARIES = ("rich", "matplotlib")


def require_demo_extra() -> None:
    """Raise :class:`~tq_redis.errors.BackendNotInstalled` naming the ``[demo]`` extra unless its
    libraries (progress bars, the timeline figure) can be imported: said before the run starts,
    not after it."""
    missing = [name for name in DEMO_LIBRARIES if not _importable(name)]
    if missing:
        raise BackendNotInstalled(
            f"the demo needs {' and '.join(missing)}, which the [demo] extra installs: pip install 'tq-redis[demo]'"
        )


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds a module without a spec
        return False


class ProgressView:
    """Per-stage progress: rich bars on a terminal, one plain line per finished stage-step otherwise."""

    def __init__(self, cfg: DemoConfig, mode: str) -> None:
        self.cfg = cfg
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self.t0 = time.time()
        self.done: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.busy: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.per_step: dict[tuple[str, int], int] = {}
        self.batches: dict[tuple[str, int], int] = {}
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}

    def start(self, t0: float) -> None:
        """The workers were released at ``t0``: show the bars (rich mode)."""
        self.t0 = t0
        if self.mode != "rich":
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            refresh_per_second=8,
        )
        self._progress.start()
        for stage in STAGES:
            workers = self.cfg.workers
            label = STAGE_LABELS[stage] + (f" x{workers}" if stage == "rollout" and workers > 1 else "")
            self._tasks[stage] = self._progress.add_task(label, total=self.cfg.samples, info="waiting")

    def span(self, span: Span) -> None:
        """Count one finished micro-batch."""
        stage = span.stage
        self.done[stage] += span.n
        self.busy[stage] += span.duration
        key = (stage, span.step)
        self.per_step[key] = self.per_step.get(key, 0) + span.n
        self.batches[key] = self.batches.get(key, 0) + 1
        finished = self.per_step[key] == self.cfg.samples_per_step
        if self._progress is not None:
            info = f"step {span.step + 1}/{self.cfg.steps}  busy {self.busy[stage]:.1f}s"
            self._progress.update(self._tasks[stage], completed=self.done[stage], info=info)
        elif self.mode == "plain" and finished:
            print(
                f"[{span.end - self.t0:6.2f}s] {STAGE_LABELS[stage]:<13} step {span.step}: "
                f"{self.per_step[key]} samples in {self.batches[key]} micro-batches "
                f"({self.done[stage]}/{self.cfg.samples} total, busy {self.busy[stage]:.2f}s)",
                flush=True,
            )

    def close(self) -> None:
        """Take the bars down (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _stage_figures(spans: list[Span]) -> dict[str, Any]:
    """One stage's totals over its spans."""
    sizes = [s.n for s in spans]
    return {
        "workers": len({s.worker for s in spans}),
        "micro_batches": len(spans),
        "samples": sum(sizes),
        "tokens": sum(s.tokens for s in spans),
        "batch_min": min(sizes, default=0),
        "batch_max": max(sizes, default=0),
        "busy_s": sum(s.duration for s in spans),
        "cpu_s": sum(s.cpu_s for s in spans),
        "bytes_in": sum(s.bytes_in for s in spans),
        "bytes_out": sum(s.bytes_out for s in spans),
    }


def summarize(
    cfg: DemoConfig,
    spans: list[Span],
    trained: dict[int, tuple[int, int]],
    t_start: float,
    t_go: float,
    t_end: float,
    url: str,
    namespace: str,
) -> dict[str, Any]:
    """The run's figures (the keys :func:`tq_redis.demo.main.run_demo` documents, but the file paths and
    ``total_s``)."""
    stages = {stage: _stage_figures([s for s in spans if s.stage == stage]) for stage in STAGES}
    wall = max(t_end - t_go, 1e-9)
    busy_sum = sum(st["busy_s"] for st in stages.values())
    cpu_sum = sum(st["cpu_s"] for st in stages.values())
    bytes_put = sum(st["bytes_out"] for st in stages.values())
    bytes_get = sum(st["bytes_in"] for st in stages.values())
    return {
        "ok": True,
        "config": dataclasses.asdict(cfg),
        "redis_url": url,
        "namespace": namespace,
        "samples": cfg.samples,
        "trained": sum(n for n, _ in trained.values()),
        "trained_unique": sum(n for n, _ in trained.values()),
        "steps_trained": len(trained),
        "bytes_put": bytes_put,
        "bytes_get": bytes_get,
        "bytes_moved": bytes_put + bytes_get,
        "stages": stages,
        "startup_s": t_go - t_start,
        "wall_s": wall,
        "busy_sum_s": busy_sum,
        "cpu_sum_s": cpu_sum,
        "overlap": busy_sum / wall,
        "overlap_cpu": cpu_sum / wall,
        "cores": os.cpu_count(),
    }


def plot_timeline(cfg: DemoConfig, spans: list[Span], t0: float, summary: dict[str, Any], path: Path) -> Path:
    """Which stage worked on which micro-batch when: one lane per worker, colour = step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = roles(cfg)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.55 * len(lanes)), dpi=110)
    span_total = max((s.end - t0 for s in spans), default=1.0)
    for y, (stage, worker) in enumerate(lanes):
        for s in spans:
            if (s.stage, s.worker) != (stage, worker):
                continue
            ax.broken_barh(
                [(s.start - t0, max(s.duration, span_total / 2000))],
                (y - 0.38, 0.76),
                facecolors=colors(s.step % 10),
                edgecolors="black",
                linewidth=0.4,
            )
            if s.duration > span_total / 40:
                ax.text(s.start - t0 + s.duration / 2, y, str(s.n), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([STAGE_LABELS[st] + (f" {w}" if st == "rollout" else "") for st, w in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the workers were released (number in a bar: samples in the micro-batch)")
    ax.set_xlim(0, span_total * 1.01)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[Patch(color=colors(k % 10), label=f"step {k}") for k in range(cfg.steps)],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22 - 0.1 / len(lanes)),
        ncol=min(cfg.steps, 10),
        fontsize=8,
        frameon=False,
    )
    ax.set_title(
        f"tq-redis demo: {cfg.steps} steps x {cfg.batch} prompts x {cfg.n_samples} samples, "
        f"{cfg.workers} rollout workers, store {cfg.store} -- overlap {summary['overlap']:.2f}x "
        f"({summary['busy_sum_s']:.1f}s of stage work in {summary['wall_s']:.1f}s)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable summary printed at the end of a run."""
    cfg = summary["config"]
    trainer = summary["stages"]["trainer"]
    lines = [
        "",
        "summary",
        f"  samples      {summary['trained_unique']}/{summary['samples']} trained exactly once, "
        f"{summary['steps_trained']} steps; trainer micro-batches: {trainer['micro_batches']} "
        f"({trainer['batch_min']}-{trainer['batch_max']} samples"
        + (f", <= {cfg['max_tokens']} tokens each)" if cfg["max_tokens"] else ")"),
        f"  bytes moved  {format_size(summary['bytes_moved'])} (put {format_size(summary['bytes_put'])}, "
        f"get {format_size(summary['bytes_get'])}) through store {cfg['store']}",
        f"  {'stage':<14}{'busy':>8}{'cpu':>8}{'batches':>9}{'samples':>9}{'tokens':>9}",
    ]
    for stage in STAGES:
        st = summary["stages"][stage]
        label = STAGE_LABELS[stage] + (f" x{st['workers']}" if st["workers"] > 1 else "")
        lines.append(
            f"  {label:<14}{st['busy_s']:>7.2f}s{st['cpu_s']:>7.2f}s{st['micro_batches']:>9}"
            f"{st['samples']:>9}{st['tokens']:>9}"
        )
    lines += [
        f"  wall         {summary['wall_s']:.2f}s pipeline ({summary['startup_s']:.1f}s startup, "
        f"{summary['total_s']:.1f}s in all)",
        f"  overlap      {summary['overlap']:.2f}x: one stage after another would take {summary['busy_sum_s']:.2f}s "
        f"(the sum of busy times), pipelined they took {summary['wall_s']:.2f}s",
        f"               (busy = wall time inside a micro-batch; the stages used {summary['cpu_sum_s']:.2f}s CPU "
        f"on {summary['cores']} cores)",
        f"  timeline     {summary['timeline_png']}",
        f"demo OK: trained={summary['trained_unique']} expected={summary['samples']} "
        f"wall_s={summary['wall_s']:.2f} overlap={summary['overlap']:.2f}",
    ]
    return "\n".join(lines)
