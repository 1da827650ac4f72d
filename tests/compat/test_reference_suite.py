"""The reference system's own public-API tests, run unchanged against tq-redis.

See ``reference_suite.py``: the wheel of ``transferqueue`` is downloaded (not installed), its
tests run in a pytest subprocess through the ``transfer_queue`` alias, and every failure that is
not in ``deselected.py`` fails this test, as does a deselect entry that no longer names a test.
"""

from __future__ import annotations

import json

from tests.compat import reference_suite
from tests.compat.deselected import DESELECTED
from tests.compat.reference_suite import SuiteResult, run_suite


def test_deselect_entries_have_reasons_and_name_known_files() -> None:
    for node, reason in DESELECTED.items():
        assert reason.strip(), f"deselected without a reason: {node}"
        assert node.split("::", 1)[0] in reference_suite.TEST_FILES, f"{node} is not in a file the harness runs"


def test_report_keeps_the_worst_phase_and_flags_stale_deselections(tmp_path) -> None:
    report = tmp_path / "report.jsonl"
    records = [
        {"event": "collected", "nodeids": ["t.py::a[x]", "t.py::b", "t.py::c"]},
        {"event": "test", "nodeid": "t.py::a[x]", "when": "call", "outcome": "passed", "message": ""},
        {"event": "test", "nodeid": "t.py::a[x]", "when": "teardown", "outcome": "error", "message": "boom"},
        {"event": "test", "nodeid": "t.py::b", "when": "setup", "outcome": "skipped", "message": "no cuda"},
        {"event": "test", "nodeid": "t.py::c", "when": "call", "outcome": "failed", "message": "assert 1 == 2"},
    ]
    report.write_text("".join(json.dumps(r) + "\n" for r in records))
    outcomes, messages, collected = reference_suite._read_report(report)
    assert outcomes == {"t.py::a[x]": "error", "t.py::b": "skipped", "t.py::c": "failed"}
    assert messages["t.py::a[x]"] == "[teardown] boom"
    result = SuiteResult(outcomes, messages, collected, [], 1, "")
    assert result.failures() == ["t.py::a[x]", "t.py::c"]
    assert set(result.stale_deselections()) == set(DESELECTED)  # none of them names t.py
    assert "1 skipped" in result.summary() and "2 failed" in result.summary()


def test_reference_public_api_suite(tmp_path) -> None:
    result = run_suite(tmp_path / "reference")
    assert result.outcomes, f"the reference's tests did not run (exit {result.returncode}):\n{result.output[-6000:]}"
    problems = [f"{node}: {result.messages.get(node, result.outcomes[node])}" for node in result.failures()]
    problems += [f"{entry}: deselected but no such test was collected" for entry in result.stale_deselections()]
    assert not problems, f"{result.summary()}\n" + "\n".join(problems)
