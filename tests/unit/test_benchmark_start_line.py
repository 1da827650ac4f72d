"""P3 and P5 release their workers only after every one attached and the machine settled."""

from __future__ import annotations

import multiprocessing as mp
import time

from benchmarks.reference import at_start_line, start_workers


def _worker(barrier, attached, released, release_times) -> None:
    with attached.get_lock():
        attached.value += 1
    at_start_line(barrier, 30)
    with released.get_lock():
        slot = released.value
        released.value += 1
    release_times[slot] = time.time()


def test_settle_runs_after_every_worker_attached_and_before_any_is_released():
    ctx = mp.get_context("fork")
    n = 3
    barrier = ctx.Barrier(n + 1)
    attached, released = ctx.Value("i", 0), ctx.Value("i", 0)
    release_times = ctx.Array("d", n)
    seen: dict[str, float] = {}

    def settle() -> str:
        seen["attached"], seen["released"] = attached.value, released.value
        time.sleep(0.2)  # a settle that takes a while: no worker may start meanwhile
        seen["settled_at"] = time.time()
        return "quiet"

    procs: list = []
    jobs = [(f"w{i}", (barrier, attached, released, release_times)) for i in range(n)]
    started = start_workers(ctx, procs, _worker, jobs, barrier, 30, settle)
    for proc in procs:
        proc.join(timeout=30)
    assert seen["attached"] == n and seen["released"] == 0
    assert started.settled == "quiet"
    assert released.value == n
    assert min(release_times) >= seen["settled_at"]
    assert started.wall >= seen["settled_at"] and started.attach_s > 0


def test_without_settle_the_workers_start_once_all_attached():
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(3)
    attached, released = ctx.Value("i", 0), ctx.Value("i", 0)
    release_times = ctx.Array("d", 2)
    procs: list = []
    jobs = [(f"w{i}", (barrier, attached, released, release_times)) for i in range(2)]
    started = start_workers(ctx, procs, _worker, jobs, barrier, 30)
    for proc in procs:
        proc.join(timeout=30)
    assert started.settled is None and released.value == 2
