"""P11: watching tags (``kv_watch``) against polling ``kv_list`` every 2 s, over 100k keys.

verl's replay buffer finds finished trajectories by listing every key's tags every 2 seconds. This
measures, on one partition of ``--keys`` keys (default 100,000; quick 20,000) tagged ``running``,
what it takes to learn that one key became ``finished``:

* **wake-up latency**: a writer thread tags one key ``finished`` (``kv_put(key, tag=...)``) at a
  random moment; the time until the watcher has that key. ``watch``: a thread blocked in
  ``kv_watch(where={"status": "finished"})`` (it wakes on the change stream). ``poll``: a thread that
  lists the partition every 2 s, as verl does (``kv_list`` of every key and tag) and, as the
  filtered variant, ``kv_list(where=...)``; the expected latency is half the period plus a listing.
* **Redis CPU per operation**: the CPU time of the server's main thread over one operation
  (``INFO cpu``'s ``used_cpu_user_main_thread + used_cpu_sys_main_thread``, read before and after),
  per ``kv_watch`` that returned a change, per listing pass of each kind, and per tag write
  (``kv_put`` of a tag, which also notes the change on the stream). It counts each command once,
  with reading the request and writing the reply, and not the time the server waited for a core.
  (``INFO commandstats``' ``usec`` is neither: it is wall time inside each command, which a loaded
  machine inflates several times, and a script's ``usec`` already holds the commands it called,
  which commandstats lists again under their own names.)

Run on an embedded Valkey and on Debian's Redis 7.0 where installed:
``python -m benchmarks.p11_watch [--keys 100000] [--events 20] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, per_server_flavour, write_result

MEASURE = "p11_watch"
PERIOD_S = 2.0  # verl's polling period
FINISHED = {"status": "finished"}


def _client(url: str, ns: str):
    from tq_redis import TransferQueueClient
    from tq_redis.meta.keys import config_key

    client = TransferQueueClient(url, ns, nested_output=False)
    spec = {"backend": "redis", "options": {}, "inline_max_bytes": 4096}
    client.redis.hset(config_key(ns), "storage", json.dumps(spec))
    return client


def _server_cpu_usec(admin) -> float:
    """CPU time the server's main thread has used so far, in µs."""
    cpu = admin.info("cpu")
    return (float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])) * 1e6


def _fill(client, keys: int) -> list[str]:
    names = [f"traj/{i}" for i in range(keys)]
    for start in range(0, keys, 4096):
        part = names[start:start + 4096]
        client.kv_batch_put(part, "replay", tags=[{"status": "running"}] * len(part))
    return names


def _cpu_per_call(admin, fn, calls: int) -> float:
    before = _server_cpu_usec(admin)
    for _ in range(calls):
        fn()
    return (_server_cpu_usec(admin) - before) / calls


def _watch_latency(url: str, ns: str, keys: list[str], events: int) -> list[float]:
    watcher, writer = _client(url, ns), _client(url, ns)
    latencies: list[float] = []
    written: dict[str, float] = {}
    ready = threading.Event()
    done = threading.Event()

    def watch() -> None:
        cursor = watcher.kv_watch("replay").cursor
        ready.set()
        while len(latencies) < events:
            changes = watcher.kv_watch("replay", cursor, timeout=30, where=FINISHED)
            now = time.perf_counter()
            cursor = changes.cursor
            for key, _ in changes.items():
                latencies.append(now - written[key])
            done.set()

    thread = threading.Thread(target=watch)
    thread.start()
    ready.wait(30)
    for key in random.sample(keys, events):
        time.sleep(random.uniform(0.01, 0.1))
        done.clear()
        written[key] = time.perf_counter()
        writer.kv_put(key, "replay", tag=FINISHED)
        done.wait(30)
    thread.join(60)
    watcher.close()
    writer.close()
    return latencies


def _poll_latency(url: str, ns: str, keys: list[str], events: int, filtered: bool) -> tuple[list[float], list[float]]:
    poller, writer = _client(url, ns), _client(url, ns)
    latencies: list[float] = []
    passes: list[float] = []
    written: dict[str, float] = {}
    stop = threading.Event()
    known = {k for k, t in poller.kv_list("replay")["replay"].items() if t.get("status") == "finished"}

    def poll() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            if filtered:
                finished = set(poller.kv_list("replay", where=FINISHED).get("replay", {}))
            else:  # verl: every key and tag, diffed in the client
                finished = {k for k, t in poller.kv_list("replay")["replay"].items() if t.get("status") == "finished"}
            now = time.perf_counter()
            passes.append(now - started)
            for key in finished - known:
                if key in written:
                    latencies.append(now - written[key])
            known.update(finished)
            stop.wait(max(0.0, PERIOD_S - (time.perf_counter() - started)))

    thread = threading.Thread(target=poll)
    thread.start()
    for key in random.sample(keys, events):
        time.sleep(random.uniform(0.0, PERIOD_S))  # a change at any moment of the period
        written[key] = time.perf_counter()
        writer.kv_put(key, "replay", tag=FINISHED)
    deadline = time.monotonic() + 4 * PERIOD_S + 30
    while len(latencies) < events and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    thread.join(60)
    poller.close()
    writer.close()
    return latencies, passes


def _summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "mean_ms": statistics.fmean(ordered) * 1000,
        "max_ms": ordered[-1] * 1000,
        "events": len(ordered),
    }


def measure_server(url: str, keys: int, events: int) -> dict[str, Any]:
    import redis

    admin = redis.Redis.from_url(url)
    results: dict[str, Any] = {}
    ns = f"p11{uuid.uuid4().hex[:8]}"
    client = _client(url, ns)
    t0 = time.perf_counter()
    names = _fill(client, keys)
    print(f"  {keys} keys tagged in {time.perf_counter() - t0:.1f} s", flush=True)

    latency = _watch_latency(url, ns, names, events)
    results["watch"] = _summary(latency)
    for filtered, name in ((False, "poll kv_list every 2 s"), (True, "poll kv_list(where=) every 2 s")):
        latency, passes = _poll_latency(url, ns, names, max(3, events // 4), filtered)
        results[name] = {**_summary(latency), "pass_ms": statistics.median(passes) * 1000}

    # Redis CPU per operation
    cursor = client.kv_watch("replay").cursor
    sample = random.sample(names, 50)
    results["tag write (kv_put tag)"] = {"redis_usec_per_op": _cpu_per_call(
        admin, lambda: client.kv_put(sample[0], "replay", tag={"status": "running"}), 200)}
    it = iter(sample)

    def watch_one() -> None:
        nonlocal cursor
        client.kv_put(next(it), "replay", tag=FINISHED)
        before = _server_cpu_usec(admin)
        changes = client.kv_watch("replay", cursor, where=FINISHED)
        watch_usec.append(_server_cpu_usec(admin) - before)
        cursor = changes.cursor

    watch_usec: list[float] = []
    for _ in range(len(sample)):
        watch_one()
    # one INFO runs between the two readings: subtract what that costs (two readings, nothing between)
    info_usec = statistics.median(_cpu_per_call(admin, lambda: None, 1) for _ in range(len(sample)))
    results["watch"]["redis_usec_per_op"] = statistics.median(watch_usec) - info_usec
    results["poll kv_list every 2 s"]["redis_usec_per_op"] = _cpu_per_call(admin, lambda: client.kv_list("replay"), 3)
    results["poll kv_list(where=) every 2 s"]["redis_usec_per_op"] = _cpu_per_call(
        admin, lambda: client.kv_list("replay", where=FINISHED), 3)
    for name, row in results.items():
        extra = "".join(
            f"  {label} {row[k]:8.1f} ms" for k, label in (("p50_ms", "p50"), ("mean_ms", "mean"), ("max_ms", "max"),
                                                         ("pass_ms", "listing")) if k in row
        )
        print(f"  {name:<32}{extra}  Redis CPU {row['redis_usec_per_op']:9.1f} us/op", flush=True)
    client.clear_partition("replay")
    client.close()
    admin.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=None, help="keys in the partition (default 100000, quick 20000)")
    parser.add_argument("--events", type=int, default=20, help="changes timed for the watch (default %(default)s)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    keys = args.keys or (20_000 if args.quick else 100_000)
    results = per_server_flavour(lambda url: measure_server(url, keys, args.events))
    write_result(MEASURE, args, {"keys": keys, "events": args.events, "period_s": PERIOD_S}, results, args.out)


if __name__ == "__main__":
    main()
