"""``tq-redis demo`` end to end with small sizes: it trains every sample exactly once, prints its
summary, writes a valid timeline PNG, fails fast and clearly when a worker fails, and leaves no
process behind either way.

Stray processes are found by an environment marker: every process the demo starts (workers, the
forkserver, the embedded Valkey, the storage nodes) inherits the demo's environment, and reparenting
after the demo exits does not change it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find stray processes")

MARK = "TQ_DEMO_TEST_MARK"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _marked_pids(mark: str) -> list[int]:
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not ours
        if needle in env:
            pids.append(int(entry))
    return pids


def _stray_processes(mark: str, grace_s: float = 10.0) -> list[str]:
    """Processes still carrying the marker after a grace period (exiting ones get time to go)."""
    deadline = time.monotonic() + grace_s
    while True:
        pids = _marked_pids(mark)
        if not pids or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # waiting for process exit: there is nothing to block on for a non-child
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid}: {cmdline}")
        except OSError:
            pass
    return out


def _run_demo(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, str]:
    mark = uuid.uuid4().hex
    env = dict(os.environ, **{MARK: mark})
    for name in ("TQ_REDIS_URL", "TQ_NAMESPACE"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "tq_redis.demo.main", "--out", str(tmp_path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp_path)
    return proc, mark


def test_demo_trains_every_sample_once_and_draws_the_timeline(tmp_path):
    started = time.monotonic()
    proc, mark = _run_demo(tmp_path, "--steps", "2", "--batch", "8", "--max-tokens", "700")
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    expected = 2 * 8 * 4  # steps x prompts x samples per prompt
    assert f"demo OK: trained={expected} expected={expected}" in out, out
    for line in ("summary", f"{expected}/{expected} trained exactly once", "bytes moved", "overlap", "wall"):
        assert line in out, f"{line!r} missing from:\n{out}"
    # not a terminal: plain progress lines, one per stage and step, no escape sequences
    assert "\x1b[" not in out
    for stage in ("prompt feeder", "rollout", "reward", "ref log-prob", "trainer"):
        assert f"{stage:<13} step 1: 32 samples" in out, f"no progress line for {stage}:\n{out}"

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trained"] == summary["trained_unique"] == summary["samples"] == expected
    assert summary["steps_trained"] == 2
    assert summary["bytes_moved"] > 0 and summary["wall_s"] > 0
    for stage in ("feeder", "rollout", "reward", "ref", "trainer"):
        assert summary["stages"][stage]["samples"] == expected, stage
        assert summary["stages"][stage]["busy_s"] > 0, stage
    assert summary["overlap"] == pytest.approx(summary["busy_sum_s"] / summary["wall_s"])
    assert summary["stages"]["trainer"]["batch_max"] <= summary["config"]["micro_batch"]
    # streaming, not stage after stage: the reward worker starts before rollout has finished the step
    spans = json.loads((tmp_path / "spans.json").read_text())
    first_reward = min(s["start"] for s in spans if s["stage"] == "reward" and s["step"] == 0)
    last_rollout = max(s["end"] for s in spans if s["stage"] == "rollout" and s["step"] == 0)
    assert first_reward < last_rollout
    # token-budget batches: every trainer micro-batch fits max_tokens (prompt + response tokens)
    trainer_tokens = [s["tokens"] for s in spans if s["stage"] == "trainer"]
    assert trainer_tokens and max(trainer_tokens) <= 700

    png = tmp_path / "demo_timeline.png"
    assert Path(summary["timeline_png"]).resolve() == png.resolve()
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    image = mpimg.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300

    assert _stray_processes(mark) == []
    assert elapsed < 120, f"the demo took {elapsed:.0f}s"


def test_demo_fails_fast_and_cleanly_when_a_worker_fails(tmp_path):
    proc, mark = _run_demo(
        tmp_path, "--steps", "1", "--batch", "2", "--workers", "1", "--fail-stage", "reward", timeout=90
    )
    assert proc.returncode == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "tq-redis demo FAILED: the reward worker 0 failed: RuntimeError: injected failure" in proc.stderr
    assert "demo OK" not in proc.stdout
    assert _stray_processes(mark) == []
