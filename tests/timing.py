"""Where the suite's time goes: each test file's summed time, printed at the end of a run.

Runs in the controlling pytest process, which under xdist receives every worker's reports, so the
figures cover the whole run. ``TQ_TEST_TIMES=FILE`` also appends one line per test as it finishes
(``seconds<TAB>node id``), which survives a run that is interrupted or hangs.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

_by_file: dict[str, float] = defaultdict(float)
_SHOWN = 15
# under xdist this hook runs in each worker and again in the controller for the same report: the
# controller sums, and the lines are written where the test ran (the controller only without workers)
_role = {"sums": True, "writes": True}


def pytest_configure(config: pytest.Config) -> None:
    worker = hasattr(config, "workerinput")
    distributed = bool(getattr(config.option, "numprocesses", None)) and not worker
    _role.update(sums=not worker, writes=not distributed)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _role["sums"]:
        _by_file[report.nodeid.split("::", 1)[0]] += report.duration
    path = os.environ.get("TQ_TEST_TIMES")
    if path and _role["writes"]:
        with open(path, "a") as out:
            out.write(f"{report.duration:.3f}\t{report.nodeid}\t{report.when}\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _by_file:
        return
    ranked = sorted(_by_file.items(), key=lambda item: -item[1])
    terminalreporter.write_sep("-", f"the {min(_SHOWN, len(ranked))} slowest test files (summed test time)")
    for path, seconds in ranked[:_SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
