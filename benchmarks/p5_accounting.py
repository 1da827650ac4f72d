"""P5's efficiency figures: the plain compute bounds of the wall time, and where the CPU went.

:func:`compute_bound` is the larger of the busiest stage's compute over its workers and all the
compute over the lanes that run it (:func:`compute_lanes`: the cores in ``cpu`` compute mode, one
per worker in ``device`` mode, see :mod:`benchmarks.p5_compute`); ``benchmarks/p5_pipeline.py``
takes the larger of it and the compute-only schedule (:mod:`benchmarks.p5_schedule`).
:func:`cpu_split` splits the machine's CPU over a run (``/proc/stat``) into the stages' compute,
the workers' calls to the data system, the workers' own glue, the system's server processes
(:func:`tree_cpu_seconds`), the rest (the OS, the harness) and idle.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
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


def _proc_stat(pid: str) -> tuple[int, float] | None:
    """``(parent pid, CPU seconds so far)`` of process ``pid`` from ``/proc/<pid>/stat``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parent_pid(pid: int | None) -> int:
    """The parent of process ``pid`` (a worker's forkserver, say); 0 when it cannot be read."""
    stat = _proc_stat(str(pid)) if pid else None
    return stat[0] if stat else 0


def tree_cpu_seconds(root: int, exclude: Iterable[int] = ()) -> dict[int, float] | None:
    """CPU seconds (user + system) used so far by each live process descending from ``root`` (not
    ``root`` itself), leaving out ``exclude`` and everything below them: the system's server
    processes (Redis and the storage units, or the reference's Ray processes) when ``root`` is
    the benchmark's parent and ``exclude`` its workers and their forkserver. Keyed by pid, so a
    process that started or ended between two readings can be told apart. None without ``/proc``."""
    if not os.path.isdir("/proc"):
        return None
    stats = {int(p): st for p in os.listdir("/proc") if p.isdigit() and (st := _proc_stat(p)) is not None}
    skip = set(exclude)
    out: dict[int, float] = {}
    for pid, (_, cpu) in stats.items():
        node, inside = pid, False
        while node in stats and node not in skip:
            parent = stats[node][0]
            if parent == root:
                inside = True
                break
            node = parent
        if inside:
            out[pid] = cpu
    return out


def tree_cpu_delta(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    """CPU seconds the processes of two :func:`tree_cpu_seconds` readings used in between (a
    process that started in between counts from zero; one that ended is lost, at most its last tick)."""
    if before is None or after is None:
        return None
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


def cpu_split(
    result: dict[str, Any], before: tuple[float, float] | None, after: tuple[float, float] | None, elapsed: float,
    servers_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Where the machine's CPU went while the pipeline ran: the stages' compute (in device mode,
    only the CPU of their real work: the device time is not the host's), the workers' calls to the
    data system (their claims, reads and puts), the rest of the workers' CPU (their own glue:
    building and checking the tensors), the system's server processes (``servers_s``: Redis and
    the storage units, or the reference's Ray processes), everything else busy (the OS, the
    harness) and idle. Machine figures span ``elapsed`` (to the last report), a little more than
    the pipeline's wall time."""
    stages = result["stages"].values()
    compute = sum(s["compute_cpu_s"] for s in stages)
    workers = sum(s["cpu_s"] for s in stages)
    calls = sum(s["claim_cpu_s"] + s["put_cpu_s"] for s in stages)
    split: dict[str, Any] = {
        "compute_s": compute,
        "workers_other_s": workers - compute,
        "data_calls_s": calls,
        "workers_glue_s": workers - compute - calls,
        "span_s": elapsed,
    }
    if before and after:
        busy, idle = after[0] - before[0], after[1] - before[1]
        split.update(machine_busy_s=busy, machine_idle_s=idle, servers_and_os_s=busy - workers)
        if servers_s is not None:
            split.update(servers_s=servers_s, os_and_other_s=busy - workers - servers_s)
    return split


def print_cpu(name: str, cpu: dict[str, Any]) -> None:
    """Print :func:`cpu_split`'s figures on one line."""
    print(f"[{name}] CPU over {cpu['span_s']:.2f} s: {describe_cpu(cpu)}", flush=True)


def describe_cpu(cpu: dict[str, Any]) -> str:
    """:func:`cpu_split`'s figures in words, core-seconds."""
    line = f"stage compute {cpu['compute_s']:.2f} s, "
    if "data_calls_s" in cpu:
        line += (
            f"the workers' calls to the data system {cpu['data_calls_s']:.2f} s "
            f"and their own glue {cpu['workers_glue_s']:.2f} s"
        )
    else:  # a result written before the calls were told apart
        line += f"workers' other CPU {cpu['workers_other_s']:.2f} s"
    if "servers_s" in cpu:
        # the two readings come from different clocks (per-process times, /proc/stat's ticks): a
        # remainder within a tick or two of zero may come out a little negative
        line += f", servers {cpu['servers_s']:.2f} s, OS and the rest {max(0.0, cpu['os_and_other_s']):.2f} s"
    elif "machine_busy_s" in cpu:
        line += f", servers + OS {cpu['servers_and_os_s']:.2f} s"
    if "machine_idle_s" in cpu:
        line += f", idle {cpu['machine_idle_s']:.2f} s"
    return line
