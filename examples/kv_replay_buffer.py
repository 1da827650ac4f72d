"""A replay buffer on the KV API, the way verl's trainer uses TransferQueue's ``kv_*`` functions.

Rollouts are stored under readable keys (``step/prompt/response``) with tags (``policy_version``,
``reward``, ``status``); the trainer lists the buffer, picks fresh high-reward samples by their
tags, reads the fields it needs, marks what it trained on with a tag-only update, adds a
per-sample field later (``old_log_prob``: fields accumulate per key) and evicts stale keys.

Run: ``python examples/kv_replay_buffer.py``
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.redact import redact

CONF = {"storage": {"backend": "redis"}}  # the store; the embedded Valkey starts without a redis.url
PARTITION = "replay"
PROMPTS, RESPONSES, SEQ = 4, 3, 8


def rollout(step: int) -> None:
    """One rollout step: PROMPTS x RESPONSES trajectories, put by key with their tags."""
    keys = [f"{step}/{p}/{r}" for p in range(PROMPTS) for r in range(RESPONSES)]
    n = len(keys)
    rewards = torch.rand(n)
    fields = TensorDict(
        {
            "input_ids": torch.randint(0, 1000, (n, SEQ)),
            "attention_mask": torch.ones(n, SEQ, dtype=torch.int64),
            "reward": rewards,
        },
        batch_size=[n],
    )
    tags = [{"policy_version": step, "reward": float(r), "status": "new"} for r in rewards]
    meta = tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=fields, tags=tags)
    assert sorted(meta.fields) == ["attention_mask", "input_ids", "reward"]


def train(step: int, batch: int, min_version: int) -> int:
    """Pick the best fresh samples by their tags, train on them, mark them used."""
    buffer = tq.kv_list(PARTITION)[PARTITION]
    fresh = [k for k, t in buffer.items() if t["status"] == "new" and t["policy_version"] >= min_version]
    chosen = sorted(fresh, key=lambda k: buffer[k]["reward"], reverse=True)[:batch]
    data = tq.kv_batch_get(keys=chosen, partition_id=PARTITION, select_fields=["input_ids", "reward"])
    # the reference's layout: per-sample rows come back as a jagged nested tensor
    assert data["input_ids"].to_padded_tensor(0).shape == (len(chosen), SEQ)
    assert torch.allclose(data["reward"], torch.tensor([buffer[k]["reward"] for k in chosen]))
    # a later stage adds a field to the same keys; the key's other fields stay
    meta = tq.kv_batch_put(chosen, PARTITION, TensorDict({"old_log_prob": torch.randn(len(chosen), SEQ)},
                                                         batch_size=[len(chosen)]))
    assert "old_log_prob" in meta.fields and "input_ids" in meta.fields
    tq.kv_batch_put(chosen, PARTITION, tags=[{"status": "used", "trained_at": step}] * len(chosen))  # tags only
    return len(chosen)


def evict(min_version: int) -> int:
    stale = [k for k, t in tq.kv_list(PARTITION)[PARTITION].items() if t["policy_version"] < min_version]
    if stale:
        tq.kv_clear(keys=stale, partition_id=PARTITION)
    return len(stale)


def main() -> int:
    cfg = tq.init(CONF)
    print(f"metadata plane: {redact(cfg['redis']['url'])} (namespace {cfg['namespace']!r})", flush=True)
    trained = evicted = 0
    try:
        for step in range(4):
            rollout(step)
            trained += train(step, batch=6, min_version=step - 1)
            evicted += evict(min_version=step - 1)
            sizes = {k: len(v) for k, v in tq.kv_list().items()}
            print(f"step {step}: buffer {sizes}", flush=True)
        left = tq.kv_list(PARTITION)[PARTITION]
        assert all(t["policy_version"] >= 2 for t in left.values())
        used = [k for k, t in left.items() if t["status"] == "used"]
        assert tq.kv_batch_get(used, PARTITION, select_fields="old_log_prob")["old_log_prob"].shape[0] == len(used)
    finally:
        tq.close()
    print(f"kv_replay_buffer OK: trained on {trained} samples, evicted {evicted}, {len(left)} left")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
