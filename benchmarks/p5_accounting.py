"""P5's efficiency figures: the plain compute bounds of the wall time, and where the CPU went.

:func:`compute_bound` is the larger of the busiest stage's compute over its workers and all the
compute over the lanes that run it (:func:`compute_lanes`: the cores in ``cpu`` compute mode, one
per worker in ``device`` mode, see :mod:`benchmarks.p5_compute`); ``benchmarks/p5_pipeline.py``
takes the larger of it and the compute-only schedule (:mod:`benchmarks.p5_schedule`).
:func:`cpu_split` splits the machine's CPU over a run (``/proc/stat``) into the stages' compute,
the rest of the workers' CPU, and the servers and the OS.
"""

from __future__ import annotations

import os
from typing import Any


def compute_lanes(cfg: dict[str, Any]) -> int:
    """How many batches can compute at once: the machine's cores when the compute runs on them
    (``cpu``), one per worker when each has its own device (``device``)."""
    if cfg["compute"] == "device":
        return cfg["workers"] + 3  # rollout workers + reward, ref, trainer (the feeder computes nothing)
    return os.cpu_count() or 1


def compute_bound(stages: dict[str, dict[str, Any]], cores: int | None = None) -> float:
    """The wall time the pipeline needs at least for its compute alone: the larger of the busiest
    stage's compute spread over its workers (a stage cannot go faster than its workers) and all the
    compute spread over the cores that run it (``min(cores, workers)``). Same work in both systems
    (same seeds, same tokens), so the wall time above it is each system's overhead: waiting, data
    movement, coordination."""
    cores = cores or os.cpu_count() or 1
    workers = sum(s["workers"] for s in stages.values())
    total = sum(s["compute_s"] for s in stages.values())
    per_stage = max((s["compute_s"] / s["workers"] for s in stages.values() if s["workers"]), default=0.0)
    return max(per_stage, total / max(1, min(cores, workers)))



def machine_cpu_seconds() -> tuple[float, float] | None:
    """``(busy, idle)`` CPU seconds of the whole machine so far (``/proc/stat``); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / tick, idle / tick


def cpu_split(
    result: dict[str, Any], before: tuple[float, float] | None, after: tuple[float, float] | None, elapsed: float
) -> dict[str, Any]:
    """Where the machine's CPU went while the pipeline ran: the stages' compute (in device mode,
    only the CPU of their real work: the device time is not the host's), the rest of the workers'
    CPU (clients, encoding, their own glue), everything else busy (Redis or the controller,
    storage units, the OS) and idle. Machine figures span ``elapsed`` (to the last
    report), a little more than the pipeline's wall time."""
    stages = result["stages"].values()
    compute = sum(s["compute_cpu_s"] for s in stages)
    workers = sum(s["cpu_s"] for s in stages)
    split: dict[str, Any] = {"compute_s": compute, "workers_other_s": workers - compute, "span_s": elapsed}
    if before and after:
        busy, idle = after[0] - before[0], after[1] - before[1]
        split.update(machine_busy_s=busy, machine_idle_s=idle, servers_and_os_s=busy - workers)
    return split


def print_cpu(name: str, cpu: dict[str, Any]) -> None:
    """Print :func:`cpu_split`'s figures on one line."""
    line = (
        f"[{name}] CPU over {cpu['span_s']:.2f} s: stage compute {cpu['compute_s']:.2f} s, "
        f"workers' other CPU {cpu['workers_other_s']:.2f} s"
    )
    if "machine_busy_s" in cpu:
        line += f", servers + OS {cpu['servers_and_os_s']:.2f} s, idle {cpu['machine_idle_s']:.2f} s"
    print(line, flush=True)
