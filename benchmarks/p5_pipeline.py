"""P5: steps per second of the ``demo``-shaped GRPO pipeline, on both systems in the same run.

One pipeline implementation, written against the API subset both systems share
(``put(td, partition_id=...)``, ``put(td, metadata=meta)``, ``get_meta(fields, batch_size,
partition_id, mode="fetch", task_name=...)``, ``get_data(meta)``, ``clear_partition``) except
for one call: a stage claims a batch and reads it with tq-redis's ``get_meta_and_data`` (one
round trip when the values are inline) and with the reference's ``get_meta`` + ``get_data``. It runs
as independent worker processes that attach to the running system
(:func:`benchmarks.reference.attach`), like ``tq-redis demo`` (``tq_redis/demo/main.py``), and doing
the demo's work: the model, rewards, GRPO update and simulated costs are
:mod:`tq_redis.demo.workload`'s, imported, not copied. One partition per training step,
``p5_step_<k>``; the stages:

* **feeder** (1 process) puts the step's ``--batch`` prompts, each repeated ``--n-samples``
  times (one GRPO group), ``demo_workload.PROMPTS_PER_PUT`` prompts per ``put``; every row carries a ``uid``.
  Step ``k`` is fed once the trainer has finished step ``k - --max-lag`` (the demo's policy lag).
* **rollout** (``--workers`` processes) claims ``--stage-batch`` rows at a time and generates a
  variable-length response per row token by token with a tiny bigram policy (one real decode
  step per token, no sleeps; lengths skewed: many short, a long tail, as in the demo), writing
  ``responses`` and ``old_log_prob`` (jagged).
* **reward** (1) scores ``--stage-batch`` rows and writes ``rewards`` and group-normalised
  ``advantages`` (normalised over each prompt's rows in the micro-batch).
* **ref** (1) writes ``ref_log_prob`` of every response token.
* **trainer** (1) claims fixed micro-batches of ``--micro-batch`` rows with every field (the
  reference has no token-budget sampler, so no ``max_tokens`` here), runs a GRPO update on
  each and clears the partition once the step is done.

Reward, ref and trainer add bounded CPU work proportional to the tokens they handle (the demo's
cost model: 0.2 / 0.35 / 0.5 decode-step units per token). Workers run with one torch thread.

Waiting for data: tq-redis blocks in ``get_meta(timeout=--wait-s)``; the reference runs in
polling mode (an unsatisfiable ``get_meta`` returns an empty batch at once: its blocking mode
sleeps inside the controller and blocks every other client) and a worker sleeps
``--poll-interval`` after an empty answer, as in P3.

Measured: steps/s = steps trained / wall time of the pipeline phase (from the moment every
worker is attached and warmed up, and the machine is quiet again, to the trainer finishing the
last step; system start-up is excluded). Verified: every fed ``uid`` is trained exactly once,
each response arrives with the length its ``uid`` determines, and the log-prob fields match the
responses.

Compute modes (``--compute``, both by default, :mod:`benchmarks.p5_compute`): ``cpu``, the stages
compute on the machine's cores as described above; ``device``, a batch holds its worker for a
known device time per token while the host CPU stays free, as on GPU ranks.

Efficiency: the compute-bound wall time is the larger of the plain bounds
(:func:`benchmarks.p5_accounting.compute_bound`) and the compute-only schedule of
:mod:`benchmarks.p5_schedule` (the run's batches replayed with their compute times only, under the
pipeline's dependencies); the wall time above it is the overhead. Where the machine's CPU went
over the run (``/proc/stat`` and the workers' ``process_time``) is reported with it.

Run: ``python -m benchmarks.p5_pipeline [--systems ...] [--quick] [--compute cpu,device] ...``.
(About 700 lines: one measure per file, runnable alone, as every ``benchmarks/p*.py``.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict

from benchmarks._common import (
    median_round,
    parse_args,
    print_run_comparison,
    run_per_system,
    wait_until_quiet,
    write_result,
)
from benchmarks.p5_accounting import (
    compute_bound,
    compute_lanes,
    cpu_split,
    machine_cpu_seconds,
    parent_pid,
    print_cpu,
    tree_cpu_delta,
    tree_cpu_seconds,
)
from benchmarks.p5_compute import DEFAULT_DEVICE_US_PER_TOKEN, MODES, Compute
from benchmarks.p5_path import describe, overhead_split, trainer_path
from benchmarks.p5_schedule import batch_durations, compute_only_wall
from benchmarks.reference import (
    at_start_line,
    attach,
    hosting_workers,
    preload_modules,
    start_workers,
    startup_seconds,
)
from tq_redis.demo import workload as wl
from tq_redis.demo.main import STAGES
from tq_redis.meta.jagged import jagged_parts, row_views

MEASURE = "p5_pipeline"
UID_STEP = 1_000_000
"""``uid = step * UID_STEP + prompt * n_samples + k``."""
TRAIN_FIELDS = ["prompts", "responses", "old_log_prob", "ref_log_prob", "advantages", "uid"]


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 4, quick 2)")
    parser.add_argument("--batch", type=int, default=None, help="prompts per step (default 16, quick 8)")
    parser.add_argument("--n-samples", type=int, default=4, help="responses per prompt (default %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="rollout worker processes (default %(default)s)")
    parser.add_argument(
        "--stage-batch", type=int, default=None, help="rows per rollout/reward/ref claim (default: --n-samples)"
    )
    parser.add_argument(
        "--micro-batch", type=int, default=16, help="rows per trainer micro-batch (default %(default)s)"
    )
    parser.add_argument("--max-lag", type=int, default=1, help="steps rollout may run ahead (default %(default)s)")
    parser.add_argument(
        "--response-len", default="16,320", help="min,max response tokens (default %(default)s; quick 16,160)"
    )
    parser.add_argument("--prompt-len", default="8,48", help="min,max prompt tokens (default %(default)s)")
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=0.05,
        help="reference: worker sleep after an empty get_meta, s (default %(default)s)",
    )
    parser.add_argument(
        "--wait-s", type=float, default=0.5, help="tq-redis: get_meta(timeout=...) per call, s (default %(default)s)"
    )
    parser.add_argument(
        "--attach-mode", choices=("zmq", "ray"), default="zmq", help="how reference workers attach (see reference.py)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="runs per system, alternating the systems; the median is reported (default 3, quick 1)",
    )
    parser.add_argument(
        "--compute",
        default=",".join(MODES),
        help="comma-separated compute modes, each run on every system: cpu (the stages compute on "
        "this machine's cores) and device (a known device time per token, the host CPU left free; "
        "see benchmarks/p5_compute.py); the first is the headline result (default %(default)s)",
    )
    parser.add_argument(
        "--device-us-per-token",
        type=float,
        default=DEFAULT_DEVICE_US_PER_TOKEN,
        help="device mode: microseconds of device time per token of a cost-1 stage (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up after this long (default %(default)s)")


# ----------------------------------------------------------------------------------------
# Helpers over the demo's workload (tq_redis.demo.workload) and both systems' layouts
# ----------------------------------------------------------------------------------------
def _response_len(cfg: dict[str, Any], uid: int) -> int:
    """The response length of row ``uid`` (deterministic, so the trainer can check it)."""
    return wl.response_length(wl.generator(cfg["seed"], uid, 1), cfg["response_len"])


def _response_lengths(cfg: dict[str, Any]) -> dict[int, int]:
    """Every row's response length, worked out once before the clock starts (drawing one costs a
    generator, ~10 µs, which rollout and the trainer's check would otherwise pay per row)."""
    uids = (s * UID_STEP + i for s in range(cfg["steps"]) for i in range(cfg["samples_per_step"]))
    return {uid: _response_len(cfg, uid) for uid in uids}


def _rows(value: Any) -> list[Any]:
    """Per-sample 1-D tensors of a jagged (or dense 2-D) field. A jagged tensor (what both systems
    return) is cut at its offsets (:func:`tq_redis.meta.jagged.row_views`): its ``unbind()``, ~0.2 ms a
    field, would be charged to both systems as overhead. Torch's own jagged class is recognised
    by its type first: ``.is_nested`` and ``.layout`` go through its ``__torch_function__``."""
    if jagged_parts(value) is not None or (value.is_nested and value.layout == torch.jagged):
        return row_views(value)
    return list(value.unbind())


def _flat(value: Any) -> Any:
    """A per-sample ``[B, 1]`` field as a ``[B]`` tensor (both systems return it nested)."""
    parts = jagged_parts(value)
    if parts is not None and parts.lengths is None:
        return parts.values[int(parts.offsets[0]) : int(parts.offsets[-1])]
    if not value.is_nested:
        return value.reshape(-1)
    return value.values()


def _partition(step: int) -> str:
    return f"p5_step_{step}"


# ----------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------
class _Stopped(Exception):
    """The parent asked every worker to stop (another worker failed, or the run timed out)."""


class _Stage:
    """What one worker process needs: its client, the shared state and its counters."""

    def __init__(self, client: Any, name: str, cfg: dict[str, Any], shared: dict[str, Any], deadline: float) -> None:
        self.client = client
        self.system = name
        self.cfg = cfg
        self.sh = shared
        self.deadline = deadline
        self.busy_s = 0.0
        self.compute_s = 0.0  # the stage's own work (model, rewards, burns; no I/O): CPU s, or device s
        self.compute_cpu_s = 0.0  # the CPU seconds of that work (in device mode, the real work's only)
        self.batches = 0
        self.samples = 0
        self.tokens = 0
        self.get_meta_calls = 0
        self.empty = 0
        self.claim_s = 0.0
        # CPU seconds of the process (every thread: a client may work in its own threads) in the
        # claims and reads (fetch), and in the puts of the stage's outputs (store)
        self.claim_cpu_s = 0.0
        self.put_cpu_s = 0.0
        self.cpu0 = time.process_time()
        self.batch_log: list[tuple[int, float, float]] = []  # (step, wall clock at start, compute s)
        # for the split of the trainer's path (benchmarks.p5_path), wall-clock times:
        self.asked_at: float | None = None  # the first ask for the batch being claimed
        self.claims: list[tuple[int, float, float, list[int]]] = []  # (step, asked, returned, rows)
        self.stored: list[tuple[float, int, list[int]]] = []  # (put returned, step, rows)
        self.compute = Compute(cfg["compute"], cfg["device_us_per_token"])

    def check(self) -> None:
        if self.sh["stop"].is_set() or time.monotonic() > self.deadline:
            raise _Stopped

    def fetch(self, fields: list[str], batch_size: int, step: int, task: str) -> tuple[Any, Any, float] | None:
        """One claim of ``task``'s rows and their data: ``(meta, data, t0)``, ``t0`` taken when
        the claim returned; ``None`` when nothing was ready (after waiting). tq-redis claims and
        reads in one call (``get_meta_and_data``), the reference with ``get_meta`` then ``get_data``."""
        self.check()
        cpu0 = time.process_time()
        try:
            return self._fetch(fields, batch_size, step, task)
        finally:
            self.claim_cpu_s += time.process_time() - cpu0

    def _fetch(self, fields: list[str], batch_size: int, step: int, task: str) -> tuple[Any, Any, float] | None:
        t0 = time.perf_counter()
        if self.asked_at is None:  # empty answers (the reference's polls) count as waiting for this batch
            self.asked_at = time.time()
        data = None
        if self.system == "tq_redis":
            meta, data = self.client.get_meta_and_data(
                fields, batch_size, _partition(step), task_name=task, timeout=self.cfg["wait_s"]
            )
        else:
            meta = self.client.get_meta(fields, batch_size, _partition(step), mode="fetch", task_name=task)
        self.get_meta_calls += 1
        if meta.size == 0:
            self.empty += 1
            if self.system != "tq_redis" and self.cfg["poll_interval"] > 0:
                time.sleep(self.cfg["poll_interval"])
            self.claim_s += time.perf_counter() - t0
            return None
        claimed = time.perf_counter()
        self.claim_s += claimed - t0
        if data is None:
            data = self.client.get_data(meta)
        self.claims.append((step, self.asked_at, time.time(), list(meta.global_indexes)))
        self.asked_at = None
        return meta, data, claimed

    def step_batches(
        self, fields: list[str], batch_size: int, step: int, task: str
    ) -> Iterator[tuple[Any, Any, float]]:
        """Claim ``task``'s micro-batches of ``step`` until this worker has had all of the step's
        samples; yields ``(meta, data, t0)`` as :meth:`fetch` returns them."""
        got = 0
        while got < self.cfg["samples_per_step"]:
            fetched = self.fetch(fields, batch_size, step, task)
            if fetched is None:
                continue
            got += fetched[0].size
            yield fetched

    def store(self, meta: Any, step: int, t0: float, tokens: int, **outputs: Any) -> None:
        """Put ``outputs`` (one row per sample of ``meta``, of ``step``) and count the micro-batch as done."""
        cpu0 = time.process_time()
        self.client.put(TensorDict(outputs, batch_size=[meta.size]), metadata=meta)
        self.put_cpu_s += time.process_time() - cpu0
        self.stored.append((time.time(), step, list(meta.global_indexes)))
        self.done(t0, meta.size, tokens)

    @contextlib.contextmanager
    def computing(self, stage: str, step: int, tokens: int) -> Iterator[None]:
        """Compute one batch of ``stage`` (the block is its real work; see
        :meth:`benchmarks.p5_compute.Compute.batch`), count its compute and log it as one batch of
        ``step`` for the compute-only schedule (:mod:`benchmarks.p5_schedule`)."""
        started, cpu0, spent = time.time(), time.thread_time(), []
        try:
            with self.compute.batch(stage, tokens, spent):
                yield
        finally:
            seconds = spent[0] if spent else 0.0
            self.compute_s += seconds
            self.compute_cpu_s += time.thread_time() - cpu0
            self.batch_log.append((step, started, seconds))

    def done(self, t0: float, n: int, tokens: int) -> None:
        self.busy_s += time.perf_counter() - t0
        self.batches += 1
        self.samples += n
        self.tokens += tokens

    def figures(self) -> dict[str, Any]:
        return {
            "busy_s": self.busy_s,
            "compute_s": self.compute_s,
            "compute_cpu_s": self.compute_cpu_s,
            "device_late_s": self.compute.late_s,
            "batches": self.batches,
            "samples": self.samples,
            "tokens": self.tokens,
            "get_meta_calls": self.get_meta_calls,
            "empty_polls": self.empty,
            "claim_s": self.claim_s,
            "claim_cpu_s": self.claim_cpu_s,
            "put_cpu_s": self.put_cpu_s,
            "cpu_s": time.process_time() - self.cpu0,  # the process's CPU over the stage, every thread
            "batch_log": self.batch_log,
            "claims": self.claims,
            "stored": self.stored,
        }


def _stage_feeder(st: _Stage) -> dict[str, Any]:
    cfg, sh = st.cfg, st.sh
    n = cfg["n_samples"]
    fed: dict[int, list[int]] = {}
    for step in range(cfg["steps"]):
        if step > cfg["max_lag"]:  # one step trained per step fed beyond the lag
            while not sh["step_trained"].acquire(timeout=0.5):
                st.check()
        fed[step] = []
        for first in range(0, cfg["batch"], wl.PROMPTS_PER_PUT):
            st.check()
            t0 = time.perf_counter()
            pids = list(range(first, min(first + wl.PROMPTS_PER_PUT, cfg["batch"])))
            prompts = [wl.prompt(cfg["seed"], step, pid, cfg["prompt_len"]) for pid in pids]
            rows = [p for p in prompts for _ in range(n)]
            uids = [step * UID_STEP + pid * n + k for pid in pids for k in range(n)]
            td = TensorDict(
                {
                    "prompts": wl.jagged(rows),
                    "prompt_id": torch.tensor(pids).repeat_interleave(n).unsqueeze(1),
                    "uid": torch.tensor(uids, dtype=torch.int64).unsqueeze(1),
                },
                batch_size=[len(rows)],
            )
            cpu0 = time.process_time()
            st.client.put(td, partition_id=_partition(step))
            st.put_cpu_s += time.process_time() - cpu0
            fed[step].extend(uids)
            st.done(t0, len(rows), sum(len(p) for p in rows))
    return {"fed": fed}


def _stage_rollout(st: _Stage) -> dict[str, Any]:
    cfg, sh = st.cfg, st.sh
    policy = wl.policy_model(cfg["seed"])
    total = cfg["samples_per_step"]
    rolled = sh["rolled"]
    for step in range(cfg["steps"]):
        while _take_share(rolled, step, total, cfg["stage_batch"]):
            fetched = None
            while fetched is None:
                fetched = st.fetch(["prompts", "uid"], cfg["stage_batch"], step, "rollout")
            meta, data, t0 = fetched
            if meta.size < cfg["stage_batch"]:  # fewer rows than the share: give the rest back
                with rolled.get_lock():
                    rolled[step] -= cfg["stage_batch"] - meta.size
            uids = _flat(data["uid"]).tolist()
            lengths = [cfg["lengths"][uid] for uid in uids]
            responses, logps = [], []
            with st.computing("rollout", step, sum(lengths)):
                for uid, prompt, length in zip(uids, _rows(data["prompts"]), lengths):
                    tokens, logp = st.compute.generate(policy, prompt, length, wl.generator(cfg["seed"], uid, 2))
                    responses.append(tokens)
                    logps.append(logp)
            tokens = sum(lengths)
            st.store(meta, step, t0, tokens, responses=wl.jagged(responses), old_log_prob=wl.jagged(logps))
    return {}


def _take_share(rolled: Any, step: int, total: int, share: int) -> bool:
    """Count ``share`` of ``step``'s rows as this rollout worker's before claiming them; False once
    the workers have taken them all. Counting before claiming keeps a worker from claiming (and, in
    a blocking claim, waiting for) rows another worker has already taken."""
    with rolled.get_lock():
        if rolled[step] >= total:
            return False
        rolled[step] += share
        return True


def _stage_reward(st: _Stage) -> dict[str, Any]:
    cfg = st.cfg
    split_groups = 0
    for step in range(cfg["steps"]):
        for meta, data, t0 in st.step_batches(["prompt_id", "responses", "uid"], cfg["stage_batch"], step, "reward"):
            responses = _rows(data["responses"])
            pids = _flat(data["prompt_id"])
            tokens = sum(len(r) for r in responses)
            with st.computing("reward", step, tokens):
                rewards = wl.rewards(responses)
                advantages = torch.zeros_like(rewards)
                for pid in pids.unique():  # normalised over each prompt's rows in the micro-batch
                    mask = pids == pid
                    if int(mask.sum()) != cfg["n_samples"]:
                        split_groups += 1
                    advantages[mask] = wl.group_advantages(rewards[mask])
            st.store(meta, step, t0, tokens, rewards=rewards.unsqueeze(1), advantages=advantages.unsqueeze(1))
    return {"split_groups": split_groups}


def _stage_ref(st: _Stage) -> dict[str, Any]:
    cfg = st.cfg
    ref = wl.reference_model(cfg["seed"])
    for step in range(cfg["steps"]):
        for meta, data, t0 in st.step_batches(["prompts", "responses"], cfg["stage_batch"], step, "ref"):
            responses = _rows(data["responses"])
            tokens = sum(len(r) for r in responses)
            with st.computing("ref", step, tokens):
                rows = wl.ref_log_probs(ref, _rows(data["prompts"]), responses)
            st.store(meta, step, t0, tokens, ref_log_prob=wl.jagged(rows))
    return {}


def _stage_trainer(st: _Stage) -> dict[str, Any]:
    cfg, sh = st.cfg, st.sh
    learner = wl.GRPOLearner(cfg["seed"])
    trained: dict[int, list[int]] = {}
    step_done_at: list[float] = []
    bad: list[str] = []
    for step in range(cfg["steps"]):
        seen: list[int] = []
        for meta, data, t0 in st.step_batches(TRAIN_FIELDS, cfg["micro_batch"], step, "train"):
            uids = _flat(data["uid"]).tolist()
            seen.extend(uids)
            prompts, responses = _rows(data["prompts"]), _rows(data["responses"])
            sizes = [len(r) for r in responses]
            for uid, size in zip(uids, sizes):
                if size != cfg["lengths"][uid] and len(bad) < 10:
                    bad.append(f"uid {uid}: response of {size} tokens, expected {cfg['lengths'][uid]}")
            old = _rows(data["old_log_prob"])
            ref = _rows(data["ref_log_prob"])
            if [len(x) for x in old] != sizes or [len(x) for x in ref] != sizes:
                bad.append(f"step {step}: log-prob lengths do not match the responses")
            total = sum(len(p) for p in prompts) + sum(sizes)
            with st.computing("trainer", step, total):
                learner.update(prompts, responses, torch.cat(old), torch.cat(ref), _flat(data["advantages"]))
            st.done(t0, meta.size, total)
        st.client.clear_partition(_partition(step))
        trained[step] = seen
        step_done_at.append(time.time())
        sh["trained"].value = step + 1
        sh["step_trained"].release()
    return {"trained": trained, "step_done_at": step_done_at, "bad": bad}


_STAGE_FUNCS = {
    "feeder": _stage_feeder,
    "rollout": _stage_rollout,
    "reward": _stage_reward,
    "ref": _stage_ref,
    "trainer": _stage_trainer,
}


def _warm_up(client: Any) -> None:
    """First calls pay for lazy imports, store connections and kernel set-up; make each kind of
    call the stages make (put, a claim, get_data, clear_partition) once, on a scratch partition of
    this process, before the clock starts. A long training job pays these once, not per step."""
    wl.warm_up()
    partition = f"p5_warmup_{os.getpid()}"
    prompts = wl.jagged([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    td = TensorDict({"prompts": prompts, "uid": torch.tensor([[0], [1]])}, batch_size=[2])
    client.put(td, partition_id=partition)
    meta = client.get_meta(["prompts", "uid"], 2, partition, mode="fetch", task_name="warmup")
    if meta.size:
        client.get_data(meta)
    if hasattr(client, "get_meta_and_data"):  # tq-redis: the call its stages claim with
        client.get_meta_and_data(["prompts", "uid"], 2, partition, task_name="warmup_combined")
    client.clear_partition(partition)


def _worker(stage: str, wid: int, name: str, spec: dict[str, Any], cfg: dict[str, Any], shared: dict[str, Any]) -> None:
    """Body of one worker process: attach, warm up, wait at the barrier, run the stage, report."""
    report: dict[str, Any] = {"stage": stage, "wid": wid, "pid": os.getpid()}
    client = close = None
    st: _Stage | None = None
    try:
        torch.set_num_threads(1)
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # a once-per-process notice
        client, close = attach(name, spec, attach_mode=cfg["attach_mode"])
        _warm_up(client)
        at_start_line(shared["barrier"], cfg["barrier_timeout_s"])
        st = _Stage(client, name, cfg, shared, time.monotonic() + cfg["timeout_s"])
        report.update(_STAGE_FUNCS[stage](st))
        report["finished_at"] = time.time()
    except _Stopped:
        report["stopped"] = True
    except Exception as exc:  # noqa: BLE001 - sent to the parent, which reports it
        report["error"] = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, threading.BrokenBarrierError):
            report["error"] = "barrier broken (another worker failed to attach in time)"
        else:
            report["traceback"] = traceback.format_exc()
            shared["barrier"].abort()  # release the others if this one never reached the barrier
    finally:
        if st is not None:
            report.update(st.figures())
        shared["results"].put(report)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - the figures are already sent
                pass


# ----------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------
def measure_system(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the pipeline against system ``name``; return its figures and the correctness check."""
    with hosting_workers(name, num_storage_units=2, polling_mode=True) as (spec, ctx, procs):
        roles = [("feeder", 0)] + [("rollout", i) for i in range(cfg["workers"])]
        roles += [("reward", 0), ("ref", 0), ("trainer", 0)]
        shared = {
            "barrier": ctx.Barrier(len(roles) + 1),
            "stop": ctx.Event(),
            "trained": ctx.Value("i", 0, lock=False),  # steps trained: written by the trainer only
            # released once per step trained: the trainer never waits for the feeder to be scheduled
            # (a Condition's notify blocks until every waiter has woken up)
            "step_trained": ctx.Semaphore(0),
            "rolled": ctx.Array("i", cfg["steps"]),
            "results": ctx.Queue(),
        }
        jobs = [(f"p5-{name}-{stage}-{wid}", (stage, wid, name, spec, cfg, shared)) for stage, wid in roles]
        started = start_workers(
            ctx, procs, _worker, jobs, shared["barrier"], cfg["barrier_timeout_s"], wait_until_quiet
        )
        start_wall, attach_all_s = started.wall, started.attach_s
        # the workers and the forkserver they came from are not the system's servers
        workers = [p.pid for p in procs] + [parent_pid(p.pid) for p in procs]
        cpu_before, servers_before = machine_cpu_seconds(), tree_cpu_seconds(os.getpid(), workers)
        print(f"[{name}] {len(roles)} workers attached and warmed up in {attach_all_s:.1f} s; running...", flush=True)
        reports = _collect(shared, procs, len(roles), cfg["timeout_s"] + 60, name)
        cpu_after, servers_after = machine_cpu_seconds(), tree_cpu_seconds(os.getpid(), workers)
        result = _summarize(name, cfg, reports, start_wall, attach_all_s)
        servers_s = tree_cpu_delta(servers_before, servers_after)
        result["cpu"] = cpu_split(result, cpu_before, cpu_after, time.time() - start_wall, servers_s)
        result["quiet_before_run"] = started.settled
        print_cpu(name, result["cpu"])
        return result


def _collect(shared: dict[str, Any], procs: list[Any], n_workers: int, timeout_s: float, name: str) -> list[dict]:
    """Gather one report per worker; on the first error, tell the others to stop."""
    reports: list[dict[str, Any]] = []
    end = time.monotonic() + timeout_s
    next_note = time.monotonic() + 10
    while len(reports) < n_workers and time.monotonic() < end:
        try:
            report = shared["results"].get(timeout=1.0)
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs):
                break
        else:
            reports.append(report)
            if "error" in report:
                shared["stop"].set()
        if time.monotonic() > next_note:
            print(f"[{name}]   steps trained {shared['trained'].value}", flush=True)
            next_note = time.monotonic() + 10
    shared["stop"].set()
    return reports


def _summarize(
    name: str, cfg: dict[str, Any], reports: list[dict[str, Any]], start_wall: float, attach_all_s: float
) -> dict[str, Any]:
    """Turn worker reports into steps/s, per-stage figures and the exactly-once check."""
    errors = [f"{r['stage']} {r['wid']}: {r['error']}" for r in reports if "error" in r]
    for r in reports:
        if "traceback" in r:
            print(f"[{name}] {r['stage']} {r['wid']} failed:\n{r['traceback']}", file=sys.stderr, flush=True)
    by_stage = {s: [r for r in reports if r["stage"] == s] for s in STAGES}
    feeder = next(iter(by_stage["feeder"]), {})
    trainer = next(iter(by_stage["trainer"]), {})
    fed = collections.Counter(u for uids in feeder.get("fed", {}).values() for u in uids)
    trained = collections.Counter(u for uids in trainer.get("trained", {}).values() for u in uids)
    expected = {s * UID_STEP + i for s in range(cfg["steps"]) for i in range(cfg["samples_per_step"])}
    duplicates = sum(c - 1 for c in trained.values() if c > 1)
    missing = len(expected - set(trained))
    unexpected = len(set(trained) - expected)
    done_at = trainer.get("step_done_at", [])
    steps_done = len(done_at)
    wall = (done_at[-1] - start_wall) if done_at else None
    exactly_once = (
        steps_done == cfg["steps"]
        and duplicates == 0
        and missing == 0
        and unexpected == 0
        and set(fed) == expected
        and not trainer.get("bad")
    )
    stages: dict[str, dict[str, Any]] = {}
    for stage, rs in by_stage.items():
        keys = (
            "busy_s", "compute_s", "compute_cpu_s", "cpu_s", "batches", "samples", "tokens", "get_meta_calls",
            "empty_polls", "claim_s", "device_late_s", "claim_cpu_s", "put_cpu_s",
        )  # fmt: skip
        stages[stage] = {"workers": len(rs), **{k: sum(r.get(k, 0) for r in rs) for k in keys}}
    tokens = stages["rollout"]["tokens"]
    lanes = compute_lanes(cfg)
    plain_bound = compute_bound(stages, lanes)
    scheduled = None
    if steps_done == cfg["steps"]:
        logs = {
            s: batch_durations((e for r in rs for e in r.get("batch_log", [])), cfg["steps"])
            for s, rs in by_stage.items()
        }
        try:
            scheduled = compute_only_wall(logs, cfg, cfg["workers"], lanes)
        except RuntimeError as exc:  # a batch log the replay cannot follow: keep the run's other figures
            print(f"[{name}] compute-only schedule not available: {exc}", flush=True)
    bound = max(plain_bound, scheduled or 0.0)
    path = split = None
    # device mode only: there a batch's compute is wall time on the trainer's path; on shared cores
    # (cpu) its wall time is longer than the CPU seconds the bound counts, by however long the
    # worker waited for a core, and the path could not tell that apart from the time between batches
    if wall and steps_done == cfg["steps"] and cfg["compute"] == "device":
        batches = [
            (step, asked, returned, started, seconds, rows)
            for (step, asked, returned, rows), (_, started, seconds) in zip(
                trainer.get("claims", []), trainer.get("batch_log", [])
            )
        ]
        stored = (e for s in ("rollout", "reward", "ref") for r in by_stage[s] for e in r.get("stored", []))
        path = trainer_path(batches, stored, start_wall, done_at[-1])
        split = overhead_split(path, bound)
    result = {
        "steps": steps_done,
        "wall_s": wall,
        "steps_per_s": steps_done / wall if wall else None,
        "samples_per_s": len(trained) / wall if wall else None,
        "rollout_tokens": tokens,
        "step_s": [b - a for a, b in zip([start_wall, *done_at[:-1]], done_at)],
        "fed": sum(fed.values()),
        "trained": sum(trained.values()),
        "trained_distinct": len(trained),
        "duplicates": duplicates,
        "missing": missing,
        "unexpected": unexpected,
        "exactly_once": exactly_once,
        "data_errors": trainer.get("bad", []),
        "reward_split_groups": sum(r.get("split_groups", 0) for r in by_stage["reward"]),
        "stages": stages,
        "busy_sum_s": sum(s["busy_s"] for s in stages.values()),
        "compute_bound_s": bound,
        "plain_bound_s": plain_bound,
        "compute_only_schedule_s": scheduled,
        "overhead_s": (wall - bound) if wall else None,
        "overhead_pct_of_bound": 100.0 * (wall - bound) / bound if wall and bound else None,
        "trainer_path": path,
        "overhead_split": split,
        "attach_all_s": attach_all_s,
        "workers_reported": len(reports),
        "errors": errors,
        "startup_s": startup_seconds(name),
    }
    print(
        f"[{name}] {steps_done}/{cfg['steps']} steps in {wall if wall is None else round(wall, 2)} s -> "
        f"{result['steps_per_s'] or 0:.3f} steps/s; trained {result['trained']} "
        f"({result['trained_distinct']} distinct of {len(expected)}, {duplicates} duplicates, {missing} missing); "
        f"exactly once: {exactly_once}",
        flush=True,
    )
    if wall and bound:
        print(
            f"[{name}] compute-bound wall time {bound:.2f} s (compute-only schedule "
            f"{scheduled or 0:.2f} s, plain bound {plain_bound:.2f} s) -> overhead {wall - bound:.2f} s "
            f"({result['overhead_pct_of_bound']:.0f}% of the bound)",
            flush=True,
        )
    if path and split:
        print(f"[{name}] overhead along the trainer's path: {describe(split, path)}", flush=True)
    for stage, s in stages.items():
        print(
            f"[{name}]   {stage:8s} busy {s['busy_s']:6.2f} s "
            f"(compute {s['compute_s']:6.2f} s, CPU {s['cpu_s']:6.2f} s: claims {s['claim_cpu_s']:5.3f}, "
            f"puts {s['put_cpu_s']:5.3f}), {s['batches']:4d} batches, "
            f"{s['get_meta_calls']:5d} get_meta ({s['empty_polls']} empty)",
            flush=True,
        )
    if errors:
        print(f"[{name}] {len(errors)} worker error(s): {errors[:3]}", flush=True)
    return result


def _measure_in(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return measure_system(name, cfg)


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median steps/s (:func:`benchmarks._common.median_round`); exactly-once
    holds only if it held in every round. All failed: the first error."""
    median = median_round(runs, "steps_per_s")
    if median is None:
        return runs[0]
    median["exactly_once"] = median["rounds_failed"] == 0 and all(r.get("exactly_once") for r in runs)
    return median


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise SystemExit(f"--compute takes a comma-separated list of {', '.join(MODES)}; got {text!r}")
    return modes


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def main() -> dict[str, Any]:
    """Measure every requested system; print and write the result."""
    args = parse_args(__doc__.splitlines()[0], _add_args)
    cfg: dict[str, Any] = {
        "steps": args.steps or (2 if args.quick else 4),
        "batch": args.batch or (8 if args.quick else 16),
        "n_samples": args.n_samples,
        "workers": args.workers,
        "stage_batch": args.stage_batch or args.n_samples,
        "micro_batch": args.micro_batch,
        "max_lag": args.max_lag,
        "prompt_len": _pair(args.prompt_len),
        "response_len": (16, 160) if args.quick and args.response_len == "16,320" else _pair(args.response_len),
        "poll_interval": args.poll_interval,
        "wait_s": args.wait_s,
        "attach_mode": args.attach_mode,
        "compute": "cpu",  # set per run from --compute
        "compute_modes": _modes(args.compute),
        "device_us_per_token": args.device_us_per_token,
        "seed": args.seed,
        "timeout_s": args.timeout_s,
        "barrier_timeout_s": 300.0,
        "prompts_per_put": wl.PROMPTS_PER_PUT,
        "stage_costs_per_token": wl.STAGE_COST,
        "process_model": "separate processes (forkserver), each attached to the running system",
    }
    cfg["samples_per_step"] = cfg["batch"] * cfg["n_samples"]
    cfg["lengths"] = _response_lengths(cfg)
    for key in ("stage_batch", "micro_batch"):
        if cfg["samples_per_step"] % cfg[key]:
            raise SystemExit(f"--{key.replace('_', '-')} must divide batch x n-samples ({cfg['samples_per_step']})")
    modules = sorted({m for s in args.systems for m in preload_modules(s)})
    mp.set_forkserver_preload(modules)
    print(
        f"P5: {cfg['steps']} steps x {cfg['batch']} prompts x {cfg['n_samples']} samples, {cfg['workers']} rollout "
        f"workers, stage batch {cfg['stage_batch']}, trainer micro-batch {cfg['micro_batch']}, "
        f"responses {cfg['response_len'][0]}-{cfg['response_len'][1]} tokens",
        flush=True,
    )
    rounds = args.rounds or (1 if args.quick else 3)
    cfg["rounds"] = rounds
    modes = cfg["compute_modes"]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(m, name): [] for m in modes for name in args.systems}
    for k in range(rounds):
        for mode in modes:
            print(f"=== round {k + 1}/{rounds}, {mode} compute ===", flush=True)
            run_cfg = {**cfg, "compute": mode}
            # one short pipeline run moves with the machine's load: alternate the systems, keep the median
            measure = functools.partial(_measure_in, run_cfg)
            for name, res in run_per_system(args.systems, measure).items():
                runs[(mode, name)].append({**res, "compute": mode})
    results = {}
    for name in args.systems:  # the first mode's figures at the top, the others under "other_modes"
        results[name] = _median_run(runs[(modes[0], name)])
        results[name]["other_modes"] = {m: _median_run(runs[(m, name)]) for m in modes[1:]}
    for mode in modes[1:]:
        print(f"\n{mode} compute:", flush=True)
        for name in args.systems:
            res = results[name]["other_modes"][mode]
            print(f"  {name}: {res.get('steps_per_s') or 0:.3f} steps/s, overhead "
                  f"{res.get('overhead_pct_of_bound') or 0:.0f}% of the bound", flush=True)

    title = "P5 demo-shaped pipeline (steps/s higher is better; wall s lower is better)"
    print_run_comparison(title, results, ("steps/s", "steps_per_s"), ("exactly once", "exactly_once"))
    write_result(MEASURE, args, {k: v for k, v in cfg.items() if k != "lengths"}, results, args.out)
    return results


if __name__ == "__main__":
    main()
