"""What test_tutorials.py and test_recipes.py share: the reference's programs, from its downloaded wheel,
and how one runs unchanged through the alias.

Each runs as its own program with the alias stub first on ``PYTHONPATH`` (what
``python -m tq_redis.integrations.alias --pythonpath`` prints), so ``import transfer_queue`` in it, and in
the Ray workers it starts, is tq-redis. A program passes when it exits 0 with no traceback. The two
files are apart so that CI's workers run the tutorials and the recipes side by side.
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
#: what users copy to start (each with its default arguments): a multi-turn agent loop on the KV
#: API with Ray workers, and a Relax-like streaming pipeline that finds the named controller
RECIPES = (
    "simple_use_case/single_controller_demo.py",
    "simple_use_case/relax_demo.py",
)
_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    with zipfile.ZipFile(reference_suite.reference_wheel()) as zf:
        members = [m for m in zf.namelist() if m.startswith(("tutorial/", "recipe/"))]
        zf.extractall(out, members)
    return out


@pytest.fixture(scope="module")
def tutorial_dir(wheel_dir) -> Path:
    return wheel_dir / "tutorial"


@pytest.fixture(scope="module")
def alias_pythonpath() -> str:
    stub = subprocess.run([sys.executable, "-m", "tq_redis.integrations.alias", "--pythonpath"], cwd=_REPO,
                          capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert (Path(stub) / "transfer_queue").is_dir(), stub
    return os.pathsep.join((stub, str(_REPO)))


def run_unchanged(script: Path, alias_pythonpath: str, cwd: Path, timeout: int) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TQ_REDIS_URL", "TQ_NAMESPACE", "RAY_ADDRESS")}
    env.update(PYTHONPATH=alias_pythonpath, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]


