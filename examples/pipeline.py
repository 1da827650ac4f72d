"""A rollout -> reward -> trainer pipeline of independent processes on the embedded default.

The main process calls ``tq.init()`` (an embedded Valkey plus local DRAM storage nodes) and
starts three worker processes that know nothing but the Redis URL and the namespace:

* rollout: puts prompts and variable-length responses into partition ``step_<k>``;
* reward:  claims responses as task ``reward`` and writes a ``reward`` field back (a rewrite);
  it claims and reads in one call (``get_meta_and_data``: small values come with the claim);
* trainer: claims (responses, reward) as task ``train``, checks every byte, then clears the step.

Run: ``python examples/pipeline.py [--steps 3] [--batch 64] [--store dram|redis]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.redact import redact


def _responses(ids: torch.Tensor) -> torch.Tensor:
    # deterministic content so the trainer can verify every byte it receives
    return torch.nested.nested_tensor([torch.arange(int(i) % 17 + 1) + int(i) for i in ids], layout=torch.jagged)


def rollout(url: str, ns: str, steps: int, batch: int) -> None:
    client = tq.TransferQueueClient(url, ns)
    for step in range(steps):
        for start in range(0, batch, 16):
            n = min(16, batch - start)
            prompt_ids = torch.arange(start, start + n) + step * 1000
            client.put(
                TensorDict({"prompt_id": prompt_ids, "responses": _responses(prompt_ids)}, batch_size=[n]),
                partition_id=f"step_{step}",
            )
    client.close()


def reward(url: str, ns: str, steps: int, batch: int) -> None:
    client = tq.TransferQueueClient(url, ns)
    for step in range(steps):
        done = 0
        while done < batch:
            meta, data = client.get_meta_and_data(
                ["prompt_id", "responses"], 8, f"step_{step}", task_name="reward", timeout=30
            )
            if meta.size == 0:
                raise RuntimeError(f"reward worker starved on step {step}")
            scores = torch.stack([r.float().mean() for r in data["responses"].unbind()])
            client.put(TensorDict({"reward": scores}, batch_size=[meta.size]), metadata=meta)
            done += meta.size
    client.close()


def trainer(url: str, ns: str, steps: int, batch: int, out) -> None:
    client = tq.TransferQueueClient(url, ns)
    seen = 0
    for step in range(steps):
        got = 0
        while got < batch:
            meta = client.get_meta(["prompt_id", "responses", "reward"], 16, f"step_{step}", task_name="train",
                                   timeout=30)
            if meta.size == 0:
                raise RuntimeError(f"trainer starved on step {step}")
            data = client.get_data(meta)
            expected = _responses(data["prompt_id"])
            for got_r, want_r in zip(data["responses"].unbind(), expected.unbind()):
                assert torch.equal(got_r, want_r), "response bytes differ"
            assert torch.allclose(data["reward"], torch.stack([r.float().mean() for r in expected.unbind()]))
            got += meta.size
        seen += got
        client.clear_partition(f"step_{step}")
        print(f"[trainer] step {step}: trained on {got} samples", flush=True)
    out.put(seen)
    client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--store", default="dram", help="data-plane store (dram or redis)")
    args = parser.parse_args(argv)

    cfg = tq.init({"storage": {"backend": args.store}})
    url, ns = cfg["redis"]["url"], cfg["namespace"]
    print(f"metadata plane: {redact(url)} (namespace {ns!r}), store: {args.store}", flush=True)
    ctx = mp.get_context("forkserver")  # torch is imported once, in the fork server, not per worker
    ctx.set_forkserver_preload(["torch", "tensordict", "tq_redis"])
    out = ctx.Queue()
    workers = [
        ctx.Process(target=rollout, args=(url, ns, args.steps, args.batch), name="rollout"),
        ctx.Process(target=reward, args=(url, ns, args.steps, args.batch), name="reward"),
        ctx.Process(target=trainer, args=(url, ns, args.steps, args.batch, out), name="trainer"),
    ]
    t0 = time.perf_counter()
    try:
        for w in workers:
            w.start()
        seen = out.get(timeout=300)
        for w in workers:
            w.join(60)
        failed = [w.name for w in workers if w.exitcode != 0]
        if failed:
            print(f"pipeline FAILED: {failed} exited with an error")
            return 1
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
        tq.close()
    elapsed = time.perf_counter() - t0
    print(f"pipeline OK: {seen} samples through rollout -> reward -> trainer in {elapsed:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
