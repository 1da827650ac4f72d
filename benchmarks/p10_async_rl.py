"""P10: what a group reservation and an append cost: reserve, commit, abort, append (partial
rollout) against put: latency and Redis CPU per call.

A producer of asynchronous RL reserves a prompt group (``reserve_group``), generates, then commits
it (``commit_group``) or aborts it (``abort_group``). Each operation runs ``--ops`` times (default
2,000; quick 300) alone on a fresh namespace of an embedded Valkey and of Debian's Redis 7.0 where
installed, with groups of ``--group`` samples (default 8) of two fields: small values (kept in
Redis with the bits: one round trip) and, for ``commit (store)``, values in the ``redis`` store
(the group's fields recorded, the bytes stored, then the commit: two scripts). The client-side
latency is timed per call (p50, p99); the server's CPU per operation is ``INFO commandstats``'
``cmdstat_fcall`` time (reset before each operation's run) divided by the operations run, with
the fcalls per operation beside it. A staleness bound is configured for the partition (``max_lag``
large enough never to refuse), so admission's bookkeeping is in the figures. For scale, ``baseline:
ids`` is the plain id allocation a put starts with (``lua/reserve.lua``): one function call doing
almost nothing. ``append`` (``append_parts``: one part of 16 tokens per sample of a group) is
measured beside ``put`` writing the same field of such samples (``put(data, metadata=...)``),
inline and in the store.

Replay (``max_times_sampled``, ``PrioritizedSampler``, ``update_priority``): claims of ``--group``
samples from a partition of 1,000 claimable samples, replayed so that none runs out, by id order
(the default sampler) and by priority (``alpha=0.6``, random priorities), and ``update_priority``
of ``--group`` samples. The samples-per-insert rate limiter (``set_rate_limit``): inserts of a
group (``put`` of new samples, inline) and replayed claims without and with a limiter on the
claiming task (its window so wide that it never holds anything back: the bookkeeping alone).

Group-shared fields (``put_shared``): ``--share-ops`` groups (default 200; quick 50) of ``--group``
samples, each with a small ``tokens`` field and one ``--image-kib`` KiB image (default 64: in the
``redis`` store), put either per sample (the image repeated in each row, one ``put``) or shared
(``put`` of the tokens, then ``put_shared`` of the image once); then ``get_data`` of each group.
Reported: put and get_data p50 / p99 per group, and the image bytes the store holds (``STRLEN``
of its keys), with sharing against without.

Run: ``python -m benchmarks.p10_async_rl [--ops 2000] [--group 8] [--share-ops 200] [--quick]``
(tq-redis only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, per_server_flavour, write_result

MEASURE = "p10_async_rl"
REPLAY_ROWS = 1000  # claimable samples in the partition the replay cases claim from


def _client(url: str, ns: str, inline_max_bytes: int):
    from tq_redis import TransferQueueClient
    from tq_redis.meta.keys import config_key

    client = TransferQueueClient(url, ns, nested_output=False)
    spec = {"backend": "redis", "options": {}, "inline_max_bytes": inline_max_bytes}
    client.redis.hset(config_key(ns), "storage", json.dumps(spec))
    return client


def _fcall_usec(admin) -> tuple[int, float]:
    stats = admin.info("commandstats").get("cmdstat_fcall", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


def _percentiles(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
    }


def measure_server(url: str, ops: int, group: int) -> dict[str, Any]:
    import redis
    import torch
    from tensordict import TensorDict

    admin = redis.Redis.from_url(url)
    data = TensorDict({"tokens": torch.arange(group * 16).reshape(group, 16), "reward": torch.ones(group)},
                      batch_size=[group])
    results: dict[str, Any] = {}

    def run(name: str, inline: int, prepare, timed, setup=None) -> None:
        client = _client(url, f"p10{uuid.uuid4().hex[:8]}", inline)
        client.set_staleness_bound("rollouts", 1_000_000, group)
        if setup is not None:
            setup(client)
        states = [prepare(client) for _ in range(ops)]
        admin.config_resetstat()
        times = []
        for state in states:
            t0 = time.perf_counter()
            timed(client, state)
            times.append(time.perf_counter() - t0)
        calls, usec = _fcall_usec(admin)
        results[name] = {**_percentiles(times), "redis_usec_per_op": usec / ops, "fcalls_per_op": calls / ops}
        row = results[name]
        print(f"  {name:<30} p50 {row['p50_ms']:6.3f} ms  p99 {row['p99_ms']:6.3f} ms  "
              f"Redis CPU {row['redis_usec_per_op']:6.1f} us/op ({row['fcalls_per_op']:.0f} fcall)", flush=True)
        client.clear_partition("rollouts")
        client.close()

    from tq_redis.ops import transitions

    # the baseline: the plain id allocation of a put (lua/reserve.lua), the least one function call costs here
    run("baseline: ids", 4096, lambda c: c.context.keys("rollouts"),
        lambda c, pk: c.run(transitions.reserve(pk, group).call()))
    run("reserve", 4096, lambda c: None, lambda c, _: c.reserve_group("rollouts", group, lease_s=600))
    run("commit (inline)", 4096, lambda c: c.reserve_group("rollouts", group, lease_s=600),
        lambda c, r: c.commit_group(r, data, end_policy_version=1))
    run("commit (store)", 0, lambda c: c.reserve_group("rollouts", group, lease_s=600),
        lambda c, r: c.commit_group(r, data, end_policy_version=1))
    run("abort", 4096, lambda c: c.reserve_group("rollouts", group, lease_s=600), lambda c, r: c.abort_group(r))
    # partial rollout: one part of 16 tokens per sample appended to existing samples, against a put
    # writing the same field of such samples (each case on fresh samples: every append is a part 0)
    tokens = TensorDict({"tokens": torch.arange(group * 16).reshape(group, 16)}, batch_size=[group])
    prompts = TensorDict({"prompt": torch.ones(group, 4)}, batch_size=[group])

    def fresh(c):
        return c.put(prompts, partition_id="rollouts")

    run("put (inline)", 4096, fresh, lambda c, meta: c.put(tokens, metadata=meta))
    run("append (inline)", 4096, fresh, lambda c, meta: c.append_parts(meta, tokens, 0))
    run("put (store)", 0, fresh, lambda c, meta: c.put(tokens, metadata=meta))
    run("append (store)", 0, fresh, lambda c, meta: c.append_parts(meta, tokens, 0))

    # replay: claims of `group` samples from REPLAY_ROWS claimable ones (replayed, so none runs out),
    # by id order (the default sampler, for scale) and in proportion to priority ** alpha
    def fill(c) -> None:
        rows = TensorDict({"x": torch.arange(REPLAY_ROWS)}, batch_size=[REPLAY_ROWS])
        ids = c.put(rows, partition_id="rollouts").global_indexes
        c.update_priority("rollouts", ids, (torch.rand(REPLAY_ROWS) + 0.01).tolist())

    def claim(config: dict):
        replayed = {"max_times_sampled": 10**9, **config}
        return lambda c, _: c.get_meta(["x"], group, "rollouts", task_name="learner", sampling_config=replayed)

    run("get_meta (replay, sequential)", 4096, lambda c: None, claim({}), fill)
    run("get_meta (prioritized)", 4096, lambda c: None, claim({"sampler": "PrioritizedSampler", "alpha": 0.6}), fill)
    run("update_priority", 4096, lambda c: torch.randint(0, REPLAY_ROWS, (group,)).unique().tolist(),
        lambda c, ids: c.update_priority("rollouts", ids, [1.5] * len(ids)), fill)
    # the samples-per-insert rate limiter's bookkeeping (a window so wide that it never holds back):
    # inserts of a group and replayed claims, without and with a limiter on the claiming task
    def limited(c) -> None:
        c.set_rate_limit("rollouts", "learner", 1.0, error_buffer=1e12)

    def fill_limited(c) -> None:
        fill(c)
        limited(c)

    run("insert (inline)", 4096, lambda c: None, lambda c, _: c.put(data, partition_id="rollouts"))
    run("insert (inline, rate-limited)", 4096, lambda c: None, lambda c, _: c.put(data, partition_id="rollouts"),
        limited)
    run("get_meta (replay, rate-limited)", 4096, lambda c: None, claim({}), fill_limited)
    admin.close()
    return results


def measure_sharing(url: str, ops: int, group: int, image_kib: int) -> dict[str, Any]:
    """put / get_data of ``ops`` groups whose image is put per sample, then shared (``put_shared``)."""
    import torch

    tokens = torch.arange(group * 16).reshape(group, 16)
    image = torch.ones(1, image_kib * 256, dtype=torch.float32)  # image_kib KiB
    results: dict[str, Any] = {}
    for mode in ("per sample", "shared"):
        client = _client(url, f"p10s{uuid.uuid4().hex[:8]}", 4096)  # the tokens inline, the image in the store
        puts, gets, metas = [], [], []
        for _ in range(ops):
            t0 = time.perf_counter()
            if mode == "shared":
                meta = client.put_shared({"image": image}, client.put({"tokens": tokens}, partition_id="p"))
            else:
                meta = client.put({"tokens": tokens, "image": image.expand(group, -1)}, partition_id="p")
            puts.append(time.perf_counter() - t0)
            metas.append(meta)
        for meta in metas:
            t0 = time.perf_counter()
            data = client.get_data(meta)
            gets.append(time.perf_counter() - t0)
        assert data["image"].shape == (group, image.shape[1])
        pk = client.context.keys("p")
        stored = sum(client.redis.strlen(k) for k in client.redis.scan_iter(match=f"{pk.prefix}d:*:image", count=1000))
        put, get = _percentiles(puts), _percentiles(gets)
        results[mode] = {"put": put, "get_data": get, "image_bytes_stored": stored}
        print(f"  image {mode:<10} put p50 {put['p50_ms']:6.3f} ms  p99 {put['p99_ms']:6.3f} ms   get_data p50 "
              f"{get['p50_ms']:6.3f} ms  p99 {get['p99_ms']:6.3f} ms   image bytes stored {stored:,}", flush=True)
        client.clear_partition("p")
        client.close()
    saved = results["per sample"]["image_bytes_stored"] - results["shared"]["image_bytes_stored"]
    results["bytes_saved"] = saved
    print(f"  sharing saved {saved:,} bytes ({saved / max(1, results['per sample']['image_bytes_stored']):.0%})")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=None, help="operations per case (default 2000, quick 300)")
    parser.add_argument("--group", type=int, default=8, help="samples per group (default %(default)s)")
    parser.add_argument("--share-ops", type=int, default=None, help="groups for put_shared (default 200, quick 50)")
    parser.add_argument("--image-kib", type=int, default=64, help="shared image size (default %(default)s KiB)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    ops = args.ops or (300 if args.quick else 2000)
    share_ops = args.share_ops or (50 if args.quick else 200)

    def measure(url: str) -> dict[str, Any]:
        results = measure_server(url, ops, args.group)
        results["sharing"] = measure_sharing(url, share_ops, args.group, args.image_kib)
        return results

    results = per_server_flavour(measure)
    params = {"ops": ops, "group": args.group, "share_ops": share_ops, "image_kib": args.image_kib}
    write_result(MEASURE, args, params, results, args.out)


if __name__ == "__main__":
    main()
