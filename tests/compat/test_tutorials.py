"""The reference's tutorials, from the same downloaded wheel, run unchanged through the alias.

Each runs as its own program with the alias stub first on ``PYTHONPATH`` (what
``python -m tq_redis.compat --pythonpath`` prints), so ``import transfer_queue`` in it, and in
the Ray workers it starts, is tq-redis. A tutorial passes when it exits 0 with no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.compat import reference_suite

TUTORIALS = (
    "01_core_components.py",
    "02_kv_interface.py",
    "03_metadata_concepts.py",
    "04_understanding_controller.py",
    "05_custom_sampler.py",
    "06_streaming_dataloader.py",
)
_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tutorial_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tutorials")
    with zipfile.ZipFile(reference_suite.reference_wheel()) as zf:
        members = [m for m in zf.namelist() if m.startswith("tutorial/")]
        zf.extractall(out, members)
    return out / "tutorial"


@pytest.fixture(scope="module")
def alias_pythonpath() -> str:
    stub = subprocess.run([sys.executable, "-m", "tq_redis.compat", "--pythonpath"], cwd=_REPO,
                          capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert (Path(stub) / "transfer_queue").is_dir(), stub
    return os.pathsep.join((stub, str(_REPO)))


@pytest.mark.slow  # each starts Ray: ~20 s apiece, so CI runs them beside the soak tests
@pytest.mark.parametrize("tutorial", TUTORIALS)
def test_reference_tutorial_runs_unchanged(tutorial, tutorial_dir, alias_pythonpath, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TQ_REDIS_URL", "TQ_NAMESPACE", "RAY_ADDRESS")}
    env.update(PYTHONPATH=alias_pythonpath, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, str(tutorial_dir / tutorial)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{tutorial} exited {proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
