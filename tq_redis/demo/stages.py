"""The worker processes of ``tq-redis demo``: one function per pipeline stage, and the body every
worker process runs (:func:`worker_main`).

A worker knows only the Redis URL and the namespace. It attaches a client, reports ready, waits
for the main process to release every worker at once, then runs its stage over every step,
claiming micro-batches as soon as their inputs are produced (:func:`micro_batches`) and reporting
one :class:`~tq_redis.demo.config.Span` per micro-batch over the events queue. The computation itself
is :mod:`tq_redis.demo.workload`'s; this module moves its inputs and outputs through tq-redis.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from tq_redis.demo import workload as wl
from tq_redis.demo.config import DemoConfig, DemoFailed, Span, partition

WAIT_SLICE_S = 1.0
"""Longest single wait of a worker (claim, gate or start); it re-checks the stop flag after it."""


class Stopped(Exception):
    """The main process asked the workers to stop."""


@dataclass
class Shared:
    """What every worker process gets: where to attach and how to talk to the main process."""

    url: str
    namespace: str
    cfg: DemoConfig
    events: Any  # multiprocessing Queue of tuples (see Reporter)
    go: Any  # Event: every worker is ready, start the clock
    stop: Any  # Event: stop now (a worker failed, timeout, Ctrl-C)
    trained: Any  # Value('i'): steps the trainer has finished (and cleared)
    cond: Any  # Condition notified when ``trained`` changes


class Reporter:
    """A worker's side of the events queue: ``("span", fields)`` or ``(kind, stage, worker, *payload)``."""

    def __init__(self, shared: Shared, stage: str, worker: int) -> None:
        self.events = shared.events
        self.stage = stage
        self.worker = worker

    def span(self, step: int, start: float, cpu0: float, n: int, tokens: int, bytes_in: int, bytes_out: int) -> None:
        """Report one micro-batch that started at ``start`` (wall) / ``cpu0`` (process CPU) and ends now."""
        span = Span(
            self.stage,
            self.worker,
            step,
            start,
            time.time(),
            n,
            tokens,
            bytes_in,
            bytes_out,
            time.process_time() - cpu0,
        )
        self.events.put(("span", dataclasses.astuple(span)))

    def send(self, kind: str, *payload: Any) -> None:
        """Report a state change: ``ready``, ``done``, ``stopped``, ``trained`` or ``error``."""
        self.events.put((kind, self.stage, self.worker, *payload))


def check_stop(sh: Shared) -> None:
    """Raise :class:`Stopped` if the main process asked to stop or is gone (killed: no one to report to)."""
    parent = mp.parent_process()
    if sh.stop.is_set() or (parent is not None and not parent.is_alive()):
        raise Stopped


def _wait_trained(sh: Shared, at_least: int) -> None:
    """Block until the trainer has finished ``at_least`` steps (the policy-lag gate)."""
    with sh.cond:
        while sh.trained.value < at_least:
            check_stop(sh)
            sh.cond.wait(WAIT_SLICE_S)


def nbytes(td: TensorDict) -> int:
    """Payload bytes of a TensorDict (jagged fields: values plus offsets)."""
    total = 0
    for value in td.values(include_nested=True, leaves_only=True):
        if not isinstance(value, torch.Tensor):
            continue
        if value.is_nested:
            values, offsets = value.values(), value.offsets()
            total += values.numel() * values.element_size() + offsets.numel() * offsets.element_size()
        else:
            total += value.numel() * value.element_size()
    return total


class MicroBatch:
    """One micro-batch a stage claimed: read its inputs, store its outputs, report its span.

    The span runs from the claim returning to :meth:`finish`.
    """

    def __init__(self, client: Any, rep: Reporter, step: int, meta: Any, values: dict[str, list] | None = None) -> None:
        self.client = client
        self.rep = rep
        self.step = step
        self.meta = meta
        self.values = values or {}  # the inline values that came with the claim
        self.start, self.cpu0 = time.time(), time.process_time()
        self.bytes_in = 0

    def read(self) -> TensorDict:
        """The claimed fields of every sample: from the values that came with the claim, and the
        store for the rest (:func:`tq_redis.ops.batch.read_claimed`; ``get_data`` without them)."""
        from tq_redis.ops.batch import read_claimed

        data = self.client.run(read_claimed(self.client.context, self.meta, self.values))
        self.bytes_in += nbytes(data)
        return data

    def finish(self, tokens: int, **outputs: torch.Tensor) -> None:
        """Store ``outputs`` (one row per sample; none: store nothing) and report the span."""
        bytes_out = 0
        if outputs:
            out = TensorDict(outputs, batch_size=[self.meta.size])
            self.client.put(out, metadata=self.meta)
            bytes_out = nbytes(out)
        self.rep.span(self.step, self.start, self.cpu0, self.meta.size, tokens, self.bytes_in, bytes_out)


def micro_batches(
    client: Any,
    sh: Shared,
    rep: Reporter,
    step: int,
    task: str,
    fields: Sequence[str],
    batch_size: int,
    sampling: dict[str, Any] | None = None,
    expected: int | None = None,
) -> Iterator[MicroBatch]:
    """Claim ``task``'s micro-batches of one step as they become ready until the step is done.

    Done means ``expected`` samples claimed by this worker (single-worker stages), or the
    partition sealed and drained for the task (stages several workers share), or the trainer
    already past the step.
    """
    from tq_redis.ops import streaming

    part = partition(step)
    got = 0
    while expected is None or got < expected:
        check_stop(sh)
        if sh.trained.value > step:
            return
        want = batch_size if expected is None else min(batch_size, expected - got)
        values: dict[str, list] = {}
        op = streaming.next_batch(
            client.context, list(fields), want, part, task, sampling, timeout=WAIT_SLICE_S, values=values
        )
        try:
            meta = client.run(op)
        except TimeoutError:
            continue
        if meta is None:
            return
        got += meta.size
        yield MicroBatch(client, rep, step, meta, values)


def _maybe_fail(cfg: DemoConfig, stage: str) -> None:
    """``--fail-stage`` (tests): fail this stage's first micro-batch."""
    if cfg.fail_stage == stage:
        raise RuntimeError(f"injected failure (--fail-stage {stage})")


def _grpo_groups(cfg: DemoConfig) -> dict[str, Any]:
    """Sampling config that claims whole GRPO groups (all ``n_samples`` rows of one prompt)."""
    return {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": cfg.n_samples}


def stage_feeder(client: Any, sh: Shared, rep: Reporter) -> None:
    """Insert each step's prompts, ``n_samples`` rows per prompt tagged with a ``uid``; seal the partition."""
    cfg = sh.cfg
    n = cfg.n_samples
    for step in range(cfg.steps):
        _wait_trained(sh, step - cfg.max_lag)
        part = partition(step)
        for first in range(0, cfg.batch, wl.PROMPTS_PER_PUT):
            check_stop(sh)
            t0, c0 = time.time(), time.process_time()
            _maybe_fail(cfg, "feeder")
            pids = list(range(first, min(first + wl.PROMPTS_PER_PUT, cfg.batch)))
            prompts = [wl.prompt(cfg.seed, step, pid, cfg.prompt_len) for pid in pids]
            rows = [p for p in prompts for _ in range(n)]
            td = TensorDict(
                {"prompts": wl.jagged(rows), "prompt_id": torch.tensor(pids).repeat_interleave(n)},
                batch_size=[len(rows)],
            )
            meta = client.put(td, partition_id=part)
            meta.update_custom_meta([{"uid": f"{part}/prompt_{pid}"} for pid in pids for _ in range(n)])
            client.set_custom_meta(meta)
            rep.span(step, t0, c0, len(rows), sum(len(p) for p in rows), 0, nbytes(td))
        client.seal_partition(part)


def stage_rollout(client: Any, sh: Shared, rep: Reporter) -> None:
    """Generate a response per row of whole GRPO groups; tag each with ``total_lengths``."""
    cfg = sh.cfg
    policy = wl.policy_model(cfg.seed)
    fields = ["prompts", "prompt_id"]
    for step in range(cfg.steps):
        for mb in micro_batches(client, sh, rep, step, "rollout", fields, cfg.n_samples, _grpo_groups(cfg)):
            _maybe_fail(cfg, "rollout")
            responses, logps, tags = [], [], []
            for gid, prompt in zip(mb.meta.global_indexes, mb.read()["prompts"].unbind()):
                gen = wl.generator(cfg.seed, step, gid, 1)
                length = wl.response_length(gen, cfg.response_len)
                response, logp = policy.generate(int(prompt[-1]), length, gen)
                responses.append(response)
                logps.append(logp)
                tags.append({"total_lengths": len(prompt) + length})
            mb.meta.update_custom_meta(tags)
            tokens = sum(len(r) for r in responses)
            mb.finish(tokens, responses=wl.jagged(responses), old_log_prob=wl.jagged(logps))


def stage_reward(client: Any, sh: Shared, rep: Reporter) -> None:
    """Score whole GRPO groups: rewards and group-normalised advantages."""
    cfg = sh.cfg
    burn = wl.Burn()
    fields = ["prompt_id", "responses"]
    groups = _grpo_groups(cfg)
    for step in range(cfg.steps):
        for mb in micro_batches(client, sh, rep, step, "reward", fields, cfg.n_samples, groups, cfg.samples_per_step):
            _maybe_fail(cfg, "reward")
            data = mb.read()
            uids = {m.get("uid") for m in mb.meta.custom_meta}
            if len(set(data["prompt_id"].tolist())) != 1 or len(uids) != 1:
                raise DemoFailed(f"reward got a batch that is not one GRPO group: uids {sorted(map(str, uids))}")
            responses = list(data["responses"].unbind())
            rewards = wl.rewards(responses)
            tokens = sum(len(r) for r in responses)
            burn.charge("reward", tokens)
            mb.finish(tokens, rewards=rewards, advantages=wl.group_advantages(rewards))


def stage_ref(client: Any, sh: Shared, rep: Reporter) -> None:
    """Write the reference policy's log-prob of every response token."""
    cfg = sh.cfg
    burn = wl.Burn()
    ref = wl.reference_model(cfg.seed)
    fields = ["prompts", "responses"]
    for step in range(cfg.steps):
        for mb in micro_batches(client, sh, rep, step, "ref", fields, cfg.n_samples, None, cfg.samples_per_step):
            _maybe_fail(cfg, "ref")
            data = mb.read()
            responses = list(data["responses"].unbind())
            rows = wl.ref_log_probs(ref, list(data["prompts"].unbind()), responses)
            tokens = sum(len(r) for r in responses)
            burn.charge("ref", tokens)
            mb.finish(tokens, ref_log_prob=wl.jagged(rows))


def stage_trainer(client: Any, sh: Shared, rep: Reporter) -> None:
    """Run a GRPO update per token-budget micro-batch; clear each step's partition once it is trained."""
    cfg = sh.cfg
    burn = wl.Burn()
    learner = wl.GRPOLearner(cfg.seed)
    fields = ["prompts", "responses", "old_log_prob", "ref_log_prob", "advantages"]
    budget = {"max_tokens": cfg.max_tokens} if cfg.max_tokens else None
    for step in range(cfg.steps):
        seen: set[int] = set()
        batches = 0
        for mb in micro_batches(client, sh, rep, step, "train", fields, cfg.micro_batch, budget, cfg.samples_per_step):
            _maybe_fail(cfg, "trainer")
            twice = seen.intersection(mb.meta.global_indexes)
            if twice:
                raise DemoFailed(f"trainer got samples {sorted(twice)[:5]} of step {step} twice")
            seen.update(mb.meta.global_indexes)
            data = mb.read()
            prompts, responses = list(data["prompts"].unbind()), list(data["responses"].unbind())
            response_tokens = sum(len(r) for r in responses)
            total = sum(len(p) for p in prompts) + response_tokens
            if cfg.max_tokens and total > cfg.max_tokens:
                raise DemoFailed(f"a micro-batch of {total} tokens exceeds max_tokens={cfg.max_tokens}")
            old = data["old_log_prob"].values()
            ref = data["ref_log_prob"].values()
            if old.numel() != response_tokens or ref.numel() != response_tokens:
                raise DemoFailed("log-prob lengths do not match the responses")
            learner.update(prompts, responses, old, ref, data["advantages"])
            burn.charge("trainer", total)
            batches += 1
            mb.finish(total)
        if len(seen) != cfg.samples_per_step:
            check_stop(sh)
            raise DemoFailed(f"trainer saw {len(seen)} samples of step {step}, expected {cfg.samples_per_step}")
        client.clear_partition(partition(step))
        rep.send("trained", step, len(seen), batches)
        with sh.cond:
            sh.trained.value = step + 1
            sh.cond.notify_all()


STAGE_FUNCS: dict[str, Callable[[Any, Shared, Reporter], None]] = {
    "feeder": stage_feeder,
    "rollout": stage_rollout,
    "reward": stage_reward,
    "ref": stage_ref,
    "trainer": stage_trainer,
}


def worker_main(stage: str, worker: int, sh: Shared) -> None:
    """Body of every worker process: attach, report ready, wait for go, run the stage."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    rep = Reporter(sh, stage, worker)
    try:
        torch.set_num_threads(1)
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # a once-per-process notice
        from tq_redis.client.blocking import TransferQueueClient

        client = TransferQueueClient(sh.url, sh.namespace, client_id=f"demo-{stage}-{worker}")
        try:
            client.get_partition_list()  # connect (and check the function library) before the clock starts
            wl.warm_up()
            rep.send("ready")
            while not sh.go.wait(WAIT_SLICE_S):
                check_stop(sh)
            STAGE_FUNCS[stage](client, sh, rep)
        finally:
            client.close()
        rep.send("done")
    except Stopped:
        rep.send("stopped")
    except BaseException as exc:  # report anything, then exit non-zero
        rep.send("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        sh.events.close()
        sh.events.join_thread()
        os._exit(1)
