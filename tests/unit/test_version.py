"""The version users' code sees: ``tq_redis.__version__`` passes the gates written for the reference."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.version import Version

import tq_redis


def test_version_is_the_reference_api_level_plus_our_release():
    ours = Version(tq_redis.__version__)
    assert ours.release[:3] == Version(tq_redis.REFERENCE_API_LEVEL).release and len(ours.release) == 4
    assert ours > Version(tq_redis.REFERENCE_API_LEVEL)  # 0.1.11.1 sorts after 0.1.11, before 0.1.12
    assert ours < Version(".".join(map(str, (*ours.release[:2], ours.release[2] + 1))))


def test_verls_checkpoint_gate_passes_with_the_one_line_switch():
    tq = tq_redis  # the README's headline switch: import tq_redis as tq
    version_supported = Version(getattr(tq, "__version__", "")) >= Version("0.1.9")  # verl's trainer_base.py
    assert version_supported and callable(tq.save_checkpoint) and callable(tq.load_checkpoint)


def test_installed_metadata_and_pyproject_read_the_one_version():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^dynamic = \["version"\]', text, re.M) and not re.search(r'^version = "', text, re.M)
    assert re.search(r'^version = \{ attr = "tq_redis.__version__" \}', text, re.M)
    assert importlib.metadata.version("tq-redis") == tq_redis.__version__
