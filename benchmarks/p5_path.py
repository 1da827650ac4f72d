"""P5's wall time along the trainer's path: where the time above the compute went.

The trainer is the pipeline's last stage, and the run ends when it finishes its last step, so the
wall time is the trainer's timeline. :func:`trainer_path` cuts that timeline into consecutive
pieces, which add up to the wall time exactly:

* **compute**: its micro-batches' compute (device or CPU seconds, as the run logged them);
* **waiting for rows**: from asking for a micro-batch until the last of its rows was stored by
  rollout, reward and ref (the pipeline filling up, or a stage running behind);
* **claims**: from then (or from the ask, when the rows were there already) until the claim
  returned with the data: the data system's latency for that hop;
* **glue**: from the claim's return to the compute's start (the worker's own handling of the batch);
* **between batches**: from a compute's end to the next ask (clearing the step's partition at
  each step's end, the worker's bookkeeping), before the first ask and after the last batch.

The compute-only schedule (:mod:`benchmarks.p5_schedule`) keeps the trainer waiting for rows too,
for ``bound - compute``; waiting beyond that is latency upstream (the other stages' claims and
puts on the critical path). So ``overhead = claims + glue + between + upstream``.

The split is made for device compute only: there a batch's compute is wall time on the path. On
shared cores (cpu mode) a batch takes longer than the CPU seconds the bound counts, by however
long its worker waited for a core, and that could not be told apart from the time between batches.

A row counts as stored when the ``put`` that wrote it returned; the rows may be visible a little
earlier (the put commits before it replies), so a claim can return before that moment: the
waiting then ends at the claim's return.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

TrainerBatch = tuple[int, float, float, float, float, Sequence[int]]
"""``(step, asked_at, returned_at, compute_started_at, compute_s, global_indexes)``; wall-clock times."""
StoredBatch = tuple[float, int, Sequence[int]]
"""``(stored_at, step, global_indexes)``: when a producing stage's ``put`` of those rows returned."""


def stored_at(puts: Iterable[StoredBatch]) -> dict[tuple[int, int], float]:
    """When each row ``(step, global index)`` had every producing stage's field: the latest of its puts."""
    ready: dict[tuple[int, int], float] = {}
    for at, step, indexes in puts:
        for index in indexes:
            key = (step, index)
            ready[key] = max(at, ready.get(key, at))
    return ready


def trainer_path(
    batches: Sequence[TrainerBatch], puts: Iterable[StoredBatch], start: float, end: float
) -> dict[str, Any]:
    """The trainer's timeline from ``start`` to ``end`` cut into compute, waiting for rows,
    claims, glue and time between batches (see the module docstring); seconds, plus the number
    of claims and their median latency in ms. A row no put logged counts as stored when asked."""
    ready = stored_at(puts)
    split = {"compute_s": 0.0, "waiting_s": 0.0, "claims_s": 0.0, "glue_s": 0.0, "between_s": 0.0}
    latencies = []
    last_end = start
    for step, asked, returned, started, compute_s, indexes in batches:
        rows_at = max((ready.get((step, i), asked) for i in indexes), default=asked)
        rows_at = min(max(rows_at, asked), returned)
        split["between_s"] += asked - last_end
        split["waiting_s"] += rows_at - asked
        split["claims_s"] += returned - rows_at
        split["glue_s"] += started - returned
        split["compute_s"] += compute_s
        latencies.append(returned - rows_at)
        last_end = started + compute_s
    split["between_s"] += end - last_end
    split["claims"] = len(latencies)
    split["claim_median_ms"] = 1e3 * statistics.median(latencies) if latencies else None
    return split


def overhead_split(path: dict[str, Any], bound: float) -> dict[str, float]:
    """The wall time above ``bound`` along the trainer's path: its claims, glue and time between
    batches, and the waiting for rows beyond what the compute-only schedule has it wait
    (``bound - compute``): latency upstream. They add up to ``wall - bound``."""
    return {
        "claims_s": path["claims_s"],
        "glue_s": path["glue_s"],
        "between_s": path["between_s"],
        "upstream_s": path["waiting_s"] - (bound - path["compute_s"]),
    }


def describe(split: dict[str, float], path: dict[str, Any]) -> str:
    """One line: ``overhead_split`` in ms, with the claims' count and median."""
    median = path.get("claim_median_ms")
    n = path["claims"]
    claims = f"{n} claim{'s' * (n != 1)}, median {median:.1f} ms" if median is not None else "no claims"
    return (
        f"its claims {1e3 * split['claims_s']:.0f} ms ({claims}), its glue {1e3 * split['glue_s']:.0f} ms, "
        f"between batches {1e3 * split['between_s']:.0f} ms, waiting for rows beyond the schedule "
        f"{1e3 * split['upstream_s']:.0f} ms"
    )
