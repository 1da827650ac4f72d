"""P9: how long one tq-redis script call holds the server, for batches that scale.

Redis runs one script at a time and serves no other client meanwhile, so the longest single call
is the stall every other client may see. Each case below runs on a fresh namespace of an embedded
Valkey (and Debian's Redis 7.0 where installed) with every command logged in ``SLOWLOG``
(``slowlog-log-slower-than 0``): the case's longest command is its stall. Meanwhile a probe process
claims one tiny sample over and over on another partition (``get_meta(batch_size=1)`` with a
lease, then a ``nack``) and times each claim: its p99 and max are what another consumer felt.

Cases (``--rows``, default 8,192): a put of rows x 4 scalar fields (small values: kept in Redis),
``get_data`` of it, a claim of all rows with their data (``get_meta_and_data``) and without, leased
claims of the most one may take (``MAX_LEASED_CLAIM``) and their acks until all rows are taken, tags
for every row (``set_custom_meta``), a rewrite of one field (``put(..., metadata=)``), a KV put of
rows keys and a listing of them, ``clear_samples`` of all rows, ``clear_partition`` of a partition of
4 x rows rows, and a put of ``--fields`` (default 10,000) one-row fields.

Each case runs ``--rounds`` times (3) and keeps its best round, the one whose longest command is
the shortest: on this shared machine other work only ever adds time (a script's time in SLOWLOG is
wall time, and the server may be descheduled in the middle of one), as ``p6_shard`` does.

Run: ``python -m benchmarks.p9_script_time [--rows 8192] [--fields 10000] [--rounds 3] [--quick]``
(tq-redis only).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, per_server_flavour, write_result

MEASURE = "p9_script_time"
SLOWLOG_LEN = 100_000


def _probe(url: str, ns: str, ready, stop, out) -> None:
    """Claim (with a lease) and nack one tiny sample until ``stop``; put the claims' latencies on ``out``."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    client.nack(client.get_meta(["x"], 1, "probe", task_name="probe", lease_s=60))
    ready.set()
    times = []
    while not stop.is_set():
        t0 = time.perf_counter()
        meta = client.get_meta(["x"], 1, "probe", task_name="probe", lease_s=60)
        times.append(time.perf_counter() - t0)
        client.nack(meta)
    client.close()
    out.put(times)


def _client(url: str, ns: str):
    from tq_redis import TransferQueueClient
    from tq_redis.meta.keys import config_key

    client = TransferQueueClient(url, ns, nested_output=False)
    spec = {"backend": "redis", "options": {}, "inline_max_bytes": 4096}
    client.redis.hset(config_key(ns), "storage", json.dumps(spec))
    return client


def _cases(rows: int, fields: int):
    """(name, setup(client) -> state, run(client, state)) of every case."""
    import torch
    from tensordict import TensorDict

    from tq_redis.ops.script_budget import MAX_LEASED_CLAIM

    def table(n: int, first: int = 0) -> TensorDict:
        base = torch.arange(first, first + n)
        return TensorDict({f"f{k}": base * (k + 1) for k in range(4)}, batch_size=[n])

    def put_inline(c, _):
        meta = c.put(table(rows), partition_id="p")
        assert meta.size == rows

    def filled(c):
        return c.put(table(rows), partition_id="p")

    def get_data(c, meta):
        assert c.get_data(meta)["f3"].tolist()[-1] == (rows - 1) * 4

    def claim_all(c, _):
        meta, data = c.get_meta_and_data(["f0", "f1", "f2", "f3"], rows, "p", task_name="t")
        assert meta.size == rows and data["f0"].shape[0] == rows

    def claim_ids(c, _):
        assert c.get_meta(["f0", "f1", "f2", "f3"], rows, "p", task_name="t").size == rows

    def lease_and_ack(c, _):
        for _ in range(rows // MAX_LEASED_CLAIM):
            leased = c.get_meta(["f0"], MAX_LEASED_CLAIM, "p", task_name="t", lease_s=60)
            assert leased.size == MAX_LEASED_CLAIM
            c.ack(leased)

    def kv_list(c, _):
        assert len(c.kv_list("kv")["kv"]) == rows

    def kv_filled(c):
        keys = [f"k{i}" for i in range(rows)]
        c.kv_batch_put(keys, "kv", TensorDict({"a": torch.arange(rows)}, batch_size=[rows]))

    def tags(c, meta):
        meta = meta.copy()
        meta.update_custom_meta([{"uid": i // 8, "total_lengths": i % 97} for i in range(rows)])
        c.set_custom_meta(meta)

    def rewrite(c, meta):
        c.put(TensorDict({"f0": torch.zeros(rows, dtype=torch.int64)}, batch_size=[rows]), metadata=meta)

    def kv_put(c, _):
        keys = [f"k{i}" for i in range(rows)]
        c.kv_batch_put(keys, "kv", TensorDict({"a": torch.arange(rows), "b": torch.arange(rows)}, batch_size=[rows]))

    def clear_samples(c, meta):
        c.clear_samples(meta)

    def big(c):
        for part in range(4):
            c.put(table(rows, part * rows), partition_id="p")

    def clear_partition(c, _):
        c.clear_partition("p")

    def many_fields(c, _):
        td = TensorDict({f"field_{k}": torch.tensor([k]) for k in range(fields)}, batch_size=[1])
        try:
            c.put(td, partition_id="wide")
            return "stored"
        except Exception as exc:  # the case reports what a too-wide put does
            return f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:160]}"

    nothing = lambda c: None  # noqa: E731
    return [
        ("inline put", nothing, put_inline),
        ("get_data", filled, get_data),
        ("claim + values", filled, claim_all),
        ("claim", filled, claim_ids),
        ("leased claims + acks", filled, lease_and_ack),
        ("set_custom_meta", filled, tags),
        ("rewrite one field", filled, rewrite),
        ("kv_batch_put", nothing, kv_put),
        ("kv_list", kv_filled, kv_list),
        ("clear_samples", filled, clear_samples),
        ("clear_partition", big, clear_partition),
        (f"put of {fields} fields", nothing, many_fields),
    ]


def _slowest(r, ns: str) -> tuple[int, str]:
    """The longest command of namespace ``ns`` SLOWLOG holds (µs) and its name (the probe's
    commands, and SLOWLOG's own, name other keys)."""
    worst, name = 0, ""
    for entry in r.slowlog_get(SLOWLOG_LEN):
        command = entry["command"]
        text = command.decode(errors="replace") if isinstance(command, bytes) else str(command)
        if f"{ns}:" in text and entry["duration"] > worst:
            worst, name = int(entry["duration"]), " ".join(text.split()[:2])
    return worst, name


def _run_case(url: str, probe_ns: str, admin, setup, run, ctx) -> dict[str, Any]:
    """One round of one case: its longest command, its wall time and what the probe saw meanwhile."""
    ns = f"p9{uuid.uuid4().hex[:8]}"
    client = _client(url, ns)
    state = setup(client)
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    probe = ctx.Process(target=_probe, args=(url, probe_ns, ready, stop, out))
    probe.start()
    if not ready.wait(120):
        raise RuntimeError("the probe process did not start claiming within 120 s")
    admin.slowlog_reset()
    t0 = time.perf_counter()
    outcome = run(client, state)
    wall = time.perf_counter() - t0
    worst_us, command = _slowest(admin, ns)
    stop.set()
    probe_times = sorted(out.get(timeout=60))
    probe.join(30)
    client.clear_partition("p")
    client.close()
    return {
        "longest_command_ms": worst_us / 1e3, "longest_command": command, "wall_ms": wall * 1e3,
        "probe_claims": len(probe_times),
        "probe_p99_ms": probe_times[int(0.99 * (len(probe_times) - 1))] * 1e3 if probe_times else None,
        "probe_max_ms": probe_times[-1] * 1e3 if probe_times else None,
        **({"outcome": outcome} if outcome is not None else {}),
    }  # fmt: skip


def measure_server(url: str, rows: int, fields: int, rounds: int) -> dict[str, Any]:
    """Every case ``rounds`` times; each case's figures are its best round's (the least longest
    command: on a shared machine other work only ever adds time), every round's beside them."""
    import redis
    import torch
    from tensordict import TensorDict

    admin = redis.Redis.from_url(url)
    admin.config_set("slowlog-log-slower-than", 0)
    admin.config_set("slowlog-max-len", SLOWLOG_LEN)
    results: dict[str, Any] = {}
    probe_ns = f"p9probe{uuid.uuid4().hex[:6]}"
    _client(url, probe_ns).put(TensorDict({"x": torch.zeros(1)}, batch_size=[1]), partition_id="probe")
    ctx = mp.get_context("forkserver")
    for name, setup, run in _cases(rows, fields):
        every = [_run_case(url, probe_ns, admin, setup, run, ctx) for _ in range(rounds)]
        best = min(every, key=lambda r: r["longest_command_ms"])
        results[name] = {**best, "rounds_longest_command_ms": [r["longest_command_ms"] for r in every]}
        outcome = f"  [{best['outcome']}]" if best.get("outcome") else ""
        print(f"  {name:22s} longest command {best['longest_command_ms']:8.2f} ms ({best['longest_command']:18s}) "
              f"rounds {' / '.join(f'{r:.2f}' for r in results[name]['rounds_longest_command_ms'])} ms  "
              f"call {best['wall_ms']:8.1f} ms  probe p99 {best['probe_p99_ms'] or 0:6.2f} ms "
              f"max {best['probe_max_ms'] or 0:6.2f} ms{outcome}", flush=True)
    admin.config_set("slowlog-log-slower-than", 10000)
    admin.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="rows per batch (default 8192, quick 2048)")
    parser.add_argument("--fields", type=int, default=10_000, help="fields of the wide put (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per case, best kept (default 3, quick 1)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    rows = args.rows or (2048 if args.quick else 8192)
    rounds = args.rounds or (1 if args.quick else 3)
    results = per_server_flavour(lambda url: measure_server(url, rows, args.fields, rounds))
    from tq_redis.ops.script_budget import SCRIPT_ITEMS

    params = {"rows": rows, "fields": args.fields, "rounds": rounds, "script_items": SCRIPT_ITEMS}
    write_result(MEASURE, args, params, results, args.out)


if __name__ == "__main__":
    main()
