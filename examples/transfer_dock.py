"""A MindSpeed-RL GRPO step through ``GRPOTransferDock``, with stages as independent processes.

The calls have MindSpeed-RL's shapes: the dock is built with ``(prompts_num, n_samples_per_prompt,
metrics, max_age, GBS_train)``; the driver puts every prompt already repeated ``n`` times, by row
index, with ``is_prompt=True``; each stage loops ``while not all_consumed(stage)`` over
``get_experience(stage, columns, count)``, which returns ``(TensorDict, indexes)`` (columns
zero-padded, plus ``original_length``) or ``(None, None)``, and puts its output columns back at
those indexes as a padded TensorDict with ``original_length``:

* actor_rollout: prompts -> responses (variable length) and their lengths;
* rule_reward:   responses -> rm_scores;
* actor_train:   whole prompts (``get_n_samples``, the default) balanced by sequence length.

Stages record timings with ``update_metrics(..., cumulate=True)``; the driver reads them with
``get_metrics`` and ``clear()``s the dock for the next step. The stages are processes handed the
dock object (it pickles to its address; MindSpeed-RL hands around a Ray actor handle instead, and
``ray.remote(GRPOTransferDock)`` works the same way). ``timeout=1`` (ours) makes a stage wait on the
dock's event stream instead of polling.

Run: ``python examples/transfer_dock.py``
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis import DockMetrics
from tq_redis.redact import redact

CONF = {"storage": {"backend": "redis"}}  # the store; the embedded Valkey starts without a redis.url
PROMPTS, N, STEPS = 8, 4, 2


def unpad(batch: TensorDict, columns: list[str]) -> dict[str, list[torch.Tensor]]:
    """Rows without padding: ``original_length`` holds each row's length, column after column."""
    lengths = iter(batch["original_length"].tolist())
    return {c: [row[: next(lengths)] for row in batch[c].unbind(0)] for c in columns}


def pad(columns: dict[str, list[torch.Tensor]]) -> TensorDict:
    """Rows zero-padded to one tensor per column, plus ``original_length`` (what MindSpeed-RL puts)."""
    out, lengths = {}, []
    for name, rows in columns.items():
        width = max(len(r) for r in rows)
        out[name] = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
        lengths += [len(r) for r in rows]
    out["original_length"] = torch.tensor(lengths)
    return TensorDict.from_dict(out)


def rollout(dock: tq.GRPOTransferDock) -> None:
    while not dock.all_consumed("actor_rollout"):
        started = time.time()
        batch, index = dock.get_experience("actor_rollout", ["prompts", "prompt_length"], 8, timeout=1)
        if index is None:
            continue
        prompts = unpad(batch, ["prompts"])["prompts"]
        responses = [torch.arange(int(p.sum()) % 9 + 1) for p in prompts]
        dock.put_experience(pad({"responses": responses,
                                 "response_length": [torch.tensor([len(r)]) for r in responses]}), index)
        dock.update_metrics("timing/rollout", value=[round(time.time() - started, 4)], cumulate=True)
    dock.close()


def reward(dock: tq.GRPOTransferDock) -> None:
    while not dock.all_consumed("rule_reward"):
        batch, index = dock.get_experience("rule_reward", ["responses"], 4, timeout=1)
        if index is None:
            continue
        responses = unpad(batch, ["responses"])["responses"]
        scores = [torch.tensor([float(len(r) % 2)]) for r in responses]
        dock.put_experience(pad({"rm_scores": scores}), index)
    dock.close()


def train(dock: tq.GRPOTransferDock, out) -> None:
    seen: list[int] = []
    while not dock.all_consumed("actor_train"):
        batch, index = dock.get_experience("actor_train", ["responses", "rm_scores", "prompt_length"], 2 * N,
                                           use_batch_seqlen_balance=True, timeout=1)
        if index is None:
            continue
        assert sorted({i // N for i in index}) == sorted({i // N for i in index[::N]}), "a prompt was split"
        assert batch["rm_scores"].shape == (2 * N, 1)
        seen.extend(index)
    dock.update_metrics("actor/trained_rows", value=[len(seen)], cumulate=True)
    out.put(seen)
    dock.close()


def prompts_batch() -> tuple[dict[str, list[torch.Tensor]], list[int]]:
    """Each prompt repeated ``N`` times and its row indexes, as MindSpeed-RL's ``put_prompts_experience``."""
    prompts = [torch.randint(1, 50, (3 + p % 4,)) for p in range(PROMPTS)]
    rows = [p for p in prompts for _ in range(N)]
    return {"prompts": rows, "prompt_length": [torch.tensor([len(p)]) for p in rows]}, list(range(PROMPTS * N))


def main() -> int:
    cfg = tq.init(CONF)
    print(f"metadata plane: {redact(cfg['redis']['url'])} (namespace {cfg['namespace']!r})", flush=True)
    dock = tq.GRPOTransferDock(PROMPTS, N, DockMetrics(), 1, PROMPTS)  # MindSpeed's positional arguments
    ctx = mp.get_context("fork")  # quick to start here; MindSpeed-RL launches stages with Ray
    try:
        for step in range(STEPS):
            out = ctx.Queue()
            stages = [ctx.Process(target=rollout, args=(dock,)), ctx.Process(target=reward, args=(dock,)),
                      ctx.Process(target=train, args=(dock, out))]
            for p in stages:
                p.start()
            batch, indexes = prompts_batch()
            dock.put_experience(pad(batch), indexes, is_prompt=True)
            trained = out.get(timeout=120)
            for p in stages:
                p.join(60)
            if any(p.exitcode != 0 for p in stages):
                print("transfer_dock FAILED: a stage exited with an error")
                return 1
            assert sorted(trained) == list(range(PROMPTS * N)), "a row was lost or trained twice"
            metrics = dock.get_metrics().metric
            assert metrics["actor/trained_rows"] == [PROMPTS * N] and len(metrics["timing/rollout"]) >= 1
            print(f"step {step}: trained on {len(trained)} rows in whole prompts; "
                  f"{len(metrics['timing/rollout'])} rollout batches", flush=True)
            dock.clear()
        dock.close()
    finally:
        tq.close()
    print(f"transfer_dock OK: {STEPS} steps of {PROMPTS} prompts x {N} responses")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
