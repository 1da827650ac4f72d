"""The runner of verl's and RLinf's own tests (``user_suites.py``): what it copies, what it checks.

The suites themselves need a checkout of each project at its pinned commit, which no artifact CI
can reach carries (see ``SUITES[...].unreachable``); ``python -m tests.compat.user_suites`` runs them.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

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
