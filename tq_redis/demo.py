"""``tq-redis demo``: the main job -- a GRPO-shaped pipeline of independent processes.

On the embedded default (a Valkey plus two local DRAM storage nodes, started and stopped here)
six worker processes that know nothing but the Redis URL and the namespace stream one partition
per training step, ``step_<k>``, through five stages:

* **feeder**   inserts the step's prompts, each repeated ``n_samples`` times (one GRPO group)
  and tagged with a ``uid`` per prompt, then seals the partition;
* **rollout**  (``--workers`` processes) claim whole groups (``GRPOGroupNSampler``) and generate
  variable-length responses token by token with a tiny bigram policy (jagged nested tensors),
  tagging each sample with ``total_lengths`` (prompt + response tokens);
* **reward**   claims whole groups, scores them and writes rewards and group-normalised
  advantages;
* **ref**      writes reference-policy log-probs of every response token;
* **trainer**  claims token-budget micro-batches (``sampling_config={"max_tokens": T}``),
  runs a GRPO update on each, and clears the partition once the step is done.

Every stage claims micro-batches as soon as their inputs are produced, so the stages overlap:
the reward worker starts on a step's first groups while rollout is still generating the rest.
Generation and scoring cost is simulated with bounded CPU work proportional to the number of
tokens (never with sleeps). The rollout of step ``k`` starts once the trainer has finished step
``k - max_lag`` (``--max-lag 0``: strictly on-policy).

Each worker reports ``(stage, worker, step, start, end, n)`` spans to this process over a
multiprocessing queue; this process draws per-stage progress bars (rich; plain lines when stdout
is not a terminal), prints a summary (samples, bytes moved, per-stage busy time, wall time and
the overlap gained over running the stages one after another) and writes a timeline PNG
(matplotlib) plus ``summary.json`` and ``spans.json`` to ``--out``.

Run: ``python -m tq_redis.demo [--steps 3] [--batch 16] [--n-samples 4] [--workers 2]``
(``--redis URL`` attaches to an existing Redis instead: storage nodes must already be running
there, e.g. ``tq-redis up``, or pass ``--store redis``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["STAGES", "DemoConfig", "DemoFailed", "Span", "build_parser", "format_summary", "main", "run_demo"]

#: pipeline stages in order; each span and progress bar belongs to one of them
STAGES: tuple[str, ...] = ("feeder", "rollout", "reward", "ref", "trainer")

_LABELS = {
    "feeder": "prompt feeder",
    "rollout": "rollout",
    "reward": "reward",
    "ref": "ref log-prob",
    "trainer": "trainer",
}

VOCAB = 512
DIM = 64
PROMPTS_PER_PUT = 2
"""Prompts (groups of ``n_samples`` rows) the feeder inserts per ``put``."""

# Simulated cost of each stage in decode-step units per token (rollout runs one real decode step
# per token; the others add that many units of bounded compute on top of their real work).
_COST = {"reward": 0.2, "ref": 0.35, "trainer": 0.5}

_WAIT_SLICE_S = 1.0
"""Longest single wait of a worker (claim, gate or start); it re-checks the stop flag after it."""
_STOP_GRACE_S = 3.0
"""How long workers get to exit by themselves after the stop flag before they are terminated
(they check it at least every ``_WAIT_SLICE_S``; one blocked retrying a dead Redis would not)."""


class DemoFailed(RuntimeError):
    """The demo did not complete: a worker failed or died, it timed out, or its output was wrong."""


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and options of one demo run (the command-line options, see :func:`build_parser`)."""

    steps: int = 3
    batch: int = 16
    n_samples: int = 4
    workers: int = 2
    store: str = "dram"
    redis_url: str | None = None
    namespace: str = "tq"
    out: str = "tq-demo-out"
    max_tokens: int = 2048
    micro_batch: int = 32
    max_lag: int = 1
    prompt_len: tuple[int, int] = (8, 48)
    response_len: tuple[int, int] = (16, 320)
    seed: int = 0
    timeout_s: float = 300.0
    progress: str = "auto"
    fail_stage: str | None = None

    @property
    def samples_per_step(self) -> int:
        """Rows per partition: prompts times samples per prompt."""
        return self.batch * self.n_samples

    @property
    def samples(self) -> int:
        """Rows over the whole run."""
        return self.steps * self.samples_per_step

    def validate(self) -> None:
        """Raise ``ValueError`` for sizes the pipeline cannot run with."""
        for name in ("steps", "batch", "n_samples", "workers", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {self.max_lag}")
        if self.store not in ("dram", "redis"):
            raise ValueError(f"store must be 'dram' or 'redis', got {self.store!r}")
        if self.progress not in ("auto", "rich", "plain", "none"):
            raise ValueError(f"progress must be auto, rich, plain or none, got {self.progress!r}")
        if self.fail_stage is not None and self.fail_stage not in STAGES:
            raise ValueError(f"fail_stage must be one of {STAGES}, got {self.fail_stage!r}")
        for name in ("prompt_len", "response_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        longest = self.prompt_len[1] + self.response_len[1]
        if self.max_tokens and self.max_tokens < longest:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must fit the longest sample ({longest} tokens: "
                f"prompt {self.prompt_len[1]} + response {self.response_len[1]}), or no batch could hold it"
            )


@dataclass(frozen=True)
class Span:
    """One stage working on one micro-batch: claim returned -> results stored."""

    stage: str
    worker: int
    step: int
    start: float
    end: float
    n: int
    tokens: int
    bytes_in: int
    bytes_out: int
    cpu_s: float

    @property
    def duration(self) -> float:
        """Seconds the micro-batch took (wall clock)."""
        return self.end - self.start


# --------------------------------------------------------------------------------------- workers


class _Stopped(Exception):
    """The main process asked the workers to stop."""


@dataclass
class _Shared:
    """What every worker process gets: where to attach and how to talk to the main process."""

    url: str
    namespace: str
    cfg: DemoConfig
    events: Any  # multiprocessing Queue of tuples (see _Reporter)
    go: Any  # Event: every worker is ready, start the clock
    stop: Any  # Event: stop now (a worker failed, timeout, Ctrl-C)
    trained: Any  # Value('i'): steps the trainer has finished (and cleared)
    cond: Any  # Condition notified when ``trained`` changes


class _Reporter:
    def __init__(self, shared: _Shared, stage: str, worker: int) -> None:
        self.events = shared.events
        self.stage = stage
        self.worker = worker

    def span(self, step: int, start: float, cpu0: float, n: int, tokens: int, bytes_in: int, bytes_out: int) -> None:
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
        self.events.put((kind, self.stage, self.worker, *payload))


def _partition(step: int) -> str:
    return f"step_{step}"


def _check_stop(sh: _Shared) -> None:
    """Raise ``_Stopped`` if the main process asked to stop or is gone (killed: no one to report to)."""
    parent = mp.parent_process()
    if sh.stop.is_set() or (parent is not None and not parent.is_alive()):
        raise _Stopped


def _wait_trained(sh: _Shared, at_least: int) -> None:
    """Block until the trainer has finished ``at_least`` steps (the policy-lag gate)."""
    with sh.cond:
        while sh.trained.value < at_least:
            _check_stop(sh)
            sh.cond.wait(_WAIT_SLICE_S)


def _claims(
    client: Any,
    sh: _Shared,
    step: int,
    task: str,
    fields: Sequence[str],
    batch_size: int,
    sampling: dict[str, Any] | None = None,
    expected: int | None = None,
) -> Iterator[Any]:
    """Claim ``task``'s micro-batches of one step as they become ready until the step is done.

    Done means ``expected`` samples claimed by this worker (single-worker stages), or the
    partition sealed and drained for the task (stages several workers share), or the trainer
    already past the step.
    """
    from tq_redis import streaming

    part = _partition(step)
    got = 0
    while expected is None or got < expected:
        _check_stop(sh)
        if sh.trained.value > step:
            return
        want = batch_size if expected is None else min(batch_size, expected - got)
        op = streaming.next_batch(client._ctx, list(fields), want, part, task, sampling, timeout=_WAIT_SLICE_S)
        try:
            meta = client._driver.run(op)
        except TimeoutError:
            continue
        if meta is None:
            return
        got += meta.size
        yield meta


def _nbytes(td: Any) -> int:
    """Payload bytes of a TensorDict (jagged fields: values plus offsets)."""
    import torch

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


def _jagged(rows: list[Any]) -> Any:
    import torch

    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _generator(*key: int) -> Any:
    import torch

    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + int(part) + 1) % (2**62)
    return torch.Generator().manual_seed(seed)


class _Burn:
    """Bounded CPU work: ``run(k)`` does ``k`` small matmuls (about one decode step each)."""

    def __init__(self) -> None:
        import torch

        self.w = torch.randn(DIM, DIM, generator=_generator(7)) / DIM**0.5
        self.h = torch.randn(4, DIM, generator=_generator(8))

    def run(self, units: float) -> None:
        import torch

        h = self.h
        for _ in range(int(units)):
            h = torch.tanh(h @ self.w)


class _BigramLM:
    """A tiny policy: next-token log-probs from the previous token only (embedding -> tanh -> head)."""

    def __init__(self, seed: int, trainable: bool = False) -> None:
        import torch

        g = _generator(seed, 1)
        self.emb = (torch.randn(VOCAB, DIM, generator=g) / DIM**0.5).requires_grad_(trainable)
        self.head = (torch.randn(DIM, VOCAB, generator=g) / DIM**0.5).requires_grad_(trainable)

    def parameters(self) -> list[Any]:
        return [self.emb, self.head]

    def generate(self, prompt: Any, length: int, gen: Any) -> tuple[Any, Any]:
        """Sample ``length`` tokens one decode step at a time; returns (tokens, their log-probs)."""
        import torch

        tok = int(prompt[-1])
        tokens, logps = [], []
        with torch.no_grad():
            for _ in range(length):
                logp = torch.log_softmax(torch.tanh(self.emb[tok]) @ self.head, dim=-1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                tokens.append(tok)
                logps.append(float(logp[tok]))
        return torch.tensor(tokens, dtype=torch.int64), torch.tensor(logps, dtype=torch.float32)

    def token_log_probs(self, prompts: list[Any], responses: list[Any]) -> Any:
        """Log-probs of every response token given its predecessor, all rows in one pass (flat)."""
        import torch

        prev = torch.cat([torch.cat([p[-1:], r[:-1]]) for p, r in zip(prompts, responses)])
        nxt = torch.cat(list(responses))
        logp = torch.log_softmax(torch.tanh(self.emb[prev]) @ self.head, dim=-1)
        return logp.gather(1, nxt.unsqueeze(1)).squeeze(1)


def _stage_feeder(client: Any, sh: _Shared, rep: _Reporter) -> None:
    import torch
    from tensordict import TensorDict

    cfg = sh.cfg
    n = cfg.n_samples
    for step in range(cfg.steps):
        _wait_trained(sh, step - cfg.max_lag)
        part = _partition(step)
        for first in range(0, cfg.batch, PROMPTS_PER_PUT):
            _check_stop(sh)
            t0, c0 = time.time(), time.process_time()
            if cfg.fail_stage == "feeder":
                raise RuntimeError("injected failure (--fail-stage feeder)")
            pids = list(range(first, min(first + PROMPTS_PER_PUT, cfg.batch)))
            prompts = []
            for pid in pids:
                g = _generator(cfg.seed, step, pid, 0)
                length = int(torch.randint(cfg.prompt_len[0], cfg.prompt_len[1] + 1, (1,), generator=g))
                prompts.append(torch.randint(0, VOCAB, (length,), generator=g))
            rows = [p for p in prompts for _ in range(n)]
            td = TensorDict(
                {"prompts": _jagged(rows), "prompt_id": torch.tensor(pids).repeat_interleave(n)},
                batch_size=[len(rows)],
            )
            meta = client.put(td, partition_id=part)
            meta.update_custom_meta([{"uid": f"{part}/prompt_{pid}"} for pid in pids for _ in range(n)])
            client.set_custom_meta(meta)
            rep.span(step, t0, c0, len(rows), sum(len(p) for p in rows), 0, _nbytes(td))
        client.seal_partition(part)


def _stage_rollout(client: Any, sh: _Shared, rep: _Reporter) -> None:
    import torch
    from tensordict import TensorDict

    cfg = sh.cfg
    policy = _BigramLM(cfg.seed + 1)
    grpo = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": cfg.n_samples}
    lo, hi = cfg.response_len
    for step in range(cfg.steps):
        for meta in _claims(client, sh, step, "rollout", ["prompts", "prompt_id"], cfg.n_samples, grpo):
            t0, c0 = time.time(), time.process_time()
            if cfg.fail_stage == "rollout":
                raise RuntimeError("injected failure (--fail-stage rollout)")
            data = client.get_data(meta)
            responses, logps, tags = [], [], []
            for gid, prompt in zip(meta.global_indexes, data["prompts"].unbind()):
                gen = _generator(cfg.seed, step, gid, 1)
                u = float(torch.rand((), generator=gen))
                length = lo + int((hi - lo) * u * u)  # skewed: many short responses, a long tail
                tokens, logp = policy.generate(prompt, length, gen)
                responses.append(tokens)
                logps.append(logp)
                tags.append({"total_lengths": len(prompt) + length})
            out = TensorDict({"responses": _jagged(responses), "old_log_prob": _jagged(logps)}, batch_size=[meta.size])
            meta.update_custom_meta(tags)
            client.put(out, metadata=meta)
            rep.span(step, t0, c0, meta.size, sum(len(r) for r in responses), _nbytes(data), _nbytes(out))


def _stage_reward(client: Any, sh: _Shared, rep: _Reporter) -> None:
    import torch
    from tensordict import TensorDict

    cfg = sh.cfg
    burn = _Burn()
    grpo = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": cfg.n_samples}
    fields = ["prompt_id", "responses"]
    for step in range(cfg.steps):
        for meta in _claims(client, sh, step, "reward", fields, cfg.n_samples, grpo, cfg.samples_per_step):
            t0, c0 = time.time(), time.process_time()
            if cfg.fail_stage == "reward":
                raise RuntimeError("injected failure (--fail-stage reward)")
            data = client.get_data(meta)
            uids = {m.get("uid") for m in meta.custom_meta}
            if len(set(data["prompt_id"].tolist())) != 1 or len(uids) != 1:
                raise DemoFailed(f"reward got a batch that is not one GRPO group: uids {sorted(map(str, uids))}")
            responses = list(data["responses"].unbind())
            tokens = sum(len(r) for r in responses)
            # a rule-based "verifier": the share of low token ids, minus a small length penalty
            rewards = torch.stack([(r < VOCAB // 4).float().mean() - 1e-4 * len(r) for r in responses])
            advantages = (rewards - rewards.mean()) / (rewards.std(correction=0) + 1e-6)
            burn.run(tokens * _COST["reward"])
            out = TensorDict({"rewards": rewards, "advantages": advantages}, batch_size=[meta.size])
            client.put(out, metadata=meta)
            rep.span(step, t0, c0, meta.size, tokens, _nbytes(data), _nbytes(out))


def _stage_ref(client: Any, sh: _Shared, rep: _Reporter) -> None:
    import torch
    from tensordict import TensorDict

    cfg = sh.cfg
    burn = _Burn()
    ref = _BigramLM(cfg.seed)
    for step in range(cfg.steps):
        for meta in _claims(
            client, sh, step, "ref", ["prompts", "responses"], cfg.n_samples, None, cfg.samples_per_step
        ):
            t0, c0 = time.time(), time.process_time()
            if cfg.fail_stage == "ref":
                raise RuntimeError("injected failure (--fail-stage ref)")
            data = client.get_data(meta)
            prompts, responses = list(data["prompts"].unbind()), list(data["responses"].unbind())
            with torch.no_grad():
                flat = ref.token_log_probs(prompts, responses)
            sizes = [len(r) for r in responses]
            burn.run(sum(sizes) * _COST["ref"])
            out = TensorDict({"ref_log_prob": _jagged(list(flat.split(sizes)))}, batch_size=[meta.size])
            client.put(out, metadata=meta)
            rep.span(step, t0, c0, meta.size, sum(sizes), _nbytes(data), _nbytes(out))


def _stage_trainer(client: Any, sh: _Shared, rep: _Reporter) -> None:
    import torch

    cfg = sh.cfg
    burn = _Burn()
    policy = _BigramLM(cfg.seed + 1, trainable=True)
    opt = torch.optim.SGD(policy.parameters(), lr=1e-2)
    fields = ["prompts", "responses", "old_log_prob", "ref_log_prob", "advantages"]
    sampling = {"max_tokens": cfg.max_tokens} if cfg.max_tokens else None
    for step in range(cfg.steps):
        seen: set[int] = set()
        batches = 0
        for meta in _claims(client, sh, step, "train", fields, cfg.micro_batch, sampling, cfg.samples_per_step):
            t0, c0 = time.time(), time.process_time()
            if cfg.fail_stage == "trainer":
                raise RuntimeError("injected failure (--fail-stage trainer)")
            twice = seen.intersection(meta.global_indexes)
            if twice:
                raise DemoFailed(f"trainer got samples {sorted(twice)[:5]} of step {step} twice")
            seen.update(meta.global_indexes)
            data = client.get_data(meta)
            prompts, responses = list(data["prompts"].unbind()), list(data["responses"].unbind())
            sizes = [len(r) for r in responses]
            total = sum(len(p) for p in prompts) + sum(sizes)
            if cfg.max_tokens and total > cfg.max_tokens:
                raise DemoFailed(f"a micro-batch of {total} tokens exceeds max_tokens={cfg.max_tokens}")
            old = data["old_log_prob"].values()
            ref = data["ref_log_prob"].values()
            if old.numel() != sum(sizes) or ref.numel() != sum(sizes):
                raise DemoFailed("log-prob lengths do not match the responses")
            adv = torch.repeat_interleave(data["advantages"], torch.tensor(sizes))
            # GRPO: clipped importance-weighted advantage plus a KL penalty to the reference
            logp = policy.token_log_probs(prompts, responses)
            ratio = torch.exp(logp - old)
            pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            loss = (pg + 0.01 * kl).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            burn.run(total * _COST["trainer"])
            batches += 1
            rep.span(step, t0, c0, meta.size, total, _nbytes(data), 0)
        if len(seen) != cfg.samples_per_step:
            _check_stop(sh)
            raise DemoFailed(f"trainer saw {len(seen)} samples of step {step}, expected {cfg.samples_per_step}")
        client.clear_partition(_partition(step))
        rep.send("trained", step, len(seen), batches)
        with sh.cond:
            sh.trained.value = step + 1
            sh.cond.notify_all()


_STAGE_FUNCS: dict[str, Callable[[Any, _Shared, _Reporter], None]] = {
    "feeder": _stage_feeder,
    "rollout": _stage_rollout,
    "reward": _stage_reward,
    "ref": _stage_ref,
    "trainer": _stage_trainer,
}


def _worker_entry(stage: str, worker: int, sh: _Shared) -> None:
    """Body of every worker process: attach, report ready, wait for go, run the stage."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    rep = _Reporter(sh, stage, worker)
    try:
        import torch

        torch.set_num_threads(1)
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # a once-per-process notice
        from tq_redis.sync import TransferQueueClient

        client = TransferQueueClient(sh.url, sh.namespace, client_id=f"demo-{stage}-{worker}")
        try:
            client.get_partition_list()  # connect (and check the function library) before the clock starts
            _BigramLM(0).generate(torch.tensor([1]), 2, _generator(0))  # warm up torch's kernels
            _Burn().run(2)
            _jagged([torch.arange(2), torch.arange(3)]).unbind()  # first jagged tensor: lazy imports
            rep.send("ready")
            while not sh.go.wait(_WAIT_SLICE_S):
                _check_stop(sh)
            _STAGE_FUNCS[stage](client, sh, rep)
        finally:
            client.close()
        rep.send("done")
    except _Stopped:
        rep.send("stopped")
    except BaseException as exc:  # report anything, then exit non-zero
        rep.send("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        sh.events.close()
        sh.events.join_thread()
        os._exit(1)


# ------------------------------------------------------------------------------- main process


class _ProgressView:
    """Per-stage progress: rich bars on a terminal, one plain line per finished stage-step otherwise."""

    def __init__(self, cfg: DemoConfig, mode: str) -> None:
        self.cfg = cfg
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self.t0 = time.time()
        self.done: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.busy: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.per_step: dict[tuple[str, int], int] = {}
        self.batches: dict[tuple[str, int], int] = {}
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}

    def start(self, t0: float) -> None:
        self.t0 = t0
        if self.mode != "rich":
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            refresh_per_second=8,
        )
        self._progress.start()
        for stage in STAGES:
            label = _LABELS[stage] + (f" x{self.cfg.workers}" if stage == "rollout" and self.cfg.workers > 1 else "")
            self._tasks[stage] = self._progress.add_task(label, total=self.cfg.samples, info="waiting")

    def span(self, span: Span) -> None:
        stage = span.stage
        self.done[stage] += span.n
        self.busy[stage] += span.duration
        key = (stage, span.step)
        self.per_step[key] = self.per_step.get(key, 0) + span.n
        self.batches[key] = self.batches.get(key, 0) + 1
        finished = self.per_step[key] == self.cfg.samples_per_step
        if self._progress is not None:
            info = f"step {span.step + 1}/{self.cfg.steps}  busy {self.busy[stage]:.1f}s"
            self._progress.update(self._tasks[stage], completed=self.done[stage], info=info)
        elif self.mode == "plain" and finished:
            print(
                f"[{span.end - self.t0:6.2f}s] {_LABELS[stage]:<13} step {span.step}: "
                f"{self.per_step[key]} samples in {self.batches[key]} micro-batches "
                f"({self.done[stage]}/{self.cfg.samples} total, busy {self.busy[stage]:.2f}s)",
                flush=True,
            )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _say(cfg: DemoConfig, text: str) -> None:
    if cfg.progress != "none":
        print(text, flush=True)


def _mp_context() -> Any:
    """forkserver (torch imported once, then forked clean) where available, else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "tensordict", "tq_redis", "tq_redis.sync"])
        return ctx
    return mp.get_context("spawn")


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT while starting children, so they inherit that (Ctrl-C is the main process's)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread; workers ignore it themselves
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_forkserver_early() -> None:
    """Start the forkserver now, so its torch import overlaps with starting Redis and the nodes."""
    if "forkserver" not in mp.get_all_start_methods():
        return
    _mp_context()
    from multiprocessing import forkserver

    with _sigint_ignored():  # a forkserver started with SIGINT ignored passes that on to its forks
        forkserver.ensure_running()


def _forkserver_running() -> bool:
    try:
        from multiprocessing import forkserver

        return forkserver._forkserver._forkserver_pid is not None  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return False


def _stop_forkserver() -> None:
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver

        forkserver._forkserver._stop()  # type: ignore[attr-defined]


class _Pipeline:
    """The worker processes of one run and the event loop that watches them."""

    def __init__(self, cfg: DemoConfig, url: str, namespace: str, view: _ProgressView) -> None:
        self.cfg = cfg
        self.view = view
        self.ctx = _mp_context()
        self.shared = _Shared(
            url=url,
            namespace=namespace,
            cfg=cfg,
            events=self.ctx.Queue(),
            go=self.ctx.Event(),
            stop=self.ctx.Event(),
            trained=self.ctx.Value("i", 0),
            cond=self.ctx.Condition(),
        )
        roles = (
            [("feeder", 0)] + [("rollout", i) for i in range(cfg.workers)] + [("reward", 0), ("ref", 0), ("trainer", 0)]
        )
        self.procs: dict[tuple[str, int], Any] = {
            role: self.ctx.Process(
                target=_worker_entry, args=(*role, self.shared), name=f"tq-demo-{role[0]}-{role[1]}", daemon=True
            )
            for role in roles
        }
        self.spans: list[Span] = []
        self.trained: dict[int, tuple[int, int]] = {}
        self.ready: set[tuple[str, int]] = set()
        self.finished: set[tuple[str, int]] = set()

    def start(self) -> None:
        with _sigint_ignored():
            for proc in self.procs.values():
                proc.start()

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "span":
            span = Span(*event[1])
            self.spans.append(span)
            self.view.span(span)
            return
        stage, worker = event[1], event[2]
        if kind == "ready":
            self.ready.add((stage, worker))
        elif kind in ("done", "stopped"):
            self.finished.add((stage, worker))
        elif kind == "trained":
            self.trained[event[3]] = (event[4], event[5])
        elif kind == "error":
            message, tb = event[3], event[4]
            raise DemoFailed(f"the {stage} worker {worker} failed: {message}\n{tb.rstrip()}")

    def _pump(self, until: Callable[[], bool], deadline: float, what: str) -> None:
        """Handle events until ``until()``; fail on a worker error, a dead worker or the deadline."""
        while not until():
            try:
                self._handle(self.shared.events.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            for (stage, worker), proc in self.procs.items():
                if proc.exitcode is not None and (stage, worker) not in self.finished:
                    self._drain()  # its error report may still be in the pipe
                    raise DemoFailed(
                        f"the {stage} worker {worker} exited with code {proc.exitcode} before finishing (while {what})"
                    )
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {self.cfg.timeout_s:.0f}s while {what}")

    def _drain(self) -> None:
        with contextlib.suppress(queue.Empty, OSError, EOFError):
            while True:
                self._handle(self.shared.events.get(timeout=0.5))

    def run(self) -> tuple[float, float]:
        """Start the workers, release them together, wait for all to finish: (t_go, t_end)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        self.start()
        self._pump(lambda: len(self.ready) == len(self.procs), deadline, "starting the workers")
        t_go = time.time()
        self.view.start(t_go)
        self.shared.go.set()
        self._pump(lambda: len(self.finished) == len(self.procs), deadline, "running the pipeline")
        t_end = time.time()
        for proc in self.procs.values():
            proc.join(max(1.0, deadline - time.monotonic()))
        return t_go, t_end

    def shutdown(self) -> None:
        """Stop and reap every worker: ask, wait, then terminate, then kill."""
        self.shared.stop.set()
        end = time.monotonic() + _STOP_GRACE_S
        for proc in self.procs.values():
            while proc.is_alive() and time.monotonic() < end:
                with contextlib.suppress(queue.Empty, OSError, EOFError, DemoFailed):
                    self.shared.events.get(timeout=0.1)  # keep the pipe flowing so children can exit
                proc.join(0.05)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        with contextlib.suppress(Exception):
            self.shared.events.close()
            self.shared.events.join_thread()


def _init_conf(cfg: DemoConfig) -> dict[str, Any]:
    return {
        "redis": {"url": cfg.redis_url},
        "namespace": cfg.namespace,
        "storage": {"backend": cfg.store, "units": 2, "unit_capacity": "1GiB"},
    }


def _attached_settings(cfg: DemoConfig) -> dict[bytes, bytes]:
    """On an attached Redis: the namespace settings ``init`` will overwrite (restored afterwards),
    after checking that the DRAM store has storage nodes registered there."""
    import redis

    from tq_redis.errors import ConnectionFailed
    from tq_redis.keys import config_key, storage_nodes_key

    assert cfg.redis_url is not None
    r = redis.Redis.from_url(cfg.redis_url, socket_connect_timeout=5)
    try:
        nodes = r.hlen(storage_nodes_key(cfg.namespace))
        settings = r.hgetall(config_key(cfg.namespace))
    except redis.ConnectionError as exc:
        raise ConnectionFailed(f"cannot reach Redis at {cfg.redis_url}: {exc}") from exc
    finally:
        r.close()
    if cfg.store == "dram" and not nodes:
        raise DemoFailed(
            f"no DRAM storage nodes are registered in namespace {cfg.namespace!r} at {cfg.redis_url}: "
            f"start them (tq-redis up, or tq-redis storage-unit) or pass --store redis"
        )
    return settings


def _restore_settings(cfg: DemoConfig, settings: dict[bytes, bytes]) -> None:
    import redis

    from tq_redis.keys import config_key

    assert cfg.redis_url is not None
    r = redis.Redis.from_url(cfg.redis_url, socket_connect_timeout=5)
    try:
        with r.pipeline() as pipe:
            pipe.delete(config_key(cfg.namespace))
            if settings:
                pipe.hset(config_key(cfg.namespace), mapping=settings)
            pipe.execute()
    finally:
        r.close()


def run_demo(config: DemoConfig | None = None, **options: Any) -> dict[str, Any]:
    """Run the pipeline once and return its summary (also written to ``<out>/summary.json``).

    Args:
        config: sizes and options; keyword ``options`` override its fields (``steps=2`` ...).

    Returns:
        A dict: ``samples``/``trained``/``trained_unique``, ``bytes_put``/``bytes_get``/
        ``bytes_moved``, per-stage ``stages`` (busy and CPU seconds, micro-batches, samples,
        tokens), ``wall_s`` (first worker released -> last one done), ``total_s`` (with startup
        and shutdown), ``busy_sum_s``, ``overlap`` (= busy_sum_s / wall_s, the speed-up over running
        the stages one after another), ``timeline_png`` and ``summary_json``.

    Raises:
        DemoFailed: a worker failed or died, the run timed out, or a check failed. Every process
            the run started is stopped first.
        ValueError: invalid sizes.
    """
    import tq_redis as tq
    from tq_redis.runtime import NotInitialized

    cfg = dataclasses.replace(config or DemoConfig(), **options)
    cfg.validate()
    try:
        tq.get_client()
    except NotInitialized:
        pass
    else:
        raise DemoFailed("run_demo starts its own tq-redis: call tq_redis.close() first")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    _say(
        cfg,
        f"tq-redis demo: {cfg.steps} steps x {cfg.batch} prompts x {cfg.n_samples} samples = {cfg.samples} "
        f"samples, {cfg.workers} rollout workers, store {cfg.store}, max_tokens {cfg.max_tokens or 'off'}",
    )
    if cfg.redis_url:
        _say(cfg, f"attaching to {cfg.redis_url}")
    else:
        _say(cfg, "starting an embedded Valkey" + (" + 2 DRAM storage nodes" if cfg.store == "dram" else ""))
    owned_forkserver = not _forkserver_running()
    view = _ProgressView(cfg, cfg.progress)
    pipeline: _Pipeline | None = None
    settings: dict[bytes, bytes] | None = None
    try:
        if cfg.redis_url:
            settings = _attached_settings(cfg)
        _start_forkserver_early()
        tq_cfg = tq.init(_init_conf(cfg))
        url, ns = tq_cfg["redis"]["url"], tq_cfg["namespace"]
        client = tq.get_client()
        for step in range(cfg.steps):  # leftovers of an earlier run on an attached Redis
            client.clear_partition(_partition(step))
        _say(cfg, f"metadata plane {url} (namespace {ns!r}); starting {cfg.workers + 4} worker processes")
        pipeline = _Pipeline(cfg, url, ns, view)
        t_go, t_end = pipeline.run()
        view.close()
        client.get_partition_list()  # the metadata plane is still healthy
    finally:
        view.close()
        try:
            if pipeline is not None:
                pipeline.shutdown()
        finally:
            if cfg.redis_url and settings is not None:
                with contextlib.suppress(Exception):
                    for step in range(cfg.steps):
                        tq.get_client().clear_partition(_partition(step))
                with contextlib.suppress(Exception):
                    _restore_settings(cfg, settings)
            tq.close()
            if owned_forkserver:
                _stop_forkserver()
    summary = _summarize(cfg, pipeline.spans, pipeline.trained, t_start, t_go, t_end, url, ns)
    summary["timeline_png"] = str(_plot_timeline(cfg, pipeline.spans, t_go, summary, out / "demo_timeline.png"))
    summary["total_s"] = time.time() - t_start
    (out / "spans.json").write_text(json.dumps([dataclasses.asdict(s) for s in pipeline.spans]))
    summary["summary_json"] = str(out / "summary.json")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if summary["trained_unique"] != cfg.samples:
        raise DemoFailed(f"trained {summary['trained_unique']} distinct samples, expected {cfg.samples}")
    return summary


def _summarize(
    cfg: DemoConfig,
    spans: list[Span],
    trained: dict[int, tuple[int, int]],
    t_start: float,
    t_go: float,
    t_end: float,
    url: str,
    namespace: str,
) -> dict[str, Any]:
    stages: dict[str, dict[str, Any]] = {}
    for stage in STAGES:
        mine = [s for s in spans if s.stage == stage]
        sizes = [s.n for s in mine]
        stages[stage] = {
            "workers": len({s.worker for s in mine}),
            "micro_batches": len(mine),
            "samples": sum(sizes),
            "tokens": sum(s.tokens for s in mine),
            "batch_min": min(sizes, default=0),
            "batch_max": max(sizes, default=0),
            "busy_s": sum(s.duration for s in mine),
            "cpu_s": sum(s.cpu_s for s in mine),
            "bytes_in": sum(s.bytes_in for s in mine),
            "bytes_out": sum(s.bytes_out for s in mine),
        }
    wall = max(t_end - t_go, 1e-9)
    busy_sum = sum(st["busy_s"] for st in stages.values())
    cpu_sum = sum(st["cpu_s"] for st in stages.values())
    bytes_put = sum(st["bytes_out"] for st in stages.values())
    bytes_get = sum(st["bytes_in"] for st in stages.values())
    return {
        "ok": True,
        "config": dataclasses.asdict(cfg),
        "redis_url": url,
        "namespace": namespace,
        "samples": cfg.samples,
        "trained": sum(n for n, _ in trained.values()),
        "trained_unique": sum(n for n, _ in trained.values()),
        "steps_trained": len(trained),
        "bytes_put": bytes_put,
        "bytes_get": bytes_get,
        "bytes_moved": bytes_put + bytes_get,
        "stages": stages,
        "startup_s": t_go - t_start,
        "wall_s": wall,
        "busy_sum_s": busy_sum,
        "cpu_sum_s": cpu_sum,
        "overlap": busy_sum / wall,
        "overlap_cpu": cpu_sum / wall,
        "cores": os.cpu_count(),
    }


def _plot_timeline(cfg: DemoConfig, spans: list[Span], t0: float, summary: dict[str, Any], path: Path) -> Path:
    """Which stage worked on which micro-batch when: one lane per worker, colour = step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = [("feeder", 0)] + [("rollout", i) for i in range(cfg.workers)] + [("reward", 0), ("ref", 0), ("trainer", 0)]
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.55 * len(lanes)), dpi=110)
    span_total = max((s.end - t0 for s in spans), default=1.0)
    for y, (stage, worker) in enumerate(lanes):
        for s in spans:
            if (s.stage, s.worker) != (stage, worker):
                continue
            ax.broken_barh(
                [(s.start - t0, max(s.duration, span_total / 2000))],
                (y - 0.38, 0.76),
                facecolors=colors(s.step % 10),
                edgecolors="black",
                linewidth=0.4,
            )
            if s.duration > span_total / 40:
                ax.text(s.start - t0 + s.duration / 2, y, str(s.n), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([_LABELS[st] + (f" {w}" if st == "rollout" else "") for st, w in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the workers were released (number in a bar: samples in the micro-batch)")
    ax.set_xlim(0, span_total * 1.01)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[Patch(color=colors(k % 10), label=f"step {k}") for k in range(cfg.steps)],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22 - 0.1 / len(lanes)),
        ncol=min(cfg.steps, 10),
        fontsize=8,
        frameon=False,
    )
    ax.set_title(
        f"tq-redis demo: {cfg.steps} steps x {cfg.batch} prompts x {cfg.n_samples} samples, "
        f"{cfg.workers} rollout workers, store {cfg.store} -- overlap {summary['overlap']:.2f}x "
        f"({summary['busy_sum_s']:.1f}s of stage work in {summary['wall_s']:.1f}s)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable summary printed at the end of a run."""
    cfg = summary["config"]
    trainer = summary["stages"]["trainer"]
    lines = [
        "",
        "summary",
        f"  samples      {summary['trained_unique']}/{summary['samples']} trained exactly once, "
        f"{summary['steps_trained']} steps; trainer micro-batches: {trainer['micro_batches']} "
        f"({trainer['batch_min']}-{trainer['batch_max']} samples"
        + (f", <= {cfg['max_tokens']} tokens each)" if cfg["max_tokens"] else ")"),
        f"  bytes moved  {_fmt_bytes(summary['bytes_moved'])} (put {_fmt_bytes(summary['bytes_put'])}, "
        f"get {_fmt_bytes(summary['bytes_get'])}) through store {cfg['store']}",
        f"  {'stage':<14}{'busy':>8}{'cpu':>8}{'batches':>9}{'samples':>9}{'tokens':>9}",
    ]
    for stage in STAGES:
        st = summary["stages"][stage]
        label = _LABELS[stage] + (f" x{st['workers']}" if st["workers"] > 1 else "")
        lines.append(
            f"  {label:<14}{st['busy_s']:>7.2f}s{st['cpu_s']:>7.2f}s{st['micro_batches']:>9}"
            f"{st['samples']:>9}{st['tokens']:>9}"
        )
    lines += [
        f"  wall         {summary['wall_s']:.2f}s pipeline ({summary['startup_s']:.1f}s startup, "
        f"{summary['total_s']:.1f}s in all)",
        f"  overlap      {summary['overlap']:.2f}x: one stage after another would take {summary['busy_sum_s']:.2f}s "
        f"(the sum of busy times), pipelined they took {summary['wall_s']:.2f}s",
        f"               (busy = wall time inside a micro-batch; the stages used {summary['cpu_sum_s']:.2f}s CPU "
        f"on {summary['cores']} cores)",
        f"  timeline     {summary['timeline_png']}",
        f"demo OK: trained={summary['trained_unique']} expected={summary['samples']} "
        f"wall_s={summary['wall_s']:.2f} overlap={summary['overlap']:.2f}",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The ``tq-redis demo`` options."""
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="tq-redis demo",
        description="GRPO-shaped rollout -> reward -> ref log-prob -> trainer pipeline of independent processes, "
        "streaming one partition per step through tq-redis.",
    )
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps, one partition each ({d.steps})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"prompts per step ({d.batch})")
    p.add_argument(
        "--n-samples", type=int, default=d.n_samples, help=f"responses per prompt, one GRPO group ({d.n_samples})"
    )
    p.add_argument("--workers", type=int, default=d.workers, help=f"rollout worker processes ({d.workers})")
    p.add_argument("--store", choices=("dram", "redis"), default=d.store, help=f"tensor store ({d.store})")
    p.add_argument(
        "--redis",
        metavar="URL",
        default=None,
        help="attach to this Redis instead of starting an embedded Valkey (with --store dram its storage "
        "nodes must already be running, e.g. tq-redis up)",
    )
    p.add_argument(
        "--namespace",
        default=os.environ.get("TQ_NAMESPACE", d.namespace),
        help="key namespace (default: $TQ_NAMESPACE or tq)",
    )
    p.add_argument("--out", default=d.out, help=f"directory for the timeline PNG and JSON ({d.out})")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help=f"trainer token budget per micro-batch, by total_lengths; 0: fixed micro-batches ({d.max_tokens})",
    )
    p.add_argument(
        "--micro-batch", type=int, default=d.micro_batch, help=f"most samples per trainer micro-batch ({d.micro_batch})"
    )
    p.add_argument(
        "--max-lag",
        type=int,
        default=d.max_lag,
        help=f"steps rollout may run ahead of the trainer; 0 = on-policy ({d.max_lag})",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--timeout", type=float, default=d.timeout_s, help=f"give up after this many seconds ({d.timeout_s:.0f})"
    )
    p.add_argument(
        "--progress",
        choices=("auto", "rich", "plain", "none"),
        default=d.progress,
        help="progress bars (auto: rich on a terminal, plain lines otherwise)",
    )
    p.add_argument("--fail-stage", choices=STAGES, default=None, help=argparse.SUPPRESS)  # tests: inject a failure
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``tq-redis demo``: run the pipeline, print the summary; 0 on success, 1 on failure, 130 on Ctrl-C."""
    from tq_redis.errors import TQError

    args = build_parser().parse_args(argv)
    cfg = DemoConfig(
        steps=args.steps,
        batch=args.batch,
        n_samples=args.n_samples,
        workers=args.workers,
        store=args.store,
        redis_url=args.redis,
        namespace=args.namespace,
        out=args.out,
        max_tokens=args.max_tokens,
        micro_batch=args.micro_batch,
        max_lag=args.max_lag,
        seed=args.seed,
        timeout_s=args.timeout,
        progress=args.progress,
        fail_stage=args.fail_stage,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"tq-redis demo: {exc}", file=sys.stderr)
        return 2

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM: clean up exactly as on Ctrl-C

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        summary = run_demo(cfg)
    except (DemoFailed, TQError) as exc:
        print(f"tq-redis demo FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tq-redis demo: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    from tq_redis.demo import main as _main  # children import tq_redis.demo, not __main__

    raise SystemExit(_main())
