"""P5's compute-only schedule: the pipeline's wall time if moving data cost nothing.

:func:`compute_only_wall` replays the pipeline of :mod:`benchmarks.p5_pipeline` with each stage's
batches taking exactly the compute they took in the run (their CPU seconds, in the order each
stage claimed them) and everything else -- claims, data movement, waking up -- taking no time.
The dependencies are the pipeline's: a step's rows are rolled out once the step is fed; reward
and ref each take a rolled-out batch; the trainer takes a micro-batch once enough rows have all
three; step ``k`` is fed once the trainer has finished step ``k - max_lag - 1``. At most
``cores`` batches compute at once (a batch keeps its core until it is done; workers waiting for
a core get one in the order they became ready). The longest dependency chain (the critical
path) is part of it: the time the single trainer cannot start before its rows exist, and the
drain after the last rollout.

A measured wall time above this schedule is overhead of the data system and the workers' glue,
not of the workload. Greedy scheduling is not always optimal, so this is the compute-bound wall
time of *this* pipeline's policy rather than a proof no schedule could be faster; the caller
takes the larger of it and the plain bounds (busiest stage over its workers, all compute over
the cores), which are.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STAGE_ORDER = ("rollout", "reward", "ref", "trainer")


def batch_durations(logs: Iterable[tuple[int, float, float]], steps: int) -> list[list[float]]:
    """Per step, the compute seconds of a stage's batches in the order they started (all of the
    stage's workers merged); ``logs`` holds ``(step, started_at, seconds)``."""
    per_step: list[list[tuple[float, float]]] = [[] for _ in range(steps)]
    for step, started, seconds in logs:
        per_step[step].append((started, seconds))
    return [[s for _, s in sorted(batches)] for batches in per_step]


@dataclass
class _Worker:
    stage: str
    busy_until: float = 0.0
    ready_since: float = 0.0
    step: int = 0  # reward, ref, trainer: the step they are on
    task: tuple[str, int, int] | None = None  # (stage, step, batch index) being computed


@dataclass
class _State:
    steps: int
    batches: int  # rollout / reward / ref batches per step
    micro_batches: int
    rows_per_micro_per_batch: float  # micro-batch rows / stage-batch rows
    fed_at: dict[int, float] = field(default_factory=dict)
    claimed: dict[str, list[int]] = field(default_factory=dict)  # stage -> batches claimed per step
    done_at: dict[str, list[list[float]]] = field(default_factory=dict)  # stage -> per step completion times

    def rows_ready(self, step: int) -> int:
        """Stage batches of ``step`` that rollout, reward and ref have all finished."""
        return min(len(self.done_at[s][step]) for s in ("rollout", "reward", "ref"))


def compute_only_wall(durations: dict[str, list[list[float]]], cfg: dict[str, Any], workers: int, cores: int) -> float:
    """Seconds the pipeline takes when only compute costs time (see the module docstring).

    ``durations``: per stage of :data:`STAGE_ORDER`, per step, the batches' compute seconds in
    claim order (:func:`batch_durations`); ``cfg`` is P5's configuration; ``workers`` the rollout
    workers; ``cores`` the cores they share.
    """
    steps, per_step = cfg["steps"], cfg["samples_per_step"]
    st = _State(
        steps=steps,
        batches=per_step // cfg["stage_batch"],
        micro_batches=per_step // cfg["micro_batch"],
        rows_per_micro_per_batch=cfg["micro_batch"] / cfg["stage_batch"],
    )
    for stage in STAGE_ORDER:
        st.claimed[stage] = [0] * steps
        st.done_at[stage] = [[] for _ in range(steps)]
    for k in range(min(steps, cfg["max_lag"] + 1)):
        st.fed_at[k] = 0.0
    pool = [_Worker("rollout") for _ in range(workers)] + [_Worker(s) for s in ("reward", "ref", "trainer")]
    running: list[tuple[float, int]] = []  # (ends at, worker index)
    now, free = 0.0, cores
    while True:
        # hand free cores to the workers that have something to compute, longest waiting first
        for i in sorted(range(len(pool)), key=lambda i: pool[i].ready_since):
            w = pool[i]
            if free == 0:
                break
            if w.task is not None:
                continue
            task = _next_task(w, st, now)
            if task is None:
                continue
            stage, step, index = task
            w.task = task
            st.claimed[stage][step] += 1
            seconds = _duration(durations, stage, step, index)
            heapq.heappush(running, (now + seconds, i))
            free -= 1
        if not running:
            raise RuntimeError("compute-only schedule stalled: no batch can run (inconsistent batch log)")
        now, i = heapq.heappop(running)
        free += 1
        w = pool[i]
        stage, step, _ = w.task  # type: ignore[misc]
        w.task, w.ready_since = None, now
        st.done_at[stage][step].append(now)
        if stage == "trainer" and len(st.done_at["trainer"][step]) == st.micro_batches:
            w.step = step + 1
            if step + 1 == steps:
                return now
            st.fed_at.setdefault(step + cfg["max_lag"] + 1, now)
        elif stage in ("reward", "ref") and len(st.done_at[stage][step]) == st.batches:
            w.step = step + 1


def _next_task(w: _Worker, st: _State, now: float) -> tuple[str, int, int] | None:
    """What worker ``w`` can start now: ``(stage, step, batch index)``, or None."""
    if w.stage == "rollout":
        for step in range(st.steps):  # workers roll out the earliest fed step with rows left
            if st.fed_at.get(step, float("inf")) <= now and st.claimed["rollout"][step] < st.batches:
                return "rollout", step, st.claimed["rollout"][step]
        return None
    step = w.step
    if step >= st.steps:
        return None
    index = st.claimed[w.stage][step]
    if w.stage in ("reward", "ref"):
        return (w.stage, step, index) if index < len(st.done_at["rollout"][step]) else None
    needed = (index + 1) * st.rows_per_micro_per_batch  # stage batches the next micro-batch spans
    return ("trainer", step, index) if index < st.micro_batches and st.rows_ready(step) >= needed else None


def _duration(durations: dict[str, list[list[float]]], stage: str, step: int, index: int) -> float:
    batches = durations.get(stage, [])
    if step >= len(batches) or index >= len(batches[step]):
        return 0.0  # not logged (a stage with no compute of its own)
    return batches[step][index]
