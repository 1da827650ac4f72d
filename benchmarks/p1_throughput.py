"""P1: bulk throughput. ``put`` and ``get_data`` of 64 MiB (1024 x 4096 int64 x 2 fields).

For each system: put a fresh 1024-sample TensorDict into a partition (timed), then
``get_data`` of the metadata ``put`` returned (timed), check the bytes came back, clear the
partition, repeat. Reports the median rate in GB/s (1 GB = 1e9 bytes) and, as the ceiling, a
plain memcpy of the same bytes (numpy ``copyto`` into a preallocated buffer).

Run: ``python -m benchmarks.p1_throughput [--systems reference,tq_redis] [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from benchmarks._common import parse_args, print_comparison, run_per_system, summarize_s, versus, write_result
from benchmarks.reference import open_system, startup_seconds

MEASURE = "p1_throughput"


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=1024, help="rows per put (default %(default)s)")
    parser.add_argument("--width", type=int, default=4096, help="int64 per row per field (default %(default)s)")
    parser.add_argument("--fields", type=int, default=2, help="fields per sample (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 7, quick 3)")
    parser.add_argument("--storage-units", type=int, default=2, help="storage units (default %(default)s)")


def memcpy_gbps(nbytes: int, repeats: int) -> dict[str, Any]:
    """Median rate of copying ``nbytes`` between two preallocated numpy buffers."""
    src = np.random.default_rng(0).integers(0, 1 << 30, size=nbytes // 8, dtype=np.int64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    times = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"gbps": nbytes / med / 1e9, "median_ms": med * 1e3}


def _make_batch(samples: int, width: int, fields: int, seed: int) -> Any:
    """A TensorDict of ``fields`` int64 tensors of shape (samples, width)."""
    import torch
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(seed)
    data = {
        f"f{i}": torch.randint(0, 1 << 30, (samples, width), dtype=torch.int64, generator=gen) for i in range(fields)
    }
    return TensorDict(data, batch_size=[samples])


def _dense(value: Any) -> Any:
    """A dense tensor from what ``get_data`` returned (the reference returns nested tensors)."""
    import torch

    if getattr(value, "is_nested", False):
        return torch.stack(list(value.unbind()))
    return value


def measure_system(
    name: str, samples: int, width: int, fields: int, repeats: int, storage_units: int
) -> dict[str, Any]:
    """Time put and get_data of one batch against system ``name``."""
    client, close = open_system(name, num_storage_units=storage_units, polling_mode=True)
    try:
        nbytes = samples * width * fields * 8
        put_s: list[float] = []
        get_s: list[float] = []
        for rep in range(repeats + 1):  # the first round warms up sockets and allocators
            batch = _make_batch(samples, width, fields, seed=rep)
            partition = f"p1_{rep}"
            t0 = time.perf_counter()
            meta = client.put(batch, partition_id=partition)
            t1 = time.perf_counter()
            got = client.get_data(meta)
            t2 = time.perf_counter()
            for key in batch.keys():
                if not bool((_dense(got[key]) == batch[key]).all()):
                    raise AssertionError(f"{name}: field {key} came back different")
            if rep > 0:
                put_s.append(t1 - t0)
                get_s.append(t2 - t1)
            del got
            client.clear_partition(partition)
            print(
                f"[{name}] rep {rep}: put {(t1 - t0) * 1e3:.1f} ms, get_data {(t2 - t1) * 1e3:.1f} ms",
                flush=True,
            )
        put_med = statistics.median(put_s)
        get_med = statistics.median(get_s)
        return {
            "bytes": nbytes,
            "put_gbps": nbytes / put_med / 1e9,
            "get_data_gbps": nbytes / get_med / 1e9,
            "put": summarize_s(put_s),
            "get_data": summarize_s(get_s),
            "startup_s": startup_seconds(name),
        }
    finally:
        close()


def main() -> dict[str, Any]:
    """Measure every requested system and the memcpy ceiling; print and write the result."""
    args = parse_args(__doc__.splitlines()[0], _add_args)
    repeats = args.repeats or (3 if args.quick else 7)
    samples = args.samples if not args.quick else min(args.samples, 256)
    nbytes = samples * args.width * args.fields * 8
    params = {
        "samples": samples,
        "width": args.width,
        "fields": args.fields,
        "dtype": "int64",
        "bytes": nbytes,
        "repeats": repeats,
        "storage_units": args.storage_units,
    }
    shape = f"{samples}x{args.width} int64 x {args.fields} fields"
    print(f"P1: put + get_data of {nbytes / 2**20:.0f} MiB ({shape})")
    memcpy = memcpy_gbps(nbytes, repeats)
    print(f"memcpy ceiling: {memcpy['gbps']:.2f} GB/s")
    results = run_per_system(
        args.systems,
        lambda name: measure_system(name, samples, args.width, args.fields, repeats, args.storage_units),
    )
    results["memcpy"] = memcpy
    print_comparison(
        f"P1 throughput, {nbytes / 2**20:.0f} MiB (GB/s, higher is better; memcpy {memcpy['gbps']:.2f} GB/s)",
        [versus(results, "put", "put_gbps"), versus(results, "get_data", "get_data_gbps")],
    )
    for name in ("reference", "tq_redis"):
        res = results.get(name, {})
        if "put_gbps" in res:
            res["put_fraction_of_memcpy"] = res["put_gbps"] / memcpy["gbps"]
            res["get_data_fraction_of_memcpy"] = res["get_data_gbps"] / memcpy["gbps"]
    write_result(MEASURE, args, params, results, args.out)
    return results


if __name__ == "__main__":
    main()
