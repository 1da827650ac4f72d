"""P5's compute-only schedule (benchmarks/p5_schedule.py) on pipelines small enough to work out by hand."""

from __future__ import annotations

import pytest

from benchmarks.p5_schedule import batch_durations, compute_only_wall


def _cfg(steps: int = 1, samples: int = 2, stage_batch: int = 1, micro_batch: int = 2, max_lag: int = 1) -> dict:
    return {
        "steps": steps, "samples_per_step": samples, "stage_batch": stage_batch, "micro_batch": micro_batch,
        "max_lag": max_lag,
    }  # fmt: skip


ONE_STEP = {"rollout": [[1.0, 1.0]], "reward": [[0.1, 0.1]], "ref": [[0.2, 0.2]], "trainer": [[0.5]]}


def test_with_a_core_per_worker_the_wall_time_is_the_critical_path():
    # rollout 0-1, 1-2 (one worker); ref of the second row ends at 2.2; the trainer's micro-batch 2.2-2.7
    assert compute_only_wall(ONE_STEP, _cfg(), workers=1, cores=8) == pytest.approx(2.7)
    # two rollout workers: both rows by 1.0; the one ref worker takes them in turn, 1.0-1.2-1.4; trainer to 1.9
    assert compute_only_wall(ONE_STEP, _cfg(), workers=2, cores=8) == pytest.approx(1.9)


def test_on_one_core_nothing_overlaps_so_the_wall_time_is_all_the_compute():
    assert compute_only_wall(ONE_STEP, _cfg(), workers=2, cores=1) == pytest.approx(2 + 0.2 + 0.4 + 0.5)


def test_a_step_is_fed_only_after_the_trainer_finished_the_step_max_lag_before_it():
    logs = {"rollout": [[1.0], [1.0]], "reward": [[0.0], [0.0]], "ref": [[0.0], [0.0]], "trainer": [[1.0], [1.0]]}
    cfg = _cfg(steps=2, samples=1, micro_batch=1, max_lag=0)
    assert compute_only_wall(logs, cfg, workers=1, cores=8) == pytest.approx(4.0)  # strictly one after the other
    cfg["max_lag"] = 1  # step 1 rolls out while the trainer works on step 0
    assert compute_only_wall(logs, cfg, workers=1, cores=8) == pytest.approx(3.0)


def test_batch_durations_merge_the_workers_in_start_order_per_step():
    logs = [(0, 5.0, 0.5), (1, 1.0, 9.0), (0, 2.0, 0.2), (0, 3.0, 0.3)]
    assert batch_durations(logs, 2) == [[0.2, 0.3, 0.5], [9.0]]


def test_a_log_that_cannot_finish_is_reported_not_looped_on():
    cfg = _cfg(samples=2, micro_batch=4)  # a micro-batch bigger than the step never fills
    with pytest.raises(RuntimeError, match="stalled"):
        compute_only_wall(ONE_STEP, cfg, workers=1, cores=2)
