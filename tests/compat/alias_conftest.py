"""tq-redis's conftest, copied as ``conftest.py`` beside the reference's unchanged tests.

It is not one of the reference's files. It installs the ``transfer_queue`` alias before any test
module imports ``transfer_queue`` (``propagate=True`` also reaches the Ray workers the tests'
fixtures start), drops the tests listed in ``TQ_COMPAT_DESELECT`` (a JSON list of node ids; an
id without ``[params]`` drops every parametrization) and writes one JSON line per collected id
and per test outcome to ``TQ_COMPAT_REPORT``, which the harness reads.

Once a module's ``tq_system`` fixture has started Ray and the system, every CPU slot of that Ray gets
a worker that has imported torch, tensordict and the client stack (``_warm_ray_workers``). A task of a
test then starts on a warm worker: the reference's ``ray.get(..., timeout=60)`` times its own calls,
not a cold worker's imports (about 4 s on an idle 2-core machine, over 60 s beside two busy loops and
the rest of the suite).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from tq_redis.integrations.alias import install_transfer_queue_alias

install_transfer_queue_alias(propagate=True)

_REPORT = os.environ.get("TQ_COMPAT_REPORT")

#: how long the warm-up may take: a cold worker's imports on a loaded machine, several at once
WARM_UP_TIMEOUT_S = 600


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


def _warm_ray_workers() -> None:
    """Give each free CPU slot of the running Ray a worker that has imported what a test's task imports.

    One task per free slot, each waiting at a gate until all have arrived, so they run on distinct
    workers and each stays warm in Ray's pool of idle workers for the test's own tasks.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    slots = int(ray.available_resources().get("CPU", 0))
    if slots < 1:
        return

    @ray.remote(num_cpus=0)
    class Gate:
        def __init__(self, expected: int) -> None:
            self.expected = expected
            self.arrived = 0
            self.all_here = asyncio.Event()

        async def arrive(self) -> None:
            self.arrived += 1
            if self.arrived >= self.expected:
                self.all_here.set()
            await self.all_here.wait()

    @ray.remote(num_cpus=1)
    def warm(gate) -> None:
        import tensordict  # noqa: F401
        import torch  # noqa: F401
        import transfer_queue  # noqa: F401

        import tq_redis.api.system  # noqa: F401

        ray.get(gate.arrive.remote())

    gate = Gate.remote(slots)
    try:
        ray.get([warm.remote(gate) for _ in range(slots)], timeout=WARM_UP_TIMEOUT_S)
    finally:
        ray.kill(gate)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    outcome = yield
    if fixturedef.argname == "tq_system" and outcome.excinfo is None:
        _warm_ray_workers()
