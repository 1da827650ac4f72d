"""verl's calls of ``transfer_queue`` (``examples/verl_kv_flow.py``) run unchanged on tq-redis.

The example replays verl's TransferQueue trainer step by step through the ``transfer_queue``
alias and prints one ``step N/M: ... ok`` line per step. Each test runs it as its own program on
the embedded default and requires every step, in order, to have passed:

* in one process (what ``python examples/verl_kv_flow.py`` does);
* with ``--ray``: the agent loop workers are async Ray actors and the log-prob workers Ray tasks;
  each calls ``tq.init()`` with no arguments and must attach to the system the driver started
  (the example checks the worker's URL and namespace against the driver's, and its pid).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "verl_kv_flow.py"
STEP = re.compile(r"^step (\d+)/(\d+): (.*)$")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TQ_REDIS_URL", "TQ_NAMESPACE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _assert_every_step_passed(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """Parse the step lines; every step 1..M must be reported once, in order, and end in ``ok``."""
    report = f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    steps = [m.groups() for m in map(STEP.match, proc.stdout.splitlines()) if m]
    assert steps, f"the example printed no step lines\n{report}"
    total = int(steps[0][1])
    assert [int(n) for n, _, _ in steps] == list(range(1, total + 1)), f"steps missing or out of order\n{report}"
    assert all(int(m) == total for _, m, _ in steps)
    failed = [f"step {n}: {text}" for n, _, text in steps if not text.endswith("... ok")]
    assert not failed, "verl's flow failed at:\n" + "\n".join(failed) + f"\n{report}"
    assert proc.returncode == 0, report
    assert f"verl_kv_flow OK: {total}/{total} steps passed" in proc.stdout, report
    return [text for _, _, text in steps]


def test_verl_flow_runs_every_step_in_one_process():
    steps = _assert_every_step_passed(_run(timeout=240))
    assert len(steps) >= 16
    assert any("in this process" in s for s in steps)


@pytest.mark.slow  # ~45 s: Ray starts its worker processes three times; CI runs it in the "soak or slow" step
def test_verl_flow_with_workers_in_ray():
    pytest.importorskip("ray")
    proc = _run("--ray", timeout=420)
    steps = _assert_every_step_passed(proc)
    assert "(workers in Ray)" in proc.stdout
    rollout = next(s for s in steps if s.startswith("agent loop"))
    bridge = next(s for s in steps if s.startswith("worker bridge"))
    assert "in Ray actors" in rollout, rollout
    assert "Ray worker process" in bridge, bridge
