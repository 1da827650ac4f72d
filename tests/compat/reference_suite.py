"""Run the reference system's own public-API tests, unchanged, against tq-redis.

The reference (``transferqueue``, PyPI) is only *downloaded* (``pip download --no-deps``), never
installed: its wheel is cached, its ``tests/`` are extracted into a fresh directory per run, our
``alias_conftest.py`` is placed beside them as ``conftest.py`` (it installs the ``transfer_queue``
alias onto tq-redis), and pytest runs them in a subprocess. Outcomes come back as JSON lines
written by that conftest.

Stand-alone: ``.venv/bin/python -m tests.compat.reference_suite`` (prints every outcome).
Environment: ``TQ_COMPAT_CACHE`` (wheel cache, default ``~/.cache/tq-redis/compat``),
``TQ_COMPAT_WHEEL`` (use this wheel file instead of downloading).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

from tests.compat.deselected import DESELECTED

REFERENCE_PACKAGE = "transferqueue"
REFERENCE_VERSION = "0.1.11"

#: the reference's test files that exercise its public API (paths inside its wheel)
TEST_FILES = (
    "tests/e2e/test_e2e_lifecycle_consistency.py",
    "tests/e2e/test_kv_interface_e2e.py",
    "tests/e2e/test_checkpoint_e2e.py",
    "tests/e2e/test_ssd_offload_e2e.py",
    "tests/test_metadata.py",
    "tests/test_samplers.py",
    "tests/test_streaming_dataset.py",
)

RUN_TIMEOUT_S = 900

#: one summary line per run in this process (printed at the end of a pytest session by conftest.py)
SUMMARIES: list[str] = []
_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent.parent


def cache_dir() -> Path:
    """Where the downloaded wheel is kept between runs."""
    if os.environ.get("TQ_COMPAT_CACHE"):
        return Path(os.environ["TQ_COMPAT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tq-redis" / "compat"


def reference_wheel() -> Path:
    """The reference's wheel: ``TQ_COMPAT_WHEEL``, the cached download, or a fresh download."""
    if os.environ.get("TQ_COMPAT_WHEEL"):
        return Path(os.environ["TQ_COMPAT_WHEEL"])
    dest = cache_dir()
    name = f"{REFERENCE_PACKAGE}-{REFERENCE_VERSION}-py3-none-any.whl"
    if (dest / name).is_file():
        return dest / name
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest),
           f"{REFERENCE_PACKAGE}=={REFERENCE_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not (dest / name).is_file():
        raise RuntimeError(
            f"could not download the reference ({' '.join(cmd)}); without network access set TQ_COMPAT_WHEEL "
            f"to a local copy of {name}:\n{proc.stdout}\n{proc.stderr}"
        )
    return dest / name


def extract_tests(wheel: Path, run_dir: Path) -> Path:
    """Extract the wheel's ``tests/`` into ``run_dir`` unchanged, add our conftest; return ``run_dir``."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith("tests/")]
        missing = [f for f in TEST_FILES if f not in members]
        if missing:
            raise RuntimeError(f"{wheel.name} has no {missing}; TEST_FILES must name files of this release")
        zf.extractall(run_dir, members)
    shutil.copyfile(_HERE / "alias_conftest.py", run_dir / "tests" / "conftest.py")
    # our own ini file, so pytest neither finds this repository's config nor needs one of the reference's
    (run_dir / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    return run_dir


@dataclasses.dataclass
class SuiteResult:
    """Outcome of one run: per-test outcome and first error line, plus what was collected."""

    outcomes: dict[str, str]
    messages: dict[str, str]
    collected: list[str]
    deselected: list[str]
    returncode: int
    output: str

    def counts(self) -> Counter:
        """passed / failed / error / skipped / deselected counts."""
        c = Counter(self.outcomes.values())
        c["deselected"] = len(self.deselected)
        return c

    def failures(self) -> list[str]:
        """Node ids that failed or errored (none of them deselected)."""
        return sorted(n for n, o in self.outcomes.items() if o in ("failed", "error"))

    def stale_deselections(self) -> list[str]:
        """Entries of the deselect list that match no collected test (renamed or removed)."""
        bases = {n.split("[", 1)[0] for n in self.collected} | set(self.collected)
        return sorted(d for d in DESELECTED if d not in bases)

    def summary(self) -> str:
        c = self.counts()
        return (f"reference tests ({REFERENCE_PACKAGE}=={REFERENCE_VERSION}): {c['passed']} passed, "
                f"{c['failed'] + c['error']} failed, {c['skipped']} skipped, {c['deselected']} deselected")


_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def _versions() -> str:
    """The versions the run used, e.g. ``0.1.11.1 (tensordict 0.15.3, torch 2.13.0, numpy 2.3.4)``."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    import tq_redis

    return f"{tq_redis.__version__} (tensordict {of('tensordict')}, torch {of('torch')}, numpy {of('numpy')})"


def _read_report(path: Path) -> tuple[dict[str, str], dict[str, str], list[str]]:
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    collected: list[str] = []
    if not path.exists():
        return outcomes, messages, collected
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec["event"] == "collected":
            collected.extend(rec["nodeids"])
            continue
        node, outcome = rec["nodeid"], rec["outcome"]
        if node not in outcomes or _RANK[outcome] > _RANK[outcomes[node]]:  # the worst phase wins
            outcomes[node] = outcome
            if rec.get("message"):
                messages[node] = f"[{rec['when']}] {rec['message']}"
    return outcomes, messages, collected


def _subprocess_env(run_dir: Path, deselect_file: Path, report: Path) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("TQ_REDIS_URL", "TQ_NAMESPACE", "RAY_ADDRESS", "PYTEST_ADDOPTS", "TQ_TEST_BACKEND"):
        env.pop(var, None)  # the reference's tests start their own system: SimpleStorage -> embedded
    env.update(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_DEDUP_LOGS="0",
        TQ_COMPAT_DESELECT=str(deselect_file),
        TQ_COMPAT_REPORT=str(report),
        # the repository first, so the subprocess and its Ray workers import this checkout's tq_redis
        PYTHONPATH=os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p),
    )
    return env


def run_suite(run_dir: Path, extra_args: tuple[str, ...] = ()) -> SuiteResult:
    """Download (once), extract and run the reference's public-API tests under ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    extract_tests(reference_wheel(), run_dir)
    deselect_file = run_dir / "deselected.json"
    deselect_file.write_text(json.dumps(sorted(DESELECTED)), encoding="utf-8")
    report = run_dir / "report.jsonl"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-c", str(run_dir / "pytest.ini"), "--rootdir", str(run_dir),
           "-p", "no:cacheprovider", "-q", "-rN", "--continue-on-collection-errors",
           "--junitxml", str(run_dir / "junit.xml"),
           *TEST_FILES, *extra_args]
    proc = subprocess.run(cmd, cwd=run_dir, env=_subprocess_env(run_dir, deselect_file, report),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    outcomes, messages, collected = _read_report(report)
    deselected = [n for n in collected if n in DESELECTED or n.split("[", 1)[0] in DESELECTED]
    result = SuiteResult(outcomes, messages, collected, deselected, proc.returncode, proc.stdout + proc.stderr)
    SUMMARIES.append(f"{result.summary()}; against tq-redis {_versions()}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the suite in a fresh directory and print every outcome; exit 1 on any failure."""
    import tempfile

    run_dir = Path(tempfile.mkdtemp(prefix="tq-compat-"))
    result = run_suite(run_dir, tuple(argv if argv is not None else sys.argv[1:]))
    for node in sorted(result.outcomes):
        print(f"{result.outcomes[node]:8s} {node}  {result.messages.get(node, '')}")
    for node in result.deselected:
        print(f"deselect {node}  ({DESELECTED.get(node) or DESELECTED.get(node.split('[', 1)[0])})")
    for entry in result.stale_deselections():
        print(f"STALE    {entry}: in the deselect list but not collected")
    print(result.summary())
    print(f"run directory: {run_dir}")
    return 1 if result.failures() or result.stale_deselections() or not result.outcomes else 0


if __name__ == "__main__":
    raise SystemExit(main())
