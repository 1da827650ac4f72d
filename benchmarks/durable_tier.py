"""The durable tier's put cost (``storage.durable``) against a plain fsspec write of the same bytes.

One embedded Valkey and 2 DRAM storage nodes on this host; a local-disk tier (``file://`` in a
temporary directory on the same disk as the plain writes). Each round times, in turn:

* ``dram``: ``put`` of a batch into a namespace without a tier (the cost today);
* ``durable``: the same ``put`` into a namespace with ``storage.durable`` (write-through: the put
  returns once the DRAM nodes and the tier both hold every value);
* ``fsspec``: the plain fsspec write of the same values (``fs.open(path, "wb").write(value)`` per
  value, one file each, on the same filesystem, into a fresh directory).

The order rotates every round, so the three medians come from the same minutes of a machine
whose speed drifts. Partitions and directories are cleared between rounds (untimed). Reported:
the medians, ``durable / fsspec`` (the tier's put against the plain write of its bytes) and
``durable - dram`` (what the tier adds to a put).

Run: ``python -m benchmarks.durable_tier [--rounds 9] [--quick]``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks._common import parse_args, write_result

MEASURE = "durable_tier"
CASES = {"16 MiB (256 samples x 2 fields x 32 KiB)": (256, 4096), "1 MiB (64 samples x 2 fields x 8 KiB)": (64, 1024)}


def _client(url: str, durable: str | None):
    from tq_redis import TransferQueueClient
    from tq_redis.meta.keys import config_key

    ns = f"bdur{uuid.uuid4().hex[:8]}"
    client = TransferQueueClient(url, ns)
    spec: dict[str, Any] = {"backend": "dram", "options": {}, "inline_max_bytes": 0}
    if durable is not None:
        spec["durable"] = {"url": durable, "storage_options": {}}
    client.redis.hset(config_key(ns), "storage", json.dumps(spec))
    return client


def _plain_write(fs: Any, root: str, values: list[bytes]) -> None:
    fs.makedirs(root, exist_ok=True)
    for i, value in enumerate(values):
        with fs.open(f"{root}/{i}", "wb") as f:
            f.write(value)


def measure(rounds: int, quick: bool) -> dict[str, Any]:
    import fsspec
    import torch
    from tensordict import TensorDict

    from tq_redis.backends.dram.launcher import spawn_node
    from tq_redis.server.embedded import EmbeddedServer

    scratch = Path(tempfile.mkdtemp(prefix="tq-bench-durable-", dir="/var/tmp"))
    server = EmbeddedServer().start()
    nodes = []
    out: dict[str, Any] = {}
    try:
        plain = _client(server.url, None)
        nodes = [spawn_node(server.url, plain.namespace, capacity="1GiB", node_id=f"a{i}") for i in range(2)]
        durable = _client(server.url, f"file://{scratch}/tier")
        nodes += [spawn_node(server.url, durable.namespace, capacity="1GiB", node_id=f"b{i}") for i in range(2)]
        fs = fsspec.filesystem("file")
        for label, (n, width) in CASES.items():
            if quick and n > 64:
                continue
            batch = TensorDict({"a": torch.randint(0, 1 << 30, (n, width)), "b": torch.randint(0, 1 << 30, (n, width))},
                               batch_size=[n])
            values = [row.numpy().tobytes() for name in ("a", "b") for row in batch[name]]
            times: dict[str, list[float]] = {"dram": [], "durable": [], "fsspec": []}
            order = ["dram", "durable", "fsspec"]
            for r in range(rounds + 1):  # round 0 warms up
                for kind in order[r % 3:] + order[: r % 3]:
                    started = time.perf_counter()
                    if kind == "fsspec":
                        _plain_write(fs, f"{scratch}/plain-{r}", values)
                    else:
                        (plain if kind == "dram" else durable).put(batch, partition_id=f"r{r}")
                    took = time.perf_counter() - started
                    if r:
                        times[kind].append(took)
                plain.clear_partition(f"r{r}")
                durable.clear_partition(f"r{r}")
                shutil.rmtree(scratch / f"plain-{r}")
            med = {k: statistics.median(v) for k, v in times.items()}
            nbytes = sum(map(len, values))
            out[label] = {
                "bytes": nbytes,
                "median_ms": {k: v * 1e3 for k, v in med.items()},
                "gb_s": {k: nbytes / v / 1e9 for k, v in med.items()},
                "durable_over_fsspec": med["durable"] / med["fsspec"],
                "durable_minus_dram_ms": (med["durable"] - med["dram"]) * 1e3,
                "rounds_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()},
            }
            left = [p for p in (scratch / "tier").rglob("*") if p.is_file()]
            out[label]["tier_files_left_after_clears"] = len(left)
        plain.close()
        durable.close()
    finally:
        for node in nodes:
            node.stop()
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--rounds", type=int, default=9))
    rounds = 3 if args.quick else args.rounds
    results = measure(rounds, args.quick)
    for label, r in results.items():
        m = r["median_ms"]
        print(f"{label}: put dram {m['dram']:.2f} ms, put dram+durable {m['durable']:.2f} ms, "
              f"plain fsspec write {m['fsspec']:.2f} ms; durable/fsspec {r['durable_over_fsspec']:.2f}x, "
              f"durable-dram {r['durable_minus_dram_ms']:.2f} ms; tier files left {r['tier_files_left_after_clears']}")
    write_result(MEASURE, args, {"rounds": rounds, "cases": list(results)}, {"tq_redis": results}, args.out)


if __name__ == "__main__":
    main()
