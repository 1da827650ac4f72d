"""P3: many processes on one partition. 8 producers + 32 consumers drain 8,192 small samples.

The parent opens the system, then starts ``--producers`` + ``--consumers`` separate worker
processes (a forkserver that has imported torch and both systems once, so 40 workers start
cheaply); each attaches to the running system (:func:`benchmarks.reference.attach`) and waits at
a barrier so that the clock starts when every process is connected (and, before that, the machine
is quiet: :func:`benchmarks._common.wait_until_quiet`, as the system of the previous round may
still be exiting).

* Each producer puts its share of ``--samples`` samples (one ``int64[16]`` field, the sample's
  number) in batches of ``--put-batch``.
* Each consumer loops ``get_meta(batch_size=--get-batch, mode="fetch")`` for ONE shared task
  name and ``get_data`` of what it claimed, until all samples are claimed, recording every
  global index it was handed. The reference runs in polling mode (an empty ``get_meta`` returns
  at once; the consumer sleeps ``--poll-interval`` and asks again); tq-redis blocks on its event
  stream for up to ``--wait-s`` inside ``get_meta(timeout=...)`` instead.

``--phase concurrent`` (default) runs producers and consumers at once, so the drain rate is
bounded by the slower side; ``--phase prefill`` makes consumers wait until every sample is put
and then times the claims alone.

Reported: wall time from the barrier to the last claim, aggregate claims/s (samples claimed per
second of that wall time; with ``prefill``, per second of the claim phase), when the producers
were done, ``get_meta`` calls and empty polls, and ``duplicates``: the number of times a sample
was handed to the task beyond the first (must be 0), plus ``missing`` samples never handed out.

Rounds: ``--rounds`` runs (default 3, quick 1), the systems alternating within each; the round
with the median claims/s is reported, with every round's rate. On this shared 2-core machine
the same code drained at anywhere from ~800 to ~1,500 claims/s within minutes, so one run per
system compares machine states as much as systems. Duplicates and missing samples are summed
over every round.

Run: ``python -m benchmarks.p3_concurrency [--systems ...] [--quick] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import threading
import time
import traceback
from typing import Any

from benchmarks._common import (
    median_round,
    parse_args,
    print_run_comparison,
    run_per_system,
    wait_until_quiet,
    write_result,
)
from benchmarks.reference import (
    at_start_line,
    attach,
    hosting_workers,
    preload_modules,
    start_workers,
    startup_seconds,
)

MEASURE = "p3_concurrency"
PARTITION = "p3"
TASK = "p3_drain"
FIELD = "x"
WIDTH = 16


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--producers", type=int, default=None, help="producer processes (default 8, quick 4)")
    parser.add_argument("--consumers", type=int, default=None, help="consumer processes (default 32, quick 8)")
    parser.add_argument("--samples", type=int, default=None, help="samples to drain (default 8192, quick 1024)")
    parser.add_argument("--put-batch", type=int, default=1, help="samples per producer put (default %(default)s)")
    parser.add_argument("--get-batch", type=int, default=1, help="get_meta batch_size (default %(default)s)")
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=0.2,
        help="consumer sleep after an empty poll, s (default %(default)s)",
    )
    parser.add_argument(
        "--wait-s",
        type=float,
        default=0.5,
        help="tq-redis get_meta(timeout=...) per call, s (default %(default)s)",
    )
    parser.add_argument("--no-read", action="store_true", help="consumers skip get_data")
    parser.add_argument("--phase", choices=("concurrent", "prefill"), default="concurrent", help="see module doc")
    parser.add_argument(
        "--attach-mode",
        choices=("zmq", "ray"),
        default="zmq",
        help="how reference workers attach (see reference.py)",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up after this long (default %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="runs per system, alternating; the median is reported (default 3)"
    )


def _worker(
    role: str,
    wid: int,
    name: str,
    spec: dict[str, Any],
    cfg: dict[str, Any],
    barrier: Any,
    counter: Any,
    produced: Any,
    results: Any,
) -> None:
    """Body of one producer or consumer process; sends one report dict to ``results``."""
    report: dict[str, Any] = {"role": role, "wid": wid, "pid": os.getpid()}
    client = close = None
    try:
        t_attach = time.perf_counter()
        client, close = attach(name, spec, attach_mode=cfg["attach_mode"])
        report["attach_s"] = time.perf_counter() - t_attach
        at_start_line(barrier, cfg["barrier_timeout_s"])
        deadline = time.monotonic() + cfg["timeout_s"]
        cpu0 = time.process_time()
        if role == "producer":
            report.update(_produce(client, wid, cfg, produced, deadline))
        else:
            report.update(_consume(client, name, cfg, counter, produced, deadline))
        report["cpu_s"] = time.process_time() - cpu0  # this process's CPU over the run, all its threads
    except Exception as exc:  # noqa: BLE001 - sent to the parent, which reports it
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
        if isinstance(exc, threading.BrokenBarrierError):
            report["error"] = "barrier broken (another worker failed to attach in time)"
            report.pop("traceback")
        elif "attach_s" not in report:
            barrier.abort()  # this worker never reaches the barrier: release the others now
    finally:
        results.put(report)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - the figures are already sent
                pass


def _produce(client: Any, wid: int, cfg: dict[str, Any], produced: Any, deadline: float) -> dict[str, Any]:
    """Put this producer's share of samples in batches; return its figures."""
    import torch
    from tensordict import TensorDict

    share = cfg["samples"] // cfg["producers"]
    first = wid * share
    put_batch = cfg["put_batch"]
    puts = 0
    t0 = time.perf_counter()
    for start in range(first, first + share, put_batch):
        if time.monotonic() > deadline:
            break
        n = min(put_batch, first + share - start)
        values = torch.arange(start, start + n, dtype=torch.int64).unsqueeze(1).expand(n, WIDTH).contiguous()
        client.put(TensorDict({FIELD: values}, batch_size=[n]), partition_id=PARTITION)
        with produced.get_lock():
            produced.value += n
        puts += 1
    return {"puts": puts, "put_s": time.perf_counter() - t0, "done_at": time.time()}


def _consume(
    client: Any, name: str, cfg: dict[str, Any], counter: Any, produced: Any, deadline: float
) -> dict[str, Any]:
    """Claim batches for the shared task until every sample is claimed; return what it got."""
    total = cfg["samples"]
    if cfg["phase"] == "prefill":
        while produced.value < total and time.monotonic() < deadline:
            time.sleep(0.005)
    batch = cfg["get_batch"]
    wait_kw = {"timeout": cfg["wait_s"]} if name == "tq_redis" else {}
    got: list[int] = []
    calls = empty = 0
    last_claim_at = None
    while counter.value < total and time.monotonic() < deadline:
        meta = client.get_meta(
            data_fields=[FIELD],
            batch_size=batch,
            partition_id=PARTITION,
            mode="fetch",
            task_name=TASK,
            **wait_kw,
        )
        calls += 1
        if meta.size == 0:
            empty += 1
            if not wait_kw and cfg["poll_interval"] > 0:
                time.sleep(cfg["poll_interval"])
            continue
        indexes = [int(i) for i in meta.global_indexes]
        with counter.get_lock():
            counter.value += len(indexes)
        last_claim_at = time.time()
        got.extend(indexes)
        if cfg["read"]:
            client.get_data(meta)
    return {"indexes": got, "get_meta_calls": calls, "empty_polls": empty, "last_claim_at": last_claim_at}


def measure_system(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the producer/consumer drain against system ``name`` and count duplicates."""
    with hosting_workers(name, num_storage_units=2, polling_mode=True) as (spec, ctx, procs):
        n_workers = cfg["producers"] + cfg["consumers"]
        barrier = ctx.Barrier(n_workers + 1)
        counter = ctx.Value("q", 0)
        produced = ctx.Value("q", 0)
        results = ctx.Queue()
        roles = [("producer", i) for i in range(cfg["producers"])] + [("consumer", i) for i in range(cfg["consumers"])]
        jobs = [
            (f"p3-{name}-{role}-{wid}", (role, wid, name, spec, cfg, barrier, counter, produced, results))
            for role, wid in roles
        ]
        started = start_workers(ctx, procs, _worker, jobs, barrier, cfg["barrier_timeout_s"], wait_until_quiet)
        print(f"[{name}] {n_workers} workers attached in {started.attach_s:.1f} s; draining...", flush=True)

        reports = _collect(results, procs, n_workers, cfg["timeout_s"] + 60, name, counter, cfg["samples"])
        result = _summarize(name, reports, started.wall, started.attach_s, cfg)
        result["quiet_before_run"] = started.settled
        return result


def _collect(
    results: Any, procs: list[Any], n_workers: int, timeout_s: float, name: str, counter: Any, total: int
) -> list[dict[str, Any]]:
    """Gather one report per worker, printing progress every few seconds."""
    reports: list[dict[str, Any]] = []
    end = time.monotonic() + timeout_s
    next_note = time.monotonic() + 10
    while len(reports) < n_workers and time.monotonic() < end:
        try:
            reports.append(results.get(timeout=1.0))
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs):
                break
        if time.monotonic() > next_note:
            print(f"[{name}]   claimed {counter.value}/{total}", flush=True)
            next_note = time.monotonic() + 10
    return reports


def _summarize(
    name: str, reports: list[dict[str, Any]], start_wall: float, attach_all_s: float, cfg: dict[str, Any]
) -> dict[str, Any]:
    """Turn worker reports into the figures of one system."""
    errors = [f"{r['role']} {r['wid']}: {r['error']}" for r in reports if "error" in r]
    for r in reports:
        if "traceback" in r:
            print(f"[{name}] {r['role']} {r['wid']} failed:\n{r['traceback']}", file=sys.stderr, flush=True)
    consumers = [r for r in reports if r["role"] == "consumer" and "indexes" in r]
    producers = [r for r in reports if r["role"] == "producer" and "put_s" in r]
    counts = collections.Counter(i for r in consumers for i in r["indexes"])
    claimed = sum(counts.values())
    distinct = len(counts)
    duplicates = claimed - distinct
    last = [r["last_claim_at"] for r in consumers if r.get("last_claim_at")]
    wall = (max(last) - start_wall) if last else None
    produce_wall = max((r["done_at"] for r in producers), default=start_wall) - start_wall
    claim_phase = wall if cfg["phase"] == "concurrent" or wall is None else wall - produce_wall
    result = {
        "claimed": claimed,
        "distinct": distinct,
        "duplicates": duplicates,
        "missing": cfg["samples"] - distinct,
        "complete": distinct == cfg["samples"],
        "wall_s": wall,
        "claims_per_s": claimed / claim_phase if claim_phase else None,
        "claim_phase_s": claim_phase,
        "producers_done_s": produce_wall,
        "get_meta_calls": sum(r["get_meta_calls"] for r in consumers),
        "empty_polls": sum(r["empty_polls"] for r in consumers),
        # where the machine's CPU went: the clients' own CPU per sample claimed, by role
        "producer_cpu_us_per_sample": _cpu_per_sample(producers, distinct),
        "consumer_cpu_us_per_sample": _cpu_per_sample(consumers, distinct),
        "attach_all_s": attach_all_s,
        "attach_s_max": max((r.get("attach_s", 0.0) for r in reports), default=None),
        "workers_reported": len(reports),
        "errors": errors,
        "startup_s": startup_seconds(name),
    }
    print(
        f"[{name}] claimed {claimed} ({distinct} distinct, {duplicates} duplicates) in "
        f"{wall if wall is None else round(wall, 2)} s -> {result['claims_per_s'] or 0:.1f} claims/s; "
        f"producers done at {produce_wall:.1f} s; {result['get_meta_calls']} get_meta calls "
        f"({result['empty_polls']} empty)",
        flush=True,
    )
    if result["producer_cpu_us_per_sample"] is not None and result["consumer_cpu_us_per_sample"] is not None:
        print(
            f"[{name}] client CPU per sample: producers {result['producer_cpu_us_per_sample']:.0f} µs, "
            f"consumers {result['consumer_cpu_us_per_sample']:.0f} µs",
            flush=True,
        )
    if errors:
        print(f"[{name}] {len(errors)} worker error(s): {errors[:3]}", flush=True)
    return result


def _cpu_per_sample(reports: list[dict[str, Any]], samples: int) -> float | None:
    """The workers' CPU seconds (``process_time``, every thread) per sample, in µs."""
    cpu = [r["cpu_s"] for r in reports if "cpu_s" in r]
    return 1e6 * sum(cpu) / samples if cpu and samples else None


def _median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median claims/s (:func:`benchmarks._common.median_round`); duplicates
    and missing samples summed over the rounds, complete only if every round was. All rounds
    failed: the first one's error."""
    median = median_round(runs, "claims_per_s")
    if median is None:
        return runs[0]
    median["duplicates"] = sum(r.get("duplicates", 0) for r in runs)
    median["missing"] = sum(r.get("missing", 0) for r in runs)
    median["complete"] = median["rounds_failed"] == 0 and all(r.get("complete") for r in runs)
    return median


def main() -> dict[str, Any]:
    """Measure every requested system; print and write the result."""
    args = parse_args(__doc__.splitlines()[0], _add_args)
    cfg = {
        "producers": args.producers or (4 if args.quick else 8),
        "consumers": args.consumers or (8 if args.quick else 32),
        "samples": args.samples or (1024 if args.quick else 8192),
        "put_batch": args.put_batch,
        "get_batch": args.get_batch,
        "poll_interval": args.poll_interval,
        "wait_s": args.wait_s,
        "read": not args.no_read,
        "attach_mode": args.attach_mode,
        "timeout_s": args.timeout_s,
        "phase": args.phase,
        "barrier_timeout_s": 300.0,
        "payload": f"{FIELD}: int64[{WIDTH}] per sample",
        "process_model": "separate processes (forkserver), each attached to the running system",
    }
    if cfg["samples"] % cfg["producers"] or cfg["samples"] % cfg["get_batch"]:
        raise SystemExit("--samples must be a multiple of --producers and of --get-batch")
    # One forkserver for the whole run, with both systems' imports preloaded (a missing one is
    # skipped by multiprocessing), so each of the 40 workers starts with torch already imported.
    modules = sorted({m for s in args.systems for m in preload_modules(s)})
    mp.set_forkserver_preload(modules)
    print(
        f"P3: {cfg['producers']} producers + {cfg['consumers']} consumers, {cfg['samples']} samples, "
        f"put batch {cfg['put_batch']}, get batch {cfg['get_batch']}"
    )
    rounds = args.rounds or (1 if args.quick else 3)
    cfg["rounds"] = rounds
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.systems}
    for k in range(rounds):
        if rounds > 1:
            print(f"=== round {k + 1}/{rounds} ===", flush=True)
        for name, res in run_per_system(args.systems, lambda name: measure_system(name, cfg)).items():
            runs[name].append(res)
    results = {name: _median_round(rs) for name, rs in runs.items()}

    title = f"P3 drain, phase {cfg['phase']} (claims/s higher is better; wall s lower is better)"
    print_run_comparison(title, results, ("aggregate claims/s", "claims_per_s"), ("duplicates", "duplicates"))
    write_result(MEASURE, args, cfg, results, args.out)
    return results


if __name__ == "__main__":
    main()
