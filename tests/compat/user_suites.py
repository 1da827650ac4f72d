"""verl's and RLinf's own tests of their TransferQueue / Channel integration, run unchanged on tq-redis.

Each suite is pinned to a commit of its project and never vendored: the runner copies the named
test files, unchanged, out of a checkout of that commit into a fresh directory, puts a conftest of
ours beside them and runs pytest in a subprocess, as :mod:`tests.compat.reference_suite` does with
the reference's wheel. verl's tests import ``transfer_queue``, which the conftest makes tq-redis (the
alias); RLinf's test gets :class:`tq_redis.Channel` in place of RLinf's ``Channel`` (see
``rlinf_conftest.py``). Every failure outside the suite's short deselect list fails the run.

Where the files come from. No artifact CI can reach (PyPI, Debian, npm) carries them, so the
runner needs a checkout (``--src DIR``, or ``TQ_VERL_SRC`` / ``TQ_RLINF_SRC``); see
:data:`SUITES` for the evidence per suite. The Python running it needs the project's own CPU
dependencies (verl: transformers, hydra-core, codetiming, orjson, datasets, cachetools, fastapi,
uvicorn, torchdata, peft; RLinf: its own CPU dependencies, with ``ray[default]``).

Stand-alone: ``python -m tests.compat.user_suites verl --src /path/to/verl`` (prints each outcome
and the counts; exit 1 on any failure). ``--own`` runs RLinf's file against RLinf's own Channel,
with the same runner, Ray head and reporting: the reference count beside tq-redis's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from tests.compat.reference_suite import SuiteResult, _read_report
from tq_redis.server.embedded import free_port

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent.parent
RUN_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class UserSuite:
    """One project's test files, pinned, and how they run on tq-redis."""

    name: str
    repository: str
    commit: str
    files: tuple[str, ...]
    env_var: str
    conftests: tuple[str, ...]  # ours, concatenated into the run directory's conftest.py
    deselected: dict[str, str]
    unreachable: str  # why CI cannot fetch the files (what was checked)
    env: tuple[tuple[str, str], ...] = ()  # the project's own settings for the run ("{src}": the checkout)
    ray_head_cpus: int = 0  # > 0: start a private Ray head with this many CPUs (the project joins "any" cluster)
    pythonpath: tuple[str, ...] = ()  # run-directory folders the project's CI puts on PYTHONPATH
    own_conftests: tuple[str, ...] = ()  # for --own: our reporting only, the project's own classes (the reference)


SUITES: dict[str, UserSuite] = {
    "verl": UserSuite(
        name="verl",
        repository="verl-project/verl",
        commit="1dda039b9",
        files=("tests/trainer/ppo/v1/test_replay_buffer_on_cpu.py",
               "tests/trainer/ppo/v1/test_reissue_inflight_on_cpu.py"),
        env_var="TQ_VERL_SRC",
        conftests=("alias_conftest.py",),
        deselected={},
        unreachable=(
            "verl 0.9.1, the newest release on PyPI: its wheel and sdist (pip download --no-deps verl==0.9.1, "
            "with and without --no-binary :all:) ship tests/ but no tests/trainer/ppo/v1/ (the files were "
            "added on verl's main branch on 2026-07-08 and 2026-07-14, after the 0.9 release branch)"
        ),
    ),
    "rlinf": UserSuite(
        name="rlinf",
        repository="RLinf/RLinf",
        commit="a3816b596",
        files=("tests/unit_tests/test_channel.py",),
        env_var="TQ_RLINF_SRC",
        conftests=("alias_conftest.py", "rlinf_conftest.py"),
        own_conftests=("alias_conftest.py",),  # its file imports no transfer_queue: RLinf's Channel stays
        # nothing: at this commit test_memory is a worker method the tests never call, not a test
        deselected={},
        unreachable=(
            "rlinf 0.3.0, the newest release on PyPI (0.2 has no files there): its wheel and sdist ship no "
            "tests at all"
        ),
        # RLinf's CI runs with PYTHONPATH=$(pwd):$(pwd)/tests/unit_tests: the Ray workers unpickle the
        # test's Worker classes by their module name, test_channel, which they import from there
        pythonpath=("tests/unit_tests",),
        # RLinf's own switch that ships its package to the Ray workers its Cluster starts
        env=(("RLINF_CODE_WORKING_DIR", "{src}"),),
        # RLinf's Cluster joins any Ray cluster it finds on the machine: give it its own, with enough
        # logical CPUs for the test's two worker groups and its three channel workers
        ray_head_cpus=16,
    ),
}


def checked_commit(src: Path, suite: UserSuite) -> str:
    """The checkout's commit when it is a git checkout at the pinned one; raises otherwise."""
    if not (src / ".git").exists():
        return "unverified (not a git checkout)"
    head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if not head.startswith(suite.commit):
        raise RuntimeError(f"{src} is at {head[:12]}, not {suite.name}'s pinned commit {suite.commit}; "
                           f"git -C {src} checkout {suite.commit}")
    return head


def prepare(suite: UserSuite, src: Path, run_dir: Path) -> Path:
    """Copy the suite's files, unchanged, from ``src`` into ``run_dir``, with our conftest and ini."""
    missing = [f for f in suite.files if not (src / f).is_file()]
    if missing:
        raise RuntimeError(f"{src} has no {missing}: is it a checkout of {suite.repository} at {suite.commit}?")
    for rel in suite.files:
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, run_dir / rel)
    (run_dir / "conftest.py").write_text(
        "\n\n".join((_HERE / name).read_text(encoding="utf-8") for name in suite.conftests), encoding="utf-8"
    )
    (run_dir / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    return run_dir


def run(suite: UserSuite, src: Path, run_dir: Path, extra_args: tuple[str, ...] = ()) -> SuiteResult:
    """Run the suite's files from checkout ``src`` in ``run_dir``; the outcomes come back as JSON lines."""
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare(suite, src, run_dir)
    deselect_file, report = run_dir / "deselected.json", run_dir / "report.jsonl"
    deselect_file.write_text(json.dumps(sorted(suite.deselected)), encoding="utf-8")
    report.unlink(missing_ok=True)
    stub = subprocess.run([sys.executable, "-m", "tq_redis.integrations.alias", "--pythonpath"], cwd=_REPO,
                          capture_output=True, text=True, check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items()
           if k not in ("TQ_REDIS_URL", "TQ_NAMESPACE", "RAY_ADDRESS", "PYTEST_ADDOPTS", "TQ_TEST_BACKEND")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0", TQ_COMPAT_DESELECT=str(deselect_file),
               TQ_COMPAT_REPORT=str(report),
               # the alias stub, the run's folders the project's CI names, the project's sources, our tq_redis
               PYTHONPATH=os.pathsep.join(p for p in (stub, *(str(run_dir / d) for d in suite.pythonpath), str(src),
                                                      str(_REPO), env.get("PYTHONPATH", "")) if p))
    env.update({name: value.format(src=src) for name, value in suite.env})
    cmd = [sys.executable, "-m", "pytest", "-c", str(run_dir / "pytest.ini"), "--rootdir", str(run_dir),
           "-p", "no:cacheprovider", "-q", "-rN", *suite.files, *extra_args]
    if suite.ray_head_cpus:
        # a loopback cluster of this run only: its clients are this run's processes, which find no
        # token for it in the shared places Ray looks (RLinf's state API calls go to its dashboard)
        env["RAY_AUTH_MODE"] = "disabled"
    with private_ray_head(suite.ray_head_cpus, env) as address:
        if address:
            env["RAY_ADDRESS"] = address
        proc = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    outcomes, messages, collected = _read_report(report)
    deselected = [n for n in collected if n in suite.deselected or n.split("[", 1)[0] in suite.deselected]
    return SuiteResult(outcomes, messages, collected, deselected, proc.returncode, proc.stdout + proc.stderr)


@contextlib.contextmanager
def private_ray_head(cpus: int, env: dict[str, str]) -> Iterator[str | None]:
    """A Ray head of our own (``ray start --head --block``), its address; stopped afterwards by
    ending that one process, which takes its cluster with it (never ``ray stop``, which would stop
    every Ray cluster of the machine's user)."""
    if cpus <= 0:
        yield None
        return
    require_ray_dashboard()
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="tqray-", dir="/tmp")  # short: Ray's socket paths are bounded
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         f"--num-cpus={cpus}", "--temp-dir", temp_dir, "--include-dashboard=true", f"--dashboard-port={free_port()}",
         "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    started, lines = threading.Event(), []

    def read_output() -> None:  # `ray start` says when the head is up; a reader keeps the pipe drained
        for line in head.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "Ray runtime started" in line:
                started.set()
        started.set()  # it exited

    threading.Thread(target=read_output, daemon=True).start()
    try:
        if not started.wait(300) or head.poll() is not None:
            raise RuntimeError("could not start a private Ray head:\n" + "".join(lines[-30:]))
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def require_ray_dashboard() -> None:
    """Raises, in one line, when this Python lacks what Ray's dashboard needs (the state API that
    RLinf's ``Cluster`` calls goes through it): ``ray[default]``, not plain ``ray``."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"the private Ray head needs Ray's dashboard: pip install 'ray[default]' "
                           f"(this Python has no {exc.name})") from None


def summary(suite: UserSuite, result: SuiteResult, commit: str) -> str:
    c = result.counts()
    return (f"{suite.name} tests ({suite.repository}@{commit[:12]}): {c['passed']} passed, "
            f"{c['failed'] + c['error']} failed, {c['skipped']} skipped, {c['deselected']} deselected")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.compat.user_suites", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--src", help="a checkout of the project at the pinned commit (default: $TQ_<NAME>_SRC)")
    parser.add_argument("--own", action="store_true",
                        help="run against the project's own classes, not tq-redis's (the reference count)")
    args, extra = parser.parse_known_args(argv)
    suite = SUITES[args.suite]
    if args.own:
        if not suite.own_conftests:
            parser.error(f"{suite.name} has no --own run (its tests reach tq-redis through the alias only)")
        suite = dataclasses.replace(suite, conftests=suite.own_conftests)
    src = args.src or os.environ.get(suite.env_var)
    if not src:
        parser.error(f"give --src or {suite.env_var}: a checkout of {suite.repository} at {suite.commit} "
                     f"(no artifact on PyPI carries the files: {suite.unreachable})")
    commit = checked_commit(Path(src), suite)
    run_dir = Path(tempfile.mkdtemp(prefix=f"tq-{suite.name}-"))
    result = run(suite, Path(src), run_dir, tuple(extra))
    for node in sorted(result.outcomes):
        print(f"{result.outcomes[node]:8s} {node}  {result.messages.get(node, '')}")
    for node in result.deselected:
        print(f"deselect {node}  ({suite.deselected.get(node) or suite.deselected.get(node.split('[', 1)[0])})")
    print(summary(suite, result, commit) + (f" (against {suite.name}'s own classes)" if args.own else ""))
    print(f"run directory: {run_dir}")
    return 1 if result.failures() or not result.outcomes else 0


if __name__ == "__main__":
    raise SystemExit(main())
