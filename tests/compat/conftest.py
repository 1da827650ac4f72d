"""Print the reference suite's counts at the end of the run, whatever the outcome."""

from __future__ import annotations

from tests.compat import reference_suite


def pytest_terminal_summary(terminalreporter) -> None:
    for line in reference_suite.SUMMARIES:
        terminalreporter.write_line(line)
