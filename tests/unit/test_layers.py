"""The package's layers and its freedom from import cycles, as ``lint-imports`` checks them.

The contracts live in pyproject.toml (``[tool.importlinter]``): a layers contract over the
subpackages of ``tq_redis`` and an acyclic-siblings contract for the modules of every package.
Lazy (function-level) and ``TYPE_CHECKING`` imports count. The other tests break a copy of the
package on purpose and check that the linter says where, so a contract that checks nothing
(a typo in a layer name, a setting that drops lazy imports) cannot pass unnoticed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )


def test_the_package_keeps_its_layers_and_has_no_import_cycle():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "tq_redis layers KEPT" in done.stdout
    assert "the stores never import the client or the operations KEPT" in done.stdout
    assert "no import cycle among the modules of any package KEPT" in done.stdout


def _copy_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "tq_redis", tmp_path / "tq_redis", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, code: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + "\n\n" + code + "\n", encoding="utf-8")


def test_a_lazy_import_up_the_layers_breaks_the_contract(tmp_path):
    root = _copy_package(tmp_path)
    _append(root / "tq_redis" / "meta" / "keys.py",
            "def _sneaky():\n    from tq_redis.client import driver\n\n    return driver")
    done = _lint(root)
    assert done.returncode != 0
    assert "tq_redis.meta is not allowed to import tq_redis.client" in done.stdout
    assert "tq_redis.meta.keys -> tq_redis.client.driver" in done.stdout


def test_a_store_that_imports_an_operation_breaks_the_contract(tmp_path):
    """``ops`` and ``backends`` are siblings, so the layers alone forbid this one too; the stores'
    own contract names it as well (and keeps forbidding it should the layers ever be regrouped)."""
    root = _copy_package(tmp_path)
    _append(root / "tq_redis" / "backends" / "dram" / "discovery.py",
            "def _sneaky():\n    from tq_redis.ops import transitions\n\n    return transitions")
    done = _lint(root)
    assert done.returncode != 0
    assert "the stores never import the client or the operations BROKEN" in done.stdout
    assert "tq_redis.backends.dram.discovery -> tq_redis.ops.transitions" in done.stdout


def test_a_type_only_cycle_inside_a_package_breaks_the_contract(tmp_path):
    root = _copy_package(tmp_path)
    _append(root / "tq_redis" / "meta" / "sample_views.py",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from tq_redis.meta.batch_meta import BatchMeta")
    done = _lint(root)
    assert done.returncode != 0
    assert "No cycles are allowed in tq_redis.meta" in done.stdout


def test_tools_that_need_no_tensors_start_without_torch():
    """A storage node, the key layout, the effects and the status snapshot import neither torch nor
    tensordict: the package ``__init__`` files that gather public names import them lazily."""
    code = (
        "import sys\n"
        "import tq_redis.backends.dram.server, tq_redis.meta.keys, tq_redis.ops.effects, tq_redis.monitor.status\n"
        "import tq_redis.settings, tq_redis.server.connections\n"
        "from tq_redis import ops, meta\n"
        "print(sorted(m for m in ('torch', 'tensordict') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
    # and the names they gather are still there when asked for
    check = "from tq_redis import ops, meta; print(ops.get_meta.__module__, meta.BatchMeta.__module__)"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.stdout.split() == ["tq_redis.ops.claim", "tq_redis.meta.batch_meta"], done.stderr[-2000:]
