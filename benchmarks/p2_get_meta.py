"""P2: ``get_meta`` latency against the number of samples in the partition.

One partition per system is filled with tiny samples (one int64 per sample, put in large
batches) up to each size in turn: 1k, 16k, 65k, 262k, 1M (1024 x 4^k, then 1,048,576). At each
size, ``get_meta(batch_size=1024, mode="fetch")`` for one task is timed ``--repeats`` times
after a warm-up call; the median is reported.

Fetch mode marks what it returns consumed, so calls need unconsumed samples:
``--consume drain`` (default) lets consecutive calls drain the partition like a trainer would,
and resets the task's consumption (untimed) only when fewer than a batch remain; ``--consume
reset`` resets before every call so each one sees the whole partition unconsumed.

A size is skipped for a system when the previous size already took longer than ``--budget-s``
to fill and measure (the reference's scan is linear, so its 1M step is the slowest).

Run: ``python -m benchmarks.p2_get_meta [--systems ...] [--quick] [--sizes 1024,16384]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks._common import parse_args, print_comparison, run_per_system, summarize_s, versus, write_result
from benchmarks.reference import opened_for, startup_seconds

MEASURE = "p2_get_meta"
FULL_SIZES = [1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
QUICK_SIZES = [1 << 10, 1 << 14, 1 << 16]


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None, help="comma-separated partition sizes (default 1k..1M; quick 1k..65k)")
    parser.add_argument("--batch", type=int, default=1024, help="get_meta batch_size (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per size (default 15, quick 5)")
    parser.add_argument(
        "--put-batch", type=int, default=65536, help="samples per put while filling (default %(default)s)"
    )
    parser.add_argument("--consume", choices=("drain", "reset"), default="drain", help="see module doc")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="skip larger sizes once one size took longer (default %(default)s)",
    )


def _fill(client: Any, partition: str, start: int, stop: int, put_batch: int) -> float:
    """Put samples ``start..stop-1`` (one int64 each) into ``partition``; return seconds taken."""
    import torch
    from tensordict import TensorDict

    t0 = time.perf_counter()
    pos = start
    while pos < stop:
        n = min(put_batch, stop - pos)
        values = torch.arange(pos, pos + n, dtype=torch.int64).reshape(n, 1)
        client.put(TensorDict({"x": values}, batch_size=[n]), partition_id=partition)
        pos += n
    return time.perf_counter() - t0


def measure_system(
    name: str, sizes: list[int], batch: int, repeats: int, put_batch: int, consume: str, budget_s: float
) -> dict[str, Any]:
    """Fill one partition of system ``name`` size by size and time get_meta at each size."""
    partition = "p2"
    per_size: dict[str, Any] = {}
    with opened_for(name, partition, num_storage_units=2, polling_mode=True) as client:
        filled = 0
        for size in sizes:
            step_start = time.perf_counter()
            added = size - filled
            fill_s = _fill(client, partition, filled, size, put_batch)
            filled = size
            task = f"p2_task_{size}"
            remaining = size
            times: list[float] = []
            for call in range(repeats + 1):  # call 0 is the warm-up
                if consume == "reset" or remaining < batch:
                    client.reset_consumption(partition, task)
                    remaining = size
                t0 = time.perf_counter()
                meta = client.get_meta(
                    data_fields=["x"], batch_size=batch, partition_id=partition, mode="fetch", task_name=task
                )
                elapsed = time.perf_counter() - t0
                if meta.size != batch:
                    raise AssertionError(f"{name}: get_meta returned {meta.size} samples, wanted {batch}")
                remaining -= batch
                if call > 0:
                    times.append(elapsed)
            step_s = time.perf_counter() - step_start
            stats = summarize_s(times)
            per_size[str(size)] = {
                **stats,
                "fill_s": fill_s,
                "fill_samples_per_s": added / fill_s if fill_s > 0 else None,
            }
            print(
                f"[{name}] {size:>9,d} samples: get_meta median {stats['median_ms']:.2f} ms "
                f"(p90 {stats['p90_ms']:.2f}), filled in {fill_s:.1f} s",
                flush=True,
            )
            if step_s > budget_s and size != sizes[-1]:
                skipped = [s for s in sizes if s > size]
                print(
                    f"[{name}] step took {step_s:.0f} s > budget {budget_s:.0f} s; skipping {skipped}",
                    flush=True,
                )
                for s in skipped:
                    per_size[str(s)] = {"skipped": f"previous size took {step_s:.0f} s > budget {budget_s:.0f} s"}
                break
        return {"sizes": per_size, "startup_s": startup_seconds(name)}


def main() -> dict[str, Any]:
    """Measure every requested system; print and write the result."""
    args = parse_args(__doc__.splitlines()[0], _add_args)
    if args.sizes:
        sizes = sorted(int(s) for s in args.sizes.split(","))
    else:
        sizes = QUICK_SIZES if args.quick else FULL_SIZES
    repeats = args.repeats or (5 if args.quick else 15)
    params = {
        "sizes": sizes,
        "batch": args.batch,
        "repeats": repeats,
        "put_batch": args.put_batch,
        "consume": args.consume,
        "field": "x: one int64 per sample",
        "mode": "fetch",
    }
    print(f"P2: get_meta(batch={args.batch}, fetch) latency vs partition size {sizes}")
    results = run_per_system(
        args.systems,
        lambda name: measure_system(name, sizes, args.batch, repeats, args.put_batch, args.consume, args.budget_s),
    )

    print_comparison(
        "P2 get_meta(1024) median latency (ms, lower is better)",
        [
            versus(results, f"{size:,d} samples", "sizes", str(size), "median_ms", unit=" ms", higher_is_better=False)
            for size in sizes
        ],
    )
    write_result(MEASURE, args, params, results, args.out)
    return results


if __name__ == "__main__":
    main()
