"""Generate the benchmark figures of the docs and the README from ``benchmarks/results/all.json``.

The full section lies between ``<!-- perf:start -->`` and ``<!-- perf:end -->`` in
``docs/benchmarks.md`` (added at its end when missing). It states when, where and at which commit
the figures were measured, and has one table with P1-P7 of ``ARCHITECTURE.md`` ("Performance
targets"): our figure, the reference system's, how many times better ours is, the target and
whether it is met; then what the figures mean and the PNG charts. The README's ``## Benchmarks``
holds a summary of the same run (P1-P5) between ``<!-- perf-summary:start -->`` and
``<!-- perf-summary:end -->``, with a link to the page. ``python -m benchmarks`` calls this at the
end of a full run.

Run: ``python -m benchmarks.report [--results benchmarks/results/all.json] [--doc docs/benchmarks.md]
[--readme README.md]`` (``--print`` writes the full section to stdout and leaves both files alone).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import REPO_ROOT, RESULTS_DIR
from benchmarks.p5_accounting import describe_cpu
from benchmarks.p5_path import describe as describe_path

START = "<!-- perf:start -->"
END = "<!-- perf:end -->"
SUMMARY_START = "<!-- perf-summary:start -->"
SUMMARY_END = "<!-- perf-summary:end -->"
SUMMARY_MEASURES = ("P1", "P2", "P3", "P4", "P5")
HEADING = "## Benchmarks"
CHARTS = ("p1_throughput", "p2_get_meta", "p3_concurrency", "p4_tiny", "p5_pipeline")
ONE_M = 1_048_576

Row = tuple[str, str, str, str, str, str, bool | None]
"""(id, measure, tq-redis, reference, tq-redis vs reference, target, met)."""


# ----------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------
def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:#.{digits}g}"  # keeps trailing zeros: 2.00, not 2


def _times(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value < 10:
        return f"{value:.2f}×"
    return f"{value:.1f}×" if value < 100 else f"{value:,.0f}×"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.0f}%"


def _size(n: int) -> str:
    for div, unit in ((ONE_M, "M"), (1024, "k")):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _label(measure: str) -> str:
    """A measure's short name in the README: ``p1_tcp`` -> ``P1-TCP``, ``p3_concurrency`` -> ``P3``."""
    return "P1-TCP" if measure == "p1_tcp" else measure.split("_", 1)[0].upper()


def _met(flag: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "n/a"}[flag]


def _gain(ours: float | None, ref: float | None, higher_better: bool) -> float | None:
    """How many times better ours is: ours/ref for rates, ref/ours for latencies."""
    if not ours or not ref:
        return None
    return ours / ref if higher_better else ref / ours


def _result(merged: dict[str, Any], measure: str, system: str) -> dict[str, Any]:
    doc = merged.get("measures", {}).get(measure) or {}
    value = (doc.get("results") or {}).get(system)
    return value if isinstance(value, dict) else {}


def _both(merged: dict[str, Any], measure: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tq-redis's result, the reference's)`` of ``measure``."""
    return _result(merged, measure, "tq_redis"), _result(merged, measure, "reference")


def _params(merged: dict[str, Any], measure: str) -> dict[str, Any]:
    doc = merged.get("measures", {}).get(measure) or {}
    return doc.get("params") or {}


def _figure_row(
    pid: str, label: str, results: tuple[dict[str, Any], dict[str, Any]], key: Sequence[str], higher_better: bool,
    target: str, at_least: float,
) -> Row:
    """A row comparing the figure at ``key`` of both results (tq-redis's first); met when
    tq-redis is ``at_least`` times better."""
    figures = []
    for res in results:
        value: Any = res
        for k in key:
            value = (value or {}).get(k)
        figures.append(value)
    (ours, ref), (o, r) = results, figures
    gain = _gain(o, r, higher_better)
    return (pid, label, _err(ours) or _num(o), _err(ref) or _num(r), _times(gain), target,
            None if gain is None else gain >= at_least)  # fmt: skip


def _run_row(
    pid: str, label: str, results: tuple[dict[str, Any], dict[str, Any]], key: str,
    describe: Callable[[dict[str, Any], float | None], str], target: str, at_least: float, correct: bool,
) -> Row:
    """A row of a measure of whole runs: each result shown as ``describe(result, its rate at key)``
    (or why it is missing); met when tq-redis's rate is ``at_least`` times the reference's and its
    run ``correct``."""
    ours, ref = results
    o, r = ours.get(key), ref.get(key)
    gain = _gain(o, r, True)
    return (pid, label, _err(ours) or describe(ours, o), _err(ref) or describe(ref, r), _times(gain), target,
            None if gain is None else (gain >= at_least and correct))  # fmt: skip


def _err(res: dict[str, Any]) -> str | None:
    if not res:
        return "not run"
    if "error" in res:
        return "error"
    return None


# ----------------------------------------------------------------------------------------
# One builder per measure
# ----------------------------------------------------------------------------------------
def _rows_p1(merged: dict[str, Any]) -> list[Row]:
    ours, ref = _both(merged, "p1_throughput")
    memcpy = _result(merged, "p1_throughput", "memcpy").get("gbps")
    mib = _params(merged, "p1_throughput").get("bytes", 0) / 2**20
    rows = [
        _figure_row("P1", f"{label} of {mib:.0f} MiB, 2 storage units (GB/s)", (ours, ref), [op], True,
                    "≥ 3× the reference", 3)
        for op, label in (("put_gbps", "put"), ("get_data_gbps", "get_data"))
    ]  # fmt: skip
    fractions = [ours.get("put_fraction_of_memcpy"), ours.get("get_data_fraction_of_memcpy")]
    ref_fractions = [ref.get("put_fraction_of_memcpy"), ref.get("get_data_fraction_of_memcpy")]
    known = [f for f in fractions if f is not None]
    rows.append(
        (
            "P1",
            f"put / get_data as a share of memcpy ({_num(memcpy)} GB/s); same host, shared memory",
            _err(ours) or " / ".join(_pct(f) for f in fractions),
            _err(ref) or " / ".join(_pct(f) for f in ref_fractions),
            "",
            "≥ 50% of memcpy",
            None if len(known) < 2 else min(known) >= 0.5,
        )
    )
    return rows


def _rows_p2(merged: dict[str, Any]) -> list[Row]:
    ours, ref = _both(merged, "p2_get_meta")

    def curve(res: dict[str, Any]) -> list[tuple[int, float]]:
        sizes = res.get("sizes") or {}
        return sorted((int(k), v["median_ms"]) for k, v in sizes.items() if isinstance(v, dict) and "median_ms" in v)

    oc, rc = curve(ours), curve(ref)

    def show(points: list[tuple[int, float]], res: dict[str, Any]) -> str:
        if _err(res):
            return _err(res) or ""
        if not points:
            return "n/a"
        (s0, m0), (s1, m1) = points[0], points[-1]
        return f"{_num(m0)} → {_num(m1)} ms ({_size(s0)} → {_size(s1)})"

    ours_1m = dict(oc).get(ONE_M)
    ref_1m = dict(rc).get(ONE_M)
    met: bool | None = None
    if ours_1m is not None and oc:
        # "flat": at 1M no slower than 2x the smallest partition measured
        met = ours_1m <= 2.0 and ours_1m <= 2 * oc[0][1]
    elif oc:
        met = None  # 1M not measured (quick run, or skipped)
    gain = _gain(ours_1m, ref_1m, False)
    return [
        (
            "P2",
            "get_meta(1024), median, smallest → largest partition",
            show(oc, ours),
            show(rc, ref),
            f"{_times(gain)} at 1M" if gain else "n/a",
            "flat (1M ≤ 2× 1k) and ≤ 2 ms at 1M",
            met,
        )
    ]


def _rounds(rates: list[float | None] | None) -> str:
    """``"median of 3: a / b / c; "`` for a measure run in several rounds, else nothing."""
    rates = rates or []
    return f"median of {len(rates)}: {' / '.join(map(_num, rates))}; " if len(rates) > 1 else ""


def _rows_p3(merged: dict[str, Any]) -> list[Row]:
    ours, ref = _both(merged, "p3_concurrency")
    p = _params(merged, "p3_concurrency")
    clean = ours.get("duplicates") == 0 and ours.get("complete") is True
    label = (f"{p.get('producers', '?')} producer + {p.get('consumers', '?')} consumer processes, "
             f"{p.get('samples', '?')} samples: claims/s")  # fmt: skip
    return [
        _run_row("P3", label, (ours, ref), "claims_per_s",
                 lambda res, rate: f"{_num(rate)}/s ({_rounds(res.get('rounds_claims_per_s'))}"
                                   f"{_num(res.get('wall_s'))} s, {res.get('duplicates')} dup)",
                 "≥ 5× the reference, 0 duplicates", 5, clean)
    ]  # fmt: skip


def _rows_p4(merged: dict[str, Any]) -> list[Row]:
    results = _both(merged, "p4_tiny")
    return [
        _figure_row("P4", f"one tiny sample: {op} (median ms)", results, [op, "median_ms"], False,
                    "≤ ¼ of the reference's latency", 4)
        for op in ("put", "get_meta", "get_data")
    ]  # fmt: skip


def _rows_p5(merged: dict[str, Any]) -> list[Row]:
    ours, ref = _both(merged, "p5_pipeline")
    p = _params(merged, "p5_pipeline")

    def describe(res: dict[str, Any], rate: float | None) -> str:
        once = "each sample trained once" if res.get("exactly_once") else "NOT exactly once"
        return f"{_num(rate)} ({_rounds(res.get('rounds_steps_per_s'))}{_num(res.get('wall_s'))} s, {once})"

    label = (f"`demo`-shaped pipeline, {p.get('steps', '?')} steps × {p.get('batch', '?')} prompts × "
             f"{p.get('n_samples', '?')} samples: steps/s")  # fmt: skip
    return [
        _run_row("P5", label, (ours, ref), "steps_per_s", describe, "≥ 1.5× the reference", 1.5,
                 ours.get("exactly_once") is True),
        _p5_overhead_row(ours, ref, "pipeline overhead above its compute-bound wall time (stages compute on the "
                         "CPU cores they share with everything else)"),
        _p5_overhead_row(_mode(ours, "device"), _mode(ref, "device"),
                         f"the same with device compute ({p.get('device_us_per_token', '?')} µs per token, host CPU "
                         "free; bound over the workers)"),
    ]  # fmt: skip


def _mode(res: dict[str, Any], mode: str) -> dict[str, Any]:
    """P5's median run in compute mode ``mode`` (``benchmarks/p5_compute.py``); empty if not run."""
    return (res.get("other_modes") or {}).get(mode) or {}


def _p5_overhead_row(ours: dict[str, Any], ref: dict[str, Any], label: str) -> Row:
    """The pipeline's wall time above its compute-bound wall time (plain bounds and the
    compute-only schedule, ``benchmarks/p5_schedule.py``), as a share of it."""

    def show(res: dict[str, Any]) -> str:
        if _err(res):
            return _err(res) or ""
        pct, over, bound = res.get("overhead_pct_of_bound"), res.get("overhead_s"), res.get("compute_bound_s")
        if pct is None:
            return "n/a"
        return f"{pct:.0f}% ({_num(over)} s over a {_num(bound)} s bound)"

    o, r = ours.get("overhead_s"), ref.get("overhead_s")
    gain = _gain(o, r, False)
    pct = ours.get("overhead_pct_of_bound")
    met = None if pct is None or gain is None else (pct <= 10 and gain >= 3)
    return ("P5", label, show(ours), show(ref), _times(gain),
            "≤ 10% of the bound and ≤ ⅓ of the reference's overhead", met)  # fmt: skip


def _p5_path_lines(merged: dict[str, Any]) -> list[str]:
    """Where each system's P5 overhead with device compute went along the trainer's path
    (``benchmarks/p5_path.py``), in the median rounds; nothing if the run has no such split."""
    parts = []
    for system, res in zip(("tq-redis", "the reference"), _both(merged, "p5_pipeline")):
        device = _mode(res, "device")
        split, path = device.get("overhead_split"), device.get("trainer_path")
        if split and path:
            parts.append(f"{system}: {describe_path(split, path)}")
    if not parts:
        return []
    return [
        "",
        "Where P5's overhead with device compute went, along the trainer's path (the run ends when the "
        "trainer does; `benchmarks/p5_path.py`): " + "; ".join(parts) + ".",
    ]


def _p5_cpu_lines(merged: dict[str, Any]) -> list[str]:
    """Where the machine's CPU went in each system's median P5 round with CPU compute
    (``benchmarks/p5_accounting.py``), and what the 10% goal leaves for everything but the
    compute on this machine's cores; nothing for a result without the split."""
    results = _both(merged, "p5_pipeline")
    parts = [
        f"{system}: {describe_cpu(res['cpu'])}"
        for system, res in zip(("tq-redis", "the reference"), results)
        if isinstance(res.get("cpu"), dict) and "data_calls_s" in res["cpu"]
    ]
    if not parts:
        return []
    lines = ["", "Where the CPU went in P5 with CPU compute (core-seconds, median round): " + "; ".join(parts) + "."]
    ours = results[0]
    cpu, bound = ours.get("cpu") or {}, ours.get("compute_bound_s")
    cores = (merged.get("machine") or {}).get("cpu_count")
    if "servers_s" in cpu and bound and cores:
        room = cores * 1.1 * bound  # the cores' CPU over a run 10% longer than the bound
        left = room - cpu["compute_s"]
        fixed = cpu["servers_s"] + cpu["workers_glue_s"]
        lines.append(
            f"An overhead of 10% of the bound gives tq-redis's run {cores} cores × 1.1 × {_num(bound)} s = "
            f"{_num(room)} core-seconds, {_num(cpu['compute_s'])} of them the compute: that leaves {_num(left)} for "
            f"everything else, and its server processes (Redis running its scripts) and the workers' own glue "
            f"(the benchmark's, not the data system's calls) used {_num(fixed)} before any client call is counted. "
            "On a machine with fewer cores than the pipeline's processes this mode measures CPU spent, not "
            "latency; the device-compute row is the pipeline's critical path over its workers."
        )
    return lines


def _rows_p1_tcp(merged: dict[str, Any]) -> list[Row]:
    res = _result(merged, "p1_tcp", "tq_redis")
    rows: list[Row] = []
    for key in sorted(k for k in res if k.startswith("nodes_")):
        nodes, row = key.split("_", 1)[1], res[key]
        for op in ("put", "get"):
            share = row.get(f"{op}_share")
            ours = f"{_num(row['store'][op])} GB/s ({_pct(share)} of {_num(row['limit'][op])} GB/s)"
            rows.append(("P1-TCP", f"{op} of 64 MiB over TCP, shared memory off, {nodes} node(s)", ours,
                         "n/a (tq-redis only)", "", "≥ 70% of the plain-socket limit (same run)",
                         None if share is None else share >= 0.7))  # fmt: skip
    return rows or [("P1-TCP", "storage nodes over TCP", _err(res) or "n/a", "n/a", "", "≥ 70% of the limit", None)]


def _rows_p6(merged: dict[str, Any]) -> list[Row]:
    res = _result(merged, "p6_shard", "tq_redis")
    if _err(res):
        return [("P6", "one shard's claim ceiling", _err(res) or "", "n/a", "", "≥ 20k claims/s, batch 1", None)]
    noop = res.get("noop_fcall") or {}
    rows: list[Row] = []
    for batch in (1, 16):
        row = res.get(f"batch_{batch}") or {}
        ceiling = row.get("script_ceiling_per_s")
        ours = (f"{_num(ceiling)}/s ({_num(row.get('command_usec_per_item'))} µs command time a claim"
                f"{_best_of(row.get('rounds_command_usec_per_item'))}); "
                f"{_num(row.get('ceiling_per_s'))}/s counting all server CPU "
                f"({_num(row.get('cpu_usec_per_item'))} µs, socket calls included); "
                f"{_num(row.get('claims_per_s'))}/s measured with the clients on the same 2 cores")  # fmt: skip
        limit = (f"no-op FCALL: {_num(noop.get('script_ceiling_per_s'))}/s "
                 f"({_num(noop.get('command_usec_per_item'))} µs); {_num(noop.get('ceiling_per_s'))}/s "
                 f"by CPU ({_num(noop.get('cpu_usec_per_item'))} µs)") if noop else "n/a"  # fmt: skip
        target = "≥ 20k claims/s (command time)" if batch == 1 else "(reported)"
        rows.append(("P6", f"one shard's ceiling, one hot partition, batch {batch}: claims/s", ours, limit, "",
                     target, (ceiling >= 20_000 if ceiling else None) if batch == 1 else None))  # fmt: skip
    return rows


def _best_of(rounds: list[float] | None) -> str:
    """``, best of 3 rounds: a / b / c µs`` for a P6 figure kept from several rounds, else nothing."""
    if not rounds or len(rounds) < 2:
        return ""
    return f", best of {len(rounds)} rounds: {' / '.join(_num(us) for us in rounds)} µs"


def _rows_p7(merged: dict[str, Any]) -> list[Row]:
    res = _result(merged, "p7_cluster", "tq_redis")
    if _err(res):
        return [("P7", "1 vs 3 shards, many partitions", _err(res) or "", "n/a", "", "(reported)", None)]
    rows: list[Row] = []
    for batch in (1, 16):
        one = (res.get("shards_1") or {}).get(f"batch_{batch}") or {}
        three = (res.get("shards_3") or {}).get(f"batch_{batch}") or {}
        scale = (res.get(f"scale_batch_{batch}") or {}).get("ceiling_ratio")
        ours = (f"1 shard {_num(one.get('aggregate_ceiling_per_s'))}/s, 3 shards "
                f"{_num(three.get('aggregate_ceiling_per_s'))}/s ({_num(three.get('cpu_usec_per_claim'))} µs "
                f"server CPU a claim)")  # fmt: skip
        rows.append(("P7", f"12 partitions, batch {batch}: claims/s the shards can serve", ours, "n/a (tq-redis only)",
                     _times(scale), "(reported; ×3 shards is the ideal)", None))  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------
# The section
# ----------------------------------------------------------------------------------------
def build_section(
    merged: dict[str, Any], results_link: str = "benchmarks/results", measures_link: str | None = "benchmarks/README.md"
) -> str:
    """The Markdown between the markers (without them); links are relative to the file it goes in
    (``measures_link=None``: ``benchmarks/README.md`` is named, not linked, as outside the docs' sources)."""
    machine = merged.get("machine") or {}
    versions = merged.get("versions") or {}
    measures = merged.get("measures") or {}
    runs = merged.get("runs") or {}
    dates = sorted(d for d in (doc.get("date") for doc in measures.values()) if d)
    when = merged.get("started") or (dates[0] if dates else merged.get("date", "?"))
    load = merged.get("loadavg_at_start") or machine.get("loadavg_1_5_15")
    load_text = " / ".join(f"{x:.1f}" for x in load) if load else "n/a"
    commit = merged.get("git_commit")
    wall = merged.get("run_wall_s")
    rows: list[Row] = []
    for build in (_rows_p1, _rows_p1_tcp, _rows_p2, _rows_p3, _rows_p4, _rows_p5, _rows_p6, _rows_p7):
        rows.extend(build(merged))

    lines = [
        "<!-- generated by `python -m benchmarks.report` from benchmarks/results/all.json; edits are overwritten -->",
        "",
        f"Both systems measured in the same run of `.venv-bench/bin/python -m benchmarks` "
        f'(tq-redis against `transferqueue=={versions.get("transferqueue") or "?"}`, "the reference"):',
        "",
        f"* **date** {when}" + (f"; the measures took {wall / 60:.1f} min" if wall else ""),
        f"* **machine** {machine.get('cpu_count', '?')} cores ({machine.get('processor') or '?'}), "
        f"{machine.get('platform', '?')}, Python {machine.get('python', '?')}; load average "
        f"{load_text} (1 / 5 / 15 min) at the start; the machine is shared, so figures move with the load",
        f"* **commit** `{commit[:12]}`" if commit else "* **commit** n/a (no git commit)",
        f"* **versions** torch {versions.get('torch')}, tensordict {versions.get('tensordict')}, "
        f"numpy {versions.get('numpy')}, ray {versions.get('ray')}",
        f"* **tq-redis batch copies** {machine.get('tq_redis_copies', 'n/a')}, batch scans "
        f"{machine.get('tq_redis_scans', 'n/a')} (see Bulk copies under Backends)",
        "",
        "| # | measure | tq-redis | reference | tq-redis vs reference | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for pid, label, ours, ref, gain, target, met in rows:
        lines.append(f"| {pid} | {label} | {ours} | {ref} | {gain} | {target} | {_met(met)} |")
    lines += [
        "",
        '"tq-redis vs reference" is how many times better tq-redis is: ours / reference for rates, '
        "reference / ours for latencies. What each measure does: "
        + (f"[benchmarks/README.md]({measures_link})." if measures_link else "`benchmarks/README.md`."),
        "",
        "P5's two overhead rows run the same pipeline two ways. With *CPU compute* the stages' work "
        "runs on the cores the six worker processes share with their clients, Redis, the storage "
        "units and the OS: on 2 cores every CPU-second of the data plane is taken from the compute, "
        "so the overhead is mostly CPU the data plane used. With *device compute* a batch holds its "
        "worker for a known time per token while the host CPU stays free, as on GPU ranks: the "
        "overhead is the data system's latency on the pipeline's critical path.",
    ]
    lines += _p5_path_lines(merged)
    lines += _p5_cpu_lines(merged)
    loads = [
        f"{_label(m)} {doc['loadavg_at_start'][0]:.1f}"
        for m, doc in sorted(measures.items())
        if doc.get("loadavg_at_start")
    ]
    if loads:
        lines += [
            "",
            f"Load average (1 min) when each measure started: {', '.join(loads)} "
            "(a decaying average: it still counts the previous measure's own processes).",
        ]
    probed = {
        m: doc["cpu_probe_s"]
        for m, doc in sorted(measures.items())
        if isinstance(doc.get("cpu_probe_s"), dict) and doc["cpu_probe_s"].get("start")
    }
    if probed:
        probes = [f"{_label(m)} {_num(p.get('start'))} → {_num(p.get('end'))}" for m, p in probed.items()]
        seen = [x for p in probed.values() for x in (p.get("start"), p.get("end")) if x]
        lines += [
            "",
            f"Machine speed when each measure started → ended, as seconds a fixed Python loop took "
            f"(`benchmarks._common.cpu_probe_s`; lower is faster): {', '.join(probes)}. This shared "
            f"machine's speed drifts within minutes ({_num(min(seen))} to {_num(max(seen))} s in this run; "
            "0.08 to 0.20 s seen on it), and every figure moves with it.",
        ]
    waits = [
        f"{_label(m)} {doc['quiet_at_start']['waited_s']:.1f} s"
        + ("" if doc["quiet_at_start"].get("quiet") else " (still busy)")
        for m, doc in sorted(measures.items())
        if isinstance(doc.get("quiet_at_start"), dict)
    ]
    if waits:
        lines += [
            "",
            "Each measure starts once the cores have been quiet (under 15% busy) for two half-second windows, "
            "so the previous measure's leftover processes do not run in it; the wait, at most 30 s: "
            f"{', '.join(waits)}.",
        ]
    notes = []
    quick = [m for m, doc in measures.items() if doc.get("quick")]
    if quick:
        notes.append(f"run with `--quick` (smaller sizes): {', '.join(quick)}")
    missing = [m for m in CHARTS if m not in measures]
    if missing:
        notes.append(f"no result: {', '.join(missing)}")
    if runs:
        stale = [f"{m} ({measures[m].get('date')})" for m in measures if m not in runs]
        if stale:
            notes.append(f"from an earlier run: {', '.join(stale)}")
        failed = [f"{m} ({r.get('status')})" for m, r in runs.items() if r.get("status") != "ok"]
        if failed:
            notes.append(f"failed in this run: {', '.join(failed)}")
    errors = [
        f"{m} {system}: {res['error']}"
        for m, doc in measures.items()
        for system, res in (doc.get("results") or {}).items()
        if isinstance(res, dict) and "error" in res
    ]
    if errors:
        notes.append("errors: " + "; ".join(e.replace("|", "\\|") for e in errors))
    if notes:
        lines += ["", *(f"> {n}" for n in notes)]
    charts = [f"![{m.split('_', 1)[0].upper()}]({results_link}/{m}.png)" for m in CHARTS if m in measures]
    if charts:
        lines += ["", "Charts:", "", *(f"{chart}\n" for chart in charts)]
    return "\n".join(lines).rstrip("\n")


def build_summary(merged: dict[str, Any], doc_link: str = "docs/benchmarks.md") -> str:
    """The README's short form of the same run: when and where, and the P1-P5 rows."""
    machine = merged.get("machine") or {}
    versions = merged.get("versions") or {}
    measures = merged.get("measures") or {}
    dates = sorted(d for d in (doc.get("date") for doc in measures.values()) if d)
    when = merged.get("started") or (dates[0] if dates else merged.get("date", "?"))
    rows: list[Row] = []
    for build in (_rows_p1, _rows_p2, _rows_p3, _rows_p4, _rows_p5):
        rows.extend(row for row in build(merged) if row[0] in SUMMARY_MEASURES)
    lines = [
        "<!-- generated by `python -m benchmarks.report` from benchmarks/results/all.json; edits are overwritten -->",
        "",
        f"tq-redis against `transferqueue=={versions.get('transferqueue') or '?'}` (\"the reference\") in one "
        f"run on {machine.get('cpu_count', '?')} shared cores, {str(when)[:10]}:",
        "",
        "| # | measure | tq-redis | reference | tq-redis vs reference | target met |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {pid} | {label} | {ours} | {ref} | {gain} | {_met(met)} |"
              for pid, label, ours, ref, gain, _target, met in rows]  # fmt: skip
    lines += [
        "",
        f"The machine, the targets, P1-TCP, P6 and P7, where P5's overhead goes, and the charts: "
        f"[docs/benchmarks.md]({doc_link}).",
    ]
    return "\n".join(lines)


def update_block(path: Path, section: str, start: str = START, end: str = END, heading: str = HEADING) -> bool:
    """Replace the text between the markers ``start`` and ``end`` (adding heading and markers at the
    end of the file when missing).

    Returns:
        ``True`` if the file changed.
    """
    text = path.read_text()
    block = f"{start}\n{section}\n{end}"
    if start in text and end in text:
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        new = pattern.sub(lambda _: block, text, count=1)
    else:
        new = text.rstrip("\n") + f"\n\n{heading}\n\n{block}\n"
    if new == text:
        return False
    path.write_text(new)
    return True


def _relative(target: Path, start: Path) -> str:
    """``target`` as a link from a file in directory ``start``."""
    return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()


def main(argv: Sequence[str] | None = None) -> int:
    """Read ``all.json`` and rewrite the docs' section and the README's summary (or print the section)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR / "all.json", help="merged results JSON")
    parser.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="page to rewrite")
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md", help="README to rewrite")
    parser.add_argument("--print", action="store_true", help="print the section; leave the files alone")
    args = parser.parse_args(argv)
    if not args.results.exists():
        print(f"{args.results} not found: run python -m benchmarks first", file=sys.stderr)
        return 1
    merged = json.loads(args.results.read_text())
    doc_dir = args.doc.parent
    section = build_section(merged, _relative(args.results.parent, doc_dir), measures_link=None)
    if args.print:
        print(section)
        return 0
    changed = update_block(args.doc, section)
    print(f"{'rewrote' if changed else 'unchanged:'} {args.doc} ({START} ... {END})", flush=True)
    summary = build_summary(merged, _relative(args.doc, args.readme.parent))
    changed = update_block(args.readme, summary, SUMMARY_START, SUMMARY_END)
    print(f"{'rewrote' if changed else 'unchanged:'} {args.readme} ({SUMMARY_START} ... {SUMMARY_END})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
