"""A replay buffer that is told about finished trajectories instead of polling for them.

verl's ReplayBuffer finds finished trajectories by calling ``tq.kv_list()`` over every partition
every 2 seconds and diffing the tags. Here the buffer blocks in ``tq.kv_watch`` instead: rollout
workers put each trajectory by key, ``status: running`` with its prompt, then ``status: finished``
with its response and reward; the buffer wakes as soon as a trajectory finishes (no 2 s delay, no
listing of every key every time), and the trainer takes batches from it. A watch cursor that
expired (the buffer fell more than the stream's cap behind, or the partition was cleared) is
answered by listing once and watching on.

It checks: every finished trajectory reaches the trainer exactly once, its fields are there when
the buffer hears of it, and nothing running or already trained is handed out.

Run: ``python examples/watch_replay_buffer.py``
"""

from __future__ import annotations

import collections
import statistics
import threading
import time

import torch

import tq_redis as tq
from tq_redis.errors import WatchCursorExpired

CONF = {"storage": {"backend": "redis"}}  # the store; the embedded Valkey starts without a redis.url
PARTITION = "rollouts"
WORKERS, PROMPTS_PER_WORKER, BATCH = 3, 16, 8
FINISHED = {"status": "finished"}


class WatchingReplayBuffer:
    """Finished trajectories of one partition, in the order they finished."""

    def __init__(self, partition: str) -> None:
        self.partition = partition
        self.ready: collections.deque[str] = collections.deque()
        self.finished_at: dict[str, float] = {}  # key -> when the buffer heard of it
        self.wakeups = 0
        self._cursor = self._catch_up()

    def _catch_up(self) -> str:
        """Take the cursor first, then list: a change between the two is seen (twice at worst)."""
        cursor = tq.kv_watch(self.partition).cursor
        listed = tq.kv_list(self.partition, where=FINISHED).get(self.partition, {})
        self._add(list(listed))
        return cursor

    def _add(self, keys: list[str]) -> None:
        now = time.monotonic()
        for key in keys:
            if key not in self.finished_at:  # a re-list after an expired cursor may repeat a key
                self.finished_at[key] = now
                self.ready.append(key)

    def take(self, n: int, timeout: float) -> list[str]:
        """Up to ``n`` finished keys, waiting up to ``timeout`` seconds for the first ones."""
        deadline = time.monotonic() + timeout
        while len(self.ready) < n and time.monotonic() < deadline:
            try:
                changes = tq.kv_watch(self.partition, self._cursor, timeout=deadline - time.monotonic(),
                                      where=FINISHED)
            except WatchCursorExpired as exc:
                self._cursor = exc.cursor
                self._add(list(tq.kv_list(self.partition, where=FINISHED).get(self.partition, {})))
                continue
            self._cursor = changes.cursor
            self.wakeups += 1
            self._add([key for key, _ in changes.items()])
        return [self.ready.popleft() for _ in range(min(n, len(self.ready)))]


def rollout_worker(rank: int, finished_at: dict[str, float]) -> None:
    """Generate PROMPTS_PER_WORKER trajectories: put running, generate, put finished."""
    for i in range(PROMPTS_PER_WORKER):
        key = f"w{rank}/p{i}"
        tq.kv_put(key, PARTITION, {"prompt": torch.full((6,), i)}, tag={"status": "running", "worker": rank})
        time.sleep(0.01 * (1 + (i + rank) % 3))  # "generation" of uneven length
        reward = float(i % 2)
        finished_at[key] = time.monotonic()
        tq.kv_put(key, PARTITION, {"response": torch.arange(4) + i, "reward": torch.tensor(reward)},
                  tag={"status": "finished", "worker": rank, "reward": reward})


def main() -> int:
    tq.init(CONF)
    try:
        buffer = WatchingReplayBuffer(PARTITION)
        put_at: dict[str, float] = {}
        workers = [threading.Thread(target=rollout_worker, args=(r, put_at)) for r in range(WORKERS)]
        for w in workers:
            w.start()
        trained: list[str] = []
        total = WORKERS * PROMPTS_PER_WORKER
        while len(trained) < total:
            keys = buffer.take(BATCH, timeout=60)
            assert keys, f"no finished trajectory within 60 s ({len(trained)} of {total} trained)"
            data = tq.kv_batch_get(keys, PARTITION, select_fields=["prompt", "response", "reward"])
            assert data["response"].shape[0] == len(keys)  # the fields were stored before the tag was noted
            # ... train on data ...
            tq.kv_batch_put(keys, PARTITION, tags=[{"status": "trained"}] * len(keys))  # not "finished": not watched
            trained += keys
        for w in workers:
            w.join()
        assert len(trained) == len(set(trained)) == total, "a trajectory was trained twice or lost"
        assert set(trained) == set(put_at)
        states = {t["status"] for t in tq.kv_list(PARTITION)[PARTITION].values()}
        assert states == {"trained"}, states
        lag_ms = [(buffer.finished_at[k] - put_at[k]) * 1000 for k in trained if k in put_at]
        median = statistics.median(lag_ms)
    finally:
        tq.close()
    print(f"watch_replay_buffer OK: {total} trajectories trained once each, {buffer.wakeups} wake-ups, "
          f"finish-to-buffer median {median:.1f} ms (polling kv_list every 2 s: ~1000 ms on average)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
