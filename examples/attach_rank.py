"""A rank process that attaches to a running tq-redis (docker-compose's ``rank`` service).

It needs nothing but ``TQ_REDIS_URL`` (and ``TQ_NAMESPACE``): the storage nodes registered
themselves in Redis. It produces samples, consumes them as a task, checks every byte, and clears.

Run: ``TQ_REDIS_URL=redis://host:6379/0 python examples/attach_rank.py --samples 256``
"""

from __future__ import annotations

import argparse
import os

import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.redact import redact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--partition", default=f"rank-{os.getpid()}")
    args = parser.parse_args(argv)
    if not os.environ.get("TQ_REDIS_URL"):
        parser.error("set TQ_REDIS_URL to the metadata plane's URL (e.g. redis://valkey:6379/0)")
    cfg = tq.init()  # attaches: TQ_REDIS_URL is set
    client = tq.get_client()
    try:
        ids = torch.arange(args.samples)
        put = client.put(TensorDict({"x": ids.unsqueeze(1).repeat(1, 1024)}, batch_size=[args.samples]),
                         partition_id=args.partition)
        value_of = dict(zip(put.global_indexes, ids.tolist()))
        seen = 0
        while seen < args.samples:
            meta = client.get_meta(["x"], min(64, args.samples - seen), args.partition, task_name="check", timeout=10)
            if meta.size == 0:
                print("attach_rank FAILED: no data")
                return 1
            data = client.get_data(meta)
            expected = torch.tensor([value_of[g] for g in meta.global_indexes]).unsqueeze(1).repeat(1, 1024)
            if not torch.equal(data["x"].to_padded_tensor(0), expected):  # nested, as the reference returns
                print("attach_rank FAILED: bytes differ")
                return 1
            seen += meta.size
        client.clear_partition(args.partition)
    finally:
        tq.close()
    print(f"attach_rank OK: {seen} samples through {redact(cfg['redis']['url'])} namespace {cfg['namespace']!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
