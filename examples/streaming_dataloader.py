"""Each training rank pulls its own micro-batches with ``StreamingDataLoader`` -- no dispatcher.

A producer (a thread here; any process in practice) streams rollouts into one partition per step
and calls ``seal_partition`` when the step is complete. Two rank processes each run a
``StreamingDataLoader`` with two worker processes; every sample of a step reaches exactly one
rank, each loader ends its step when the partition is sealed and drained, then ``step()``s to
the next partition.

Run: ``python examples/streaming_dataloader.py``
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.redact import redact

CONF = {"storage": {"backend": "redis"}}  # the store; the embedded Valkey starts without a redis.url
STEPS, PER_STEP, CHUNK, RANKS = 2, 48, 8, 2


def produce(client: tq.TransferQueueClient) -> None:
    for step in range(STEPS):
        for start in range(0, PER_STEP, CHUNK):
            ids = torch.arange(start, start + CHUNK) + step * 1000
            responses = torch.nested.nested_tensor([torch.full((int(i) % 7 + 1,), int(i)) for i in ids],
                                                   layout=torch.jagged)
            client.put(TensorDict({"sample_id": ids, "responses": responses}, batch_size=[CHUNK]),
                       partition_id=f"step_{step}")
        client.seal_partition(f"step_{step}")  # no more samples for this step


def rank(cfg: dict, dp_rank: int, out) -> None:
    dataset = tq.StreamingDataset(cfg, batch_size=4, micro_batch_size=2, data_fields=["sample_id", "responses"],
                                  partition_id="step_0", task_name="actor_update", dp_rank=dp_rank)
    loader = tq.StreamingDataLoader(dataset, num_workers=2, multiprocessing_context="fork")
    seen = []
    for step in range(STEPS):
        if step:
            loader.step(f"step_{step}")
        for micro_batch, _meta in loader:
            for sid, row in zip(micro_batch["sample_id"].tolist(), micro_batch["responses"].unbind()):
                assert row.tolist() == [sid] * (sid % 7 + 1), "bytes differ"
            seen.extend(micro_batch["sample_id"].tolist())
        print(f"[rank {dp_rank}] step {step} done", flush=True)
    out.put(seen)


def main() -> int:
    cfg = tq.init(CONF)
    print(f"metadata plane: {redact(cfg['redis']['url'])} (namespace {cfg['namespace']!r})", flush=True)
    ctx = mp.get_context("fork")  # quick to start here; real jobs launch ranks with torchrun, Ray, ...
    out = ctx.Queue()
    ranks = [ctx.Process(target=rank, args=(cfg, r, out)) for r in range(RANKS)]
    try:
        for p in ranks:
            p.start()
        producer = threading.Thread(target=produce, args=(tq.get_client(),))
        producer.start()
        seen = [out.get(timeout=300) for _ in ranks]
        producer.join()
        for p in ranks:
            p.join(60)
        if any(p.exitcode != 0 for p in ranks):
            print("streaming_dataloader FAILED: a rank exited with an error")
            return 1
    finally:
        for p in ranks:
            if p.is_alive():
                p.terminate()
        tq.close()
    everything = sorted(x for s in seen for x in s)
    expected = sorted(step * 1000 + i for step in range(STEPS) for i in range(PER_STEP))
    assert everything == expected, "a sample was lost or delivered twice"
    print(f"streaming_dataloader OK: {len(everything)} samples, each to exactly one of {RANKS} ranks "
          f"({', '.join(str(len(s)) for s in seen)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
