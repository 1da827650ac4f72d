"""P5's CPU accounting (benchmarks/p5_accounting.py): the server processes' CPU read from /proc,
and the split of the machine's CPU over a run."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.p5_accounting import cpu_split, describe_cpu, parent_pid, tree_cpu_delta, tree_cpu_seconds

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "all.json"


def _spin_for(seconds: float, ready, go) -> None:
    ready.set()
    go.wait(30)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _parent_of_a_sleeper(started, done) -> None:
    grandchild = mp.get_context("fork").Process(target=done.wait, args=(30,))
    grandchild.start()
    started.put(grandchild.pid)
    grandchild.join(30)


def test_a_process_left_out_takes_its_children_with_it():
    ctx = mp.get_context("fork")
    started, done = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=done.wait, args=(30,))
    worker = ctx.Process(target=_parent_of_a_sleeper, args=(started, done))
    server.start()
    worker.start()
    try:
        grandchild = started.get(timeout=30)
        every = tree_cpu_seconds(os.getpid())
        servers = tree_cpu_seconds(os.getpid(), exclude=[worker.pid])
        parents = (parent_pid(worker.pid), parent_pid(grandchild))
    finally:
        done.set()
        server.join(30)
        worker.join(30)
    assert {server.pid, worker.pid, grandchild} <= set(every)
    assert server.pid in servers and worker.pid not in servers and grandchild not in servers
    assert tree_cpu_delta(None, servers) is None
    assert parents == (os.getpid(), worker.pid)
    assert parent_pid(None) == 0 and parent_pid(worker.pid) == 0  # gone once joined


def test_a_spinning_child_reads_its_cpu_while_it_runs():
    ctx = mp.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_spin_for, args=(0.5, ready, go))
    child.start()
    try:
        assert ready.wait(30)
        before = tree_cpu_seconds(os.getpid())
        go.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = tree_cpu_seconds(os.getpid())
            if now.get(child.pid, 0.0) - before.get(child.pid, 0.0) >= 0.3:
                break
            time.sleep(0.05)
        assert tree_cpu_delta(before, now) >= 0.3
    finally:
        go.set()
        child.join(30)


def test_the_split_tells_the_calls_from_the_glue_and_the_servers_from_the_os():
    stages = {
        "rollout": {"compute_cpu_s": 1.0, "cpu_s": 1.3, "claim_cpu_s": 0.1, "put_cpu_s": 0.1},
        "trainer": {"compute_cpu_s": 0.5, "cpu_s": 0.6, "claim_cpu_s": 0.05, "put_cpu_s": 0.0},
    }
    split = cpu_split({"stages": stages}, (10.0, 5.0), (12.4, 5.2), 1.2, servers_s=0.3)
    assert split["compute_s"] == pytest.approx(1.5)
    assert split["data_calls_s"] == pytest.approx(0.25)
    assert split["workers_glue_s"] == pytest.approx(0.15)
    assert split["servers_s"] == 0.3 and split["os_and_other_s"] == pytest.approx(2.4 - 1.9 - 0.3)
    text = describe_cpu(split)
    assert "calls to the data system 0.25 s and their own glue 0.15 s, servers 0.30 s, OS and the rest 0.20 s" in text


def test_the_readme_says_what_the_ten_percent_goal_leaves_on_this_machines_cores():
    merged = json.loads(RESULTS.read_text())
    merged["machine"]["cpu_count"] = 2
    doc = merged["measures"]["p5_pipeline"]["results"]
    doc["tq_redis"]["compute_bound_s"] = 0.8
    doc["tq_redis"]["cpu"] = {
        "compute_s": 1.6, "workers_other_s": 0.3, "data_calls_s": 0.24, "workers_glue_s": 0.06, "span_s": 1.1,
        "machine_idle_s": 0.1, "servers_s": 0.1, "os_and_other_s": 0.07,
    }  # fmt: skip
    doc["reference"].pop("cpu", None)
    section = report.build_section(merged)
    assert "with CPU compute (core-seconds, median round): tq-redis: stage compute 1.60 s" in section
    assert "2 cores × 1.1 × 0.800 s = 1.76 core-seconds, 1.60 of them the compute: that leaves 0.160" in section
    assert "(the benchmark's, not the data system's calls) used 0.160 before any client call" in section
