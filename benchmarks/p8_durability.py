"""P8: what durable mode costs per put and per claim (tq-redis only).

A primary (AOF, ``appendfsync everysec``) and one replica (AOF, ``appendfsync always``: with
``everysec`` a ``WAITAOF`` for a replica waits for its next once-a-second fsync, ~1 s per call) on
loopback, of the bundled
Valkey (``WAITAOF`` needs Valkey >= 8 / Redis >= 7.2) and, where installed, of Debian's Redis 7.0
(``none`` and ``replicas`` only). For each durable mode a client puts one tiny sample (one int64
field, bytes in Redis) and claims it (``get_meta(batch_size=1)``), ``--rounds`` times after a
warm-up; each call is timed on its own. Modes: ``none``, ``replicas:1`` (``WAIT 1``), ``aof``
(``WAITAOF 1 0``: fsynced on the primary), ``aof:1`` (and on the replica).

A put is two writing function calls (reserve, insert: two waits), a claim one.

Run: ``python -m benchmarks.p8_durability [--rounds 300] [--quick]``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, summarize_s, write_result

MEASURE = "p8_durability"
MODES = {"valkey": ("none", "replicas:1", "aof", "aof:1"), "redis7": ("none", "replicas:1")}


def _pair(binary: str | None, folder: Path) -> tuple[Any, Any]:
    """A primary (AOF, everysec) and a replica (AOF, always), the replica in sync."""
    from tq_redis.server.embedded import EmbeddedServer

    primary = EmbeddedServer(data_dir=folder / "primary", appendonly=True, binary=binary,
                             extra_args=("--repl-diskless-sync-delay", "0")).start()
    # the replica fsyncs every write: with everysec a WAITAOF for it waits for its next
    # once-a-second fsync (~1 s per call, measured)
    replica = EmbeddedServer(data_dir=folder / "replica", appendonly=True, appendfsync="always", binary=binary,
                             extra_args=("--replicaof", "127.0.0.1", str(primary.port))).start()
    import redis

    with redis.Redis(port=primary.port) as r:
        deadline = time.monotonic() + 30
        while int(r.execute_command("WAIT", 1, 100)) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not come in sync within 30 s")
    return primary, replica


def measure_mode(url: str, mode: str, rounds: int, warmup: int) -> dict[str, Any]:
    """Time ``rounds`` tiny puts and claims with durable mode ``mode``."""
    import json
    import uuid

    import torch
    from tensordict import TensorDict

    from tq_redis import TransferQueueClient
    from tq_redis.meta.keys import config_key
    from tq_redis.server import durability

    durability.declare(url, mode, 5000)
    ns = f"p8{uuid.uuid4().hex[:8]}"
    client = TransferQueueClient(url, ns)
    client.redis.hset(config_key(ns), "storage", json.dumps({"backend": "redis", "options": {}}))
    times: dict[str, list[float]] = {"put": [], "claim": []}
    try:
        for i in range(warmup + rounds):
            td = TensorDict({"x": torch.tensor([i])}, batch_size=[1])
            t0 = time.perf_counter()
            client.put(td, partition_id="p")
            t1 = time.perf_counter()
            meta = client.get_meta(["x"], 1, "p", task_name="t")
            t2 = time.perf_counter()
            assert meta.size == 1
            if i >= warmup:
                times["put"].append(t1 - t0)
                times["claim"].append(t2 - t1)
        client.clear_partition("p")
    finally:
        client.close()
        durability.declare(url, None)
    return {op: summarize_s(samples) for op, samples in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per mode (default 300, quick 50)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    rounds = args.rounds or (50 if args.quick else 300)
    from tq_redis.server.embedded import valkey_binary

    flavours = {"valkey": valkey_binary(), "redis7": shutil.which("redis-server")}
    results: dict[str, Any] = {}
    for flavour, binary in flavours.items():
        if binary is None:
            print(f"{flavour}: not installed, skipped")
            continue
        folder = Path(tempfile.mkdtemp(prefix="tq-p8-"))
        primary, replica = _pair(binary, folder)
        try:
            for mode in MODES[flavour]:
                got = measure_mode(primary.url, mode, rounds, args.warmup)
                results[f"{flavour}/{mode}"] = got
                print(f"{flavour:7s} {mode:11s} put median {got['put']['median_ms']:.3f} ms "
                      f"(p90 {got['put']['p90_ms']:.3f})   claim median {got['claim']['median_ms']:.3f} ms "
                      f"(p90 {got['claim']['p90_ms']:.3f})", flush=True)
        finally:
            replica.stop()
            primary.stop()
            shutil.rmtree(folder, ignore_errors=True)
    write_result(MEASURE, args, {"rounds": rounds, "warmup": args.warmup,
                                     "appendfsync": {"primary": "everysec", "replica": "always"}}, results,
                 args.out)


if __name__ == "__main__":
    main()
