"""P1 with ``storage.replicas``: put / get of 64 MiB through 3 DRAM nodes with N=2 against N=1, and
the repair's throughput against a plain loopback socket, all in one run on one machine.

1024 samples x 2 fields of 32 KiB (as ``p1_dram_roundtrip.py``), same host (shared memory). The N=1
and N=2 stores are timed in alternating rounds, so both medians come from the same minutes of a
busy machine; the goal is an N=2 put within 2.2x of N=1 and an unchanged get. Repair: the 64 MiB
are put with N=2, the node holding most of them is SIGKILLed, and one
:func:`~tq_redis.backends.dram.repair.repair_once` pass re-makes its copies; GB/s is the bytes it
re-made over its time, next to a plain TCP sender/receiver moving the same bytes over loopback.

    .venv/bin/python benchmarks/p1_replicas.py [--iters 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import threading
import time

import numpy as np

from benchmarks.p1_dram_roundtrip import HEADER, N_FIELDS, N_SAMPLES, ROW, TOTAL, _gbps, _start_valkey
from tq_redis.backends.dram.launcher import start_local_nodes
from tq_redis.backends.dram.store import DramStore


def _values():
    rng = np.random.default_rng(1)
    fields = [rng.integers(0, 1 << 40, (N_SAMPLES, ROW), dtype=np.int64) for _ in range(N_FIELDS)]
    keys = [f"p1r:{f}:{i}" for f in range(N_FIELDS) for i in range(N_SAMPLES)]
    values = [[HEADER, memoryview(fields[f][i])] for f in range(N_FIELDS) for i in range(N_SAMPLES)]
    return keys, values


def socket_limit(nbytes: int, iters: int) -> float:
    """GB/s of one loopback TCP connection moving ``nbytes`` in 1 MiB sends (median of ``iters``)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    buf = memoryview(bytearray(nbytes))
    sink = memoryview(bytearray(nbytes))

    def receive(conn: socket.socket, done: threading.Event) -> None:
        got = 0
        while got < nbytes:
            got += conn.recv_into(sink[got:], nbytes - got)
        done.set()

    times = []
    for _ in range(iters):
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        done = threading.Event()
        t = threading.Thread(target=receive, args=(conn, done))
        start = time.perf_counter()
        t.start()
        for off in range(0, nbytes, 1 << 20):
            client.sendall(buf[off : off + (1 << 20)])
        done.wait()
        times.append(time.perf_counter() - start)
        t.join()
        client.close()
        conn.close()
    server.close()
    return _gbps(statistics.median(times), nbytes)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    proc, url = _start_valkey()
    keys, values = _values()
    out: dict = {"bytes": TOTAL, "iters": args.iters, "loadavg": open("/proc/loadavg").read().split()[:3]}
    try:
        with start_local_nodes(url, "p1r", n=3, capacity="1GiB") as nodes:
            stores = {n: DramStore(url, "p1r", replicas=n, repair_every_s=0) for n in (1, 2)}
            times: dict[str, list[float]] = {f"{op}_n{n}": [] for op in ("put", "get") for n in (1, 2)}
            for rnd in range(args.iters + 1):  # round 0 warms up
                for n in ((1, 2) if rnd % 2 else (2, 1)):
                    st = stores[n]
                    t = time.perf_counter()
                    st.put(keys, values)
                    put_s = time.perf_counter() - t
                    t = time.perf_counter()
                    got = st.get(keys)
                    get_s = time.perf_counter() - t
                    assert bytes(got[5]) == bytes(HEADER) + bytes(values[5][1])
                    del got
                    st.delete(keys)
                    if rnd:
                        times[f"put_n{n}"].append(put_s)
                        times[f"get_n{n}"].append(get_s)
            for name, ts in times.items():
                out[f"{name}_gbps"] = _gbps(statistics.median(ts))
            out["put_ratio_n2_over_n1_time"] = statistics.median(times["put_n2"]) / statistics.median(times["put_n1"])
            out["get_ratio_n2_over_n1_time"] = statistics.median(times["get_n2"]) / statistics.median(times["get_n1"])

            st = stores[2]
            st.put(keys, values)
            held = {node_id: m["keys"] for node_id, m in st.stats().items()}
            victim = max(held, key=held.__getitem__)
            node = next(x for x in nodes.nodes if x.node_id == victim)
            os.kill(node.proc.pid, signal.SIGKILL)
            node.proc.wait()
            st.forget_after_s = st.dead_after_s = 3.0  # three missed 1 s heartbeats: dead
            while st.link_of(victim) is not None and st.link_of(victim).heartbeat_age <= st.dead_after_s:
                time.sleep(0.05)  # until the registry says the victim is dead (its heartbeat stopped)
            t = time.perf_counter()
            did = st.repair()
            repair_s = time.perf_counter() - t
            made = int(st._redis.hget("p1r:storage:repair", "bytes_done") or 0)
            out["repair_pass"] = {k: v for k, v in did.items() if k != "pending"} | {"pending": len(did["pending"])}
            out["repair_values"] = did["repaired"]
            out["repair_bytes"] = made
            out["repair_gbps"] = _gbps(repair_s, made)
            out["socket_limit_gbps"] = socket_limit(max(made, 1 << 20), args.iters)
            out["repair_share_of_socket"] = out["repair_gbps"] / out["socket_limit_gbps"]
            for s in stores.values():
                s.close()
    finally:
        proc.kill()
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
