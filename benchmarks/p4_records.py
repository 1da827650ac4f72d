"""P4 with request records on and off: what exactly-once under retry costs a tiny call.

The P4 round (``put`` of one int64 sample, ``get_meta(batch_size=1, mode="fetch")``, ``get_data``)
in one process on one embedded Valkey with 2 DRAM nodes, in ``--blocks`` alternating blocks of
``--rounds`` rounds: records on (the shipped client) and off (this benchmark only swaps
``tq_redis.client.plans.with_record`` for the identity, so no call carries a record key and the
scripts run without their record). The order inside a pair of blocks alternates, so a load change
on this shared machine hits both alike. Reports each call's median latency on and off and their
ratio, and the Redis server's CPU time per round (``INFO cpu``), on and off.

Run: ``python -m benchmarks.p4_records [--blocks 10] [--rounds 300]`` (tq-redis only).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks._common import parse_args, write_result
from benchmarks.reference import open_system

MEASURE = "p4_records"
OPS = ("put", "get_meta", "get_data")


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=10, help="pairs of blocks, on and off (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=300, help="rounds per block (default %(default)s)")


def _server_cpu_s(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measure(blocks: int, rounds: int) -> dict[str, Any]:
    """The P4 round with records on and off, interleaved; medians per call and server CPU per round."""
    import torch
    from tensordict import TensorDict

    from tq_redis.client import plans

    shipped = plans.with_record
    times: dict[bool, dict[str, list[float]]] = {on: {op: [] for op in OPS} for on in (True, False)}
    cpu_us: dict[bool, list[float]] = {True: [], False: []}
    client, close = open_system("tq_redis", num_storage_units=2)
    n = 0
    try:
        for block in range(2 * blocks):
            on = (block % 2 == 0) == (block // 2 % 2 == 0)
            plans.with_record = shipped if on else (lambda effect, new_id: effect)
            cpu0 = _server_cpu_s(client.redis)
            for _ in range(rounds):
                sample = TensorDict({"x": torch.tensor([[n]], dtype=torch.int64)}, batch_size=[1])
                t0 = time.perf_counter()
                client.put(sample, partition_id="p4r")
                t1 = time.perf_counter()
                meta = client.get_meta(data_fields=["x"], batch_size=1, partition_id="p4r", mode="fetch", task_name="t")
                t2 = time.perf_counter()
                data = client.get_data(meta)
                t3 = time.perf_counter()
                if int(data["x"][0].reshape(-1)[0]) != n:
                    raise AssertionError(f"round {n}: get_data returned {data['x']}")
                n += 1
                for op, took in zip(OPS, (t1 - t0, t2 - t1, t3 - t2)):
                    times[on][op].append(took)
            cpu_us[on].append((_server_cpu_s(client.redis) - cpu0) / rounds * 1e6)
    finally:
        plans.with_record = shipped
        client.clear_partition("p4r")
        close()
    result: dict[str, Any] = {}
    for op in OPS:
        on_ms, off_ms = (statistics.median(times[on][op]) * 1e3 for on in (True, False))
        result[op] = {"on_ms": on_ms, "off_ms": off_ms, "ratio": on_ms / off_ms}
        print(f"{op:9s} on {on_ms:.4f} ms  off {off_ms:.4f} ms  {100 * (on_ms / off_ms - 1):+.1f}%", flush=True)
    result["server_cpu_us_per_round"] = {"on": statistics.median(cpu_us[True]), "off": statistics.median(cpu_us[False])}
    print(f"server CPU per round: on {result['server_cpu_us_per_round']['on']:.1f} us, "
          f"off {result['server_cpu_us_per_round']['off']:.1f} us", flush=True)
    return result


def main() -> dict[str, Any]:
    """Measure, print and write the result."""
    args = parse_args(__doc__.splitlines()[0], _add_args)
    blocks, rounds = (2, 50) if args.quick else (args.blocks, args.rounds)
    params = {"blocks": blocks, "rounds": rounds, "sample": "one int64 field, batch 1", "mode": "fetch"}
    results = {"tq_redis": measure(blocks, rounds)}
    write_result(MEASURE, args, params, results, args.out)
    return results


if __name__ == "__main__":
    main()
