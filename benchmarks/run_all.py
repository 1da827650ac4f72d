"""Run every measure, merge the results into ``results/all.json`` and draw the charts.

Each measure runs in its own Python process (``python -m benchmarks.<measure>``), so one
system's Ray cluster, storage processes or forkserver never leak into the next measure, and a
crash in one measure does not stop the others. The per-measure JSON files are then merged into
``benchmarks/results/all.json`` (with the date, the machine and the git commit), and one PNG
chart per measure is drawn next to them with matplotlib. Finally the README's performance section
(between ``<!-- perf:start -->`` and ``<!-- perf:end -->``) is regenerated from ``all.json`` by
:mod:`benchmarks.report` (not after a ``--quick`` run; ``--no-readme`` skips it always).

Run: ``python -m benchmarks [--systems reference,tq_redis] [--quick] [--only p2_get_meta,p4_tiny] [--no-readme]``
or ``python -m benchmarks --charts-only`` to redraw from the JSON files already there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, git_commit, machine_info, versions
from benchmarks.reference import SYSTEMS

MEASURES: tuple[str, ...] = (
    "p1_throughput", "p1_tcp", "p2_get_meta", "p4_tiny", "p3_concurrency", "p5_pipeline", "p6_shard", "p7_cluster",
)  # fmt: skip
"""Measures run by default, cheapest first."""

COLORS = {"reference": "#8c8c8c", "tq_redis": "#d62728", "memcpy": "#1f77b4"}


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated systems (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(MEASURES)}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default %(default)s)")
    parser.add_argument("--charts-only", action="store_true", help="only merge existing JSON and draw charts")
    parser.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    parser.add_argument("--no-readme", action="store_true", help="do not regenerate the README's performance section")
    parser.add_argument(
        "--timeout-s", type=float, default=1800.0, help="per-measure time limit, s (default %(default)s)"
    )
    return parser.parse_args()


def run_measure(measure: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one measure as a child process; return how it went."""
    cmd = [sys.executable, "-m", f"benchmarks.{measure}", "--systems", args.systems, "--out", str(args.out)]
    if args.quick:
        cmd.append("--quick")
    print(f"\n=== {measure}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=args.timeout_s, check=False)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    elapsed = time.perf_counter() - t0
    status = "ok" if rc == 0 else ("timeout" if rc is None else f"exit {rc}")
    print(f"=== {measure}: {status} in {elapsed:.0f} s", flush=True)
    return {"status": status, "seconds": elapsed}


def merge(
    out_dir: Path,
    measures: list[str],
    runs: dict[str, dict[str, Any]],
    started: str | None = None,
    loadavg_at_start: list[float] | None = None,
) -> dict[str, Any]:
    """Merge ``<measure>.json`` files into ``all.json``; return the merged document.

    ``runs`` holds the measures this invocation ran (status, seconds); ``started`` and
    ``loadavg_at_start`` describe the run as a whole (``None`` for ``--charts-only``).
    """
    merged: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "started": started,
        "run_wall_s": sum(r["seconds"] for r in runs.values()) if runs else None,
        "loadavg_at_start": loadavg_at_start,
        "git_commit": git_commit(),
        "machine": machine_info(),
        "versions": versions(),
        "runs": runs,
        "measures": {},
    }
    previous = out_dir / "all.json"
    if not runs and previous.exists():  # --charts-only: keep what the last real run recorded
        try:
            last = json.loads(previous.read_text())
        except ValueError:
            last = {}
        for key in ("started", "run_wall_s", "loadavg_at_start", "runs"):
            merged[key] = last.get(key, merged[key])
    for measure in measures:
        path = out_dir / f"{measure}.json"
        if path.exists():
            merged["measures"][measure] = json.loads(path.read_text())
    all_path = out_dir / "all.json"
    all_path.write_text(json.dumps(merged, indent=2, default=str) + "\n")
    print(f"wrote {all_path}", flush=True)
    return merged


# ----------------------------------------------------------------------------------------
# Charts
# ----------------------------------------------------------------------------------------
def _systems_with(results: dict[str, Any], key: str) -> list[str]:
    return [s for s in SYSTEMS if isinstance(results.get(s), dict) and key in results[s]]


def _label(ax: Any, bar: Any, text: str) -> None:
    """Write ``text`` just above ``bar``."""
    height = bar.get_height()
    ax.annotate(
        text,
        (bar.get_x() + bar.get_width() / 2, height),
        ha="center",
        va="bottom",
        fontsize=8,
        xytext=(0, 2),
        textcoords="offset points",
    )


def _grouped_bars(ax: Any, results: dict[str, Any], systems: list[str], ops: tuple[str, ...],
                  value: Callable[[dict[str, Any], str], float]) -> None:
    """A group of bars per op, a bar per system in each (``value(result, op)`` high, labelled)."""
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(ops))]
        bars = ax.bar(xs, [value(results[system], op) for op in ops], width, label=system, color=COLORS[system])
        for bar in bars:
            _label(ax, bar, f"{bar.get_height():.2f}")


def _run_bars(ax: Any, results: dict[str, Any], key: str, note: Callable[[dict[str, Any], float], str]) -> None:
    """A bar per system of its whole-run figure ``key``, annotated with ``note(result, figure)``
    ("incomplete" for a run without a wall time)."""
    systems = _systems_with(results, key)
    bars = ax.bar(systems, [results[s][key] or 0.0 for s in systems], color=[COLORS[s] for s in systems])
    for bar, system in zip(bars, systems):
        r = results[system]
        _label(ax, bar, note(r, bar.get_height()) if r.get("wall_s") else "incomplete")
    ax.margins(y=0.2)


def chart_p1(doc: dict[str, Any], plt: Any, path: Path) -> None:
    """Grouped bars: put and get_data GB/s per system, memcpy as a dashed line."""
    results = doc["results"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ops = ("put_gbps", "get_data_gbps")
    _grouped_bars(ax, results, _systems_with(results, "put_gbps"), ops, lambda r, op: r[op])
    memcpy = results.get("memcpy", {}).get("gbps")
    if memcpy:
        ax.axhline(memcpy, ls="--", color=COLORS["memcpy"], label=f"memcpy {memcpy:.1f} GB/s")
    ax.set_xticks(range(len(ops)), ["put", "get_data"])
    ax.set_ylabel("GB/s (higher is better)")
    mib = doc["params"]["bytes"] / 2**20
    ax.set_title(f"P1 throughput, {mib:.0f} MiB, {doc['params']['storage_units']} storage units")
    ax.legend()
    _save(fig, path)


def chart_p2(doc: dict[str, Any], plt: Any, path: Path) -> None:
    """Log-log lines: get_meta median latency against partition size, per system."""
    results = doc["results"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for system in _systems_with(results, "sizes"):
        points = [(int(size), row["median_ms"]) for size, row in results[system]["sizes"].items() if "median_ms" in row]
        points.sort()
        if points:
            ax.plot(*zip(*points), marker="o", label=system, color=COLORS[system])
    ax.axhline(2.0, ls=":", color="black", label="target: 2 ms at 1M")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("samples in the partition")
    ax.set_ylabel(f"get_meta({doc['params']['batch']}) median ms (lower is better)")
    ax.set_title("P2 get_meta latency vs partition size")
    ax.legend()
    _save(fig, path)


def chart_p3(doc: dict[str, Any], plt: Any, path: Path) -> None:
    """Bars: aggregate claims/s per system, annotated with wall time and duplicates."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    _run_bars(ax, doc["results"], "claims_per_s",
              lambda r, rate: f"{rate:.0f}/s\n{r['wall_s']:.1f} s, {r['duplicates']} dup")  # fmt: skip
    p = doc["params"]
    ax.set_ylabel("samples claimed per second (higher is better)")
    ax.set_title(f"P3 {p['producers']} producers + {p['consumers']} consumers, {p['samples']} samples")
    _save(fig, path)


def chart_p4(doc: dict[str, Any], plt: Any, path: Path) -> None:
    """Grouped bars: median latency of put / get_meta / get_data of one tiny sample."""
    results = doc["results"]
    ops = ("put", "get_meta", "get_data")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    _grouped_bars(ax, results, _systems_with(results, "put"), ops, lambda r, op: r[op]["median_ms"])
    ax.set_xticks(range(len(ops)), list(ops))
    ax.set_ylabel("median ms (lower is better)")
    ax.set_title(f"P4 one tiny sample, {doc['params']['rounds']} rounds")
    ax.legend()
    _save(fig, path)


def chart_p5(doc: dict[str, Any], plt: Any, path: Path) -> None:
    """Bars: pipeline steps/s per system, annotated with wall time and the exactly-once check."""
    fig, ax = plt.subplots(figsize=(6.5, 4))

    def note(r: dict[str, Any], rate: float) -> str:
        once = "each sample trained once" if r.get("exactly_once") else "NOT exactly once"
        return f"{rate:.2f} steps/s\n{r['wall_s']:.1f} s, {once}"

    _run_bars(ax, doc["results"], "steps_per_s", note)
    p = doc["params"]
    ax.set_ylabel("pipeline steps per second (higher is better)")
    ax.set_title(
        f"P5 demo pipeline: {p['steps']} steps x {p['batch']} prompts x {p['n_samples']} samples, "
        f"{p['workers']} rollout workers",
        fontsize=10,
    )
    _save(fig, path)


CHARTS = {
    "p1_throughput": chart_p1,
    "p2_get_meta": chart_p2,
    "p3_concurrency": chart_p3,
    "p4_tiny": chart_p4,
    "p5_pipeline": chart_p5,
}


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def draw_charts(merged: dict[str, Any], out_dir: Path) -> None:
    """Draw one PNG per measure present in ``merged``; a chart that fails is reported."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for measure, doc in merged["measures"].items():
        draw = CHARTS.get(measure)
        if draw is None:
            continue
        try:
            draw(doc, plt, out_dir / f"{measure}.png")
        except Exception as exc:  # noqa: BLE001 - one bad chart must not hide the others
            print(f"chart {measure} failed: {type(exc).__name__}: {exc}", flush=True)
        finally:
            plt.close("all")


def main() -> int:
    """Run the measures, merge, chart; exit non-zero if any measure failed."""
    args = _parse()
    measures = [m.strip() for m in args.only.split(",")] if args.only else list(MEASURES)
    unknown = [m for m in measures if m not in MEASURES]
    if unknown:
        raise SystemExit(f"unknown measure(s) {unknown}; choose from {list(MEASURES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    started = None if args.charts_only else time.strftime("%Y-%m-%dT%H:%M:%S%z")
    loadavg = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if not args.charts_only:
        for measure in measures:
            runs[measure] = run_measure(measure, args)
    merged = merge(args.out, list(MEASURES), runs, started, None if args.charts_only else loadavg)
    if not args.no_charts:
        draw_charts(merged, args.out)
    if args.no_readme:
        pass
    elif args.quick:
        print("--quick: README not regenerated (python -m benchmarks.report does it anyway)", flush=True)
    elif args.out.resolve() != RESULTS_DIR.resolve():
        print(f"results in {args.out}: README not regenerated (it links to {RESULTS_DIR})", flush=True)
    else:
        from benchmarks import report

        try:
            report.main([])
        except Exception as exc:  # noqa: BLE001 - the results are written; say why the README is not
            print(f"README not regenerated: {type(exc).__name__}: {exc}", flush=True)
    failed = [m for m, r in runs.items() if r["status"] != "ok"]
    if failed:
        print(f"failed measures: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
