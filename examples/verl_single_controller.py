"""verl's single-controller GRPO step, with the data going through tq-redis instead of the driver.

The controller only handles ``BatchMeta`` (ids and schemas, never tensors); each worker group
reads its shard with ``get_data`` and writes its outputs back with ``put(..., metadata=shard)``:

1. put the prompts repeated n times, each row tagged with its prompt's ``uid``;
2. rollout: ``get_meta`` -> ``chunk(dp)`` -> workers generate -> ``concat`` of their outputs;
3. reward and reference log-prob read ``select_fields`` of the batch and write new fields; the
   controller ``union``s the stage outputs (a sample is ready only if ready in both);
4. advantages per uid group (GRPO), written back with a rewrite (partial update of fields);
5. actor update: ``reorder`` the batch so each dp rank gets similar token counts, ``chunk(dp)``;
6. ``clear_samples`` once the step is trained.

Run: ``python examples/verl_single_controller.py``
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis import BatchMeta, TransferQueueClient
from tq_redis.redact import redact
from tq_redis.samplers import karmarkar_karp

CONF = {"storage": {"backend": "redis"}}  # the store; the embedded Valkey starts without a redis.url
PROMPTS, N, DP, PROMPT_LEN = 4, 4, 2, 6


class Worker:
    """One rank of a worker group: it has its own client and sees only its shard's metadata."""

    def __init__(self, url: str, ns: str, rank: int) -> None:
        self.client = TransferQueueClient(url, ns)
        self.rank = rank

    def generate(self, meta: BatchMeta) -> BatchMeta:
        data = self.client.get_data(meta)
        lengths = [int(p.sum()) % 5 + 2 for p in data["input_ids"]]
        responses = torch.nested.nested_tensor([torch.arange(k) + self.rank for k in lengths], layout=torch.jagged)
        out = TensorDict({"responses": responses, "response_length": torch.tensor(lengths)}, batch_size=[meta.size])
        meta.update_custom_meta([{"total_lengths": PROMPT_LEN + k} for k in lengths])
        return self.client.put(out, metadata=meta)

    def reward(self, meta: BatchMeta) -> BatchMeta:
        data = self.client.get_data(meta.select_fields(["responses"]))
        scores = torch.stack([r.float().mean() for r in data["responses"].unbind()])
        return self.client.put(TensorDict({"score": scores}, batch_size=[meta.size]), metadata=meta)

    def ref_log_prob(self, meta: BatchMeta) -> BatchMeta:
        data = self.client.get_data(meta.select_fields(["input_ids", "response_length"]))
        ref = torch.log_softmax(data["input_ids"].to_padded_tensor(0).float(), dim=-1)
        return self.client.put(TensorDict({"ref_log_prob": ref}, batch_size=[meta.size]), metadata=meta)

    def update_actor(self, meta: BatchMeta) -> int:
        data = self.client.get_data(meta.select_fields(["input_ids", "responses", "advantages"]))
        assert torch.isfinite(data["advantages"]).all()
        return sum(len(r) for r in data["responses"].unbind())


def run_group(workers: list[Worker], method: str, meta: BatchMeta) -> BatchMeta:
    """Dispatch like verl's DP dispatch: one chunk per rank, outputs concatenated in order."""
    outputs = [getattr(w, method)(shard) for w, shard in zip(workers, meta.chunk(len(workers)))]
    return BatchMeta.concat(outputs)


def step(client: TransferQueueClient, workers: list[Worker], step_id: int) -> int:
    partition = f"train_{step_id}"
    prompts = torch.randint(0, 100, (PROMPTS, PROMPT_LEN))
    batch = TensorDict({"input_ids": prompts.repeat_interleave(N, dim=0)}, batch_size=[PROMPTS * N])
    meta = client.put(batch, partition_id=partition)
    meta.update_custom_meta([{"uid": f"{step_id}-{i // N}"} for i in range(meta.size)])
    client.set_custom_meta(meta)

    gen_meta = client.get_meta(["input_ids"], PROMPTS * N, partition, task_name="rollout")
    gen_out = run_group(workers, "generate", gen_meta)

    reward_out = run_group(workers, "reward", gen_out.select_fields(["responses"]))
    ref_out = run_group(workers, "ref_log_prob", gen_out.select_fields(["input_ids", "response_length"]))
    scored = reward_out.union(ref_out)
    assert scored.is_ready and {"score", "ref_log_prob"} <= set(scored.field_names)

    # GRPO advantages on the controller: normalise the scores within each uid group
    data = client.get_data(scored.select_fields(["score"]))
    uids = [m["uid"] for m in scored.custom_meta]
    adv = torch.empty(scored.size)
    for uid in set(uids):
        rows = [i for i, u in enumerate(uids) if u == uid]
        s = data["score"][rows]
        adv[rows] = (s - s.mean()) / (s.std() + 1e-6)
    client.put(TensorDict({"advantages": adv}, batch_size=[scored.size]), metadata=scored)

    # actor update: only the fields it needs, balanced by total_lengths across the dp ranks
    train_meta = client.get_meta(["input_ids", "responses", "advantages"], PROMPTS * N, partition,
                                 task_name="actor_update")
    lengths = [m["total_lengths"] for m in train_meta.custom_meta]
    parts = karmarkar_karp(lengths, DP)  # equal-size parts with balanced token sums, as verl does
    train_meta.reorder([i for part in parts for i in part])
    tokens = [w.update_actor(shard) for w, shard in zip(workers, train_meta.chunk(DP))]
    assert sum(tokens) == sum(int(m["total_lengths"]) - PROMPT_LEN for m in train_meta.custom_meta)

    client.clear_samples(train_meta)
    assert client.get_meta(["input_ids"], 1, partition, mode="force_fetch").size == 0
    return sum(tokens)


def main() -> int:
    cfg = tq.init(CONF)
    url, ns = cfg["redis"]["url"], cfg["namespace"]
    print(f"metadata plane: {redact(url)} (namespace {ns!r})", flush=True)
    try:
        client = tq.get_client()
        workers = [Worker(url, ns, rank) for rank in range(DP)]
        total = 0
        for step_id in range(3):
            tokens = step(client, workers, step_id)
            print(f"step {step_id}: trained on {PROMPTS * N} samples, {tokens} response tokens", flush=True)
            total += tokens
        for w in workers:
            w.client.close()
    finally:
        tq.close()
    print(f"verl_single_controller OK: 3 steps, {total} response tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
