"""RLinf-style pipelining through a ``Channel``: rollout workers stream trajectories, the trainer
takes batches by token budget.

Two rollout processes ``put`` TensorDict trajectories (through the data plane; the queue holds
references) weighted by their token count into a bounded channel. They put with ``async_op=True``
and never wait: each process's puts land in the order they were issued, wait for room when the
trainer falls behind (back-pressure), and ``close()`` (or process exit) lands whatever is still
pending. The trainer pops ``get_batch(target_weight=TOKENS)``, RLinf's rule: the oldest
trajectories while the next still fits the token budget, FIFO across producers. Small control
messages (plain Python objects) go through a second queue key; ``async_op=True`` overlaps a get
with work. A ``local=True`` channel (in-process, no Redis) collects the trainer's statistics.

Run: ``python examples/channel.py``
"""

from __future__ import annotations

import multiprocessing as mp

import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.redact import redact

CONF = {"storage": {"backend": "redis"}}  # the store; the embedded Valkey starts without a redis.url
WORKERS, TRAJECTORIES, TOKENS = 2, 12, 64


def rollout_worker(url: str, ns: str, rank: int) -> None:
    channel = tq.Channel.connect("rollout", redis_url=url, namespace=ns)
    for i in range(TRAJECTORIES):
        length = 8 + (i * 7 + rank * 3) % 17
        trajectory = TensorDict({"tokens": torch.full((length,), rank * 1000 + i),
                                 "reward": torch.tensor(float(i % 3))}, batch_size=[])
        channel.put(trajectory, weight=length, async_op=True)  # fire and forget; lands in issue order
    channel.put({"worker": rank, "done": TRAJECTORIES}, key="control", async_op=True)
    channel.close()  # returns once every put above has landed (waiting for room as needed)


def main() -> int:
    cfg = tq.init(CONF)
    url, ns = cfg["redis"]["url"], cfg["namespace"]
    print(f"metadata plane: {redact(url)} (namespace {ns!r})", flush=True)
    channel = tq.Channel.create("rollout", maxsize=8)  # a full queue always holds a batch: 8 x >= 8 tokens
    stats = tq.Channel.create("stats", local=True)  # this process only
    ctx = mp.get_context("fork")  # quick to start here; RLinf launches workers with Ray
    workers = [ctx.Process(target=rollout_worker, args=(url, ns, r)) for r in range(WORKERS)]
    received: list[int] = []
    try:
        for w in workers:
            w.start()
        done = channel.get(key="control", async_op=True)  # overlaps with the training loop below
        finished: list[dict] = []
        while len(finished) < WORKERS or not channel.empty():
            try:
                batch, full = channel.get_batch(TOKENS, timeout=1.0), True
            except TimeoutError:  # what is left weighs less than the budget: take it one by one
                batch, full = [channel.get_nowait() for _ in range(channel.qsize())], False
            if batch:
                tokens = sum(int(t["tokens"].numel()) for t in batch)
                received.extend(int(t["tokens"][0]) for t in batch)
                stats.put((tokens, full), weight=1)
                print(f"[trainer] batch of {len(batch)} trajectories, {tokens} tokens", flush=True)
            if done.done():
                finished.append(done.wait())
                done = channel.get(key="control", async_op=True) if len(finished) < WORKERS else done
        for w in workers:
            w.join(60)
        if any(w.exitcode != 0 for w in workers):
            print("channel FAILED: a rollout worker exited with an error")
            return 1
        for rank in range(WORKERS):  # FIFO per key: each worker's trajectories arrive in order
            mine = [r - rank * 1000 for r in received if r // 1000 == rank]
            assert mine == list(range(TRAJECTORIES)), mine
        batches = stats.get_batch(stats.qsize())  # every batch's token count (weight 1 each)
        assert sum(t for t, _ in batches) == sum(8 + (i * 7 + r * 3) % 17 for i in range(TRAJECTORIES)
                                                 for r in range(WORKERS))
        assert all(t <= TOKENS for t, full in batches if full), batches  # a batch never exceeds the budget
        channel.delete()
        channel.close()
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
        tq.close()
    print(f"channel OK: {len(received)} trajectories from {WORKERS} workers, in order per worker")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
