"""A MindSpeed-RL GRPO step through ``GRPOTransferDock``, with stages as independent processes.

The dock holds ``prompts_num * n_samples_per_prompt`` rows; each stage is a consumer that claims
rows whose input columns are ready and writes its output columns back by row index:

* actor_rollout: prompts -> responses (variable length) and their lengths;
* rule_reward:   responses -> rm_scores;
* actor_train:   whole prompts (``get_n_samples``) balanced by sequence length, once scored.

The stages run concurrently, block on the dock's event stream while nothing is ready, and stop
when ``all_consumed``. Then the driver ``clear()``s the dock for the next step.

Run: ``python examples/transfer_dock.py``
"""

from __future__ import annotations

import multiprocessing as mp

import torch

import tq_redis as tq

CONF = {"storage": {"backend": "redis"}}  # the store; the embedded Valkey starts without a redis.url
PROMPTS, N, STEPS = 8, 4, 2


def dock_for(url: str, ns: str) -> tq.GRPOTransferDock:
    return tq.GRPOTransferDock(PROMPTS, N, redis_url=url, namespace=ns)


def rollout(url: str, ns: str) -> None:
    dock = dock_for(url, ns)
    while not dock.all_consumed("actor_rollout"):
        batch, rows = dock.get_experience("actor_rollout", ["prompts", "prompt_length"], 8, timeout=1)
        if rows is None:
            continue
        responses = [torch.arange(int(p.sum()) % 9 + 1) for p in batch["prompts"].unbind()]
        dock.put_experience({"responses": responses,
                             "response_length": torch.tensor([[len(r)] for r in responses])}, indexes=rows)
    dock.close()


def reward(url: str, ns: str) -> None:
    dock = dock_for(url, ns)
    while not dock.all_consumed("rule_reward"):
        batch, rows = dock.get_experience("rule_reward", ["responses"], 4, timeout=1)
        if rows is None:
            continue
        scores = torch.tensor([float(len(r) % 2) for r in batch["responses"].unbind()])
        dock.put_experience({"rm_scores": scores}, indexes=rows)
    dock.close()


def train(url: str, ns: str, out) -> None:
    dock = dock_for(url, ns)
    seen: list[int] = []
    while not dock.all_consumed("actor_train"):
        batch, rows = dock.get_experience("actor_train", ["responses", "rm_scores", "prompt_length"], 2 * N,
                                          get_n_samples=True, use_batch_seqlen_balance=True, timeout=1)
        if rows is None:
            continue
        assert sorted({r // N for r in rows}) == sorted({r // N for r in rows[::N]}), "a prompt was split"
        seen.extend(rows)
    out.put(seen)
    dock.close()


def main() -> int:
    cfg = tq.init(CONF)
    url, ns = cfg["redis"]["url"], cfg["namespace"]
    print(f"metadata plane: {url} (namespace {ns!r})", flush=True)
    dock = dock_for(url, ns)
    ctx = mp.get_context("fork")  # quick to start here; MindSpeed-RL launches stages with Ray
    try:
        for step in range(STEPS):
            out = ctx.Queue()
            stages = [ctx.Process(target=rollout, args=(url, ns)), ctx.Process(target=reward, args=(url, ns)),
                      ctx.Process(target=train, args=(url, ns, out))]
            for p in stages:
                p.start()
            prompts = [torch.randint(1, 50, (3 + p % 4,)) for p in range(PROMPTS)]
            dock.put_experience({"prompts": prompts, "prompt_length": torch.tensor([[len(p)] for p in prompts])},
                                is_prompt=True)  # each prompt fills its n rows
            trained = out.get(timeout=120)
            for p in stages:
                p.join(60)
            if any(p.exitcode != 0 for p in stages):
                print("transfer_dock FAILED: a stage exited with an error")
                return 1
            assert sorted(trained) == list(range(PROMPTS * N)), "a row was lost or trained twice"
            print(f"step {step}: trained on {len(trained)} rows in whole prompts", flush=True)
            dock.clear()
        dock.close()
    finally:
        tq.close()
    print(f"transfer_dock OK: {STEPS} steps of {PROMPTS} prompts x {N} responses")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
