"""The README's performance section says how loaded and how fast the machine was per measure."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report
from benchmarks._common import busy_share, cpu_probe_s, cpu_times, wait_until_quiet

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
    assert "drifts within minutes (0.110 to 0.194 s in this run;" in section


def test_a_result_without_a_probe_lists_none():
    merged = _merged_with("p4_tiny", {})
    merged["measures"]["p4_tiny"].pop("cpu_probe_s", None)
    assert "Machine speed" not in report.build_section(merged)


def test_the_probe_times_a_loop():
    first, second = cpu_probe_s(), cpu_probe_s()
    assert 0 < first < 5 and 0 < second < 5


def test_each_measure_says_how_long_it_waited_for_a_quiet_machine():
    section = report.build_section(
        _merged_with("p6_shard", {"quiet_at_start": {"waited_s": 4.25, "busy_share": 0.05, "quiet": True}})
    )
    assert "the wait, at most 30 s: P6 4.2 s." in section
    busy = report.build_section(
        _merged_with("p6_shard", {"quiet_at_start": {"waited_s": 30.0, "busy_share": 0.6, "quiet": False}})
    )
    assert "P6 30.0 s (still busy)." in busy


def test_busy_share_counts_every_state_but_idle_and_iowait():
    assert busy_share((100.0, 1000.0), (150.0, 1200.0)) == 0.25
    assert busy_share((100.0, 1000.0), (100.0, 1000.0)) == 0.0
    now = cpu_times()
    assert now is not None and 0 <= now[0] <= now[1]


def test_waiting_for_quiet_gives_up_at_its_limit_while_a_core_is_busy():
    import multiprocessing as mp

    stop = mp.get_context("spawn").Event()
    spinner = mp.get_context("spawn").Process(target=_spin, args=(stop,))
    spinner.start()
    try:
        got = wait_until_quiet(busy_below=0.2, window_s=0.2, max_wait_s=1.5)
    finally:
        stop.set()
        spinner.join(timeout=10)
    assert got is not None and got["quiet"] is False and got["busy_share"] >= 0.2
    assert 1.5 <= got["waited_s"] < 5


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def test_p5_device_overhead_is_split_along_the_trainers_path_for_each_system():
    path = {"compute_s": 0.86, "waiting_s": 0.1, "claims_s": 0.05, "glue_s": 0.01, "between_s": 0.02,
            "claims": 16, "claim_median_ms": 2.5}  # fmt: skip
    split = {"claims_s": 0.05, "glue_s": 0.01, "between_s": 0.02, "upstream_s": 0.04}
    merged = json.loads(RESULTS.read_text())
    doc = merged["measures"]["p5_pipeline"]
    ours = doc["results"]["tq_redis"]
    ours["other_modes"]["device"].update(trainer_path=path, overhead_split=split)
    ours.update(trainer_path=path, overhead_split=split)  # a CPU-mode split is not the device line's
    doc["results"]["reference"]["other_modes"]["device"].pop("trainer_path", None)
    section = report.build_section(merged)
    assert (
        "along the trainer's path (the run ends when the trainer does; `benchmarks/p5_path.py`): tq-redis: "
        "its claims 50 ms (16 claims, median 2.5 ms), its glue 10 ms, between batches 20 ms, waiting for rows "
        "beyond the schedule 40 ms." in section
    )
    assert section.count("its claims") == 1  # a system without a split says nothing


def test_a_run_without_a_path_split_adds_no_line():
    merged = json.loads(RESULTS.read_text())
    for res in merged["measures"]["p5_pipeline"]["results"].values():
        res.pop("trainer_path", None)
        res.get("other_modes", {}).get("device", {}).pop("trainer_path", None)
    assert "along the trainer's path" not in report.build_section(merged)


def test_p6_keeps_the_round_with_the_least_command_time_and_lists_every_round():
    from benchmarks.p6_shard import best_round

    rows = [{"command_usec_per_item": 51.0, "claims_per_s": 1.0}, {"command_usec_per_item": 38.2, "claims_per_s": 2.0},
            {"command_usec_per_item": 39.0, "claims_per_s": 3.0}]  # fmt: skip
    best = best_round(rows)
    assert best["claims_per_s"] == 2.0
    assert best["rounds_command_usec_per_item"] == [51.0, 38.2, 39.0]
    assert "rounds_command_usec_per_item" not in rows[1]  # the rounds themselves are left as they were
    merged = json.loads(RESULTS.read_text())
    merged["measures"]["p6_shard"]["results"]["tq_redis"]["batch_1"].update(
        command_usec_per_item=38.2, script_ceiling_per_s=26178.0, rounds_command_usec_per_item=[51.0, 38.2, 39.0]
    )
    section = report.build_section(merged)
    assert "26,178/s (38.2 µs command time a claim, best of 3 rounds: 51.0 / 38.2 / 39.0 µs)" in section


def test_the_docs_page_gets_the_full_section_and_the_readme_a_summary_linking_to_it(tmp_path: Path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "all.json").write_text(RESULTS.read_text())
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(f"# Benchmarks\n\nintro\n\n{report.START}\nSTALE FIGURES\n{report.END}\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Benchmarks\n\n{report.SUMMARY_START}\n{report.SUMMARY_END}\n\n## next\n")
    assert report.main(["--results", str(results / "all.json"), "--doc", str(doc), "--readme", str(readme)]) == 0
    page, front = doc.read_text(), readme.read_text()
    assert page.startswith("# Benchmarks\n\nintro\n") and "STALE FIGURES" not in page
    assert "| P6 |" in page and "![P1](../benchmarks/results/p1_throughput.png)" in page
    assert "`benchmarks/README.md`" in page  # outside the docs' sources: named, not linked
    summary = front.split(report.SUMMARY_START, 1)[1].split(report.SUMMARY_END, 1)[0]
    assert "| P1 |" in summary and "| P5 |" in summary and "| P6 |" not in summary
    assert "[docs/benchmarks.md](docs/benchmarks.md)" in summary and front.endswith("## next\n")
