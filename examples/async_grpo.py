"""A fully asynchronous GRPO loop: rollout workers generate while the trainer trains.

The main process calls ``tq.init()`` (an embedded Valkey; the ``redis`` store keeps the bytes in it)
and is the trainer; three rollout worker processes know only the Redis URL and the namespace.

* A worker reserves a prompt group (``reserve_group``) under the staleness bound: it blocks while
  the trainer is ``MAX_LAG`` versions behind. It drops some groups (``abort_group``: a prompt
  filter, or the weights changed before it started), else commits the group's prompts
  (``commit_group``) and generates the responses in decode steps. When the trainer publishes new
  weights mid-response, the worker appends what it generated so far as a part recorded with the
  old version (``append_parts``) and goes on with the new weights; the last part marks the
  responses complete, which is when the trainer can claim them.
* The trainer claims whole groups (GRPO sampler) of responses started at most ``MAX_LAG`` versions
  ago (``min_policy_version``), replaying each group up to ``MAX_TIMES_SAMPLED`` times, "trains",
  and publishes the next version (``set_policy_version``), which wakes blocked reservers. It does
  not publish while a group would go stale untrained: it trains that group first.

At the end it checks: no sample was trained more than ``MAX_LAG`` versions after it started, each
committed group was trained, no aborted sample was ever seen, each token's version
(``response~version``) is the one its worker generated it under, and clearing the partition left
none of its bytes behind.

Run: ``python examples/async_grpo.py``
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import queue
import time

import torch

import tq_redis as tq

CONF = {"storage": {"backend": "redis"}}  # the store: bytes in the embedded Valkey, where we can check they go
PARTITION = "rollouts"
WORKERS, GROUPS_PER_WORKER = 3, 8
GROUP = 4                    # responses per prompt (n_samples_per_prompt)
PROMPT_LEN, RESPONSE_LEN, DECODE_TOKENS = 8, 12, 3
DECODE_S, TRAIN_S = 0.02, 0.03  # the time a decode step and a training step "take"
MAX_LAG = 1                  # a sample is trained at most 1 version after the one it started on
CLAIMS_PER_STEP = 4          # one training step: up to 4 claims of one group each
MAX_TIMES_SAMPLED = 2        # replay: each group is trained up to twice
ABORT_EVERY = 4              # the prompt filter drops every 4th group a worker reserves


def rollout_worker(rank: int, url: str, ns: str, weights, publish_lock, out) -> None:
    """Reserve, commit the prompts, generate the responses in parts, report each group to the trainer.

    ``weights.value`` is the policy version the worker's weights are at (the trainer's weight
    broadcast); ``publish_lock`` is held by the trainer while it publishes a version.
    """
    client = tq.TransferQueueClient(url, ns)
    try:
        for g in range(GROUPS_PER_WORKER):
            r = client.reserve_group(PARTITION, GROUP, lease_s=120, timeout=120)  # waits at the staleness bound
            prompts = torch.full((GROUP, PROMPT_LEN), rank * 1000 + g)
            # commit or abort under the publish lock, so the trainer sees every group that started on
            # an old version before it publishes a newer one
            with publish_lock:
                if g % ABORT_EVERY == ABORT_EVERY - 1 or weights.value != r.policy_version:
                    client.abort_group(r)  # nothing of it is ever visible; its slots are admitted again
                    out.put(("aborted", rank, r.global_indexes))
                    continue
                meta = client.commit_group(r, {"prompts": prompts})  # tagged policy_version = r.policy_version
            versions = _generate(client, meta, r.policy_version, weights)
            out.put(("committed", rank, r.global_indexes, r.policy_version, versions))
    finally:
        client.close()
        out.put(("done", rank))


def _generate(client: tq.TransferQueueClient, meta, version: int, weights) -> list[int]:
    """Decode the group's responses; a weight update interrupts them: the tokens so far become a
    part under the old version. Returns the version of every token (the same for each sample)."""
    pending: list[torch.Tensor] = []
    versions: list[int] = []
    for step in range(RESPONSE_LEN // DECODE_TOKENS):
        time.sleep(DECODE_S)  # one decode step of the group's responses
        pending.append(torch.arange(DECODE_TOKENS).repeat(GROUP, 1) + step * DECODE_TOKENS)
        versions += [version] * DECODE_TOKENS
        now = weights.value
        if now != version:  # new weights: keep the tokens of the old policy, go on with the new one
            client.append_parts(meta, {"responses": torch.cat(pending, dim=1)}, version)
            pending, version = [], now
    if pending:
        client.append_parts(meta, {"responses": torch.cat(pending, dim=1)}, version, complete=True)
    else:  # the update came after the last step: every token is appended already
        client.complete_parts(meta, ["responses"])
    return versions


class Trainer:
    """Claims completed groups, checks what it is handed, publishes versions."""

    def __init__(self, client: tq.TransferQueueClient, weights, publish_lock) -> None:
        self.client, self.weights, self.publish_lock = client, weights, publish_lock
        self.version = 0
        self.times_trained: collections.Counter[int] = collections.Counter()
        self.seen: set[int] = set()  # every sample id the trainer was ever handed or listed
        self.versions: dict[int, list[int]] = {}  # sample -> each token's version, as its worker reported
        self.off_policy_tokens = self.tokens = 0

    def step(self) -> int:
        """One training step at the current version: up to CLAIMS_PER_STEP groups. Returns the
        samples trained."""
        config = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": GROUP,
                  "max_times_sampled": MAX_TIMES_SAMPLED, "min_policy_version": self.version - MAX_LAG}
        trained = 0
        for _ in range(CLAIMS_PER_STEP):
            meta = self.client.get_meta(["prompts", "responses"], GROUP, PARTITION, task_name="train",
                                        sampling_config=config, timeout=0.2 if trained == 0 else 0)
            if meta.size == 0:
                break
            self._train(meta)
            trained += meta.size
        if trained:
            time.sleep(TRAIN_S)  # ... the optimizer step ...
        return trained

    def _train(self, meta) -> None:
        data = self.client.get_data(meta)
        ids = [int(i) for i in meta.global_indexes]
        self.seen.update(ids)
        for sid, tags, token_versions in zip(ids, meta.get_all_custom_meta(), data["responses~version"].unbind()):
            start = tags["policy_version"]
            assert self.version - start <= MAX_LAG, f"sample {sid} (started on {start}) trained at {self.version}"
            token_versions = token_versions.tolist()
            assert token_versions == sorted(token_versions) and start <= token_versions[0], (sid, token_versions)
            assert token_versions[-1] <= self.version, (sid, token_versions, self.version)
            self.versions.setdefault(sid, token_versions)
            assert self.versions[sid] == token_versions, f"sample {sid}: versions changed between replays"
            self.off_policy_tokens += sum(v < self.version for v in token_versions)  # mask these in the loss
            self.tokens += len(token_versions)
            self.times_trained[sid] += 1

    def publish_if_none_left_behind(self) -> bool:
        """Publish the next version unless a group that started ``MAX_LAG`` versions ago is untrained
        (it would go stale): then train on until it is."""
        with self.publish_lock:
            listed = self.client.get_meta([], 1, PARTITION, mode="force_fetch")
            self.seen.update(int(i) for i in listed.global_indexes)
            behind = [int(i) for i, tags in zip(listed.global_indexes, listed.get_all_custom_meta())
                      if tags["policy_version"] <= self.version - MAX_LAG and int(i) not in self.times_trained]
            if behind:
                return False
            self.version += 1
            self.client.set_policy_version(PARTITION, self.version)  # wakes blocked reservers
            self.weights.value = self.version  # the weight broadcast
            return True


def main() -> int:
    cfg = tq.init(CONF)
    url, ns = cfg["redis"]["url"], cfg["namespace"]
    client = tq.get_client()
    client.set_staleness_bound(PARTITION, max_lag=MAX_LAG, batch_size=2 * GROUP)
    client.set_policy_version(PARTITION, 0)
    ctx = mp.get_context("forkserver")  # torch is imported once, in the fork server, not per worker
    ctx.set_forkserver_preload(["torch", "tensordict", "tq_redis"])
    weights, publish_lock, out = ctx.Value("q", 0), ctx.Lock(), ctx.Queue()
    workers = [ctx.Process(target=rollout_worker, args=(rank, url, ns, weights, publish_lock, out),
                           name=f"rollout{rank}") for rank in range(WORKERS)]
    trainer = Trainer(client, weights, publish_lock)
    committed: dict[int, tuple[int, list[int]]] = {}  # sample -> (start version, token versions)
    aborted: set[int] = set()
    t0 = time.perf_counter()
    try:
        for w in workers:
            w.start()
        done = 0
        deadline = time.monotonic() + 180
        while done < WORKERS or any(sid not in trainer.times_trained for sid in committed):
            assert time.monotonic() < deadline, "the loop did not finish within 180 s"
            assert all(w.is_alive() or w.exitcode == 0 for w in workers), "a rollout worker failed"
            if trainer.step():
                trainer.publish_if_none_left_behind()
            while True:  # what the workers reported meanwhile
                try:
                    msg = out.get_nowait()
                except queue.Empty:
                    break
                if msg[0] == "done":
                    done += 1
                elif msg[0] == "aborted":
                    aborted.update(msg[2])
                else:
                    _, _, ids, start, versions = msg
                    committed.update((sid, (start, versions)) for sid in ids)
        for w in workers:
            w.join(60)
        assert all(w.exitcode == 0 for w in workers), [w.exitcode for w in workers]

        assert aborted and not aborted & trainer.seen, "an aborted sample was visible"
        assert set(trainer.times_trained) == set(committed), "a committed group was not trained (or one unknown was)"
        assert max(trainer.times_trained.values()) <= MAX_TIMES_SAMPLED
        for sid, (_, versions) in committed.items():
            assert trainer.versions[sid] == versions, f"sample {sid}: trained {trainer.versions[sid]}, made {versions}"
        interrupted = sum(len(set(v)) > 1 for _, v in committed.values()) // GROUP

        client.clear_partition(PARTITION)  # frees every byte: the store's and the inline values
        keys = client.context.keys(PARTITION)
        left = list(client.redis.scan_iter(match=f"{keys.prefix}d:*")) + list(client.redis.scan_iter(match=keys.inline))
        assert not left, f"bytes left after clear_partition: {left[:5]}"
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
        tq.close()
    elapsed = time.perf_counter() - t0
    replays = sum(trainer.times_trained.values()) - len(trainer.times_trained)
    print(f"async_grpo OK: {len(committed) // GROUP} groups trained ({replays} sample replays) over "
          f"{trainer.version} policy versions, {len(aborted) // GROUP} aborted, {interrupted} responses interrupted "
          f"by a weight update, {trainer.off_policy_tokens}/{trainer.tokens} tokens off-policy, "
          f"all bytes freed, {elapsed:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
