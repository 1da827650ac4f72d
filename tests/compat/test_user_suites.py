"""The runner of verl's and RLinf's own tests (``user_suites.py``): what it copies, what it checks.

The suites themselves need a checkout of each project at its pinned commit, which no artifact CI
can reach carries (see ``SUITES[...].unreachable``); ``python -m tests.compat.user_suites`` runs them.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.compat import user_suites
from tests.compat.user_suites import SUITES


def test_each_suite_is_pinned_and_its_deselections_name_its_files_with_reasons():
    for suite in SUITES.values():
        assert len(suite.commit) >= 9 and suite.unreachable and suite.files
        for node, reason in suite.deselected.items():
            assert reason.strip() and node.split("::", 1)[0] in suite.files


def _checkout(tmp_path, files):
    src = tmp_path / "src"
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    return src, head


def test_files_are_copied_unchanged_beside_our_conftests_and_the_commit_is_checked(tmp_path):
    test_text = "import transfer_queue\n\ndef test_x():\n    assert transfer_queue\n"
    src, head = _checkout(tmp_path, {"tests/unit_tests/test_channel.py": test_text, "rlinf/__init__.py": ""})
    suite = user_suites.UserSuite("rlinf", "RLinf/RLinf", head[:9], ("tests/unit_tests/test_channel.py",),
                                  "TQ_RLINF_SRC", ("alias_conftest.py", "rlinf_conftest.py"), {}, "none")
    assert user_suites.checked_commit(src, suite) == head
    run_dir = user_suites.prepare(suite, src, tmp_path / "run")
    assert (run_dir / "tests/unit_tests/test_channel.py").read_text() == test_text
    conftest = (run_dir / "conftest.py").read_text()
    assert "install_transfer_queue_alias(propagate=True)" in conftest and "_module.Channel = _Channel" in conftest
    other = user_suites.UserSuite(**{**suite.__dict__, "commit": "0123456789"})
    with pytest.raises(RuntimeError, match="not rlinf's pinned commit 0123456789"):
        user_suites.checked_commit(src, other)
    missing = user_suites.UserSuite(**{**suite.__dict__, "files": ("tests/nothing.py",)})
    with pytest.raises(RuntimeError, match="has no"):
        user_suites.prepare(missing, src, tmp_path / "run2")


def test_a_missing_ray_dashboard_is_said_in_one_line_before_any_head_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.dashboard.optional_deps", None)  # what a plain `pip install ray` lacks
    with pytest.raises(RuntimeError, match=r"^the private Ray head needs Ray's dashboard: pip install 'ray\[default\]' "
                                           r"\(this Python has no ray.dashboard.optional_deps\)$"):
        with user_suites.private_ray_head(4, dict(os.environ)):
            pytest.fail("a head was started")


def test_processes_the_tests_start_import_the_test_module_by_name_as_in_rlinf_ci(tmp_path):
    """RLinf's Ray workers unpickle the test's Worker classes by their module's name (``test_channel``),
    in processes of their own: the run directory's tests/unit_tests is on their PYTHONPATH, as RLinf's
    CI puts it. A child process with another working directory stands in for a worker here."""
    test_text = (
        "import subprocess, sys\n\nclass Marker:\n    pass\n\n"
        "def test_a_child_imports_this_module_by_name(tmp_path):\n"
        "    child = subprocess.run([sys.executable, '-c', 'import test_child; print(test_child.Marker.__name__)'],\n"
        "                           cwd=tmp_path, capture_output=True, text=True)\n"
        "    assert child.stdout.strip() == 'Marker', child.stderr\n"
    )
    src, head = _checkout(tmp_path, {"tests/unit_tests/test_child.py": test_text})
    suite = dataclasses.replace(SUITES["rlinf"], commit=head[:9], files=("tests/unit_tests/test_child.py",),
                                conftests=("alias_conftest.py",), env=(), ray_head_cpus=0)
    result = user_suites.run(suite, src, tmp_path / "run")
    assert result.outcomes == {"tests/unit_tests/test_child.py::test_a_child_imports_this_module_by_name": "passed"}, \
        result.output[-3000:]


def test_own_runs_the_project_classes_only_where_a_suite_has_them(tmp_path, capsys):
    with pytest.raises(SystemExit):
        user_suites.main(["verl", "--own", "--src", str(tmp_path)])
    assert "verl has no --own run" in capsys.readouterr().err
    own = dataclasses.replace(SUITES["rlinf"], conftests=SUITES["rlinf"].own_conftests)
    src, _ = _checkout(tmp_path, {"tests/unit_tests/test_channel.py": "def test_x():\n    pass\n"})
    conftest = (user_suites.prepare(own, src, tmp_path / "run") / "conftest.py").read_text()
    assert "TQ_COMPAT_REPORT" in conftest and "_module.Channel = _Channel" not in conftest


# A test module shaped like RLinf's test_channel.py (written here, not RLinf's): its own dataclasses go
# through a channel between worker processes that load the module by its name, as RLinf's Ray workers
# load test_channel, with nothing registered and nothing pickled.
_RLINF_SHAPED = '''
import multiprocessing
import pstats
from dataclasses import dataclass

import torch

import tq_redis
from tq_redis import Channel
from tq_redis.codec.item_classes import REGISTERED
from tq_redis.errors import ItemClassNotAllowed


@dataclass
class TensorMessage:
    id: int
    payload: torch.Tensor
    note: str


@dataclass
class NestedMessage:
    id: int
    parts: list
    by_name: dict
    inner: TensorMessage


def produce(name, url, ns):
    ch = Channel.connect(name, redis_url=url, namespace=ns)
    try:
        ch.put(pstats.StatsProfile(0.5, {}), async_op=True)  # the standard library's: refused here
        refused = "queued"
    except ItemClassNotAllowed as exc:
        refused = exc.path
    ch.put(TensorMessage(1, torch.arange(3), "one"))
    inner = TensorMessage(3, torch.arange(2), "inner")
    ch.put(NestedMessage(2, [torch.ones(2)], {"a": torch.zeros(1)}, inner), async_op=True).wait()
    ch.close()
    return refused


def consume(name, url, ns):
    ch = Channel.connect(name, redis_url=url, namespace=ns)
    got = [ch.get(timeout=120), ch.get(timeout=120)]
    ch.close()
    return [(type(x).__module__, type(x).__name__, x.id) for x in got], got[1].inner.payload.tolist()


def test_module_dataclasses_cross_worker_processes_with_nothing_registered():
    cfg = tq_redis.init()
    try:
        url, ns = cfg["redis"]["url"], cfg["namespace"]
        Channel.create("items", redis_url=url, namespace=ns).close()
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            waiting = pool.apply_async(consume, ("items", url, ns))  # a consumer waits before any put
            refused = pool.apply(produce, ("items", url, ns))
            got, inner = waiting.get(180)
        assert refused == "pstats.StatsProfile"
        assert got == [(__name__, "TensorMessage", 1), (__name__, "NestedMessage", 2)] and inner == [0, 1]
        assert not REGISTERED.paths()
    finally:
        tq_redis.close()
'''


def test_a_test_modules_dataclasses_cross_worker_processes_on_the_default_codec(tmp_path):
    """What RLinf's test_channel.py needs of the default codec, in CI (which has no RLinf checkout):
    a test module's dataclasses, put and got by worker processes that import the module by name,
    travel with nothing registered; a refused put raises in the producer and the waiting consumer
    gets the next item. The RLinf conftest registers nothing either."""
    assert "register_item_class" not in (user_suites._HERE / "rlinf_conftest.py").read_text()
    src, head = _checkout(tmp_path, {"tests/unit_tests/test_like_rlinf.py": _RLINF_SHAPED})
    suite = dataclasses.replace(SUITES["rlinf"], commit=head[:9], files=("tests/unit_tests/test_like_rlinf.py",),
                                conftests=("alias_conftest.py",), env=(), ray_head_cpus=0)
    result = user_suites.run(suite, src, tmp_path / "run")
    node = "tests/unit_tests/test_like_rlinf.py::test_module_dataclasses_cross_worker_processes_with_nothing_registered"
    assert result.outcomes == {node: "passed"}, result.output[-4000:]


@pytest.mark.skipif(not os.environ.get("TQ_RLINF_SRC"),
                    reason="needs a checkout of RLinf at the pinned commit in TQ_RLINF_SRC (no package CI can "
                           "reach carries its tests; see SUITES['rlinf'].unreachable)")
def test_rlinfs_own_test_channel_passes_unchanged_on_the_default_codec():
    """RLinf's tests/unit_tests/test_channel.py, copied unchanged out of the checkout, with our Channel,
    the default codec and nothing registered: no failure, no error."""
    suite = SUITES["rlinf"]
    src = Path(os.environ["TQ_RLINF_SRC"])
    commit = user_suites.checked_commit(src, suite)
    result = user_suites.run(suite, src, Path(tempfile.mkdtemp(prefix="tq-rlinf-")))
    print(user_suites.summary(suite, result, commit))
    assert result.outcomes and not result.failures(), result.output[-4000:]
