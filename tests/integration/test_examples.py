"""Every example runs as its own program (``python examples/X.py``), exits 0 and says it succeeded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# example file -> the line it prints when everything it checked held
EXAMPLES = {
    "kv_replay_buffer.py": "kv_replay_buffer OK",
    "verl_single_controller.py": "verl_single_controller OK",
    "streaming_dataloader.py": "streaming_dataloader OK",
    "channel.py": "channel OK",
    "transfer_dock.py": "transfer_dock OK",
    "pipeline.py": "pipeline OK: 64 samples",
    "ray_placement.py": "ray_placement OK",
    "watch_replay_buffer.py": "watch_replay_buffer OK",
    "async_grpo.py": "async_grpo OK",
    "rate_limited_replay.py": "rate_limited_replay OK",
    "durable_resume.py": "durable_resume OK",
}
# Examples that start a local Ray (~20 s here) run in CI's "soak or slow" step.
SLOW = {"ray_placement.py"}
# small sizes for the examples that take options
ARGS = {"pipeline.py": ["--steps", "2", "--batch", "32"]}


@pytest.mark.parametrize(
    "example", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in sorted(EXAMPLES)]
)
def test_example_runs(example):
    env = {k: v for k, v in os.environ.items() if k not in ("TQ_REDIS_URL", "TQ_NAMESPACE")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), *ARGS.get(example, [])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"{example} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert EXAMPLES[example] in proc.stdout, proc.stdout[-3000:]
