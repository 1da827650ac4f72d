"""P5's two ways of computing a batch (benchmarks/p5_compute.py): CPU work, or known device time."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.p5_accounting import compute_lanes
from benchmarks.p5_compute import SPIN_TAIL_S, Compute, _wait_until
from tq_redis.demo import workload as wl


def test_device_time_is_the_stage_cost_times_the_tokens():
    compute = Compute("device", device_us_per_token=100)
    assert compute.device_seconds("rollout", 1000) == pytest.approx(0.1)
    assert compute.device_seconds("trainer", 1000) == pytest.approx(0.1 * wl.STAGE_COST["trainer"])
    assert compute.device_seconds("reward", 0) == 0


def test_a_device_batch_holds_its_worker_for_the_known_time_and_logs_it():
    compute, log = Compute("device", device_us_per_token=1000), []
    t0 = time.perf_counter()
    with compute.batch("rollout", 20, log):  # 20 ms of device time, next to no real work
        pass
    waited = time.perf_counter() - t0
    assert log == [pytest.approx(0.02)]
    assert waited >= 0.02
    assert compute.late_s == pytest.approx(waited - 0.02, abs=2e-3)  # the wake-up came that much later


def test_the_wait_sleeps_then_spins_its_tail_and_never_ends_early():
    deadline = time.perf_counter() + 0.01
    cpu0 = time.thread_time()
    _wait_until(deadline)
    ended, spun = time.perf_counter(), time.thread_time() - cpu0
    assert ended >= deadline
    assert spun < 0.01 - SPIN_TAIL_S / 2  # most of it slept: a busy wait would have used ~10 ms of CPU
    _wait_until(time.perf_counter() - 1)  # a deadline already past returns at once


def test_real_work_longer_than_the_device_time_is_what_the_batch_took():
    compute, log = Compute("device", device_us_per_token=1), []
    with compute.batch("reward", 10, log):  # 2 µs of device time
        time.sleep(0.01)
    assert log[0] >= 0.01
    assert compute.late_s == 0  # no wait was needed


def test_a_cpu_batch_logs_its_cpu_time_including_the_burn():
    compute, light, heavy = Compute("cpu"), [], []
    with compute.batch("trainer", 1, light):
        pass
    with compute.batch("trainer", 2000, heavy):  # 1000 burn units
        pass
    assert 0 <= light[0] < heavy[0]
    t0 = time.perf_counter()
    with compute.batch("reward", 1000, []):
        time.sleep(0.02)  # sleeping is not computing: thread_time does not count it
    assert time.perf_counter() - t0 >= 0.02


def test_rollout_rows_are_real_in_both_modes():
    policy, prompt = wl.policy_model(0), torch.tensor([3, 1, 4])
    for mode in ("cpu", "device"):
        tokens, logps = Compute(mode).generate(policy, prompt, 7, wl.generator(0, 5))
        assert tokens.shape == logps.shape == (7,)
        assert tokens.dtype == torch.int64 and bool(((tokens >= 0) & (tokens < wl.VOCAB)).all())
        assert bool((logps <= 0).all())
    # device mode scores its tokens with the policy: the same log-probs a teacher-forced pass gives
    tokens, logps = Compute("device").generate(policy, prompt, 7, wl.generator(0, 5))
    assert torch.allclose(logps, policy.token_log_probs([prompt], [tokens]))
    again, _ = Compute("device").generate(policy, prompt, 7, wl.generator(0, 5))
    assert torch.equal(tokens, again)  # same generator key, same rows


def test_bad_modes_and_times_are_refused():
    with pytest.raises(ValueError, match="cpu"):
        Compute("gpu")
    with pytest.raises(ValueError, match="positive"):
        Compute("device", device_us_per_token=0)


def test_the_bound_runs_over_the_cores_or_over_the_workers():
    assert compute_lanes({"compute": "cpu", "workers": 2}) >= 1  # this machine's cores
    assert compute_lanes({"compute": "device", "workers": 2}) == 5  # 2 rollout + reward, ref, trainer
