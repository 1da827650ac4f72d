"""tq-redis's conftest, copied as ``conftest.py`` beside the reference's unchanged tests.

It is not one of the reference's files. It installs the ``transfer_queue`` alias before any test
module imports ``transfer_queue`` (``propagate=True`` also reaches the Ray workers the tests'
fixtures start), drops the tests listed in ``TQ_COMPAT_DESELECT`` (a JSON list of node ids; an
id without ``[params]`` drops every parametrization) and writes one JSON line per collected id
and per test outcome to ``TQ_COMPAT_REPORT``, which the harness reads.
"""

from __future__ import annotations

import json
import os

import pytest

from tq_redis.integrations.alias import install_transfer_queue_alias

install_transfer_queue_alias(propagate=True)

_REPORT = os.environ.get("TQ_COMPAT_REPORT")


def _emit(record: dict) -> None:
    if _REPORT:
        with open(_REPORT, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")


def _deselect_list() -> set[str]:
    path = os.environ.get("TQ_COMPAT_DESELECT")
    if not path:
        return set()
    with open(path, encoding="utf-8") as fh:
        return set(json.load(fh))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted_out = _deselect_list()
    _emit({"event": "collected", "nodeids": [item.nodeid for item in items]})
    keep, drop = [], []
    for item in items:
        base = item.nodeid.split("[", 1)[0]
        (drop if item.nodeid in wanted_out or base in wanted_out else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _summary(report: pytest.TestReport | pytest.CollectReport) -> str:
    if report.passed:
        return ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0] if crash.message else ""
    text = str(report.longrepr or "")
    return text.strip().splitlines()[-1] if text.strip() else ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    outcome = report.outcome
    if report.when != "call" and outcome == "passed":
        return
    if report.when != "call" and outcome == "failed":
        outcome = "error"  # a fixture's setup or teardown failed
    _emit({"event": "test", "nodeid": report.nodeid, "when": report.when, "outcome": outcome,
           "message": _summary(report)})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit({"event": "test", "nodeid": report.nodeid, "when": "collect", "outcome": "error",
               "message": _summary(report)})
