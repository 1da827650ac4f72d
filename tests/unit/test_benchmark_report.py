"""The README's performance section says how loaded and how fast the machine was per measure."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report
from benchmarks._common import cpu_probe_s

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "all.json"


def _merged_with(measure: str, doc: dict) -> dict:
    merged = json.loads(RESULTS.read_text())
    merged["measures"] = {measure: {**merged["measures"][measure], **doc}}
    return merged


def test_each_measure_is_listed_with_its_speed_probe_and_load_under_its_own_name():
    section = report.build_section(
        _merged_with("p1_tcp", {"loadavg_at_start": [0.7, 0.5, 0.4], "cpu_probe_s": {"start": 0.11, "end": 0.194}})
    )
    assert "Load average (1 min) when each measure started: P1-TCP 0.7 " in section
    assert "lower is faster): P1-TCP 0.110 → 0.194." in section


def test_a_result_without_a_probe_lists_none():
    merged = _merged_with("p4_tiny", {})
    merged["measures"]["p4_tiny"].pop("cpu_probe_s", None)
    assert "Machine speed" not in report.build_section(merged)


def test_the_probe_times_a_loop():
    first, second = cpu_probe_s(), cpu_probe_s()
    assert 0 < first < 5 and 0 < second < 5
