"""Actors and a replaying learner held to a samples-per-insert ratio.

An off-policy learner trains on each transition several times (replay). Too fast, and it overfits
to the few transitions there are; too slow, and the actors' work goes stale. ``set_rate_limit``
holds both to ``SAMPLES_PER_INSERT`` samples per inserted transition, within ``ERROR_BUFFER``,
from ``MIN_SIZE`` inserts on: an actor's ``put`` that would run ahead waits for the learner's next
claim, and a learner's ``get_meta`` that would run ahead finds nothing until the actors insert.
Neither side polls: each wakes the other.

It checks, while both run: the balance ``inserts * ratio - samples`` never leaves the window (a
batch may overshoot by one batch), the learner started only after ``MIN_SIZE`` inserts, no
transition was handed out more than ``max_times_sampled`` times, and every insert arrived.

Run: ``python examples/rate_limited_replay.py``
"""

from __future__ import annotations

import collections
import threading

import torch
from tensordict import TensorDict

import tq_redis as tq

PARTITION, LEARNER = "replay", "learner"
SAMPLES_PER_INSERT, MIN_SIZE, ERROR_BUFFER = 4.0, 32, 24.0
ACTORS, PUTS_PER_ACTOR, PUT_BATCH = 2, 16, 4
TRAIN_BATCH, MAX_TIMES_SAMPLED = 8, 8


def actor(index: int, inserted: list[int]) -> None:
    client = tq.get_client()
    for step in range(PUTS_PER_ACTOR):
        obs = torch.full((PUT_BATCH, 4), float(index * 1000 + step))
        meta = client.put(TensorDict({"obs": obs}, batch_size=[PUT_BATCH]), partition_id=PARTITION)
        inserted.extend(meta.global_indexes)


def learner(actors_done: threading.Event, handed: collections.Counter) -> None:
    client = tq.get_client()
    replay = {"max_times_sampled": MAX_TIMES_SAMPLED}
    while True:
        # once the actors are done, a claim the limiter holds back will not be woken: stop then
        timeout = 1.0 if actors_done.is_set() else 30.0
        batch = client.get_meta(["obs"], TRAIN_BATCH, PARTITION, task_name=LEARNER, timeout=timeout,
                                sampling_config=replay)
        if batch.size == 0:
            if actors_done.is_set():
                return
            continue
        client.get_data(batch)  # ... a learner step on it ...
        handed.update(batch.global_indexes)


def main() -> None:
    tq.init({"storage": {"backend": "redis"}})  # the embedded Valkey
    try:
        client = tq.get_client()
        client.set_rate_limit(PARTITION, LEARNER, SAMPLES_PER_INSERT, min_size_to_sample=MIN_SIZE,
                              error_buffer=ERROR_BUFFER, insert_timeout=120)
        inserted: list[int] = []
        handed: collections.Counter = collections.Counter()
        actors_done, stop = threading.Event(), threading.Event()
        seen: list[tuple[int, int]] = []

        def observe() -> None:
            while not stop.is_set():
                limit = client.get_rate_limit(PARTITION, LEARNER)
                seen.append((limit.inserts, limit.samples))
                stop.wait(0.005)

        actors = [threading.Thread(target=actor, args=(i, inserted)) for i in range(ACTORS)]
        learning = threading.Thread(target=learner, args=(actors_done, handed))
        observer = threading.Thread(target=observe)
        for thread in (observer, learning, *actors):
            thread.start()
        for thread in actors:
            thread.join()
        actors_done.set()
        learning.join()
        stop.set()
        observer.join()
        final = client.get_rate_limit(PARTITION, LEARNER)

        total = ACTORS * PUTS_PER_ACTOR * PUT_BATCH
        assert sorted(inserted) == list(range(total)), "an insert was lost"
        assert max(handed.values()) <= MAX_TIMES_SAMPLED, "a transition was replayed too often"
        assert (final.inserts, final.samples) == (total, sum(handed.values()))
        low = SAMPLES_PER_INSERT * MIN_SIZE - ERROR_BUFFER - TRAIN_BATCH
        high = SAMPLES_PER_INSERT * MIN_SIZE + ERROR_BUFFER + (PUT_BATCH - 1) * SAMPLES_PER_INSERT
        for inserts, samples in seen + [(final.inserts, final.samples)]:
            balance = inserts * SAMPLES_PER_INSERT - samples
            assert samples == 0 or inserts >= MIN_SIZE, f"the learner started at {inserts} inserts"
            assert balance <= high and (samples == 0 or low <= balance), f"balance {balance} left [{low}, {high}]"
        ratio = final.samples / final.inserts
        print(f"{final.inserts} transitions inserted, {final.samples} sampled ({ratio:.2f} per insert, "
              f"target {SAMPLES_PER_INSERT:g}), {len(seen)} observations within the window")
        print("rate_limited_replay OK")
    finally:
        tq.close()


if __name__ == "__main__":
    main()
