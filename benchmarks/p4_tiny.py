"""P4: latency of one tiny sample: ``put``, ``get_meta`` and ``get_data``.

Each round puts one sample (a single int64 field) into one partition, then claims it with
``get_meta(batch_size=1, mode="fetch")`` for one task, then reads it with ``get_data``; each
call is timed on its own. Medians over ``--rounds`` rounds (default 200) after a warm-up.

Run: ``python -m benchmarks.p4_tiny [--systems ...] [--quick] [--rounds 200]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks._common import parse_args, print_comparison, run_per_system, summarize_s, versus, write_result
from benchmarks.reference import opened_for, startup_seconds

MEASURE = "p4_tiny"
OPS = ("put", "get_meta", "get_data")


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 200, quick 50)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first (default %(default)s)")


def measure_system(name: str, rounds: int, warmup: int) -> dict[str, Any]:
    """Time put / get_meta / get_data of one tiny sample ``rounds`` times on system ``name``."""
    import torch
    from tensordict import TensorDict

    partition, task = "p4", "p4_task"
    times: dict[str, list[float]] = {op: [] for op in OPS}
    with opened_for(name, partition, num_storage_units=2, polling_mode=True) as client:
        for i in range(warmup + rounds):
            sample = TensorDict({"x": torch.tensor([[i]], dtype=torch.int64)}, batch_size=[1])
            t0 = time.perf_counter()
            client.put(sample, partition_id=partition)
            t1 = time.perf_counter()
            meta = client.get_meta(
                data_fields=["x"], batch_size=1, partition_id=partition, mode="fetch", task_name=task
            )
            t2 = time.perf_counter()
            data = client.get_data(meta)
            t3 = time.perf_counter()
            if meta.size != 1:
                raise AssertionError(f"{name}: round {i}: get_meta returned {meta.size} samples, wanted 1")
            got = int(data["x"][0].reshape(-1)[0])
            if got != i:
                raise AssertionError(f"{name}: round {i}: get_data returned {got}")
            if i >= warmup:
                times["put"].append(t1 - t0)
                times["get_meta"].append(t2 - t1)
                times["get_data"].append(t3 - t2)
        result: dict[str, Any] = {op: summarize_s(times[op]) for op in OPS}
        result["startup_s"] = startup_seconds(name)
        medians = ", ".join(f"{op} {result[op]['median_ms']:.2f} ms" for op in OPS)
        print(f"[{name}] median {medians}", flush=True)
        return result


def main() -> dict[str, Any]:
    """Measure every requested system; print and write the result."""
    args = parse_args(__doc__.splitlines()[0], _add_args)
    rounds = args.rounds or (50 if args.quick else 200)
    params = {"rounds": rounds, "warmup": args.warmup, "sample": "one int64 field, batch 1", "mode": "fetch"}
    print(f"P4: tiny-sample latency, {rounds} rounds")
    results = run_per_system(args.systems, lambda name: measure_system(name, rounds, args.warmup))

    print_comparison(
        "P4 one tiny sample, median latency (ms, lower is better)",
        [versus(results, op, op, "median_ms", unit=" ms", higher_is_better=False) for op in OPS],
    )
    write_result(MEASURE, args, params, results, args.out)
    return results


if __name__ == "__main__":
    main()
